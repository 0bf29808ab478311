"""SOCKS5 on 127.0.0.1:15080 (``UNSTABLE_ENABLE_SOCKS5``): a CONNECT goes where 15001 would send a
captured connection to the same destination.

Rust ``src/proxy/socks5.rs``: one listener per proxy instance (inside the pod's netns in shared
mode), the handshake of ``socks5_proto``, then ``OutboundConnection::proxy_to`` with the
destination the request named; here ``Outbound.handle`` with that destination instead of
SO_ORIGINAL_DST (the same routing, HBONE or passthrough, the same access log and metrics). A
hostname is resolved as Rust does, by the instance's DNS proxy (its answers from state, then its
upstreams; Rust's ``pi.resolver`` is the DNS server's store); without the DNS proxy a hostname is
refused.

Hostile clients: the handshake has a deadline (``HANDSHAKE_TIMEOUT``, the hostname lookup
included; Rust has none), at most ``MAX_HANDSHAKES`` are in progress per instance (more are
closed at once), what a client can make us read is bounded by the protocol (a few hundred bytes),
the listener refuses connections within the fd reserve (``net/fdbudget.py``) as every listener
does, and every line a client can trigger is rate limited. Once established, a connection is an
outbound connection like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Awaitable, Callable

from ztunnel.core.addr import IPAddr, SocketAddr
from ztunnel.logs import RateLimitedLog
from ztunnel.net.sockopt import peer_addr
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.socks5_proto import (
    Handshake,
    Reply,
    Request,
    SocksError,
    early_eof,
    first_address,
    invalid_protocol,
    lookup_query,
    reply,
    reply_for,
)

log = logging.getLogger("ztunnel.proxy.socks5")

# A DNS message to the instance's DNS proxy, and its response (None: it dropped the message).
DnsExchange = Callable[[bytes], Awaitable[bytes | None]]

HANDSHAKE_TIMEOUT = 10.0
MAX_HANDSHAKES = 128


class Socks5:
    def __init__(self, ctx: ProxyContext, outbound: Outbound, dns: DnsExchange | None) -> None:
        self.ctx = ctx
        self.outbound = outbound
        self.dns = dns
        self.handshakes = 0  # in progress
        self._log = RateLimitedLog(log)

    async def handle(self, sock: socket.socket) -> None:
        try:
            src = peer_addr(sock)
        except OSError:
            return  # gone before we looked (Rust #1764)
        if self.handshakes >= MAX_HANDSHAKES:
            self._guard("socks5_handshakes")
            self._log.warning(
                "busy",
                "socks5: %d handshakes in progress; closing a new connection from %s",
                self.handshakes,
                src,
            )
            return
        self.handshakes += 1
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                dst = await self._negotiate(sock, src)
        except SocksError as e:
            # Rust handle_socks_connection: warn, then send_error (best effort)
            self._log.warning(
                f"negotiate {e.reply.name}", "failed to negotiate socks connection: %s", e
            )
            _send_reply(sock, e.reply)
            return
        except TimeoutError:
            self._guard("socks5_handshake_timeout")
            self._log.warning(
                "timeout",
                "failed to negotiate socks connection: no complete request from %s within %.0fs",
                src,
                HANDSHAKE_TIMEOUT,
            )
            return
        finally:
            self.handshakes -= 1
        await self.outbound.handle(sock, src=src, dst=dst, answer=functools.partial(_answer, sock))

    async def _negotiate(self, sock: socket.socket, src: SocketAddr) -> SocketAddr:
        """Rust ``negotiate_socks_connection``: the target the client asked for."""
        loop = asyncio.get_running_loop()
        hs = Handshake()
        while True:
            out = hs.feed(await _read_exactly(loop, sock, hs.need))
            if isinstance(out, Request):
                break
            if out is not None:
                try:
                    await loop.sock_sendall(sock, out)
                except OSError as e:
                    raise SocksError(Reply.GENERAL, f"io error: {e}") from None
        if isinstance(out.host, str):
            return out.target(await self._resolve(out.host, src.ip.version == 6))
        return out.target()

    async def _resolve(self, host: str, ipv6: bool) -> IPAddr:
        """Rust ``dns_lookup`` through the instance's DNS proxy."""
        if self.dns is None:
            raise invalid_protocol("unsupported hostname lookup, requires DNS enabled")
        query = lookup_query(host, ipv6)
        try:
            response = await self.dns(query)
        except OSError as e:
            raise SocksError(
                Reply.HOST_UNREACHABLE, f"dns lookup of {host!r} failed: {e}"
            ) from None
        return first_address(response)

    def _guard(self, reason: str) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.guard_event(reason)


async def _read_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """``n`` bytes and not one more (what follows the request is the upstream's)."""
    buf = b""
    while len(buf) < n:
        try:
            chunk = await loop.sock_recv(sock, n - len(buf))
        except OSError as e:
            raise SocksError(Reply.GENERAL, f"io error: {e}") from None
        if not chunk:
            raise early_eof()
        buf += chunk
    return buf


def _send_reply(sock: socket.socket, code: Reply) -> bool:
    """One reply, without waiting: 10 bytes into a socket we have written 2 bytes to. False when
    it did not go out whole (the client is gone, or not reading)."""
    data = reply(code)
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


def _answer(sock: socket.socket, error: BaseException | str | None) -> None:
    """How the outbound connection went, told to the client before any byte is copied."""
    if not _send_reply(sock, reply_for(error)) and error is None:
        # A success the client did not get whole: end the connection rather than copy after a
        # torn reply (the copy then sees the socket closed).
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
