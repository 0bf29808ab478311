"""CRL_PATH: peers with a revoked certificate are refused in the handshake (Rust src/tls/crl.rs,
src/tls/revocation.rs verify_cert_chain), the file is reloaded when it changes."""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.crl import CrlError, CrlManager, parse_crls
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import TLS_POLICY_MEMO, TlsPolicy, client_context, server_context
from ztunnel.testing.certs import (
    handshake,
    intermediate_ca,
    issue_via,
    refused_alert,
    revocation_list,
)

pytestmark = pytest.mark.timeout(30)

SERVER = Identity("cluster.local", "default", "server")
CLIENT = Identity("cluster.local", "default", "client")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def with_policy(cert: WorkloadCertificate, policy: TlsPolicy) -> WorkloadCertificate:
    cert.memo(TLS_POLICY_MEMO, lambda: policy)
    return cert


def write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode, as a ConfigMap update does


@pytest.fixture
def ca() -> LocalCA:
    return LocalCA.ephemeral()


def test_revoked_client_refused_in_the_handshake_with_an_alert(ca: LocalCA, tmp_path: Path) -> None:
    # Rust: WebPkiClientVerifier with the CRLs -> CertificateError::Revoked -> alert
    # certificate_revoked; the rejection is counted (crl_policy_rejections{reporter}).
    good, bad = ca.issue(CLIENT), ca.issue(CLIENT)
    path = tmp_path / "crl.pem"
    path.write_bytes(revocation_list(ca, [bad.serial]))
    rejected: list[str] = []
    crl = CrlManager(path, on_reject=rejected.append)
    server = with_policy(ca.issue(SERVER), TlsPolicy(crl=crl))
    assert handshake(server_context(server), client_context(good)).ok
    res = handshake(server_context(server), client_context(bad))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)
    assert "certificate revoked" in str(res.server_error)
    assert "ALERT_CERTIFICATE_REVOKED" in refused_alert(server_context(server), client_context(bad))
    assert rejected == ["destination", "destination"]


def test_revoked_server_refused_by_the_client(ca: LocalCA, tmp_path: Path) -> None:
    # Rust IdentityVerifier::verify_server_cert runs the same verify_cert_chain with the CRLs.
    server = ca.issue(SERVER)
    path = tmp_path / "crl.pem"
    path.write_bytes(revocation_list(ca, [server.serial]))
    rejected: list[str] = []
    client = with_policy(
        ca.issue(CLIENT), TlsPolicy(crl=CrlManager(path, on_reject=rejected.append))
    )
    res = handshake(server_context(server), client_context(client))
    assert isinstance(res.client_error, ssl.SSLCertVerificationError)
    assert rejected == ["source"]


def test_revoked_intermediate_refuses_its_leaves(ca: LocalCA, tmp_path: Path) -> None:
    # RevocationCheckDepth::Chain: the intermediate is checked against the root's CRL.
    inter = intermediate_ca(ca)
    leaf = issue_via(ca, inter, CLIENT)
    path = tmp_path / "crl.pem"
    path.write_bytes(revocation_list(ca, [inter.root_cert.serial_number]))
    server = with_policy(ca.issue(SERVER), TlsPolicy(crl=CrlManager(path)))
    res = handshake(server_context(server), client_context(leaf))
    assert isinstance(res.server_error, ssl.SSLCertVerificationError)


def test_unknown_issuer_and_forged_crls_allow(ca: LocalCA, tmp_path: Path) -> None:
    # UnknownStatusPolicy::Allow: no CRL from the leaf's issuer -> allowed. A CRL naming our CA
    # but signed by another key is not a CRL of that issuer.
    other = LocalCA.ephemeral()
    client = ca.issue(CLIENT)
    path = tmp_path / "crl.pem"
    path.write_bytes(
        revocation_list(other, [client.serial]) + revocation_list(ca, [client.serial], signer=other)
    )
    server = with_policy(ca.issue(SERVER), TlsPolicy(crl=CrlManager(path)))
    assert handshake(server_context(server), client_context(client)).ok


def test_reloaded_when_the_file_changes(ca: LocalCA, tmp_path: Path) -> None:
    client = ca.issue(CLIENT)
    path = tmp_path / "crl.pem"
    path.write_bytes(b"")  # empty: no revocations
    clock = Clock()
    crl = CrlManager(path, clock=clock)
    server = with_policy(ca.issue(SERVER), TlsPolicy(crl=crl))
    assert handshake(server_context(server), client_context(client)).ok
    write(path, revocation_list(ca, [client.serial], number=2))
    clock.now += 2
    assert not handshake(server_context(server), client_context(client)).ok
    write(path, b"garbage")  # a bad update keeps the last good CRLs
    clock.now += 2
    assert not handshake(server_context(server), client_context(client)).ok
    write(path, revocation_list(ca, [], number=3))
    clock.now += 2
    assert handshake(server_context(server), client_context(client)).ok
    assert crl.generation == 3


def test_file_formats(ca: LocalCA, tmp_path: Path) -> None:
    # Rust parse_crl_file: PEM (non-CRL blocks skipped) or one DER; empty means none; a missing
    # file is a warning; garbage is an error at start.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pem = revocation_list(ca, [5])
    der = x509.load_pem_x509_crl(pem).public_bytes(serialization.Encoding.DER)
    assert len(parse_crls(ca.root_pem.encode() + pem + pem)) == 2
    assert len(parse_crls(der)) == 1
    assert parse_crls(b"") == [] and parse_crls(ca.root_pem.encode()) == []
    CrlManager(tmp_path / "missing.pem")
    (tmp_path / "bad").write_bytes(b"not a crl")
    with pytest.raises(CrlError):
        CrlManager(tmp_path / "bad")


