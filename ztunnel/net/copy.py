"""Byte-copy engine between two connected sockets (splice or buffered); it owns and closes both sockets.

Invariants:

* ``copy_bidirectional`` takes ownership of both sockets: whatever happens (clean end, error,
  cancellation) both are closed when it returns or raises, and every fd callback it registered is
  removed *before* the fd is closed (closing a registered fd corrupts uvloop/libuv state).
* Exact half-close: EOF on one side becomes ``shutdown(SHUT_WR)`` on the other side once every byte
  read before the EOF has been written; the other direction keeps flowing until its own EOF.
* Any socket error (reset, broken pipe, ...) ends the whole session: both sockets are closed
  abortively (``SO_LINGER`` 0, so the peers see RST, never a truncated stream that looks clean) and
  the error is reported in ``CopyResult.error``.
* Splice path: a pipe is held only while bytes are in flight; it goes back to the caller's
  ``PipePool`` as soon as it is empty (idle connections hold no pipes). A pipe that still holds data
  when a session ends is closed, never returned. Buffered path: likewise, a direction holds a read
  buffer only while data flows (except 256 KiB buffers of flows past 10 MiB, kept like ztunnel's).
  Pipes out and those 256 KiB buffers count against the pool's budget (``PipePool``).
* Runs on any asyncio loop that implements ``add_reader``/``add_writer`` (stdlib selector loop, uvloop).
  No module-level state: the pipe pool is built by the caller (composition root) and passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

__all__ = [
    "CopyCounters",
    "CopyResult",
    "PipePool",
    "PipePoolStats",
    "Side",
    "copy_bidirectional",
]

Pipe: TypeAlias = tuple[int, int, int]
"""A pipe as ``(read_fd, write_fd, capacity)``, both fds non-blocking and close-on-exec."""

DEFAULT_BUDGET = 32 << 20
"""What a whole node's data plane may hold in pipes and large buffers at once (``ZTUNNEL_COPY_BUDGET``);
each of N worker processes gets ``budget // N``."""
SMALL_PIPE = 64 << 10  # the kernel's default pipe capacity (16 pages): no F_SETPIPE_SZ needed

_F_SETPIPE_SZ: int = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ: int = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_PIPE_MAX_SIZE_PATH = "/proc/sys/fs/pipe-max-size"

# SPLICE_F_MOVE is only a hint (mostly a no-op) but costs nothing. SPLICE_F_NONBLOCK makes the pipe
# side non-blocking (the sockets are O_NONBLOCK themselves). SPLICE_F_MORE is deliberately NOT used on
# the pipe->socket leg: it corks the tail segment (like MSG_MORE), and since we always flush the whole
# pipe there is no "more" we could promise; it would add latency to request/response traffic. HAProxy
# makes the same choice.
_SPLICE_FLAGS: int = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK

# Fairness: at most this many socket->pipe->socket rounds per readable callback (4 MiB with 1 MiB
# pipes) so one bulk flow cannot starve the loop.
_SPLICE_ROUNDS = 4
# Buffered path: at most this many recv/send rounds per readable callback.
_BUFFERED_ROUNDS = 8
# After a read of at least this much was fully written, read again at once instead of going back to
# the loop: a streaming sender has usually sent more meanwhile (HAProxy reads the same way). At a
# paced 3 Gbit/s this halved our epoll wakeups (6084 -> 2614 in 3 s, HAProxy: 2196-3200). Smaller
# reads look like request/response traffic, where the extra read would just hit EAGAIN.
_SPECULATE_MIN = 64 * 1024

# A splice direction gets a large pipe once it has delivered this much: bulk. A destination that
# stopped reading delivered little (its receive window and our send buffer), so it parks bytes in
# a small pipe, not a large one. (Not "filled a small pipe in one splice": a pipe's 16 slots take
# one socket buffer fragment each, so over a 1448-byte MSS path a full small pipe holds ~50 KiB.)
_BULK_MOVED = 4 * 1024 * 1024

