"""An HBONE connection: TLS 1.3 over a raw non-blocking socket, driving the sans-IO H2Connection.

The lean TLS path: ``ssl.SSLObject`` with memory BIOs, fed from ``recv_into`` a reused 256 KiB
buffer and drained with ``add_reader``/``add_writer``, so there is no asyncio transport or
protocol layer between the socket, TLS and HTTP/2. Outgoing HTTP/2 buffers are joined before
``SSLObject.write`` so that TLS records are full (a 9-byte frame header on its own would cost a
record of its own), and plaintext is decrypted into one reused buffer that the HTTP/2 parser
slices without copying.

Each tunnelled TCP connection is one stream, bridged to its socket by ``StreamBridge``:
TCP bytes become DATA within the peer's flow-control windows, DATA is written to the socket and
acknowledged (releasing window) only once written, FIN maps to END_STREAM both ways, and a reset
with NO_ERROR or CANCEL is a clean end. The first connection-level error fails every stream.
What a connection holds in memory (DATA that arrived before its stream was bridged, or that the
socket did not take yet) counts against the process's ``budget.BufferBudget``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.budget import BufferBudget
from ztunnel.hbone.clienthello import (
    NO_APPLICATION_PROTOCOL_ALERT,
    NotClientHello,
    parse_client_hello,
)
from ztunnel.identity.osslverify import VerifiedChain, take_verified_chain
from ztunnel.identity.tls import peer_identity
from ztunnel.logs import RateLimitedLog
from ztunnel.net.copy import CopyCounters

log = logging.getLogger("ztunnel.hbone")
_rate_limited = RateLimitedLog(log)

_RECV_SIZE = 256 * 1024
# A peer pays for its frames, not only for its bytes: one whose frames are tiny (more than one
# frame per 64 bytes of plaintext: 1-byte DATA frames, say) makes each byte cost as much as a
# frame. Such a connection (and a new one, until its input shows large frames) is read this much
# at a time and parsed one slice of plaintext per turn of the loop, about 400 frames at most
# (what is left waits in TLS for the next turn), so it cannot hold the loop for long, however
# many such connections there are (fairness, not a limit: the frames are legal).
_SMALL_RECV = 16 * 1024
_SMALL_PLAIN = 4 * 1024
_PLAIN_SIZE = 512 * 1024
_TCP_READ = 256 * 1024  # the most a stream reads from its TCP socket at once


class _Scratch(threading.local):
    """The ciphertext read buffer and the plaintext decrypt buffer (and the TCP -> HTTP/2 framing
    buffer, _TxBuffer), one set per thread (that is, per event loop) shared by all of its HBONE
    connections.

    A connection uses them only within one synchronous read callback: ciphertext is copied into
    the TLS memory BIO at once, and plaintext is parsed and written to the streams' sockets before
    the callback returns; what must outlive it (early stream data, bytes a socket would not take)
    is copied. So sharing is as safe as reusing a per-connection buffer, and a pooled connection
    costs no 768 KiB of its own: with 100 streams per connection that was 7.7 KiB per idle
    tunnelled connection on each side.

    The read and decrypt buffers are anonymous maps, resident only once touched, and
    :meth:`release` (the idle trimmer, every few seconds) gives their pages back: a ztunnel that
    has carried no HBONE since holds none of them (memory at rest, issue 18). Under load that is a
    few hundred zero-filled page faults per trim interval.
    """

    def __init__(self) -> None:
        # Private (not mmap's default, shared): freed by MADV_DONTNEED, copied on write by a fork.
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.recv = mmap.mmap(-1, _RECV_SIZE, flags=private)
        self.recv_view = memoryview(self.recv)
        self._plain = mmap.mmap(-1, _PLAIN_SIZE, flags=private)
        self.plain_view = memoryview(self._plain)
        # TCP -> HTTP/2 framing buffers by DATA frame size (one in practice: 64 KiB).
        self._tx: dict[int, _TxBuffer] = {}

    def release(self) -> None:
        """Return the buffers' pages to the kernel (their contents never outlive a callback)."""
        for m in (self.recv, self._plain):
            m.madvise(mmap.MADV_DONTNEED)
        self._tx.clear()  # made again by the next send

    def tx(self, frame: int) -> _TxBuffer:
        t = self._tx.get(frame)
        if t is None:
            t = self._tx[frame] = _TxBuffer(frame)
        return t


