"""HBONE failure cases: bad certificates, bad requests, missing workloads, peers that vanish.

Every case checks three things: a clear error (a log line or an HTTP status), that nothing stays
open in the ztunnels involved (fds from /proc/PID/fd, tasks and connections back to baseline,
no internal error), and that ztunnel keeps serving afterwards.

Topology: pod a (n1) and pod b (n2) with their own ztunnels as in test_hbone.py; pod c (n2) is
configured as service account sa-c but its ztunnel runs as default/c/imposter (so its certificate
says imposter); pod d (n2) runs a ztunnel for a workload missing from the local config. The raw
HBONE client (``HboneClient``, python-hyper h2 over ssl) runs on an external host. Outbound
pools release idle connections after 200 ms so the baseline is zero connections everywhere.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import SAN_MISMATCH_MESSAGE
from ztunnel.testing.apps import (
    connect_from,
    echo_roundtrip,
    listen_in,
    payload,
    socket_in,
    start_app,
)
from ztunnel.testing.certs import expired_certificate
from ztunnel.testing.hbone import (
    HboneClient,
    HboneClosed,
    Mesh,
    PodSpec,
    mesh,
    no_leaks,
    settled,
)
from ztunnel.testing.netns import Host
from ztunnel.testing.proc import Record, ZtunnelProcess

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

ECHO = 9100
TESTER = Identity("cluster.local", "default", "tester")


@dataclass
class Bed:
    m: Mesh
    ztc: ZtunnelProcess  # certificate SAN: imposter; the config expects sa-c
    ztd: ZtunnelProcess  # its workload is not in the local config
    good: WorkloadCertificate  # a valid mesh certificate for the raw client

    @property
    def ext(self) -> Host:
        assert self.m.ext is not None
        return self.m.ext

    def client(self, ip: str | None = None, cert: WorkloadCertificate | None = None) -> HboneClient:
        """A raw HBONE client on the external host, connected to ``ip`` (default pod b):15008,
        trusting the mesh root."""
        return HboneClient.connect(
            self.ext,
            ip or self.m.b.ip4,
            cert=cert or self.good,
            roots_pem=self.m.ca.root_pem,
        )


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    extra = [
        PodSpec("c", "n2", service_account="sa-c", ztunnel="default/c/imposter"),
        PodSpec("d", "n2", service_account=None, ztunnel="default/d/sa-d", inpod_rules=False),
    ]
    with mesh(
        extra_env={"POOL_UNUSED_RELEASE_TIMEOUT": "200ms"}, extra_pods=extra, external=True
    ) as m:
        echo = start_app(m.b, "echo", ports=(ECHO,))
        b = Bed(m, m.ztunnels["c"], m.ztunnels["d"], m.ca.issue(TESTER))
        # Warm up: every ztunnel fetches its certificate (and starts its renewal timer) now,
        # so the per-test baselines are steady.
        assert_serves(b)
        for ip in (m.pods["c"].ip4, m.pods["d"].ip4):
            with b.client(ip) as c:
                c.wait_settings()
        yield b
        echo.stop()


def assert_serves(b: Bed) -> None:
    """ztunnel still works: the raw client through ztunnel-b, and a -> b through both."""
    with b.client() as c:
        sid = c.connect_stream(f"{b.m.b.ip4}:{ECHO}")
        c.send(sid, b"still here\n", end_stream=True)
        assert c.read_to_end(sid) == b"still here\n"
    assert echo_roundtrip(b.m.a, b.m.b.ip4, ECHO) == b"hello\n"
    # ztunnel-a's pool closes the idle connection after 200 ms; ztunnel-b then sees it go.
    settled(b.m.ztb)


def mark(zt: ZtunnelProcess) -> int:
    return len(zt.records)


def wait_log(zt: ZtunnelProcess, since: int, *needles: str, timeout: float = 10.0) -> Record:
    """The first record from ``since`` on whose text holds every needle."""
    return zt.wait_for(
        lambda r: all(n in " ".join(map(str, r.values())) for n in needles), timeout, start=since
    )


def read_until_closed(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the connection ends, by FIN or by RST (unread data makes a RST)."""
    s.settimeout(timeout)
    got = bytearray()
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


