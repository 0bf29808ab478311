"""Workload certificates: key + leaf + chain + roots, CSR building, PEM chain and SAN parsing.

A ``WorkloadCertificate`` is immutable: rotation replaces the whole object, so anything derived
from it (TLS contexts, PEM encodings) can be cached on the object and dropped with it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ztunnel.core.identity import Identity

T = TypeVar("T")

_PEM_CERT_BEGIN = b"-----BEGIN CERTIFICATE-----"


class ParsedChain(NamedTuple):
    """An Istio CA ``cert_chain`` split into its parts."""

    leaf: x509.Certificate
    intermediates: tuple[x509.Certificate, ...]
    roots: tuple[x509.Certificate, ...]


def _as_bytes(pem: str | bytes) -> bytes:
    return pem.encode("ascii") if isinstance(pem, str) else pem


def load_pem_certificates(pem: str | bytes) -> list[x509.Certificate]:
    """All certificates in a PEM blob, in order. Raises ValueError if there is none."""
    data = _as_bytes(pem)
    if _PEM_CERT_BEGIN not in data:
        raise ValueError("no PEM certificate found")
    return x509.load_pem_x509_certificates(data)


def parse_pem_chain(chain: Sequence[str | bytes]) -> ParsedChain:
    """Split a CA response ``cert_chain``: leaf first, intermediates next, root bundle last.

    This is the ``IstioCertificateResponse.cert_chain`` shape. The last element may hold several
    concatenated roots (root rotation); any other element may, leniently, hold several
    certificates too (e.g. leaf and intermediates in one string), which are taken in order.
    """
    if len(chain) < 2:
        raise ValueError(
            f"certificate chain needs a leaf and a root bundle, got {len(chain)} element(s)"
        )
    certs = [c for element in chain[:-1] for c in load_pem_certificates(element)]
    roots = tuple(load_pem_certificates(chain[-1]))
    return ParsedChain(leaf=certs[0], intermediates=tuple(certs[1:]), roots=roots)


def _as_certificate(cert: x509.Certificate | bytes) -> x509.Certificate:
    return x509.load_der_x509_certificate(cert) if isinstance(cert, bytes) else cert


def uri_sans(cert: x509.Certificate | bytes) -> list[str]:
    """The URI subject alternative names of a certificate (object or DER), in order."""
    try:
        ext = _as_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.UniformResourceIdentifier)


def spiffe_identities(cert: x509.Certificate | bytes) -> list[Identity]:
    """The URI SANs that parse as ``spiffe://<td>/ns/<ns>/sa/<sa>``, in order; others are skipped."""
    out: list[Identity] = []
    for uri in uri_sans(cert):
        try:
            out.append(Identity.parse(uri))
        except ValueError:
            continue
    return out


def first_identity(cert: x509.Certificate | bytes) -> Identity | None:
    """The peer identity ztunnel uses for RBAC and metrics: the first SPIFFE URI SAN, if any."""
    ids = spiffe_identities(cert)
    return ids[0] if ids else None