# Buffered path sizes, from istio/ztunnel src/copy.rs (the -64 leaves room for TLS/h2 framing):
# 16 KiB - 64, then 256 KiB - 64 once a direction moved 10 MiB. See _BufferedDirection for why
# ztunnel's 1 KiB first level is skipped.
_LARGE_BUFFER_SIZE = 16_384 - 64
_JUMBO_BUFFER_SIZE = 16 * 16_384 - 64
_RESIZE_THRESHOLD_JUMBO = 10 * 1024 * 1024

_LINGER_ABORT = struct.pack("ii", 1, 0)


class Side(enum.Enum):
    """Which leg of the session a socket error came from."""

    DOWNSTREAM = "downstream"
    UPSTREAM = "upstream"


@dataclass(frozen=True, slots=True)
class CopyResult:
    """Outcome of ``copy_bidirectional``: bytes delivered each way and the error that ended it, if any.

    ``error`` is None for a clean end (both directions reached EOF and were half-closed). Peer resets
    show up here as ``ConnectionResetError``/``BrokenPipeError``; callers decide whether that is
    worth an error log (a peer disconnect usually is not).
    """

    down_to_up: int
    up_to_down: int
    error: OSError | None = None
    error_side: Side | None = None


class CopyCounters:
    """Live byte counters for one session (or shared by many), bumped once per chunk written.

    The engine only ever adds to them; readers (metrics scrapes) may read them at any time from the
    loop thread. ``down_to_up`` counts bytes written to the upstream socket, ``up_to_down`` bytes
    written to the downstream socket.
    """

    __slots__ = ("down_to_up", "up_to_down")

    def __init__(self) -> None:
        self.down_to_up = 0
        self.up_to_down = 0

    def __repr__(self) -> str:
        return f"CopyCounters(down_to_up={self.down_to_up}, up_to_down={self.up_to_down})"


@dataclass(frozen=True, slots=True)
class PipePoolStats:
    """A snapshot of a ``PipePool``'s counters."""

    idle: int
    """Pipes parked in the pool."""
    in_use: int
    """Pipes handed out by ``get()`` and not yet given back."""
    created: int
    """Pipes created over the pool's life."""
    resize_failed: int
    """Pipes that kept their default size because ``F_SETPIPE_SZ`` failed (e.g. EPERM past
    ``fs.pipe-user-pages-soft`` for a non-root user)."""
    size: int
    """The size new pipes get: ``pipe_size``, or ``fs.pipe-max-size`` when that is smaller and the
    process may not exceed it."""
    create_failed: int
    """``pipe2`` failures (EMFILE/ENFILE); each made a session fall back to the buffered copy."""
    limited: int = 0
    """``get()`` refusals because the budget was spent (that direction then copies with a 16 KiB
    buffer): a pipe stays out while its destination does not read, so stuck connections would
    otherwise pin a pipe (2 fds, up to ``size`` bytes of kernel memory) each."""
    held: int = 0
    """Bytes of the budget in use: the capacity of every pipe out plus the large buffers."""
    budget: int = 0
    """This pool's budget in bytes."""
    small_in_use: int = 0
    """Pipes out at the small size (a direction gets a large one once it moves bulk)."""


