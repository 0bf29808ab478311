"""The SOCKS5 listener's I/O (proxy/socks5.py) on real loopback sockets, with the outbound path
and the DNS proxy stood in for: what reaches Outbound.handle, the replies, the bounds."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import dns.message
import dns.rrset
import pytest

from ztunnel.config import Config
from ztunnel.core.addr import SocketAddr
from ztunnel.proxy import socks5 as socks5_mod
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.proxy.socks5 import Socks5
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(20)


class FakeOutbound:
    """Records what the handshake hands to the outbound path, answers success, and reads what
    the client sent after its request (the upstream's bytes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[SocketAddr, SocketAddr]] = []
        self.after: bytes = b""

    async def handle(self, sock: socket.socket, src: Any, dst: Any, answer: Any) -> None:
        self.calls.append((src, dst))
        answer(None)
        await asyncio.sleep(0.1)  # (whatever the client sent with its request is there)
        try:
            self.after = sock.recv(100)
        except BlockingIOError:
            self.after = b""


Exchange = Callable[[bytes], Awaitable[bytes | None]]


async def connection(
    dns: Exchange | None, client_bytes: bytes, *, read: int = 12
) -> tuple[bytes, FakeOutbound, Socks5]:
    """One client connection to a Socks5 handler: what the client received (``read`` bytes
    at most, or until the socket was closed: by the listener, here once the handler returns)."""
    loop = asyncio.get_running_loop()
    ctx = ProxyContext(Config(socks5=True), State(), SocketFactory(mark=None), None, lambda: None)
    out = FakeOutbound()
    handler = Socks5(ctx, out, dns)  # type: ignore[arg-type]
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        client = socket.create_connection(lst.getsockname())
        server, _ = lst.accept()
    server.setblocking(False)
    client.setblocking(False)
    task = loop.create_task(handler.handle(server))
    task.add_done_callback(lambda _: server.close())
    try:
        await loop.sock_sendall(client, client_bytes)
        got = b""
        async with asyncio.timeout(5):
            while len(got) < read:
                try:
                    chunk = await loop.sock_recv(client, read - len(got))
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                got += chunk
        await asyncio.wait_for(task, 5)
        return got, out, handler
    finally:
        client.close()
        server.close()


GREETING = b"\x05\x01\x00"
OK = b"\x05\x00"  # the method selection
DUMMY = b"\x00\x01\x00\x00\x00\x00\x00\x00"


async def test_an_ip_request_reaches_the_outbound_path_and_early_bytes_stay_for_it() -> None:
    req = b"\x05\x01\x00\x01\x0a\x00\x02\x02\x1f\x90"
    got, out, _ = await connection(None, GREETING + req + b"early data", read=12)
    assert got == OK + b"\x05\x00" + DUMMY  # the reply once the outbound side answered
    [(src, dst)] = out.calls
    assert str(dst) == "10.0.2.2:8080" and str(src.ip) == "127.0.0.1"
    assert out.after == b"early data"


async def test_a_hostname_without_the_dns_proxy_is_command_not_supported() -> None:
    """Rust negotiate_socks_connection: no resolver -> invalid_protocol("unsupported hostname
    lookup, requires DNS enabled")."""
    got, out, _ = await connection(None, GREETING + b"\x05\x01\x00\x03\x02s1\x00\x50")
    assert got == OK + b"\x05\x07" + DUMMY and not out.calls


async def test_a_hostname_is_resolved_by_the_dns_exchange() -> None:
    asked: list[dns.message.Message] = []

    async def exchange(query: bytes) -> bytes | None:
        q = dns.message.from_wire(query)
        asked.append(q)
        r = dns.message.make_response(q)
        r.answer.append(dns.rrset.from_text(q.question[0].name, 30, "IN", "A", "10.96.0.20"))
        wire: bytes = r.to_wire()
        return wire

    got, out, _ = await connection(exchange, GREETING + b"\x05\x01\x00\x03\x02s1\x00\x50")
    assert got == OK + b"\x05\x00" + DUMMY
    assert str(out.calls[0][1]) == "10.96.0.20:80"
    assert asked[0].question[0].name.to_text() == "s1."


async def test_a_name_that_does_not_resolve_is_host_unreachable() -> None:
    async def nothing(query: bytes) -> bytes | None:
        return None  # (the DNS proxy dropped it)

    got, out, _ = await connection(nothing, GREETING + b"\x05\x01\x00\x03\x02s1\x00\x50")
    assert got == OK + b"\x05\x04" + DUMMY and not out.calls


async def test_a_slow_handshake_is_closed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socks5_mod, "HANDSHAKE_TIMEOUT", 0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got, out, handler = await connection(None, b"\x05")  # (then nothing)
    assert got == b"" and not out.calls and handler.handshakes == 0
    assert 0.25 < loop.time() - t0 < 3


async def test_handshakes_over_the_cap_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socks5_mod, "MAX_HANDSHAKES", 0)
    got, out, handler = await connection(None, GREETING)
    assert got == b"" and not out.calls and handler.handshakes == 0
