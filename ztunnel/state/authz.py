"""L4 authorization: decide whether a connection may reach a workload, and explain why.

Pure functions, no I/O. Semantics follow istio/ztunnel ``src/rbac.rs`` (``Authorization::matches``)
and ``src/state.rs`` (``assert_rbac``, including the dry-run handling):

* rules are OR-ed, a rule's clauses AND-ed, a clause's matches OR-ed; inside one match the field
  kinds are AND-ed and the values of one kind OR-ed; a negative list holds when none of its values
  match;
* an empty match is *skipped*: it never makes its clause true, so a clause made only of empty
  matches is false, while a clause with no matches at all is true; a policy with no rules never
  matches;
* principals are compared without ``spiffe://``; with no source identity every principal test
  fails (so ``principals`` fails and ``notPrincipals`` holds); the namespace of a missing identity
  is ``""`` and is compared like any other string; service accounts compare ``(namespace, sa)``
  and never match a missing identity;
* decision: a matching enforced DENY denies; else with no enforced ALLOW the connection is
  allowed; else it is allowed only if some enforced ALLOW matches. Dry-run policies are evaluated
  and reported (with the decision they would produce if enforced) and never change the outcome.

Hot path: each policy is compiled into one generated function (IPs as tagged integers, string
matches as sets/tuples, empty matches and clauses folded away). :class:`PolicyIndex` compiles
policies lazily and caches, per ``(namespace, authorization_policies)``, the applicable ones
already split into enforced DENY / enforced ALLOW / dry-run. Evaluating a connection costs only
the applicable policies and allocates nothing when no dry-run policy applies.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ztunnel.core.addr import IPAddr, IPNet, canonical_ip, parse_ip
from ztunnel.core.identity import SPIFFE_PREFIX, Identity
from ztunnel.state.model import (
    Authorization,
    Match,
    PolicyAction,
    PolicyScope,
    Rule,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    Workload,
)
from ztunnel.state.store import ChangeKind, State, StateChange

__all__ = [
    "NOT_ALLOWED",
    "NO_ALLOW_POLICIES",
    "AppliesVia",
    "ClauseTrace",
    "CompiledPolicy",
    "ConditionTrace",
    "Connection",
    "Decision",
    "DryRunOutcome",
    "Explanation",
    "MatchTrace",
    "PolicyIndex",
    "PolicySet",
    "PolicyTrace",
    "RuleTrace",
    "compile_policy",
    "decision_log",
    "evaluate",
    "explain",
]

# The Rust rejection texts (proxy.rs AuthorizationRejectionError), so access logs read the same.
NOT_ALLOWED: Final = "allow policies exist, but none allowed"
NO_ALLOW_POLICIES: Final = "no allow policies"


def _denied_by(key: str) -> str:
    return f"explicitly denied by: {key}"


def _allowed_by(key: str) -> str:
    return f"allowed by: {key}"


# IPs and networks as plain ints so a CIDR test is one AND and one compare. A family tag above
# bit 128 keeps IPv4 and IPv6 apart: a v6 key never carries the v4 tag a v4 mask keeps.
_TAG4: Final = 1 << 128
_TAG6: Final = 1 << 129


def _ip_key(ip: IPAddr) -> int:
    return int(ip) | (_TAG4 if ip.version == 4 else _TAG6)


# Every live inbound connection keeps its Connection (for policy re-checks): the derived values
# are shared between connections from the same peer instead of rebuilt (~300 bytes) for each.
_cached_ip_key = functools.lru_cache(maxsize=4096)(_ip_key)


@functools.lru_cache(maxsize=4096)
def _identity_parts(ident: Identity) -> tuple[str, str, tuple[str, str]]:
    """``principal``, ``src_namespace`` and ``src_sa`` of a Connection from ``ident``."""
    return ident.principal, ident.namespace, (ident.namespace, ident.service_account)


def _net_key(net: IPNet) -> tuple[int, int]:
    tag = _TAG4 if net.version == 4 else _TAG6
    return int(net.network_address) | tag, int(net.netmask) | tag


# --- the connection ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connection:
    """What authorization sees of a connection (Rust ``rbac::Connection``).

    ``dst_port`` is the port after target-port resolution (the port the workload listens on).
    ``src_identity`` is None for plaintext. ``dst_network`` is carried for logging only: policies
    apply regardless of network, as in Rust. IPs are canonicalised (IPv4-mapped IPv6 -> IPv4).
    The remaining fields are derived once here so evaluation does no per-policy work on them.
    """

    src_ip: IPAddr
    src_identity: Identity | None
    dst_ip: IPAddr
    dst_port: int
    dst_network: str = ""
    src_key: int = field(init=False, repr=False, compare=False)
    dst_key: int = field(init=False, repr=False, compare=False)
    principal: str | None = field(init=False, repr=False, compare=False)
    src_namespace: str = field(init=False, repr=False, compare=False)
    src_sa: tuple[str, str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        src = canonical_ip(self.src_ip)
        dst = canonical_ip(self.dst_ip)
        ident = self.src_identity
        set_ = object.__setattr__
        set_(self, "src_ip", src)
        set_(self, "dst_ip", dst)
        set_(self, "src_key", _cached_ip_key(src))
        set_(self, "dst_key", _cached_ip_key(dst))
        if ident is None:
            set_(self, "principal", None)
            set_(self, "src_namespace", "")
            set_(self, "src_sa", None)
        else:
            principal, namespace, sa = _identity_parts(ident)
            set_(self, "principal", principal)
            set_(self, "src_namespace", namespace)
            set_(self, "src_sa", sa)

    def __str__(self) -> str:
        ident = str(self.src_identity) if self.src_identity is not None else "None"
        return f"{self.src_ip}({ident})->{_hostport(self.dst_ip, self.dst_port)}"


def _hostport(ip: IPAddr, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


# --- compiled policies ------------------------------------------------------------------------
#
# Each policy becomes one generated Python function ``_m(c) -> bool``: the rule/clause/match
# structure as a single boolean expression (rules ``or``, clauses ``and``, matches ``or``, fields
# ``and``), with the connection fields it reads loaded once into locals. One call per policy and
# no per-test function calls: several times faster than walking the structure. Only generated
# identifiers and operators go into the source; every policy value (string, port, network, set)
# is passed in as a parameter default, so policy data can never become code.
# Empty matches and empty clauses are folded away here (see the module docstring).

_Matcher = Callable[[Connection], bool]

# Local name -> the Connection field it holds.
_FIELDS: Final = {
    "p": "dst_port",
    "dk": "dst_key",
    "sk": "src_key",
    "sa": "src_sa",
    "ns": "src_namespace",
    "pr": "principal",
}


def _always_false(c: Connection) -> bool:
    return False


def _always_true(c: Connection) -> bool:
    return True


class _Gen:
    """Builds the expression for one policy."""

    def __init__(self) -> None:
        self.consts: dict[str, object] = {}
        self._names: dict[tuple[type, object], str] = {}
        self.used: set[str] = set()

    def const(self, value: object) -> str:
        """A global name bound to ``value`` (equal values share one name). Every value goes
        through here, integers too, so the source depends only on the policy's shape and
        policies of the same shape share one compiled code object."""
        k = (type(value), value)
        name = self._names.get(k)
        if name is None:
            name = self._names[k] = f"_k{len(self.consts)}"
            self.consts[name] = value
        return name

    def var(self, name: str) -> str:
        self.used.add(name)
        return name

    def ports(self, ports: Sequence[int], negative: bool) -> str:
        p = self.var("p")
        if len(ports) == 1:
            return f"{p} {'!=' if negative else '=='} {self.const(int(ports[0]))}"
        return (
            f"{p} {'not in' if negative else 'in'} {self.const(frozenset(int(x) for x in ports))}"
        )

    def nets(self, nets: Sequence[IPNet], negative: bool, var: str) -> str:
        k = self.var(var)
        tests = []
        for n in nets:
            net_key, mask = _net_key(n)
            tests.append(f"({k} & {self.const(mask)}) == {self.const(net_key)}")
        expr = tests[0] if len(tests) == 1 else "(" + " or ".join(tests) + ")"
        return f"not {expr}" if negative else expr

    def sas(self, sas: Sequence[ServiceAccountMatch], negative: bool) -> str:
        s = self.const(frozenset((m.namespace, m.service_account) for m in sas))
        return f"{self.var('sa')} {'not in' if negative else 'in'} {s}"

    def strings(self, sms: Sequence[StringMatch], v: str) -> str:
        """True when any of ``sms`` matches the string in local ``v`` (StringMatch.matches)."""
        exact = frozenset(m.value for m in sms if m.kind is StringMatchKind.EXACT)
        pre = tuple(m.value for m in sms if m.kind is StringMatchKind.PREFIX)
        suf = tuple(m.value for m in sms if m.kind is StringMatchKind.SUFFIX)
        if any(m.kind is StringMatchKind.PRESENCE for m in sms):
            # Presence takes every string but "", which an exact/prefix/suffix "" also takes.
            return "True" if "" in exact or "" in pre or "" in suf else f'{v} != ""'
        parts = []
        if len(exact) == 1:
            parts.append(f"{v} == {self.const(next(iter(exact)))}")
        elif exact:
            parts.append(f"{v} in {self.const(exact)}")
        if pre:
            parts.append(f"{v}.startswith({self.const(pre)})")
        if suf:
            parts.append(f"{v}.endswith({self.const(suf)})")
        return parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"

    def namespaces(self, sms: Sequence[StringMatch], negative: bool) -> str:
        t = self.strings(sms, self.var("ns"))
        return f"not {t}" if negative else t

    def principals(self, sms: Sequence[StringMatch], negative: bool) -> str:
        # No identity: every principal test fails (Rust strips "spiffe://" from "" and fails).
        pr = self.var("pr")
        t = self.strings(sms, pr)
        if negative:
            return f"({pr} is None or not {t})"
        return f"({pr} is not None and {t})"

    def match(self, m: Match) -> str | None:
        """The AND of every non-empty field, cheapest first (all tests are pure, so the order
        cannot change the result); None for an empty match."""
        tests: list[str] = []
        if m.destination_ports:
            tests.append(self.ports(m.destination_ports, False))
        if m.not_destination_ports:
            tests.append(self.ports(m.not_destination_ports, True))
        if m.destination_ips:
            tests.append(self.nets(m.destination_ips, False, "dk"))
        if m.not_destination_ips:
            tests.append(self.nets(m.not_destination_ips, True, "dk"))
        if m.source_ips:
            tests.append(self.nets(m.source_ips, False, "sk"))
        if m.not_source_ips:
            tests.append(self.nets(m.not_source_ips, True, "sk"))
        if m.service_accounts:
            tests.append(self.sas(m.service_accounts, False))
        if m.not_service_accounts:
            tests.append(self.sas(m.not_service_accounts, True))
        if m.namespaces:
            tests.append(self.namespaces(m.namespaces, False))
        if m.not_namespaces:
            tests.append(self.namespaces(m.not_namespaces, True))
        if m.principals:
            tests.append(self.principals(m.principals, False))
        if m.not_principals:
            tests.append(self.principals(m.not_principals, True))
        if not tests:
            return None
        return tests[0] if len(tests) == 1 else "(" + " and ".join(tests) + ")"

    def rules(self, rules: Sequence[Rule]) -> str | bool:
        """The policy expression, or a constant when the structure alone decides."""
        rule_exprs: list[str] = []
        for rule in rules:
            clause_exprs: list[str] = []
            dead = False
            for clause in rule.clauses:
                if not clause.matches:
                    continue  # an empty clause is true: it adds nothing to the AND
                live = [e for e in (self.match(m) for m in clause.matches) if e is not None]
                if not live:
                    dead = True  # every match was empty (skipped): the clause, so the rule, fails
                    break
                clause_exprs.append(live[0] if len(live) == 1 else "(" + " or ".join(live) + ")")
            if dead:
                continue
            if not clause_exprs:
                return True  # a rule with nothing to check matches every connection
            rule_exprs.append(
                clause_exprs[0]
                if len(clause_exprs) == 1
                else "(" + " and ".join(clause_exprs) + ")"
            )
        if not rule_exprs:
            return False  # no rules, or none that can ever match
        return " or ".join(rule_exprs)


def _compile_matcher(policy: Authorization) -> _Matcher:
    gen = _Gen()
    expr = gen.rules(policy.rules)
    if expr is True:
        return _always_true
    if expr is False:
        return _always_false
    prologue = "".join(f"    {v} = c.{f}\n" for v, f in _FIELDS.items() if v in gen.used)
    params = "".join(f", {name}" for name in gen.consts)
    code = _code_for(f"def _m(c{params}):\n{prologue}    return {expr}\n")
    # The constants are the function's defaults (fast locals): policies of one shape share the
    # code object, and neither per-function globals nor the adaptive interpreter's global
    # caches (which live in the shared code) come into play.
    fn: _Matcher = types.FunctionType(code, _NO_GLOBALS, "_m", tuple(gen.consts.values()))
    return fn


_NO_GLOBALS: Final[dict[str, Any]] = {"__builtins__": {}}


@functools.lru_cache(maxsize=4096)
def _code_for(src: str) -> types.CodeType:
    """The code object of the one function ``src`` defines; cached by source, so policies of
    the same shape (the common case: istiod generates them from a few templates) compile once."""
    module = compile(src, "<authz policy>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


class CompiledPolicy:
    """An :class:`Authorization` ready for per-connection evaluation. ``policy`` is the source."""

    __slots__ = ("_match", "action", "decision", "dry_run", "key", "policy", "scope")

    def __init__(self, policy: Authorization) -> None:
        self.policy: Final = policy
        self.key: Final = policy.key
        self.action: Final = policy.action
        self.scope: Final = policy.scope
        self.dry_run: Final = policy.dry_run
        self._match: Final = _compile_matcher(policy)
        # The decision this policy produces when it decides (built once, shared by every call).
        deny = policy.action is PolicyAction.DENY
        self.decision: Final = Decision(
            allowed=not deny,
            policy=self.key,
            reason=_denied_by(self.key) if deny else _allowed_by(self.key),
        )

    def matches(self, conn: Connection) -> bool:
        return self._match(conn)

    def __repr__(self) -> str:
        return f"CompiledPolicy({self.key!r}, {self.action.name}, dry_run={self.dry_run})"


def compile_policy(policy: Authorization) -> CompiledPolicy:
    return CompiledPolicy(policy)


# --- decisions --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DryRunOutcome:
    """A dry-run policy and whether it matched the connection."""

    policy: str
    action: PolicyAction
    matched: bool


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome for one connection.

    ``policy`` is the key of the deciding policy (None when no policy decided: no ALLOW policy
    applied, or ALLOW policies applied and none matched). ``reason`` is the Rust rejection text
    on a deny. ``dry_run`` lists every applicable dry-run policy and whether it matched;
    ``would_allow`` / ``would_policy`` / ``would_reason`` give the decision if those dry-run
    policies were enforced (None / None / "" when no dry-run policy applies).
    """

    allowed: bool
    policy: str | None
    reason: str
    dry_run: tuple[DryRunOutcome, ...] = ()
    would_allow: bool | None = None
    would_policy: str | None = None
    would_reason: str = ""

    @property
    def dry_run_differs(self) -> bool:
        """True when enforcing the dry-run policies would flip the decision (worth an INFO log)."""
        return self.would_allow is not None and self.would_allow != self.allowed

    def dry_run_summary(self) -> str | None:
        """``"would deny: <reason>"`` / ``"would allow: <reason>"`` for logs; None without
        dry-run policies."""
        if self.would_allow is None:
            return None
        verb = "would allow" if self.would_allow else "would deny"
        return f"{verb}: {self.would_reason}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "allowed": self.allowed,
            "policy": self.policy,
            "reason": self.reason,
        }
        if self.would_allow is not None:
            out["dryRun"] = {
                "policies": [
                    {"policy": o.policy, "action": o.action.name, "matched": o.matched}
                    for o in self.dry_run
                ],
                "wouldAllow": self.would_allow,
                "wouldPolicy": self.would_policy,
                "wouldReason": self.would_reason,
            }
        return out