class _TxBuffer:
    """TCP -> HTTP/2 in place: a read is scattered (``recvmsg_into``) into payload slots of
    ``frame`` bytes with a 9-byte gap before each, ``H2Connection.frame_data_in_place`` writes the
    frame headers into the gaps, and the frames go to TLS as they lie, encrypted before the read
    callback returns (so, like _Scratch, one per thread serves every connection)."""

    __slots__ = ("buf", "frame", "full", "read_size", "view")

    def __init__(self, frame: int) -> None:
        # At most 64 slots per read (the iovec count; only tiny test frame sizes hit it).
        self.read_size = min(_TCP_READ, 64 * frame)
        nframes = -(-self.read_size // frame)
        self.buf = bytearray(self.read_size + 9 * nframes)
        self.view = memoryview(self.buf)
        self.frame = frame
        self.full: list[memoryview] = []
        for k in range(nframes):
            pos = k * (frame + 9) + 9
            self.full.append(self.view[pos : pos + min(frame, self.read_size - k * frame)])

    def slots(self, want: int) -> list[memoryview]:
        """The payload slots for ``want`` (<= ``read_size``) bytes."""
        if want >= self.read_size:
            return self.full
        k, last = divmod(want, self.frame)
        if not last:
            return self.full[:k]
        return [*self.full[:k], self.full[k][:last]]


_scratch = _Scratch()


def _no_resume() -> None:
    pass


def release_scratch() -> None:
    """This thread's HBONE scratch buffers go back to the kernel until next used (call it between
    callbacks, on the event loop's thread: the idle trimmer does)."""
    _scratch.release()


_HIGH_WATER = 1 << 20  # pause every stream's TCP reads above this much unsent ciphertext
_PAUSE_BACKLOG = 1  # the peer leaves our replies unread (_CONTROL_BACKLOG)
_PAUSE_BUDGET = 2  # past the process's buffer budget, holding its share (budget.py)
_CONTROL_BACKLOG = 64 * 1024  # stop reading a peer that left this much of our replies unread
# Reads per readiness callback before yielding to other callbacks (call_soon continues: at most
# one continuation is queued per reader, and a readiness callback that finds one queued leaves
# the reading to it, so a busy socket gets one turn per loop iteration; before, every iteration
# of a socket that stayed readable queued one more, and a few busy peers made the loop run
# dozens of their turns per iteration: tens of ms for everyone else). Readers read until
# EAGAIN: after EPOLLERR (e.g. a peer's RST) uvloop runs a reader once and then drops it
# without telling us, so bytes or an error left unread would strand the connection for good.
# A short read (fewer bytes than asked for) drained the socket, so instead of a second recv that
# fails with EAGAIN (a syscall plus an OSError built with a locale-decoded strerror: most of the
# Python cost of a small message) the reader checks SO_ERROR, which is what EPOLLERR reports on a
# TCP socket; anything that arrives later raises a fresh level-triggered event.
_READ_BATCH = 16
_HANDSHAKE_TIMEOUT = 10.0
KEEPALIVE_INTERVAL = 10.0
KEEPALIVE_TIMEOUT = 20.0


class HboneError(Exception):
    """The HBONE connection or stream failed."""


class ConnectionLost(HboneError):
    pass


class StreamRefused(HboneError):
    """The stream was not processed: the peer refused it (RST_STREAM REFUSED_STREAM, or it was
    above the last stream id of a GOAWAY), or it was never sent (the connection had closed or
    had no stream left). Safe to retry on another connection (RFC 9113 8.7)."""


class AlpnRefused(HboneError):
    """The client offered ALPN without ``h2`` (refused with no_application_protocol, as rustls)."""


def _socket_error(sock: socket.socket) -> OSError | None:
    """The socket's pending error (as recv would raise it), consuming it; None if there is none
    (or if the socket was closed meanwhile: whoever closed it has already handled its end)."""
    try:
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:  # (EBADF: closed by a teardown during this callback)
        return None
    return OSError(err, os.strerror(err)) if err else None  # OSError picks the errno subclass


async def tls_handshake(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    server_side: bool,
    timeout: float = _HANDSHAKE_TIMEOUT,
    require_alpn: bytes | None = None,
) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO, VerifiedChain]:
    """Run a TLS handshake on a connected non-blocking socket. No SNI is sent (reference 2.1).
    Also returns the peer's verified chain above its leaf as the in-handshake callback saw it
    (``osslverify``; empty without one), for re-checks after a CRL reload.

    ``require_alpn`` (server side): a client whose ClientHello offers ALPN without it is refused
    with a no_application_protocol alert (:class:`AlpnRefused`); one offering no ALPN is not."""
    inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
    sslobj = ctx.wrap_bio(inbio, outbio, server_side=server_side, server_hostname=None)
    try:
        await _handshake(sock, sslobj, inbio, outbio, server_side, timeout, require_alpn)
    finally:
        # Always taken (also when the handshake fails after verifying): nothing is left behind.
        chain = take_verified_chain(sslobj)
    return sslobj, inbio, outbio, chain


async def _handshake(
    sock: socket.socket,
    sslobj: ssl.SSLObject,
    inbio: ssl.MemoryBIO,
    outbio: ssl.MemoryBIO,
    server_side: bool,
    timeout: float,
    require_alpn: bytes | None,
) -> None:
    loop = asyncio.get_running_loop()
    hello: bytearray | None = bytearray() if server_side and require_alpn else None
    async with asyncio.timeout(timeout):
        while True:
            try:
                sslobj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLError:
                # Send the alert OpenSSL queued (unknown CA, expired certificate, ...) so that
                # the peer learns why, as rustls does, instead of seeing a bare EOF.
                if outbio.pending:
                    with contextlib.suppress(OSError):
                        sock.send(outbio.read())
                raise
            if outbio.pending:
                await loop.sock_sendall(sock, outbio.read())
            if done:
                return
            data = await loop.sock_recv(sock, 65536)
            if not data:
                raise ConnectionLost("peer closed the connection during the TLS handshake")
            if hello is not None:
                # Hold the first bytes back until the ClientHello is complete (see clienthello).
                hello += data
                try:
                    parsed = parse_client_hello(hello)
                except NotClientHello:
                    parsed = None  # OpenSSL rejects it its own way
                else:
                    if parsed is None:
                        continue
                    assert require_alpn is not None
                    if parsed.refuses(require_alpn):
                        with contextlib.suppress(OSError):
                            sock.send(NO_APPLICATION_PROTOCOL_ALERT)
                        offered = b",".join(parsed.alpn or ()).decode("latin-1")
                        raise AlpnRefused(f"client offered ALPN {offered!r} without h2")
                data, hello = bytes(hello), None
            inbio.write(data)


@dataclass(slots=True)
class _PendingWrite:
    data: memoryview
    flow: int  # flow-controlled bytes to acknowledge once written


