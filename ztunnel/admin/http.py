"""A small, strict HTTP/1.1 server for the admin, stats and readiness ports.

Two halves: :class:`RequestParser` is sans-IO (bytes in, :class:`Request` objects out, a
:class:`HttpError` carrying the status to answer on any protocol violation) and
:func:`serialize_response` builds the reply bytes; :class:`HttpServer` drives them over asyncio
streams. Invariants: one request at a time per connection, in order (pipelined requests wait in the
parser's buffer); a protocol error answers once with ``Connection: close`` and closes that
connection only; every connection task belongs to the server and ``close()`` ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs

from ztunnel.net.sockopt import bind_listener

log = logging.getLogger("ztunnel.admin.http")

MAX_REQUEST_LINE = 8 * 1024
MAX_HEADER_BYTES = 32 * 1024  # request line + headers
MAX_HEADER_COUNT = 100
MAX_BODY = 64 * 1024

# RFC 9110 5.6.2 token; RFC 9112 3.2 request-target (origin-form, or "*" for OPTIONS).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"/[\x21-\x7e]*|\*")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
# field-value: visible chars, obs-text, SP and HTAB (no CTLs).
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class HttpError(Exception):
    """A request this server will not process; ``status`` is what to answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str  # as sent: path and query
    version: tuple[int, int]
    headers: tuple[tuple[str, str], ...]  # names lower-cased, in order
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def query_params(self) -> dict[str, list[str]]:
        """``?level=debug&reset`` -> ``{"level": ["debug"], "reset": [""]}``."""
        return parse_qs(self.query, keep_blank_values=True)

    def header(self, name: str) -> str | None:
        """The value of ``name`` (case-insensitive); repeated headers are joined with ``, ``."""
        name = name.lower()
        values = [v for k, v in self.headers if k == name]
        return ", ".join(values) if values else None

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in (self.header("connection") or "").split(",")}
        if self.version >= (1, 1):
            return "close" not in tokens
        return "keep-alive" in tokens


class RequestParser:
    """Incremental HTTP/1.x request parser. Sans-IO: ``feed()`` bytes, then call
    ``next_request()`` until it returns None (needs more bytes). After it raises
    :class:`HttpError` the connection must be answered and closed.

    Strict by design: CRLF line endings only, no obs-fold, no whitespace before a header colon,
    exactly one Host for HTTP/1.1, Content-Length only (Transfer-Encoding is refused with 501),
    bounded request line, header block, header count and body.
    """

    def __init__(
        self,
        *,
        max_request_line: int = MAX_REQUEST_LINE,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_header_count: int = MAX_HEADER_COUNT,
        max_body: int = MAX_BODY,
    ) -> None:
        self.max_request_line = max_request_line
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count
        self.max_body = max_body
        self._buf = bytearray()
        self._head: Request | None = None  # parsed head waiting for its body
        self._body_len = 0
        self._eof = False

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def idle(self) -> bool:
        """No partial request is buffered."""
        return not self._buf and self._head is None

    def feed(self, data: bytes) -> None:
        self._buf += data

    def feed_eof(self) -> None:
        self._eof = True

    def next_request(self) -> Request | None:
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                self._check_partial_head()
                if self._eof and self._buf:
                    raise HttpError(400, "connection closed inside a request head")
                return None
            if end + 4 > self.max_header_bytes:
                raise HttpError(431, "request header block too large")
            head = bytes(self._buf[:end])
            del self._buf[: end + 4]
            self._head, self._body_len = self._parse_head(head)
        if len(self._buf) < self._body_len:
            if self._eof:
                raise HttpError(400, "connection closed inside a request body")
            return None
        body = bytes(self._buf[: self._body_len])
        del self._buf[: self._body_len]
        req = self._head
        self._head, self._body_len = None, 0
        if body:
            req = Request(req.method, req.target, req.version, req.headers, body)
        return req

    def _check_partial_head(self) -> None:
        # Reject oversized input early, without waiting for the blank line.
        line_end = self._buf.find(b"\r\n")
        if line_end < 0 and len(self._buf) > self.max_request_line:
            raise HttpError(414, "request line too long")
        if line_end > self.max_request_line:
            raise HttpError(414, "request line too long")
        if len(self._buf) > self.max_header_bytes:
            raise HttpError(431, "request header block too large")

    def _parse_head(self, head: bytes) -> tuple[Request, int]:
        lines = head.split(b"\r\n")
        for line in lines:
            if b"\r" in line or b"\n" in line:
                raise HttpError(400, "bare CR or LF in request head")
        request_line, header_lines = lines[0], lines[1:]
        if len(request_line) > self.max_request_line:
            raise HttpError(414, "request line too long")
        parts = request_line.split(b" ")
        if len(parts) != 3:
            raise HttpError(400, "malformed request line")
        method, target, version = parts
        if not _TOKEN.fullmatch(method):
            raise HttpError(400, "malformed method")
        if not _TARGET.fullmatch(target):
            raise HttpError(400, "request target must be origin-form")
        m = _VERSION.fullmatch(version)
        if m is None:
            raise HttpError(400, "malformed HTTP version")
        ver = (int(m.group(1)), int(m.group(2)))
        if ver[0] != 1:
            raise HttpError(505, "only HTTP/1.x is supported")
        if target == b"*" and method != b"OPTIONS":
            raise HttpError(400, "asterisk-form is only for OPTIONS")

        if len(header_lines) > self.max_header_count:
            raise HttpError(431, "too many header fields")
        headers: list[tuple[str, str]] = []
        for line in header_lines:
            if not line:
                raise HttpError(400, "empty header line")
            if line[:1] in (b" ", b"\t"):
                raise HttpError(400, "obsolete line folding")
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise HttpError(400, "malformed header field")
            value = value.strip(b" \t")
            if _BAD_VALUE.search(value):
                raise HttpError(400, "control character in header value")
            headers.append((name.decode("ascii").lower(), value.decode("latin-1")))

        req = Request(method.decode("ascii"), target.decode("ascii"), ver, tuple(headers))
        hosts = [v for k, v in headers if k == "host"]
        if ver >= (1, 1) and len(hosts) != 1:
            raise HttpError(400, "HTTP/1.1 needs exactly one Host header")
        if len(hosts) > 1:
            raise HttpError(400, "more than one Host header")
        if any(k == "transfer-encoding" for k, _ in headers):
            raise HttpError(501, "Transfer-Encoding is not supported; send Content-Length")
        lengths = {v.strip() for k, v in headers if k == "content-length"}
        body_len = 0
        if lengths:
            if len(lengths) != 1:
                raise HttpError(400, "conflicting Content-Length headers")
            (text,) = lengths
            if not text.isdigit() or not text.isascii():
                raise HttpError(400, "malformed Content-Length")
            body_len = int(text)
            if body_len > self.max_body:
                raise HttpError(413, "request body too large")
        return req, body_len


