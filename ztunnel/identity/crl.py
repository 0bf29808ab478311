"""Certificate revocation lists (``CRL_PATH``, the chart's ``peerCaCrl.enabled``).

Follows istio/ztunnel ``src/tls/crl.rs`` and ``src/tls/revocation.rs``:

* the file holds PEM CRLs (non-CRL PEM blocks are skipped) or one DER CRL; an empty file, or
  a PEM file with no CRL block, means "no revocations"; a missing file at start is a warning
  (checked again later), any other unreadable or unparsable file is an error at start;
* every certificate of a peer's chain except the trust anchor is checked (webpki
  ``RevocationCheckDepth::Chain``); a certificate whose issuer has no CRL here passes
  (``UnknownStatusPolicy::Allow``); a CRL past its next update still applies
  (``ExpirationPolicy::Ignore``); a CRL counts only if its signature verifies with the
  issuing certificate's key;
* the file is reloaded when it changes (Rust watches the directory with a 2 s debounce; this
  module stats the file at most once a second when it is consulted); a reload that fails to
  parse keeps the previous CRLs.

Rejections are counted in ``istio_crl_policy_rejections_total{reporter}`` and logged (at most
one line a second). After a reload, live connections are re-checked with
:meth:`CrlManager.revoked_chain` on the chain their handshake verified, inbound and outbound,
and the revoked ones closed (Rust ``RevocationIndex::navigate``). A connection whose verified
chain was not recorded is re-checked against our own CA certificates only, and counted in
``istio_crl_untracked_connections_total{reporter}`` (Rust's count of connections its index
could not track).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa

log = logging.getLogger(__name__)

RELOAD_CHECK_INTERVAL = 1.0  # how often the watcher re-checks live connections
_CRL_KEY_TYPES = (
    rsa.RSAPublicKey,
    ec.EllipticCurvePublicKey,
    ed25519.Ed25519PublicKey,
    ed448.Ed448PublicKey,
    dsa.DSAPublicKey,
)
_LOG_INTERVAL = 1.0

__all__ = ["CrlError", "CrlManager"]


class CrlError(ValueError):
    """The CRL file cannot be read or parsed."""


@dataclass(frozen=True, slots=True)
class _Crl:
    crl: x509.CertificateRevocationList
    issuer: bytes  # DER of the issuer name
    revoked: frozenset[int]


def parse_crls(data: bytes) -> list[x509.CertificateRevocationList]:
    """The CRLs in ``data`` (Rust ``CrlManager::parse_crl_file``)."""
    if not data.strip():
        return []
    if data.lstrip().startswith(b"-----BEGIN"):
        out = []
        marker = b"-----BEGIN X509 CRL-----"
        end = b"-----END X509 CRL-----"
        pos = 0
        while (start := data.find(marker, pos)) >= 0:
            stop = data.find(end, start)
            if stop < 0:
                raise CrlError("unterminated PEM CRL block")
            block = data[start : stop + len(end)]
            try:
                out.append(x509.load_pem_x509_crl(block))
            except ValueError as e:
                raise CrlError(f"failed to parse crl {len(out) + 1}: {e}") from None
            pos = stop + len(end)
        return out
    try:
        return [x509.load_der_x509_crl(data)]
    except ValueError as e:
        raise CrlError(f"failed to parse crl 1: {e}") from None


def _signed_by(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    key = issuer.public_key()
    if not isinstance(key, _CRL_KEY_TYPES):
        return False
    try:
        return crl.is_signature_valid(key)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return False


class CrlManager:
    """The CRLs of one file, reloaded when it changes. Thread-safe (handshakes may run on
    several threads); ``clock`` is injectable for tests."""

    def __init__(
        self,
        path: Path,
        *,
        on_reject: Callable[[str], None] | None = None,
        on_untracked: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._on_reject = on_reject
        self._on_untracked = on_untracked
        self._last_untracked_log = 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._crls: list[_Crl] = []
        self._serials: frozenset[int] = frozenset()  # every serial any CRL lists
        self._stamp: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) loaded
        self._verified: dict[tuple[int, bytes], bool] = {}  # (id(crl), issuer DER) -> ok
        self._last_log = 0.0
        self.generation = 0
        try:
            self._load()
        except FileNotFoundError:
            log.warning("CRL file %s not found; will retry when a peer is checked", path)
        except OSError as e:
            raise CrlError(f"failed to read CRL file {path}: {e}") from None

    # -- loading ----------------------------------------------------------------------------------

    def _load(self) -> None:
        st = os.stat(self.path)
        data = self.path.read_bytes()
        crls = [
            _Crl(c, c.issuer.public_bytes(), frozenset(r.serial_number for r in c))
            for c in parse_crls(data)
        ]
        serials = frozenset().union(*(c.revoked for c in crls))
        with self._lock:
            self._crls = crls
            self._serials = serials
            self._verified = {}
            self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            self.generation += 1
        log.info("loaded %d CRL(s) from %s", len(crls), self.path)

    def maybe_reload(self) -> None:
        """Reload if the file changed since it was loaded. One stat per check: every data-plane
        worker then sees a new file at its next handshake, so they all decide alike at once."""
        try:
            st = os.stat(self.path)
        except OSError:
            return  # gone or unreadable: keep what we have (Rust keeps the last good CRLs)
        if (st.st_mtime_ns, st.st_size, st.st_ino) == self._stamp:
            return
        try:
            self._load()
        except (OSError, CrlError) as e:
            log.warning(
                "CRL file %s changed but cannot be loaded (keeping the old CRLs): %s", self.path, e
            )
            self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)

    @property
    def count(self) -> int:
        return len(self._crls)

    # -- checking ---------------------------------------------------------------------------------

    def is_revoked(self, cert: x509.Certificate, issuer: x509.Certificate | None) -> bool:
        """Whether a CRL from ``cert``'s issuer, signed by ``issuer``, lists ``cert``.

        ``issuer`` None (not known): a CRL whose issuer name matches still counts only if it
        was verified against that issuer before; otherwise unknown status, allowed."""
        self.maybe_reload()
        return self._listed(cert, issuer)

    def _listed(self, cert: x509.Certificate, issuer: x509.Certificate | None) -> bool:
        crls = self._crls
        if not crls:
            return False
        name = cert.issuer.public_bytes()
        serial = cert.serial_number
        for c in crls:
            if c.issuer != name or serial not in c.revoked:
                continue
            if issuer is None:
                continue
            key = (id(c), issuer.fingerprint(hashes.SHA256()))
            ok = self._verified.get(key)
            if ok is None:
                ok = _signed_by(c.crl, issuer)
                with self._lock:
                    self._verified[key] = ok
            if ok:
                return True
        return False

    def revoked_chain(self, peer_der: bytes, chain: Sequence[x509.Certificate]) -> bool:
        """Whether a live connection's verified chain holds a certificate revoked now: the
        leaf (DER) and each certificate above it but the trust anchor, each checked against a
        CRL signed by its issuer (Rust ``chain_is_revoked``, re-run on established connections
        after a reload). ``chain`` is the chain above the leaf as verified (``osslverify``),
        issuer first; the issuer of each certificate is looked up by name in it, so a set of
        CA certificates (ours, which a mesh peer's chain shares) also serves when no chain was
        recorded. A certificate whose issuer is not there ends the walk: unknown status,
        allowed, as :meth:`is_revoked` does; a self-issued one is the anchor. Checked against
        the CRLs loaded now (the caller has just reloaded them): no stat of the file per
        connection."""
        if not self._crls or not peer_der:
            return False
        try:
            cert = x509.load_der_x509_certificate(peer_der)
        except ValueError:
            return False
        serials = self._serials
        if cert.serial_number not in serials and not any(c.serial_number in serials for c in chain):
            return False  # (most connections: no CRL lists any serial of the chain)
        for _ in range(len(chain)):
            name = cert.issuer
            issuer = next((c for c in chain if c.subject == name and c is not cert), None)
            if issuer is None:
                return False
            if self._listed(cert, issuer):
                return True
            if issuer.issuer == issuer.subject:
                return False
            cert = issuer
        return False

    def untracked(self, reporter: str, peer: str) -> None:
        """Count and (rate-limited) log a connection whose verified chain was not recorded:
        a reload re-checks it against our own CA certificates only, so a revoked certificate
        of another chain would not close it (Rust ``record_crl_untracked_connection``)."""
        if self._on_untracked is not None:
            self._on_untracked(reporter)
        now = self._clock()
        if now - self._last_untracked_log >= _LOG_INTERVAL:
            self._last_untracked_log = now
            log.warning(
                "CRL: no verified chain recorded for %s; connection not tracked (re-checked "
                "against our own CA certificates only)",
                peer,
            )

    def rejected(self, reporter: str, peer: str) -> None:
        """Count and (rate-limited) log a connection refused for a revoked certificate."""
        if self._on_reject is not None:
            self._on_reject(reporter)
        now = self._clock()
        if now - self._last_log >= _LOG_INTERVAL:
            self._last_log = now
            log.warning("connection refused: peer certificate revoked by CRL (%s)", peer)
