"""A certificate verification callback inside the TLS handshake, for ``ssl.SSLContext``.

Python's ``ssl`` runs OpenSSL's chain verification but offers no callback, so checks that
Rust's rustls verifiers make in the handshake (the server's trust-domain check,
``TrustDomainVerifier``; CRL revocation, ``verify_cert_chain``) would otherwise run only after
it, when the peer has already finished and sees a plain EOF instead of an alert. This module
installs OpenSSL's own verify callback (``SSL_CTX_set_verify``) on the context's ``SSL_CTX``
through ``ctypes``, against the libssl the ``_ssl`` module is linked to:

* the ``SSL_CTX *`` is read from the ``_ssl._SSLContext`` object (its first field after the
  object header, as CPython lays it out); the pointer is accepted only if OpenSSL then reports
  the same verify mode and options as the Python object, else nothing is installed and
  :func:`install` returns False (callers keep their post-handshake checks);
* the callback runs for each certificate of the verified chain, trust anchor first, leaf
  last (OpenSSL ``internal_verify``), only after OpenSSL's own checks passed
  (``preverify_ok``); a False from the check fails the handshake with the given X509 error,
  which OpenSSL turns into the matching TLS alert (``certificate_revoked`` for
  ``X509_V_ERR_CERT_REVOKED``);
* the callback holds the GIL (ctypes takes it; ``_ssl`` releases it around the handshake) and
  costs one DER encode per certificate per handshake (and a parse of the leaf; CA certificates
  are parsed once and shared), nothing per byte;
* on the last call of a successful verification (depth 0) it records the verified chain above
  the leaf (intermediates, then the trust anchor) for the connection: the ``SSL *`` comes from
  the store's ex-data, and the ``_ssl`` object owning it is the SSL's app data (CPython sets
  it to itself). :func:`take_verified_chain` hands it over after the handshake, matched by that
  object and the leaf, so a CRL reload can re-check the whole chain of a live connection
  (Rust ``RevocationIndex``).
"""

from __future__ import annotations

import ctypes
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

log = logging.getLogger(__name__)

X509_V_ERR_CERT_REVOKED = 23  # alert certificate_revoked (rustls: CertificateError::Revoked)
X509_V_ERR_CERT_REJECTED = 28  # alert bad_certificate (rustls: CertificateError::Other)
X509_V_ERR_APPLICATION_VERIFICATION = 50  # alert handshake_failure

__all__ = [
    "X509_V_ERR_APPLICATION_VERIFICATION",
    "X509_V_ERR_CERT_REJECTED",
    "X509_V_ERR_CERT_REVOKED",
    "ChainCheck",
    "VerifiedChain",
    "VerifyFailure",
    "available",
    "install",
    "take_verified_chain",
]


class VerifyFailure(Exception):
    """Raised by a check to fail the handshake with ``error`` (an X509_V_ERR_* code)."""

    def __init__(self, error: int, message: str) -> None:
        super().__init__(message)
        self.error = error


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """One certificate of the peer's chain as the callback sees it: ``depth`` 0 is the leaf;
    ``issuer`` is the certificate verified just before it (None for the top one)."""

    depth: int
    cert: x509.Certificate
    issuer: x509.Certificate | None


Check = Callable[[ChainCheck], None]

_VERIFY_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p)


