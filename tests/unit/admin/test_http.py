"""The strict HTTP/1.1 core: the sans-IO parser, response bytes, and the asyncio server loop."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.admin import read_response, request
from ztunnel.admin.http import (
    HttpError,
    HttpServer,
    Request,
    RequestParser,
    Response,
    serialize_response,
)

pytestmark = pytest.mark.timeout(30)


def parse_one(data: bytes, **limits: int) -> Request:
    p = RequestParser(**limits)
    p.feed(data)
    req = p.next_request()
    assert req is not None
    return req


def parse_error(data: bytes, **limits: int) -> HttpError:
    p = RequestParser(**limits)
    p.feed(data)
    with pytest.raises(HttpError) as ei:
        p.next_request()
    return ei.value


# --- parser: good input ------------------------------------------------------------------------


def test_simple_get() -> None:
    req = parse_one(b"GET /logging?level=debug&reset HTTP/1.1\r\nHost: x\r\nAccept: a/b\r\n\r\n")
    assert req.method == "GET"
    assert req.path == "/logging"
    assert req.query == "level=debug&reset"
    assert req.query_params() == {"level": ["debug"], "reset": [""]}
    assert req.version == (1, 1)
    assert req.header("ACCEPT") == "a/b"
    assert req.header("missing") is None
    assert req.keep_alive
    assert req.body == b""


def test_header_value_whitespace_trimmed_and_repeats_joined() -> None:
    req = parse_one(b"GET / HTTP/1.1\r\nHost: x\r\nAccept:  a \t\r\nAccept: b\r\n\r\n")
    assert req.header("accept") == "a, b"


def test_byte_at_a_time() -> None:
    data = b"POST /quitquitquit HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    p = RequestParser()
    for i in range(len(data) - 1):
        p.feed(data[i : i + 1])
        assert p.next_request() is None
    p.feed(data[-1:])
    req = p.next_request()
    assert req is not None and req.body == b"abc" and req.method == "POST"
    assert p.idle


def test_pipelined_requests() -> None:
    p = RequestParser()
    p.feed(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\nGET /c")
    a, b = p.next_request(), p.next_request()
    assert a is not None and a.path == "/a"
    assert b is not None and b.path == "/b"
    assert p.next_request() is None
    assert not p.idle


@pytest.mark.parametrize(
    ("head", "keep"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Close\r\n", False),
        (b"GET / HTTP/1.0\r\n", False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n", True),
    ],
)
def test_keep_alive_rules(head: bytes, keep: bool) -> None:
    assert parse_one(head + b"\r\n").keep_alive is keep


def test_http10_needs_no_host() -> None:
    assert parse_one(b"GET / HTTP/1.0\r\n\r\n").version == (1, 0)


# --- parser: malformed input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9
        (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # double space
        (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # bad method token
        (b"GET http://x/ HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # absolute-form
        (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.x\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400),  # space before colon
        (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\nHost: x\r\n\r\n", 400),  # bare LF
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
    ],
)
def test_malformed(data: bytes, status: int) -> None:
    assert parse_error(data).status == status


def test_limits() -> None:
    assert parse_error(b"GET /" + b"a" * 200, max_request_line=100).status == 414
    assert parse_error(b"GET /" + b"a" * 200 + b" HTTP/1.1\r\n", max_request_line=100).status == 414
    many = b"".join(b"X-%d: y\r\n" % i for i in range(20))
    assert (
        parse_error(b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n", max_header_count=10).status
        == 431
    )
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 500
    assert parse_error(big, max_header_bytes=256).status == 431
    body = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    assert parse_error(body, max_body=100).status == 413


def test_eof_inside_request() -> None:
    p = RequestParser()
    p.feed(b"GET / HTTP/1.1\r\nHo")
    assert p.next_request() is None
    p.feed_eof()
    with pytest.raises(HttpError):
        p.next_request()
    q = RequestParser()
    q.feed(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab")
    q.feed_eof()
    with pytest.raises(HttpError):
        q.next_request()


# --- responses ----------------------------------------------------------------------------------


def test_serialize_response() -> None:
    raw = serialize_response(Response.text(200, "ready\n"), keep_alive=True)
    assert raw == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: 6\r\n\r\nready\n"
    )
    raw = serialize_response(Response.empty(405), keep_alive=False)
    assert raw == (
        b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    head = serialize_response(Response.text(200, "abc"), keep_alive=True, head_only=True)
    assert head.endswith(b"content-length: 3\r\n\r\n")


# --- the server loop -----------------------------------------------------------------------------


async def echo_handler(req: Request) -> Response:
    if req.path == "/boom":
        raise RuntimeError("handler bug")
    if req.path == "/slow":
        await asyncio.sleep(0.3)
    return Response.text(200, f"{req.method} {req.target} {len(req.body)}\n")


async def started(**kw: float) -> HttpServer:
    srv = HttpServer.bind("test", [("127.0.0.1", 0)], echo_handler, **kw)
    await srv.start()
    return srv


@pytest.mark.both_loops
async def test_keep_alive_and_pipelining() -> None:
    srv = await started()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\n\r\n")
        r1, r2 = await read_response(reader), await read_response(reader)
        assert (r1.text, r2.text) == ("GET /1 0\n", "GET /2 0\n")
        assert "connection" not in r1.headers
        writer.write(b"POST /3 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        r3 = await read_response(reader)
        assert r3.text == "POST /3 2\n"
        writer.write(b"GET /4 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        r4 = await read_response(reader)
        assert r4.headers["connection"] == "close"
        assert await reader.read() == b""  # server closed
        writer.close()
        await writer.wait_closed()
    finally:
        await srv.close()


@pytest.mark.both_loops
async def test_malformed_gets_400_and_others_keep_working() -> None:
    srv = await started()
    try:
        good_r, good_w = await asyncio.open_connection("127.0.0.1", srv.port)
        bad_r, bad_w = await asyncio.open_connection("127.0.0.1", srv.port)
        bad_w.write(b"BLAH\r\n\r\n")
        bad = await read_response(bad_r)
        assert bad.status == 400
        assert bad.headers["connection"] == "close"
        assert await bad_r.read() == b""
        good_w.write(b"GET /still HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(good_r)).text == "GET /still 0\n"
        assert (await request(srv.port, "GET", "/fresh")).status == 200
        for w in (good_w, bad_w):
            w.close()
            await w.wait_closed()
    finally:
        await srv.close()


async def test_handler_error_is_500_and_server_survives() -> None:
    srv = await started()
    try:
        r = await request(srv.port, "GET", "/boom")
        assert r.status == 500
        assert (await request(srv.port, "GET", "/ok")).status == 200
    finally:
        await srv.close()


async def test_head_has_no_body() -> None:
    srv = await started()
    try:
        r = await request(srv.port, "HEAD", "/x")
        assert r.status == 200 and r.body == b""
        assert r.headers["content-length"] == str(len("HEAD /x 0\n"))
    finally:
        await srv.close()


async def test_slow_header_times_out_with_408() -> None:
    srv = await started(header_timeout=0.2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET / HTTP/1.1\r\n")
        resp = await read_response(reader)
        assert resp.status == 408
        writer.close()
        await writer.wait_closed()
    finally:
        await srv.close()


async def test_idle_keepalive_connection_is_closed() -> None:
    srv = await started(idle_timeout=0.2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()
    finally:
        await srv.close()


@pytest.mark.both_loops
async def test_close_waits_for_busy_request_and_cancels_idle() -> None:
    srv = await started()
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", srv.port)
    slow = asyncio.create_task(request(srv.port, "GET", "/slow"))
    await asyncio.sleep(0.1)
    await srv.close(grace=2.0)
    resp = await slow
    assert resp.status == 200
    assert await idle_r.read() == b""
    idle_w.close()
    await idle_w.wait_closed()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", srv.port)


def test_bind_conflict_fails_at_bind_time() -> None:
    a = HttpServer.bind("a", [("127.0.0.1", 0)], echo_handler)
    try:
        with pytest.raises(OSError):
            HttpServer.bind("b", [("127.0.0.1", a.port)], echo_handler)
    finally:
        for s in a.socks:
            s.close()
