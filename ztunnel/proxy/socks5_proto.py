"""SOCKS5 (RFC 1928) as ztunnel speaks it, without I/O: the handshake parser and the replies.

What Rust's ``src/proxy/socks5.rs`` accepts: no authentication (method 0) and CONNECT only, to an
IPv4 address, an IPv6 address or a hostname. Its answers, which these functions give:

* every protocol error (version, no methods, no "no authentication" method, a command other than
  CONNECT, an unknown address type, a hostname that is not UTF-8, a hostname without the DNS
  proxy) is ``command not supported`` (7), Rust's ``SocksError::invalid_protocol``;
* a hostname that does not resolve is ``host unreachable`` (4);
* a client gone mid-handshake is ``general failure`` (1), Rust's ``From<io::Error>``;
* every reply names the bound address 0.0.0.0:0 (Rust's ``send_response`` dummy address).

The messages are Rust's, with its variant name in front (``CommandNotSupported: unsupported
command 2``), and #1927's fix (``methods cannot be zero``, without the version byte).

Where we go further than Rust: Rust sends its success reply before it dials the destination, so a
destination that refuses is, for the client, a connection closed after a success. We reply once
the upstream is established (TCP connected, or HBONE's CONNECT answered 200), and a failure gets
the RFC's code for it (:func:`reply_for`), which is what the RFC asks for and what Rust's own TODO
in ``handle_socks_connection`` wants.

The parser reads exactly what it needs (``Handshake.need``) and never past the request, so bytes
a client sends before our reply stay in the socket for the upstream.
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass

from ztunnel.core.addr import IPAddr, SocketAddr, ip_from_bytes, parse_ip
from ztunnel.core.errors import (
    AuthorizationDenied,
    HboneRejected,
    NoHealthyUpstream,
    SelfCallError,
    UpstreamConnectError,
)

VERSION = 5
CMD_CONNECT = 1
ATYP_IPV4 = 1
ATYP_DOMAIN = 3
ATYP_IPV6 = 4
METHOD_NO_AUTH = 0
# Our answer to the greeting: version 5, method "no authentication required".
METHOD_SELECTED = bytes((VERSION, METHOD_NO_AUTH))


class Reply(enum.IntEnum):
    """The REP field (RFC 1928 section 6), named as Rust's ``SocksError`` variants."""

    SUCCEEDED = 0
    GENERAL = 1
    NOT_ALLOWED = 2
    NETWORK_UNREACHABLE = 3
    HOST_UNREACHABLE = 4
    CONNECTION_REFUSED = 5
    COMMAND_NOT_SUPPORTED = 7


_RUST_VARIANT = {
    Reply.GENERAL: "General",
    Reply.NOT_ALLOWED: "NotAllowed",
    Reply.NETWORK_UNREACHABLE: "NetworkUnreachable",
    Reply.HOST_UNREACHABLE: "HostUnreachable",
    Reply.CONNECTION_REFUSED: "ConnectionRefused",
    Reply.COMMAND_NOT_SUPPORTED: "CommandNotSupported",
}


class SocksError(Exception):
    """A handshake that fails: the reply code it is answered with, and Rust's message."""

    def __init__(self, reply: Reply, message: str) -> None:
        super().__init__(message)
        self.reply = reply
        self.message = message

    def __str__(self) -> str:
        return f"{_RUST_VARIANT[self.reply]}: {self.message}"


def invalid_protocol(reason: str) -> SocksError:
    """Rust ``SocksError::invalid_protocol``: every protocol error is CommandNotSupported."""
    return SocksError(Reply.COMMAND_NOT_SUPPORTED, reason)


def early_eof() -> SocksError:
    """The client closed before the request was complete (Rust: ``read_exact``'s io error)."""
    return SocksError(Reply.GENERAL, "io error: early eof")


def reply(code: Reply) -> bytes:
    """Rust ``send_response``: VER, REP, RSV, then the bound address 0.0.0.0:0 (IPv4 type)."""
    return bytes((VERSION, code, 0, ATYP_IPV4, 0, 0, 0, 0, 0, 0))