# --- decision logs ------------------------------------------------------------------------------

# The messages of Rust's ``assert_rbac`` (``src/state.rs``, ``authpol_log!``), logged with the
# deciding policy's key as ``policy`` where there is one.
DRY_RUN_DENY_MATCH: Final = "dry-run: deny policy match"
DENY_MATCH: Final = "deny policy match"
DRY_RUN_ALLOW_MATCH: Final = "dry-run: allow policy match"
DRY_RUN_NO_ALLOW_MATCH: Final = "dry-run: no allow policies match"
NO_ALLOW_POLICIES_ALLOW: Final = "no allow policies, allow"
ALLOW_MATCH: Final = "allow policy match"
NO_ALLOW_MATCHED: Final = "no allow policies matched"


def decision_log(d: Decision) -> list[tuple[str, str | None]]:
    """The lines Rust's ``assert_rbac`` logs for decision ``d``, in its order: (message,
    policy key or None). Pure: the caller checks its logger's level once, then logs these.

    Dry-run DENYs that match come first; an enforced DENY that matches ends it; then the
    dry-run ALLOWs that match; with no enforced ALLOW, "dry-run: no allow policies match"
    when dry-run ALLOWs exist and none matched, and "no allow policies, allow"; else the
    enforced ALLOW that matched, or "no allow policies matched"."""
    out: list[tuple[str, str | None]] = [
        (DRY_RUN_DENY_MATCH, o.policy)
        for o in d.dry_run
        if o.matched and o.action is PolicyAction.DENY
    ]
    if not d.allowed and d.policy is not None:
        out.append((DENY_MATCH, d.policy))
        return out
    dry_allows = [o for o in d.dry_run if o.action is PolicyAction.ALLOW]
    out += [(DRY_RUN_ALLOW_MATCH, o.policy) for o in dry_allows if o.matched]
    if d.allowed and d.policy is None:  # no enforced ALLOW applies
        if dry_allows and not any(o.matched for o in dry_allows):
            out.append((DRY_RUN_NO_ALLOW_MATCH, None))
        out.append((NO_ALLOW_POLICIES_ALLOW, None))
    elif d.allowed:
        out.append((ALLOW_MATCH, d.policy))
    else:
        out.append((NO_ALLOW_MATCHED, None))
    return out


