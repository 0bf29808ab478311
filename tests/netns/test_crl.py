"""CRL_PATH end to end: real ztunnels in network namespaces refuse a client whose certificate
the CRL revokes, in the TLS handshake (alert certificate_revoked), with a log line and
``istio_crl_policy_rejections_total``; the file is reloaded when it changes, and a reload closes
live connections, inbound and outbound (pooled), whose verified chain it revokes, leaf or
intermediate (Rust src/tls/crl.rs CrlManager, src/tls/revocation.rs verify_cert_chain and
RevocationIndex)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.testing.apps import connect_from, echo_roundtrip, recv_line, start_app
from ztunnel.testing.certs import intermediate_ca, issue_via, revocation_list
from ztunnel.testing.hbone import HboneClient, HboneClosed, Mesh, mesh
from ztunnel.testing.xdsbed import http_get, metric

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(90),
]

ECHO = 9100
STATS = 15020
TESTER = Identity("cluster.local", "default", "tester")


@dataclass
class Bed:
    m: Mesh
    crl: Path
    good: WorkloadCertificate
    revoked: WorkloadCertificate

    def write_crl(self, data: bytes) -> None:
        tmp = self.crl.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.crl)  # atomically, as a ConfigMap/Secret volume update does

    def attempt(self, cert: WorkloadCertificate) -> str:
        """CONNECT through ztunnel-b with ``cert`` from the external host: "ok" or how the
        connection ended."""
        assert self.m.ext is not None
        try:
            c = HboneClient.connect(
                self.m.ext, self.m.b.ip4, cert=cert, roots_pem=self.m.ca.root_pem
            )
        except (OSError, HboneClosed) as e:
            return f"handshake: {e!r}"
        try:
            # Read first: a TLS 1.3 client finishes its handshake before the server has
            # judged its certificate, and sending now would race the server's alert.
            c.wait_settings()
        except HboneClosed:
            c.close()
            return f"closed: {c.closed}"
        try:
            sid = c.connect_stream(f"{self.m.b.ip4}:{ECHO}")
            c.send(sid, b"crl?\n", end_stream=True)
            return "ok" if c.read_to_end(sid) == b"crl?\n" else "bad echo"
        except (OSError, HboneClosed, AssertionError) as e:
            return f"closed: {e!r}"
        finally:
            c.close()

    def rejections(self, pod: str = "b", reporter: str = "destination") -> float:
        _, text = http_get(self.m.pods[pod], STATS, "/stats/prometheus")
        return metric(text, "istio_crl_policy_rejections_total", reporter=reporter)


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with tempfile.TemporaryDirectory() as tmp:
        crl = Path(tmp) / "crl.pem"  # absent at start: Rust warns and checks again later
        with mesh(extra_env={"CRL_PATH": str(crl)}, external=True) as m:
            echo = start_app(m.b, "echo", ports=(ECHO,))
            yield Bed(m, crl, m.ca.issue(TESTER), m.ca.issue(TESTER))
            echo.stop()


def wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()  # type: ignore[operator]
        if got:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_revoked_client_refused_then_accepted_after_reload(bed: Bed) -> None:
    m = bed.m
    # No CRL file yet: everyone is accepted.
    assert bed.attempt(bed.revoked) == "ok"
    since = len(m.ztb.records)
    bed.write_crl(revocation_list(m.ca, [bed.revoked.serial]))
    # Reloaded on change (the file is polled at most once a second when a peer is checked).
    wait_for(lambda: bed.attempt(bed.revoked) != "ok")
    why = bed.attempt(bed.revoked)
    assert "alert certificate revoked" in why, why
    m.ztb.wait_for(lambda r: "revoked by CRL" in " ".join(map(str, r.values())), 10, start=since)
    m.ztb.wait_for(
        lambda r: "TLS handshake failed" in " ".join(map(str, r.values())), 10, start=since
    )
    assert bed.rejections() >= 2
    # Everyone else is still served, pod to pod too (ztunnel-a checks ztunnel-b's chain).
    assert bed.attempt(bed.good) == "ok"
    assert echo_roundtrip(m.a, m.b.ip4, ECHO) == b"hello\n"
    # A new CRL without the serial: accepted again.
    bed.write_crl(revocation_list(m.ca, [], number=2))
    wait_for(lambda: bed.attempt(bed.revoked) == "ok")


def test_live_connection_closed_when_its_peer_is_revoked(bed: Bed) -> None:
    """Rust re-checks established connections when the CRLs change: a connection opened before
    the revocation is closed, its stream logged with ``certificate revoked``; a good peer's
    connection lives on."""
    m = bed.m
    assert m.ext is not None
    bed.write_crl(revocation_list(m.ca, [], number=10))
    victim = m.ca.issue(TESTER)
    since = len(m.ztb.records)
    before = bed.rejections()
    with (
        HboneClient.connect(m.ext, m.b.ip4, cert=victim, roots_pem=m.ca.root_pem) as doomed,
        HboneClient.connect(m.ext, m.b.ip4, cert=bed.good, roots_pem=m.ca.root_pem) as fine,
    ):
        sid = doomed.connect_stream(f"{m.b.ip4}:{ECHO}")
        doomed.send(sid, b"before\n")
        assert doomed.read(sid, 7) == b"before\n"
        ok = fine.connect_stream(f"{m.b.ip4}:{ECHO}")
        bed.write_crl(revocation_list(m.ca, [victim.serial], number=11))
        why = doomed.wait_closed(timeout=10)  # within a poll interval or two
        assert why, why
        rec = m.ztb.wait_for(
            lambda r: (
                r.get("message") == "connection complete"
                and "certificate revoked" in str(r.get("error", ""))
            ),
            10,
            start=since,
        )
        assert rec["src.identity"] == str(TESTER)
        # the other peer's connection is untouched
        fine.send(ok, b"still here\n", end_stream=True)
        assert fine.read_to_end(ok) == b"still here\n"
    assert bed.rejections() >= before + 1
    bed.write_crl(revocation_list(m.ca, [], number=12))


def echo_ok(m: Mesh) -> bool:
    """Pod a -> b's echo through both ztunnels (pooled HBONE) works."""
    try:
        return echo_roundtrip(m.a, m.b.ip4, ECHO) == b"hello\n"
    except OSError:
        return False


