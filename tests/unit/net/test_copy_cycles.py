"""copy_bidirectional leaves no reference cycles: a finished connection is freed by refcounting.

With the cyclic GC off, the engine's per-connection objects (_Session, its directions, the sinks)
must be gone as soon as each connection ends, on every way it can end: clean half-closes, a reset
(the error is kept in the result, without the traceback whose frames hold a direction) and
cancellation.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
from collections.abc import Iterator

import pytest

from tests.unit.net.test_copy import PATHS, make_leg, make_pool
from ztunnel.net import copy as copy_mod
from ztunnel.net.copy import PipePool, copy_bidirectional

pytestmark = pytest.mark.timeout(60)

N = 300


def _engine_objects() -> int:
    kinds = (copy_mod._Session, copy_mod._Direction, copy_mod._SocketSink)
    return sum(1 for o in gc.get_objects() if isinstance(o, kinds))


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _clean(pool: PipePool | None) -> None:
    leg = make_leg()
    loop = asyncio.get_running_loop()
    task = loop.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
    leg.client.sendall(b"ping")
    leg.client.shutdown(socket.SHUT_WR)
    leg.server.sendall(b"pong")
    leg.server.shutdown(socket.SHUT_WR)
    result = await task
    assert (result.down_to_up, result.up_to_down, result.error) == (4, 4, None)
    leg.close_ends()


async def _reset(pool: PipePool | None) -> None:
    leg = make_leg()
    loop = asyncio.get_running_loop()
    task = loop.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
    leg.client.sendall(b"x")
    await asyncio.sleep(0)
    leg.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    leg.client.close()
    result = await task
    assert result.error is not None
    assert result.error.__traceback__ is None
    leg.close_ends()


async def _cancel(pool: PipePool | None) -> None:
    leg = make_leg()
    loop = asyncio.get_running_loop()
    task = loop.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
    leg.client.sendall(b"x")
    await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    del task
    leg.close_ends()


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ending", ["clean", "reset", "cancel"])
@pytest.mark.usefixtures("no_gc")
async def test_finished_connections_are_freed_without_gc(path: str, ending: str) -> None:
    run = {"clean": _clean, "reset": _reset, "cancel": _cancel}[ending]
    pool = make_pool(path)
    await run(pool)  # warm-up (first-use caches)
    before = _engine_objects()
    for _ in range(N):
        await run(pool)
    await asyncio.sleep(0)
    # (<= 0: the warm-up's last connection can still be held by its exception until the next one)
    left = _engine_objects() - before
    assert left <= 0, f"{left} engine objects of {N} {ending} connections wait for the GC"
    if pool is not None:
        pool.close()