_ALLOW_NO_POLICIES: Final = Decision(True, None, NO_ALLOW_POLICIES)
_DENY_NONE_ALLOWED: Final = Decision(False, None, NOT_ALLOWED)


class PolicySet:
    """The policies that apply to one destination, in applicability order (namespace, global,
    workload-selected; each once), pre-split by how the decision uses them."""

    __slots__ = ("allow", "deny", "dry_run", "policies")

    def __init__(self, policies: Iterable[CompiledPolicy]) -> None:
        self.policies: Final = tuple(policies)
        self.deny: Final = tuple(
            p for p in self.policies if not p.dry_run and p.action is PolicyAction.DENY
        )
        self.allow: Final = tuple(
            p for p in self.policies if not p.dry_run and p.action is PolicyAction.ALLOW
        )
        self.dry_run: Final = tuple(p for p in self.policies if p.dry_run)

    def __iter__(self) -> Iterator[CompiledPolicy]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    def evaluate(self, conn: Connection) -> Decision:
        """The decision for ``conn`` (see the module docstring for the order)."""
        d: Decision
        for p in self.deny:
            if p._match(conn):
                d = p.decision
                break
        else:
            if not self.allow:
                d = _ALLOW_NO_POLICIES
            else:
                for p in self.allow:
                    if p._match(conn):
                        d = p.decision
                        break
                else:
                    d = _DENY_NONE_ALLOWED
        if not self.dry_run:
            return d
        return self._with_dry_run(d, conn)

    def _with_dry_run(self, d: Decision, conn: Connection) -> Decision:
        outcomes = tuple(DryRunOutcome(p.key, p.action, p._match(conn)) for p in self.dry_run)
        # The decision if every dry-run policy were enforced. The enforced policies' own results
        # are already known from ``d``: a matching enforced DENY stays decisive; an enforced
        # ALLOW that decided stays a match.
        dry_deny = next(
            (o.policy for o in outcomes if o.matched and o.action is PolicyAction.DENY), None
        )
        would: tuple[bool, str | None, str]
        if not d.allowed and d.policy is not None:  # an enforced DENY matched
            would = (False, d.policy, d.reason)
        elif dry_deny is not None:
            would = (False, dry_deny, _denied_by(dry_deny))
        elif d.allowed and d.policy is not None:  # an enforced ALLOW matched
            would = (True, d.policy, d.reason)
        else:
            dry_allows = [o for o in outcomes if o.action is PolicyAction.ALLOW]
            hit = next((o.policy for o in dry_allows if o.matched), None)
            if hit is not None:
                would = (True, hit, _allowed_by(hit))
            elif self.allow or dry_allows:
                would = (False, None, NOT_ALLOWED)
            else:
                would = (True, None, NO_ALLOW_POLICIES)
        return Decision(d.allowed, d.policy, d.reason, outcomes, *would)


