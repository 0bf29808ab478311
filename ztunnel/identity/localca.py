"""The embedded local CA: a self-signed ECDSA P-256 root that issues SPIFFE workload certificates.

Used when no CA address is configured (ztunnel's ``FAKE_CA``) and in tests. Several ztunnel
processes on one machine share one root through ``LocalCA.load_or_create(directory)``, which is
safe against concurrent starts: each file is published with ``link(2)`` from a fully written temp
file, so it appears atomically and the first writer wins; everyone then loads the winner's files.
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ztunnel.core.identity import Identity

from .certs import WorkloadCertificate, build_csr, parse_pem_chain

log = logging.getLogger(__name__)

DEFAULT_SECRET_TTL = dt.timedelta(hours=24)
DEFAULT_ROOT_TTL = dt.timedelta(days=3650)
# not_before is moved back a little to tolerate clock skew between nodes; capped at a tenth of
# the lifetime so short test TTLs keep their half-life where the test expects it.
DEFAULT_BACKDATE = dt.timedelta(minutes=1)
DEFAULT_TRUST_DOMAIN = "cluster.local"
ROOT_CERT_FILE = "root-cert.pem"
ROOT_KEY_FILE = "root-key.pem"
_ROOT_COMMON_NAME = "ztunnel-py local CA"
# How long a loser of the creation race waits for a half-written file (O_EXCL fallback only).
_READ_RETRY_SECONDS = 5.0


def _whole_seconds_up(delta: dt.timedelta) -> dt.timedelta:
    # X.509 times have one-second resolution; round lifetimes up so a cert never lives less.
    return dt.timedelta(seconds=math.ceil(delta.total_seconds()))


def _whole_seconds_down(delta: dt.timedelta) -> dt.timedelta:
    return dt.timedelta(seconds=math.floor(delta.total_seconds()))


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _spki(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# What a CA certificate may sign: certificates and CRLs (and its own signatures).
CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _self_signed_root(
    key: ec.EllipticCurvePrivateKey, trust_domain: str, lifetime: dt.timedelta, now: float
) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain),
            x509.NameAttribute(NameOID.COMMON_NAME, _ROOT_COMMON_NAME),
        ]
    )
    start = dt.datetime.fromtimestamp(int(now), dt.UTC) - dt.timedelta(hours=1)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _publish(directory: Path, name: str, data: bytes, mode: int) -> bool:
    """Create ``directory/name`` holding ``data`` unless it exists; True if this call created it.

    The content is written and fsynced in a private temp file first, then hard-linked into place:
    link(2) fails with EEXIST instead of overwriting, and readers never see a partial file.
    """
    final = directory / name
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, final)
            created = True
        except FileExistsError:
            created = False
        except OSError as e:
            # Some filesystems (FUSE, some overlay setups) refuse hard links: fall back to O_EXCL.
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            created = _create_exclusive(final, data, mode)
    finally:
        os.unlink(tmp)
    if created:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return created


def _create_exclusive(path: Path, data: bytes, mode: int) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        return False
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_pem(path: Path, parse: Callable[[bytes], object]) -> object:
    """Read and parse ``path``, retrying briefly: under the O_EXCL fallback a racing writer may
    not have finished writing it yet."""
    deadline = time.monotonic() + _READ_RETRY_SECONDS
    while True:
        data = path.read_bytes()
        try:
            return parse(data)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class LocalCA:
    """A CA held in memory: root key + self-signed root; issues SPIFFE leaf certificates.

    Implements ``CertificateProvider`` (``async sign(identity)``). Leaves carry the SPIFFE id as
    the only (critical) URI SAN, an empty subject, keyUsage digitalSignature (plus
    keyEncipherment for RSA keys only, where it means something), extendedKeyUsage serverAuth +
    clientAuth, and live ``ttl`` (``SECRET_TTL``) from now, with not_before backdated slightly.
    """

    def __init__(
        self,
        root_key: ec.EllipticCurvePrivateKey,
        root_cert: x509.Certificate,
        *,
        ttl: dt.timedelta = DEFAULT_SECRET_TTL,
        backdate: dt.timedelta = DEFAULT_BACKDATE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if _spki(root_key.public_key()) != _spki(root_cert.public_key()):
            raise ValueError("CA root key does not match the root certificate")
        if ttl <= dt.timedelta(0):
            raise ValueError(f"certificate TTL must be positive, got {ttl}")
        self.root_key = root_key
        self.root_cert = root_cert
        self.ttl = ttl
        self.backdate = backdate
        self._clock = clock
        self._root_pem = root_cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
        self._aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key())

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def ephemeral(
        cls,
        *,
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        ttl: dt.timedelta = DEFAULT_SECRET_TTL,
        root_ttl: dt.timedelta = DEFAULT_ROOT_TTL,
        clock: Callable[[], float] = time.time,
    ) -> LocalCA:
        """A fresh CA living only in memory. Each call gives a different, unrelated root."""
        key = ec.generate_private_key(ec.SECP256R1())
        return cls(
            key, _self_signed_root(key, trust_domain, root_ttl, clock()), ttl=ttl, clock=clock
        )

    @classmethod
    def from_pem(
        cls,
        root_cert_pem: str | bytes,
        root_key_pem: str | bytes,
        *,
        ttl: dt.timedelta = DEFAULT_SECRET_TTL,
        clock: Callable[[], float] = time.time,
    ) -> LocalCA:
        """A CA from an existing PEM root certificate and (unencrypted) ECDSA key."""
        cert_b = root_cert_pem.encode() if isinstance(root_cert_pem, str) else root_cert_pem
        key_b = root_key_pem.encode() if isinstance(root_key_pem, str) else root_key_pem
        key = serialization.load_pem_private_key(key_b, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError("the local CA needs an ECDSA root key")
        return cls(key, x509.load_pem_x509_certificate(cert_b), ttl=ttl, clock=clock)

    @classmethod
    def load_or_create(
        cls,
        directory: Path,
        *,
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        ttl: dt.timedelta = DEFAULT_SECRET_TTL,
        root_ttl: dt.timedelta = DEFAULT_ROOT_TTL,
        clock: Callable[[], float] = time.time,
    ) -> LocalCA:
        """Load ``root-cert.pem`` + ``root-key.pem`` (0600) from ``directory``, creating them if absent.

        Safe when several processes call it at once on the same directory: the key is published
        first (first link wins), everyone loads the published key, then the root certificate for
        that key is published the same way. A process that died between the two steps leaves a
        key without certificate; the next call completes it. Raises ValueError if the files do
        not belong together or the root has expired (remove the directory to start over).
        """
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key_path = directory / ROOT_KEY_FILE
        cert_path = directory / ROOT_CERT_FILE

        if not key_path.exists():
            new_key = ec.generate_private_key(ec.SECP256R1())
            if _publish(directory, ROOT_KEY_FILE, _pem_key(new_key), 0o600):
                log.info("created local CA root key %s", key_path)
        key = _read_pem(key_path, lambda b: serialization.load_pem_private_key(b, password=None))
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an ECDSA private key")
        if key_path.stat().st_mode & 0o077:
            log.warning("%s is readable by group/others; it should be mode 0600", key_path)

        if not cert_path.exists():
            root = _self_signed_root(key, trust_domain, root_ttl, clock())
            if _publish(
                directory, ROOT_CERT_FILE, root.public_bytes(serialization.Encoding.PEM), 0o644
            ):
                log.info("created local CA root certificate %s", cert_path)
        cert = _read_pem(cert_path, x509.load_pem_x509_certificate)
        assert isinstance(cert, x509.Certificate)
        if _spki(cert.public_key()) != _spki(key.public_key()):
            raise ValueError(
                f"{cert_path} does not match {key_path}; remove {directory} to start over"
            )
        if cert.not_valid_after_utc.timestamp() <= clock():
            raise ValueError(
                f"{cert_path} expired at {cert.not_valid_after_utc}; remove {directory}"
            )
        return cls(key, cert, ttl=ttl, clock=clock)

    # -- accessors ------------------------------------------------------------------------------

    @property
    def root_pem(self) -> str:
        return self._root_pem

    @property
    def trust_domain(self) -> str:
        """The root's organization, which ``ephemeral``/``load_or_create`` set to the trust domain."""
        attrs = self.root_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        return str(attrs[0].value) if attrs else DEFAULT_TRUST_DOMAIN

    # -- issuing --------------------------------------------------------------------------------

    def _validity(
        self, ttl: dt.timedelta | None, not_before: dt.datetime | None
    ) -> tuple[dt.datetime, dt.datetime]:
        ttl = _whole_seconds_up(self.ttl if ttl is None else ttl)
        if not_before is not None:
            return not_before, not_before + ttl
        # Whole seconds, because that is all X.509 can encode; doing it here keeps the half-life
        # of short-lived test certificates where the caller expects it.
        start = dt.datetime.fromtimestamp(int(self._clock()), dt.UTC)
        back = _whole_seconds_down(min(self.backdate, ttl / 10))
        return start - back, start + ttl

    def sign_certificate(
        self,
        public_key: CertificatePublicKeyTypes,
        uri_sans: Sequence[str],
        *,
        ttl: dt.timedelta | None = None,
        not_before: dt.datetime | None = None,
    ) -> x509.Certificate:
        """Issue a leaf for ``public_key`` with exactly ``uri_sans`` as its (critical) URI SANs.

        ``not_before`` (aware datetime) pins the validity window start, e.g. in the past for an
        already-expired test certificate; by default it is now minus a small backdate.
        """
        if not uri_sans:
            raise ValueError("a workload certificate needs at least one URI SAN")
        nb, na = self._validity(ttl, not_before)
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.root_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(nb)
            .not_valid_after(na)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    # keyEncipherment is meaningless for EC keys (ECDHE, not RSA key transport).
                    key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            # Critical because the subject is empty (RFC 5280 4.2.1.6), as Istio's CA does.
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uri_sans]),
                critical=True,
            )
            .add_extension(self._aki, critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(self.root_key, hashes.SHA256())
        )

    def sign_csr(
        self,
        csr_pem: str | bytes,
        *,
        ttl: dt.timedelta | None = None,
        identity: Identity | None = None,
    ) -> list[str]:
        """Sign a PEM CSR; return the Istio CA response ``cert_chain`` (leaf PEM, root bundle PEM).

        The SANs are the CSR's URI SANs, or ``identity`` when given (the impersonated identity,
        as istiod does for a node proxy). Raises ValueError for a bad signature or no SPIFFE SAN.
        """
        data = csr_pem.encode("ascii") if isinstance(csr_pem, str) else csr_pem
        csr = x509.load_pem_x509_csr(data)
        if not csr.is_signature_valid:
            raise ValueError("CSR signature is invalid")
        if identity is not None:
            sans = [str(identity)]
        else:
            try:
                ext = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                sans = ext.value.get_values_for_type(x509.UniformResourceIdentifier)
            except x509.ExtensionNotFound:
                sans = []
            for san in sans:
                Identity.parse(san)  # raises ValueError for anything not SPIFFE-shaped
            if not sans:
                raise ValueError("CSR has no URI SAN")
        leaf = self.sign_certificate(csr.public_key(), sans, ttl=ttl)
        return [leaf.public_bytes(serialization.Encoding.PEM).decode("ascii"), self._root_pem]

    def issue(
        self,
        identity: Identity,
        *,
        ttl: dt.timedelta | None = None,
        not_before: dt.datetime | None = None,
        key: ec.EllipticCurvePrivateKey | None = None,
        uri_sans: Sequence[str] | None = None,
    ) -> WorkloadCertificate:
        """Issue a ``WorkloadCertificate`` for ``identity`` directly (no CSR round trip).

        ``uri_sans`` overrides the SAN list (tests: extra or non-SPIFFE SANs; it must still hold
        a SPIFFE id). ``key`` reuses a key instead of generating a P-256 one.
        """
        key = key or ec.generate_private_key(ec.SECP256R1())
        sans = list(uri_sans) if uri_sans is not None else [str(identity)]
        leaf = self.sign_certificate(key.public_key(), sans, ttl=ttl, not_before=not_before)
        return WorkloadCertificate(key, leaf, (), (self.root_cert,))

    async def sign(self, identity: Identity) -> WorkloadCertificate:
        """``CertificateProvider``: the same CSR flow as against istiod, done in-process.

        Pure CPU, well under a millisecond for P-256, so it runs inline on the event loop.
        """
        key, csr = build_csr(identity)
        chain = self.sign_csr(csr, identity=identity)
        parsed = parse_pem_chain(chain)
        cert = WorkloadCertificate(key, parsed.leaf, parsed.intermediates, parsed.roots)
        if cert.identity != identity:
            raise ValueError(f"local CA issued {cert.identity}, requested {identity}")
        return cert
