"""Authorization: match semantics (istio/ztunnel rbac.rs), the decision order (state.rs
assert_rbac), dry-run, STRICT, the policy index, explanations, and a reference evaluator."""

from __future__ import annotations

import ipaddress
import json
import textwrap
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ztunnel.core.addr import IPAddr, IPNet, parse_ip
from ztunnel.core.identity import Identity
from ztunnel.state.authz import (
    NO_ALLOW_POLICIES,
    NOT_ALLOWED,
    AppliesVia,
    CompiledPolicy,
    Connection,
    Decision,
    PolicyIndex,
    PolicySet,
    decision_log,
    evaluate,
    explain,
)
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import (
    Authorization,
    Clause,
    Match,
    PolicyAction,
    PolicyScope,
    Rule,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    Workload,
)
from ztunnel.state.store import State

ALLOW, DENY = PolicyAction.ALLOW, PolicyAction.DENY
GLOBAL, NAMESPACE, SELECTOR = (
    PolicyScope.GLOBAL,
    PolicyScope.NAMESPACE,
    PolicyScope.WORKLOAD_SELECTOR,
)


def exact(v: str) -> StringMatch:
    return StringMatch(StringMatchKind.EXACT, v)


def prefix(v: str) -> StringMatch:
    return StringMatch(StringMatchKind.PREFIX, v)


def suffix(v: str) -> StringMatch:
    return StringMatch(StringMatchKind.SUFFIX, v)


PRESENCE = StringMatch(StringMatchKind.PRESENCE)


def net(text: str) -> IPNet:
    return ipaddress.ip_network(text, strict=False)


def sa(ns: str, name: str) -> ServiceAccountMatch:
    return ServiceAccountMatch(ns, name)


def rules(*rs: Sequence[Sequence[Match]]) -> tuple[Rule, ...]:
    """rules(rule, ...) with rule = [clause, ...] and clause = [match, ...] (the YAML nesting)."""
    return tuple(Rule(tuple(Clause(tuple(c)) for c in r)) for r in rs)


def policy(
    name: str,
    *rs: Sequence[Sequence[Match]],
    action: PolicyAction = ALLOW,
    namespace: str = "namespace",
    scope: PolicyScope = GLOBAL,
    dry_run: bool = False,
) -> Authorization:
    return Authorization(name, namespace, scope, action, rules(*rs), dry_run)


def one(m: Match, **kw: object) -> Authorization:
    """A policy whose single rule has a single clause holding ``m``."""
    return policy("p", [[m]], **kw)  # type: ignore[arg-type]


def conn(
    src: str = "127.0.0.1",
    identity: Identity | None = None,
    dst: str = "127.0.0.2",
    port: int = 8080,
    network: str = "",
) -> Connection:
    return Connection(parse_ip(src), identity, parse_ip(dst), port, network)


# The three connections of the Rust rbac.rs tests.
PLAINTEXT = conn()
TLS = conn(identity=Identity("td", "namespace", "account"))
TLS_ALT = conn("127.0.0.3", Identity("td-alt", "ns-alt", "sa=alt"), "127.0.0.4", 9090)
CONNS = (PLAINTEXT, TLS, TLS_ALT)


# --- match kinds ------------------------------------------------------------------------------

MATCH_TABLE: list[tuple[str, Match, tuple[bool, bool, bool]]] = [
    # (id, match, expected for PLAINTEXT, TLS, TLS_ALT)
    ("namespaces", Match(namespaces=(exact("namespace"),)), (False, True, False)),
    ("not_namespaces", Match(not_namespaces=(exact("namespace"),)), (True, False, True)),
    ("namespaces_or", Match(namespaces=(exact("namespace"), exact("ns-alt"))), (False, True, True)),
    ("namespaces_prefix", Match(namespaces=(prefix("ns-"),)), (False, False, True)),
    ("namespaces_suffix", Match(namespaces=(suffix("space"),)), (False, True, False)),
    ("namespaces_presence", Match(namespaces=(PRESENCE,)), (False, True, True)),
    ("not_namespaces_presence", Match(not_namespaces=(PRESENCE,)), (True, False, False)),
    # Rust compares the namespace of a missing identity as "": an exact "" takes plaintext.
    ("namespaces_exact_empty", Match(namespaces=(exact(""),)), (True, False, False)),
    (
        "namespaces_presence_or_empty",
        Match(namespaces=(PRESENCE, exact(""))),
        (True, True, True),
    ),
    (
        "namespaces_presence_or_prefix",
        Match(namespaces=(prefix("x"), PRESENCE)),
        (False, True, True),
    ),
    (
        "service_accounts",
        Match(service_accounts=(sa("namespace", "account"),)),
        (False, True, False),
    ),
    (
        "not_service_accounts",
        Match(not_service_accounts=(sa("namespace", "account"),)),
        (True, False, True),
    ),
    (
        "service_accounts_or",
        Match(service_accounts=(sa("x", "y"), sa("ns-alt", "sa=alt"))),
        (False, False, True),
    ),
    (
        "service_accounts_ns_mismatch",
        Match(service_accounts=(sa("ns-alt", "account"),)),
        (False, False, False),
    ),
    (
        "principals",
        Match(principals=(exact("td/ns/namespace/sa/account"),)),
        (False, True, False),
    ),
    (
        "not_principals",
        Match(not_principals=(exact("td/ns/namespace/sa/account"),)),
        (True, False, True),
    ),
    # Principals are compared without spiffe://, so a full URI never matches.
    (
        "principals_with_scheme",
        Match(principals=(exact("spiffe://td/ns/namespace/sa/account"),)),
        (False, False, False),
    ),
    ("principals_prefix", Match(principals=(prefix("td/"),)), (False, True, False)),
    ("principals_prefix_td", Match(principals=(prefix("td"),)), (False, True, True)),
    ("principals_suffix", Match(principals=(suffix("/sa/account"),)), (False, True, False)),
    ("not_principals_suffix", Match(not_principals=(suffix("/sa/account"),)), (True, False, True)),
    ("principals_presence", Match(principals=(PRESENCE,)), (False, True, True)),
    ("not_principals_presence", Match(not_principals=(PRESENCE,)), (True, False, False)),
    # No identity fails every principal test, even an empty prefix (Rust strips "spiffe://" from
    # "" and fails).
    ("principals_empty_prefix", Match(principals=(prefix(""),)), (False, True, True)),
    ("not_principals_empty_prefix", Match(not_principals=(prefix(""),)), (True, False, False)),
    ("source_ips", Match(source_ips=(net("127.0.0.1/32"),)), (True, True, False)),
    ("not_source_ips", Match(not_source_ips=(net("127.0.0.1/32"),)), (False, False, True)),
    (
        "source_ips_or",
        Match(source_ips=(net("10.0.0.0/8"), net("127.0.0.3/32"))),
        (False, False, True),
    ),
    ("destination_ips", Match(destination_ips=(net("127.0.0.2/32"),)), (True, True, False)),
    (
        "not_destination_ips",
        Match(not_destination_ips=(net("127.0.0.2/32"),)),
        (False, False, True),
    ),
    ("cidr_range", Match(destination_ips=(net("127.0.0.1/24"),)), (True, True, True)),
    ("cidr_v6_never_v4", Match(destination_ips=(net("::/0"),)), (False, False, False)),
    ("cidr_v4_all", Match(destination_ips=(net("0.0.0.0/0"),)), (True, True, True)),
    ("not_cidr_v6", Match(not_source_ips=(net("::/0"),)), (True, True, True)),
    ("destination_ports", Match(destination_ports=(8080,)), (True, True, False)),
    ("not_destination_ports", Match(not_destination_ports=(8080,)), (False, False, True)),
    ("destination_ports_or", Match(destination_ports=(80, 9090)), (False, False, True)),
    ("not_destination_ports_many", Match(not_destination_ports=(80, 9090)), (True, True, False)),
    # Different kinds AND-ed.
    (
        "kinds_and",
        Match(namespaces=(exact("namespace"),), destination_ports=(8080,)),
        (False, True, False),
    ),
    (
        "kinds_and_ip",
        Match(source_ips=(net("127.0.0.0/24"),), not_principals=(PRESENCE,)),
        (True, False, False),
    ),
    # Positive and negative of one kind: in the list and not excluded.
    (
        "pos_and_neg",
        Match(destination_ports=(8080, 9090), not_destination_ports=(9090,)),
        (True, True, False),
    ),
]