def evaluate(
    policies: PolicySet | Iterable[Authorization | CompiledPolicy], conn: Connection
) -> Decision:
    """Decide ``conn`` against the policies that apply to its destination.

    Pass a :class:`PolicySet` (from :meth:`PolicyIndex.policies_for`) on the hot path. Plain
    :class:`Authorization` objects are compiled on first sight and remembered by identity (the
    State hands out the same objects until they change), so ``evaluate(state.policies_for(w),
    conn)`` is correct and only moderately slower.
    """
    if not isinstance(policies, PolicySet):
        policies = PolicySet(p if isinstance(p, CompiledPolicy) else _memo(p) for p in policies)
    return policies.evaluate(conn)


_MEMO_MAX: Final = 4096
# id(policy) -> (policy, compiled). The entry holds the policy, so its id cannot be reused while
# the entry lives; a pure cache: dropping it changes nothing but speed.
_memo_by_id: dict[int, tuple[Authorization, CompiledPolicy]] = {}


def _memo(p: Authorization) -> CompiledPolicy:
    hit = _memo_by_id.get(id(p))
    if hit is not None and hit[0] is p:
        return hit[1]
    if len(_memo_by_id) >= _MEMO_MAX:
        _memo_by_id.clear()
    cp = CompiledPolicy(p)
    _memo_by_id[id(p)] = (p, cp)
    return cp


