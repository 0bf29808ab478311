"""Benchmark L4 authorization (ztunnel.state.authz): one connection against 10,000 policies.

Usage: ``python benchmarks/bench_authz.py [--policies 10000] [--rules 10] [--namespaces 1000]
[--samples 31] [--quick]``

The policy shape is the Rust ``benches/throughput.rs`` ``rbac`` case, written here: every policy
is a DENY whose rules each hold one match with namespaces and principals (prefix, suffix, exact),
``sourceIps`` and ``destinationIps`` 198.51.100.0/24 and ``destinationPorts [0]``; the
connection is plaintext 127.0.0.1:12345 -> 127.0.0.2:12345, so no policy matches and every
applicable rule is evaluated (a deny list's worst case). Here the policies are namespace-scoped
and spread over ``--namespaces`` namespaces (10 per namespace by default); the destination
workload lives in one of them.

Cases, in CPU microseconds per connection (median over ``--samples`` batches of ~20 ms):

* ``index``: ``PolicyIndex.evaluate(workload, conn)`` (cached applicable set; the hot path);
* ``index+conn``: the same plus building the ``Connection`` (what a proxy pays per connection);
* ``index, mTLS``: a source with an identity;
* ``index, every test runs``: rules whose tests all pass but the last one checked (principal),
  so each rule costs five tests instead of one;
* ``index, 10x fewer policies``: the same applicable policies with 10x fewer elsewhere: equal to
  ``index`` within noise, i.e. the lookup does not grow with unrelated namespaces;
* ``no index: scan``: select the applicable policies by scanning all compiled policies, then
  evaluate (what it costs if lookups grew with the policy count);
* ``State.policies_for + evaluate``: the raw ``Authorization`` objects from the State (their
  compiled form remembered by identity inside ``evaluate``);
* ``compile every call``: the same, compiling the applicable policies on every call (the cost a
  policy change adds to the next connection);
* ``worst: all global``: the Rust bench's own placement, every policy GLOBAL so all 10,000 apply:
  this one must grow with the policy count (10,000 x 10 rules evaluated).

The cheap cases run interleaved, sample by sample, so load on the (shared) machine hits them
alike. CPU time (``time.process_time``) rather than wall time, for the same reason.
Writes ``benchmarks/results/authz.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import ipaddress
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ztunnel.core.addr import parse_ip  # noqa: E402
from ztunnel.core.identity import Identity  # noqa: E402
from ztunnel.state.authz import (  # noqa: E402
    CompiledPolicy,
    Connection,
    PolicyIndex,
    PolicySet,
    evaluate,
)
from ztunnel.state.model import (  # noqa: E402
    Authorization,
    Clause,
    Match,
    PolicyAction,
    PolicyScope,
    Rule,
    StringMatch,
    StringMatchKind,
    Workload,
)
from ztunnel.state.store import State  # noqa: E402

DUMMY_NETWORK = ipaddress.ip_network("198.51.100.0/24")


def rust_bench_rules(n_rules: int) -> tuple[Rule, ...]:
    sms = (
        StringMatch(StringMatchKind.PREFIX, "random-prefix-2b123"),
        StringMatch(StringMatchKind.SUFFIX, "random-postix-2b723"),
        StringMatch(StringMatchKind.EXACT, "random-exac-2bc13"),
    )
    m = Match(
        namespaces=sms,
        principals=sms,
        source_ips=(DUMMY_NETWORK,),
        destination_ips=(DUMMY_NETWORK,),
        destination_ports=(0,),
    )
    return tuple(Rule((Clause((m,)),)) for _ in range(n_rules))


def all_tests_run_rules(n_rules: int) -> tuple[Rule, ...]:
    """Every test passes for the mTLS connection except the principal, which is checked last."""
    m = Match(
        destination_ports=(12345,),
        destination_ips=(ipaddress.ip_network("127.0.0.0/8"),),
        source_ips=(ipaddress.ip_network("127.0.0.0/8"),),
        namespaces=(StringMatch(StringMatchKind.PREFIX, "ns-"),),
        principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/nobody"),),
    )
    return tuple(Rule((Clause((m,)),)) for _ in range(n_rules))


def make_policies(
    n: int, n_ns: int, scope: PolicyScope, rules: tuple[Rule, ...]
) -> list[Authorization]:
    return [
        Authorization(
            name=f"policy-{i}",
            namespace=f"ns-{i % n_ns}",
            scope=scope,
            action=PolicyAction.DENY,
            rules=rules,
        )
        for i in range(n)
    ]


def _batch_size(fn: Callable[[], object], target_s: float) -> int:
    clock = time.process_time
    fn()
    n = 1
    while True:
        t0 = clock()
        for _ in range(n):
            fn()
        dt = clock() - t0
        if dt >= target_s / 4 or n >= 1 << 20:
            return max(1, int(n * target_s / max(dt, 1e-9)))
        n *= 2


def measure(
    fns: dict[str, Callable[[], object]], samples: int, target_s: float = 0.02
) -> dict[str, dict[str, Any]]:
    """CPU microseconds per call: ``samples`` batches of ~target_s each, the functions taking
    turns batch by batch; median, p10 and p90 over the batches."""
    clock = time.process_time
    batches = {name: _batch_size(fn, target_s) for name, fn in fns.items()}
    per: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()
    try:
        for _ in range(samples):
            for name, fn in fns.items():
                b = batches[name]
                t0 = clock()
                for _ in range(b):
                    fn()
                per[name].append((clock() - t0) / b * 1e6)
    finally:
        gc.enable()
    out = {}
    for name, xs in per.items():
        xs.sort()
        out[name] = {
            "us_median": statistics.median(xs),
            "us_p10": xs[len(xs) // 10],
            "us_p90": xs[(len(xs) * 9) // 10],
            "batch": batches[name],
            "samples": samples,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--policies", type=int, default=10_000)
    ap.add_argument("--rules", type=int, default=10)
    ap.add_argument("--namespaces", type=int, default=1_000)
    ap.add_argument("--samples", type=int, default=31)
    ap.add_argument("--quick", action="store_true", help="7 samples")
    args = ap.parse_args()
    samples = 7 if args.quick else args.samples
    bench_rules = rust_bench_rules(args.rules)

    policies = make_policies(args.policies, args.namespaces, PolicyScope.NAMESPACE, bench_rules)
    state = State()
    t0 = time.perf_counter()
    for p in policies:
        state.upsert_policy(p)
    t_state = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = PolicyIndex.from_state(state)
    t_index = time.perf_counter() - t0

    dst_ns = "ns-7"
    wl = Workload(
        uid=f"cluster1//v1/Pod/{dst_ns}/server",
        name="server",
        namespace=dst_ns,
        addresses=(parse_ip("127.0.0.2"),),
    )
    state.upsert_workload(wl)
    src_ip, dst_ip = parse_ip("127.0.0.1"), parse_ip("127.0.0.2")
    plain = Connection(src_ip, None, dst_ip, 12345)
    mtls = Connection(src_ip, Identity("cluster.local", dst_ns, "client"), dst_ip, 12345)
    t0 = time.perf_counter()
    first = index.evaluate(wl, plain)  # cold: builds the applicable set, compiles its policies
    t_first = time.perf_counter() - t0
    applicable = len(index.policies_for(wl))
    assert applicable == len(state.policies_for(wl)) > 0
    assert first.allowed and index.evaluate(wl, mtls).allowed

    every_test = PolicyIndex(
        make_policies(
            args.policies, args.namespaces, PolicyScope.NAMESPACE, all_tests_run_rules(args.rules)
        )
    )
    assert every_test.evaluate(wl, mtls).allowed
    n_small = max(args.policies // 10, applicable)
    small = PolicyIndex(
        make_policies(n_small, max(args.namespaces // 10, 1), PolicyScope.NAMESPACE, bench_rules)
    )
    assert len(small.policies_for(wl)) == applicable

    all_compiled = list(index)  # compiles all 10,000: the scan gets compiled policies for free

    def scan() -> object:
        ns, sel = wl.namespace, wl.authorization_policies
        return PolicySet(
            p
            for p in all_compiled
            if (p.scope is PolicyScope.NAMESPACE and p.policy.namespace == ns)
            or p.scope is PolicyScope.GLOBAL
            or p.key in sel
        ).evaluate(plain)

    print(
        f"{args.policies} policies x {args.rules} rules over {args.namespaces} namespaces; "
        f"{applicable} apply to {wl.namespace}/{wl.name}; index built in {t_index * 1e3:.0f} ms, "
        f"first (cold) evaluation {t_first * 1e6:.0f} us"
    )
    results = measure(
        {
            "index": lambda: index.evaluate(wl, plain),
            "index+conn": lambda: index.evaluate(wl, Connection(src_ip, None, dst_ip, 12345)),
            "index, mTLS": lambda: index.evaluate(wl, mtls),
            "index, every test runs": lambda: every_test.evaluate(wl, mtls),
            f"index, {n_small} policies total": lambda: small.evaluate(wl, plain),
        },
        samples,
    )
    results.update(
        measure(
            {
                "no index: scan": scan,
                "State.policies_for + evaluate": lambda: evaluate(state.policies_for(wl), plain),
                "compile every call": lambda: PolicySet(
                    CompiledPolicy(p) for p in state.policies_for(wl)
                ).evaluate(plain),
            },
            max(5, samples // 3),
        )
    )
    global_idx = PolicyIndex(
        make_policies(args.policies, args.namespaces, PolicyScope.GLOBAL, bench_rules)
    )
    assert len(global_idx.policies_for(wl)) == args.policies
    results.update(measure({"worst: all global": lambda: global_idx.evaluate(wl, plain)}, 5, 0.2))
    for name, r in results.items():
        print(
            f"  {name:<32} {r['us_median']:>11.2f} us/conn"
            f"  (p10 {r['us_p10']:.2f}, p90 {r['us_p90']:.2f})"
        )

    idx_us = results["index"]["us_median"]
    doc = {
        "command": "python benchmarks/bench_authz.py" + (" --quick" if args.quick else ""),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
        },
        "params": {
            "policies": args.policies,
            "rules_per_policy": args.rules,
            "namespaces": args.namespaces,
            "applicable_policies": applicable,
            "samples": samples,
            "clock": "process_time (CPU)",
        },
        "setup_s": {
            "state_upserts": t_state,
            "index_build": t_index,
            "first_evaluation_cold": t_first,
        },
        "us_per_connection": {k: v["us_median"] for k, v in results.items()},
        "us_per_applicable_rule": idx_us / max(applicable * args.rules, 1),
        "runs": results,
    }
    out = ROOT / "benchmarks" / "results" / "authz.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"index: {idx_us:.1f} us per connection against {args.policies} policies "
        f"({applicable} applicable); wrote {out.relative_to(ROOT)}"
    )


if __name__ == "__main__":
    main()
