"""copy_bidirectional on loopback: integrity, half-close, resets, cancellation, counters, churn, pipes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import random
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from ztunnel.net import copy as copy_mod
from ztunnel.net.copy import CopyCounters, CopyResult, PipePool, Side, copy_bidirectional
from ztunnel.testing.fds import open_fds

_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)

pytestmark = pytest.mark.timeout(30)

PATHS = ["splice", "buffered"]
MiB = 1 << 20


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected blocking loopback TCP sockets (connector, acceptor)."""
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    return a, b


def make_pool(path: str) -> PipePool | None:
    return PipePool() if path == "splice" else None


@dataclass
class Leg:
    """One proxied connection: client <-> [down  engine  up] <-> server."""

    client: socket.socket
    down: socket.socket
    up: socket.socket
    server: socket.socket
    extra: list[socket.socket] = field(default_factory=list)

    def close_ends(self) -> None:
        for s in (self.client, self.server, *self.extra):
            s.close()


def make_leg() -> Leg:
    client, down = tcp_pair()
    up, server = tcp_pair()
    return Leg(client, down, up, server)


def pattern(seed: int, total: int) -> Callable[[], bytes | None]:
    """Deterministic pseudo-random chunks of varying size (so reordering bugs change the hash)."""
    rnd = random.Random(seed)
    base = rnd.randbytes(4 * MiB)
    left = total

    def nxt() -> bytes | None:
        nonlocal left
        if left <= 0:
            return None
        size = min(left, rnd.randint(1, 1 * MiB))
        off = rnd.randint(0, len(base) - size)
        left -= size
        return base[off : off + size]

    return nxt


def send_all_then_fin(sock: socket.socket, seed: int, total: int) -> str:
    h = hashlib.sha256()
    nxt = pattern(seed, total)
    while (chunk := nxt()) is not None:
        sock.sendall(chunk)
        h.update(chunk)
    sock.shutdown(socket.SHUT_WR)
    return h.hexdigest()


def recv_to_eof(sock: socket.socket, delay: float = 0.0) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    buf = bytearray(256 * 1024)
    while True:
        k = sock.recv_into(buf)
        if not k:
            return n, h.hexdigest()
        n += k
        h.update(memoryview(buf)[:k])
        if delay:
            time.sleep(delay)


T = TypeVar("T")


