"""ztunnel.hbone.clienthello: ALPN read from real ClientHellos (OpenSSL's), partial input,
garbage, and rustls' rule (Rust src/tls/certificate.rs: server alpn_protocols = [h2])."""

from __future__ import annotations

import contextlib
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztunnel.hbone.clienthello import (
    ClientHello,
    NotClientHello,
    parse_client_hello,
)


def client_hello(alpn: list[str] | None) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn is not None:
        ctx.set_alpn_protocols(alpn)
    inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inbio, outbio, server_hostname=None)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outbio.read()


@pytest.mark.parametrize(
    ("alpn", "want"),
    [
        (["h2"], (b"h2",)),
        (["http/1.1"], (b"http/1.1",)),
        (["http/1.1", "h2"], (b"http/1.1", b"h2")),
        (None, None),
    ],
)
def test_alpn_of_openssl_client_hellos(alpn: list[str] | None, want: object) -> None:
    assert parse_client_hello(client_hello(alpn)) == ClientHello(want)  # type: ignore[arg-type]


def test_rustls_rule() -> None:
    assert ClientHello((b"http/1.1",)).refuses(b"h2")
    assert not ClientHello((b"http/1.1", b"h2")).refuses(b"h2")
    assert not ClientHello(None).refuses(b"h2")  # no ALPN offered: accepted, as rustls


def test_partial_input_needs_more() -> None:
    hello = client_hello(["h2"])
    for n in (0, 1, 4, 5, 6, len(hello) // 2, len(hello) - 1):
        assert parse_client_hello(hello[:n]) is None
    assert parse_client_hello(hello) is not None
    assert parse_client_hello(hello + b"more records") is not None


def test_split_across_records() -> None:
    hello = client_hello(["h2", "x"])
    body = hello[5:]
    records = b"".join(
        b"\x16\x03\x01" + len(body[i : i + 10]).to_bytes(2, "big") + body[i : i + 10]
        for i in range(0, len(body), 10)
    )
    assert parse_client_hello(records) == ClientHello((b"h2", b"x"))


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x16\x03\x01\x00\x00",  # empty record
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # a ServerHello
        b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00",  # truncated body
        b"\x16\x03\x01\x00\x04\x01\xff\xff\xff",  # claims 16 MiB
    ],
)
def test_not_client_hello(data: bytes) -> None:
    with pytest.raises(NotClientHello):
        parse_client_hello(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_never_crashes(data: bytes) -> None:
    with contextlib.suppress(NotClientHello):
        parse_client_hello(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2000), st.binary(min_size=1, max_size=4))
def test_mutated_hellos_never_crash(pos: int, junk: bytes) -> None:
    hello = bytearray(client_hello(["h2", "http/1.1"]))
    pos %= len(hello)
    hello[pos : pos + len(junk)] = junk
    with contextlib.suppress(NotClientHello):
        parse_client_hello(bytes(hello))