class _BridgeDone(asyncio.Future["StreamBridge"]):
    """A bridge's completion. Cancelling it (the awaiting task was cancelled: drain, policy,
    deleted pod) aborts the bridge, as the coroutine that awaited it used to."""

    __slots__ = ("bridge",)

    def __init__(self, bridge: StreamBridge, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.bridge: StreamBridge | None = bridge

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        b, self.bridge = self.bridge, None
        if b is not None:
            b.abort(ConnectionLost("connection closed due to connection drain"))
        return True


class StreamBridge:
    """Copies one TCP socket <-> one HTTP/2 stream. Owns (and finally closes) the socket."""

    # One per tunnelled connection for its whole life: no __dict__ (memory per idle connection).
    __slots__ = (
        "_error",
        "_fin_sent",
        "_finished",
        "_h2_eof",
        "_more_soon",
        "_pending",
        "_reading",
        "_tcp_eof",
        "_writer_armed",
        "conn",
        "counters",
        "done",
        "fd",
        "h2_to_tcp",
        "sock",
        "stream_id",
        "tcp_to_h2",
    )

    def __init__(
        self,
        conn: HboneConnection,
        stream_id: int,
        sock: socket.socket,
        counters: CopyCounters | None,
    ) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.sock = sock
        self.fd = sock.fileno()
        self.counters = counters or CopyCounters()
        self.tcp_to_h2 = 0
        self.h2_to_tcp = 0
        self._reading = False
        self._tcp_eof = False  # the TCP side sent FIN (END_STREAM sent to the peer)
        self._h2_eof = False  # the peer sent END_STREAM
        self._fin_sent = False  # shutdown(SHUT_WR) done on the TCP side
        self._pending: list[_PendingWrite] = []
        self._writer_armed = False
        self._more_soon = False  # a call_soon continuation of the TCP reader is queued
        self._finished = False
        self._error: BaseException | None = None
        # Resolved with the bridge itself when it finishes (HboneConnection.bridge returns it);
        # cancelled by the task awaiting it being cancelled, which aborts the bridge. Dropped at
        # the finish, so the future (holding the bridge as its result) and the bridge never
        # form a cycle: a finished connection is freed by refcounting.
        self.done: _BridgeDone | None = _BridgeDone(self, conn.loop)

    @property
    def error(self) -> BaseException | None:
        """None while running or after a clean end; otherwise why the bridge failed."""
        return self._error

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._resume_reading()

    def _finish(self, error: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        self._error = error
        loop = self.conn.loop
        if self._reading:
            loop.remove_reader(self.fd)
            self._reading = False
        if self._writer_armed:
            loop.remove_writer(self.fd)
            self._writer_armed = False
        if error is not None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
        if self._pending:  # (aborted with bytes unwritten: they are dropped)
            self.conn._holder.release(sum(len(p.data) for p in self._pending))
            self._pending.clear()
        self.sock.close()
        self.conn._bridges.pop(self.stream_id, None)
        if self.conn.goaway:
            self.conn.loop.call_soon(self.conn.close_if_idle)
        done, self.done = self.done, None
        if done is not None:
            done.bridge = None
            if not done.done():  # (cancelled with the task awaiting it)
                done.set_result(self)

    def abort(self, error: BaseException) -> None:
        """Connection-level failure or cancellation: reset the stream, drop the socket."""
        if self._finished:
            return
        if self.conn.h2.stream_is_open(self.stream_id):
            with contextlib.suppress(h2.ProtocolError):
                self.conn.h2.reset_stream(self.stream_id, h2.ErrorCode.CANCEL)
                self.conn.flush()
        self._finish(error)

    def _check_done(self) -> None:
        if self._tcp_eof and self._h2_eof and self._fin_sent and not self._pending:
            self._finish(None)

    # --- TCP -> HTTP/2 ---------------------------------------------------------------------

    def _resume_reading(self) -> None:
        if not self._reading and not self._tcp_eof and not self._finished:
            self.conn.loop.add_reader(self.fd, self._on_tcp_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self.conn.loop.remove_reader(self.fd)
            self._reading = False

    def _on_tcp_readable(self) -> None:
        if not self._more_soon:  # (else the queued continuation reads, in its turn)
            self._read_tcp()

    def _on_more(self) -> None:
        self._more_soon = False
        self._read_tcp()

    def _read_tcp(self) -> None:
        # Read until EAGAIN, a short read, EOF, an error, or a pause for flow control /
        # back-pressure (which removes the reader, so a later resume registers afresh): see
        # _READ_BATCH.
        conn = self.conn
        h2c = conn.h2
        sid = self.stream_id
        sock = self.sock
        scratch = _scratch  # this thread's buffers
        for _ in range(_READ_BATCH):
            if not self._reading:  # (finishing stops reading)
                return
            if conn._out_size >= _HIGH_WATER:
                self._pause_reading()
                conn._blocked_bridges.add(self)
                return
            want = h2c.stream_send_window(sid)  # (stream and connection windows)
            if want <= 0:
                self._pause_reading()  # resumed on WINDOW_UPDATE
                return
            tx = scratch.tx(h2c.max_outbound_frame_size)
            if want > tx.read_size:
                want = tx.read_size
            try:
                n = sock.recvmsg_into(tx.slots(want))[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.abort(e)
                return
            if not n:
                self._pause_reading()
                self._tcp_eof = True
                with contextlib.suppress(h2.ProtocolError):
                    h2c.end_stream(sid)
                conn.flush()
                self._check_done()
                return
            try:
                size = h2c.frame_data_in_place(sid, tx.buf, n)
            except h2.ProtocolError as e:
                self.abort(e)
                return
            self.tcp_to_h2 += n
            self.counters.down_to_up += n
            conn.send_frames(tx.view[:size])
            if self._finished:  # (the connection failed while sending: already torn down)
                return
            if n < want:  # drained: see _READ_BATCH
                if (err := _socket_error(sock)) is not None:
                    self.abort(err)
                return
        self._more_soon = True  # more to read: let others run first
        conn.loop.call_soon(self._on_more)

    def on_window(self) -> None:
        """Send capacity grew: read TCP again (reads never take more than the windows allow)."""
        if not self._finished:
            self._resume_reading()

    # --- HTTP/2 -> TCP ---------------------------------------------------------------------

    def on_data(self, data: h2.Buffer, flow: int) -> None:
        if self._finished:
            return
        n = 0
        if not self._pending:
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.abort(e)
                return
        self.h2_to_tcp += n
        self.counters.up_to_down += n
        if n == len(data):
            self.conn.h2.acknowledge_received_data(self.stream_id, flow)
            return
        # The decrypted buffer is reused: keep a private copy of what is left.
        self._queue(bytes(memoryview(data)[n:]), flow)

    def on_data_list(self, bufs: list[h2.Buffer], size: int, flow: int) -> None:
        """Several DATA payloads of this stream from one decrypted batch (``size`` bytes in all):
        one ``sendmsg`` and one acknowledgement instead of a send and an ack for each."""
        if self._finished:
            return
        n = 0
        if not self._pending:
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.abort(e)
                return
        self.h2_to_tcp += n
        self.counters.up_to_down += n
        if n == size:
            self.conn.h2.acknowledge_received_data(self.stream_id, flow)
            return
        # Copy what is left, once (the decrypted buffer is reused); acknowledged once written.
        rest: list[h2.Buffer] = []
        for buf in bufs:
            k = len(buf)
            if n >= k:
                n -= k
                continue
            rest.append(memoryview(buf)[n:] if n else buf)
            n = 0
        self._queue(b"".join(rest), flow)

    def _queue(self, data: bytes, flow: int) -> None:
        self._pending.append(_PendingWrite(memoryview(data), flow))
        self.conn._holder.hold(len(data))
        if not self._writer_armed:
            self.conn.loop.add_writer(self.fd, self._on_tcp_writable)
            self._writer_armed = True

    def _on_tcp_writable(self) -> None:
        acked = False
        holder = self.conn._holder
        while self._pending:
            head = self._pending[0]
            try:
                n = self.sock.send(head.data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.abort(e)
                return
            holder.release(n)
            self.h2_to_tcp += n
            self.counters.up_to_down += n
            if n < len(head.data):
                head.data = head.data[n:]
                break
            self._pending.pop(0)
            self.conn.h2.acknowledge_received_data(self.stream_id, head.flow)
            acked = True
        if acked:
            self.conn.flush()
        if not self._pending:
            self.conn.loop.remove_writer(self.fd)
            self._writer_armed = False
            if self._h2_eof:
                self._send_fin()

    def on_end_stream(self) -> None:
        self._h2_eof = True
        if not self._pending:
            self._send_fin()

    def _send_fin(self) -> None:
        if not self._fin_sent:
            self._fin_sent = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
        self._check_done()

    def on_reset(self, code: int) -> None:
        if h2.is_clean_reset(code):
            # A clean end: deliver what we have, then FIN; nothing more goes upstream.
            self._tcp_eof = True
            self._pause_reading()
            self.on_end_stream()
            if not self._finished and not self._pending:
                self._finish(None)
        else:
            self.abort(HboneError(f"stream reset by peer with error code {code}"))


class HboneConnection:
    """One mTLS HTTP/2 connection (client or server side) on a raw socket."""

    def __init__(
        self,
        sock: socket.socket,
        sslobj: ssl.SSLObject,
        inbio: ssl.MemoryBIO,
        outbio: ssl.MemoryBIO,
        h2c: h2.H2Connection,
        *,
        on_request: Callable[[HboneConnection, h2.RequestReceived], None] | None = None,
        keepalive: bool = True,
        peer_chain: VerifiedChain = (),
        budget: BufferBudget | None = None,
    ) -> None:
        """``budget``: the process's budget for held bytes (default: the loop's, with the
        default size)."""
        self.loop = asyncio.get_running_loop()
        self.sock = sock
        self.fd = sock.fileno()
        self.sslobj = sslobj
        self.inbio = inbio
        self.outbio = outbio
        self.h2 = h2c
        self.on_request = on_request
        self.peer_der = sslobj.getpeercert(binary_form=True) or b""
        self.peer_chain = peer_chain  # above the leaf, as verified (tls_handshake)
        # The C-level TLS object behind the SSLObject: its read/write/pending are what the
        # SSLObject methods call, minus a Python frame each (several per message).
        tls = getattr(sslobj, "_sslobj", sslobj)
        self._tls_read = tls.read
        self._tls_write = tls.write
        self._tls_pending = tls.pending
        self._peer_identity: Identity | bool | None = False  # False: not parsed yet
        self._out: list[memoryview] = []
        self._out_size = 0
        self._writer_armed = False
        self._bridges: dict[int, StreamBridge] = {}
        self._blocked_bridges: set[StreamBridge] = set()
        self._responses: dict[int, asyncio.Future[h2.ResponseReceived]] = {}
        # Events for streams whose bridge is not attached yet (between CONNECT/200 and bridge()).
        # Bounded by the stream window: nothing is acknowledged until the bridge writes it.
        self._early: dict[int, list[h2.Event]] = {}
        self._reserved = 0  # streams promised to callers but not opened yet
        self.error: BaseException | None = None
        self.closed: asyncio.Future[BaseException | None] = self.loop.create_future()
        self._closing = False  # _teardown has started (it may re-enter via flush -> _fail)
        self._ping_sent: float | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self.goaway = False
        self._paused = 0  # why the socket is not read (_PAUSE_*: see _read_and_dispatch)
        if budget is None:
            budget = BufferBudget.of_loop(self.loop)
        self._holder = budget.holder(self._budget_resume)
        self._ctl_backlog = 0  # control bytes queued behind unsent output
        # The peer's frames are tiny: read little at a time. Until its input shows otherwise, so
        # that not even the first read of a connection can be 256 KiB of 1-byte frames.
        self._small_reads = True
        self._tls_backlog = False  # plaintext left in TLS for the next turn (_SMALL_PLAIN)
        self._more_soon = False  # a call_soon continuation of the reader is queued
        self.protocol_error: h2.RemoteProtocolError | None = None  # why we sent a GOAWAY
        self.loop.add_reader(self.fd, self._on_readable)
        if keepalive:
            self._keepalive = self.loop.call_later(KEEPALIVE_INTERVAL, self._on_keepalive)
        self.flush()

    @property
    def peer_identity(self) -> Identity | None:
        """The peer's SPIFFE identity (first URI SAN), parsed once per connection."""
        if self._peer_identity is False:
            self._peer_identity = peer_identity(self.peer_der) if self.peer_der else None
        assert self._peer_identity is not True
        return self._peer_identity

    # --- sending ---------------------------------------------------------------------------

    @property
    def write_blocked(self) -> bool:
        return self._out_size >= _HIGH_WATER

    def flush(self) -> None:
        """Encrypt whatever HTTP/2 queued and push it to the socket."""
        if self.closed.done():
            return
        bufs = self.h2.data_to_send()
        if bufs:
            data = bufs[0] if len(bufs) == 1 else b"".join(bufs)
            if self._out:  # (the socket is backlogged: count what we add to it)
                self._ctl_backlog += len(data)
            try:
                self._tls_write(data)
            except ssl.SSLError as e:
                self._fail(e)
                return
        if self.outbio.pending:
            self._push()

    def send_frames(self, frames: memoryview) -> None:
        """Encrypt ``frames`` (wire-ready HTTP/2, after anything HTTP/2 queued) and push them.

        ``frames`` is encrypted before this returns and never kept: the caller may reuse it."""
        if self.closed.done():
            return
        try:
            bufs = self.h2.data_to_send()
            if bufs:
                self._tls_write(bufs[0] if len(bufs) == 1 else b"".join(bufs))
            self._tls_write(frames)
        except ssl.SSLError as e:
            self._fail(e)
            return
        self._push()

    def _push(self) -> None:
        """Send the ciphertext in the TLS output BIO, queueing what the socket does not take."""
        record = self.outbio.read()
        n = 0
        if not self._out:
            try:
                n = self.sock.send(record)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self._fail(e)
                return
            if n == len(record):
                self._ctl_backlog = 0  # the peer reads: nothing is backlogged
                return
        cipher = memoryview(record)[n:]
        if self._closing:
            return  # tearing down: best effort only, never re-arm the writer
        self._out.append(cipher)
        self._out_size += len(cipher)
        if not self._writer_armed:
            self.loop.add_writer(self.fd, self._on_writable)
            self._writer_armed = True

    def _on_writable(self) -> None:
        while self._out:
            head = self._out[0]
            try:
                n = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(e)
                return
            self._out_size -= n
            if n < len(head):
                self._out[0] = head[n:]
                return
            self._out.pop(0)
        self.loop.remove_writer(self.fd)
        self._writer_armed = False
        self._ctl_backlog = 0
        if self._paused & _PAUSE_BACKLOG:
            self._resume(_PAUSE_BACKLOG)
        if self._blocked_bridges:
            blocked, self._blocked_bridges = self._blocked_bridges, set()
            for b in blocked:
                b._resume_reading()

    # --- receiving -------------------------------------------------------------------------

    def _on_readable(self) -> None:
        # (paused; or the queued continuation reads, in its turn)
        if not self._paused and not self._more_soon:
            self._read_turn()

    def _on_more(self) -> None:
        self._more_soon = False
        if not self._paused:  # (a continuation from before a pause)
            self._read_turn()

    def _read_turn(self) -> None:
        # Read until EAGAIN (see _READ_BATCH), yielding to other callbacks now and then.
        try:
            for _ in range(_READ_BATCH):
                if not self._read_and_dispatch():
                    return
                if self._small_reads or self._holder.budget.tight:
                    break  # (frame-dense input, or the budget is tight: one small read a turn)
        except Exception as e:  # a bug: fail this connection, keep serving the others
            log.exception("HBONE connection failed on an internal error")
            self._fail(e)
            return
        self._continue_soon()

    def _continue_soon(self) -> None:
        if not self._more_soon:
            self._more_soon = True
            self.loop.call_soon(self._on_more)

    def _pause(self, why: int) -> None:
        if not self._paused:
            self.loop.remove_reader(self.fd)
        self._paused |= why

    def _resume(self, why: int) -> None:
        if not self._paused & why:
            return
        self._paused &= ~why
        if not self._paused and not self._closing:
            self.loop.add_reader(self.fd, self._on_readable)
            self._continue_soon()  # (what TLS holds goes on even if the socket stays quiet)

    def _budget_resume(self) -> None:
        self._resume(_PAUSE_BUDGET)

    def _read_and_dispatch(self) -> bool:
        """One read (or, for a frame-dense peer, one slice of what TLS still holds); True if
        there may be more (and the connection is still up)."""
        if self._closing:
            return False
        holder = self._holder
        if holder.held and holder.must_wait():
            # Past the process's budget and holding at least its share: not read until the
            # budget drains (HTTP/2 windows cannot be taken back; TCP's can).
            self._pause(_PAUSE_BUDGET)
            b = holder.budget
            _rate_limited.warning(
                "budget",
                "HBONE buffer budget of %d MiB is used up (%d connections hold %d MiB): "
                "connections holding their share or more are not read until it drains",
                b.limit >> 20,
                b.holders,
                b.used >> 20,
            )
            return False
        sock = self.sock
        scratch = _scratch  # this thread's buffers
        small = self._small_reads or holder.budget.tight
        limit = _SMALL_RECV if small else _RECV_SIZE
        inbio = self.inbio
        backlog = self._tls_backlog
        if backlog:  # the last turn left plaintext in TLS: parse it before reading again
            self._tls_backlog = False
            n = limit
        else:
            try:
                n = sock.recv_into(scratch.recv, limit)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                self._fail(e)
                return False
            if n == 0:
                self._fail(ConnectionLost("peer closed the connection"))
                return False
            inbio.write(scratch.recv_view[:n])
        read = self._tls_read
        pending = self._tls_pending
        plain = scratch.plain_view
        size = _SMALL_PLAIN if self._small_reads else _PLAIN_SIZE
        # Decrypt while a whole record may be there: input left in the BIO or plaintext left in
        # OpenSSL. Once complete records are consumed the BIO is empty (a partial record moves
        # into OpenSSL's buffer on the read that raises SSLWantReadError), so a small message
        # costs no exception.
        while inbio.pending or pending():
            got = 0
            try:
                while got < size:
                    # With a buffer, read() returns a count (typeshed says bytes).
                    k: int = read(size - got, plain[got:] if got else plain)  # type: ignore[assignment]
                    if k == 0:
                        break
                    got += k
                    if not inbio.pending and not pending():
                        break
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                self._feed(plain[:got])
                self._fail(ConnectionLost("peer closed the TLS session"))
                return False
            except ssl.SSLError as e:
                self._fail(e)
                return False
            if got:
                self._feed(plain[:got])
            if got < size or self.closed.done():
                break
            if self._small_reads:  # one slice per turn; the rest stays in TLS
                self._tls_backlog = True
                break
        if self.h2.has_output or self.outbio.pending:  # (WINDOW_UPDATE, ACKs, RST, alerts)
            self.flush()
        if self._closing or self.closed.done():
            return False
        if self._ctl_backlog >= _CONTROL_BACKLOG:
            # The peer does not read the replies it makes us queue (PING and SETTINGS ACKs,
            # RST_STREAM, WINDOW_UPDATE): read no more from it until our output drains
            # (_on_writable resumes). DATA is not counted: bridges stop at _HIGH_WATER, and a
            # connection that stopped reading on bulk backlog alone could deadlock with a peer
            # doing the same.
            self._pause(_PAUSE_BACKLOG)
            return False
        if n < limit and not self._tls_backlog:  # drained: see _READ_BATCH
            if (err := _socket_error(sock)) is not None:
                self._fail(err)
            return False
        return True

    def _feed(self, data: memoryview) -> None:
        if self.closed.done():
            return
        h2c = self.h2
        try:
            frames = h2c.frames_received
            events = h2c.receive_data(data)
            # Frame-dense input is read in small pieces (see _SMALL_RECV), until a real sample
            # (4 KiB or more) averages 256 bytes or more per frame.
            nf, nd = h2c.frames_received - frames, len(data)
            if nf > (nd >> 6) + 8:
                self._small_reads = True
            elif self._small_reads and nd >= _SMALL_PLAIN and nf << 8 < nd:
                self._small_reads = False
        except h2.RemoteProtocolError as e:
            # The GOAWAY goes out first, whatever the events do; the socket then closes
            # gracefully so that the peer gets it (not a RST that would discard it).
            self.flush()
            self.protocol_error = e
            self._dispatch(e.events)
            self._fail(e)
            return
        self._dispatch(events)

    def _dispatch(self, events: list[h2.Event]) -> None:
        # DATA for bridged streams is gathered per stream and written at the end, or before the
        # next non-DATA event (which may end or reset a stream): one sendmsg per stream per
        # decrypted batch. Order within a stream is kept; streams are independent sockets.
        runs: dict[StreamBridge, list[h2.DataReceived]] | None = None
        for ev in events:
            if isinstance(ev, h2.DataReceived):  # the common case first
                b = self._bridges.get(ev.stream_id)
                if b is not None:
                    if runs is None:
                        runs = {b: [ev]}
                    elif (run := runs.get(b)) is None:
                        runs[b] = [ev]
                    else:
                        run.append(ev)
                        if len(run) >= _MAX_IOV:
                            del runs[b]
                            _deliver(b, run)
                    continue
                if (early := self._early.get(ev.stream_id)) is not None:
                    # Copied: the decrypt buffer is reused on the next read.
                    copy = bytes(ev.data)
                    early.append(h2.DataReceived(ev.stream_id, copy, ev.flow_controlled_length))
                    self._holder.hold(len(copy))
                else:
                    self.h2.acknowledge_received_data(ev.stream_id, ev.flow_controlled_length)
                continue
            if runs:
                _deliver_all(runs)
                runs = None
            if isinstance(ev, h2.WindowUpdated):
                if ev.stream_id == 0:
                    for b in list(self._bridges.values()):
                        b.on_window()
                elif (b := self._bridges.get(ev.stream_id)) is not None:
                    b.on_window()
            elif isinstance(ev, h2.StreamEnded):
                if (b := self._bridges.get(ev.stream_id)) is not None:
                    b.on_end_stream()
                elif (early := self._early.get(ev.stream_id)) is not None:
                    early.append(ev)
            elif isinstance(ev, h2.ResponseReceived):
                fut = self._responses.pop(ev.stream_id, None)
                if fut is not None and not fut.done():
                    self._early[ev.stream_id] = []
                    fut.set_result(ev)
            elif isinstance(ev, h2.RequestReceived):
                if self.on_request is not None:
                    self._early[ev.stream_id] = []
                    self.on_request(self, ev)
            elif isinstance(ev, h2.StreamReset):
                fut = self._responses.pop(ev.stream_id, None)
                if fut is not None and not fut.done():
                    cls = (
                        StreamRefused
                        if ev.error_code == h2.ErrorCode.REFUSED_STREAM
                        else HboneError
                    )
                    fut.set_exception(cls(f"stream reset before response, code {ev.error_code}"))
                if (b := self._bridges.get(ev.stream_id)) is not None:
                    b.on_reset(ev.error_code)
                elif (early := self._early.get(ev.stream_id)) is not None:
                    if not h2.is_clean_reset(ev.error_code):
                        # Nothing of it will be delivered: free the copies now.
                        for e in early:
                            if isinstance(e, h2.DataReceived):
                                self._holder.release(len(e.data))
                                self.h2.acknowledge_received_data(
                                    ev.stream_id, e.flow_controlled_length
                                )
                        early.clear()
                    early.append(ev)
            elif isinstance(ev, h2.PingAcked):
                self._ping_sent = None
            elif isinstance(ev, h2.GoAwayReceived):
                self.goaway = True
                self.loop.call_soon(self.close_if_idle)
            elif isinstance(ev, h2.ConnectionTerminated):
                self.flush()  # (the GOAWAY)
                self._fail(HboneError(f"HTTP/2 connection terminated: {ev.reason}"))
        if runs:
            _deliver_all(runs)

    # --- keepalive and teardown ------------------------------------------------------------

    def _on_keepalive(self) -> None:
        self._keepalive = None
        if self.closed.done():
            return
        now = time.monotonic()
        if self._ping_sent is not None and now - self._ping_sent >= KEEPALIVE_TIMEOUT:
            self._fail(HboneError("keepalive ping timed out"))
            return
        if self._ping_sent is None:
            self.h2.ping()
            self._ping_sent = now
            self.flush()
        self._keepalive = self.loop.call_later(KEEPALIVE_INTERVAL, self._on_keepalive)

    def _fail(self, error: BaseException) -> None:
        if self._closing or self.closed.done():
            return
        self.error = error
        self._teardown(error)

    def _teardown(self, error: BaseException | None) -> None:
        # Aborting the bridges below flushes their RST_STREAMs; if that send fails, flush calls
        # _fail, which must not start a second teardown (closed.set_result would then raise).
        if self._closing:
            return
        self._closing = True
        # No request comes after this: drop the callback, which usually closes over this
        # connection (the inbound handler's), so the pair is freed by refcounting rather than
        # left, with its grown stream tables, for a full GC (issue 18).
        self.on_request = None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if not self._paused:
            self.loop.remove_reader(self.fd)
        if self._writer_armed:
            self.loop.remove_writer(self.fd)
            self._writer_armed = False
        # Every stream on this connection fails with it. A socket error here is the tunnel
        # dying, not the app's own socket being reset, so it stays an error for the streams.
        exc: BaseException
        if error is None:
            exc = ConnectionLost("connection closed")
        elif isinstance(error, OSError):
            exc = ConnectionLost(f"HBONE connection failed: {error}")
        else:
            exc = error
        for fut in self._responses.values():
            if not fut.done():
                fut.set_exception(ConnectionLost(f"HBONE connection failed: {exc}"))
        self._responses.clear()
        self._early.clear()
        for b in list(self._bridges.values()):
            b.abort(exc)
        self._holder.release_all()  # (the early copies; the bridges released their own)
        self._holder.resume = _no_resume  # (it pointed back here: no cycle is left)
        if self.protocol_error is not None:
            # (also with nothing left to send: closing with unread input would send a RST
            # that purges a GOAWAY still in the kernel's send queue)
            self._linger_close()
        else:
            self.sock.close()
        self.closed.set_result(error)

    def _linger_close(self) -> None:
        """After a GOAWAY for a protocol error: hand the socket to a bounded graceful close
        (what is queued is sent, then FIN; input is discarded), so the peer reads the GOAWAY
        instead of a RST that would discard it."""
        # On a dup: whoever gave us the socket closes it when its handler returns (the Listener
        # does), and closing an fd uvloop still watches would corrupt its state.
        try:
            sock = self.sock.dup()
        except OSError:  # (out of fds: a plain close)
            self.sock.close()
            return
        self.sock.close()
        _LingeringClose(self.loop, sock, self._out)
        self._out = []
        self._out_size = 0

    def close(self, error: BaseException | None = None) -> None:
        """Close now: GOAWAY (best effort), then drop the socket; streams fail (with ``error``
        when given, e.g. the peer's certificate was revoked)."""
        if self.closed.done():
            return
        with contextlib.suppress(Exception):
            self.h2.close()
            self.flush()
        self._teardown(error)

    def send_goaway(self) -> None:
        """Graceful drain: no new streams; existing ones run on."""
        if self.closed.done() or self.goaway:
            return
        self.goaway = True
        with contextlib.suppress(h2.ProtocolError):
            self.h2.goaway(h2.ErrorCode.NO_ERROR)
            self.flush()
        self.close_if_idle()

    def close_if_idle(self) -> None:
        """After GOAWAY (either way), a connection with no stream left has nothing to wait for."""
        if self.goaway and self.active_streams == 0:
            self.close()

    # --- streams ---------------------------------------------------------------------------

    @property
    def active_streams(self) -> int:
        # _early: streams past CONNECT (or its 200) whose bridge is not attached yet.
        return len(self._bridges) + len(self._responses) + len(self._early) + self._reserved

    def reserve(self) -> None:
        self._reserved += 1

    def release(self) -> None:
        self._reserved -= 1

    async def open_stream(
        self, authority: str, headers: h2.Headers, *, reserved: bool = False
    ) -> tuple[int, h2.ResponseReceived]:
        """Client side: send CONNECT and wait for the response headers. Raises
        :class:`StreamRefused` when the stream was not processed (retry it elsewhere).

        ``reserved``: the caller holds a reservation from the pool, converted into this stream."""
        try:
            if self.closed.done():
                raise StreamRefused(f"HBONE connection is closed: {self.error}")
            try:
                sid = self.h2.open_stream(authority, headers)
            except h2.LocalProtocolError as e:
                if e.error_code != h2.ErrorCode.REFUSED_STREAM:
                    raise
                raise StreamRefused(f"HBONE connection has no stream left: {e}") from None
        finally:
            if reserved:
                self._reserved -= 1
        fut: asyncio.Future[h2.ResponseReceived] = self.loop.create_future()
        self._responses[sid] = fut
        self.flush()
        try:
            return sid, await fut
        except asyncio.CancelledError:
            self._responses.pop(sid, None)
            if self.h2.stream_is_open(sid):
                self.h2.reset_stream(sid, h2.ErrorCode.CANCEL)
                self.flush()
            raise

    def respond(
        self, stream_id: int, status: int, headers: h2.Headers, *, end_stream: bool
    ) -> None:
        if end_stream:
            self.abandon(stream_id)
        with contextlib.suppress(h2.ProtocolError):
            self.h2.send_response(stream_id, status, headers, end_stream=end_stream)
        self.flush()

    def release_stream(self, stream_id: int) -> None:
        """The work for a peer stream ended (its task is done): it stops counting against the
        stream limit, and bytes still owed for it go back to the connection window."""
        if self.closed.done():
            return
        for ev in self._early.pop(stream_id, ()):
            if isinstance(ev, h2.DataReceived):
                self._holder.release(len(ev.data))
        self.h2.release_stream(stream_id)
        if self.h2.has_output:
            self.flush()

    def charge(self) -> None:
        """The peer made us refuse a malformed request: count it against the control-frame
        budget (h2conn.H2Connection.charge); past the budget the connection ends with GOAWAY."""
        if self.closed.done():
            return
        exc = self.h2.charge()
        if exc is not None:
            self.protocol_error = exc
            self.flush()
            self._fail(exc)

    def refuse(self, stream_id: int) -> None:
        """Reset a peer stream with REFUSED_STREAM before any work (safe for it to retry)."""
        if self.closed.done():
            return
        with contextlib.suppress(h2.ProtocolError):
            self.h2.reset_stream(stream_id, h2.ErrorCode.REFUSED_STREAM)
        self.flush()

    def abandon(self, stream_id: int) -> None:
        """No bridge will be attached to this stream: release what was buffered for it."""
        for ev in self._early.pop(stream_id, ()):
            if isinstance(ev, h2.DataReceived):
                self._holder.release(len(ev.data))
                self.h2.acknowledge_received_data(stream_id, ev.flow_controlled_length)

    def bridge(
        self, stream_id: int, sock: socket.socket, counters: CopyCounters | None = None
    ) -> asyncio.Future[StreamBridge]:
        """Copy between ``sock`` and the stream until both directions end; closes ``sock``.

        Await the returned future for the bridge, which carries the byte counts and ``error``
        (None for a clean end). Cancelling it (as cancelling the task awaiting it does) aborts
        the bridge. A plain function, not a coroutine: an idle tunnelled connection holds no
        coroutine frame here (memory per connection, issue 18)."""
        b = StreamBridge(self, stream_id, sock, counters)
        done = b.done
        assert done is not None
        if self.closed.done():
            b._finish(ConnectionLost(f"HBONE connection is closed: {self.error}"))
            return done
        self._bridges[stream_id] = b
        early = self._early.pop(stream_id, ())
        b.start()
        for ev in early:
            if isinstance(ev, h2.DataReceived):
                self._holder.release(len(ev.data))  # (what the socket does not take is queued)
                b.on_data(ev.data, ev.flow_controlled_length)
            elif isinstance(ev, h2.StreamEnded):
                b.on_end_stream()
            elif isinstance(ev, h2.StreamReset):
                b.on_reset(ev.error_code)
        if early:
            self.flush()
        return done


_MAX_IOV = 256  # DATA payloads per sendmsg (the kernel takes up to 1024 iovecs)


def _deliver(b: StreamBridge, run: list[h2.DataReceived]) -> None:
    if len(run) == 1:
        ev = run[0]
        b.on_data(ev.data, ev.flow_controlled_length)
        return
    bufs: list[h2.Buffer] = []
    size = flow = 0
    for ev in run:
        bufs.append(ev.data)
        size += len(ev.data)
        flow += ev.flow_controlled_length
    b.on_data_list(bufs, size, flow)


def _deliver_all(runs: dict[StreamBridge, list[h2.DataReceived]]) -> None:
    for b, run in runs.items():
        _deliver(b, run)


_LINGER_SECONDS = 2.0
_LINGER_DISCARD = 1 << 20


class _LingeringClose:
    """Send ``pending`` ciphertext, shut down writing, discard input until EOF, then close;
    bounded by ``_LINGER_SECONDS`` and ``_LINGER_DISCARD`` bytes, whichever comes first."""

    __slots__ = ("discarded", "fd", "loop", "pending", "sock", "timer", "writing")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, pending: list[memoryview]
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self.pending = pending
        self.discarded = 0
        self.writing = False
        self.timer = loop.call_later(_LINGER_SECONDS, self.close)
        loop.add_reader(self.fd, self._on_readable)
        self._on_writable()

    def _on_writable(self) -> None:
        while self.pending:
            try:
                n = self.sock.send(self.pending[0])
            except (BlockingIOError, InterruptedError):
                if not self.writing:
                    self.writing = True
                    self.loop.add_writer(self.fd, self._on_writable)
                return
            except OSError:
                self.close()
                return
            if n < len(self.pending[0]):
                self.pending[0] = self.pending[0][n:]
            else:
                self.pending.pop(0)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self.discarded += len(data)
        if not data or self.discarded > _LINGER_DISCARD:
            self.close()

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        self.timer.cancel()
        self.loop.remove_reader(self.fd)
        if self.writing:
            self.loop.remove_writer(self.fd)
        self.sock.close()