class PipePool:
    """A pool of non-blocking pipes for the splice path; built once by the composition root.

    ``get()`` hands out an empty pipe (creating one when none of that size is idle); ``put()``
    takes back an *empty* pipe, keeping at most ``max_idle`` of each size; ``discard()`` closes a
    pipe that may hold data. ``close()`` closes the idle pipes; pipes given back after that are
    closed too. Not thread-safe: use one pool per event loop.

    Sizes, per connection to what it moves: a direction first gets a ``small_size`` pipe (64 KiB,
    the kernel's default: no ``F_SETPIPE_SZ``), and a ``pipe_size`` one (1 MiB) once it moves bulk
    (``get(bulk=True)``: it delivered 4 MiB). On the in-pod benchmark path (iperf3, proxy CPU per
    byte) 64 KiB pipes cost about twice the CPU per GiB of 1 MiB pipes, 256 KiB ~1.3x, 512 KiB
    ~1.1x, 2 and 4 MiB the same as 1 MiB; request/response traffic never fills a small one.

    Budget: a pipe out of the pool (a pipe whose destination stopped reading stays out, holding
    up to its capacity of kernel memory) counts its capacity against ``budget`` bytes, and so do
    large copy buffers (:meth:`reserve`). Past it, a bulk direction gets a small pipe, and when
    not even that fits, ``get()`` refuses (``OSError(EAGAIN)``) and the direction copies with a
    16 KiB buffer: what peers can pin in this pool is ``budget`` plus that per connection, each of
    which costs them a connection (fds are budgeted in ``net/fdbudget.py``).

    An unprivileged user may hold at most ``fs.pipe-user-pages-soft`` pages of pipe capacity (64
    MiB by default). Past that ``F_SETPIPE_SZ`` fails and the pipe keeps its default size
    (``stats().resize_failed``); CAP_SYS_ADMIN or CAP_SYS_RESOURCE exempt a process. No pipe may
    exceed ``fs.pipe-max-size`` (1 MiB by default) without CAP_SYS_RESOURCE: when ``pipe_size`` is
    refused for that reason the pool shrinks to that limit once, for good.
    """

    __slots__ = (
        "_budget",
        "_closed",
        "_create_failed",
        "_created",
        "_held",
        "_idle",
        "_idle_small",
        "_in_use",
        "_limited",
        "_max_idle",
        "_pipe_size",
        "_resize_failed",
        "_small_in_use",
        "_small_size",
    )

    def __init__(
        self,
        pipe_size: int = 1 << 20,
        max_idle: int = 32,
        budget: int = DEFAULT_BUDGET,
        small_size: int = SMALL_PIPE,
    ) -> None:
        if pipe_size <= 0 or small_size <= 0:
            raise ValueError(f"pipe sizes must be positive, got {pipe_size}, {small_size}")
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self._pipe_size = pipe_size
        self._small_size = min(small_size, pipe_size)
        self._max_idle = max_idle
        self._budget = budget
        self._held = 0
        self._limited = 0
        self._idle: list[Pipe] = []
        self._idle_small: list[Pipe] = []
        self._in_use = 0
        self._small_in_use = 0
        self._created = 0
        self._resize_failed = 0
        self._create_failed = 0
        self._closed = False

    @property
    def pipe_size(self) -> int:
        """The size requested for each new large pipe (``fs.pipe-max-size`` if the requested size
        was refused for exceeding it)."""
        return self._pipe_size

    def get(self, bulk: bool = True) -> Pipe:
        """An empty pipe: ``pipe_size`` for a ``bulk`` direction while the budget allows, else
        ``small_size``. Raises ``OSError`` (EMFILE, ENFILE, ...) if none can be created, or
        EAGAIN when not even a small one fits in the budget."""
        small = self._small_size
        size = self._pipe_size if bulk else small
        if self._held + size > self._budget:
            if size == small or self._held + small > self._budget:
                self._limited += 1
                raise OSError(errno.EAGAIN, "pipe budget spent")
            size = small
        idle = self._idle_small if size == small else self._idle
        pipe = idle.pop() if idle else self._create(size)
        self._held += pipe[2]
        self._in_use += 1
        if pipe[2] == small:
            self._small_in_use += 1
        return pipe

    def _create(self, size: int) -> Pipe:
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._create_failed += 1
            raise
        self._created += 1
        if size != SMALL_PIPE:  # (a new pipe has the default capacity already)
            try:
                fcntl.fcntl(w, _F_SETPIPE_SZ, size)
            except OSError:
                if self._shrink_to_limit(w):
                    size = self._pipe_size
                else:
                    # EPERM past pipe-user-pages-soft (non-root): a smaller pipe still works.
                    self._resize_failed += 1
                    size = fcntl.fcntl(w, _F_GETPIPE_SZ)
        return r, w, size

    def _shrink_to_limit(self, w: int) -> bool:
        """``pipe_size`` was refused: if it is above ``fs.pipe-max-size``, size the pipe to that limit
        and use the limit for every later pipe. True if the pipe was resized."""
        try:
            with open(_PIPE_MAX_SIZE_PATH, "rb") as f:
                limit = int(f.read())
        except (OSError, ValueError):
            return False
        if not 0 < limit < self._pipe_size:
            return False  # not the reason (e.g. pipe-user-pages-soft): keep the requested size
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, limit)
        except OSError:
            return False
        self._pipe_size = limit
        return True

    def _returned(self, pipe: Pipe) -> None:
        self._in_use -= 1
        self._held -= pipe[2]
        if pipe[2] == self._small_size:
            self._small_in_use -= 1

    def put(self, pipe: Pipe) -> None:
        """Give back a pipe the caller knows to be empty."""
        self._returned(pipe)
        idle = self._idle_small if pipe[2] == self._small_size else self._idle
        odd = pipe[2] != self._small_size and pipe[2] != self._pipe_size  # (its resize failed)
        if self._closed or odd or len(idle) >= self._max_idle:
            _close_pipe(pipe)
        else:
            idle.append(pipe)

    def discard(self, pipe: Pipe) -> None:
        """Give back a pipe that may still hold data: it is closed, never reused."""
        self._returned(pipe)
        _close_pipe(pipe)

    def reserve(self, n: int) -> bool:
        """Take ``n`` bytes of the budget for a large copy buffer; False if they do not fit."""
        if self._held + n > self._budget:
            self._limited += 1
            return False
        self._held += n
        return True

    def release(self, n: int) -> None:
        """Give back what :meth:`reserve` took."""
        self._held -= n

    def close(self) -> None:
        """Close every idle pipe; pipes still in use are closed when given back."""
        self._closed = True
        idle, self._idle = self._idle + self._idle_small, []
        self._idle_small = []
        for pipe in idle:
            _close_pipe(pipe)

    def stats(self) -> PipePoolStats:
        return PipePoolStats(
            idle=len(self._idle) + len(self._idle_small),
            in_use=self._in_use,
            created=self._created,
            resize_failed=self._resize_failed,
            create_failed=self._create_failed,
            size=self._pipe_size,
            limited=self._limited,
            held=self._held,
            budget=self._budget,
            small_in_use=self._small_in_use,
        )

    def __repr__(self) -> str:
        return f"PipePool(pipe_size={self._pipe_size}, max_idle={self._max_idle}, {self.stats()})"


