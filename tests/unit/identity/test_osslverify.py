"""identity/osslverify.py: OpenSSL's verify callback on an ssl.SSLContext through ctypes."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from ztunnel.core.identity import Identity
from ztunnel.identity import osslverify
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import TLS_POLICY_MEMO, TlsPolicy, client_context, server_context
from ztunnel.testing.certs import handshake

pytestmark = pytest.mark.timeout(20)

SERVER = Identity("cluster.local", "default", "server")
CLIENT = Identity("cluster.local", "default", "client")


def test_available_here() -> None:
    # The CI machines use a dynamically linked _ssl: the hook must be there, or the
    # trust-domain alert and CRL checks silently degrade.
    assert osslverify.available()


def test_callback_sees_the_chain_top_down() -> None:
    ca = LocalCA.ephemeral()
    seen: list[tuple[int, bool]] = []
    ctx = server_context(ca.issue(SERVER))
    assert osslverify.install(ctx, lambda c: seen.append((c.depth, c.issuer is None)))
    assert handshake(ctx, client_context(ca.issue(CLIENT))).ok
    assert seen == [(1, True), (0, False)]  # root (trust anchor, no issuer), then the leaf


def test_a_failing_check_fails_the_handshake_with_its_error() -> None:
    ca = LocalCA.ephemeral()
    ctx = server_context(ca.issue(SERVER))

    def refuse(c: osslverify.ChainCheck) -> None:
        if c.depth == 0:
            raise osslverify.VerifyFailure(osslverify.X509_V_ERR_CERT_REVOKED, "no")

    assert osslverify.install(ctx, refuse)
    res = handshake(ctx, client_context(ca.issue(CLIENT)))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)
    assert "certificate revoked" in str(res.server_error)


def test_unrecognised_layout_installs_nothing_and_crl_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(osslverify, "_ssl_ctx_ptr", lambda lib, ctx: None)
    ca = LocalCA.ephemeral()
    assert not osslverify.install(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), lambda c: None)
    # Without the hook a CRL cannot be honoured: building the context fails, no peer is
    # accepted unchecked.
    path = tmp_path / "crl.pem"
    path.write_bytes(b"")
    cert = ca.issue(SERVER)
    cert.memo(TLS_POLICY_MEMO, lambda: TlsPolicy(crl=CrlManager(path)))
    with pytest.raises(RuntimeError, match="CRL_PATH"):
        server_context(cert)
    # Without a CRL the context builds (the trust domain is checked after the handshake).
    assert server_context(ca.issue(SERVER)) is not None
