"""Test helpers for identities: odd certificates, a scriptable CA provider, a blocking TLS pair.

Product code never imports this module.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import CA_KEY_USAGE, LocalCA


def identity(sa: str, *, ns: str = "default", td: str = "cluster.local") -> Identity:
    return Identity(td, ns, sa)


def intermediate_ca(parent: LocalCA, *, ttl: dt.timedelta | None = None) -> LocalCA:
    """A CA whose "root" is an intermediate signed by ``parent`` (pathlen 0).

    Its ``issue`` lists the intermediate as the root; use ``issue_via`` for a proper chain.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, parent.trust_domain),
            x509.NameAttribute(NameOID.COMMON_NAME, "ztunnel-py test intermediate"),
        ]
    )
    start = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=1)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(parent.root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(parent.root_key.public_key()),
            critical=False,
        )
        .sign(parent.root_key, hashes.SHA256())
    )
    return LocalCA(key, cert, ttl=ttl or parent.ttl)


def issue_via(root: LocalCA, intermediate: LocalCA, ident: Identity) -> WorkloadCertificate:
    """A leaf from ``intermediate`` with the chain leaf -> intermediate -> root (root trusted)."""
    cert = intermediate.issue(ident)
    return replace(cert, intermediates=(intermediate.root_cert,), roots=(root.root_cert,))


def expired_certificate(ca: LocalCA, ident: Identity) -> WorkloadCertificate:
    """Valid for a day, ending a day ago."""
    start = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(days=2)
    return ca.issue(ident, not_before=start, ttl=dt.timedelta(days=1))


def not_yet_valid_certificate(ca: LocalCA, ident: Identity) -> WorkloadCertificate:
    """Valid from tomorrow."""
    start = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(days=1)
    return ca.issue(ident, not_before=start, ttl=dt.timedelta(days=1))


@dataclass
class ScriptedProvider:
    """A ``CertificateProvider`` over a ``LocalCA`` that records calls and can fail or stall.

    ``failures`` > 0 makes that many next calls raise ``error``; ``gate``, when set, makes every
    call wait for it (to pile up concurrent callers); ``ttl`` and ``not_before_clock`` pick the
    validity window (``not_before_clock`` returns UNIX seconds, e.g. a fake clock).
    """

    ca: LocalCA
    ttl: dt.timedelta | None = None
    not_before_clock: Callable[[], float] | None = None
    failures: int = 0
    error: Exception = field(default_factory=lambda: ConnectionError("CA unreachable"))
    gate: asyncio.Event | None = None
    calls: list[Identity] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def sign(self, ident: Identity) -> WorkloadCertificate:
        self.calls.append(ident)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.failures > 0:
                self.failures -= 1
                raise self.error
            not_before = None
            if self.not_before_clock is not None:
                now = self.not_before_clock()
                not_before = dt.datetime.fromtimestamp(int(now), dt.UTC)
            return self.ca.issue(ident, ttl=self.ttl, not_before=not_before)
        finally:
            self.in_flight -= 1


@dataclass
class HandshakeResult:
    """Outcome of one blocking TLS handshake plus a one-byte exchange, seen from both ends."""

    server_error: BaseException | None = None
    client_error: BaseException | None = None
    server_peer_der: bytes | None = None
    client_peer_der: bytes | None = None
    server_alpn: str | None = None
    client_alpn: str | None = None
    version: str | None = None
    cipher: str | None = None
    session_reused: bool | None = None

    @property
    def ok(self) -> bool:
        return self.server_error is None and self.client_error is None


def handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, *, timeout: float = 5.0
) -> HandshakeResult:
    """Run a TLS handshake over a loopback socket pair (server in a thread), then exchange one
    byte each way, so that a TLS 1.3 client learns about a server-side rejection of its cert."""
    res = HandshakeResult()
    s_sock, c_sock = socket.socketpair()
    s_sock.settimeout(timeout)
    c_sock.settimeout(timeout)

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(s_sock, server_side=True) as tls:
                res.server_peer_der = tls.getpeercert(binary_form=True)
                res.server_alpn = tls.selected_alpn_protocol()
                if tls.recv(1) != b"c":
                    raise ConnectionError("server did not get the client byte")
                tls.sendall(b"s")
        except BaseException as e:
            res.server_error = e
        finally:
            s_sock.close()

    thread = threading.Thread(target=serve, name="tls-test-server", daemon=True)
    thread.start()
    try:
        with client_ctx.wrap_socket(c_sock, server_hostname=None) as tls:
            res.client_peer_der = tls.getpeercert(binary_form=True)
            res.client_alpn = tls.selected_alpn_protocol()
            res.version = tls.version()
            cipher = tls.cipher()
            res.cipher = cipher[0] if cipher else None
            res.session_reused = tls.session_reused
            tls.sendall(b"c")
            if tls.recv(1) != b"s":
                raise ConnectionError("client did not get the server byte")
    except BaseException as e:
        res.client_error = e
    finally:
        c_sock.close()
        thread.join(timeout + 1)
    return res


def refused_alert(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> str:
    """A handshake where the client only reads afterwards (sending first would race the server's
    close: unread data makes the kernel reset the connection and drop the alert); returns the
    client's error, which carries the alert the server sent."""
    s_sock, c_sock = socket.socketpair()
    s_sock.settimeout(5)
    c_sock.settimeout(5)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(s_sock, server_side=True):
                pass
        except BaseException as e:
            errors.append(e)
        finally:
            s_sock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client_ctx.wrap_socket(c_sock, server_hostname=None) as tls:
            tls.recv(1)
    except ssl.SSLError as e:
        return str(e)
    finally:
        c_sock.close()
        t.join(6)
    raise AssertionError(f"client saw no alert (server: {errors})")


def client_context_without_certificate(roots_pem: str) -> ssl.SSLContext:
    """Like an HBONE client context but presenting no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=roots_pem)
    return ctx


def revocation_list(
    ca: LocalCA, serials: Sequence[int], *, number: int = 1, signer: LocalCA | None = None
) -> bytes:
    """A PEM CRL issued by ``ca`` (signed by ``signer``'s key, default ``ca``'s: pass another
    CA to forge one) revoking ``serials``."""
    key = (signer or ca).root_key
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.root_cert.subject)
        .last_update(now - dt.timedelta(minutes=1))
        .next_update(now + dt.timedelta(days=1))
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(now - dt.timedelta(minutes=1))
            .build()
        )
    crl = builder.sign(key, hashes.SHA256())
    return crl.public_bytes(serialization.Encoding.PEM)