def _close_pipe(pipe: Pipe) -> None:
    for fd in pipe[:2]:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Sink(Protocol):
    """Where the buffered path writes: the seam for a future non-socket destination (an h2 stream).

    ``send`` behaves like non-blocking ``socket.send``: it accepts a prefix of ``data`` and returns its
    length (may raise ``BlockingIOError`` when nothing fits); it must not keep a reference to ``data``
    after returning (the buffer is reused). ``wait_writable(cb)`` arranges for ``cb()`` to be called
    (repeatedly) until ``cancel_wait()``; ``shutdown_write`` is the half-close (FIN / END_STREAM).
    Closing is the session's job, not the sink's.
    """

    def send(self, data: memoryview, /) -> int: ...

    def wait_writable(self, cb: Callable[[], None], /) -> None: ...

    def cancel_wait(self) -> None: ...

    def shutdown_write(self) -> None: ...


class _SocketSink:
    """``_Sink`` for a plain non-blocking socket."""

    __slots__ = ("_fd", "_loop", "_sock", "send")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self.send: Callable[[memoryview], int] = sock.send

    def wait_writable(self, cb: Callable[[], None]) -> None:
        self._loop.add_writer(self._fd, cb)

    def cancel_wait(self) -> None:
        self._loop.remove_writer(self._fd)

    def shutdown_write(self) -> None:
        _shutdown_write(self._sock)


def _shutdown_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError as e:
        # The peer may already be gone; that is its own way of shutting down (as ztunnel does).
        if e.errno != errno.ENOTCONN:
            raise