@dataclass(slots=True)
class Response:
    """A reply. ``body`` may be a list of chunks: sent piecewise, yielding to the loop between
    them (large metric scrapes)."""

    status: int
    body: bytes | list[bytes] = b""
    content_type: str | None = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def content_length(self) -> int:
        if isinstance(self.body, bytes):
            return len(self.body)
        return sum(len(c) for c in self.body)

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status, text.encode("utf-8"))

    @classmethod
    def empty(cls, status: int) -> Response:
        return cls(status, b"", None)


def serialize_head(resp: Response, *, keep_alive: bool) -> bytes:
    """Status line and headers (Content-Length always, Connection: close when not keeping
    alive)."""
    try:
        reason = HTTPStatus(resp.status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {resp.status} {reason}"]
    if resp.content_type is not None:
        lines.append(f"content-type: {resp.content_type}")
    lines.extend(f"{k}: {v}" for k, v in resp.headers)
    lines.append(f"content-length: {resp.content_length}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def serialize_response(resp: Response, *, keep_alive: bool, head_only: bool = False) -> bytes:
    """Head and body (omitted for HEAD) as one byte string."""
    head = serialize_head(resp, keep_alive=keep_alive)
    if head_only:
        return head
    body = resp.body if isinstance(resp.body, bytes) else b"".join(resp.body)
    return head + body


WRITE_HIGH_WATER = 256 * 1024


async def write_response(
    writer: asyncio.StreamWriter, resp: Response, *, keep_alive: bool, head_only: bool = False
) -> None:
    """Send ``resp``; a chunked body is written piece by piece, draining and yielding every
    ``WRITE_HIGH_WATER`` bytes so a huge body never sits in one buffer or one loop turn."""
    if head_only or isinstance(resp.body, bytes):
        writer.write(serialize_response(resp, keep_alive=keep_alive, head_only=head_only))
        await writer.drain()
        return
    writer.write(serialize_head(resp, keep_alive=keep_alive))
    pending = 0
    for chunk in resp.body:
        writer.write(chunk)
        pending += len(chunk)
        if pending >= WRITE_HIGH_WATER:
            await writer.drain()
            # drain() does not yield when the transport is not paused (a fast reader): yield
            # anyway, or a 40 MB body would go out in one loop turn.
            await asyncio.sleep(0)
            pending = 0
    await writer.drain()


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Serves ``handler`` on already-bound listening sockets.

    Build with :meth:`bind` (binds now, so a taken port fails at start-up), then ``await
    start()``. ``close()`` stops accepting, lets in-flight requests finish for ``grace`` seconds,
    then cancels every connection task. Limits: ``header_timeout`` for a request head to arrive,
    ``idle_timeout`` between keep-alive requests.
    """

    def __init__(
        self,
        name: str,
        socks: Sequence[socket.socket],
        handler: Handler,
        *,
        header_timeout: float = 10.0,
        idle_timeout: float = 60.0,
        parser_factory: Callable[[], RequestParser] = RequestParser,
    ) -> None:
        self.name = name
        self.socks = list(socks)
        self.handler = handler
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.parser_factory = parser_factory
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: set[asyncio.Task[None]] = set()  # tasks inside a handler call
        self._closing = False

    @classmethod
    def bind(
        cls,
        name: str,
        addresses: Sequence[tuple[str, int]],
        handler: Handler,
        *,
        header_timeout: float = 10.0,
        idle_timeout: float = 60.0,
    ) -> HttpServer:
        """Bind every address now (a taken port fails here, at start-up), serve later."""
        socks: list[socket.socket] = []
        try:
            for host, port in addresses:
                socks.append(bind_listener((host, port)))
        except BaseException:
            for s in socks:
                s.close()
            raise
        return cls(name, socks, handler, header_timeout=header_timeout, idle_timeout=idle_timeout)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [s.getsockname()[:2] for s in self.socks]

    @property
    def port(self) -> int:
        return int(self.socks[0].getsockname()[1])

    async def start(self) -> None:
        for sock in self.socks:
            self._servers.append(await asyncio.start_server(self._on_client, sock=sock))

    async def close(self, grace: float = 1.0) -> None:
        """Stop accepting; give busy requests ``grace`` seconds; cancel the rest. Idempotent."""
        self._closing = True
        for srv in self._servers:
            srv.close()
        idle = [t for t in self._tasks if t not in self._busy]
        for t in idle:
            t.cancel()
        busy = [t for t in self._tasks if t in self._busy]
        if busy:
            await asyncio.wait(busy, timeout=grace)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await srv.wait_closed()
        self._servers.clear()
        for sock in self.socks:
            sock.close()

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback: the connection task is ours (asyncio's own wrapper task would log a
        # cancelled task as an error on 3.11), so close() can cancel it cleanly.
        if self._closing:
            writer.close()
            return
        task = asyncio.get_running_loop().create_task(self._connection(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._serve(task, reader, writer)
        except (ConnectionError, TimeoutError):
            pass
        except Exception:
            log.exception("%s: connection from %s failed", self.name, _peer(writer))
        finally:
            self._busy.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, task: asyncio.Task[None], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        parser = self.parser_factory()
        while not self._closing:
            try:
                req = await self._read_request(parser, reader)
            except HttpError as e:
                log.debug("%s: bad request from %s: %s", self.name, _peer(writer), e)
                resp = Response.text(e.status, f"{e.reason}\n")
                writer.write(serialize_response(resp, keep_alive=False))
                await writer.drain()
                return
            if req is None:
                return
            keep_alive = req.keep_alive and not self._closing
            self._busy.add(task)  # busy until the reply is written: close() grants it grace
            try:
                try:
                    resp = await self.handler(req)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s: handler failed for %s %s", self.name, req.method, req.path)
                    resp = Response.text(500, "internal error\n")
                    keep_alive = False
                await write_response(
                    writer,
                    resp,
                    keep_alive=keep_alive and not self._closing,
                    head_only=req.method == "HEAD",
                )
            finally:
                self._busy.discard(task)
            if not keep_alive or self._closing:
                return

    async def _read_request(
        self, parser: RequestParser, reader: asyncio.StreamReader
    ) -> Request | None:
        """The next request; None on a clean EOF or an idle timeout between requests."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            req = parser.next_request()
            if req is not None:
                return req
            if parser.idle:
                timeout = self.idle_timeout
            else:
                if deadline is None:
                    deadline = loop.time() + self.header_timeout
                timeout = max(0.0, deadline - loop.time())
            try:
                async with asyncio.timeout(timeout):
                    data = await reader.read(65536)
            except TimeoutError:
                if parser.idle:
                    return None
                raise HttpError(408, "request not received in time") from None
            if not data:
                if parser.idle:
                    return None
                parser.feed_eof()
                continue
            if parser.idle:
                deadline = None
            parser.feed(data)


def _peer(writer: asyncio.StreamWriter) -> str:
    try:
        p = writer.get_extra_info("peername")
    except Exception:
        return "?"
    return f"{p[0]}:{p[1]}" if p else "?"
