"""HBONE TLS contexts: real mTLS 1.3 handshakes on loopback, and post-handshake SAN checks."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives import serialization

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import (
    SAN_MISMATCH_MESSAGE,
    TlsIdentityError,
    client_context,
    peer_identity,
    server_context,
    verify_client_trust_domain,
    verify_server_identity,
)
from ztunnel.testing.certs import (
    client_context_without_certificate,
    expired_certificate,
    handshake,
    intermediate_ca,
    issue_via,
    not_yet_valid_certificate,
    refused_alert,
)
from ztunnel.testing.fds import open_fds

pytestmark = pytest.mark.timeout(30)

TD = "cluster.local"
SERVER = Identity(TD, "default", "server")
CLIENT = Identity(TD, "default", "client")


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.ephemeral()


@pytest.fixture(scope="module")
def server_cert(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(SERVER)


@pytest.fixture(scope="module")
def client_cert(ca: LocalCA) -> WorkloadCertificate:
    return ca.issue(CLIENT)


def _der(cert: WorkloadCertificate) -> bytes:
    return cert.leaf.public_bytes(serialization.Encoding.DER)


def test_context_settings(server_cert: WorkloadCertificate) -> None:
    for ctx in (server_context(server_cert), client_context(server_cert)):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.options & ssl.OP_NO_TICKET
        assert ctx.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN
    assert client_context(server_cert).check_hostname is False
    assert server_context(server_cert).num_tickets == 0
    # The cipher suite API is missing in this Python; see the module docstring of tls.py.
    assert not hasattr(ssl.SSLContext, "set_ciphersuites")


def test_contexts_are_cached_per_certificate(ca: LocalCA, server_cert: WorkloadCertificate) -> None:
    assert server_context(server_cert) is server_context(server_cert)
    assert client_context(server_cert) is client_context(server_cert)
    assert server_context(server_cert) is not client_context(server_cert)
    rotated = ca.issue(SERVER)
    assert server_context(rotated) is not server_context(server_cert)


def test_loading_leaks_no_file_descriptors(ca: LocalCA) -> None:
    before = open_fds()
    for _ in range(5):
        cert = ca.issue(SERVER)
        server_context(cert)
        client_context(cert)
    assert open_fds() == before


def test_mutual_tls_handshake(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    res = handshake(server_context(server_cert), client_context(client_cert))
    assert res.ok, (res.server_error, res.client_error)
    assert res.version == "TLSv1.3"
    assert res.client_alpn == res.server_alpn == "h2"
    assert res.cipher in {"TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256"}
    assert res.session_reused is False
    assert res.client_peer_der == _der(server_cert)
    assert res.server_peer_der == _der(client_cert)
    assert res.client_peer_der is not None and res.server_peer_der is not None
    assert verify_server_identity(res.client_peer_der, [SERVER]) == SERVER
    assert verify_client_trust_domain(res.server_peer_der, TD) == CLIENT


def test_no_sni_is_sent(ca: LocalCA, client_cert: WorkloadCertificate) -> None:
    cert = ca.issue(SERVER)  # private copy: the callback must not leak into shared contexts
    ctx = server_context(cert)
    seen: list[str | None] = []
    ctx.sni_callback = lambda _sock, name, _ctx: seen.append(name)
    assert handshake(ctx, client_context(client_cert)).ok
    assert seen == [None]


def test_no_session_resumption(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    import socket
    import threading

    sctx, cctx = server_context(server_cert), client_context(client_cert)
    sessions: list[ssl.SSLSession | None] = []
    for _ in range(2):
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)

        def serve(sock: socket.socket = a) -> None:
            with sctx.wrap_socket(sock, server_side=True) as s:
                s.sendall(b"x")
                s.recv(1)

        t = threading.Thread(target=serve)
        t.start()
        prev = sessions[-1] if sessions else None
        with cctx.wrap_socket(b, server_hostname=None, session=prev) as c:
            assert c.recv(1) == b"x"  # reads past the point where tickets would arrive
            assert not c.session_reused
            sessions.append(c.session)
            c.sendall(b"y")
        t.join(5)
    # Either no session at all, or one that was not resumable.
    assert all(s is None or not s.has_ticket for s in sessions)


def test_client_certificate_is_required(server_cert: WorkloadCertificate, ca: LocalCA) -> None:
    res = handshake(server_context(server_cert), client_context_without_certificate(ca.root_pem))
    assert isinstance(res.server_error, ssl.SSLError)
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in str(res.server_error)
    # TLS 1.3: the client learns of the rejection on its first read.
    assert res.client_error is not None


def test_server_with_unexpected_san_is_rejected(
    ca: LocalCA, client_cert: WorkloadCertificate
) -> None:
    impostor = ca.issue(Identity(TD, "default", "impostor"))
    res = handshake(server_context(impostor), client_context(client_cert))
    assert res.ok  # same CA: the chain is fine, the identity is not
    assert res.client_peer_der is not None
    with pytest.raises(TlsIdentityError) as err:
        verify_server_identity(res.client_peer_der, [SERVER, "spiffe://cluster.local/ns/x/sa/svc"])
    assert str(err.value) == SAN_MISMATCH_MESSAGE
    assert err.value.presented == ("spiffe://cluster.local/ns/default/sa/impostor",)


def test_server_identity_matches_any_expected_san(ca: LocalCA) -> None:
    # A leaf with a non-SPIFFE URI first and two SPIFFE ids; expected list has a service SAN.
    svc = Identity(TD, "default", "svc")
    cert = ca.issue(SERVER, uri_sans=["https://example.com/", str(SERVER), str(svc)])
    der = _der(cert)
    assert verify_server_identity(der, ["spiffe://cluster.local/ns/x/sa/y", svc]) == SERVER
    assert verify_server_identity(der, [str(SERVER)]) == SERVER
    assert peer_identity(der) == SERVER
    with pytest.raises(TlsIdentityError, match="expected SAN"):
        verify_server_identity(der, [])


def test_certificate_from_another_ca_fails_the_handshake(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    other = LocalCA.ephemeral()
    # Client cert from a foreign CA (the client itself trusts our root): the server rejects it.
    foreign_client = replace(other.issue(CLIENT), roots=(ca.root_cert,))
    res = handshake(server_context(server_cert), client_context(foreign_client))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)
    assert "unable to get local issuer certificate" in str(res.server_error)
    assert res.client_error is not None
    # Server cert from a foreign CA: the client rejects it.
    foreign_server = replace(other.issue(SERVER), roots=(ca.root_cert,))
    res = handshake(server_context(foreign_server), client_context(client_cert))
    assert isinstance(res.client_error, ssl.SSLCertVerificationError)
    # Both foreign: whoever verifies first refuses.
    res = handshake(server_context(server_cert), client_context(other.issue(CLIENT)))
    assert res.client_error is not None and res.server_error is not None


def test_other_trust_domain_rejected_by_server_check(
    ca: LocalCA, server_cert: WorkloadCertificate
) -> None:
    # Rust TrustDomainVerifier fails the handshake: the client gets an alert (bad_certificate,
    # rustls CertificateError::Other), not a completed handshake and then EOF.
    foreign = ca.issue(Identity("evil.example", "default", "client"))
    res = handshake(server_context(server_cert), client_context(foreign))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)
    assert "certificate rejected" in str(res.server_error)
    assert isinstance(res.client_error, ssl.SSLError)  # the alert, or a reset racing it
    assert "ALERT_BAD_CERTIFICATE" in refused_alert(
        server_context(server_cert), client_context(foreign)
    )
    # The post-handshake check still says why (callers without the in-handshake hook).
    with pytest.raises(TlsIdentityError, match=r"trust domain 'cluster\.local'"):
        verify_client_trust_domain(_der(foreign), server_cert.identity.trust_domain)
    # Any SAN in the trust domain is enough; the identity returned is still the first one.
    both = ca.issue(foreign.identity, uri_sans=[str(foreign.identity), str(CLIENT)])
    assert verify_client_trust_domain(_der(both), TD) == foreign.identity


def test_expired_certificates_fail_the_handshake(
    ca: LocalCA, server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    res = handshake(server_context(expired_certificate(ca, SERVER)), client_context(client_cert))
    assert isinstance(res.client_error, ssl.SSLCertVerificationError)
    assert "expired" in str(res.client_error)
    res = handshake(server_context(server_cert), client_context(expired_certificate(ca, CLIENT)))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)
    res = handshake(
        server_context(not_yet_valid_certificate(ca, SERVER)), client_context(client_cert)
    )
    assert isinstance(res.client_error, ssl.SSLCertVerificationError)


def test_intermediate_chain_is_presented(ca: LocalCA, client_cert: WorkloadCertificate) -> None:
    inter = intermediate_ca(ca)
    cert = issue_via(ca, inter, SERVER)
    res = handshake(server_context(cert), client_context(client_cert))
    assert res.ok, res.client_error
    # And the client side with an intermediate, towards a server trusting only the root.
    res = handshake(server_context(ca.issue(SERVER)), client_context(issue_via(ca, inter, CLIENT)))
    assert res.ok, res.server_error


def test_multiple_roots_in_bundle(ca: LocalCA) -> None:
    other = LocalCA.ephemeral()
    roots = (ca.root_cert, other.root_cert)
    server = replace(ca.issue(SERVER), roots=roots)
    client = replace(other.issue(CLIENT), roots=roots)
    assert handshake(server_context(server), client_context(client)).ok


@pytest.mark.both_loops
async def test_asyncio_streams_handshake(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    seen: list[Identity] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        obj = writer.get_extra_info("ssl_object")
        seen.append(verify_client_trust_domain(obj.getpeercert(binary_form=True), TD))
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(server_cert))
    port = server.sockets[0].getsockname()[1]
    async with asyncio.timeout(10):
        # server_hostname="" keeps asyncio from defaulting it to the host: no SNI, no hostname.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(client_cert), server_hostname=""
        )
        obj = writer.get_extra_info("ssl_object")
        assert obj.selected_alpn_protocol() == "h2"
        assert obj.version() == "TLSv1.3"
        assert verify_server_identity(obj.getpeercert(binary_form=True), [SERVER]) == SERVER
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        writer.close()
        await writer.wait_closed()
    server.close()
    await server.wait_closed()
    assert seen == [CLIENT]