class _Direction:
    """Common state of one direction: the session, its source/destination socket and counters."""

    __slots__ = (
        "_counters",
        "_dst",
        "_dst_fd",
        "_fwd",
        "_loop",
        "_reading",
        "_session",
        "_src",
        "_src_fd",
        "_writing",
        "moved",
    )

    def __init__(
        self, session: _Session, src: socket.socket, dst: socket.socket, fwd: bool
    ) -> None:
        self._session = session
        self._loop = session.loop
        self._counters = session.counters
        self._src = src
        self._dst = dst
        self._src_fd = src.fileno()
        self._dst_fd = dst.fileno()
        self._fwd = fwd
        self._reading = False
        self._writing = False
        self.moved = 0

    @property
    def src_side(self) -> Side:
        return Side.DOWNSTREAM if self._fwd else Side.UPSTREAM

    @property
    def dst_side(self) -> Side:
        return Side.UPSTREAM if self._fwd else Side.DOWNSTREAM

    def start(self) -> None:
        self._loop.add_reader(self._src_fd, self._on_readable)
        self._reading = True

    def _on_readable(self) -> None:
        raise NotImplementedError

    def _count(self, n: int) -> None:
        self.moved += n
        if self._fwd:
            self._counters.down_to_up += n
        else:
            self._counters.up_to_down += n

    def _remove_callbacks(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._src_fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._dst_fd)

    def _finish_eof(self) -> None:
        """Source hit EOF and everything read was written: half-close the destination."""
        self._remove_callbacks()
        session = self._session
        if session._open == 1 and self._dst_is_socket:
            # The other direction has ended: the session closes both sockets now, and close()
            # sends the same FIN as shutdown() (the other direction read this destination to
            # its EOF, so nothing is left unread to turn it into a RST). HAProxy closes so too.
            session.direction_done()
            return
        try:
            self._shutdown_dst()
        except OSError as e:
            self._session.fail(e, self.dst_side)
            return
        self._session.direction_done()

    def _shutdown_dst(self) -> None:
        _shutdown_write(self._dst)

    @property
    def _dst_is_socket(self) -> bool:
        """The half-close is the destination socket's FIN (not a sink's own end of stream)."""
        return True

    def stop(self) -> None:
        """Remove callbacks and release resources; never raises. Called on session end."""
        self._remove_callbacks()


