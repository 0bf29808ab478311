"""The SOCKS5 handshake and replies without sockets (Rust src/proxy/socks5.rs)."""

from __future__ import annotations

import errno
import ipaddress
import socket

import dns.message
import dns.rdatatype
import dns.rrset
import pytest

from ztunnel.core.addr import SocketAddr
from ztunnel.core.errors import (
    AuthorizationDenied,
    HboneRejected,
    NoHealthyUpstream,
    SelfCallError,
    UpstreamConnectError,
)
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.proxy.socks5_proto import (
    METHOD_SELECTED,
    Handshake,
    Reply,
    Request,
    SocksError,
    early_eof,
    first_address,
    lookup_query,
    reply,
    reply_for,
)

pytestmark = pytest.mark.timeout(20)

GREETING = b"\x05\x01\x00"  # version 5, one method: no authentication


def feed_all(data: bytes) -> tuple[list[bytes | Request], int]:
    """Feed ``data`` as the I/O loop does (exactly ``need`` bytes each time): what came out and
    how many bytes were read, up to the request (or SocksError). Running out of input is an
    AssertionError."""
    hs = Handshake()
    out: list[bytes | Request] = []
    pos = 0
    while True:
        n = hs.need
        assert pos + n <= len(data), f"wants {n} more bytes at {pos}"
        got = hs.feed(data[pos : pos + n])
        pos += n
        if got is not None:
            out.append(got)
        if isinstance(got, Request):
            return out, pos


def run(data: bytes) -> list[bytes | Request]:
    out, used = feed_all(data)
    assert used == len(data)
    return out


@pytest.mark.parametrize(
    ("request_bytes", "want"),
    [
        (
            b"\x05\x01\x00\x01\x0a\x00\x02\x02\x1f\x90",
            Request(ipaddress.ip_address("10.0.2.2"), 8080),
        ),
        (
            b"\x05\x01\x00\x04" + ipaddress.IPv6Address("fd00:2::2").packed + b"\x00\x50",
            Request(ipaddress.ip_address("fd00:2::2"), 80),
        ),
        (b"\x05\x01\x00\x03\x0as1.default\x00\x50", Request("s1.default", 80)),
        (b"\x05\x01\x00\x03\x02s1\x01\xbb", Request("s1", 443)),
        (b"\x05\x01\x00\x03\x00\x00\x50", Request("", 80)),
    ],
)
def test_connect_requests(request_bytes: bytes, want: Request) -> None:
    """Rust negotiate_socks_connection: CONNECT to an IPv4 address, an IPv6 address or a
    hostname (resolved afterwards), after the method selection (05 00)."""
    assert run(GREETING + request_bytes) == [METHOD_SELECTED, want]


def test_any_method_list_with_no_authentication_is_accepted() -> None:
    """Rust: the client must include 'unauthenticated' (0) among its methods."""
    assert run(b"\x05\x03\x02\x01\x00" + b"\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50") == [
        METHOD_SELECTED,
        Request(ipaddress.ip_address("127.0.0.1"), 80),
    ]


def test_nothing_past_the_request_is_read() -> None:
    """Bytes a client sends right after its request (before our reply) are the upstream's."""
    req = GREETING + b"\x05\x01\x00\x03\x02s1\x00\x50"
    assert feed_all(req + b"GET / HTTP/1.1\r\n")[1] == len(req)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x04\x01\x00", "unsupported version 4"),
        (b"GET / HTTP/1.1\r\n", "unsupported version 71"),
        # #1927: the message no longer carries the version byte
        (b"\x05\x00", "methods cannot be zero"),
        (b"\x05\x02\x01\x02", "only unauthenticated is supported"),
        (GREETING + b"\x04\x01", "unsupported version 4"),
        (GREETING + b"\x05\x02", "unsupported command 2"),  # BIND
        (GREETING + b"\x05\x03", "unsupported command 3"),  # UDP ASSOCIATE
        (GREETING + b"\x05\x01\x00\x02", "unsupported address type 2"),
        (GREETING + b"\x05\x01\x00\x05", "unsupported address type 5"),
        (
            GREETING + b"\x05\x01\x00\x03\x02\xff\xfe\x00\x50",
            "domain is not a valid utf8 string: [255, 254]",
        ),
    ],
)
def test_protocol_errors_are_command_not_supported(data: bytes, message: str) -> None:
    """Rust negotiate_socks_connection -> SocksError::invalid_protocol: every protocol error is
    CommandNotSupported (reply 7), logged as "CommandNotSupported: <reason>"."""
    with pytest.raises(SocksError) as info:
        run(data)
    assert info.value.reply is Reply.COMMAND_NOT_SUPPORTED
    assert str(info.value) == f"CommandNotSupported: {message}"


def test_the_command_is_refused_before_the_address_is_read() -> None:
    """Rust reads VER+CMD and checks the command before it reads RSV/ATYP/the address."""
    hs = Handshake()
    hs.feed(b"\x05\x01")
    assert hs.feed(b"\x00") == METHOD_SELECTED
    assert hs.need == 2
    with pytest.raises(SocksError, match="unsupported command 2"):
        hs.feed(b"\x05\x02")


def test_a_client_gone_mid_handshake_is_a_general_failure() -> None:
    """Rust From<io::Error> for SocksError: General."""
    e = early_eof()
    assert e.reply is Reply.GENERAL and str(e) == "General: io error: early eof"


