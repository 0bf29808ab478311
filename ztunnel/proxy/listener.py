"""TCP accept loops that own their connection tasks: accept, dispatch, stop, drain.

A ``Listener`` accepts in batches from a non-blocking listening socket driven by ``add_reader``
(cheaper than one ``sock_accept`` future per connection) and runs one task per connection. It owns
those tasks: ``stop_accepting()`` closes the socket at once (so a new ztunnel bound with
SO_REUSEPORT takes new connections), ``drain(deadline)`` lets running connections finish and cancels
what is left at the deadline. Running out of file descriptors backs off instead of crashing, and a
connection accepted within the fd reserve (``net/fdbudget.py``) is closed at once with a RST,
counted (``refused``) and logged at most once a second, before it can cost anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ztunnel.net.fdbudget import FdBudget

log = logging.getLogger("ztunnel.proxy")

# ``handler(conn)``, or ``handler(conn, peer)`` with ``pass_peer`` (the address accept()
# returned: getpeername fails on a connection reset before it is handled).
Handler = Callable[..., Coroutine[Any, Any, None]]

_ACCEPT_BATCH = 64
_FD_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_EMFILE_BACKOFF = 0.1
_LINGER_RST = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # SO_LINGER on, 0 s: close sends RST


def _not_started() -> tuple[int, Any]:
    raise RuntimeError("the listener is not started")


class Listener:
    """Accepts connections on ``sock`` and runs ``handler(conn)`` for each in a task it owns."""

    def __init__(self, sock: socket.socket, handler: Handler, name: str) -> None:
        self.sock = sock
        self.name = name
        self._handler = handler
        self._tasks: dict[asyncio.Task[None], socket.socket] = {}  # task -> its socket
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._resume: asyncio.TimerHandle | None = None
        # One contextvars.Context for every connection task and its done callback, instead of
        # two copies (64 bytes each) per connection: nothing in the proxy sets context variables,
        # and a task only enters its context for one step at a time (no eager tasks on 3.11).
        self._context = contextvars.Context()
        self.accepted = 0
        self.refused = 0  # closed at once: the fd budget was exhausted
        self._refused_logged = 0.0
        self.budget: FdBudget | None = None
        self.pass_peer = False
        self.on_refused: Callable[[], None] | None = None  # a connection refused (fd budget)
        self.on_socket: Callable[[bool], None] | None = None  # accepted (True) / closed (False)
        self._accept: Callable[[], tuple[int, Any]] = _not_started  # sock._accept once started
        self._sock_args = (0, 0, 0)  # the accepted sockets' family, type and protocol

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    @property
    def active(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        # socket.accept() builds the accepted socket from the listener's family and type
        # properties, each an enum conversion per call: taken once here instead.
        sock = self.sock
        self._accept = sock._accept  # type: ignore[attr-defined]
        self._sock_args = (int(sock.family), int(sock.type), sock.proto)
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._accepting = True
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        accept = self._accept
        family, type_, proto = self._sock_args
        for _ in range(_ACCEPT_BATCH):
            try:
                fd, addr = accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _FD_EXHAUSTED:
                    log.warning("%s: accept failed (%s); pausing accepts", self.name, e)
                    self._pause_accepting()
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.error("%s: accept failed: %s", self.name, e)
                return
            conn = socket.socket(family, type_, proto, fd)
            if self.budget is not None and not self.budget.admit(conn.fileno()):
                self._refuse(conn)
                continue
            # (TCP_NODELAY, the mark and keepalive come with the connection from the listening
            # socket: ``SocketFactory.listener`` sets them there once.)
            conn.setblocking(False)
            self.accepted += 1
            self._spawn(conn, addr)

    def _refuse(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        conn.close()
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused()
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:
            self._refused_logged = now
            log.warning(
                "%s: file descriptor budget exhausted; refusing new connections (%d so far)",
                self.name,
                self.refused,
            )

    def _spawn(self, conn: socket.socket, addr: Any = None) -> None:
        # The handler's coroutine is the task itself (no wrapper coroutine: a connection's
        # coroutines live as long as it does, so each frame counts); _on_done is the wrapper.
        assert self._loop is not None
        if self.on_socket is not None:
            self.on_socket(True)
        ctx = self._context
        try:
            coro = self._handler(conn, addr) if self.pass_peer else self._handler(conn)
            task = self._loop.create_task(coro, context=ctx)
        except BaseException:
            self._closed(conn)
            raise
        self._tasks[task] = conn
        task.add_done_callback(self._on_done, context=ctx)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        conn = self._tasks.pop(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s: connection handler failed", self.name, exc_info=exc)
        self._closed(conn)

    def _closed(self, conn: socket.socket) -> None:
        # Handlers normally hand the socket to the copy engine, which closes it; this is the
        # safety net for early failures. close() on a closed socket is a no-op.
        conn.close()
        if self.on_socket is not None:
            self.on_socket(False)

    def _pause_accepting(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.sock.fileno())
        self._resume = self._loop.call_later(_EMFILE_BACKOFF, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._accepting and self._loop is not None:
            self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def stop_accepting(self) -> None:
        """Close the listening socket now; running connections continue."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._accepting and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self._accepting = False
        self.sock.close()

    async def drain(self, deadline: float | None) -> int:
        """Wait up to ``deadline`` seconds (None: no limit) for running connections, then cancel
        the rest.

        Returns how many were cut."""
        self.stop_accepting()
        if not self._tasks:
            return 0
        _done, pending = await asyncio.wait(set(self._tasks), timeout=deadline)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    async def close(self) -> None:
        """Stop at once: no grace period (a deleted pod)."""
        await self.drain(0)