class _SpliceDirection(_Direction):
    """socket -> pipe -> socket with ``os.splice``; holds a pipe only while bytes are in it."""

    __slots__ = ("_bulk", "_in_pipe", "_pipe", "_pool")

    def __init__(
        self, session: _Session, src: socket.socket, dst: socket.socket, fwd: bool, pool: PipePool
    ) -> None:
        super().__init__(session, src, dst, fwd)
        self._pool = pool
        self._pipe: Pipe | None = None
        self._in_pipe = 0
        self._bulk = False  # moves bulk: gets a large pipe from then on

    # The hot path. The loop calls _pump directly and counting is inlined: perf shows the same
    # kernel profile as HAProxy's splice path, so interpreter time is the only extra cost.

    def start(self) -> None:
        self._loop.add_reader(self._src_fd, self._pump, False)
        self._reading = True

    def _on_writable(self) -> None:
        pipe = self._pipe
        if pipe is not None and self._in_pipe:
            try:
                m = os.splice(pipe[0], self._dst_fd, self._in_pipe, None, None, _SPLICE_FLAGS)
            except BlockingIOError:
                return
            except OSError as e:
                self._session.fail(e, self.dst_side)
                return
            self._count(m)
            self._in_pipe -= m
            if self._in_pipe:
                return
        # The pipe is empty. The destination was the bottleneck, so the source very likely has
        # more: read right away while still registered for write, rather than bouncing through the
        # loop (one wakeup and two epoll_ctl saved per pipeful).
        self._pump(True)

    def _pump(self, as_writer: bool) -> None:
        """Move socket -> pipe -> socket until the source is empty, the destination is full or the
        round budget is spent. Precondition: the pipe is empty (or not held)."""
        pool = self._pool
        pipe = self._pipe
        if pipe is None:
            try:
                pipe = pool.get(self._bulk)
            except OSError:
                # Out of fds (EMFILE/ENFILE) or of the pipe budget: keep the connection, copy
                # this direction with buffers.
                self._session.fall_back_to_buffered(self)
                return
            self._pipe = pipe
        r, w, chunk = pipe
        src_fd = self._src_fd
        dst_fd = self._dst_fd
        splice = os.splice
        rounds = _SPLICE_ROUNDS
        # Invariant: the pipe is empty here, so EAGAIN from socket->pipe means "socket empty", never
        # "pipe full" (the ambiguity HAProxy's splice commit describes).
        while True:
            try:
                n = splice(src_fd, w, chunk, None, None, _SPLICE_FLAGS)
            except BlockingIOError:
                # Source drained: give the (empty) pipe back and wait for the source.
                self._pipe = None
                pool.put(pipe)
                if as_writer:
                    self._writing = False
                    self._loop.remove_writer(dst_fd)
                    self._reading = True
                    self._loop.add_reader(src_fd, self._pump, False)
                return
            except OSError as e:
                self._session.fail(e, self.src_side)
                return
            if n == 0:
                self._pipe = None
                pool.put(pipe)
                self._finish_eof()
                return
            if self.moved >= _BULK_MOVED:
                self._bulk = True
            try:
                m = splice(r, dst_fd, n, None, None, _SPLICE_FLAGS)
            except BlockingIOError:
                m = 0
            except OSError as e:
                self._in_pipe = n
                self._session.fail(e, self.dst_side)
                return
            if m:
                self.moved += m
                if self._fwd:
                    self._counters.down_to_up += m
                else:
                    self._counters.up_to_down += m
            if m < n:
                # Destination full: park the rest in the pipe and wait for the destination only.
                self._in_pipe = n - m
                if not as_writer:
                    self._reading = False
                    self._loop.remove_reader(src_fd)
                    self._writing = True
                    self._loop.add_writer(dst_fd, self._on_writable)
                return
            rounds -= 1
            if not rounds or (n < _SPECULATE_MIN and not as_writer):
                # Budget spent (fairness) or the source looked drained: yield to the loop with
                # the registration unchanged; level-triggered polling brings us back if needed.
                self._pipe = None
                pool.put(pipe)
                return

    def _release_pipe(self) -> None:
        pipe = self._pipe
        if pipe is not None:
            self._pipe = None
            if self._in_pipe:
                self._in_pipe = 0
                self._pool.discard(pipe)
            else:
                self._pool.put(pipe)

    def stop(self) -> None:
        self._remove_callbacks()
        self._release_pipe()


