"""ConnectionPool bookkeeping: one dial per key, stream capacity, and the idle clock
(POOL_UNUSED_RELEASE_TIMEOUT: a connection with no streams for that long is closed).

The connections are stand-ins with the few members the pool reads: what is tested here is the
pool's own accounting (end to end, tests/netns/test_hbone*.py run real pooled connections)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ztunnel.core.addr import SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.hbone.pool import ConnectionPool, WorkloadKey
from ztunnel.hbone.transport import HboneConnection

pytestmark = pytest.mark.timeout(30)

KEY = WorkloadKey(
    Identity("cluster.local", "ns", "a"),
    (Identity("cluster.local", "ns", "b"),),
    None,
    SocketAddr.parse("10.0.0.2:15008"),
)


class FakeConn:
    def __init__(self, max_streams: int | None = None) -> None:
        self.h2 = SimpleNamespace(remote_max_concurrent_streams=max_streams)
        self.closed: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )
        self.goaway = False
        self.active_streams = 0

    def reserve(self) -> None:
        self.active_streams += 1

    def release(self) -> None:
        self.active_streams -= 1

    def close(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _pool(idle_timeout: float, dialled: list[FakeConn], **kw: Any) -> ConnectionPool:
    async def dial(_key: WorkloadKey) -> HboneConnection:
        await asyncio.sleep(0.01)
        conn = FakeConn(**kw)
        dialled.append(conn)
        return cast(HboneConnection, conn)

    return ConnectionPool(dial, max_streams=2, idle_timeout=idle_timeout)


def _end_stream(pool: ConnectionPool, conn: HboneConnection) -> None:
    cast(FakeConn, conn).release()
    pool.stream_done(conn)


@pytest.mark.both_loops
async def test_one_dial_per_key_and_streams_up_to_the_limit() -> None:
    dialled: list[FakeConn] = []
    pool = _pool(10.0, dialled)
    a, b, c = await asyncio.gather(*(pool.checkout(KEY) for _ in range(3)))
    assert a is b and a is not c  # max_streams=2: the third stream needs a second connection
    assert len(dialled) == 2 and pool.dials == 2
    pool.close()


@pytest.mark.both_loops
async def test_an_idle_connection_is_closed_after_the_timeout() -> None:
    dialled: list[FakeConn] = []
    pool = _pool(0.1, dialled)
    conn = await pool.checkout(KEY)
    _end_stream(pool, conn)
    await asyncio.sleep(0.05)
    assert not conn.closed.done()
    await asyncio.sleep(0.15)
    assert conn.closed.done()
    assert pool.connections() == []


@pytest.mark.both_loops
async def test_the_idle_clock_starts_at_the_last_stream_end() -> None:
    # Used again before its timeout, the connection stays; it closes a whole timeout after
    # its last stream ended, not after the first idle period began. Back-to-back streams arm
    # no timer each: at most one is armed per connection.
    dialled: list[FakeConn] = []
    pool = _pool(0.2, dialled)
    conn = await pool.checkout(KEY)
    _end_stream(pool, conn)
    for _ in range(5):
        await asyncio.sleep(0.06)
        assert await pool.checkout(KEY) is conn
        _end_stream(pool, conn)
        assert len(pool._idle) <= 1
    last_end = asyncio.get_running_loop().time()
    await asyncio.sleep(0.12)
    assert not conn.closed.done()  # 0.3 s since the first idle period began, 0.12 s idle
    while not conn.closed.done():
        await asyncio.sleep(0.01)
    assert asyncio.get_running_loop().time() - last_end >= 0.19
    assert len(dialled) == 1


@pytest.mark.both_loops
async def test_a_busy_connection_is_not_closed_by_its_idle_timer() -> None:
    dialled: list[FakeConn] = []
    pool = _pool(0.05, dialled)
    conn = await pool.checkout(KEY)
    _end_stream(pool, conn)
    assert await pool.checkout(KEY) is conn  # busy again before the timer fires
    await asyncio.sleep(0.12)
    assert not conn.closed.done()
    _end_stream(pool, conn)
    await asyncio.sleep(0.12)
    assert conn.closed.done()


@pytest.mark.both_loops
async def test_goaway_closes_at_the_last_stream_and_a_closed_connection_leaves() -> None:
    dialled: list[FakeConn] = []
    pool = _pool(10.0, dialled)
    conn = await pool.checkout(KEY)
    cast(FakeConn, conn).goaway = True
    _end_stream(pool, conn)
    assert conn.closed.done()
    await asyncio.sleep(0)
    assert pool.connections() == [] and pool._idle == {} and pool._idle_since == {}
    fresh = await pool.checkout(KEY)
    assert fresh is not conn and len(dialled) == 2
    pool.close()


@pytest.mark.both_loops
async def test_a_connection_that_refused_the_stream_is_avoided_for_its_retry() -> None:
    # RFC 9113 8.7: a refused stream is retried on another connection (HboneConnector): the
    # pool hands out any other usable one, or dials a new one; others still get the first.
    dialled: list[FakeConn] = []
    pool = _pool(10.0, dialled)
    first = await pool.checkout(KEY)
    _end_stream(pool, first)
    retry = await pool.checkout(KEY, avoid=[first])
    assert retry is not first and len(dialled) == 2
    assert await pool.checkout(KEY, avoid=[first]) is retry  # (max_streams=2: room for one more)
    assert await pool.checkout(KEY) is first
    pool.close()
