"""What a TLS ClientHello offers for ALPN, read from the first bytes a client sends (sans-IO).

Python's ``ssl`` cannot refuse a handshake over ALPN: when the client's list has no protocol in
common with ours, OpenSSL (through CPython's callback) just carries on without ALPN. rustls, which
the Rust ztunnel uses, refuses it with a ``no_application_protocol`` alert, and lets a client that
offers no ALPN at all through. The HBONE server reads the ClientHello itself before OpenSSL sees
it (:func:`parse_client_hello`) to make the same decision, and answers with the same alert
(:data:`NO_APPLICATION_PROTOCOL_ALERT`).

Anything that is not a well-formed ClientHello is left to OpenSSL, which fails it in its own way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

_HANDSHAKE: Final = 22
_CLIENT_HELLO: Final = 1
_EXT_ALPN: Final = 16
MAX_CLIENT_HELLO: Final = 64 * 1024  # more than any real ClientHello (post-quantum ones ~2 KiB)

# A TLS alert record: fatal (2), no_application_protocol (120), legacy version 3.3.
NO_APPLICATION_PROTOCOL_ALERT: Final = b"\x15\x03\x03\x00\x02\x02\x78"


class NotClientHello(ValueError):
    """The bytes are not a well-formed TLS ClientHello (OpenSSL will say why)."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    """``alpn``: the protocols offered, in order; None when the extension is absent."""

    alpn: tuple[bytes, ...] | None

    def refuses(self, protocol: bytes) -> bool:
        """rustls' rule: ALPN offered without ``protocol`` is refused; no ALPN is accepted."""
        return self.alpn is not None and protocol not in self.alpn


def parse_client_hello(data: bytes | bytearray | memoryview) -> ClientHello | None:
    """The ClientHello at the start of ``data`` (TLS records as received), None if more bytes
    are needed. Raises :class:`NotClientHello` for anything else, or past ``MAX_CLIENT_HELLO``."""
    buf = bytes(data[: MAX_CLIENT_HELLO + 5 * 16])
    # Reassemble the handshake layer from the records.
    body = bytearray()
    pos = 0
    need: int | None = None
    while need is None or len(body) < need:
        if len(buf) - pos < 5:
            _check_limit(len(buf))
            return None
        ctype = buf[pos]
        length = int.from_bytes(buf[pos + 3 : pos + 5], "big")
        if ctype != _HANDSHAKE or buf[pos + 1] != 3 or length == 0 or length > 16_384 + 256:
            raise NotClientHello("not a TLS handshake record")
        if len(buf) - pos - 5 < length:
            _check_limit(len(buf))
            return None
        body += buf[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if need is None and len(body) >= 4:
            if body[0] != _CLIENT_HELLO:
                raise NotClientHello("first handshake message is not a ClientHello")
            need = 4 + int.from_bytes(body[1:4], "big")
            if need > MAX_CLIENT_HELLO:
                raise NotClientHello("ClientHello too large")
    return _parse_body(memoryview(bytes(body))[4:need])


def _check_limit(n: int) -> None:
    if n > MAX_CLIENT_HELLO + 5 * 16:
        raise NotClientHello("ClientHello too large")


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise NotClientHello("truncated ClientHello")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def _parse_body(body: memoryview) -> ClientHello:
    r = _Reader(body)
    r.take(2 + 32)  # legacy_version, random
    r.take(r.u8())  # legacy_session_id
    suites = r.u16()
    if suites % 2:
        raise NotClientHello("odd cipher suite list")
    r.take(suites)
    r.take(r.u8())  # legacy_compression_methods
    if not r.left:
        return ClientHello(None)  # no extensions at all
    ext = _Reader(r.take(r.u16()))
    alpn: tuple[bytes, ...] | None = None
    seen: set[int] = set()
    while ext.left:
        etype = ext.u16()
        data = ext.take(ext.u16())
        if etype in seen:
            raise NotClientHello(f"duplicate extension {etype}")
        seen.add(etype)
        if etype == _EXT_ALPN:
            alpn = _parse_alpn(data)
    return ClientHello(alpn)


def _parse_alpn(data: memoryview) -> tuple[bytes, ...]:
    r = _Reader(data)
    lst = _Reader(r.take(r.u16()))
    if r.left:
        raise NotClientHello("trailing bytes in the ALPN extension")
    out: list[bytes] = []
    while lst.left:
        n = lst.u8()
        if not n:
            raise NotClientHello("empty ALPN protocol name")
        out.append(bytes(lst.take(n)))
    if not out:
        raise NotClientHello("empty ALPN list")
    return tuple(out)