@dataclass(frozen=True, slots=True)
class Request:
    """A complete CONNECT request: to an address, or to a hostname still to be resolved."""

    host: IPAddr | str
    port: int

    def target(self, ip: IPAddr | None = None) -> SocketAddr:
        """The destination, with ``ip`` the hostname's address."""
        if isinstance(self.host, str):
            assert ip is not None, "a hostname request needs its resolved address"
            return SocketAddr(ip, self.port)
        return SocketAddr(self.host, self.port)


class _Stage(enum.Enum):
    GREETING = enum.auto()  # VER, NMETHODS
    METHODS = enum.auto()  # NMETHODS bytes
    COMMAND = enum.auto()  # VER, CMD
    ADDRESS_TYPE = enum.auto()  # RSV, ATYP
    DOMAIN_LENGTH = enum.auto()  # one byte
    DESTINATION = enum.auto()  # the address (or hostname), then the port
    DONE = enum.auto()


class Handshake:
    """Rust ``negotiate_socks_connection`` as a state machine. Give :meth:`feed` exactly
    :attr:`need` bytes each time: it returns the bytes to send (the method selection), the
    complete :class:`Request`, or None to read on; it raises :class:`SocksError`.

    Reads are split where Rust checks in between (the command is refused before the address is
    read); what a client can make us hold is bounded by the protocol (255 methods, a 255-byte
    hostname)."""

    __slots__ = ("_atyp", "_stage", "need")

    def __init__(self) -> None:
        self._stage = _Stage.GREETING
        self._atyp = 0
        self.need = 2

    def feed(self, data: bytes) -> bytes | Request | None:
        assert len(data) == self.need, (len(data), self.need)
        stage = self._stage
        if stage is _Stage.GREETING:
            if data[0] != VERSION:
                raise invalid_protocol(f"unsupported version {data[0]}")
            if data[1] == 0:
                raise invalid_protocol("methods cannot be zero")  # (#1927)
            self._next(_Stage.METHODS, data[1])
            return None
        if stage is _Stage.METHODS:
            if METHOD_NO_AUTH not in data:
                raise invalid_protocol("only unauthenticated is supported")
            self._next(_Stage.COMMAND, 2)
            return METHOD_SELECTED
        if stage is _Stage.COMMAND:
            if data[0] != VERSION:
                raise invalid_protocol(f"unsupported version {data[0]}")
            if data[1] != CMD_CONNECT:
                raise invalid_protocol(f"unsupported command {data[1]}")
            self._next(_Stage.ADDRESS_TYPE, 2)
            return None
        if stage is _Stage.ADDRESS_TYPE:  # data[0] is RSV, skipped
            atyp = self._atyp = data[1]
            if atyp == ATYP_IPV4:
                self._next(_Stage.DESTINATION, 4 + 2)
                return None
            if atyp == ATYP_IPV6:
                self._next(_Stage.DESTINATION, 16 + 2)
                return None
            if atyp == ATYP_DOMAIN:
                self._next(_Stage.DOMAIN_LENGTH, 1)
                return None
            raise invalid_protocol(f"unsupported address type {atyp}")
        if stage is _Stage.DOMAIN_LENGTH:
            self._next(_Stage.DESTINATION, data[0] + 2)
            return None
        if stage is _Stage.DESTINATION:
            self._next(_Stage.DONE, 0)
            raw, port = data[:-2], int.from_bytes(data[-2:], "big")
            if self._atyp != ATYP_DOMAIN:
                return Request(ip_from_bytes(raw), port)
            try:
                return Request(raw.decode("utf-8"), port)
            except UnicodeDecodeError:
                # Rust prints the bytes with {:?}: [104, 255, ...]
                shown = "[" + ", ".join(str(b) for b in raw) + "]"
                raise invalid_protocol(f"domain is not a valid utf8 string: {shown}") from None
        raise RuntimeError("the handshake is over")

    def _next(self, stage: _Stage, need: int) -> None:
        self._stage = stage
        self.need = need


