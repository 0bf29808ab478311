"""ZDS client: connect to the node agent's SEQPACKET socket, say hello, apply each request, answer it.

ztunnel is the client of istio-cni's ZDS server (reference 3.1, 3.3). One connection at a time:
connect to ``INPOD_UDS``, send a bare ``ZdsHello{V1}``, then for every record received decode it
(``protocol.decode_request``), check it against the session rules (``protocol.ZdsSession``),
carry out the decision through a ``WorkloadHandler`` and send exactly one ``WorkloadResponse``,
in order. A protocol violation is NACKed with its reason and ends the connection; the client then
reconnects with capped exponential backoff, and the new connection starts a new snapshot.

Runs on the event loop with a non-blocking socket driven by ``add_reader``/``add_writer`` and
``recvmsg`` (no threads), on stdlib asyncio and on uvloop.

Ownership: the netns fd of an ``Add`` passes to ``WorkloadHandler.add`` at the call, whatever
the call returns or raises; every other received fd is closed here. Proxies belong to the
handler: disconnecting (or cancelling ``run``) never stops them; the next snapshot reconciles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable
from typing import Final, Protocol

from ztunnel.inpod.protocol import (
    MAX_FDS,
    MAX_RECORD_SIZE,
    Decision,
    KeepProxy,
    Reconcile,
    StartProxy,
    StopProxy,
    WorkloadInfo,
    ZdsProtocolError,
    ZdsSession,
    check_netns_fd,
    decode_request,
    encode_ack,
    encode_hello,
    fds_from_ancdata,
)

log = logging.getLogger("ztunnel.inpod")

DEFAULT_INPOD_UDS: Final = "/var/run/ztunnel/ztunnel.sock"
PENDING_RETRY_INTERVAL: Final = 5.0
"""How often the handler should retry a workload whose proxy failed to start (reference 3.3)."""

_CMSG_BUFSIZE: Final = socket.CMSG_SPACE(MAX_FDS * 4)
_TRUNCATED: Final = socket.MSG_TRUNC | socket.MSG_CTRUNC


class WorkloadHandler(Protocol):
    """What the client asks of the per-pod proxy manager (the lead's in-pod state manager).

    Each call is awaited before the answer to its request is sent, so the node agent's view
    (ACK = the pod is served) is true when it gets the ACK. Raising is a bug: the client NACKs
    with the exception text and reconnects, which re-sends the snapshot.
    """

    async def add(self, uid: str, info: WorkloadInfo, netns_fd: int) -> str | None:
        """Start the proxy for pod ``uid`` in ``netns_fd``; None when it runs, else the reason.

        Takes ownership of ``netns_fd`` (close it when the proxy is gone, or at once if not
        needed). Same uid and same netns (``protocol.netns_identity``) is a no-op success; same
        uid, other netns: stop the old proxy, start a new one. On failure (e.g. a bind error)
        return the reason: the client NACKs it and stays connected, and the handler keeps the
        pod *pending* and retries it every ``PENDING_RETRY_INTERVAL`` seconds by itself. It is
        not ready while anything is pending.
        """
        ...

    async def keep(self, uid: str) -> None:
        """Snapshot only: the agent has no netns for ``uid``; keep its proxy if there is one."""
        ...

    async def delete(self, uid: str) -> None:
        """Pod ``uid`` is gone: stop its proxy now (drain Immediate) and drop any pending retry.

        Idempotent (unknown uids are fine). Also called for a delete before the snapshot ends;
        upstream then only forgets the uid and lets the reconcile stop it, same end state."""
        ...

    async def reconcile(self, named_uids: frozenset[str]) -> None:
        """End of snapshot: stop (drain Immediate) every proxy and pending retry whose uid is
        not in ``named_uids`` (``protocol.Reconcile.to_stop`` computes that set)."""
        ...


class Backoff:
    """Capped exponential backoff with jitter: ``initial`` x ``factor`` ... up to ``cap``.

    ``next()`` returns the delay to sleep now (the current step +/- ``jitter``, never above
    ``cap``) and moves to the next step; ``reset()`` goes back to ``initial``.
    """

    def __init__(
        self,
        initial: float = 0.010,
        factor: float = 2.0,
        cap: float = 15.0,
        jitter: float = 0.2,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if initial <= 0 or factor < 1 or cap < initial or not 0 <= jitter < 1:
            raise ValueError("backoff needs 0 < initial <= cap, factor >= 1, 0 <= jitter < 1")
        self.initial = initial
        self.factor = factor
        self.cap = cap
        self.jitter = jitter
        self._rand = rand
        self._step = initial

    def next(self) -> float:
        delay = self._step * (1.0 + self.jitter * (2.0 * self._rand() - 1.0))
        self._step = min(self.cap, self._step * self.factor)
        return min(self.cap, delay)

    def reset(self) -> None:
        self._step = self.initial


class ZdsHandlerError(Exception):
    """The ``WorkloadHandler`` raised; the request was NACKed and the connection is dropped."""


class ZdsClient:
    """The ZDS connection to the node agent, reconnecting forever until cancelled.

    ``on_snapshot_done()`` runs once per connection, after the SnapshotSent was reconciled and
    ACKed; ``on_disconnected()`` after a connection that had said hello ends. Readiness
    (reference 3.3.6) = snapshot done and no pending workload (the handler knows the latter).
    """

    def __init__(
        self,
        path: str,
        handler: WorkloadHandler,
        *,
        on_snapshot_done: Callable[[], None] | None = None,
        on_disconnected: Callable[[], None] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.path = path
        self.handler = handler
        self.on_snapshot_done = on_snapshot_done
        self.on_disconnected = on_disconnected
        self.backoff = backoff or Backoff()
        self._connected = False
        self._snapshot_done = False
        self.connections = 0  # connections that said hello, for logs and tests

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def snapshot_done(self) -> bool:
        """True once this connection's snapshot was reconciled; False again on disconnect."""
        return self._snapshot_done

    async def run(self) -> None:
        """Connect, serve, reconnect after ``backoff.next()``; returns only by cancellation.

        Every reconnect waits the next backoff step; a completed snapshot resets the backoff,
        so after a healthy session the first retry comes after ~10 ms.
        """
        while True:
            try:
                sock = await self.connect()
            except OSError as e:
                delay = self.backoff.next()
                log.warning(
                    "failed to connect to the Istio CNI node agent over %s, is the node agent "
                    "healthy? (%s) retrying in %.3fs",
                    self.path,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            try:
                await self.serve(sock)
                log.info("zds: node agent closed the connection")
            except ZdsProtocolError as e:
                log.warning("zds: protocol error, reconnecting: %s", e)
            except ZdsHandlerError as e:
                log.error("zds: handler failed, reconnecting: %s", e)
            except OSError as e:
                log.warning("zds: connection to the node agent failed: %s", e)
            finally:
                sock.close()
            delay = self.backoff.next()
            log.info("zds: reconnecting in %.3fs", delay)
            await asyncio.sleep(delay)

    async def connect(self) -> socket.socket:
        """A non-blocking SEQPACKET socket connected to ``path`` (raises OSError)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    async def serve(self, sock: socket.socket) -> None:
        """Run one ZDS session on a connected SEQPACKET socket; the caller closes it.

        Returns on EOF. Raises ``ZdsProtocolError`` (after NACKing) when the agent breaks the
        protocol, ``ZdsHandlerError`` when the handler raised, ``OSError`` on socket errors.
        """
        sock.setblocking(False)
        session = ZdsSession()
        await self._send(sock, encode_hello())
        self._connected = True
        self.connections += 1
        log.info("zds: connected to the node agent at %s, hello sent", self.path)
        try:
            while True:
                record = await self._recv(sock)
                if record is None:
                    return
                data, fds, flags = record
                try:
                    decision = session.handle(decode_request(data, fds, msg_flags=flags))
                except ZdsProtocolError as e:
                    with contextlib.suppress(OSError):
                        await self._send(sock, encode_ack(f"failure to read message: {e}"))
                    raise
                try:
                    error = await self._apply(decision)
                except ZdsHandlerError as e:
                    with contextlib.suppress(OSError):
                        await self._send(sock, encode_ack(f"failure to process message: {e}"))
                    raise
                await self._send(sock, encode_ack(error))
                if isinstance(decision, Reconcile):
                    self._snapshot_done = True
                    self.backoff.reset()
                    log.info("zds: snapshot reconciled (%d named)", len(decision.named_uids))
                    if self.on_snapshot_done is not None:
                        self.on_snapshot_done()
        finally:
            self._connected = False
            self._snapshot_done = False
            if self.on_disconnected is not None:
                self.on_disconnected()

    async def _apply(self, decision: Decision) -> str | None:
        """Carry out one decision through the handler; the NACK text, or None for an ACK."""
        try:
            if isinstance(decision, StartProxy):
                reason = check_netns_fd(decision.netns_fd)
                if reason is not None:
                    log.warning("zds: add %s: netns fd check failed: %s", decision.uid, reason)
                log.info(
                    "zds: pod received, starting proxy uid=%s name=%s namespace=%s",
                    decision.uid,
                    decision.workload_info.name,
                    decision.workload_info.namespace,
                )
                error = await self.handler.add(
                    decision.uid, decision.workload_info, decision.netns_fd
                )
                if error:
                    log.warning("zds: failed to start proxy uid=%s: %s", decision.uid, error)
                    return f"failure to start proxy: {error}"
                return None
            if isinstance(decision, KeepProxy):
                log.info("zds: pod keep received uid=%s", decision.uid)
                await self.handler.keep(decision.uid)
            elif isinstance(decision, StopProxy):
                log.info("zds: pod delete received uid=%s", decision.uid)
                await self.handler.delete(decision.uid)
            else:
                await self.handler.reconcile(decision.named_uids)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("zds: handler failed on %s", type(decision).__name__)
            raise ZdsHandlerError(f"{type(e).__name__}: {e}") from e
        return None

    async def _recv(self, sock: socket.socket) -> tuple[bytes, list[int], int] | None:
        """One record with its fds and flags, or None at EOF."""
        while True:
            try:
                data, ancdata, flags, _ = sock.recvmsg(
                    MAX_RECORD_SIZE, _CMSG_BUFSIZE, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                await _wait_ready(sock, write=False)
                continue
            fds = fds_from_ancdata(ancdata)
            if not data and not fds and not flags & _TRUNCATED:
                return None
            return data, fds, flags

    async def _send(self, sock: socket.socket, data: bytes) -> None:
        while True:
            try:
                sock.send(data)  # SEQPACKET: the whole record or nothing
                return
            except (BlockingIOError, InterruptedError):
                await _wait_ready(sock, write=True)


async def _wait_ready(sock: socket.socket, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    fd = sock.fileno()
    if write:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