def unread_bytes(s: socket.socket) -> int:
    """Bytes waiting in ``s``'s receive queue (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def rejected(b: Bed, cert: WorkloadCertificate) -> str:
    """Connect with ``cert``; the server must end the connection. Returns how it ended."""
    try:
        c = b.client(cert=cert)
    except (OSError, HboneClosed) as e:
        return f"handshake: {e!r}"
    try:
        return c.wait_closed()
    finally:
        c.close()


# --- certificates ---------------------------------------------------------------------------


def test_server_presents_unexpected_san(bed: Bed) -> None:
    """a -> c: ztunnel-c's certificate says imposter, the config says sa-c: the outbound side
    refuses the tunnel with ztunnel's SAN error and closes the app connection."""
    c = bed.m.pods["c"]
    since = mark(bed.m.zta)
    with no_leaks(bed.m.zta, bed.ztc), connect_from(bed.m.a, c.ip4, ECHO) as s:
        s.sendall(b"never delivered\n")
        s.shutdown(socket.SHUT_WR)
        assert read_until_closed(s) == b""
    rec = wait_log(bed.m.zta, since, "connection complete", SAN_MISMATCH_MESSAGE)
    assert rec["direction"] == "outbound"
    assert rec["dst.hbone_addr"] == f"{c.ip4}:{ECHO}"
    assert "spiffe://cluster.local/ns/default/sa/sa-c" in rec["error"]  # what was expected
    assert_serves(bed)


def test_client_certificate_from_another_ca(bed: Bed) -> None:
    foreign = LocalCA.ephemeral().issue(TESTER)
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb):
        why = rejected(bed, foreign)
    assert "alert unknown ca" in why, why  # the server's TLS alert says why
    wait_log(bed.m.ztb, since, bed.ext.ip4, "TLS handshake failed", "certificate verify failed")
    assert_serves(bed)


def test_client_certificate_from_another_trust_domain(bed: Bed) -> None:
    """Same root, SAN spiffe://other.domain/...: the chain verifies, the trust-domain check
    rejects it inside the handshake with a TLS alert, as Rust's TrustDomainVerifier does."""
    other = bed.m.ca.issue(Identity("other.domain", "default", "tester"))
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb):
        why = rejected(bed, other)
    assert "alert bad certificate" in why, why
    rec = wait_log(bed.m.ztb, since, bed.ext.ip4, "TLS handshake failed", "certificate rejected")
    assert rec["level"] == "warn" or rec["level"] == "warning", rec
    assert rec["scope"] == "access"  # Rust log_early_deny
    assert_serves(bed)


def test_expired_client_certificate(bed: Bed) -> None:
    expired = expired_certificate(bed.m.ca, TESTER)
    assert expired.not_after < dt.datetime.now(dt.UTC)
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb):
        why = rejected(bed, expired)
    assert "alert certificate expired" in why, why
    wait_log(bed.m.ztb, since, bed.ext.ip4, "TLS handshake failed", "certificate has expired")
    assert_serves(bed)