# --- hostnames (Rust dns_lookup) ---------------------------------------------------------------


def lookup_query(host: str, ipv6: bool) -> bytes:
    """Rust ``dns_lookup``: one recursive query for ``host``, A for an IPv4 client and AAAA for an
    IPv6 one (no search, no racing of both families, as Rust). Raises SocksError (host
    unreachable) for a name DNS cannot carry."""
    import dns.exception  # (dnspython only once a hostname is asked for: memory at rest)
    import dns.message
    import dns.name
    import dns.rdatatype

    try:
        name = dns.name.from_text(host) if host else dns.name.root
        msg = dns.message.make_query(name, dns.rdatatype.AAAA if ipv6 else dns.rdatatype.A)
    except (dns.exception.DNSException, UnicodeError, ValueError) as e:
        raise SocksError(Reply.HOST_UNREACHABLE, f"invalid hostname {host!r}: {e}") from None
    wire: bytes = msg.to_wire()
    return wire


def first_address(response: bytes | None) -> IPAddr:
    """The first address among a DNS response's answers (Rust: the first record with an IP);
    SocksError (host unreachable) when there is none, as Rust's ``Error::DnsEmpty``."""
    if response is not None:
        import dns.exception
        import dns.message
        import dns.rdataclass
        import dns.rdatatype

        try:
            msg = dns.message.from_wire(response)
        except (dns.exception.DNSException, ValueError):
            msg = None
        for rrset in msg.answer if msg is not None else ():
            # (an A record of another class is opaque data to dnspython, not an address)
            if rrset.rdclass == dns.rdataclass.IN and rrset.rdtype in (
                dns.rdatatype.A,
                dns.rdatatype.AAAA,
            ):
                for rd in rrset:
                    return parse_ip(rd.address)
    raise SocksError(Reply.HOST_UNREACHABLE, "dns response had no valid IP addresses")


# --- after the handshake (beyond Rust: see the module docstring) -----------------------------

_CONNECT_ERRNO = {
    errno.ECONNREFUSED: Reply.CONNECTION_REFUSED,
    errno.ENETUNREACH: Reply.NETWORK_UNREACHABLE,
    errno.EHOSTUNREACH: Reply.HOST_UNREACHABLE,
}


def reply_for(error: BaseException | str | None) -> Reply:
    """The reply for how the outbound connection went: succeeded, or why it was never
    established (the same failure the access log names)."""
    if error is None:
        return Reply.SUCCEEDED
    if isinstance(error, SocksError):
        return error.reply
    if isinstance(error, SelfCallError | AuthorizationDenied):
        return Reply.NOT_ALLOWED
    if isinstance(error, HboneRejected):
        # 401: the destination's policies refused us; 503: its ztunnel could not reach the app.
        if error.peer_status == 401:
            return Reply.NOT_ALLOWED
        if error.peer_status == 503:
            return Reply.CONNECTION_REFUSED
        return Reply.GENERAL
    if isinstance(error, NoHealthyUpstream):
        return Reply.HOST_UNREACHABLE
    if isinstance(error, UpstreamConnectError):
        return _connect_reply(error)
    return Reply.GENERAL


def _connect_reply(error: UpstreamConnectError) -> Reply:
    """The socket error under a failed connect (an UpstreamConnectError is raised while
    handling it, so it is the exception's context, maybe a few levels down: the HBONE dial
    wraps it once more)."""
    cause: BaseException = error
    for _ in range(4):
        up = cause.__cause__ or cause.__context__
        if up is None:
            break
        cause = up
        if isinstance(cause, TimeoutError):
            return Reply.HOST_UNREACHABLE
        if isinstance(cause, OSError) and cause.errno in _CONNECT_ERRNO:
            return _CONNECT_ERRNO[cause.errno]
    return Reply.GENERAL
