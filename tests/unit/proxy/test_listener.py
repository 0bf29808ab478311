"""Listener: one task per accepted connection, whose done callback closes the socket, balances
the socket gauge and logs a handler failure; drain cuts what is left at the deadline."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import pytest

from ztunnel.proxy.listener import Listener

pytestmark = pytest.mark.timeout(30)


def _listening() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def _connect(lst: Listener) -> socket.socket:
    loop = asyncio.get_running_loop()
    c = socket.socket()
    c.setblocking(False)
    await loop.sock_connect(c, lst.address)
    return c


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.mark.both_loops
async def test_handler_runs_per_connection_and_its_socket_is_closed() -> None:
    seen: list[socket.socket] = []
    gauge: list[bool] = []

    async def handler(conn: socket.socket) -> None:
        seen.append(conn)

    lst = Listener(_listening(), handler, "test")
    lst.on_socket = gauge.append
    lst.start()
    clients = [await _connect(lst) for _ in range(3)]
    await _until(lambda: len(seen) == 3 and lst.active == 0)
    assert all(s.fileno() == -1 for s in seen)  # closed by the listener after the handler
    assert gauge.count(True) == gauge.count(False) == 3
    assert lst.accepted == 3
    await lst.close()
    for c in clients:
        c.close()


@pytest.mark.both_loops
async def test_handler_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(conn: socket.socket) -> None:
        raise RuntimeError("boom")

    lst = Listener(_listening(), handler, "test")
    gauge: list[bool] = []
    lst.on_socket = gauge.append
    lst.start()
    with caplog.at_level(logging.ERROR, logger="ztunnel.proxy"):
        c = await _connect(lst)
        await _until(lambda: gauge == [True, False])
    assert [r.getMessage() for r in caplog.records] == ["test: connection handler failed"]
    assert caplog.records[0].exc_info is not None
    assert isinstance(caplog.records[0].exc_info[1], RuntimeError)
    await lst.close()
    c.close()


@pytest.mark.both_loops
async def test_drain_cancels_what_is_left_at_the_deadline() -> None:
    started = asyncio.Event()
    cancelled: list[bool] = []
    conns: list[socket.socket] = []

    async def handler(conn: socket.socket) -> None:
        conns.append(conn)
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    gauge: list[bool] = []
    lst = Listener(_listening(), handler, "test")
    lst.on_socket = gauge.append
    lst.start()
    c = await _connect(lst)
    await started.wait()
    assert lst.active == 1
    assert await lst.drain(0.05) == 1
    assert cancelled == [True] and lst.active == 0
    assert conns[0].fileno() == -1 and gauge == [True, False]
    c.close()


@pytest.mark.both_loops
async def test_connections_within_the_fd_reserve_are_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 13: before RLIMIT_NOFILE, accepted connections are reset at once and counted;
    the handler never runs for them, and one warning line is logged per second at most."""
    import resource

    from ztunnel.net.fdbudget import FdBudget

    seen: list[socket.socket] = []

    async def handler(conn: socket.socket) -> None:
        seen.append(conn)

    lst = Listener(_listening(), handler, "test")
    lst.budget = FdBudget(reserve=0)
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (3, 3))  # every fd is over it
    lst.start()
    # (blocking connects: the kernel completes them before the listener runs)
    clients = [socket.create_connection(lst.address, timeout=2) for _ in range(5)]
    await _until(lambda: lst.refused == 5)
    assert not seen and lst.accepted == 0
    for c in clients:  # each got a RST
        with pytest.raises(ConnectionResetError):
            c.recv(1)
        c.close()
    assert sum("budget exhausted" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.undo()
    lst.budget = FdBudget(reserve=0)  # (one that reads the real limit now, not in a second)
    c = await _connect(lst)
    await _until(lambda: len(seen) == 1)
    await lst.close()
    c.close()


@pytest.mark.both_loops
async def test_pass_peer_gives_the_handler_accepts_address() -> None:
    peers: list[object] = []

    async def handler(conn: socket.socket, peer: object) -> None:
        peers.append(peer)

    lst = Listener(_listening(), handler, "test")
    lst.pass_peer = True
    lst.start()
    c = await _connect(lst)
    await _until(lambda: len(peers) == 1)
    assert peers[0] == c.getsockname()
    await lst.close()
    c.close()