@pytest.mark.parametrize(
    ("m", "expect"), [(m, e) for _, m, e in MATCH_TABLE], ids=[i for i, _, _ in MATCH_TABLE]
)
def test_match_kinds(m: Match, expect: tuple[bool, bool, bool]) -> None:
    cp = CompiledPolicy(one(m))
    assert tuple(cp.matches(c) for c in CONNS) == expect
    # The same result through the decision: an ALLOW policy allows exactly the matching ones.
    assert tuple(evaluate([one(m)], c).allowed for c in CONNS) == expect
    # ... through the explanation's verbose walk ...
    dst = wl("dst", "namespace")
    for c, e in zip(CONNS, expect, strict=True):
        ex = explain(
            PolicyIndex([one(m)]), c.src_identity, dst, c.dst_port, src_ip=c.src_ip, dst_ip=c.dst_ip
        )
        assert ex.policies[0].matched is e
    # ... and by the reference evaluator below.
    assert tuple(ref_policy_matches(one(m), c) for c in CONNS) == expect


@pytest.mark.parametrize(
    ("kind", "value", "subject", "expect"),
    [
        (StringMatchKind.EXACT, "foo", "foo", True),
        (StringMatchKind.EXACT, "foo", "not", False),
        (StringMatchKind.EXACT, "foo", "", False),
        (StringMatchKind.PREFIX, "foo", "foobar", True),
        (StringMatchKind.PREFIX, "foo", "notfoo", False),
        (StringMatchKind.PREFIX, "foo", "", False),
        (StringMatchKind.SUFFIX, "foo", "barfoo", True),
        (StringMatchKind.SUFFIX, "foo", "foonot", False),
        (StringMatchKind.SUFFIX, "foo", "", False),
        (StringMatchKind.PRESENCE, "", "foo", True),
        (StringMatchKind.PRESENCE, "", "", False),
    ],
)
def test_string_match_on_namespace(
    kind: StringMatchKind, value: str, subject: str, expect: bool
) -> None:
    m = Match(namespaces=(StringMatch(kind, value),))
    ident = Identity("td", subject, "sa") if subject else None
    assert CompiledPolicy(one(m)).matches(conn(identity=ident)) is expect


def test_ipv6_and_mapped_addresses() -> None:
    m = Match(source_ips=(net("2001:db8::/32"),), destination_ips=(net("10.0.0.0/8"),))
    p = CompiledPolicy(one(m))
    assert p.matches(conn("2001:db8::7", None, "10.1.2.3"))
    assert not p.matches(conn("2001:db9::7", None, "10.1.2.3"))
    # An IPv4-mapped IPv6 destination is canonicalised to IPv4 (Rust socket::to_canonical).
    c = conn("2001:db8::1", None, "::ffff:10.0.0.5")
    assert str(c.dst_ip) == "10.0.0.5"
    assert p.matches(c)


# --- structure: empty matches, empty clauses, no rules, nesting --------------------------------


NS_A = Match(namespaces=(exact("a"),))
NS_B = Match(namespaces=(exact("b"),))
PORT_80 = Match(destination_ports=(80,))


def ident(ns: str) -> Identity:
    return Identity("td", ns, "account")


@pytest.mark.parametrize(
    ("rs", "expect"),
    [
        ([[[Match()]]], False),  # a clause of only empty matches: the empty match is skipped
        ([[[Match(), Match()]]], False),
        ([[[]]], True),  # an empty clause counts as true
        ([[]], True),  # a rule with no clauses matches
        ([], False),  # a policy with no rules never matches
        ([[[Match()]], [[]]], True),  # a later rule can still match
        ([[[Match(), PORT_80]]], False),  # the empty match is skipped, the port decides
        ([[[Match(), Match(destination_ports=(8080,))]]], True),
        ([[[], [Match()]]], False),  # true AND false
        ([[[Match(destination_ports=(8080,))], []]], True),
    ],
    ids=[
        "empty_match",
        "two_empty_matches",
        "empty_clause",
        "no_clauses",
        "no_rules",
        "dead_rule_then_live",
        "empty_or_port80",
        "empty_or_port8080",
        "empty_clause_and_empty_match",
        "port_and_empty_clause",
    ],
)
def test_empty_structures(rs: list[list[list[Match]]], expect: bool) -> None:
    p = policy("empty", *rs)
    assert CompiledPolicy(p).matches(PLAINTEXT) is expect
    assert ref_policy_matches(p, PLAINTEXT) is expect