async def in_thread(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


# ---------------------------------------------------------------------------------------------
# bulk integrity


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_large_transfer_both_ways(path: str) -> None:
    size = 64 * MiB
    pool = make_pool(path)
    leg = make_leg()
    try:
        copy_task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        results = await asyncio.gather(
            in_thread(lambda: send_all_then_fin(leg.client, 1, size)),
            in_thread(lambda: recv_to_eof(leg.server)),
            in_thread(lambda: send_all_then_fin(leg.server, 2, size)),
            in_thread(lambda: recv_to_eof(leg.client)),
        )
        res = await asyncio.wait_for(copy_task, 10)
    finally:
        leg.close_ends()
    c_sent, s_got, s_sent, c_got = results
    assert s_got == (size, c_sent)
    assert c_got == (size, s_sent)
    assert res == CopyResult(size, size, None, None)
    assert leg.down.fileno() == -1 and leg.up.fileno() == -1
    if pool is not None:
        st = pool.stats()
        assert st.in_use == 0
        assert st.created <= 4  # per direction at most a small pipe, then a large one
        pool.close()


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_small_send_buffers_force_partial_writes(path: str) -> None:
    """Tiny proxy-side send buffers: every pipeful/bufferful drains over many partial writes."""
    size = 4 * MiB
    pool = make_pool(path)
    leg = make_leg()
    for s in (leg.down, leg.up):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    try:
        copy_task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        results = await asyncio.gather(
            in_thread(lambda: send_all_then_fin(leg.client, 11, size)),
            in_thread(lambda: recv_to_eof(leg.server, delay=0.0002)),
            in_thread(lambda: send_all_then_fin(leg.server, 12, size)),
            in_thread(lambda: recv_to_eof(leg.client, delay=0.0002)),
        )
        res = await asyncio.wait_for(copy_task, 15)
    finally:
        leg.close_ends()
    c_sent, s_got, s_sent, c_got = results
    assert s_got == (size, c_sent)
    assert c_got == (size, s_sent)
    assert res == CopyResult(size, size)
    if pool is not None:
        assert pool.stats().in_use == 0
        pool.close()


# ---------------------------------------------------------------------------------------------
# half-close


def request_then_long_reply(first: socket.socket, second: socket.socket, reply: int) -> None:
    """`first` sends a request and FIN; `second` reads it to EOF, then sends a long reply and FIN."""
    first.sendall(b"q" * 100_000)
    first.shutdown(socket.SHUT_WR)
    got, _ = recv_to_eof(second)
    assert got == 100_000
    send_all_then_fin(second, 7, reply)


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("who_closes_first", ["client", "server"])
async def test_half_close_keeps_other_direction(path: str, who_closes_first: str) -> None:
    reply = 16 * MiB
    pool = make_pool(path)
    leg = make_leg()
    first, second = (
        (leg.client, leg.server) if who_closes_first == "client" else (leg.server, leg.client)
    )
    try:
        copy_task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        _, (got, _) = await asyncio.gather(
            in_thread(lambda: request_then_long_reply(first, second, reply)),
            # the half-closed side reads slowly at first so the FIN overtakes nothing
            in_thread(lambda: recv_to_eof(first)),
        )
        res = await asyncio.wait_for(copy_task, 10)
    finally:
        leg.close_ends()
    assert got == reply
    assert res.error is None
    if who_closes_first == "client":
        assert (res.down_to_up, res.up_to_down) == (100_000, reply)
    else:
        assert (res.down_to_up, res.up_to_down) == (reply, 100_000)
    if pool is not None:
        assert pool.stats().in_use == 0
        pool.close()


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_half_close_propagates_fin_without_closing(path: str) -> None:
    """A FIN from the client reaches the server as EOF while the proxy keeps both sockets open."""
    pool = make_pool(path)
    leg = make_leg()
    try:
        copy_task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        leg.client.shutdown(socket.SHUT_WR)
        assert await in_thread(lambda: leg.server.recv(10)) == b""
        await asyncio.sleep(0.05)
        assert not copy_task.done()
        leg.server.sendall(b"still here")
        assert await in_thread(lambda: leg.client.recv(100)) == b"still here"
        leg.server.shutdown(socket.SHUT_WR)
        res = await asyncio.wait_for(copy_task, 5)
        assert await in_thread(lambda: leg.client.recv(10)) == b""
    finally:
        leg.close_ends()
    assert res == CopyResult(0, 10)


# ---------------------------------------------------------------------------------------------
# resets


def abort(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def server_floods_until_error(sock: socket.socket) -> BaseException | None:
    chunk = b"x" * 65536
    try:
        while True:
            sock.sendall(chunk)
    except OSError as e:
        return e


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("resetter", ["client", "server"])
async def test_reset_mid_stream_closes_other_side(path: str, resetter: str) -> None:
    pool = make_pool(path)
    fds_before = open_fds()
    leg = make_leg()
    counters = CopyCounters()
    try:
        copy_task = asyncio.create_task(
            copy_bidirectional(leg.down, leg.up, pipes=pool, counters=counters)
        )
        # bulk in both directions, then one end resets
        victim = leg.server if resetter == "client" else leg.client
        flooder = asyncio.create_task(in_thread(lambda: server_floods_until_error(victim)))
        rst = leg.client if resetter == "client" else leg.server
        rst.sendall(b"y" * 300_000)
        while counters.down_to_up + counters.up_to_down < 1 * MiB:
            await asyncio.sleep(0.005)
        abort(rst)
        res = await asyncio.wait_for(copy_task, 5)
        err = await asyncio.wait_for(flooder, 5)
    finally:
        leg.close_ends()
    assert isinstance(res.error, (ConnectionResetError, BrokenPipeError)), res
    assert res.error_side == (Side.DOWNSTREAM if resetter == "client" else Side.UPSTREAM)
    # the surviving peer was torn down with a reset too, not a clean EOF
    assert isinstance(err, (ConnectionResetError, BrokenPipeError)), err
    assert leg.down.fileno() == -1 and leg.up.fileno() == -1
    if pool is not None:
        assert pool.stats().in_use == 0
        pool.close()
    assert open_fds() == fds_before


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_reset_while_backpressured_drops_parked_bytes(path: str) -> None:
    """The server stops reading (bytes parked in the pipe/buffer), then resets: all torn down."""
    pool = make_pool(path)
    fds_before = open_fds()
    leg = make_leg()
    counters = CopyCounters()
    try:
        copy_task = asyncio.create_task(
            copy_bidirectional(leg.down, leg.up, pipes=pool, counters=counters)
        )
        # The server half-closes first, so only the parked direction still watches upstream: the
        # reset must be caught by the writer side.
        leg.server.shutdown(socket.SHUT_WR)
        assert await in_thread(lambda: leg.client.recv(1)) == b""
        leg.client.setblocking(False)
        last, still = -1, 0
        while still < 5:  # push until the proxy can no longer deliver upstream
            with contextlib.suppress(BlockingIOError):
                leg.client.send(b"p" * 65536)
            await asyncio.sleep(0.01)
            still = still + 1 if counters.down_to_up == last else 0
            last = counters.down_to_up
        if pool is not None:
            assert pool.stats().in_use == 1  # the parked bytes sit in a pipe
        abort(leg.server)
        res = await asyncio.wait_for(copy_task, 5)
    finally:
        leg.close_ends()
    assert isinstance(res.error, (ConnectionResetError, BrokenPipeError)), res
    assert res.error_side == Side.UPSTREAM
    assert res.down_to_up == counters.down_to_up > 0
    if pool is not None:
        st = pool.stats()
        assert st.in_use == 0
        assert st.created - st.idle >= 1  # the dirty pipe was closed, not pooled
        pool.close()
    assert open_fds() == fds_before


# ---------------------------------------------------------------------------------------------
# cancellation


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_cancel_closes_everything_and_drops_dirty_pipes(path: str) -> None:
    pool = make_pool(path)
    fds_before = open_fds()
    leg = make_leg()
    counters = CopyCounters()
    stop = threading.Event()

    def client_pushes() -> None:
        # the server never reads: the proxy's upstream send buffer fills and data sits in the pipe
        leg.client.setblocking(False)
        chunk = b"z" * 65536
        while not stop.is_set():
            try:
                leg.client.send(chunk)
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                return

    try:
        copy_task = asyncio.create_task(
            copy_bidirectional(leg.down, leg.up, pipes=pool, counters=counters)
        )
        pusher = asyncio.create_task(in_thread(client_pushes))
        deadline = time.monotonic() + 5
        if pool is not None:
            while pool.stats().in_use == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert pool.stats().in_use == 1  # a dirty pipe is held while upstream is stuck
        else:
            await asyncio.sleep(0.3)
        assert counters.down_to_up > 0
        copy_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await copy_task
        assert leg.down.fileno() == -1 and leg.up.fileno() == -1
        stop.set()
        await pusher
        # the client sees the proxy go away (reset, since the stream was truncated)
        leg.client.setblocking(True)
        with pytest.raises(OSError):
            for _ in range(1000):
                if not leg.client.recv(65536):
                    raise OSError("eof")
    finally:
        stop.set()
        leg.close_ends()
    if pool is not None:
        st = pool.stats()
        # The dirty pipe was closed, not pooled (the clean small one before it was).
        assert st.in_use == 0 and st.idle == st.created - 1
        pool.close()
    assert open_fds() == fds_before


# ---------------------------------------------------------------------------------------------
# counters


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_counters_update_during_transfer(path: str) -> None:
    size = 32 * MiB
    pool = make_pool(path)
    leg = make_leg()
    counters = CopyCounters()
    seen: list[int] = []
    try:
        copy_task = asyncio.create_task(
            copy_bidirectional(leg.down, leg.up, pipes=pool, counters=counters)
        )
        leg.server.shutdown(socket.SHUT_WR)
        sender = asyncio.create_task(in_thread(lambda: send_all_then_fin(leg.client, 3, size)))
        receiver = asyncio.create_task(in_thread(lambda: recv_to_eof(leg.server, delay=0.0005)))
        while not copy_task.done():
            seen.append(counters.down_to_up)
            await asyncio.sleep(0.005)
        res = await copy_task
        await sender
        got, _ = await receiver
    finally:
        leg.close_ends()
    assert got == size
    assert res.down_to_up == size == counters.down_to_up
    assert counters.up_to_down == 0
    middle = [v for v in seen if 0 < v < size]
    assert len(set(middle)) >= 3, seen  # observed growing while the transfer ran
    assert seen == sorted(seen)
    if pool is not None:
        pool.close()


# ---------------------------------------------------------------------------------------------
# churn soak through a tiny proxy


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    """Raw-socket echo server: echoes until EOF, then closes."""
    loop = asyncio.get_running_loop()
    lst = socket.create_server(("127.0.0.1", 0), backlog=512)
    lst.setblocking(False)
    handlers: set[asyncio.Task[None]] = set()

    async def handle(s: socket.socket) -> None:
        with s:
            while data := await loop.sock_recv(s, 65536):
                await loop.sock_sendall(s, data)

    async def accept_loop() -> None:
        while True:
            s, _ = await loop.sock_accept(lst)
            t = asyncio.create_task(handle(s))
            handlers.add(t)
            t.add_done_callback(handlers.discard)

    acceptor = asyncio.create_task(accept_loop())
    try:
        yield lst.getsockname()
    finally:
        acceptor.cancel()
        for t in list(handlers):
            t.cancel()
        await asyncio.gather(acceptor, *handlers, return_exceptions=True)
        lst.close()


@contextlib.asynccontextmanager
async def tiny_proxy(
    upstream: tuple[str, int], pool: PipePool | None, results: list[CopyResult]
) -> AsyncIterator[tuple[str, int]]:
    """accept -> connect upstream -> copy_bidirectional; the engine closes both sockets."""
    loop = asyncio.get_running_loop()
    lst = socket.create_server(("127.0.0.1", 0), backlog=512)
    lst.setblocking(False)
    handlers: set[asyncio.Task[None]] = set()

    async def handle(down: socket.socket) -> None:
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        try:
            await loop.sock_connect(up, upstream)
        except BaseException:
            up.close()
            down.close()
            raise
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        results.append(await copy_bidirectional(down, up, pipes=pool))

    async def accept_loop() -> None:
        while True:
            s, _ = await loop.sock_accept(lst)
            t = asyncio.create_task(handle(s))
            handlers.add(t)
            t.add_done_callback(handlers.discard)

    acceptor = asyncio.create_task(accept_loop())
    try:
        yield lst.getsockname()
    finally:
        acceptor.cancel()
        for t in list(handlers):
            t.cancel()
        await asyncio.gather(acceptor, *handlers, return_exceptions=True)
        lst.close()


async def short_client(addr: tuple[str, int], payload: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    with s:
        await loop.sock_connect(s, addr)
        await loop.sock_sendall(s, payload)
        s.shutdown(socket.SHUT_WR)
        out = bytearray()
        while data := await loop.sock_recv(s, 65536):
            out += data
        return bytes(out)


@pytest.mark.both_loops
@pytest.mark.parametrize("path", PATHS)
async def test_churn_soak_short_connections(path: str) -> None:
    n_conns, concurrency = 3000, 50
    fds_before = open_fds()
    tasks_before = len(asyncio.all_tasks())
    pool = make_pool(path)
    results: list[CopyResult] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        payload = (b"%d:" % i) * (1 + i % 50)
        async with sem:
            assert await short_client(proxy_addr, payload) == payload

    async with echo_server() as echo_addr, tiny_proxy(echo_addr, pool, results) as proxy_addr:
        await asyncio.gather(*(one(i) for i in range(n_conns)))
        # the last sessions finish right after their clients saw EOF (a busy machine may
        # take a while to run them: what matters is that every one does)
        deadline = asyncio.get_running_loop().time() + 20
        while len(results) < n_conns and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
    assert len(results) == n_conns
    assert all(r.error is None for r in results), [r for r in results if r.error][:3]
    if pool is not None:
        st = pool.stats()
        assert st.in_use == 0
        # short flows give their pipe back within the same callback: a handful ever get created
        assert st.created <= 4, st
        pool.close()
    await asyncio.sleep(0)
    assert open_fds() == fds_before
    assert len(asyncio.all_tasks()) == tasks_before


# ---------------------------------------------------------------------------------------------
# pipe pool


@pytest.mark.both_loops
async def test_idle_connections_hold_no_pipes() -> None:
    pool = PipePool(max_idle=4)
    legs = [make_leg() for _ in range(20)]
    tasks = [asyncio.create_task(copy_bidirectional(g.down, g.up, pipes=pool)) for g in legs]
    try:
        for g in legs:
            g.client.sendall(b"hello")
            assert await in_thread(lambda g=g: g.server.recv(5)) == b"hello"  # type: ignore[misc]
            g.server.sendall(b"world!")
            assert await in_thread(lambda g=g: g.client.recv(6)) == b"world!"  # type: ignore[misc]
        await asyncio.sleep(0.05)
        st = pool.stats()
        assert st.in_use == 0  # 20 live, idle connections hold no pipe
        assert 1 <= st.created <= 2 and st.idle == st.created
        assert not any(t.done() for t in tasks)
    finally:
        for g in legs:
            g.client.shutdown(socket.SHUT_WR)
            g.server.shutdown(socket.SHUT_WR)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        for g in legs:
            g.close_ends()
    assert all(r == CopyResult(5, 6) for r in results)
    pool.close()
    assert pool.stats().idle == 0


def test_pool_reuses_and_bounds_idle() -> None:
    pool = PipePool(pipe_size=1 << 16, max_idle=1)
    a = pool.get()
    b = pool.get()
    pool.put(a)
    pool.put(b)  # over max_idle: closed
    with pytest.raises(OSError):
        os.fstat(b[0])
    assert pool.get() == a
    pool.discard(a)
    with pytest.raises(OSError):
        os.fstat(a[0])
    st = pool.stats()
    assert (st.created, st.in_use, st.idle) == (2, 0, 0)
    pool.close()
    c = pool.get()
    pool.put(c)  # after close(): closed, not parked
    assert pool.stats().idle == 0


@pytest.mark.both_loops
async def test_pool_keeps_default_size_pipe_when_resize_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_fcntl = fcntl.fcntl

    def deny_setpipe(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == copy_mod._F_SETPIPE_SZ:
            raise PermissionError(errno.EPERM, "pipe-user-pages-soft")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", deny_setpipe)
    pool = PipePool()
    leg = make_leg()
    try:
        task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        leg.server.shutdown(socket.SHUT_WR)
        sent, (got, digest) = await asyncio.gather(
            in_thread(lambda: send_all_then_fin(leg.client, 5, 8 * MiB)),
            in_thread(lambda: recv_to_eof(leg.server)),
        )
        res = await asyncio.wait_for(task, 5)
    finally:
        leg.close_ends()
    assert (got, digest) == (8 * MiB, sent)
    assert res.error is None
    assert pool.stats().resize_failed >= 1
    pool.close()


def test_pool_shrinks_to_pipe_max_size_when_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    limit = 256 * 1024
    real_fcntl = fcntl.fcntl
    refused: list[int] = []

    def capped_setpipe(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == copy_mod._F_SETPIPE_SZ and arg > limit:
            refused.append(arg)
            raise PermissionError(errno.EPERM, "above pipe-max-size")
        return real_fcntl(fd, cmd, arg)

    max_size = tmp_path / "pipe-max-size"
    max_size.write_text(f"{limit}\n")
    monkeypatch.setattr(copy_mod, "_PIPE_MAX_SIZE_PATH", str(max_size))
    monkeypatch.setattr(fcntl, "fcntl", capped_setpipe)
    pool = PipePool(pipe_size=1 << 20)
    a, b = pool.get(), pool.get()
    try:
        for _r, w, _size in (a, b):
            assert real_fcntl(w, _F_GETPIPE_SZ) == limit  # not the 64 KiB default
        assert refused == [1 << 20]  # asked once; the second pipe used the limit directly
        assert pool.pipe_size == limit
        st = pool.stats()
        assert (st.size, st.resize_failed, st.created) == (limit, 0, 2)
    finally:
        pool.discard(a)
        pool.discard(b)
        pool.close()


def test_pool_keeps_its_size_when_refused_below_pipe_max_size(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_fcntl = fcntl.fcntl

    def deny_setpipe(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == copy_mod._F_SETPIPE_SZ:
            raise PermissionError(errno.EPERM, "pipe-user-pages-soft")
        return real_fcntl(fd, cmd, arg)

    max_size = tmp_path / "pipe-max-size"
    max_size.write_text("1048576\n")
    monkeypatch.setattr(copy_mod, "_PIPE_MAX_SIZE_PATH", str(max_size))
    monkeypatch.setattr(fcntl, "fcntl", deny_setpipe)
    pool = PipePool(pipe_size=1 << 20)
    pipe = pool.get()
    pool.put(pipe)
    st = pool.stats()
    assert (st.size, st.resize_failed) == (1 << 20, 1)  # a later pipe may still get the full size
    pool.close()


@pytest.mark.both_loops
async def test_pipe_creation_failure_falls_back_to_buffered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_fds(flags: int) -> tuple[int, int]:
        raise OSError(errno.EMFILE, "Too many open files")

    pool = PipePool()
    leg = make_leg()
    try:
        monkeypatch.setattr(os, "pipe2", no_fds)
        task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        results = await asyncio.gather(
            in_thread(lambda: send_all_then_fin(leg.client, 8, 8 * MiB)),
            in_thread(lambda: recv_to_eof(leg.server)),
            in_thread(lambda: send_all_then_fin(leg.server, 9, 3 * MiB)),
            in_thread(lambda: recv_to_eof(leg.client)),
        )
        res = await asyncio.wait_for(task, 5)
    finally:
        monkeypatch.undo()
        leg.close_ends()
    c_sent, s_got, s_sent, c_got = results
    assert s_got == (8 * MiB, c_sent) and c_got == (3 * MiB, s_sent)
    assert res == CopyResult(8 * MiB, 3 * MiB)
    st = pool.stats()
    assert st.create_failed == 2 and st.created == 0 and st.in_use == 0
    pool.close()


@pytest.mark.both_loops
async def test_closed_socket_is_rejected_and_other_closed() -> None:
    leg = make_leg()
    leg.up.close()
    try:
        with pytest.raises((ValueError, OSError)):
            await copy_bidirectional(leg.down, leg.up, pipes=None)
        assert leg.down.fileno() == -1
    finally:
        leg.close_ends()


def test_pipe_pool_bounds_what_is_out_by_its_budget() -> None:
    """A pipe whose destination stops reading stays out: what is out (pipe capacities and large
    buffers) stays within the budget; a bulk direction gets a small pipe when a large one does
    not fit, and nothing when a small one does not either."""
    small, large = 64 << 10, 1 << 20
    pool = PipePool(pipe_size=large, small_size=small, budget=large + small)
    a = pool.get(bulk=True)
    assert a[2] == large and pool.stats().held == large
    b = pool.get(bulk=True)  # a large one no longer fits: small
    assert b[2] == small and pool.stats().held == large + small
    with pytest.raises(BlockingIOError):
        pool.get(bulk=False)
    assert not pool.reserve(1)
    assert pool.stats().limited == 2 and pool.stats().in_use == 2
    pool.discard(a)
    assert pool.reserve(256 << 10) and pool.stats().held == small + (256 << 10)
    pool.release(256 << 10)
    c = pool.get(bulk=False)
    assert c[2] == small and pool.stats().small_in_use == 2
    for p in (b, c):
        pool.put(p)
    assert pool.stats().held == 0 and pool.stats().idle == 2
    assert pool.get(bulk=False) in (b, c)  # reused by size
    pool.close()


def test_small_pipes_keep_the_default_capacity() -> None:
    """A small pipe is the kernel's default (no F_SETPIPE_SZ); a large one is resized."""
    pool = PipePool()
    small, large = pool.get(bulk=False), pool.get(bulk=True)
    try:
        assert fcntl.fcntl(small[1], _F_GETPIPE_SZ) == small[2] == 64 << 10
        assert fcntl.fcntl(large[1], _F_GETPIPE_SZ) == large[2] == 1 << 20
    finally:
        pool.discard(small)
        pool.discard(large)
        pool.close()


@pytest.mark.both_loops
async def test_a_flow_gets_a_large_pipe_once_it_moves_bulk() -> None:
    """Request/response traffic only ever takes small pipes; a bulk flow fills a small one and
    gets a large one from then on."""
    pool = PipePool()
    leg = make_leg()
    try:
        task = asyncio.create_task(copy_bidirectional(leg.down, leg.up, pipes=pool))
        for _ in range(20):
            leg.client.sendall(b"x" * 1000)
            assert await in_thread(lambda: leg.server.recv(1000)) == b"x" * 1000
        assert pool.stats().created == 1  # one small pipe, reused
        sent, (got, digest) = await asyncio.gather(
            in_thread(lambda: send_all_then_fin(leg.client, 4, 32 * MiB)),
            in_thread(lambda: recv_to_eof(leg.server)),
        )
        assert (got, digest) == (32 * MiB, sent)
        leg.server.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(task, 10)
    finally:
        leg.close_ends()
    st = pool.stats()
    assert st.created == 2 and st.idle == 2 and st.held == 0  # one small, one large
    pool.close()


@pytest.mark.both_loops
async def test_stuck_destinations_do_not_pin_more_than_the_budget() -> None:
    """Connections whose destination never reads: each holds its pipe (with data) until then;
    past the budget the next ones copy with buffers instead, and every byte still arrives."""
    pool = PipePool(budget=64 << 10)  # one small pipe
    legs = [make_leg(), make_leg()]
    tasks = [asyncio.create_task(copy_bidirectional(g.down, g.up, pipes=pool)) for g in legs]
    try:
        senders = [
            asyncio.ensure_future(in_thread(lambda g=g: send_all_then_fin(g.client, 3, 6 * MiB)))
            for g in legs
        ]
        await asyncio.sleep(0.5)  # nobody reads the servers: the legs pin their pipes
        assert pool.stats().held <= 64 << 10 and pool.stats().in_use <= 1
        assert pool.stats().limited >= 1
        readers = [
            asyncio.ensure_future(in_thread(lambda g=g: recv_to_eof(g.server))) for g in legs
        ]
        sent = await asyncio.gather(*senders)
        got = await asyncio.gather(*readers)
        for g in legs:
            g.server.shutdown(socket.SHUT_WR)
        await asyncio.gather(*(in_thread(lambda g=g: recv_to_eof(g.client)) for g in legs))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        for g in legs:
            g.close_ends()
    assert [x[0] for x in got] == [6 * MiB, 6 * MiB]
    assert [x[1] for x in got] == list(sent)
    assert all(r.down_to_up == 6 * MiB for r in results)
    assert pool.stats().in_use == 0 and pool.stats().held == 0
    pool.close()
