"""Connection plumbing shared by the xDS and CA clients: address, TLS roots, token, headers.

Follows istio/ztunnel ``src/tls/control.rs`` and ``src/identity/auth.rs``: server-only TLS (no
client certificate), ALPN h2, roots from a path, inline PEM or ``SYSTEM``, an optional
alternative name to verify; h2 keepalive 30 s with a 10 s ack timeout; a 5 s connect timeout.
Every call carries the configured extra headers and, with a token, ``authorization: Bearer
<token>`` and ``clusterid`` (``AuthSource::insert_headers``; with no token, neither). The token
file and the roots file are read again for every new connection, so a rotated projected token or
root bundle is picked up without a restart.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass

from grpclib.client import Channel
from grpclib.config import Configuration

from ztunnel.config import AuthToken

__all__ = [
    "CONNECT_TIMEOUT",
    "ControlPlaneError",
    "ControlPlaneTarget",
    "Endpoint",
    "client_ssl_context",
    "read_token",
]

CONNECT_TIMEOUT = 5.0
KEEPALIVE_TIME = 30.0
KEEPALIVE_TIMEOUT = 10.0
SYSTEM_ROOTS = "SYSTEM"
_PEM_BEGIN = "-----BEGIN"
_HEADER_KEY = re.compile(r"[0-9a-z_.\-]+")
_HEADER_VALUE = re.compile(r"[ !-~]+")  # printable ASCII, as gRPC metadata requires
_RESERVED_HEADERS = frozenset({"te", "content-type", "user-agent"})  # grpclib sets these
_AUTH_HEADERS = frozenset({"authorization", "clusterid"})


class ControlPlaneError(Exception):
    """Connecting to istiod is impossible right now (bad roots, missing token, bad address)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed ``XDS_ADDRESS``/``CA_ADDRESS``: ``https://host:port`` or ``http://host:port``."""

    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """Accept ``https://host[:port]``, ``http://host[:port]`` (plaintext, for tests) and a
        bare ``host:port`` (TLS implied); IPv6 hosts go in brackets."""
        text = url.strip()
        scheme, sep, rest = text.partition("://")
        if not sep:
            scheme, rest = "https", text
        if scheme not in ("http", "https"):
            raise ValueError(f"invalid control plane address {url!r}: scheme must be https or http")
        rest = rest.rstrip("/")
        m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^/:\[\]\s]+)(?::(\d+))?", rest)
        if not m:
            raise ValueError(f"invalid control plane address {url!r} (want https://host:port)")
        host = m.group(1).strip("[]")
        tls = scheme == "https"
        port = int(m.group(2)) if m.group(2) else (443 if tls else 80)
        if not 0 < port < 65536:
            raise ValueError(f"invalid control plane address {url!r}: port {port} out of range")
        return cls(host, port, tls)


def client_ssl_context(root_ca: str) -> ssl.SSLContext:
    """A TLS client context trusting ``root_ca``: a file path, inline PEM, or ``SYSTEM``.

    Server-only TLS (ztunnel presents no certificate to istiod), TLS 1.2+, ALPN h2 only.
    Raises ControlPlaneError if the roots cannot be loaded.
    """
    value = root_ca.strip()
    if value == SYSTEM_ROOTS:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # the system trust store
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks the name; no roots yet
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    if value == SYSTEM_ROOTS:
        return ctx
    try:
        if value.startswith(_PEM_BEGIN):
            ctx.load_verify_locations(cadata=value)
        else:
            ctx.load_verify_locations(cafile=value)
    except FileNotFoundError:
        raise ControlPlaneError(f"root certificate file {root_ca!r} does not exist") from None
    except (OSError, ssl.SSLError, ValueError) as e:
        where = "inline PEM" if value.startswith(_PEM_BEGIN) else repr(root_ca)
        raise ControlPlaneError(f"cannot load root certificates from {where}: {e}") from None
    return ctx


def read_token(auth: AuthToken) -> str:
    """The bearer token: the token file's contents (read now; a trailing newline is dropped),
    or the static value (``config.AuthToken``, decided as Rust does from ``AUTH_TOKEN``).

    Raises ControlPlaneError for a missing, unreadable or empty token file.
    """
    if auth.path is None:
        token, where = auth.value or "", "AUTH_TOKEN"
    else:
        where = repr(str(auth.path))
        try:
            token = auth.path.read_text(encoding="ascii", errors="strict").strip()
        except FileNotFoundError:
            raise ControlPlaneError(f"token file {where} does not exist") from None
        except (OSError, UnicodeError) as e:
            raise ControlPlaneError(f"cannot read token file {where}: {e}") from None
        if not token:
            raise ControlPlaneError(f"token file {where} exists, but was empty")
    if not token:
        raise ControlPlaneError("the token (AUTH_TOKEN) is empty")
    if not _HEADER_VALUE.fullmatch(token):
        raise ControlPlaneError(f"token from {where} is not printable ASCII")
    return token


def _check_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    out = []
    for key, value in headers:
        if not _HEADER_KEY.fullmatch(key) or key.startswith("grpc-") or key in _RESERVED_HEADERS:
            raise ValueError(f"invalid or reserved gRPC header name {key!r}")
        if not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {key!r}: value must be printable ASCII, got {value!r}")
        out.append((key, value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ControlPlaneTarget:
    """Everything needed to open a channel to istiod (xDS or CA) and authenticate each call.

    ``auth_token`` None sends neither ``authorization`` nor ``clusterid`` (Rust
    ``AuthSource::None``: no token file and no ``AUTH_TOKEN``).
    """

    address: str
    root_ca: str
    alt_hostname: str | None
    auth_token: AuthToken | None
    cluster_id: str
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        Endpoint.parse(self.address)  # fail early, with the address in the message
        _check_headers(self.headers)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint.parse(self.address)

    def metadata(self) -> list[tuple[str, str]]:
        """Call metadata: extra headers, then, with a token, ``authorization`` and ``clusterid``
        (which win, as ztunnel's interceptor overwrites them). Re-reads the token file."""
        md = [(k, v) for k, v in self.headers if k not in _AUTH_HEADERS]
        if self.auth_token is not None:
            md.append(("authorization", f"Bearer {read_token(self.auth_token)}"))
            if self.cluster_id:
                md.append(("clusterid", self.cluster_id))
        return md

    def roots_fingerprint(self) -> tuple[int, int, int] | None:
        """(inode, size, mtime) of a roots *file*, to notice rotation; None otherwise."""
        value = self.root_ca.strip()
        if value == SYSTEM_ROOTS or value.startswith(_PEM_BEGIN):
            return None
        try:
            st = os.stat(value)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def open_channel(self) -> Channel:
        """A new (not yet connected) channel; the caller closes it. Loads the roots now.

        Must be called from the event loop that will use the channel.
        """
        ep = self.endpoint
        ctx = client_ssl_context(self.root_ca) if ep.tls else None
        config = Configuration(
            _keepalive_time=KEEPALIVE_TIME,
            _keepalive_timeout=KEEPALIVE_TIMEOUT,
            ssl_target_name_override=self.alt_hostname if ep.tls else None,
        )
        return Channel(ep.host, ep.port, ssl=ctx, config=config)
