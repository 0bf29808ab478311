"""A pod handed over before istiod sent its own workload (Rust ``proxy.rs`` ``get_workload``,
``state.rs`` ``wait_for_workload``: up to 5 s, then "failed to fetch information about local
workload").

Two shared-mode ztunnels fed by one fake istiod. The node agents hand every pod over, but istiod
starts without the workloads of ``late``/``late-in`` (pushed 2 s into a connection) and of
``never``/``never-in`` (never pushed). Outbound (a pod calling ``s1`` over HBONE) and inbound
plaintext (an outside client calling the pod) both wait, then go on, or are refused; nothing is
ever routed without the pod's workload (no plaintext to a mesh destination)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ztunnel.testing.apps import App, connect_from, recv_line, start_app
from ztunnel.testing.xdsbed import MeshPod, XdsMesh, xds_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(90),
]

PODS = (
    MeshPod("s1", "n2", "sa-s1"),
    MeshPod("late", "n1", "sa-late"),
    MeshPod("never", "n1", "sa-never"),
    MeshPod("late-in", "n2", "sa-late-in"),
    MeshPod("never-in", "n2", "sa-never-in"),
)
UNKNOWN = "failed to fetch information about local workload"


@pytest.fixture(scope="module")
def mesh() -> Iterator[tuple[XdsMesh, dict[str, App]]]:
    with xds_mesh(PODS, withhold=("late", "never", "late-in", "never-in")) as m:
        apps = {p: start_app(m.pods[p], "echo") for p in ("s1", "late-in", "never-in")}
        try:
            yield m, apps
        finally:
            for app in apps.values():
                app.stop()


def _push_later(m: XdsMesh, pod: str, delay: float) -> threading.Timer:
    timer = threading.Timer(
        delay, lambda: m.istiod.call(m.istiod.istiod.set_addresses, m.workload(pod))
    )
    timer.start()
    return timer


def _roundtrip(src: object, ip: str, msg: str) -> tuple[str, float]:
    """(the echoed line or the error, seconds until then)."""
    t0 = time.monotonic()
    try:
        with connect_from(src, ip, 8080, timeout=10) as s:  # type: ignore[arg-type]
            s.sendall(f"{msg}\n".encode())
            got = recv_line(s, timeout=15)
    except OSError as e:
        got = f"error: {e!r}"
    return got, time.monotonic() - t0


def test_outbound_waits_for_a_late_workload_then_goes_over_hbone(
    mesh: tuple[XdsMesh, dict[str, App]],
) -> None:
    m, _ = mesh
    timer = _push_later(m, "late", 2.0)
    try:
        got, took = _roundtrip(m.pods["late"], m.pods["s1"].ip4, "late-out")
    finally:
        timer.join()
    assert got == "late-out"
    assert 1.8 <= took < 5, took  # held until the workload came, not refused at once
    rec = m.ztunnel_of("s1").wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and str(r.get("src.addr", "")).startswith(f"{m.pods['late'].ip4}:")
        )
    )
    assert rec["src.identity"] == "spiffe://cluster.local/ns/default/sa/sa-late"  # mTLS


def test_outbound_of_a_pod_whose_workload_never_comes_is_refused(
    mesh: tuple[XdsMesh, dict[str, App]],
) -> None:
    m, _ = mesh
    got, took = _roundtrip(m.pods["never"], m.pods["s1"].ip4, "never-out")
    assert got.startswith("error"), got
    assert 4.5 <= took < 9, took
    rec = m.ztunnel_of("never").wait_for(
        lambda r: (
            r.get("message") == "connection failed"
            and str(r.get("src.addr", "")).startswith(f"{m.pods['never'].ip4}:")
        )
    )
    assert str(rec["error"]).startswith(UNKNOWN), rec
    assert rec["direction"] == "outbound"
    # Nothing of it reached s1, neither over HBONE nor in plaintext.
    assert not [
        r
        for r in m.ztunnel_of("s1").records
        if str(r.get("src.addr", "")).startswith(f"{m.pods['never'].ip4}:")
    ]


def test_inbound_waits_for_a_late_workload(mesh: tuple[XdsMesh, dict[str, App]]) -> None:
    m, _ = mesh
    timer = _push_later(m, "late-in", 2.0)
    try:
        got, took = _roundtrip(m.istiod_host, m.pods["late-in"].ip4, "late-in")
    finally:
        timer.join()
    assert got == "late-in"
    assert took >= 1.8, took


def test_inbound_to_a_pod_whose_workload_never_comes_is_refused(
    mesh: tuple[XdsMesh, dict[str, App]],
) -> None:
    m, _ = mesh
    got, took = _roundtrip(m.istiod_host, m.pods["never-in"].ip4, "never-in")
    assert not got.startswith("never-in"), "proxied to the app without its policies"
    assert 4.5 <= took < 9, took
    rec = m.ztunnel_of("never-in").wait_for(
        lambda r: (
            r.get("direction") == "inbound"
            and str(r.get("src.addr", "")).startswith(f"{m.istiod_host.ip4}:")
            and "error" in r
        )
    )
    # Rust inbound_passthrough: an early deny ("connection failed"), no connection counted.
    assert rec["message"] == "connection failed", rec
    assert str(rec["error"]).startswith(UNKNOWN), rec
