"""Two nodes, a ztunnel in each pod (dedicated mode), HBONE between them: pod A on node 1 reaches
pod B on node 2 through outbound 15001, mTLS HTTP/2 CONNECT to 15008, and the app."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from ztunnel.testing.apps import (
    Digest,
    connect_from,
    recv_digest,
    recv_line,
    send_payload,
    start_app,
)
from ztunnel.testing.hbone import Mesh, mesh
from ztunnel.testing.netns import Pod
from ztunnel.testing.proc import ZtunnelProcess

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root")]


@pytest.fixture(scope="module")
def m() -> Iterator[Mesh]:
    with mesh() as mm:
        yield mm


def _complete(zt: ZtunnelProcess, direction: str, port: int) -> dict[str, object]:
    return zt.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == direction
            and str(r.get("dst.hbone_addr", r.get("dst.addr", ""))).endswith(f":{port}")
        )
    )


@pytest.mark.parametrize("family", ["ip4", "ip6"])
def test_large_transfer_both_ways(m: Mesh, family: str) -> None:
    port_sink, port_source = (9001, 9002) if family == "ip4" else (9003, 9004)
    sink = start_app(m.b, "sink", ports=(port_sink,))
    source = start_app(m.b, "source", "--bytes", str(32 << 20), "--seed", "5", ports=(port_source,))
    dst = getattr(m.b, family)

    with connect_from(m.a, dst, port_sink, timeout=30) as s:
        sent = send_payload(s, 32 << 20, seed=9)
        s.shutdown(socket.SHUT_WR)
        assert Digest.parse(recv_line(s, timeout=30)) == sent
    with connect_from(m.a, dst, port_source, timeout=30) as s:
        assert recv_digest(s, timeout=30) == Digest.of_payload(32 << 20, seed=5)

    out = _complete(m.zta, "outbound", port_sink)
    assert out["dst.addr"] == (f"{dst}:15008" if family == "ip4" else f"[{dst}]:15008")
    assert out["src.identity"] == "spiffe://cluster.local/ns/default/sa/sa-a"
    assert out["dst.identity"] == "spiffe://cluster.local/ns/default/sa/sa-b"
    assert out["bytes_sent"] == 32 << 20
    inbound = _complete(m.ztb, "inbound", port_sink)
    assert inbound["src.identity"] == "spiffe://cluster.local/ns/default/sa/sa-a"
    assert inbound["bytes_recv"] == 32 << 20
    sink.stop()
    source.stop()


def test_half_close_each_way(m: Mesh) -> None:
    sink = start_app(m.b, "sink", ports=(9011,))
    with connect_from(m.a, m.b.ip4, 9011) as s:
        s.sendall(b"q" * 123_456)
        s.shutdown(socket.SHUT_WR)
        assert recv_line(s).split()[0] == "123456"
        assert s.recv(1) == b""
    source = start_app(m.b, "source", "--bytes", "70000", "--seed", "2", ports=(9012,))
    with connect_from(m.a, m.b.ip4, 9012) as s:
        assert recv_digest(s).count == 70_000  # server FIN arrived...
        s.sendall(b"z" * 50_000)  # ...and the other direction still works
        s.shutdown(socket.SHUT_WR)
        assert source.wait_for_line("RECEIVED", timeout=10).split()[1] == "50000"
    sink.stop()
    source.stop()


def test_app_sees_client_source_ip(m: Mesh) -> None:
    echo = start_app(m.b, "echo", "--announce", ports=(9020,))
    with connect_from(m.a, m.b.ip4, 9020) as s:
        peer = recv_line(s).split()
        assert peer[1] == m.a.ip4
    with connect_from(m.a, m.b.ip6, 9020) as s:
        peer = recv_line(s).split()
        assert peer[1] == m.a.ip6
    echo.stop()


def test_service_vip_over_hbone(m: Mesh) -> None:
    echo = start_app(m.b, "echo", "--announce", ports=(8080,))
    with connect_from(m.a, "10.96.0.20", 80) as s:
        peer = recv_line(s).split()
        assert peer[3:] == [m.b.ip4, "8080"]
    rec = m.zta.wait_for(lambda r: r.get("dst.service") == "b.default.svc.cluster.local")
    assert rec["dst.hbone_addr"] == f"{m.b.ip4}:8080"
    echo.stop()


def _hbone_conns(pod: Pod, dst: str) -> int:
    out = pod.run("ss", "-Htn", "state", "established", "dst", f"{dst}:15008").stdout
    return len([line for line in out.splitlines() if line.strip()])


def test_pooling_100_streams_then_second_connection(m: Mesh) -> None:
    echo = start_app(m.b, "echo", ports=(9030,))
    conns: list[socket.socket] = []
    try:
        for _ in range(100):
            s = connect_from(m.a, m.b.ip4, 9030)
            s.sendall(b"x\n")
            assert recv_line(s) == "x"
            conns.append(s)
        before = _hbone_conns(m.a, m.b.ip4)
        workers = m.zta.workers
        if workers > 1:
            # Each worker pools its own connections (README "Compatibility"): the 100 streams
            # share at most one per worker that accepted some of them.
            assert 1 <= before <= workers, f"{before} connections for 100 streams"
            return
        assert before == 1, f"100 streams should share one pooled connection, saw {before}"
        s = connect_from(m.a, m.b.ip4, 9030)
        s.sendall(b"y\n")
        assert recv_line(s) == "y"
        conns.append(s)
        assert _hbone_conns(m.a, m.b.ip4) == 2
    finally:
        for s in conns:
            s.close()
        echo.stop()


def test_connect_refused_app_gives_503(m: Mesh) -> None:
    with connect_from(m.a, m.b.ip4, 9999) as s:
        s.settimeout(5)
        assert s.recv(1) == b""
    rec = m.zta.wait_for(
        lambda r: r.get("message") == "connection complete" and "status 503" in str(r.get("error"))
    )
    assert rec["direction"] == "outbound"
    m.ztb.wait_for(
        lambda r: (
            r.get("direction") == "inbound"
            and str(r.get("dst.hbone_addr")).endswith(":9999")
            and "error" in r
        )
    )


def test_plain_connections_work_after_many(m: Mesh) -> None:
    """The pool keeps serving: 200 sequential short connections."""
    echo = start_app(m.b, "echo", ports=(9040,))
    t = time.monotonic()
    for i in range(200):
        with connect_from(m.a, m.b.ip4, 9040) as s:
            s.sendall(b"%d\n" % i)
            assert recv_line(s) == str(i)
    assert time.monotonic() - t < 60
    echo.stop()