# --- the index --------------------------------------------------------------------------------

_MAX_CACHED_SETS: Final = 8192


class PolicyIndex:
    """Compiled policies indexed for ``policies_for(workload)``, optionally following a State.

    Lookup cost depends only on the applicable policies: namespace-scoped ones are found by the
    destination's namespace, global ones under ``""``, selector ones by the keys the workload
    lists in ``authorization_policies`` (any policy named there applies, whatever its scope, as in
    Rust). The resulting :class:`PolicySet` is cached per ``(namespace, authorization_policies)``
    and the cache is dropped on any policy change, so workload changes need no notification.

    Policies are compiled lazily, the first time they apply to a destination: storing one is a
    dict insert, and a node proxy never pays to compile policies for namespaces it does not serve.
    """

    __slots__ = (
        "_by_key",
        "_by_ns",
        "_compiled",
        "_generation",
        "_sets",
        "_state",
        "_unsubscribe",
    )

    def __init__(self, policies: Iterable[Authorization] = ()) -> None:
        self._by_key: dict[str, Authorization] = {}
        self._compiled: dict[str, CompiledPolicy] = {}
        # namespace ("" = global) -> ordered set of keys; WORKLOAD_SELECTOR policies are not here.
        self._by_ns: dict[str, dict[str, None]] = {}
        self._sets: dict[tuple[str, tuple[str, ...]], PolicySet] = {}
        self._generation = 0
        self._state: State | None = None
        self._unsubscribe: Callable[[], None] | None = None
        for p in policies:
            self.upsert(p)

    @classmethod
    def from_state(cls, state: State, *, follow: bool = True) -> PolicyIndex:
        """Index ``state``'s policies; with ``follow`` keep up to date through
        :meth:`State.subscribe` until :meth:`close`."""
        index = cls(state.policies())
        if follow:
            index._state = state
            index._unsubscribe = state.subscribe(index._on_change)
        return index

    def close(self) -> None:
        """Stop following the State (idempotent)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._state = None

    def _on_change(self, change: StateChange) -> None:
        if change.kind is not ChangeKind.POLICY or self._state is None:
            return
        p = None if change.removed else self._state.find_policy(change.key)
        if p is None:
            self.remove(change.key)
        else:
            self.upsert(p)

    @property
    def generation(self) -> int:
        """Bumped on every policy change: a connection decided at an older generation may need
        re-evaluation (Rust's per-pod policy watcher)."""
        return self._generation

    @staticmethod
    def _ns_of(p: Authorization) -> str | None:
        if p.scope is PolicyScope.GLOBAL:
            return ""
        if p.scope is PolicyScope.NAMESPACE:
            return p.namespace
        return None

    def upsert(self, policy: Authorization) -> None:
        key = policy.key
        old = self._by_key.get(key)
        if old is not None:
            self._unindex(old)
            self._compiled.pop(key, None)
        self._by_key[key] = policy
        ns = self._ns_of(policy)
        if ns is not None:
            self._by_ns.setdefault(ns, {})[key] = None
        self._changed()

    def remove(self, key: str) -> bool:
        old = self._by_key.pop(key, None)
        if old is None:
            return False
        self._compiled.pop(key, None)
        self._unindex(old)
        self._changed()
        return True

    def _unindex(self, p: Authorization) -> None:
        ns = self._ns_of(p)
        if ns is None:
            return
        keys = self._by_ns.get(ns)
        if keys is not None:
            keys.pop(p.key, None)
            if not keys:
                del self._by_ns[ns]

    def _changed(self) -> None:
        self._generation += 1
        self._sets.clear()

    def get(self, key: str) -> CompiledPolicy | None:
        """The compiled policy ``key`` (compiling it now if needed), or None."""
        cp = self._compiled.get(key)
        if cp is None:
            p = self._by_key.get(key)
            if p is None:
                return None
            cp = self._compiled[key] = CompiledPolicy(p)
        return cp

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[CompiledPolicy]:
        """Every policy, compiled (this compiles them all)."""
        for key in tuple(self._by_key):
            cp = self.get(key)
            if cp is not None:
                yield cp

    def policies_for(self, workload: Workload) -> PolicySet:
        """The policies that apply to ``workload`` as a destination: its namespace's, the global
        ones, then those it names in ``authorization_policies`` (each once; unknown keys are
        skipped: the control plane may not have sent them yet)."""
        ck = (workload.namespace, workload.authorization_policies)
        ps = self._sets.get(ck)
        if ps is not None:
            return ps
        seen: dict[str, CompiledPolicy] = {}
        for keys in (
            self._by_ns.get(workload.namespace, ()),
            self._by_ns.get("", ()),
            workload.authorization_policies,
        ):
            for k in keys:
                if k not in seen:
                    cp = self.get(k)
                    if cp is not None:
                        seen[k] = cp
        ps = PolicySet(seen.values())
        if len(self._sets) >= _MAX_CACHED_SETS:
            self._sets.clear()
        self._sets[ck] = ps
        return ps

    def evaluate(self, workload: Workload, conn: Connection) -> Decision:
        """The decision for ``conn`` to ``workload`` (``conn.dst_ip`` should be one of its IPs)."""
        return self.policies_for(workload).evaluate(conn)


# --- explanations -----------------------------------------------------------------------------


class AppliesVia(enum.Enum):
    """Why a policy applies to a destination."""

    NAMESPACE = "namespace"
    GLOBAL = "global"
    SELECTOR = "workloadSelector"


@dataclass(frozen=True, slots=True)
class ConditionTrace:
    """One field of a match: e.g. ``notDestinationPorts [9999]`` against port 8080.

    ``hit`` is the value that matched the connection (for a negative field, the one that made it
    fail), if any.
    """

    field: str
    negative: bool
    values: tuple[str, ...]
    actual: str
    hit: str | None
    ok: bool

    def __str__(self) -> str:
        vals = ", ".join(self.values)
        why = f"matches {self.hit}" if self.hit is not None else "matches none"
        return f"{self.field} [{vals}]: {self.actual} {why} -> {'ok' if self.ok else 'FAILED'}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "values": list(self.values),
            "actual": self.actual,
            "hit": self.hit,
            "ok": self.ok,
        }


