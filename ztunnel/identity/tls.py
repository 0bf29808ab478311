"""TLS for HBONE: mTLS 1.3 ``SSLContext``s built from a WorkloadCertificate, and peer SAN checks.

Contexts follow ztunnel (reference 2.1): TLS 1.3 only, ALPN ``h2``, client certificate required,
no session resumption, no SNI / hostname check (identity is checked on SANs after the
handshake), roots taken from the certificate's own CA response. OpenSSL verifies the chain
during the handshake; which identity the peer holds is checked afterwards with
``verify_server_identity`` (client side) and ``verify_client_trust_domain`` (server side),
because Python's ``ssl`` has no custom verification callback.

Cipher suites: ztunnel offers only TLS_AES_256_GCM_SHA384 then TLS_AES_128_GCM_SHA256. Python 3.11
has no API for TLS 1.3 suites (``set_ciphers`` only affects TLS <= 1.2 and there is no
``set_ciphersuites``), so OpenSSL's default list applies, which also allows
TLS_CHACHA20_POLY1305_SHA256. If a later Python grows ``SSLContext.set_ciphersuites`` it is used.
Otherwise run with ``OPENSSL_CONF`` pointing at a file such as::

    openssl_conf = openssl_init
    [openssl_init]
    ssl_conf = ssl_sect
    [ssl_sect]
    system_default = system_default_sect
    [system_default_sect]
    Ciphersuites = TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256

(putting TLS_AES_128_GCM_SHA256 first is ~19% faster on this hardware, performance notes 3.3).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from ztunnel.core.identity import Identity

from . import osslverify
from .certs import WorkloadCertificate, spiffe_identities, uri_sans
from .crl import CrlManager

ALPN_H2 = "h2"
TLS13_CIPHERSUITES = "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256"
SAN_MISMATCH_MESSAGE = "identity verification error: peer did not present the expected SAN"

_SERVER_MEMO_KEY = "tls.server_context"
_CLIENT_MEMO_KEY = "tls.client_context"


class TlsIdentityError(Exception):
    """The peer's certificate does not carry an acceptable identity."""

    def __init__(
        self, message: str, *, presented: Sequence[str] = (), expected: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.presented = tuple(presented)
        self.expected = tuple(expected)


# -- contexts ---------------------------------------------------------------------------------


def server_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    """The HBONE server (inbound 15008) context presenting ``cert``; cached on ``cert``.

    After the handshake, call ``verify_client_trust_domain(peer_der, cert.identity.trust_domain)``.
    """
    return cert.memo(_SERVER_MEMO_KEY, lambda: _build(cert, server_side=True))


def client_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    """The HBONE client (outbound) context presenting ``cert``; cached on ``cert``.

    Connect with ``server_hostname=None`` (no SNI; with asyncio pass ``server_hostname=""``
    so the loop does not default it to the host), and never pass ``session=``; after the
    handshake call ``verify_server_identity(peer_der, expected_sans)``.
    """
    return cert.memo(_CLIENT_MEMO_KEY, lambda: _build(cert, server_side=False))


@dataclass(frozen=True, slots=True)
class TlsPolicy:
    """Process-wide TLS settings a ``SecretManager`` attaches to the certificates it hands out
    (memo ``TLS_POLICY_MEMO``), so contexts built from them follow the config: ``tls12``
    (``TLS12_ENABLED``: TLS 1.2 with ztunnel's four ECDHE AES-GCM suites next to 1.3) and
    ``crl`` (``CRL_PATH``: every peer chain checked in the handshake)."""

    tls12: bool = False
    crl: CrlManager | None = None


TLS_POLICY_MEMO = "tls.policy"


def crl_of(cert: WorkloadCertificate) -> CrlManager | None:
    """The CRLs (``CRL_PATH``) that contexts built from ``cert`` check peers against."""
    return cert.memo(TLS_POLICY_MEMO, lambda: _DEFAULT_POLICY).crl


TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256:"
    "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-AES128-GCM-SHA256"
)
_DEFAULT_POLICY = TlsPolicy()


def _handshake_check(
    trust_domain: str | None, crl: CrlManager | None, reporter: str
) -> osslverify.Check:
    """The in-handshake check (``osslverify``): CRL revocation on every certificate but the
    trust anchor (Rust ``verify_cert_chain``), and on the server the client leaf's trust
    domain (Rust ``TrustDomainVerifier``), so a refused peer gets a TLS alert."""

    def check(c: osslverify.ChainCheck) -> None:
        if crl is not None and c.issuer is not None and crl.is_revoked(c.cert, c.issuer):
            crl.rejected(reporter, f"serial {c.cert.serial_number:x} at depth {c.depth}")
            raise osslverify.VerifyFailure(osslverify.X509_V_ERR_CERT_REVOKED, "revoked")
        if (
            trust_domain is not None
            and c.depth == 0
            and not any(i.trust_domain == trust_domain for i in spiffe_identities(c.cert))
        ):
            raise osslverify.VerifyFailure(osslverify.X509_V_ERR_CERT_REJECTED, "trust domain")

    return check