def test_revoked_intermediate_refused_in_the_handshake(bed: Bed) -> None:
    """RevocationCheckDepth::Chain: a leaf that is not revoked itself is refused when the CRL of
    the root revokes the intermediate that issued it."""
    m = bed.m
    inter = intermediate_ca(m.ca)
    client = issue_via(m.ca, inter, TESTER)
    bed.write_crl(revocation_list(m.ca, [], number=20))
    wait_for(lambda: bed.attempt(client) == "ok")
    before = bed.rejections()
    bed.write_crl(revocation_list(m.ca, [inter.root_cert.serial_number], number=21))
    wait_for(lambda: bed.attempt(client) != "ok")
    why = bed.attempt(client)
    assert "alert certificate revoked" in why, why
    assert bed.attempt(bed.good) == "ok"  # a leaf of the root itself is fine
    assert bed.rejections() >= before + 2
    bed.write_crl(revocation_list(m.ca, [], number=22))


def test_live_connection_closed_when_its_peers_intermediate_is_revoked(bed: Bed) -> None:
    """The reload re-checks the chain each connection's handshake verified (Rust
    ConnRegistration / chain_is_revoked): revoking the intermediate closes a live connection
    from one of its leaves; a connection from a leaf of the root lives on."""
    m = bed.m
    assert m.ext is not None
    inter = intermediate_ca(m.ca)
    victim = issue_via(m.ca, inter, TESTER)
    bed.write_crl(revocation_list(m.ca, [], number=30))
    wait_for(lambda: bed.attempt(victim) == "ok")
    since = len(m.ztb.records)
    before = bed.rejections()
    with (
        HboneClient.connect(m.ext, m.b.ip4, cert=victim, roots_pem=m.ca.root_pem) as doomed,
        HboneClient.connect(m.ext, m.b.ip4, cert=bed.good, roots_pem=m.ca.root_pem) as fine,
    ):
        sid = doomed.connect_stream(f"{m.b.ip4}:{ECHO}")
        doomed.send(sid, b"before\n")
        assert doomed.read(sid, 7) == b"before\n"
        ok = fine.connect_stream(f"{m.b.ip4}:{ECHO}")
        bed.write_crl(revocation_list(m.ca, [inter.root_cert.serial_number], number=31))
        why = doomed.wait_closed(timeout=10)
        assert why, why
        rec = m.ztb.wait_for(
            lambda r: (
                r.get("message") == "connection complete"
                and "certificate revoked" in str(r.get("error", ""))
            ),
            10,
            start=since,
        )
        assert rec["src.identity"] == str(TESTER)
        fine.send(ok, b"still here\n", end_stream=True)
        assert fine.read_to_end(ok) == b"still here\n"
    assert bed.rejections() >= before + 1
    bed.write_crl(revocation_list(m.ca, [], number=32))


def test_pooled_outbound_connection_closed_when_the_server_is_revoked(bed: Bed) -> None:
    """Outbound too (Rust pool.rs registers each pooled connection; h2 client tears the tunnel
    down on revocation): pod a's app holds a connection to b through ztunnel-a's pooled HBONE
    connection; revoking ztunnel-b's certificate makes ztunnel-a close that pooled connection
    (its stream logged with ``certificate revoked``, counted with reporter source), and a new
    connection to b is refused in ztunnel-a's handshake."""
    m = bed.m
    assert m.ext is not None
    bed.write_crl(revocation_list(m.ca, [], number=40))
    wait_for(lambda: echo_ok(m))
    with HboneClient.connect(m.ext, m.b.ip4, cert=bed.good, roots_pem=m.ca.root_pem) as probe:
        server_serial = x509.load_der_x509_certificate(probe.peer_der).serial_number
    since = len(m.zta.records)
    before = bed.rejections("a", "source")
    with connect_from(m.a, m.b.ip4, ECHO, timeout=10) as app:
        app.sendall(b"before\n")
        assert recv_line(app) == "before"
        bed.write_crl(revocation_list(m.ca, [server_serial], number=41))
        try:
            rest = app.recv(100)
        except ConnectionResetError:
            rest = b""
        assert rest == b"", rest
    rec = m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and "certificate revoked" in str(r.get("error", ""))
        ),
        10,
        start=since,
    )
    assert rec["dst.identity"].endswith("/sa/sa-b"), rec
    assert bed.rejections("a", "source") >= before + 1
    # A new connection dials again and is refused in ztunnel-a's handshake.
    with connect_from(m.a, m.b.ip4, ECHO, timeout=10) as app:
        app.sendall(b"after\n")
        try:
            got = app.recv(100)
        except ConnectionResetError:
            got = b""
        assert got == b""
    m.zta.wait_for(lambda r: "revoked" in " ".join(map(str, r.values())), 10, start=since)
    assert bed.rejections("a", "source") >= before + 2
    bed.write_crl(revocation_list(m.ca, [], number=42))
    wait_for(lambda: echo_ok(m))