@pytest.mark.parametrize("code", list(Reply))
def test_replies_carry_the_dummy_bound_address(code: Reply) -> None:
    """Rust send_response: 05, the status, 00, then 0.0.0.0:0 as an IPv4 address."""
    assert reply(code) == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def test_rust_reply_codes() -> None:
    """Rust send_response's status byte for each SocksError variant (RFC 1928 section 6)."""
    assert [(r.name, int(r)) for r in Reply] == [
        ("SUCCEEDED", 0),
        ("GENERAL", 1),
        ("NOT_ALLOWED", 2),
        ("NETWORK_UNREACHABLE", 3),
        ("HOST_UNREACHABLE", 4),
        ("CONNECTION_REFUSED", 5),
        ("COMMAND_NOT_SUPPORTED", 7),
    ]


@pytest.mark.parametrize(("ipv6", "rdtype"), [(False, dns.rdatatype.A), (True, dns.rdatatype.AAAA)])
def test_hostname_lookup_asks_one_family(ipv6: bool, rdtype: int) -> None:
    """Rust dns_lookup: A for an IPv4 client, AAAA for an IPv6 one, recursion desired."""
    q = dns.message.from_wire(lookup_query("s1.default.svc.cluster.local", ipv6))
    [question] = q.question
    assert question.name.to_text() == "s1.default.svc.cluster.local."
    assert question.rdtype == rdtype
    assert q.flags & dns.flags.RD


def test_a_name_dns_cannot_carry_is_host_unreachable() -> None:
    with pytest.raises(SocksError) as info:
        lookup_query("a" * 64 + ".example", False)
    assert info.value.reply is Reply.HOST_UNREACHABLE


def _response(name: str, *records: tuple[str, str]) -> bytes:
    q = dns.message.make_query(name, "A")
    r = dns.message.make_response(q)
    for rdtype, value in records:
        r.answer.append(dns.rrset.from_text(name, 30, "IN", rdtype, value))
    wire: bytes = r.to_wire()
    return wire


@pytest.mark.parametrize(
    ("records", "want"),
    [
        ((("A", "10.96.0.10"),), "10.96.0.10"),
        ((("CNAME", "s1.default.svc.cluster.local."), ("A", "10.96.0.11")), "10.96.0.11"),
        ((("AAAA", "fd00::10"),), "fd00::10"),
    ],
)
def test_first_address_of_the_answers(records: tuple[tuple[str, str], ...], want: str) -> None:
    """Rust dns_lookup: the first answer record that carries an IP."""
    assert first_address(_response("s1.", *records)) == ipaddress.ip_address(want)


# fuzz/corpus/socks5/found-a419af30833a: an A record of class 0 (dnspython keeps it opaque)
_CLASS0_A = bytes.fromhex(
    "5383810000010001000000000273310764656661756c740373766307632c7573746572056c5b63616c"
    "0000010001c00c000100000000001e00040a600014"
)


@pytest.mark.parametrize("response", [None, b"", b"\x00" * 5, _response("s1."), _CLASS0_A])
def test_no_address_is_host_unreachable(response: bytes | None) -> None:
    """Rust dns_lookup: Error::DnsEmpty -> SocksError::HostUnreachable (4)."""
    with pytest.raises(SocksError) as info:
        first_address(response)
    assert info.value.reply is Reply.HOST_UNREACHABLE
    assert str(info.value) == "HostUnreachable: dns response had no valid IP addresses"


def _connect_failed(cause: BaseException | None) -> UpstreamConnectError:
    """An UpstreamConnectError raised as the socket factory raises it: while handling the
    socket error, ``from None``."""
    try:
        try:
            if cause is not None:
                raise cause
            raise UpstreamConnectError("file descriptor budget exhausted")
        except OSError:
            raise UpstreamConnectError("connection to 1.2.3.4:80 failed") from None
    except UpstreamConnectError as e:
        return e


@pytest.mark.parametrize(
    ("error", "want"),
    [
        (None, Reply.SUCCEEDED),
        (SelfCallError(SocketAddr.parse("127.0.0.1:15001")), Reply.NOT_ALLOWED),
        (AuthorizationDenied("denied"), Reply.NOT_ALLOWED),
        (HboneRejected("10.0.2.2:8080", 401), Reply.NOT_ALLOWED),
        (HboneRejected("10.0.2.2:8080", 503), Reply.CONNECTION_REFUSED),
        (HboneRejected("10.0.2.2:8080", 400), Reply.GENERAL),
        (
            _connect_failed(ConnectionRefusedError(errno.ECONNREFUSED, "x")),
            Reply.CONNECTION_REFUSED,
        ),
        (_connect_failed(OSError(errno.ENETUNREACH, "x")), Reply.NETWORK_UNREACHABLE),
        (_connect_failed(OSError(errno.EHOSTUNREACH, "x")), Reply.HOST_UNREACHABLE),
        (_connect_failed(TimeoutError()), Reply.HOST_UNREACHABLE),
        (_connect_failed(None), Reply.GENERAL),
        (NoHealthyUpstream("s1.default.svc.cluster.local"), Reply.HOST_UNREACHABLE),
        ("failed to fetch information about local workload", Reply.GENERAL),
        (SocksError(Reply.HOST_UNREACHABLE, "x"), Reply.HOST_UNREACHABLE),
    ],
)
def test_reply_for_each_outcome(error: BaseException | str | None, want: Reply) -> None:
    """Beyond Rust (which replies success before dialling): the RFC 1928 code for the failure
    the outbound path logs."""
    assert reply_for(error) is want


async def test_a_real_refused_connect_maps_to_connection_refused() -> None:
    """The message the socket factory really gives (not a copy of its format) maps to 5."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: the connect is refused
        with pytest.raises(UpstreamConnectError) as info:
            await SocketFactory(mark=None).connect(SocketAddr.parse(f"127.0.0.1:{port}"))
    assert reply_for(info.value) is Reply.CONNECTION_REFUSED
