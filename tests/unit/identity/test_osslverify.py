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


def _bio_handshake(
    cctx: ssl.SSLContext, sctx: ssl.SSLContext
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A complete handshake between two SSLObjects over memory BIOs."""
    ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = cctx.wrap_bio(ci, co, server_side=False)
    server = sctx.wrap_bio(si, so, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, (obj, out, peer_in) in enumerate(((client, co, si), (server, so, ci))):
            try:
                obj.do_handshake()
                done[i] = True
            except ssl.SSLWantReadError:
                pass
            if out.pending:
                peer_in.write(out.read())
        if all(done):
            return client, server
    raise AssertionError("handshake did not complete")


def test_verified_chain_recorded_per_connection_and_handed_over_once() -> None:
    # What a CRL reload re-checks (Rust ConnRegistration keeps the verified chain): the chain
    # above the leaf, intermediates first, the trust anchor last, for each side's peer.
    from ztunnel.testing.certs import intermediate_ca, issue_via

    root = LocalCA.ephemeral()
    inter = intermediate_ca(root)
    server_cert = issue_via(root, inter, SERVER)
    client_cert = root.issue(CLIENT)
    sctx = server_context(server_cert)  # (the trust-domain check installs the callback)
    cctx = client_context(client_cert)
    assert osslverify.install(cctx, lambda c: None)
    for _ in range(2):  # a second connection gets its own record (the CA objects are shared)
        client, server = _bio_handshake(cctx, sctx)
        got = osslverify.take_verified_chain(client)
        assert [c.subject for c in got] == [inter.root_cert.subject, root.root_cert.subject]
        assert osslverify.take_verified_chain(client) == ()  # handed over, not kept
        assert osslverify.take_verified_chain(server) == (root.root_cert,)
    # No callback on the client context (no CRL): nothing recorded, nothing stale returned.
    client, server = _bio_handshake(client_context(root.issue(CLIENT)), sctx)
    assert osslverify.take_verified_chain(client) == ()
    assert osslverify.take_verified_chain(server) == (root.root_cert,)
