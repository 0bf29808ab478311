"""WorkloadCertificate, CSR building, PEM chain parsing and SAN extraction."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import (
    WorkloadCertificate,
    build_csr,
    first_identity,
    load_pem_certificates,
    parse_pem_chain,
    spiffe_identities,
    uri_sans,
)
from ztunnel.identity.localca import LocalCA
from ztunnel.testing.certs import intermediate_ca, issue_via

pytestmark = pytest.mark.timeout(30)

ALICE = Identity("cluster.local", "default", "alice")


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.ephemeral()


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def test_csr_has_exactly_one_critical_uri_san() -> None:
    key, csr_pem = build_csr(ALICE)
    csr = x509.load_pem_x509_csr(csr_pem.encode())
    assert csr_pem.startswith("-----BEGIN CERTIFICATE REQUEST-----")
    assert csr.is_signature_valid
    assert len(csr.subject) == 0
    assert isinstance(csr.signature_hash_algorithm, hashes.SHA256)
    assert isinstance(key.curve, ec.SECP256R1)
    pub = csr.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey) and isinstance(pub.curve, ec.SECP256R1)
    assert pub.public_numbers() == key.public_key().public_numbers()
    exts = list(csr.extensions)
    assert len(exts) == 1
    (san,) = exts
    assert san.critical
    assert isinstance(san.value, x509.SubjectAlternativeName)
    assert list(san.value) == [x509.UniformResourceIdentifier(str(ALICE))]


def test_csr_keys_are_fresh() -> None:
    k1, _ = build_csr(ALICE)
    k2, _ = build_csr(ALICE)
    assert k1.private_numbers().private_value != k2.private_numbers().private_value


def test_parse_chain_leaf_first_roots_last(ca: LocalCA) -> None:
    inter = intermediate_ca(ca)
    other_root = LocalCA.ephemeral()
    cert = issue_via(ca, inter, ALICE)
    chain = [
        _pem(cert.leaf),
        _pem(inter.root_cert),
        _pem(ca.root_cert) + _pem(other_root.root_cert),
    ]
    parsed = parse_pem_chain(chain)
    assert parsed.leaf == cert.leaf
    assert parsed.intermediates == (inter.root_cert,)
    assert parsed.roots == (ca.root_cert, other_root.root_cert)

    wc = WorkloadCertificate.from_pem(cert.private_key_pem(), chain)
    assert wc.identity == ALICE
    assert wc.intermediates == (inter.root_cert,)
    assert wc.roots == (ca.root_cert, other_root.root_cert)
    # pem_chain() gives the same shape back.
    assert wc.pem_chain() == chain
    assert parse_pem_chain(wc.pem_chain()) == parsed
    assert wc.chain_pem() == (_pem(cert.leaf) + _pem(inter.root_cert)).encode()
    assert wc.roots_pem() == chain[-1]


def test_parse_chain_leaf_and_root_only(ca: LocalCA) -> None:
    cert = ca.issue(ALICE)
    parsed = parse_pem_chain([_pem(cert.leaf), ca.root_pem])
    assert parsed.intermediates == ()
    assert parsed.roots == (ca.root_cert,)


def test_parse_chain_lenient_about_bundled_leaf_element(ca: LocalCA) -> None:
    inter = intermediate_ca(ca)
    cert = issue_via(ca, inter, ALICE)
    parsed = parse_pem_chain([_pem(cert.leaf) + _pem(inter.root_cert), ca.root_pem.encode()])
    assert parsed.leaf == cert.leaf and parsed.intermediates == (inter.root_cert,)


@pytest.mark.parametrize("chain", [[], ["x"], ["not pem", "not pem"]])
def test_parse_chain_rejects(chain: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_pem_chain(chain)


def test_load_pem_certificates_rejects_empty() -> None:
    with pytest.raises(ValueError):
        load_pem_certificates(b"")


def test_san_helpers(ca: LocalCA) -> None:
    bob = Identity("other.td", "ns", "bob")
    sans = ["https://example.com/x", str(ALICE), "spiffe://td/not/the/shape", str(bob)]
    cert = ca.issue(ALICE, uri_sans=sans)
    der = cert.leaf.public_bytes(serialization.Encoding.DER)
    assert uri_sans(der) == sans
    assert uri_sans(cert.leaf) == sans
    assert spiffe_identities(der) == [ALICE, bob]
    assert first_identity(der) == ALICE
    # The certificate identity is the first SAN that parses as SPIFFE.
    assert cert.identity == ALICE
    assert uri_sans(ca.root_cert) == []
    assert first_identity(ca.root_cert) is None


def test_validity_properties(ca: LocalCA) -> None:
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    cert = ca.issue(ALICE, not_before=start, ttl=dt.timedelta(hours=24))
    assert cert.not_before == start
    assert cert.not_after == start + dt.timedelta(hours=24)
    assert cert.refresh_at == start + dt.timedelta(hours=12)
    assert cert.serial == cert.leaf.serial_number
    assert not cert.is_expired(start.timestamp())
    assert cert.is_expired((start + dt.timedelta(hours=24)).timestamp())
    assert "alice" in repr(cert) and "BEGIN" not in repr(cert)


def test_construction_checks(ca: LocalCA) -> None:
    cert = ca.issue(ALICE)
    other_key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(ValueError, match="does not match"):
        replace(cert, private_key=other_key)
    with pytest.raises(ValueError, match="no trust roots"):
        replace(cert, roots=())
    with pytest.raises(ValueError, match="no SPIFFE URI SAN"):
        ca.issue(ALICE, uri_sans=["https://example.com/"])


def test_equality_is_identity_and_memo_builds_once(ca: LocalCA) -> None:
    cert = ca.issue(ALICE)
    copy = replace(cert)
    assert cert == cert and cert != copy
    assert len({cert, copy}) == 2
    calls: list[int] = []

    def build() -> int:
        calls.append(1)
        return 42

    assert cert.memo("k", build) == 42
    assert cert.memo("k", build) == 42
    assert calls == [1]
    assert copy.memo("k", build) == 42
    assert calls == [1, 1]
