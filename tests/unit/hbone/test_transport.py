"""HboneConnection + StreamBridge in one process: mTLS over loopback TCP, streams bridged to
loopback sockets. Integrity, request/response, half-close both ways, resets, TLS record framing
across reads, connection loss."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import socket
import ssl
import struct
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone import transport
from ztunnel.hbone.budget import BufferBudget
from ztunnel.hbone.transport import (
    ConnectionLost,
    HboneConnection,
    StreamBridge,
    _BridgeDone,
    release_scratch,
    tls_handshake,
)
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.tls import client_context, server_context

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20


@pytest.fixture(scope="module")
def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = LocalCA.ephemeral()
    server = ca.issue(Identity("cluster.local", "default", "server"))
    client = ca.issue(Identity("cluster.local", "default", "client"))
    return client_context(client), server_context(server)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected non-blocking loopback TCP sockets (connector, acceptor)."""
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


@dataclass
class Tunnel:
    """app <-> [client bridge] <-> HBONE <-> [server bridge] <-> upstream."""

    app: socket.socket
    upstream: socket.socket
    client_bridge: asyncio.Future[StreamBridge]
    server_bridge: asyncio.Future[StreamBridge]


@dataclass
class Pair:
    client: HboneConnection
    server: HboneConnection
    raw_client: socket.socket
    raw_server: socket.socket
    pending: list[asyncio.Future[tuple[int, socket.socket]]] = field(default_factory=list)
    tasks: set[asyncio.Future[StreamBridge]] = field(default_factory=set)

    async def tunnel(self) -> Tunnel:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[tuple[int, socket.socket]] = loop.create_future()
        self.pending.append(accepted)
        app, proxy_in = tcp_pair()
        sid, resp = await self.client.open_stream("10.0.0.2:8080", [("forwarded", "for=x")])
        assert resp.status == 200
        client_bridge = asyncio.ensure_future(self.client.bridge(sid, proxy_in))
        _, upstream = await accepted
        server_bridge = self._server_bridges.pop(sid)
        return Tunnel(app, upstream, client_bridge, server_bridge)

    _server_bridges: dict[int, asyncio.Future[StreamBridge]] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def hbone_pair(
    contexts: tuple[ssl.SSLContext, ssl.SSLContext],
    client_h2: dict[str, int] | None = None,
    server_h2: dict[str, int] | None = None,
) -> AsyncIterator[Pair]:
    tc, ts = tcp_pair()
    (cs, ci, co, _), (ss, si, so, _) = await asyncio.gather(
        tls_handshake(tc, contexts[0], server_side=False),
        tls_handshake(ts, contexts[1], server_side=True),
    )
    pair: Pair

    def on_request(conn: HboneConnection, ev: h2.RequestReceived) -> None:
        assert ev.method == "CONNECT" and ev.authority == "10.0.0.2:8080"
        assert ("forwarded", "for=x") in ev.headers
        proxy_out, upstream = tcp_pair()
        conn.respond(ev.stream_id, 200, [], end_stream=False)
        task = asyncio.ensure_future(conn.bridge(ev.stream_id, proxy_out))
        pair._server_bridges[ev.stream_id] = task
        pair.pending.pop(0).set_result((ev.stream_id, upstream))

    server = HboneConnection(
        ts,
        ss,
        si,
        so,
        h2.H2Connection(False, **(server_h2 or {})),
        on_request=on_request,
        keepalive=False,
    )
    client = HboneConnection(
        tc, cs, ci, co, h2.H2Connection(True, **(client_h2 or {})), keepalive=False
    )
    pair = Pair(client, server, tc, ts)
    try:
        yield pair
    finally:
        client.close()
        server.close()