class _Lib:
    def __init__(self) -> None:
        ssl_path, crypto_path = _linked_libs()
        self.ssl = ctypes.CDLL(ssl_path)
        self.crypto = ctypes.CDLL(crypto_path)
        s, c = self.ssl, self.crypto
        s.SSL_CTX_set_verify.argtypes = [ctypes.c_void_p, ctypes.c_int, _VERIFY_CB]
        s.SSL_CTX_set_verify.restype = None
        s.SSL_CTX_get_verify_mode.argtypes = [ctypes.c_void_p]
        s.SSL_CTX_get_verify_mode.restype = ctypes.c_int
        s.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
        s.SSL_CTX_get_options.restype = ctypes.c_uint64
        c.X509_STORE_CTX_get_current_cert.argtypes = [ctypes.c_void_p]
        c.X509_STORE_CTX_get_current_cert.restype = ctypes.c_void_p
        c.X509_STORE_CTX_get_error_depth.argtypes = [ctypes.c_void_p]
        c.X509_STORE_CTX_get_error_depth.restype = ctypes.c_int
        c.X509_STORE_CTX_set_error.argtypes = [ctypes.c_void_p, ctypes.c_int]
        c.X509_STORE_CTX_set_error.restype = None
        c.X509_STORE_CTX_get0_chain.argtypes = [ctypes.c_void_p]
        c.X509_STORE_CTX_get0_chain.restype = ctypes.c_void_p
        c.OPENSSL_sk_num.argtypes = [ctypes.c_void_p]
        c.OPENSSL_sk_num.restype = ctypes.c_int
        c.i2d_X509.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        c.i2d_X509.restype = ctypes.c_int
        c.X509_STORE_CTX_get_ex_data.argtypes = [ctypes.c_void_p, ctypes.c_int]
        c.X509_STORE_CTX_get_ex_data.restype = ctypes.c_void_p
        s.SSL_get_ex_data_X509_STORE_CTX_idx.argtypes = []
        s.SSL_get_ex_data_X509_STORE_CTX_idx.restype = ctypes.c_int
        s.SSL_get_ex_data.argtypes = [ctypes.c_void_p, ctypes.c_int]
        s.SSL_get_ex_data.restype = ctypes.c_void_p
        self.ssl_idx = s.SSL_get_ex_data_X509_STORE_CTX_idx()

    def owner_of(self, store: int) -> int:
        """The ``_ssl`` object (its address) whose handshake is verifying in ``store``; 0 if
        unknown. Reads pointers only, never dereferences one as a Python object."""
        ssl_ptr = self.crypto.X509_STORE_CTX_get_ex_data(store, self.ssl_idx)
        if not ssl_ptr:
            return 0
        return self.ssl.SSL_get_ex_data(ssl_ptr, 0) or 0  # SSL_get_app_data

    def cert_der(self, x509_ptr: int) -> bytes:
        n = self.crypto.i2d_X509(x509_ptr, None)
        if n <= 0:
            raise ValueError("i2d_X509 failed")
        buf = ctypes.create_string_buffer(n)
        cursor = ctypes.c_void_p(ctypes.addressof(buf))
        if self.crypto.i2d_X509(x509_ptr, ctypes.byref(cursor)) != n:
            raise ValueError("i2d_X509 wrote an unexpected length")
        return buf.raw


def _linked_libs() -> tuple[str, str]:
    """The libssl/libcrypto files this process has mapped for ``_ssl`` (never another copy)."""
    ssl_path = crypto_path = ""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6:
                continue
            path = parts[5]
            base = path.rsplit("/", 1)[-1]
            if base.startswith("libssl.so") and not ssl_path:
                ssl_path = path
            elif base.startswith("libcrypto.so") and not crypto_path:
                crypto_path = path
    if not ssl_path or not crypto_path:
        raise OSError("libssl/libcrypto not mapped (is _ssl statically linked?)")
    return ssl_path, crypto_path


_lib: _Lib | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _get_lib() -> _Lib | None:
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        with _lib_lock:
            if _lib is None and _lib_error is None:
                try:
                    _lib = _Lib()
                except (OSError, AttributeError) as e:
                    _lib_error = str(e)
                    log.warning("in-handshake certificate checks unavailable: %s", e)
    return _lib


def available() -> bool:
    return _get_lib() is not None


def _ssl_ctx_ptr(lib: _Lib, ctx: ssl.SSLContext) -> int | None:
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not ptr:
        return None
    # Confirm it is the SSL_CTX: OpenSSL must report what the Python object says.
    if lib.ssl.SSL_CTX_get_options(ptr) != int(ctx.options):
        return None
    want_mode = {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 3}[ctx.verify_mode]
    if lib.ssl.SSL_CTX_get_verify_mode(ptr) != want_mode:
        return None
    return ptr


VerifiedChain = tuple[x509.Certificate, ...]
"""A peer's verified chain above its leaf: intermediates from the leaf's issuer up, the trust
anchor last (empty when none was recorded)."""

# _ssl object address -> (leaf DER, chain) of its last successful verification, until
# take_verified_chain; bounded in case a caller never takes its handshake's chain
_chains: dict[int, tuple[bytes, VerifiedChain]] = {}
_MAX_PENDING = 4096
_MAX_CA_CACHE = 256