class _BufferedDirection(_Direction):
    """``recv_into`` a buffer, then ``send`` it to a sink; the buffer exists only while data flows.

    Sizes follow ztunnel's upper two levels (16 KiB - 64, then 256 KiB - 64 once 10 MiB moved), but
    the buffer is dropped as soon as the source is drained and nothing is pending, so an idle
    connection holds no buffer at all. ztunnel's 1 KiB first level is skipped on purpose: a read
    costs ~10 us of Python here, and 1 KiB reads made a 100 KB flow ~3x more expensive, while
    allocating a transient 16 KiB buffer costs ~1 us. A 256 KiB buffer (~14 us to allocate) is kept
    while idle, as ztunnel keeps its buffers: only connections that moved 10 MiB get one.
    """

    __slots__ = ("_buf", "_end", "_jumbo", "_recv_into", "_sent", "_sink", "_sink_send")

    def __init__(
        self,
        session: _Session,
        src: socket.socket,
        dst: socket.socket,
        fwd: bool,
        sink: _Sink | None = None,
    ) -> None:
        super().__init__(session, src, dst, fwd)
        self._sink: _Sink = sink if sink is not None else _SocketSink(self._loop, dst)
        self._sink_send = self._sink.send
        self._recv_into = src.recv_into
        self._buf: memoryview | None = None
        self._sent = 0  # pending bytes are self._buf[self._sent:self._end]
        self._end = 0
        self._jumbo = False  # holds a 256 KiB buffer (taken from the pipe pool's budget, if any)

    def _may_grow(self) -> bool:
        """Whether this direction may use (and keep) a 256 KiB buffer: it moved 10 MiB, and the
        session's pipe pool, if any, has the budget for it (else it stays at 16 KiB)."""
        if self._jumbo:
            return True
        if self.moved < _RESIZE_THRESHOLD_JUMBO:
            return False
        pool = self._session.pipes
        if pool is not None and not pool.reserve(_JUMBO_BUFFER_SIZE):
            return False
        self._jumbo = True
        return True

    def _on_readable(self) -> None:
        self._pump(False)

    def _on_writable(self) -> None:
        buf = self._buf
        if buf is not None and self._sent < self._end:
            try:
                m = self._sink_send(buf[self._sent : self._end])
            except BlockingIOError:
                return
            except OSError as e:
                self._session.fail(e, self.dst_side)
                return
            self._count(m)
            self._sent += m
            if self._sent < self._end:
                return
        # Drained: read again right away while still registered for write (see _SpliceDirection).
        self._pump(True)

    def _pump(self, as_writer: bool) -> None:
        """recv -> send until the source is empty, the sink is full or the round budget is spent.
        Precondition: nothing pending in the buffer."""
        buf = self._buf
        if buf is None:
            size = _JUMBO_BUFFER_SIZE if self._may_grow() else _LARGE_BUFFER_SIZE
            buf = self._buf = memoryview(bytearray(size))
        else:
            size = len(buf)
        recv_into = self._recv_into
        send = self._sink_send
        rounds = _BUFFERED_ROUNDS
        while True:
            try:
                n = recv_into(buf)
            except BlockingIOError:
                if size < _JUMBO_BUFFER_SIZE:
                    self._buf = None  # idle: hold no buffer
                if as_writer:
                    self._writing = False
                    self._sink.cancel_wait()
                    self._reading = True
                    self._loop.add_reader(self._src_fd, self._on_readable)
                return
            except OSError as e:
                self._session.fail(e, self.src_side)
                return
            if n == 0:
                self._buf = None
                self._finish_eof()
                return
            data = buf if n == size else buf[:n]
            try:
                m = send(data)
            except BlockingIOError:
                m = 0
            except OSError as e:
                self._session.fail(e, self.dst_side)
                return
            if m:
                self._count(m)
            if m < n:
                # Backpressure: keep the rest, stop reading until the sink took it.
                self._sent = m
                self._end = n
                if not as_writer:
                    self._reading = False
                    self._loop.remove_reader(self._src_fd)
                    self._writing = True
                    self._sink.wait_writable(self._on_writable)
                return
            rounds -= 1
            if not rounds:
                return  # busy flow: keep the buffer, let others run
            if n < size and n < _SPECULATE_MIN and not as_writer:
                if size < _JUMBO_BUFFER_SIZE:
                    self._buf = None  # source looks drained: hold no buffer while idle
                return
            if size < _JUMBO_BUFFER_SIZE and self._may_grow():
                buf = self._buf = memoryview(bytearray(_JUMBO_BUFFER_SIZE))
                size = _JUMBO_BUFFER_SIZE

    def _remove_callbacks(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._src_fd)
        if self._writing:
            self._writing = False
            self._sink.cancel_wait()

    def _shutdown_dst(self) -> None:
        self._sink.shutdown_write()

    def stop(self) -> None:
        self._remove_callbacks()
        if self._jumbo:
            self._jumbo = False
            self._buf = None
            pool = self._session.pipes
            if pool is not None:
                pool.release(_JUMBO_BUFFER_SIZE)

    @property
    def _dst_is_socket(self) -> bool:
        return type(self._sink) is _SocketSink