def _build(cert: WorkloadCertificate, *, server_side: bool) -> ssl.SSLContext:
    policy = cert.memo(TLS_POLICY_MEMO, lambda: _DEFAULT_POLICY)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2 if policy.tls12 else ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    if policy.tls12:
        ctx.set_ciphers(TLS12_CIPHERS)
    set_suites = getattr(ctx, "set_ciphersuites", None)  # absent in Python <= 3.13
    if set_suites is not None:
        set_suites(TLS13_CIPHERSUITES)
    ctx.set_alpn_protocols([ALPN_H2])
    # No resumption: ztunnel disables it. OP_NO_TICKET alone makes a TLS 1.3 OpenSSL server send
    # stateful tickets instead, so the server also sends zero tickets.
    ctx.options |= ssl.OP_NO_TICKET
    if server_side:
        ctx.num_tickets = 0
    else:
        # Identity is checked on URI SANs after the handshake, never on a host name (no SNI).
        ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    # Every root from the CA response is a trust anchor even if it is not self-signed (an
    # intermediate used as the mesh root), as webpki treats its root store in ztunnel.
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.load_verify_locations(cadata=cert.roots_pem())
    _load_key_and_chain(ctx, cert)
    td = cert.identity.trust_domain if server_side else None
    if td is not None or policy.crl is not None:
        reporter = "destination" if server_side else "source"
        installed = osslverify.install(ctx, _handshake_check(td, policy.crl, reporter))
        if not installed and policy.crl is not None:
            # CRL_PATH asks for revocation checks we cannot make: refuse rather than accept.
            raise RuntimeError(
                "CRL_PATH is set but in-handshake certificate checks are unavailable"
            )
    return ctx


def _load_key_and_chain(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> None:
    """``load_cert_chain`` only reads files. Rather than write the private key to disk (where it
    would outlive the process and be visible to anyone who can read the directory), hand OpenSSL
    anonymous in-memory files: ``memfd_create`` gives an fd with no name in any filesystem, and
    ``/proc/self/fd/N`` lets OpenSSL open it by path. Both fds are closed right after loading,
    which frees the memory; the key then lives only inside the ``SSL_CTX``."""
    chain_fd = os.memfd_create("ztunnel-chain", os.MFD_CLOEXEC)
    try:
        key_fd = os.memfd_create("ztunnel-key", os.MFD_CLOEXEC)
        try:
            _write_all(chain_fd, cert.chain_pem())
            _write_all(key_fd, cert.private_key_pem())
            ctx.load_cert_chain(f"/proc/self/fd/{chain_fd}", f"/proc/self/fd/{key_fd}")
        finally:
            os.close(key_fd)
    finally:
        os.close(chain_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- post-handshake verification (pure) -------------------------------------------------------


def peer_certificate_der(conn: ssl.SSLObject | ssl.SSLSocket) -> bytes:
    """The peer's leaf certificate (DER) of a completed handshake."""
    der = conn.getpeercert(binary_form=True)
    if not der:
        raise TlsIdentityError("peer presented no certificate")
    return der


def peer_identity(peer_der: bytes) -> Identity | None:
    """The identity ztunnel attributes to a peer: its first URI SAN that parses as SPIFFE."""
    ids = spiffe_identities(peer_der)
    return ids[0] if ids else None


def verify_server_identity(peer_der: bytes, expected: Sequence[Identity | str]) -> Identity:
    """Client side: accept the server only if any URI SAN of its leaf is in ``expected``.

    ``expected`` is the destination workload's identity plus its service's
    ``subject_alt_names`` (or the waypoint's). Returns the server's peer identity.
    """
    wanted = [str(e) for e in expected]
    presented = uri_sans(peer_der)
    if not set(presented).intersection(wanted):
        raise TlsIdentityError(SAN_MISMATCH_MESSAGE, presented=presented, expected=wanted)
    ident = peer_identity(peer_der)
    if ident is None:
        # The matching SAN was not SPIFFE-shaped (a raw service SAN); no RBAC identity.
        raise TlsIdentityError(
            "identity verification error: peer has no SPIFFE identity",
            presented=presented,
            expected=wanted,
        )
    return ident


def verify_client_trust_domain(peer_der: bytes, trust_domain: str) -> Identity:
    """Server side: require a SPIFFE URI SAN in ``trust_domain`` (ztunnel's TrustDomainVerifier).

    Which identity is allowed is left to authorization policy. Returns the peer identity (first
    SPIFFE SAN).
    """
    ids = spiffe_identities(peer_der)
    if not any(i.trust_domain == trust_domain for i in ids):
        raise TlsIdentityError(
            f"identity verification error: client certificate has no SPIFFE identity in trust "
            f"domain {trust_domain!r}",
            presented=uri_sans(peer_der),
            expected=(trust_domain,),
        )
    return ids[0]