def test_plaintext_clients(bed: Bed) -> None:
    """HTTP/1.1 in the clear, a bare HTTP/2 preface, and a client that connects and leaves."""
    b = bed.m.b
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb):
        for first in (b"GET / HTTP/1.1\r\nHost: b\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
            with connect_from(bed.ext, b.ip4, 15008) as s:
                s.sendall(first)
                rest = read_until_closed(s)
                assert b"HTTP" not in rest  # no plaintext answer, only a TLS alert at most
            wait_log(bed.m.ztb, since, bed.ext.ip4, "TLS handshake failed")
            since = mark(bed.m.ztb)
        connect_from(bed.ext, b.ip4, 15008).close()
        wait_log(bed.m.ztb, since, bed.ext.ip4, "TLS handshake failed", "peer closed")
    assert_serves(bed)


def test_tls_then_garbage_instead_of_http2(bed: Bed) -> None:
    """A valid mTLS client that does not speak HTTP/2: GOAWAY, connection closed, no leak."""
    with no_leaks(bed.m.ztb), bed.client() as c:
        c.tls.sendall(b"this is not an HTTP/2 connection preface\r\n\r\n")
        c.wait_closed()
    assert_serves(bed)


# --- requests -------------------------------------------------------------------------------


def test_non_connect_method_is_400(bed: Bed) -> None:
    b = bed.m.b
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(f"{b.ip4}:{ECHO}", method="GET", scheme="https", path="/", end_stream=True)
        assert c.response(sid) == 400
        c.read_to_end(sid)
        assert c.streams[sid].ended
        # CONNECT with :path is not a valid CONNECT either.
        sid = c.request(f"{b.ip4}:{ECHO}", path="/")
        assert c.response(sid) == 400
        # The connection survives rejected streams.
        ok = c.connect_stream(f"{b.ip4}:{ECHO}")
        c.send(ok, b"x\n", end_stream=True)
        assert c.read_to_end(ok) == b"x\n"
    rec = wait_log(bed.m.ztb, since, "inbound HBONE request rejected", "'GET' is not CONNECT")
    assert rec["status"] == 400
    assert_serves(bed)


@pytest.mark.parametrize("authority", ["not-an-address", "10.2.0.2", "[fd00:2::2:80", None])
def test_bad_authority_is_400(bed: Bed, authority: str | None) -> None:
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(authority)
        assert c.response(sid) == 400
        assert c.read_to_end(sid) == b""
    wait_log(bed.m.ztb, since, "inbound HBONE request rejected", "400")


def test_authority_ip_mismatch_is_400(bed: Bed) -> None:
    """The authority names pod a while the connection arrived at pod b: Rust
    validate_destination's IPMismatch, an early denial ("connection failed")."""
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(f"{bed.m.a.ip4}:{ECHO}")
        assert c.response(sid) == 400
    rec = wait_log(bed.m.ztb, since, "connection failed", "ip mismatch")
    assert rec["direction"] == "inbound"
    assert rec["error"] == f"ip mismatch: {bed.m.b.ip4} != {bed.m.a.ip4}"
    assert rec["dst.addr"] == f"{bed.m.b.ip4}:15008"
    assert_serves(bed)


def test_ipv6_authority_on_ipv4_connection_is_400(bed: Bed) -> None:
    """Pod b's own IPv6 address named on a connection that arrived at its IPv4 address: still
    not the connection's IP (Rust compares with the connection's destination only). Before,
    this was accepted and the app saw ztunnel's address as the source."""
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(f"[{bed.m.b.ip6}]:{ECHO}")
        assert c.response(sid) == 400
    wait_log(bed.m.ztb, since, "connection failed", "ip mismatch")
    assert_serves(bed)


@pytest.mark.parametrize("port", [15008, 15001, 15006])
def test_connect_to_ztunnel_port_is_503(bed: Bed, port: int) -> None:
    """Rust find_inbound_upstream: a final port among ztunnel's own is SelfCall, 503."""
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(f"{bed.m.b.ip4}:{port}")
        assert c.response(sid) == 503
    wait_log(bed.m.ztb, since, "connection failed", "recursive call")


def test_unknown_local_workload_is_503(bed: Bed) -> None:
    """ztunnel-d's workload is not in its config: after the 5 s wait for it, 503."""
    d = bed.m.pods["d"]
    since = mark(bed.ztd)
    with no_leaks(bed.ztd), bed.client(d.ip4) as c:
        t = time.monotonic()
        sid = c.request(f"{d.ip4}:{ECHO}")
        assert c.response(sid, timeout=10) == 503
        waited = time.monotonic() - t
        assert c.read_to_end(sid) == b""
    assert 4.5 <= waited < 8, waited
    rec = wait_log(bed.ztd, since, "connection failed", "local workload")
    assert rec["direction"] == "inbound"


def test_app_refuses_is_503(bed: Bed) -> None:
    b = bed.m.b
    since = mark(bed.m.ztb)
    with no_leaks(bed.m.ztb), bed.client() as c:
        sid = c.request(f"{b.ip4}:9999")
        assert c.response(sid) == 503
        assert c.streams[sid].ended or c.read_to_end(sid) == b""
    with no_leaks(bed.m.ztb), bed.client(b.ip6) as c:
        sid = c.request(f"[{b.ip6}]:9999")
        assert c.response(sid) == 503
    rec = wait_log(bed.m.ztb, since, "connection complete", f"{b.ip4}:9999")
    assert rec["error"]
    assert_serves(bed)


# --- peers that vanish ----------------------------------------------------------------------


@pytest.mark.parametrize("unread_reply", [False, True], ids=["quiet", "unread-reply"])
def test_client_vanishes_mid_stream(bed: Bed, unread_reply: bool) -> None:
    """The raw client opens a stream, sends data, then its TCP socket is reset (SO_LINGER 0):
    ztunnel-b closes the app's connection, logs it, and frees everything. With an unread reply
    in the client's socket, ztunnel-b's read fails with ECONNRESET and its RST_STREAM cannot be
    sent either (that once broke the connection teardown)."""
    b = bed.m.b
    since = mark(bed.m.ztb)
    data = payload(200_000, seed=4)
    with no_leaks(bed.m.ztb), listen_in(b, 9200) as lst:
        lst.settimeout(5)
        c = bed.client()
        sid = c.connect_stream(f"{b.ip4}:9200")
        app, _peer = lst.accept()
        with app:
            app.settimeout(5)
            c.send(sid, data)
            got = bytearray()
            while len(got) < len(data):
                chunk = app.recv(65536)
                assert chunk, "EOF before the data arrived"
                got += chunk
            assert got == data
            if unread_reply:
                app.sendall(b"r" * 10_000)
                wait_until(lambda: unread_bytes(c.tls) > 0)
            c.abort()
            assert read_until_closed(app) == b"", "the app connection should end"
    rec = wait_log(bed.m.ztb, since, "connection complete", f"{b.ip4}:9200")
    assert "error" in rec, rec
    assert rec["bytes_recv"] == len(data)
    assert_serves(bed)


def test_server_app_dies_mid_transfer(bed: Bed) -> None:
    """a -> b through both ztunnels; the app in b sends part of a transfer and dies (RST) while
    it has unread client bytes: the client in a sees the connection end, and neither ztunnel
    keeps anything. Repeated, because the RST can land between reads (uvloop then reports
    EPOLLERR once and drops the reader)."""
    a, b = bed.m.a, bed.m.b
    with no_leaks(bed.m.zta, bed.m.ztb), listen_in(b, 9201) as lst:
        lst.settimeout(5)
        for _ in range(12):
            since_a, since_b = mark(bed.m.zta), mark(bed.m.ztb)
            with connect_from(a, b.ip4, 9201) as s:
                app, _peer = lst.accept()
                app.sendall(payload(300_000, seed=1))
                first = s.recv(65536)
                assert first
                s.sendall(b"client data that the app never reads\n" * 100)
                app.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
                app.close()  # the app dies: RST
                total = len(first) + len(read_until_closed(s))
                assert total <= 300_000
            wait_log(bed.m.ztb, since_b, "connection complete", f"{b.ip4}:9201")
            wait_log(bed.m.zta, since_a, "connection complete", f"{b.ip4}:9201")
    assert_serves(bed)


def test_many_bad_clients_at_once_then_serves(bed: Bed) -> None:
    """A burst of mixed failures at the same time leaves nothing behind."""
    b = bed.m.b
    foreign = LocalCA.ephemeral().issue(TESTER)
    with no_leaks(bed.m.ztb):
        socks = []
        clients = []
        for i in range(10):
            s = socket_in(bed.ext)
            s.settimeout(5)
            s.connect((b.ip4, 15008))
            s.sendall(b"garbage %d\r\n" % i)
            socks.append(s)
        for _ in range(5):
            clients.append(bed.client())
        for c in clients:
            sid = c.request("nonsense")
            assert c.response(sid) == 400
        for _ in range(5):
            rejected(bed, foreign)
        for s in socks:
            s.close()
        for c in clients[:2]:
            c.abort()
        for c in clients[2:]:
            c.close()
    assert_serves(bed)