def test_nesting() -> None:
    # (ns a OR ns b) AND port 80 (Rust rbac_nesting)
    p = CompiledPolicy(policy("nested", [[NS_A, NS_B], [PORT_80]]))
    assert p.matches(conn(identity=ident("a"), port=80))
    assert p.matches(conn(identity=ident("b"), port=80))
    assert p.matches(conn(identity=ident("b"), port=80, network="remote"))  # network ignored
    assert not p.matches(conn(identity=ident("bad"), port=80))
    assert not p.matches(conn(identity=ident("b"), port=12345))


def test_same_shape_policies_keep_their_own_values() -> None:
    # Policies of one shape share generated code; each must still test its own values.
    shape = [
        Match(principals=(exact(f"td/ns/{ns}/sa/account"),), destination_ports=(port,))
        for ns, port in (("a", 80), ("b", 81))
    ]
    pa, pb = (CompiledPolicy(policy(f"p{i}", [[m]])) for i, m in enumerate(shape))
    assert pa.matches(conn(identity=ident("a"), port=80))
    assert not pa.matches(conn(identity=ident("b"), port=81))
    assert pb.matches(conn(identity=ident("b"), port=81))
    assert not pb.matches(conn(identity=ident("a"), port=80))


def test_multi_rule() -> None:
    p = CompiledPolicy(policy("multi", [[NS_A]], [[NS_B]]))
    assert p.matches(conn(identity=ident("a")))
    assert p.matches(conn(identity=ident("b")))
    assert not p.matches(conn(identity=ident("bad")))


# --- the decision -----------------------------------------------------------------------------


def test_no_policies_allows() -> None:
    d = evaluate([], PLAINTEXT)
    assert d == Decision(True, None, NO_ALLOW_POLICIES)
    assert d.dry_run == () and d.would_allow is None and not d.dry_run_differs


def test_deny_matching_denies_with_rust_text() -> None:
    p = one(PORT_80, action=DENY, namespace="default")
    p = replace(p, name="deny-80")
    d = evaluate([p], conn(port=80))
    assert not d.allowed
    assert d.policy == "default/deny-80"
    assert d.reason == "explicitly denied by: default/deny-80"
    assert evaluate([p], conn(port=81)) == Decision(True, None, NO_ALLOW_POLICIES)


def test_allow_policies() -> None:
    allow_a = policy("allow-a", [[NS_A]])
    d = evaluate([allow_a], conn(identity=ident("a")))
    assert (
        d.allowed
        and d.policy == "namespace/allow-a"
        and d.reason == "allowed by: namespace/allow-a"
    )
    d = evaluate([allow_a], conn(identity=ident("b")))
    assert d == Decision(False, None, NOT_ALLOWED)
    assert d.reason == "allow policies exist, but none allowed"


def test_deny_before_allow_whatever_the_order() -> None:
    allow_all = policy("allow-all", [[]])
    deny_a = policy("deny-a", [[NS_A]], action=DENY)
    for order in ([allow_all, deny_a], [deny_a, allow_all]):
        d = evaluate(order, conn(identity=ident("a")))
        assert not d.allowed and d.policy == "namespace/deny-a"
        assert evaluate(order, conn(identity=ident("b"))).policy == "namespace/allow-all"


def test_policies_without_rules() -> None:
    # An ALLOW with no rules allows nothing but still counts as "an ALLOW exists".
    assert evaluate([policy("allow-nothing")], TLS) == Decision(False, None, NOT_ALLOWED)
    # A DENY with no rules denies nothing.
    assert evaluate([policy("deny-nothing", action=DENY)], TLS).allowed


def test_dry_run_deny_is_reported_not_enforced() -> None:
    dry = policy("dry-deny", [[NS_A]], action=DENY, dry_run=True)
    d = evaluate([dry], conn(identity=ident("a")))
    assert d.allowed and d.policy is None and d.reason == NO_ALLOW_POLICIES
    assert [(o.policy, o.action, o.matched) for o in d.dry_run] == [
        ("namespace/dry-deny", DENY, True)
    ]
    assert d.would_allow is False and d.would_policy == "namespace/dry-deny"
    assert d.dry_run_differs
    assert d.dry_run_summary() == "would deny: explicitly denied by: namespace/dry-deny"
    d = evaluate([dry], conn(identity=ident("b")))
    assert d.allowed and d.would_allow is True and not d.dry_run_differs
    assert d.dry_run[0].matched is False


def test_dry_run_allow_does_not_create_an_allow() -> None:
    # Only a dry-run ALLOW: no enforced ALLOW exists, so the connection is allowed, but it would
    # be denied if enforced (Rust: "dry-run no allow policies match").
    dry = policy("dry-allow", [[NS_A]], dry_run=True)
    d = evaluate([dry], conn(identity=ident("b")))
    assert d.allowed and d.reason == NO_ALLOW_POLICIES
    assert d.would_allow is False and d.would_reason == NOT_ALLOWED and d.dry_run_differs
    d = evaluate([dry], conn(identity=ident("a")))
    assert d.allowed and d.would_allow is True and d.would_policy == "namespace/dry-allow"


def test_dry_run_allow_would_rescue_a_denied_connection() -> None:
    real = policy("real-allow", [[NS_A]])
    dry = policy("dry-allow", [[NS_B]], dry_run=True)
    d = evaluate([real, dry], conn(identity=ident("b")))
    assert not d.allowed and d.reason == NOT_ALLOWED
    assert d.would_allow is True and d.would_policy == "namespace/dry-allow"
    assert d.dry_run_summary() == "would allow: allowed by: namespace/dry-allow"


def test_enforced_deny_wins_over_dry_run() -> None:
    real = policy("real-deny", [[NS_A]], action=DENY)
    dry = policy("dry-allow", [[NS_A]], dry_run=True)
    d = evaluate([dry, real], conn(identity=ident("a")))
    assert not d.allowed and d.policy == "namespace/real-deny"
    assert d.would_allow is False and d.would_policy == "namespace/real-deny"
    assert not d.dry_run_differs