def take_verified_chain(sslobj: ssl.SSLObject | ssl.SSLSocket) -> VerifiedChain:
    """The chain the callback verified for this connection's peer (after the handshake; call
    once: it is handed over, not kept here). Empty when no callback ran for it or the record is
    not this connection's (another object at a reused address, or another leaf)."""
    owner = id(getattr(sslobj, "_sslobj", sslobj))
    got = _chains.pop(owner, None)
    if got is None:
        return ()
    leaf, chain = got
    try:
        if leaf != sslobj.getpeercert(binary_form=True):
            return ()
    except ValueError:  # (the handshake did not finish)
        return ()
    return chain


class _Verifier:
    """The per-context callback; keeps, per store, the certificates verified so far in this
    chain (trust anchor first)."""

    def __init__(self, lib: _Lib, check: Check) -> None:
        self.lib = lib
        self.check = check
        self.above: dict[int, list[x509.Certificate]] = {}
        # DER -> parsed CA certificate: every connection of a mesh shares a few of them
        self.cas: dict[bytes, x509.Certificate] = {}
        self.cfunc = _VERIFY_CB(self._callback)

    def _ca(self, der: bytes) -> x509.Certificate:
        cert = self.cas.get(der)
        if cert is None:
            if len(self.cas) >= _MAX_CA_CACHE:
                self.cas.clear()
            cert = self.cas[der] = x509.load_der_x509_certificate(der)
        return cert

    def _callback(self, preverify_ok: int, store: int) -> int:
        lib = self.lib
        try:
            if not preverify_ok:
                self.above.pop(store, None)
                return 0
            depth = lib.crypto.X509_STORE_CTX_get_error_depth(store)
            der = lib.cert_der(lib.crypto.X509_STORE_CTX_get_current_cert(store))
            # The top of the chain (the trust anchor) has no issuer here, whatever a previous
            # handshake that reused this store left behind.
            chain = lib.crypto.X509_STORE_CTX_get0_chain(store)
            top = chain is not None and depth >= lib.crypto.OPENSSL_sk_num(chain) - 1
            above = None if top else self.above.get(store)
            issuer = above[-1] if above else None
            if depth == 0:
                cert = x509.load_der_x509_certificate(der)
                self.above.pop(store, None)
            else:
                cert = self._ca(der)
                if above is None:
                    if len(self.above) > 4096:  # never reached unless OpenSSL skips depth 0
                        self.above.clear()
                    self.above[store] = [cert]
                else:
                    above.append(cert)
            self.check(ChainCheck(depth, cert, issuer))
            if depth == 0:
                owner = lib.owner_of(store)
                if owner:
                    if len(_chains) >= _MAX_PENDING:
                        _chains.clear()
                    _chains[owner] = (der, tuple(reversed(above)) if above else ())
            return 1
        except VerifyFailure as e:
            self.above.pop(store, None)
            lib.crypto.X509_STORE_CTX_set_error(store, e.error)
            return 0
        except Exception:
            self.above.pop(store, None)
            log.exception("certificate verification callback failed; refusing the peer")
            lib.crypto.X509_STORE_CTX_set_error(store, X509_V_ERR_APPLICATION_VERIFICATION)
            return 0


def install(ctx: ssl.SSLContext, check: Check) -> bool:
    """Run ``check`` on every certificate of the peer's chain inside the handshake.

    Call after ``verify_mode`` and options are set. Returns False (nothing installed) when the
    libssl hook is unavailable; the context keeps working without it."""
    lib = _get_lib()
    if lib is None:
        return False
    ptr = _ssl_ctx_ptr(lib, ctx)
    if ptr is None:
        log.warning("in-handshake certificate checks unavailable: SSL_CTX layout not recognised")
        return False
    verifier = _Verifier(lib, check)
    # The context owns the callback object: it lives exactly as long as the SSL_CTX uses it.
    ctx._ztunnel_verifier = verifier  # type: ignore[attr-defined]
    lib.ssl.SSL_CTX_set_verify(ptr, lib.ssl.SSL_CTX_get_verify_mode(ptr), verifier.cfunc)
    return True