class _Session:
    """Both directions of one proxied connection; resolves ``done`` exactly once."""

    __slots__ = (
        "_moved",
        "_open",
        "counters",
        "directions",
        "done",
        "down",
        "error",
        "error_side",
        "loop",
        "pipes",
        "up",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        down: socket.socket,
        up: socket.socket,
        counters: CopyCounters,
    ) -> None:
        self.loop = loop
        self.down = down
        self.up = up
        self.counters = counters
        self.done: asyncio.Future[None] = loop.create_future()
        self.error: OSError | None = None
        self.error_side: Side | None = None
        self.directions: list[_Direction] = []
        self.pipes: PipePool | None = None
        self._moved = (0, 0)
        self._open = 2

    def start(self, pipes: PipePool | None) -> None:
        down, up = self.down, self.up
        self.pipes = pipes
        if pipes is not None:
            self.directions = [
                _SpliceDirection(self, down, up, True, pipes),
                _SpliceDirection(self, up, down, False, pipes),
            ]
        else:
            self.directions = [
                _BufferedDirection(self, down, up, True),
                _BufferedDirection(self, up, down, False),
            ]
        for d in self.directions:
            d.start()

    def fall_back_to_buffered(self, old: _Direction) -> None:
        """Swap a splice direction (that holds no pipe) for a buffered one, keeping its byte count."""
        old.stop()
        new = _BufferedDirection(self, old._src, old._dst, old._fwd)
        new.moved = old.moved
        self.directions[self.directions.index(old)] = new
        new.start()

    def direction_done(self) -> None:
        self._open -= 1
        if self._open == 0:
            self._end(abort=False)

    def fail(self, error: OSError, side: Side) -> None:
        if self.done.done():
            return
        self.error = error.with_traceback(None)
        self.error_side = side
        self._end(abort=True)

    def cancel(self) -> None:
        """The awaiting task was cancelled: tear down abortively (the stream is truncated)."""
        self._end(abort=True)

    def _end(self, *, abort: bool) -> None:
        # Callbacks first, then fds: never close an fd that is still registered with the loop.
        for d in self.directions:
            d.stop()
        # No reference cycles outlive the connection (issue 18): the directions point back at the
        # session, so the session lets go of them (keeping their byte counts), and an error keeps
        # no traceback (its frames hold a direction). Refcounting frees all of it, no GC needed.
        if self.directions:
            fwd, rev = self.directions
            self._moved = (fwd.moved, rev.moved)
            self.directions = []
        for sock in (self.down, self.up):
            _close_socket(sock, abort)
        if not self.done.done():
            self.done.set_result(None)

    def result(self) -> CopyResult:
        if self.directions:  # still running
            fwd, rev = self.directions
            return CopyResult(fwd.moved, rev.moved, self.error, self.error_side)
        return CopyResult(*self._moved, self.error, self.error_side)


def _close_socket(sock: socket.socket, abort: bool) -> None:
    # (try/except rather than contextlib.suppress: no context manager object per socket)
    if abort:
        try:  # noqa: SIM105
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        except OSError:
            pass
    try:  # noqa: SIM105
        sock.close()
    except OSError:
        pass


async def copy_bidirectional(
    downstream: socket.socket,
    upstream: socket.socket,
    *,
    pipes: PipePool | None,
    counters: CopyCounters | None = None,
) -> CopyResult:
    """Copy bytes both ways between two connected sockets until both directions end; close both.

    ``pipes`` selects the path: a ``PipePool`` means zero-copy ``splice`` through pooled pipes;
    ``None`` means the buffered ``recv_into``/``send`` path. ``counters`` (optional) is updated per
    chunk as bytes are written, for live metrics.

    Returns when both directions reached EOF (each half-closed the other side), or on the first
    socket error (both sockets then closed abortively; the error is in the result, not raised).
    Cancelling the call closes both sockets abortively and releases every pipe.
    """
    loop = asyncio.get_running_loop()
    session = _Session(
        loop, downstream, upstream, counters if counters is not None else CopyCounters()
    )
    try:
        # (getblocking() reads the socket object only; setblocking() is an ioctl every time, and
        # the proxy's sockets are non-blocking already)
        if downstream.getblocking():
            downstream.setblocking(False)
        if upstream.getblocking():
            upstream.setblocking(False)
        session.start(pipes)
    except BaseException:
        session.cancel()
        raise
    try:
        await session.done
    except asyncio.CancelledError:
        session.cancel()
        raise
    return session.result()