def build_csr(identity: Identity) -> tuple[ec.EllipticCurvePrivateKey, str]:
    """A new ECDSA P-256 key and a PEM PKCS#10 CSR for ``identity``, as ztunnel sends to the CA.

    The CSR is signed with SHA-256, has an empty subject, and carries exactly one extension: a
    critical subjectAltName holding one URI, the SPIFFE id (critical because the subject is empty,
    RFC 5280 4.2.1.6).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _public_der(key: Any) -> bytes:
    return cast(
        bytes,
        key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


@dataclass(frozen=True, eq=False)
class WorkloadCertificate:
    """A workload's private key, leaf certificate, intermediates (leaf excluded) and trust roots.

    Equality and hashing are by object identity: a renewed certificate is a new object, and
    derived artefacts (TLS contexts) are cached per object via ``memo``.
    Construction checks that the key matches the leaf, that the leaf carries a SPIFFE URI SAN and
    that there is at least one root.
    """

    private_key: ec.EllipticCurvePrivateKey
    leaf: x509.Certificate
    intermediates: tuple[x509.Certificate, ...]
    roots: tuple[x509.Certificate, ...]
    _memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _memo_lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.private_key, ec.EllipticCurvePrivateKey):
            raise TypeError("workload certificates use ECDSA keys")
        if not self.roots:
            raise ValueError("workload certificate has no trust roots")
        if _public_der(self.private_key.public_key()) != _public_der(self.leaf.public_key()):
            raise ValueError("private key does not match the leaf certificate")
        ident = first_identity(self.leaf)
        if ident is None:
            raise ValueError(
                f"leaf certificate has no SPIFFE URI SAN (URI SANs: {uri_sans(self.leaf)})"
            )
        # Cache what the per-connection path reads; frozen dataclasses forbid plain assignment.
        self._memo["identity"] = ident
        self._memo["not_after_ts"] = self.leaf.not_valid_after_utc.timestamp()

    @classmethod
    def from_pem(
        cls, private_key_pem: str | bytes, chain: Sequence[str | bytes]
    ) -> WorkloadCertificate:
        """Build from a PEM (PKCS#8 or SEC1) key and a CA response chain (leaf first, roots last)."""
        key = serialization.load_pem_private_key(_as_bytes(private_key_pem), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError("workload certificates use ECDSA keys")
        parsed = parse_pem_chain(chain)
        return cls(key, parsed.leaf, parsed.intermediates, parsed.roots)

    # -- identity and validity ----------------------------------------------------------------

    @property
    def identity(self) -> Identity:
        """The first SPIFFE URI SAN of the leaf."""
        return cast(Identity, self._memo["identity"])

    @property
    def not_before(self) -> dt.datetime:
        """Start of validity of the leaf (timezone-aware, UTC)."""
        return self.leaf.not_valid_before_utc

    @property
    def not_after(self) -> dt.datetime:
        """End of validity of the leaf (timezone-aware, UTC)."""
        return self.leaf.not_valid_after_utc

    @property
    def refresh_at(self) -> dt.datetime:
        """Half-life point, when ztunnel asks for a new certificate."""
        nb, na = self.not_before, self.not_after
        return nb + (na - nb) / 2 if na > nb else na

    @property
    def serial(self) -> int:
        return self.leaf.serial_number

    def is_expired(self, now: float) -> bool:
        """Whether the leaf is past ``not_after`` at UNIX time ``now``."""
        return now >= cast(float, self._memo["not_after_ts"])

    # -- encodings ------------------------------------------------------------------------------

    def pem_chain(self) -> list[str]:
        """The Istio CA response shape: leaf PEM, one PEM per intermediate, then all roots in one."""
        return [
            _cert_pem(self.leaf),
            *(_cert_pem(c) for c in self.intermediates),
            "".join(_cert_pem(c) for c in self.roots),
        ]

    def chain_pem(self) -> bytes:
        """Leaf then intermediates, concatenated: what a TLS endpoint presents."""
        return self.memo(
            "chain_pem",
            lambda: b"".join(
                c.public_bytes(serialization.Encoding.PEM) for c in (self.leaf, *self.intermediates)
            ),
        )

    def roots_pem(self) -> str:
        """All roots, concatenated PEM (``cadata`` for ``SSLContext.load_verify_locations``)."""
        return self.memo("roots_pem", lambda: "".join(_cert_pem(c) for c in self.roots))

    def private_key_pem(self) -> bytes:
        """Unencrypted PKCS#8 PEM of the key. Secret: keep in memory only."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def memo(self, key: str, build: Callable[[], T]) -> T:
        """Cache ``build()`` on this certificate under ``key`` (e.g. TLS contexts).

        Built at most once per object, under a re-entrant lock (builders may use other memos).
        """
        try:
            return cast(T, self._memo[key])
        except KeyError:
            pass
        with self._memo_lock:
            if key not in self._memo:
                self._memo[key] = build()
            return cast(T, self._memo[key])

    def __repr__(self) -> str:
        return (
            f"WorkloadCertificate(identity={self.identity}, serial={self.serial:x}, "
            f"not_before={self.not_before.isoformat()}, not_after={self.not_after.isoformat()})"
        )