def test_decision_to_dict_is_json() -> None:
    dry = policy("dry", [[NS_A]], action=DENY, dry_run=True)
    doc = evaluate([dry], conn(identity=ident("a"))).to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["dryRun"]["wouldAllow"] is False
    assert "dryRun" not in evaluate([], PLAINTEXT).to_dict()


# --- STRICT: istiod's PeerAuthentication as a DENY ---------------------------------------------


def strict(permissive_ports: tuple[int, ...] = ()) -> Authorization:
    m = Match(not_principals=(PRESENCE,), not_destination_ports=permissive_ports)
    return Authorization(
        "istio_converted_static_strict", "istio-system", GLOBAL, DENY, rules([[m]])
    )


def test_strict_blocks_plaintext_allows_mtls() -> None:
    d = evaluate([strict()], PLAINTEXT)
    assert not d.allowed
    assert d.reason == "explicitly denied by: istio-system/istio_converted_static_strict"
    assert evaluate([strict()], TLS).allowed
    assert evaluate([strict()], TLS_ALT).allowed


def test_strict_with_a_permissive_port() -> None:
    assert evaluate([strict((8080,))], conn(port=8080)).allowed
    assert not evaluate([strict((8080,))], conn(port=9090)).allowed


def test_plaintext_has_no_identity() -> None:
    assert PLAINTEXT.src_identity is None
    assert (
        PLAINTEXT.principal is None and PLAINTEXT.src_namespace == "" and PLAINTEXT.src_sa is None
    )
    assert TLS.principal == "td/ns/namespace/sa/account"
    assert str(PLAINTEXT) == "127.0.0.1(None)->127.0.0.2:8080"
    assert str(TLS) == "127.0.0.1(spiffe://td/ns/namespace/sa/account)->127.0.0.2:8080"


# --- scopes and the index ---------------------------------------------------------------------


def wl(name: str, ns: str, *authz: str, ip: str = "10.0.0.1", network: str = "") -> Workload:
    return Workload(
        uid=f"c//v1/Pod/{ns}/{name}",
        name=name,
        namespace=ns,
        addresses=(parse_ip(ip),),
        network=network,
        authorization_policies=authz,
    )


DENY_ALL = [[Match(not_destination_ports=(1,))]]  # matches every port but 1


def scoped() -> list[Authorization]:
    return [
        policy("global", DENY_ALL, namespace="istio-system", scope=GLOBAL, action=DENY),
        policy("ns-a", DENY_ALL, namespace="a", scope=NAMESPACE, action=DENY),
        policy("ns-b", DENY_ALL, namespace="b", scope=NAMESPACE, action=DENY),
        policy("sel-a", DENY_ALL, namespace="a", scope=SELECTOR, action=DENY),
        policy("sel-b", DENY_ALL, namespace="b", scope=SELECTOR, action=DENY),
    ]


@pytest.mark.parametrize(
    ("workload", "expect"),
    [
        (wl("w", "a"), ["a/ns-a", "istio-system/global"]),
        (wl("w", "b"), ["b/ns-b", "istio-system/global"]),
        (wl("w", "c"), ["istio-system/global"]),
        (wl("w", "a", "a/sel-a"), ["a/ns-a", "istio-system/global", "a/sel-a"]),
        # Any policy the workload names applies, whatever its scope or namespace (Rust: by key).
        (wl("w", "c", "b/sel-b", "a/ns-a"), ["istio-system/global", "b/sel-b", "a/ns-a"]),
        # Each once; unknown keys skipped.
        (wl("w", "a", "a/ns-a", "a/missing"), ["a/ns-a", "istio-system/global"]),
    ],
)
def test_scopes(workload: Workload, expect: list[str]) -> None:
    index = PolicyIndex(scoped())
    assert [p.key for p in index.policies_for(workload)] == expect
    state = State()
    for p in scoped():
        state.upsert_policy(p)
    assert [p.key for p in state.policies_for(workload)] == expect
    c = conn(dst="10.0.0.1")
    d = index.evaluate(workload, c)
    assert not d.allowed and d.policy == expect[0]


def test_selector_policy_only_applies_when_selected() -> None:
    allow = policy("only-a", [[NS_A]], namespace="x", scope=SELECTOR)
    index = PolicyIndex([allow])
    c = conn(identity=ident("b"), dst="10.0.0.1")
    assert index.evaluate(wl("other", "x"), c).allowed  # not selected: no ALLOW applies
    assert not index.evaluate(wl("sel", "x", "x/only-a"), c).allowed


def test_index_follows_state() -> None:
    state = State()
    index = PolicyIndex.from_state(state)
    w = wl("w", "a")
    state.upsert_workload(w)
    c = conn(identity=ident("z"), dst="10.0.0.1")
    assert index.evaluate(w, c).allowed
    g0 = index.generation

    state.upsert_policy(policy("p", [[NS_A]], namespace="a", scope=NAMESPACE))
    assert index.generation > g0
    assert index.evaluate(w, c) == Decision(False, None, NOT_ALLOWED)

    # Scope change: namespace -> selector; it no longer applies by namespace...
    state.upsert_policy(policy("p", [[NS_A]], namespace="a", scope=SELECTOR))
    assert len(index.policies_for(w)) == 0 and index.evaluate(w, c).allowed
    # ...until the workload selects it.
    w2 = replace(w, authorization_policies=("a/p",))
    state.upsert_workload(w2)
    assert [p.key for p in index.policies_for(w2)] == ["a/p"]
    assert not index.evaluate(w2, c).allowed
    # ...and stops when it no longer does.
    state.upsert_workload(w)
    assert index.evaluate(w, c).allowed

    # Namespace -> global applies everywhere.
    state.upsert_policy(policy("p", [[NS_A]], namespace="a", scope=GLOBAL))
    assert not index.evaluate(wl("v", "elsewhere"), c).allowed

    # Content change (rules) is seen at once: no stale cached set.
    state.upsert_policy(policy("p", [[]], namespace="a", scope=GLOBAL))
    assert index.evaluate(w, c).policy == "a/p"

    assert state.remove_policy("a/p") is not None
    assert "a/p" not in index and len(index) == 0 and index.evaluate(w, c).allowed

    state.upsert_policy(policy("q", DENY_ALL, namespace="a", scope=NAMESPACE, action=DENY))
    assert not index.evaluate(w, c).allowed
    state.clear()
    assert len(index) == 0 and index.evaluate(w, c).allowed

    index.close()
    index.close()  # idempotent
    state.upsert_policy(policy("r", DENY_ALL, namespace="a", scope=NAMESPACE, action=DENY))
    assert len(index) == 0  # no longer following