@dataclass(frozen=True, slots=True)
class MatchTrace:
    index: int
    ok: bool
    conditions: tuple[ConditionTrace, ...]

    @property
    def empty(self) -> bool:
        """An empty match is skipped: it never makes its clause true."""
        return not self.conditions

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "matched": self.ok,
            "empty": self.empty,
            "conditions": [c.to_dict() for c in self.conditions],
        }


@dataclass(frozen=True, slots=True)
class ClauseTrace:
    index: int
    ok: bool
    matches: tuple[MatchTrace, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "matched": self.ok,
            "matches": [m.to_dict() for m in self.matches],
        }


@dataclass(frozen=True, slots=True)
class RuleTrace:
    index: int
    ok: bool
    clauses: tuple[ClauseTrace, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "matched": self.ok,
            "clauses": [c.to_dict() for c in self.clauses],
        }


@dataclass(frozen=True, slots=True)
class PolicyTrace:
    """One applicable policy, how it applies, and whether (and why) it matched."""

    key: str
    action: PolicyAction
    scope: PolicyScope
    via: AppliesVia
    dry_run: bool
    matched: bool
    rules: tuple[RuleTrace, ...]

    def why(self) -> str:
        """One line: the rule that matched, or why each rule failed."""
        if not self.rules:
            return "no rules: never matches"
        if self.matched:
            r = next(r for r in self.rules if r.ok)
            if not r.clauses:
                return f"rule[{r.index}] has no clauses: matches everything"
            parts = []
            for c in r.clauses:
                if not c.matches:
                    parts.append(f"clause[{c.index}] empty (true)")
                    continue
                m = next(m for m in c.matches if m.ok)
                conds = "; ".join(str(x) for x in m.conditions)
                parts.append(f"clause[{c.index}] match[{m.index}]: {conds}")
            return f"rule[{r.index}] matched: " + " AND ".join(parts)
        fails = []
        for r in self.rules:
            c = next(c for c in r.clauses if not c.ok)
            if all(m.empty for m in c.matches):
                fails.append(f"rule[{r.index}] clause[{c.index}]: only empty matches (skipped)")
                continue
            ms = []
            for m in c.matches:
                if m.empty:
                    ms.append(f"match[{m.index}] empty (skipped)")
                else:
                    bad = "; ".join(str(x) for x in m.conditions if not x.ok)
                    ms.append(f"match[{m.index}]: {bad}")
            fails.append(f"rule[{r.index}] clause[{c.index}] failed: " + " OR ".join(ms))
        return "no rule matched: " + " | ".join(fails)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.key,
            "action": self.action.name,
            "scope": self.scope.name,
            "appliesVia": self.via.value,
            "dryRun": self.dry_run,
            "matched": self.matched,
            "why": self.why(),
            "rules": [r.to_dict() for r in self.rules],
        }


