"""What a worker rebuilds from the supervisor's messages: the state (it maps the supervisor's
store and is told what each commit changed), certificates (DER bundles), and one metrics
exposition summed over processes."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.core.identity import Identity
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import TLS_POLICY_MEMO, TlsPolicy
from ztunnel.metrics import Family, HistogramFamily, encode, merged_registry, registry_values
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.store import ChangeKind, State, StateChange
from ztunnel.workers import messages as m
from ztunnel.workers.supervisor import cert_bundle
from ztunnel.workers.worker import cert_from_bundle

pytestmark = pytest.mark.timeout(30)

LOCAL = """
workloads:
- uid: c//v1/Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: sa
  workloadIps: ["10.0.0.1"]
  services: {"ns/svc.ns.svc.cluster.local": {80: 8080}}
services:
- name: svc
  namespace: ns
  hostname: svc.ns.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
policies:
- name: deny-all
  namespace: ns
  scope: Namespace
  action: Deny
  rules: [[[{"notDestinationPorts": [1]}]]]
"""


def test_a_worker_sees_every_commit_it_is_told_about() -> None:
    src = State()
    sent: list[bytes] = []

    def tell(changes: list[StateChange]) -> None:  # (what WorkerPool._on_commit sends)
        msg = m.StateChanged([(c.kind.value, c.key, c.removed, c.ref) for c in changes])
        sent.append(pickle.dumps(msg))

    src.on_commit(tell)
    with src.batch():
        load_local_config(LOCAL, "test").apply_to(src)
    replica = State(store=src.store.reader())  # a worker: the same store, read-only
    seen: list[StateChange] = []
    replica.subscribe(seen.append)
    (w,) = replica.workloads()
    assert w.uid == "c//v1/Pod/ns/a"
    (svc,) = replica.services()
    assert [e.uid for e in replica.endpoints(svc)] == [w.uid]
    assert [p.key for p in replica.policies_for(w)] == [p.key for p in src.policies_for(w)]
    assert replica.find_workload_by_uid(w.uid) == w  # (now in its cache)
    with src.batch():
        src.remove_workload(w.uid)
        src.remove_policy("ns/deny-all")
    # Until it is told, the worker keeps reading the snapshot it has: never half of a commit.
    assert replica.find_workload_by_uid(w.uid) == w
    msg = pickle.loads(sent[-1])
    replica.apply_changes(
        StateChange(ChangeKind(k), key, rm, ref) for k, key, rm, ref in msg.changes
    )
    assert replica.find_workload_by_uid(w.uid) is None
    assert not list(replica.workloads()) and not list(replica.policies())
    assert replica.endpoints(svc) == []
    assert [(c.kind, c.key, c.removed) for c in seen] == [
        (ChangeKind.WORKLOAD, w.uid, True),
        (ChangeKind.POLICY, "ns/deny-all", True),
    ]
    replica.close()
    replica.store.close()


def test_certificate_bundle_round_trip() -> None:
    ca = LocalCA.ephemeral(trust_domain="cluster.local")
    ident = Identity("cluster.local", "ns", "sa")
    import asyncio

    cert = asyncio.run(ca.sign(ident))
    policy = TlsPolicy(tls12=False)
    copy = cert_from_bundle(pickle.loads(pickle.dumps(cert_bundle(cert))), policy)
    assert copy.identity == ident
    assert copy.leaf == cert.leaf and copy.roots == cert.roots
    assert copy.intermediates == cert.intermediates
    assert copy.memo(TLS_POLICY_MEMO, lambda: None) is policy


def _registry(n: int) -> tuple[CollectorRegistry, Family, HistogramFamily]:
    reg = CollectorRegistry()
    fam = Family("t_conns", "conns", "counter", ("reporter",), registry=reg)
    hist = HistogramFamily("t_dur", "dur", ("k",), ((0.1, "0.1"), (1.0, "1.0")), registry=reg)
    fam.labels("source").inc(n)
    hist.observe(("x",), 0.05 * n)
    return reg, fam, hist


def test_metrics_of_every_process_are_summed_by_series() -> None:
    sup, sup_fam, _ = _registry(1)
    w1, _, _ = _registry(2)
    w2, fam2, _ = _registry(3)
    fam2.labels("destination").inc(7)  # a series only one worker has
    others = [pickle.loads(pickle.dumps(registry_values(r))) for r in (w1, w2)]
    text = encode(merged_registry(sup, others)).decode()
    assert 't_conns_total{reporter="source"} 6' in text
    assert 't_conns_total{reporter="destination"} 7' in text
    assert 't_dur_count{k="x"} 3' in text
    assert 't_dur_bucket{k="x",le="0.1"} 2' in text  # 0.05 and 0.1; 0.15 is above
    assert text.count("# TYPE t_conns counter") == 1
    # The supervisor's own cells are not changed by a scrape.
    assert sup_fam.labels("source").get() == 1


def test_repeated_scrapes_do_not_accumulate_and_drop_vanished_series() -> None:
    sup, _, _ = _registry(1)
    w1, fam1, _ = _registry(2)
    memo: dict[str, dict[tuple[str, ...], Any]] = {}
    fam1.labels("gone").inc(5)
    first = encode(merged_registry(sup, [registry_values(w1)], memo)).decode()
    assert 't_conns_total{reporter="source"} 3' in first
    assert 't_dur_count{k="x"} 2' in first
    values = registry_values(w1)
    del values["t_conns"][("gone",)]
    second = encode(merged_registry(sup, [values], memo)).decode()
    assert 't_conns_total{reporter="source"} 3' in second  # the same, not 6
    assert 't_dur_count{k="x"} 2' in second
    assert "gone" not in second


def test_cumulative_values_add_up_and_gauges_are_left_out() -> None:
    from ztunnel.metrics import add_values, cumulative_families

    reg, _, _ = _registry(1)
    Family("t_open", "open", "gauge", ("k",), registry=reg).labels("x").set(3)
    names = cumulative_families(reg)
    assert names == {"t_conns", "t_dur"}
    acc: dict[str, dict[tuple[str, ...], Any]] = {}
    add_values(acc, registry_values(reg), names)
    add_values(acc, registry_values(reg), names)
    assert acc["t_conns"][("source",)] == 2
    assert acc["t_dur"][("x",)][2] == 2  # the count of two histograms
    assert "t_open" not in acc
