"""istiod may send anything: what does not fit is refused with a clear error, a metric and a
NACK, nothing of it is applied, memory stays bounded, and every worker keeps serving the last
good state.

Two shared-mode ztunnels fed by one fake istiod, with a small state store
(``ZTUNNEL_STATE_MAX_BYTES`` = 8 MiB). A pod ``c1`` on n1 calls ``s1`` on n2 over HBONE before
and after each bad push.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ztunnel.testing import meshgen
from ztunnel.testing.apps import App, connect_from, recv_line, start_app
from ztunnel.testing.xdsbed import MeshPod, XdsMesh, http_get, metric, xds_mesh
from ztunnel.xds.client import ADDRESS_TYPE_URL
from ztunnel.xds.convert import address_to_proto
from ztunnel.xds.protos import workload_pb2 as wl_pb

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(180),
]

PODS = (MeshPod("c1", "n1", "sa-c1"), MeshPod("s1", "n2", "sa-s1"))
STORE = 8 << 20


@pytest.fixture(scope="module")
def mesh() -> Iterator[tuple[XdsMesh, App]]:
    with xds_mesh(PODS, extra_env={"ZTUNNEL_STATE_MAX_BYTES": str(STORE)}) as m:
        for zt in m.ztunnels.values():  # (the refusals below are logged as errors, rightly)
            zt.expected_errors += ["not applied: ", "xDS NACK ", "allowed; retrying in"]
        echo = start_app(m.pods["s1"], "echo")
        try:
            yield m, echo
        finally:
            echo.stop()


def _hbone_echo(m: XdsMesh, msg: str) -> None:
    """c1 -> s1 works, and over HBONE (s1's ztunnel logs c1's identity)."""
    with connect_from(m.pods["c1"], m.pods["s1"].ip4, 8080, timeout=10) as s:
        s.sendall(f"{msg}\n".encode())
        assert recv_line(s, timeout=10) == msg
    m.ztunnel_of("s1").wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("src.identity") == "spiffe://cluster.local/ns/default/sa/sa-c1"
            and r.get("direction") == "inbound"
        ),
        start=max(0, len(m.ztunnel_of("s1").records) - 50),
    )


def _metric(m: XdsMesh, node: str, name: str, **labels: str) -> float:
    _, body = http_get(m.nodes[node], 15020, "/metrics")
    return metric(body, name, **labels)


def test_a_state_too_big_for_the_store_is_nacked_whole_and_the_last_state_kept(
    mesh: tuple[XdsMesh, App],
) -> None:
    m, _ = mesh
    _hbone_echo(m, "before")
    # 20,000 pods (about 15 MiB of records) in one response: more than the store holds.
    big = meshgen.mesh(20_000, 1_000)
    nonces = m.istiod.call(m.istiod.istiod.set_addresses, *big.services, *big.workloads)
    answers = m.istiod.answers(nonces, timeout=60)
    assert answers and all(a.is_nack for a in answers), answers
    for a in answers:
        assert "not applied: the state does not fit in the store (8 MiB)" in a.error_message
    # Nothing of it was applied, readiness holds, and every worker still serves the old state.
    for node in m.nodes:
        assert m.readiness(node) == (200, "ready\n")
        assert _metric(m, node, "ztunnel_xds_refused_total", reason="state_store_full") >= 1
        assert _metric(m, node, "ztunnel_state_objects", kind="workloads") == 2
    for i in range(6):  # (several connections: both workers of each node)
        _hbone_echo(m, f"after-{i}")
    # istiod takes them back: later pushes apply again.
    m.istiod.call(
        m.istiod.istiod.remove_addresses,
        *(w.uid for w in big.workloads),
        *(s.key for s in big.services),
    )
    ok = m.istiod.answers(m.istiod.call(m.istiod.istiod.set_addresses, *big.services[:10]))
    assert ok and all(a.is_ack for a in ok), ok


def test_a_resource_over_1_mib_is_nacked_alone(mesh: tuple[XdsMesh, App]) -> None:
    m, _ = mesh
    huge = wl_pb.Workload(
        uid="Kubernetes//Pod/default/huge", name="huge", namespace="default", node="n1"
    )
    huge.authorization_policies.extend(f"default/policy-{i:06d}" for i in range(80_000))
    small = meshgen.pod(1, 0)
    nonces = m.istiod.call(
        m.istiod.istiod.push,
        ADDRESS_TYPE_URL,
        [(huge.uid, wl_pb.Address(workload=huge)), (small.uid, address_to_proto(small))],
    )
    answers = m.istiod.answers(nonces)
    assert answers and all(a.is_nack for a in answers)
    for a in answers:
        assert a.error_message.startswith("Kubernetes//Pod/default/huge: resource of ")
        assert "larger than the 1048576 allowed" in a.error_message
        assert small.uid not in a.error_message
    for node in m.nodes:  # (the small one was applied beside it)
        assert _metric(m, node, "ztunnel_state_objects", kind="workloads") == 3
        assert _metric(m, node, "ztunnel_xds_refused_total", reason="resource_too_large") >= 1
    m.istiod.call(m.istiod.istiod.remove_addresses, huge.uid, small.uid)
    _hbone_echo(m, "still")


def test_a_message_over_200_mib_restarts_the_stream_with_memory_bounded(
    mesh: tuple[XdsMesh, App],
) -> None:
    m, _ = mesh
    zt = m.ztunnels["n1"]
    before = zt.tree_rss_kib()
    start = len(zt.records)
    # One resource of 201 MiB: the message is over Rust's 200 MiB, refused before its body.
    m.istiod.call(m.istiod.istiod.push_raw, ADDRESS_TYPE_URL, "giant", b"\x00" * (201 << 20))
    rec = zt.wait_for(
        lambda r: "larger than the 209715200 allowed" in str(r.get("message")),
        timeout=60,
        start=start,
    )
    assert rec["level"] == "error"
    peak = zt.tree_rss_kib()
    m.istiod.call(m.istiod.istiod.remove_addresses, "giant")
    assert peak - before < 64 << 10, (before, peak)
    # Reconnected (with backoff), synced again and serving as before.
    deadline = time.monotonic() + 60
    while _metric(m, "n1", "ztunnel_xds_refused_total", reason="message_too_large") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    zt.wait_for(
        lambda r: (
            str(r.get("message", "")).startswith("xDS stream")
            and "established" in str(r.get("message"))
        ),
        timeout=60,
        start=start + 1,
    )
    _hbone_echo(m, "after-giant")
