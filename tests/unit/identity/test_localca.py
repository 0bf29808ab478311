"""LocalCA: issued leaf contents, CSR signing, and the shared on-disk root (incl. a process race)."""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

import ztunnel
from ztunnel.core.identity import Identity
from ztunnel.identity import localca
from ztunnel.identity.certs import build_csr
from ztunnel.identity.localca import (
    DEFAULT_SECRET_TTL,
    ROOT_CERT_FILE,
    ROOT_KEY_FILE,
    LocalCA,
)

pytestmark = pytest.mark.timeout(60)

ALICE = Identity("cluster.local", "default", "alice")
REPO_ROOT = Path(ztunnel.__file__).resolve().parents[1]


def _fingerprint(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _check_leaf(leaf: x509.Certificate, ca: LocalCA, uri: str) -> None:
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical
    assert list(san.value) == [x509.UniformResourceIdentifier(uri)]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature
    assert not ku.value.key_cert_sign and not ku.value.key_encipherment  # EC key
    bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca is False
    assert len(leaf.subject) == 0
    assert leaf.issuer == ca.root_cert.subject
    leaf.verify_directly_issued_by(ca.root_cert)


def test_issue_directly() -> None:
    ca = LocalCA.ephemeral()
    before = int(time.time())
    cert = ca.issue(ALICE)
    after = time.time()
    _check_leaf(cert.leaf, ca, str(ALICE))
    assert cert.identity == ALICE
    assert cert.roots == (ca.root_cert,)
    assert cert.intermediates == ()
    # Default SECRET_TTL is 24 h from now; not_before is backdated by at most a minute.
    assert dt.timedelta(hours=24) == DEFAULT_SECRET_TTL
    assert before + 86400 <= cert.not_after.timestamp() <= after + 86400
    assert before - 61 <= cert.not_before.timestamp() <= after


def test_sign_csr_gives_istio_response_shape() -> None:
    ca = LocalCA.ephemeral(ttl=dt.timedelta(hours=1))
    key, csr = build_csr(ALICE)
    chain = ca.sign_csr(csr)
    assert len(chain) == 2 and chain[1] == ca.root_pem
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    _check_leaf(leaf, ca, str(ALICE))
    assert leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert dt.timedelta(hours=1) <= lifetime <= dt.timedelta(hours=1, minutes=1)


def test_sign_csr_impersonation_and_rejections() -> None:
    ca = LocalCA.ephemeral()
    bob = Identity("cluster.local", "default", "bob")
    _, csr = build_csr(ALICE)
    leaf = x509.load_pem_x509_certificate(ca.sign_csr(csr, identity=bob)[0].encode())
    _check_leaf(leaf, ca, str(bob))
    with pytest.raises(ValueError):
        ca.sign_csr("garbage")
    # A CSR whose SAN is not SPIFFE-shaped is refused.
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP256R1())
    bad = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier("https://x/")]),
            critical=True,
        )
        .sign(k, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    with pytest.raises(ValueError):
        ca.sign_csr(bad)
    no_san = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(k, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    with pytest.raises(ValueError, match="no URI SAN"):
        ca.sign_csr(no_san)


async def test_sign_is_a_certificate_provider() -> None:
    ca = LocalCA.ephemeral()
    cert = await ca.sign(ALICE)
    assert cert.identity == ALICE
    _check_leaf(cert.leaf, ca, str(ALICE))


def test_short_ttl_has_exact_half_life() -> None:
    now = 1_900_000_000.7
    ca = LocalCA.ephemeral(ttl=dt.timedelta(seconds=2), clock=lambda: now)
    cert = ca.issue(ALICE)
    # Whole seconds (X.509 resolution), no backdate for tiny TTLs: refresh 1 s after issue.
    assert cert.not_before.timestamp() == 1_900_000_000
    assert cert.not_after.timestamp() == 1_900_000_002
    assert cert.refresh_at.timestamp() == 1_900_000_001


def test_backdate_is_capped_at_a_minute() -> None:
    now = 1_900_000_000.0
    ca = LocalCA.ephemeral(clock=lambda: now)
    cert = ca.issue(ALICE)
    assert cert.not_before.timestamp() == now - 60
    assert cert.not_after.timestamp() == now + 86400


def test_root_properties() -> None:
    ca = LocalCA.ephemeral(trust_domain="example.org")
    root = ca.root_cert
    assert root.subject == root.issuer
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert root.not_valid_after_utc - root.not_valid_before_utc > dt.timedelta(days=3000)
    root.verify_directly_issued_by(root)
    assert ca.trust_domain == "example.org"


def test_ephemeral_cas_differ() -> None:
    a, b = LocalCA.ephemeral(), LocalCA.ephemeral()
    assert _fingerprint(a.root_cert) != _fingerprint(b.root_cert)
    leaf = b.issue(ALICE).leaf
    with pytest.raises(Exception):  # noqa: B017 - InvalidSignature or ValueError
        leaf.verify_directly_issued_by(a.root_cert)


def test_constructor_checks() -> None:
    a, b = LocalCA.ephemeral(), LocalCA.ephemeral()
    with pytest.raises(ValueError, match="does not match"):
        LocalCA(a.root_key, b.root_cert)
    with pytest.raises(ValueError, match="TTL"):
        LocalCA(a.root_key, a.root_cert, ttl=dt.timedelta(0))


# -- load_or_create ---------------------------------------------------------------------------


def _dir_listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def test_load_or_create_creates_then_loads(tmp_path: Path) -> None:
    d = tmp_path / "ca"
    first = LocalCA.load_or_create(d)
    assert _dir_listing(d) == [ROOT_CERT_FILE, ROOT_KEY_FILE]
    assert stat.S_IMODE((d / ROOT_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    second = LocalCA.load_or_create(d)
    assert _fingerprint(first.root_cert) == _fingerprint(second.root_cert)
    # Leaves from one validate against the other's root: it is the same CA.
    second.issue(ALICE).leaf.verify_directly_issued_by(first.root_cert)
    loaded = LocalCA.from_pem((d / ROOT_CERT_FILE).read_bytes(), (d / ROOT_KEY_FILE).read_bytes())
    assert _fingerprint(loaded.root_cert) == _fingerprint(first.root_cert)


def test_load_or_create_completes_a_half_created_dir(tmp_path: Path) -> None:
    # The winner of a race died after publishing the key: the next start adds the certificate.
    first = LocalCA.load_or_create(tmp_path)
    (tmp_path / ROOT_CERT_FILE).unlink()
    again = LocalCA.load_or_create(tmp_path)
    assert again.root_key.private_numbers() == first.root_key.private_numbers()
    assert _dir_listing(tmp_path) == [ROOT_CERT_FILE, ROOT_KEY_FILE]


def test_load_or_create_refuses_mismatched_or_expired(tmp_path: Path) -> None:
    LocalCA.load_or_create(tmp_path / "a")
    LocalCA.load_or_create(tmp_path / "b")
    (tmp_path / "a" / ROOT_CERT_FILE).write_bytes((tmp_path / "b" / ROOT_CERT_FILE).read_bytes())
    with pytest.raises(ValueError, match="does not match"):
        LocalCA.load_or_create(tmp_path / "a")
    LocalCA.load_or_create(tmp_path / "c")
    with pytest.raises(ValueError, match="expired"):
        LocalCA.load_or_create(tmp_path / "c", clock=lambda: time.time() + 3651 * 86400)


def test_load_or_create_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_link)
    a = LocalCA.load_or_create(tmp_path)
    b = LocalCA.load_or_create(tmp_path)
    assert _fingerprint(a.root_cert) == _fingerprint(b.root_cert)
    assert _dir_listing(tmp_path) == [ROOT_CERT_FILE, ROOT_KEY_FILE]
    assert stat.S_IMODE((tmp_path / ROOT_KEY_FILE).stat().st_mode) == 0o600


def test_threads_racing_share_one_root(tmp_path: Path) -> None:
    n = 8
    barrier = threading.Barrier(n)
    out: list[str] = []

    def run() -> None:
        barrier.wait()
        out.append(_fingerprint(LocalCA.load_or_create(tmp_path).root_cert))

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(out) == n and len(set(out)) == 1
    assert _dir_listing(tmp_path) == [ROOT_CERT_FILE, ROOT_KEY_FILE]


_RACER = """
import hashlib, logging, sys, time
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from ztunnel.identity.localca import LocalCA
logging.basicConfig(level=logging.INFO, format="%(message)s")
go_at = float(sys.argv[2])
while time.time() < go_at:
    pass
ca = LocalCA.load_or_create(Path(sys.argv[1]))
print(hashlib.sha256(ca.root_cert.public_bytes(serialization.Encoding.DER)).hexdigest())
"""


def test_processes_racing_share_one_root(tmp_path: Path) -> None:
    """Several ztunnel processes starting at once on one directory end with a single root."""
    dirs = [tmp_path / f"round{i}" for i in range(3)]
    per_dir = 4
    go_at = time.time() + 2.0  # after every interpreter has imported cryptography
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        (
            d,
            subprocess.Popen(
                [sys.executable, "-c", _RACER, str(d), repr(go_at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            ),
        )
        for d in dirs
        for _ in range(per_dir)
    ]
    results: dict[Path, set[str]] = {d: set() for d in dirs}
    logs: dict[Path, str] = {d: "" for d in dirs}
    for d, p in procs:
        out, err = p.communicate(timeout=40)
        assert p.returncode == 0, err
        results[d].add(out.strip())
        logs[d] += err
    for d in dirs:
        assert len(results[d]) == 1, results[d]
        # Exactly one process won each publication; the others loaded its files.
        assert logs[d].count("created local CA root key") == 1, logs[d]
        assert logs[d].count("created local CA root certificate") == 1, logs[d]
        on_disk = LocalCA.load_or_create(d)
        assert results[d] == {_fingerprint(on_disk.root_cert)}
        assert _dir_listing(d) == [ROOT_CERT_FILE, ROOT_KEY_FILE]


def test_loser_of_the_link_race_loads_the_winners_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deterministic version of the race: both files appear between our existence check and
    # our link(2), so both publications lose and the winner's files are loaded.
    winner = LocalCA.load_or_create(tmp_path)
    published: list[bool] = []
    real_publish = localca._publish

    def publish(directory: Path, name: str, data: bytes, mode: int) -> bool:
        published.append(real_publish(directory, name, data, mode))
        return published[-1]

    monkeypatch.setattr(localca, "_publish", publish)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    loser = LocalCA.load_or_create(tmp_path)
    assert published == [False, False]
    assert _fingerprint(loser.root_cert) == _fingerprint(winner.root_cert)
    assert loser.root_key.private_numbers() == winner.root_key.private_numbers()
    assert _dir_listing(tmp_path) == [ROOT_CERT_FILE, ROOT_KEY_FILE]