async def recv_exact(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        d = await loop.sock_recv(sock, n - len(buf))
        if not d:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += d
    return bytes(buf)


async def recv_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while d := await loop.sock_recv(sock, 1 << 16):
        buf += d
    return bytes(buf)


def payload(n: int, seed: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d:%d" % (seed, i)).digest()
        i += 1
    return bytes(out[:n])


@pytest.mark.both_loops
async def test_request_response_many_small_messages(contexts) -> None:
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        for i in range(300):
            msg = payload(1024 + i, i)
            t.app.send(msg)
            got = await recv_exact(t.upstream, len(msg))
            assert got == msg
            t.upstream.send(got[::-1])
            assert await recv_exact(t.app, len(msg)) == msg[::-1]
        t.app.shutdown(socket.SHUT_WR)
        assert await recv_all(t.upstream) == b""
        t.upstream.shutdown(socket.SHUT_WR)
        assert await recv_all(t.app) == b""
        cb, sb = await t.client_bridge, await t.server_bridge
        assert cb.error is None and sb.error is None
        total = sum(1024 + i for i in range(300))
        assert cb.tcp_to_h2 == cb.h2_to_tcp == sb.tcp_to_h2 == sb.h2_to_tcp == total
        t.app.close()
        t.upstream.close()
        # The connection carries on after the stream.
        assert not p.client.closed.done() and p.client.active_streams == 0


@pytest.mark.both_loops
async def test_a_busy_peer_gets_one_read_turn_per_loop_iteration(contexts) -> None:
    """A socket that stays readable (a peer sending 1-byte DATA frames faster than they are
    parsed) is read one turn per iteration of the loop, a frame-dense one 4 KiB of plaintext per
    turn: at most one continuation is queued per reader. Before, each iteration of a socket that
    stayed readable queued one more, and the loop soon ran dozens of that peer's turns per
    iteration (tens of ms for everyone else)."""
    loop = asyncio.get_running_loop()
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        (sid,) = p.client._bridges
        one = struct.pack(">IBI", 1 << 8 | h2.DATA, 0, sid) + b"x"
        p.client.send_frames(memoryview(one * 100_000))  # (wire-ready frames, 1 MB)
        turns = 0
        read = p.server._read_and_dispatch

        def counted() -> bool:
            nonlocal turns
            turns += 1
            return read()

        p.server._read_and_dispatch = counted  # type: ignore[method-assign]
        per_iteration: list[int] = []
        done = loop.create_future()

        def tick(seen: int) -> None:
            per_iteration.append(turns - seen)
            if len(per_iteration) < 100:
                loop.call_soon(tick, turns)
            else:
                done.set_result(None)

        await asyncio.sleep(0.05)  # (the frames are in the server's socket)
        loop.call_soon(tick, turns)
        await done
        assert sum(per_iteration) >= 50  # the peer was served all along ...
        assert max(per_iteration) <= 2, per_iteration  # ... a turn per iteration, not more
        assert p.server.h2.frames_received >= 50 * 400
        t.app.close()
        t.upstream.close()


@pytest.mark.both_loops
async def test_early_data_past_the_budget_stops_the_reads_until_it_drains(contexts) -> None:
    """DATA for a stream not bridged yet (its upstream connect pending) is copied and held,
    against the process's budget: past it, the connection holding it is not read (TCP
    back-pressure: 1 MiB sent, far less held); once the stream is bridged the bytes are
    written out, released, and reading resumes; in the end nothing is held."""
    budget = BufferBudget(64 << 10)
    tc, ts = tcp_pair()
    (cs, ci, co, _), (ss, si, so, _) = await asyncio.gather(
        tls_handshake(tc, contexts[0], server_side=False),
        tls_handshake(ts, contexts[1], server_side=True),
    )
    requests: list[int] = []
    server = HboneConnection(
        ts,
        ss,
        si,
        so,
        h2.H2Connection(False),
        on_request=lambda conn, ev: requests.append(ev.stream_id),
        keepalive=False,
        budget=budget,
    )
    client = HboneConnection(tc, cs, ci, co, h2.H2Connection(True), keepalive=False)
    try:
        sid = client.h2.open_stream("10.0.0.2:8080")
        client.flush()
        data = payload(1 * MiB, 7)
        frames = b"".join(
            struct.pack(">IBI", (16 << 10) << 8 | h2.DATA, 0, sid) + data[k : k + (16 << 10)]
            for k in range(0, len(data), 16 << 10)
        )
        client.send_frames(memoryview(frames))
        for _ in range(200):
            if server._paused & transport._PAUSE_BUDGET:
                break
            await asyncio.sleep(0.01)
        assert server._paused & transport._PAUSE_BUDGET and requests == [sid]
        assert budget.limit <= budget.used < 512 << 10  # (a read past the limit, not 1 MiB)
        assert budget.waits == 1 and server._holder.held == budget.used
        # The upstream connect completes: the stream is answered and bridged.
        proxy_out, upstream = tcp_pair()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        proxy_out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        server.respond(sid, 200, [], end_stream=False)
        bridged = asyncio.ensure_future(server.bridge(sid, proxy_out))
        assert await recv_exact(upstream, len(data)) == data
        assert budget.used == 0 and budget.holders == 0 and not server._paused
        # Held again (the upstream stops reading), then the connection goes: nothing stays.
        client.send_frames(memoryview(frames))
        for _ in range(200):
            if budget.used:
                break
            await asyncio.sleep(0.01)
        assert budget.used and server._holder.held == budget.used
        server.close()
        assert (await bridged).error is not None
        assert budget.used == 0 and budget.holders == 0 and budget.waiting == 0
        upstream.close()
    finally:
        client.close()
        server.close()


@pytest.mark.both_loops
async def test_bulk_both_ways_crosses_records_and_reads(contexts) -> None:
    """Several MiB each way at once: TLS records split across socket reads, many records per
    read, DATA frames across decrypt buffers, flow control (4 MiB stream window)."""
    loop = asyncio.get_running_loop()
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        up_data, down_data = payload(9 * MiB + 123, 1), payload(7 * MiB + 7, 2)

        async def send(sock: socket.socket, data: bytes) -> None:
            await loop.sock_sendall(sock, data)
            sock.shutdown(socket.SHUT_WR)

        results = await asyncio.gather(
            send(t.app, up_data),
            send(t.upstream, down_data),
            recv_all(t.upstream),
            recv_all(t.app),
        )
        assert results[2] == up_data
        assert results[3] == down_data
        cb, sb = await t.client_bridge, await t.server_bridge
        assert cb.error is None and sb.error is None
        t.app.close()
        t.upstream.close()


@pytest.mark.both_loops
async def test_small_frames_and_windows_both_ways(contexts) -> None:
    """TCP reads framed in place with odd frame sizes (and a slot limit below the read size) and
    reads cut short by small windows: every byte arrives, in order, within the windows."""
    loop = asyncio.get_running_loop()
    small = {"send_frame_size": 1000, "initial_window_size": 70_001}
    async with hbone_pair(contexts, small, {**small, "send_frame_size": 16_385}) as p:
        t = await p.tunnel()
        up_data, down_data = payload(3 * MiB + 17, 3), payload(2 * MiB + 5, 4)

        async def send(sock: socket.socket, data: bytes) -> None:
            await loop.sock_sendall(sock, data)
            sock.shutdown(socket.SHUT_WR)

        results = await asyncio.gather(
            send(t.app, up_data),
            send(t.upstream, down_data),
            recv_all(t.upstream),
            recv_all(t.app),
        )
        assert results[2] == up_data
        assert results[3] == down_data
        cb, sb = await t.client_bridge, await t.server_bridge
        assert cb.error is None and sb.error is None
        assert cb.tcp_to_h2 == sb.h2_to_tcp == len(up_data)
        assert sb.tcp_to_h2 == cb.h2_to_tcp == len(down_data)
        t.app.close()
        t.upstream.close()


@pytest.mark.both_loops
async def test_batched_data_to_a_slow_reader(contexts) -> None:
    """Many DATA frames per decrypted batch go out in one sendmsg; what a full socket does not
    take is copied, written later in order, and only then acknowledged (the sender waits)."""
    loop = asyncio.get_running_loop()
    small = {"send_frame_size": 4096, "initial_window_size": 1 * MiB}
    async with hbone_pair(contexts, small, small) as p:
        t = await p.tunnel()
        t.upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        data = payload(8 * MiB + 11, 5)

        async def send() -> None:
            await loop.sock_sendall(t.app, data)
            t.app.shutdown(socket.SHUT_WR)

        sender = loop.create_task(send())
        await asyncio.sleep(0.2)  # the upstream reads nothing yet: the stream window fills up
        assert p.server._bridges[1]._pending  # (the first stream) copied, not yet written
        assert await recv_all(t.upstream) == data
        await sender
        t.upstream.shutdown(socket.SHUT_WR)
        assert await recv_all(t.app) == b""
        cb, sb = await t.client_bridge, await t.server_bridge
        assert cb.error is None and sb.error is None
        assert sb.h2_to_tcp == len(data)
        t.app.close()
        t.upstream.close()


@pytest.mark.both_loops
async def test_concurrent_streams_bulk_on_one_connection(contexts) -> None:
    """Several streams sending at once share TLS writes (records of several streams in one send);
    each stream's bytes arrive whole and in order, both ways, and the connection stays up."""
    loop = asyncio.get_running_loop()
    async with hbone_pair(contexts) as p:
        tunnels = [await p.tunnel() for _ in range(4)]

        async def send(sock: socket.socket, data: bytes) -> None:
            await loop.sock_sendall(sock, data)
            sock.shutdown(socket.SHUT_WR)

        ups = [payload(2 * MiB + i, 10 + i) for i in range(4)]
        downs = [payload(MiB + 3 * i, 20 + i) for i in range(4)]
        jobs = []
        for t, up, down in zip(tunnels, ups, downs, strict=True):
            jobs += [send(t.app, up), send(t.upstream, down), recv_all(t.upstream), recv_all(t.app)]
        results = await asyncio.gather(*jobs)
        for i in range(4):
            assert results[4 * i + 2] == ups[i]
            assert results[4 * i + 3] == downs[i]
        for t in tunnels:
            cb, sb = await t.client_bridge, await t.server_bridge
            assert cb.error is None and sb.error is None
            t.app.close()
            t.upstream.close()
        assert not p.client.closed.done() and p.client.active_streams == 0


@pytest.mark.both_loops
async def test_connections_share_read_buffers_without_mixing_data(contexts) -> None:
    """Three HBONE connections, bulk both ways on each at once: their reads interleave on the
    thread's one pair of read/decrypt buffers, and no byte crosses between them."""
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        pairs = [await stack.enter_async_context(hbone_pair(contexts)) for _ in range(3)]
        tunnels = [await p.tunnel() for p in pairs]

        async def send(sock: socket.socket, data: bytes) -> None:
            await loop.sock_sendall(sock, data)
            sock.shutdown(socket.SHUT_WR)

        sent, jobs = [], []
        for i, t in enumerate(tunnels):
            up, down = payload(3 * MiB + i, 10 + i), payload(2 * MiB + 17 * i, 20 + i)
            sent += [up, down]
            jobs += [send(t.app, up), send(t.upstream, down), recv_all(t.upstream), recv_all(t.app)]
        got = await asyncio.gather(*jobs)
        for i, t in enumerate(tunnels):
            assert got[4 * i + 2] == sent[2 * i], f"tunnel {i} upstream"
            assert got[4 * i + 3] == sent[2 * i + 1], f"tunnel {i} downstream"
            assert (await t.client_bridge).error is None
            assert (await t.server_bridge).error is None
            t.app.close()
            t.upstream.close()


async def test_a_connection_owns_no_bulk_buffers(contexts) -> None:
    """Idle pooled connections are cheap: the 768 KiB of read buffers are per thread."""
    tracemalloc.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(hbone_pair(contexts))  # the thread's buffers exist
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(4):
                await stack.enter_async_context(hbone_pair(contexts))
            per_pair = (tracemalloc.get_traced_memory()[0] - before) / 4
    finally:
        tracemalloc.stop()
    assert per_pair < 128 * 1024, f"{per_pair / 1024:.0f} KiB per connection pair"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_scratch_release_gives_the_pages_back() -> None:
    s = transport._Scratch()
    s.recv_view[:] = b"\x01" * len(s.recv_view)
    s.plain_view[:] = b"\x02" * len(s.plain_view)
    s.tx(16384)
    touched = _rss_kib()
    s.release()
    # 768 KiB of read/decrypt buffers (less whatever else the process did meanwhile)
    assert touched - _rss_kib() > 600, (touched, _rss_kib())
    assert s.recv_view[:64] == bytes(64) and s.plain_view[-64:] == bytes(64)
    assert not s._tx


def test_scratch_is_private_to_each_forked_worker() -> None:
    """Workers are forked after the imports: a worker's writes to its scratch buffers must not
    reach another process's (MAP_PRIVATE, not mmap's default MAP_SHARED)."""
    s = transport._Scratch()
    s.recv_view[:4] = b"mine"
    pid = os.fork()
    if pid == 0:  # the child: scribble, then leave without running any cleanup
        s.recv_view[:4] = b"kid!"
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert bytes(s.recv_view[:4]) == b"mine"


@pytest.mark.both_loops
async def test_streams_carry_on_after_the_scratch_is_released(contexts) -> None:
    """What the idle trimmer does between callbacks: the next reads fault zero pages in."""
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        for i in range(6):
            msg = payload(100_000 + i, i)
            t.app.send(msg)
            got = await recv_exact(t.upstream, len(msg))
            assert got == msg
            t.upstream.send(got[::-1])
            assert await recv_exact(t.app, len(msg)) == msg[::-1]
            release_scratch()
        t.app.close()
        t.upstream.close()


@pytest.mark.both_loops
async def test_half_close_each_way(contexts) -> None:
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        # client FIN first: the server side keeps sending afterwards
        t.app.send(b"request")
        t.app.shutdown(socket.SHUT_WR)
        assert await recv_all(t.upstream) == b"request"
        for _ in range(3):
            t.upstream.send(b"late reply ")
        await asyncio.sleep(0.05)
        t.upstream.shutdown(socket.SHUT_WR)
        assert await recv_all(t.app) == b"late reply " * 3
        assert (await t.client_bridge).error is None
        assert (await t.server_bridge).error is None
        t.app.close()
        t.upstream.close()

        # server FIN first
        t = await p.tunnel()
        t.upstream.send(b"banner")
        t.upstream.shutdown(socket.SHUT_WR)
        assert await recv_all(t.app) == b"banner"
        t.app.send(b"after the server's FIN")
        t.app.shutdown(socket.SHUT_WR)
        assert await recv_all(t.upstream) == b"after the server's FIN"
        assert (await t.client_bridge).error is None
        assert (await t.server_bridge).error is None
        t.app.close()
        t.upstream.close()


def hard_close(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.both_loops
async def test_upstream_reset_after_data(contexts) -> None:
    """Data then RST from the upstream app: the data is delivered and the reset is not lost (the
    reader sees EPOLLERR with data queued: it must consume the error too, not just the data).
    The stream is reset with CANCEL, which HBONE treats as a clean end towards the app."""
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        t.app.send(b"ping")
        assert await recv_exact(t.upstream, 4) == b"ping"
        t.upstream.send(b"partial answer")
        hard_close(t.upstream)
        assert await recv_all(t.app) == b"partial answer"
        sb = await t.server_bridge
        assert isinstance(sb.error, ConnectionResetError)
        assert sb.tcp_to_h2 == len(b"partial answer")
        cb = await t.client_bridge
        assert cb.error is None and cb.h2_to_tcp == len(b"partial answer")
        t.app.close()
        assert not p.client.closed.done()


@pytest.mark.both_loops
async def test_app_reset_ends_the_stream(contexts) -> None:
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        t.app.send(b"hello")
        assert await recv_exact(t.upstream, 5) == b"hello"
        hard_close(t.app)
        assert await recv_all(t.upstream) == b""  # CANCEL: a clean end on the far side
        assert isinstance((await t.client_bridge).error, ConnectionResetError)
        assert (await t.server_bridge).error is None
        t.upstream.close()


@pytest.mark.both_loops
async def test_connection_loss_fails_every_stream(contexts) -> None:
    loop = asyncio.get_running_loop()
    async with hbone_pair(contexts) as p:
        tunnels = [await p.tunnel() for _ in range(3)]
        for t in tunnels:
            t.app.send(b"x")
            assert await recv_exact(t.upstream, 1) == b"x"
        hard_close(p.raw_server)  # the tunnel's TCP connection dies under the server
        for t in tunnels:
            cb = await t.client_bridge
            assert isinstance(cb.error, ConnectionLost)
            with contextlib.suppress(ConnectionResetError):
                assert await loop.sock_recv(t.app, 10) == b""
            t.app.close()
            t.upstream.close()
        assert isinstance(await p.client.closed, OSError)


@pytest.mark.both_loops
async def test_cancelling_a_bridge_resets_its_stream_only(contexts) -> None:
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()
        other = await p.tunnel()
        t.app.send(b"x")
        assert await recv_exact(t.upstream, 1) == b"x"
        t.client_bridge.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t.client_bridge
        assert await recv_all(t.upstream) == b""  # CANCEL: a clean end on the far side
        assert (await t.server_bridge).error is None
        with pytest.raises(ConnectionResetError):  # our end of the app socket was aborted
            while await asyncio.get_running_loop().sock_recv(t.app, 10):
                pass
        # the other stream and the connection are unaffected
        other.app.send(b"still here")
        assert await recv_exact(other.upstream, 10) == b"still here"
        assert p.client.active_streams == 1
        for s in (t.app, t.upstream, other.app, other.upstream):
            s.close()


@pytest.mark.both_loops
async def test_finished_bridges_are_freed_by_refcounting(contexts) -> None:
    """No reference cycle per connection (issue 18): with the cyclic GC off, the bridges and
    their futures of finished tunnels are gone once the caller drops them."""

    def alive() -> int:
        return sum(1 for o in gc.get_objects() if type(o) in (StreamBridge, _BridgeDone))

    gc.collect()
    gc.disable()
    try:
        async with hbone_pair(contexts) as p:
            for _ in range(5):
                t = await p.tunnel()
                t.app.send(b"x")
                assert await recv_exact(t.upstream, 1) == b"x"
                t.app.shutdown(socket.SHUT_WR)
                assert await recv_all(t.upstream) == b""
                t.upstream.shutdown(socket.SHUT_WR)
                assert await recv_all(t.app) == b""
                assert (await t.client_bridge).error is None
                assert (await t.server_bridge).error is None
                t.app.close()
                t.upstream.close()
                del t
            await asyncio.sleep(0.05)
            assert alive() == 0
    finally:
        gc.enable()


async def test_closed_connections_are_freed_by_refcounting(contexts) -> None:
    """The server's request callback closes over the pair here (as the inbound handler's does
    over its connection): once closed, no connection is left for the cyclic GC (issue 18)."""
    gc.collect()
    gc.disable()
    try:
        async with hbone_pair(contexts) as p:
            t = await p.tunnel()
            t.app.send(b"x")
            assert await recv_exact(t.upstream, 1) == b"x"
            t.app.close()
            t.upstream.close()
            del t
        del p
        await asyncio.sleep(0.1)
        assert sum(1 for o in gc.get_objects() if type(o) is HboneConnection) == 0
    finally:
        gc.enable()


@pytest.mark.both_loops
async def test_cancelling_the_task_awaiting_a_bridge_aborts_it(contexts) -> None:
    """The proxy's way (drain, policy re-check): the handler task awaiting the bridge is
    cancelled; the bridge is aborted and leaves no reference cycle behind."""
    async with hbone_pair(contexts) as p:
        t = await p.tunnel()

        async def handler() -> StreamBridge:
            return await t.client_bridge

        task = asyncio.create_task(handler())
        t.app.send(b"x")
        assert await recv_exact(t.upstream, 1) == b"x"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.client_bridge.cancelled()
        assert await recv_all(t.upstream) == b""  # the far side sees the stream end
        assert (await t.server_bridge).error is None
        assert p.client.active_streams == 0
        assert t.client_bridge.bridge is None  # type: ignore[attr-defined]
        t.app.close()
        t.upstream.close()


# --- hostile peers (issue 13) -------------------------------------------------------------


def _raw_frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, sid) + payload


@pytest.mark.both_loops
@pytest.mark.parametrize("bridged", [False, True], ids=["no-stream", "stream-bridged"])
async def test_connection_error_sends_goaway_then_closes(contexts, bridged: bool) -> None:
    """Attacks 7 and 8: a connection-level error from the peer, with or without a bridged
    stream, reaches the peer as a GOAWAY with the error code before the close, and no internal
    error (the loop's exception handler would fail this test) happens on the way."""
    async with hbone_pair(contexts) as p:
        if bridged:
            t = await p.tunnel()
            t.app.send(b"hello")
            assert await recv_exact(t.upstream, 5) == b"hello"
        goaways: list[h2.GoAwayReceived] = []
        dispatch = p.client._dispatch

        def spy(events: list[h2.Event]) -> None:
            goaways.extend(e for e in events if isinstance(e, h2.GoAwayReceived))
            dispatch(events)

        p.client._dispatch = spy  # type: ignore[method-assign]
        # A WINDOW_UPDATE of 0 on the connection: PROTOCOL_ERROR (RFC 9113 6.9).
        p.client._tls_write(_raw_frame(h2.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"))
        p.client._push()
        await asyncio.wait_for(asyncio.shield(p.server.closed), 5)
        assert p.server.protocol_error is not None
        await asyncio.wait_for(asyncio.shield(p.client.closed), 5)
        assert [g.error_code for g in goaways] == [h2.ErrorCode.PROTOCOL_ERROR]
        if bridged:  # the app's connection was closed (reset: the stream failed)
            with contextlib.suppress(ConnectionResetError):
                assert await recv_all(t.upstream) == b""
            t.app.close()
            t.upstream.close()


@pytest.mark.both_loops
async def test_input_pauses_while_the_peer_does_not_read(contexts) -> None:
    """A peer that sends PINGs and never reads: once our unsent output passes the high-water
    mark we stop reading from it (replies cannot pile up), and resume once it drains."""
    calm = {"limits": h2.FloodLimits(control_frames=10**9)}  # (the client gets 1000s of ACKs)
    async with hbone_pair(contexts, client_h2=calm, server_h2=calm) as p:  # type: ignore[arg-type]
        p.client.loop.remove_reader(p.client.fd)  # the client stops reading
        p.raw_server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ping = _raw_frame(h2.PING, 0, 0, b"12345678") * 4096
        for _ in range(400):
            if p.server._paused & transport._PAUSE_BACKLOG:
                break
            p.client._tls_write(ping)
            p.client._push()
            await asyncio.sleep(0.01)
        assert p.server._paused & transport._PAUSE_BACKLOG
        assert p.server._out_size < 4 * MiB  # bounded: not 1:1 with what the client sent
        pauses = [0]
        pause = p.server._pause

        def counting_pause(why: int) -> None:
            pauses[0] += 1
            pause(why)

        p.server._pause = counting_pause  # type: ignore[method-assign]
        p.client.loop.add_reader(p.client.fd, p.client._on_readable)
        # Resumed once the client reads (it may pause again on the pings still queued).
        for _ in range(500):
            if not p.server._paused & transport._PAUSE_BACKLOG or pauses[0]:
                break
            await asyncio.sleep(0.01)
        assert not p.server._paused & transport._PAUSE_BACKLOG or pauses[0]


@pytest.mark.both_loops
async def test_alpn_without_h2_is_refused_with_an_alert(contexts) -> None:
    ca = LocalCA.ephemeral()
    cert = ca.issue(Identity("cluster.local", "default", "server"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    tc, ts = tcp_pair()
    from ztunnel.hbone.transport import AlpnRefused

    with pytest.raises(AlpnRefused, match=r"http/1\.1"):
        await asyncio.gather(
            tls_handshake(ts, server_context(cert), server_side=True, require_alpn=b"h2"),
            tls_handshake(tc, ctx, server_side=False),
        )
    tc.close()
    ts.close()