@dataclass(frozen=True, slots=True)
class Explanation:
    """Which policies apply to a connection, whether each matched and why, and the decision."""

    connection: Connection
    destination: str  # "namespace/name" of the destination workload
    destination_uid: str
    policies: tuple[PolicyTrace, ...]
    decision: Decision
    unknown_policies: tuple[str, ...] = ()  # named by the workload but not (yet) known
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        c = self.connection
        src = str(c.src_identity) if c.src_identity is not None else "plaintext (no identity)"
        lines = [
            f"source:      {src} from {c.src_ip}",
            f"destination: {self.destination} at {_hostport(c.dst_ip, c.dst_port)}"
            + (f" (network {c.dst_network!r})" if c.dst_network else ""),
        ]
        lines.extend(f"note:        {n}" for n in self.notes)
        d = self.decision
        verdict = "ALLOW" if d.allowed else "DENY"
        by = f" [decided by {d.policy}]" if d.policy else ""
        lines.append(f"decision:    {verdict}: {d.reason}{by}")
        summary = d.dry_run_summary()
        if summary is not None:
            lines.append(f"dry-run:     {summary}" + (" (differs)" if d.dry_run_differs else ""))
        if not self.policies:
            lines.append("policies:    none apply")
        else:
            lines.append(f"policies:    {len(self.policies)} apply")
            for p in self.policies:
                tag = " dry-run" if p.dry_run else ""
                res = "MATCHED" if p.matched else "no match"
                lines.append(f"  {p.action.name:<5} {p.key} ({p.via.value}{tag}): {res}")
                lines.append(f"        {p.why()}")
        for k in self.unknown_policies:
            lines.append(f"  skipped unknown policy {k}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        c = self.connection
        return {
            "source": {
                "identity": str(c.src_identity) if c.src_identity is not None else None,
                "ip": str(c.src_ip),
            },
            "destination": {
                "workload": self.destination,
                "uid": self.destination_uid,
                "ip": str(c.dst_ip),
                "port": c.dst_port,
                "network": c.dst_network,
            },
            "decision": self.decision.to_dict(),
            "policies": [p.to_dict() for p in self.policies],
            "unknownPolicies": list(self.unknown_policies),
            "notes": list(self.notes),
        }


def _fmt_sm(m: StringMatch) -> str:
    if m.kind is StringMatchKind.PRESENCE:
        return "presence"
    return f"{m.kind.value} {m.value!r}"


def _trace_strings(
    name: str, sms: Sequence[StringMatch], actual: str | None, negative: bool, shown: str
) -> ConditionTrace:
    # actual None: no identity, and the test cannot match (principals need an identity).
    hit = None
    if actual is not None:
        hit = next((_fmt_sm(m) for m in sms if m.matches(actual)), None)
    ok = (hit is None) if negative else (hit is not None)
    return ConditionTrace(name, negative, tuple(_fmt_sm(m) for m in sms), shown, hit, ok)


def _trace_match(m: Match, conn: Connection) -> tuple[ConditionTrace, ...]:
    """Every non-empty field of ``m`` against ``conn``; in the YAML field order."""
    out: list[ConditionTrace] = []
    ns_shown = repr(conn.src_namespace) + ("" if conn.src_identity else " (no identity)")
    pr_shown = repr(conn.principal) if conn.principal is not None else "(no identity)"
    sa_shown = "/".join(conn.src_sa) if conn.src_sa is not None else "(no identity)"
    for name, sms, neg in (
        ("namespaces", m.namespaces, False),
        ("notNamespaces", m.not_namespaces, True),
    ):
        if sms:
            out.append(_trace_strings(name, sms, conn.src_namespace, neg, ns_shown))
    for name, sas, neg in (
        ("serviceAccounts", m.service_accounts, False),
        ("notServiceAccounts", m.not_service_accounts, True),
    ):
        if sas:
            vals = tuple(f"{s.namespace}/{s.service_account}" for s in sas)
            hit = None
            if conn.src_sa is not None:
                hit = next(
                    (
                        v
                        for s, v in zip(sas, vals, strict=True)
                        if (s.namespace, s.service_account) == conn.src_sa
                    ),
                    None,
                )
            ok = (hit is None) if neg else (hit is not None)
            out.append(ConditionTrace(name, neg, vals, sa_shown, hit, ok))
    for name, sms, neg in (
        ("principals", m.principals, False),
        ("notPrincipals", m.not_principals, True),
    ):
        if sms:
            out.append(_trace_strings(name, sms, conn.principal, neg, pr_shown))
    for name, nets, neg, ip in (
        ("sourceIps", m.source_ips, False, conn.src_ip),
        ("notSourceIps", m.not_source_ips, True, conn.src_ip),
        ("destinationIps", m.destination_ips, False, conn.dst_ip),
        ("notDestinationIps", m.not_destination_ips, True, conn.dst_ip),
    ):
        if nets:
            hit = next((str(n) for n in nets if n.version == ip.version and ip in n), None)
            ok = (hit is None) if neg else (hit is not None)
            out.append(ConditionTrace(name, neg, tuple(str(n) for n in nets), str(ip), hit, ok))
    for name, ports, neg in (
        ("destinationPorts", m.destination_ports, False),
        ("notDestinationPorts", m.not_destination_ports, True),
    ):
        if ports:
            hit = str(conn.dst_port) if conn.dst_port in ports else None
            ok = (hit is None) if neg else (hit is not None)
            out.append(
                ConditionTrace(name, neg, tuple(str(p) for p in ports), str(conn.dst_port), hit, ok)
            )
    return tuple(out)


def _trace_policy(p: Authorization, via: AppliesVia, conn: Connection) -> PolicyTrace:
    """The verbose walk: every rule, clause and match is evaluated (no short circuit)."""
    rules: list[RuleTrace] = []
    for ri, rule in enumerate(p.rules):
        clauses: list[ClauseTrace] = []
        for ci, clause in enumerate(rule.clauses):
            matches: list[MatchTrace] = []
            for mi, m in enumerate(clause.matches):
                conds = _trace_match(m, conn)
                # An empty match is skipped: it never holds.
                matches.append(MatchTrace(mi, bool(conds) and all(c.ok for c in conds), conds))
            ok = not matches or any(m.ok for m in matches)
            clauses.append(ClauseTrace(ci, ok, tuple(matches)))
        rules.append(RuleTrace(ri, all(c.ok for c in clauses), tuple(clauses)))
    matched = any(r.ok for r in rules)
    return PolicyTrace(p.key, p.action, p.scope, via, p.dry_run, matched, tuple(rules))


def _via(p: Authorization, workload: Workload) -> AppliesVia:
    if p.scope is PolicyScope.NAMESPACE and p.namespace == workload.namespace:
        return AppliesVia.NAMESPACE
    if p.scope is PolicyScope.GLOBAL:
        return AppliesVia.GLOBAL
    return AppliesVia.SELECTOR


def explain(
    source: State | PolicyIndex,
    src: Identity | IPAddr | Workload | str | None,
    dst: Workload,
    port: int,
    *,
    src_ip: IPAddr | str | None = None,
    dst_ip: IPAddr | str | None = None,
) -> Explanation:
    """Explain the decision for a connection from ``src`` to ``dst:port``.

    ``src`` is an :class:`Identity` (or its ``spiffe://`` URI), a source workload (its identity
    and first IP), an IP (plaintext, no identity), or None (plaintext from an unknown IP).
    ``src_ip`` / ``dst_ip`` override the IPs; a missing source IP is taken as the unspecified
    address of the destination's family and said so in ``notes`` (``sourceIps`` conditions are
    then evaluated against it). ``port`` is the destination port after target-port resolution.
    The decision is the one :func:`evaluate` gives, so it is the one the proxy enforces.
    """
    notes: list[str] = []
    identity: Identity | None = None
    ip: IPAddr | None = parse_ip(src_ip) if isinstance(src_ip, str) else src_ip
    if isinstance(src, str):
        src = Identity.parse(src) if src.startswith(SPIFFE_PREFIX) else parse_ip(src)
    if isinstance(src, Identity):
        identity = src
    elif isinstance(src, Workload):
        identity = src.identity
        if ip is None and src.addresses:
            ip = src.addresses[0]
    elif src is not None:
        ip = src
    d_ip: IPAddr | None = parse_ip(dst_ip) if isinstance(dst_ip, str) else dst_ip
    if d_ip is None:
        if not dst.addresses:
            raise ValueError(f"workload {dst.namespace}/{dst.name} has no IP: pass dst_ip")
        d_ip = dst.addresses[0]
    d_ip = canonical_ip(d_ip)
    if ip is None:
        ip = parse_ip("0.0.0.0" if d_ip.version == 4 else "::")
        notes.append(f"source IP not given: {ip} assumed for sourceIps conditions")
    conn = Connection(ip, identity, d_ip, port, dst.network)

    if isinstance(source, PolicyIndex):
        pset = source.policies_for(dst)
        known = {p.key for p in pset}
        policies = [p.policy for p in pset]
    else:
        policies = source.policies_for(dst)
        known = {p.key for p in policies}
        pset = PolicySet(_memo(p) for p in policies)
    unknown = tuple(k for k in dst.authorization_policies if k not in known)
    traces = tuple(_trace_policy(p, _via(p, dst), conn) for p in policies)
    return Explanation(
        connection=conn,
        destination=f"{dst.namespace}/{dst.name}",
        destination_uid=dst.uid,
        policies=traces,
        decision=pset.evaluate(conn),
        unknown_policies=unknown,
        notes=tuple(notes),
    )