def test_tls12_enabled_adds_tls12(ca: LocalCA) -> None:
    # Rust tls/lib.rs tls_versions(): TLS12_ENABLED=true offers TLS 1.2 (ECDHE AES-GCM suites)
    # besides 1.3; otherwise 1.3 only.
    for enabled in (False, True):
        server = with_policy(ca.issue(SERVER), TlsPolicy(tls12=enabled))
        client = with_policy(ca.issue(CLIENT), TlsPolicy(tls12=True))
        cctx = client_context(client)
        cctx.maximum_version = ssl.TLSVersion.TLSv1_2
        res = handshake(server_context(server), cctx)
        if enabled:
            assert res.ok and res.version == "TLSv1.2", res
            assert res.cipher is not None and res.cipher.startswith("ECDHE-")
        else:
            assert not res.ok


def test_live_chain_recheck_covers_every_certificate_but_the_anchor(
    ca: LocalCA, tmp_path: Path
) -> None:
    # Rust chain_is_revoked (run by RevocationIndex::navigate after a reload): verify_cert_chain
    # with RevocationCheckDepth::Chain on the connection's verified chain, so a revoked leaf or
    # intermediate counts; the trust anchor itself is never checked; no CRL from an issuer is
    # UnknownStatusPolicy::Allow.
    inter = intermediate_ca(ca)
    leaf = issue_via(ca, inter, CLIENT)
    direct = ca.issue(CLIENT)
    chain = (inter.root_cert, ca.root_cert)  # as osslverify records it: issuer first
    path = tmp_path / "crl.pem"
    path.write_bytes(b"")
    clock = Clock()
    crl = CrlManager(path, clock=clock)
    rows = [
        # (CRL file, peer leaf, chain above it, revoked?)
        (b"", leaf, chain, False),
        (revocation_list(inter, [leaf.serial]), leaf, chain, True),  # leaf, by its issuer
        (revocation_list(ca, [inter.root_cert.serial_number]), leaf, chain, True),  # intermediate
        (revocation_list(ca, [ca.root_cert.serial_number]), leaf, chain, False),  # the anchor
        (revocation_list(ca, [leaf.serial]), leaf, chain, False),  # not the leaf's issuer
        (revocation_list(inter, [leaf.serial], signer=ca), leaf, chain, False),  # forged
        (revocation_list(inter, [leaf.serial]), leaf, (ca.root_cert,), False),  # unknown issuer
        (revocation_list(ca, [direct.serial]), direct, (ca.root_cert,), True),
        # Our own CA certificates in any order stand in for an unrecorded chain.
        (revocation_list(ca, [inter.root_cert.serial_number]), leaf, chain[::-1], True),
    ]
    for number, (data, cert, above, revoked) in enumerate(rows, start=2):
        write(path, data)
        clock.now += 2
        crl.maybe_reload()
        assert crl.generation == number
        assert crl.revoked_chain(cert.leaf.public_bytes(Encoding.DER), above) is revoked, (
            number,
            revoked,
        )


def test_a_changed_file_is_seen_at_the_very_next_check(ca: LocalCA, tmp_path: Path) -> None:
    # One stat per check, no throttle: with several data-plane workers, each decides with the
    # new file from its next handshake on, so they never disagree for a second.
    client = ca.issue(CLIENT)
    path = tmp_path / "crl.pem"
    path.write_bytes(b"")
    server = with_policy(ca.issue(SERVER), TlsPolicy(crl=CrlManager(path, clock=Clock())))
    assert handshake(server_context(server), client_context(client)).ok
    write(path, revocation_list(ca, [client.serial], number=2))
    assert not handshake(server_context(server), client_context(client)).ok


def test_a_connection_without_a_recorded_chain_counts_as_untracked(
    ca: LocalCA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rust record_crl_untracked_connection: a connection the CRL index cannot follow. Ours
    are re-checked by the chain their handshake verified; one with no chain recorded (the
    verify callback found no _ssl object) falls back to our own CA certificates and counts."""
    from ztunnel.proxy.hbone_outbound import _recheck_new

    path = tmp_path / "crl.pem"
    path.write_bytes(revocation_list(ca, []))
    untracked: list[str] = []
    crl = CrlManager(path, on_untracked=untracked.append)
    ours, peer = ca.issue(CLIENT), ca.issue(SERVER)
    der = peer.leaf.public_bytes(Encoding.DER)
    recorded = (*peer.intermediates, *peer.roots)
    assert _recheck_new(crl, crl.generation, der, recorded, ours) == recorded
    assert untracked == []
    with caplog.at_level(logging.WARNING, logger="ztunnel.identity.crl"):
        chain = _recheck_new(crl, crl.generation, der, (), ours)
        _recheck_new(crl, crl.generation, der, (), ours)
    assert chain == (*ours.intermediates, *ours.roots)
    assert untracked == ["source", "source"]
    assert len([r for r in caplog.records if "not tracked" in r.getMessage()]) == 1  # (a second)
    # Without CRL_PATH nothing is tracked nor counted.
    assert _recheck_new(None, 0, der, (), ours) == chain and len(untracked) == 2