def test_index_from_state_without_follow() -> None:
    state = State()
    state.upsert_policy(policy("p", [[]], namespace="a", scope=NAMESPACE))
    index = PolicyIndex.from_state(state, follow=False)
    state.remove_policy("a/p")
    assert "a/p" in index and index.get("a/p") is not None


def test_index_direct_upsert_and_remove() -> None:
    index = PolicyIndex()
    index.upsert(policy("p", [[]], namespace="a", scope=NAMESPACE))
    assert [p.key for p in index] == ["a/p"]
    # Compiled once, lazily; recompiled after an update.
    first = index.get("a/p")
    assert first is not None and index.get("a/p") is first
    index.upsert(policy("p", [[Match(destination_ports=(80,))]], namespace="a", scope=NAMESPACE))
    second = index.get("a/p")
    assert second is not None and second is not first
    assert not second.matches(PLAINTEXT) and first.matches(PLAINTEXT)
    assert index.get("a/missing") is None
    assert index.remove("a/p") and not index.remove("a/p")


def test_policy_set_is_reusable_and_iterable() -> None:
    ps = PolicySet(CompiledPolicy(p) for p in scoped())
    assert len(ps) == 5 and next(iter(ps)).key == "istio-system/global"
    assert len(ps.deny) == 5 and ps.allow == () and ps.dry_run == ()
    assert evaluate(ps, PLAINTEXT) == ps.evaluate(PLAINTEXT)


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("policy"),
            st.sampled_from(["p1", "p2", "p3"]),
            st.sampled_from(["a", "b", "istio-system"]),
            st.sampled_from([GLOBAL, NAMESPACE, SELECTOR]),
        ),
        st.tuples(st.just("remove"), st.sampled_from(["a/p1", "b/p2", "istio-system/p3", "a/p3"])),
        st.tuples(
            st.just("workload"),
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.sampled_from(["a/p1", "b/p2", "a/p3", "istio-system/p3"]), max_size=3),
        ),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_index_agrees_with_state_across_changes(ops: list[tuple[object, ...]]) -> None:
    state = State()
    index = PolicyIndex.from_state(state)
    w = wl("w", "a")
    for op in ops:
        if op[0] == "policy":
            _, name, ns, scope = op
            state.upsert_policy(policy(str(name), [[]], namespace=str(ns), scope=scope))  # type: ignore[arg-type]
        elif op[0] == "remove":
            state.remove_policy(str(op[1]))
        else:
            _, ns, keys = op
            w = replace(w, namespace=str(ns), authorization_policies=tuple(keys))  # type: ignore[arg-type]
            state.upsert_workload(w)
        got = [p.key for p in index.policies_for(w)]
        assert got == [p.key for p in state.policies_for(w)]
        assert [p.policy for p in index.policies_for(w)] == state.policies_for(w)
    assert sorted(p.key for p in index) == sorted(p.key for p in state.policies())


# --- local config YAML -> evaluation ----------------------------------------------------------


