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