def y(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


LOCAL = y(
    """
    workloads:
    - uid: cluster1//v1/Pod/default/server
      name: server
      namespace: default
      serviceAccount: server
      trustDomain: cluster.local
      workloadIps: ["10.0.0.2"]
      protocol: HBONE
      authorizationPolicies: ["default/only-sleep"]
    - uid: cluster1//v1/Pod/other/db
      name: db
      namespace: other
      serviceAccount: db
      trustDomain: cluster.local
      workloadIps: ["10.0.1.2"]
      protocol: HBONE
    policies:
    - name: deny-9999
      namespace: default
      scope: Namespace
      action: Deny
      rules:
      - - - destinationPorts: [9999]
    - name: only-sleep
      namespace: default
      scope: WorkloadSelector
      action: Allow
      rules:
      - - - principals: [{Exact: cluster.local/ns/default/sa/sleep}]
          - principals: [{Prefix: cluster.local/ns/admin/}]
        - - notDestinationPorts: [15000]
      - - - sourceIps: ["192.168.0.0/16"]
            serviceAccounts: [{namespace: ops, serviceAccount: probe}]
    - name: strict
      namespace: istio-system
      scope: Global
      action: Deny
      rules:
      - - - notPrincipals: [{Presence: []}]
            notDestinationPorts: [8081]
    - name: watch-other
      namespace: other
      scope: Namespace
      action: Deny
      dryRun: true
      rules:
      - - - notNamespaces: [{Exact: other}]
    """
)


@pytest.fixture
def local() -> tuple[State, PolicyIndex, Workload, Workload]:
    cfg = load_local_config(LOCAL, "local.yaml")
    state = State()
    index = PolicyIndex.from_state(state)
    cfg.apply_to(state)
    server = state.find_workload_by_uid("cluster1//v1/Pod/default/server")
    db = state.find_workload_by_uid("cluster1//v1/Pod/other/db")
    assert server is not None and db is not None
    return state, index, server, db


def sid(ns: str, name: str) -> Identity:
    return Identity("cluster.local", ns, name)


@pytest.mark.parametrize(
    ("src_ip", "identity", "port", "allowed", "by"),
    [
        ("10.0.9.9", sid("default", "sleep"), 8080, True, "default/only-sleep"),
        ("10.0.9.9", sid("admin", "tool"), 8080, True, "default/only-sleep"),
        ("10.0.9.9", sid("default", "sleep"), 15000, False, None),  # second clause fails
        ("10.0.9.9", sid("default", "other"), 8080, False, None),
        ("192.168.3.4", sid("ops", "probe"), 8080, True, "default/only-sleep"),
        ("10.0.9.9", sid("ops", "probe"), 8080, False, None),
        ("10.0.9.9", sid("default", "sleep"), 9999, False, "default/deny-9999"),
        ("10.0.9.9", None, 8080, False, "istio-system/strict"),  # STRICT
        ("192.168.3.4", None, 8081, False, None),  # permissive port: strict passes, allow fails
    ],
)
def test_local_config_to_decision(
    local: tuple[State, PolicyIndex, Workload, Workload],
    src_ip: str,
    identity: Identity | None,
    port: int,
    allowed: bool,
    by: str | None,
) -> None:
    state, index, server, _ = local
    c = conn(src_ip, identity, "10.0.0.2", port)
    d = index.evaluate(server, c)
    assert (d.allowed, d.policy) == (allowed, by)
    assert evaluate(state.policies_for(server), c) == d
    assert explain(state, identity or src_ip, server, port, src_ip=src_ip).decision == d


def test_local_config_dry_run(local: tuple[State, PolicyIndex, Workload, Workload]) -> None:
    _, index, _, db = local
    d = index.evaluate(db, conn("10.0.9.9", sid("default", "sleep"), "10.0.1.2", 5432))
    assert d.allowed and d.dry_run_differs
    assert d.dry_run_summary() == "would deny: explicitly denied by: other/watch-other"
    d = index.evaluate(db, conn("10.0.9.9", sid("other", "app"), "10.0.1.2", 5432))
    assert d.allowed and not d.dry_run_differs and d.would_allow is True


# --- explain ----------------------------------------------------------------------------------


def test_explain_deny(local: tuple[State, PolicyIndex, Workload, Workload]) -> None:
    _, index, server, _ = local
    ex = explain(index, "spiffe://cluster.local/ns/default/sa/x", server, 9999)
    assert not ex.decision.allowed and ex.decision.policy == "default/deny-9999"
    by_key = {p.key: p for p in ex.policies}
    assert list(by_key) == ["default/deny-9999", "istio-system/strict", "default/only-sleep"]
    assert by_key["default/deny-9999"].via is AppliesVia.NAMESPACE
    assert by_key["istio-system/strict"].via is AppliesVia.GLOBAL
    assert by_key["default/only-sleep"].via is AppliesVia.SELECTOR
    assert by_key["default/deny-9999"].matched
    assert "rule[0] matched" in by_key["default/deny-9999"].why()
    assert "destinationPorts [9999]: 9999 matches 9999 -> ok" in by_key["default/deny-9999"].why()
    strict_why = by_key["istio-system/strict"].why()
    assert "notPrincipals [presence]" in strict_why and "FAILED" in strict_why
    text = str(ex)
    assert "decision:    DENY: explicitly denied by: default/deny-9999" in text
    assert "source IP not given" in text  # no IP was passed
    doc = ex.to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["decision"]["policy"] == "default/deny-9999"
    assert [p["appliesVia"] for p in doc["policies"]] == ["namespace", "global", "workloadSelector"]


def test_explain_allow_and_reasons(local: tuple[State, PolicyIndex, Workload, Workload]) -> None:
    state, _, server, _ = local
    ex = explain(state, sid("admin", "tool"), server, 8080, src_ip="10.0.9.9")
    assert ex.decision.allowed and ex.decision.policy == "default/only-sleep"
    assert ex.notes == ()
    only = next(p for p in ex.policies if p.key == "default/only-sleep")
    why = only.why()
    assert why.startswith(
        "rule[0] matched: clause[0] match[1]: principals [prefix 'cluster.local/ns/admin/']"
    )
    assert "clause[1] match[0]: notDestinationPorts [15000]: 8080 matches none -> ok" in why

    ex = explain(state, sid("default", "nobody"), server, 8080, src_ip="10.0.9.9")
    assert ex.decision.reason == NOT_ALLOWED
    why = next(p for p in ex.policies if p.key == "default/only-sleep").why()
    assert why.startswith("no rule matched: rule[0] clause[0] failed: match[0]: principals")
    assert "rule[1] clause[0] failed" in why and "sourceIps" in why
    assert "DENY: allow policies exist, but none allowed" in str(ex)


def test_explain_sources(local: tuple[State, PolicyIndex, Workload, Workload]) -> None:
    state, index, server, db = local
    # A source workload: its identity and first IP.
    ex = explain(index, db, server, 8080)
    assert (
        ex.connection.src_identity == sid("other", "db") and str(ex.connection.src_ip) == "10.0.1.2"
    )
    # A bare IP: plaintext.
    ex = explain(index, parse_ip("10.0.9.9"), server, 8080)
    assert ex.connection.src_identity is None and ex.decision.policy == "istio-system/strict"
    ex = explain(index, "10.0.9.9", server, 8080)
    assert ex.connection.src_identity is None
    assert "plaintext (no identity)" in str(ex)
    ex = explain(index, None, server, 8080, dst_ip="10.0.0.2")
    assert "source IP not given: 0.0.0.0" in ex.notes[0]
    # Unknown policies the workload names are reported.
    ghost = replace(server, authorization_policies=("default/only-sleep", "default/ghost"))
    ex = explain(state, None, ghost, 8080)
    assert ex.unknown_policies == ("default/ghost",)
    assert "skipped unknown policy default/ghost" in str(ex)
    with pytest.raises(ValueError, match="no IP"):
        explain(index, None, replace(server, addresses=()), 8080)


def test_explain_empty_structures() -> None:
    w = wl("w", "a")
    ps = [
        policy("no-rules", namespace="a", scope=NAMESPACE),
        policy("empty-match", [[Match()]], namespace="a", scope=NAMESPACE),
        policy("no-clauses", [], namespace="a", scope=NAMESPACE, dry_run=True),
    ]
    ex = explain(PolicyIndex(ps), "10.1.1.1", w, 80)
    whys = {p.key: p.why() for p in ex.policies}
    assert whys["a/no-rules"] == "no rules: never matches"
    assert "only empty matches (skipped)" in whys["a/empty-match"]
    assert "no clauses: matches everything" in whys["a/no-clauses"]
    assert "dry-run" in str(ex) and "would allow" in str(ex)


# --- property: agreement with a straightforward reference evaluator -----------------------------
#
# Written from the reference text, independently of ztunnel.state.authz: plain nested loops over
# the model types, ipaddress containment, full SPIFFE URIs stripped here.


def ref_string(m: StringMatch, s: str) -> bool:
    if m.kind is StringMatchKind.EXACT:
        return s == m.value
    if m.kind is StringMatchKind.PREFIX:
        return s.startswith(m.value)
    if m.kind is StringMatchKind.SUFFIX:
        return s.endswith(m.value)
    return s != ""


def ref_field(positive: Sequence[object], negative: Sequence[object], test: object) -> bool:
    pred = test  # a callable on one value
    ok = True
    if positive:
        ok = False
        for v in positive:
            if pred(v):  # type: ignore[operator]
                ok = True
    if negative:
        for v in negative:
            if pred(v):  # type: ignore[operator]
                ok = False
    return ok


def ref_in(ip: IPAddr, n: IPNet) -> bool:
    return ip.version == n.version and ip in n


def ref_match(m: Match, c: Connection) -> bool:
    ident = c.src_identity
    uri = str(ident) if ident is not None else ""
    principal = uri[len("spiffe://") :] if uri.startswith("spiffe://") else None
    namespace = ident.namespace if ident is not None else ""
    results = [
        ref_field(m.namespaces, m.not_namespaces, lambda s: ref_string(s, namespace)),
        ref_field(
            m.service_accounts,
            m.not_service_accounts,
            lambda a: (
                ident is not None
                and a.namespace == ident.namespace
                and a.service_account == ident.service_account
            ),
        ),
        ref_field(
            m.principals,
            m.not_principals,
            lambda s: principal is not None and ref_string(s, principal),
        ),
        ref_field(m.source_ips, m.not_source_ips, lambda n: ref_in(c.src_ip, n)),
        ref_field(m.destination_ips, m.not_destination_ips, lambda n: ref_in(c.dst_ip, n)),
        ref_field(m.destination_ports, m.not_destination_ports, lambda p: p == c.dst_port),
    ]
    return all(results)


def ref_is_empty(m: Match) -> bool:
    return m == Match()


def ref_policy_matches(p: Authorization, c: Connection) -> bool:
    if not p.rules:
        return False
    for rule in p.rules:
        rule_ok = True
        for clause in rule.clauses:
            if not clause.matches:
                continue  # an empty clause counts as true
            clause_ok = False
            for m in clause.matches:
                if ref_is_empty(m):
                    continue  # skipped
                if ref_match(m, c):
                    clause_ok = True
            if not clause_ok:
                rule_ok = False
        if rule_ok:
            return True
    return False


def ref_decide(policies: Sequence[Authorization], c: Connection) -> tuple[bool, str | None, str]:
    enforced = [p for p in policies if not p.dry_run]
    for p in enforced:
        if p.action is DENY and ref_policy_matches(p, c):
            return False, p.key, f"explicitly denied by: {p.key}"
    allows = [p for p in enforced if p.action is ALLOW]
    if not allows:
        return True, None, "no allow policies"
    for p in allows:
        if ref_policy_matches(p, c):
            return True, p.key, f"allowed by: {p.key}"
    return False, None, "allow policies exist, but none allowed"


NS_VALUES = ["", "a", "b", "ns", "ns-alt", "alt"]
PRINCIPAL_VALUES = [
    "",
    "td/ns/a/sa/x",
    "cluster.local/ns/a/sa/default",
    "cluster.local/",
    "td/",
    "/sa/x",
    "sa/default",
    "spiffe://td/ns/a/sa/x",
]
IPS = ["10.0.0.1", "10.0.0.2", "10.0.1.7", "192.168.1.1", "::1", "2001:db8::5", "::ffff:10.0.0.1"]
NETS = [
    "10.0.0.0/24",
    "10.0.0.1/32",
    "10.0.0.0/8",
    "0.0.0.0/0",
    "::/0",
    "2001:db8::/32",
    "::1/128",
    "192.168.0.0/16",
]
PORTS = [80, 443, 8080, 9999]


def string_matches(values: list[str]) -> st.SearchStrategy[tuple[StringMatch, ...]]:
    one_sm = st.one_of(
        st.builds(StringMatch, st.sampled_from(list(StringMatchKind)[:3]), st.sampled_from(values)),
        st.just(PRESENCE),
    )
    return st.lists(one_sm, min_size=1, max_size=3).map(tuple)


FIELD_STRATEGIES: dict[str, st.SearchStrategy[tuple[object, ...]]] = {
    "namespaces": string_matches(NS_VALUES),
    "not_namespaces": string_matches(NS_VALUES),
    "principals": string_matches(PRINCIPAL_VALUES),
    "not_principals": string_matches(PRINCIPAL_VALUES),
    **{
        k: st.lists(
            st.builds(sa, st.sampled_from(["a", "b", ""]), st.sampled_from(["x", "default"])),
            min_size=1,
            max_size=2,
        ).map(tuple)
        for k in ("service_accounts", "not_service_accounts")
    },
    **{
        k: st.lists(st.sampled_from(NETS).map(net), min_size=1, max_size=2).map(tuple)
        for k in ("source_ips", "not_source_ips", "destination_ips", "not_destination_ips")
    },
    **{
        k: st.lists(st.sampled_from(PORTS), min_size=1, max_size=2).map(tuple)
        for k in ("destination_ports", "not_destination_ports")
    },
}


@st.composite
def matches(draw: st.DrawFn) -> Match:
    fields = draw(st.lists(st.sampled_from(sorted(FIELD_STRATEGIES)), max_size=3, unique=True))
    return Match(**{f: draw(FIELD_STRATEGIES[f]) for f in fields})  # type: ignore[arg-type]


RULES = st.lists(
    st.lists(st.lists(matches(), max_size=3).map(lambda ms: Clause(tuple(ms))), max_size=3).map(
        lambda cs: Rule(tuple(cs))
    ),
    max_size=3,
).map(tuple)


@st.composite
def policies(draw: st.DrawFn) -> list[Authorization]:
    n = draw(st.integers(0, 4))
    return [
        Authorization(
            f"p{i}",
            "ns",
            GLOBAL,
            draw(st.sampled_from([ALLOW, DENY])),
            draw(RULES),
            draw(st.booleans()),
        )
        for i in range(n)
    ]


IDENTITIES = st.one_of(
    st.none(),
    st.builds(
        Identity,
        st.sampled_from(["td", "cluster.local"]),
        st.sampled_from(["a", "b", "ns-alt"]),
        st.sampled_from(["x", "default"]),
    ),
)
CONNECTIONS = st.builds(
    Connection,
    st.sampled_from(IPS).map(parse_ip),
    IDENTITIES,
    st.sampled_from(IPS).map(parse_ip),
    st.sampled_from(PORTS),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pols=policies(), c=CONNECTIONS)
def test_evaluate_agrees_with_reference(pols: list[Authorization], c: Connection) -> None:
    d = evaluate(pols, c)
    assert (d.allowed, d.policy, d.reason) == ref_decide(pols, c)
    for p in pols:
        assert CompiledPolicy(p).matches(c) is ref_policy_matches(p, c)
    # Dry-run: every dry-run policy reported, and the "would" decision is the decision with all
    # policies enforced.
    dry = [p for p in pols if p.dry_run]
    assert [(o.policy, o.matched) for o in d.dry_run] == [
        (p.key, ref_policy_matches(p, c)) for p in dry
    ]
    if dry:
        would = ref_decide([replace(p, dry_run=False) for p in pols], c)
        assert d.would_allow is would[0]
        if d.would_policy is not None:
            decider = next(p for p in pols if p.key == d.would_policy)
            assert ref_policy_matches(decider, c)
            assert (decider.action is ALLOW) is d.would_allow
        else:
            assert would[1] is None and d.would_reason == would[2]
    else:
        assert d.would_allow is None and d.dry_run == ()
    # The explanation agrees with both.
    dst = Workload(uid="u", name="d", namespace="ns", addresses=(c.dst_ip,))
    ex = explain(
        PolicyIndex(pols), c.src_identity, dst, c.dst_port, src_ip=c.src_ip, dst_ip=c.dst_ip
    )
    assert ex.decision == d
    assert [(t.key, t.matched) for t in ex.policies] == [
        (p.key, ref_policy_matches(p, c)) for p in pols
    ]


def test_connections_from_one_peer_share_derived_values() -> None:
    ident = Identity("cluster.local", "ns", "sa")
    a = conn("10.1.2.3", ident, "10.9.9.9")
    b = conn("10.1.2.3", Identity("cluster.local", "ns", "sa"), "10.9.9.9")
    assert a.principal == "cluster.local/ns/ns/sa/sa" and a.src_sa == ("ns", "sa")
    assert a.principal is b.principal and a.src_sa is b.src_sa
    assert a.src_key == b.src_key and a.dst_key == b.dst_key
    v6 = conn("::ffff:10.1.2.3", ident, "10.9.9.9")  # canonicalised before the key is taken
    assert v6.src_key == a.src_key
    assert conn("::1").src_key != conn("0.0.0.1").src_key  # families stay apart


# --- decision logs (Rust src/state.rs assert_rbac, authpol_log!) -----------------------------


def ref_rbac_log(policies: Sequence[Authorization], c: Connection) -> list[tuple[str, str | None]]:
    """Rust ``assert_rbac``'s loop, line for line: partition into deny/allow then dry-run,
    log each match in that order, return at the first decision."""
    deny = [p for p in policies if p.action is DENY and not p.dry_run]
    deny_dry = [p for p in policies if p.action is DENY and p.dry_run]
    allow = [p for p in policies if p.action is ALLOW and not p.dry_run]
    allow_dry = [p for p in policies if p.action is ALLOW and p.dry_run]
    out: list[tuple[str, str | None]] = []
    for p in deny_dry:
        if ref_policy_matches(p, c):
            out.append(("dry-run: deny policy match", p.key))
    for p in deny:
        if ref_policy_matches(p, c):
            out.append(("deny policy match", p.key))
            return out
    dry_allow_matched = False
    for p in allow_dry:
        if ref_policy_matches(p, c):
            dry_allow_matched = True
            out.append(("dry-run: allow policy match", p.key))
    if not allow and allow_dry and not dry_allow_matched:
        out.append(("dry-run: no allow policies match", None))
    if not allow:
        out.append(("no allow policies, allow", None))
        return out
    for p in allow:
        if ref_policy_matches(p, c):
            out.append(("allow policy match", p.key))
            return out
    out.append(("no allow policies matched", None))
    return out


@pytest.mark.parametrize(
    ("pols", "identity", "lines"),
    [
        ([], "a", [("no allow policies, allow", None)]),
        ([policy("allow-a", [[NS_A]])], "a", [("allow policy match", "namespace/allow-a")]),
        ([policy("allow-a", [[NS_A]])], "b", [("no allow policies matched", None)]),
        (
            [policy("deny-a", [[NS_A]], action=DENY), policy("allow-a", [[NS_A]])],
            "a",
            [("deny policy match", "namespace/deny-a")],
        ),
        (
            [
                policy("dry-deny", [[NS_A]], action=DENY, dry_run=True),
                policy("deny-a", [[NS_A]], action=DENY),
                policy("dry-allow", [[NS_A]], dry_run=True),
            ],
            "a",
            # dry-run DENYs are logged before the enforced DENY; dry-run ALLOWs only after it
            [
                ("dry-run: deny policy match", "namespace/dry-deny"),
                ("deny policy match", "namespace/deny-a"),
            ],
        ),
        (
            [policy("dry-allow", [[NS_A]], dry_run=True)],
            "b",
            [("dry-run: no allow policies match", None), ("no allow policies, allow", None)],
        ),
        (
            [policy("dry-allow", [[NS_A]], dry_run=True), policy("allow-b", [[NS_B]])],
            "a",
            [
                ("dry-run: allow policy match", "namespace/dry-allow"),
                ("no allow policies matched", None),
            ],
        ),
    ],
)
def test_decision_log_is_rusts(
    pols: list[Authorization], identity: str, lines: list[tuple[str, str | None]]
) -> None:
    c = conn(identity=ident(identity))
    assert decision_log(evaluate(pols, c)) == lines == ref_rbac_log(pols, c)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pols=policies(), c=CONNECTIONS)
def test_decision_log_agrees_with_rusts_loop(pols: list[Authorization], c: Connection) -> None:
    assert decision_log(evaluate(pols, c)) == ref_rbac_log(pols, c)
