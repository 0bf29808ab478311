"""The HBONE connection pool: reuse mTLS HTTP/2 connections across tunnelled TCP connections.

Key = (source identity, expected destination identities, source IP, destination address), as in
ztunnel's ``WorkloadKey``. A connection takes streams until it holds
min(``POOL_MAX_STREAMS_PER_CONNECTION``, the peer's SETTINGS_MAX_CONCURRENT_STREAMS); then a new
one is dialled. Only one dial per key runs at a time; callers arriving meanwhile wait and then
share it. A connection that breaks or gets GOAWAY leaves the pool at once; one with no streams
for ``idle_timeout`` is closed. A caller whose stream a connection refused asks again, avoiding
that one (``checkout(avoid=...)``: RFC 9113 8.7, see ``proxy/hbone_outbound.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from ztunnel.core.addr import IPAddr, SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.hbone.transport import HboneConnection

log = logging.getLogger("ztunnel.hbone.pool")


@dataclass(frozen=True, slots=True)
class WorkloadKey:
    src_identity: Identity
    dst_identities: tuple[Identity, ...]
    src_ip: IPAddr | None
    dst: SocketAddr


Dialer = Callable[[WorkloadKey], Awaitable[HboneConnection]]


class ConnectionPool:
    def __init__(
        self, dial: Dialer, *, max_streams: int = 100, idle_timeout: float = 300.0
    ) -> None:
        self._dial = dial
        self.max_streams = max_streams
        self.idle_timeout = idle_timeout
        self._conns: dict[WorkloadKey, list[HboneConnection]] = {}
        self._locks: dict[WorkloadKey, asyncio.Lock] = {}
        # The idle clock: when each connection last went idle (none while it has streams), and
        # at most one armed timer per connection. A timer that finds its connection busy again
        # just lapses, and one that fires early (the connection was used meanwhile) re-arms for
        # the rest, so a stream ending on an idle-prone connection arms no timer of its own
        # (one call_later and one cancel per stream otherwise).
        self._idle_since: dict[HboneConnection, float] = {}
        self._idle: dict[HboneConnection, asyncio.TimerHandle] = {}
        self.dials = 0

    def _capacity(self, conn: HboneConnection) -> int:
        peer = conn.h2.remote_max_concurrent_streams
        limit = self.max_streams if peer is None else min(self.max_streams, peer)
        return limit - conn.active_streams

    def _usable(self, conn: HboneConnection) -> bool:
        return not conn.closed.done() and not conn.goaway and self._capacity(conn) > 0

    def _take(self, key: WorkloadKey, avoid: Collection[HboneConnection]) -> HboneConnection | None:
        for conn in self._conns.get(key, ()):
            if self._usable(conn) and conn not in avoid:
                conn.reserve()
                self._idle_since.pop(conn, None)  # busy (an armed timer lapses)
                return conn
        return None

    async def checkout(
        self, key: WorkloadKey, avoid: Collection[HboneConnection] = ()
    ) -> HboneConnection:
        """A connection with one stream reserved for the caller (open it with
        ``open_stream(..., reserved=True)`` or give it back with ``conn.release()``), other than
        those in ``avoid`` (connections that refused the caller's stream: a new one is dialled
        if no other is usable)."""
        conn = self._take(key, avoid)
        if conn is not None:
            return conn
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._take(key, avoid)
            if conn is not None:
                return conn
            self.dials += 1
            try:
                conn = await self._dial(key)
            except BaseException:
                # Forget the lock of a destination we could not reach, or failing keys pile up.
                if key not in self._conns:
                    self._locks.pop(key, None)
                raise
            self._conns.setdefault(key, []).append(conn)
            conn.closed.add_done_callback(functools.partial(self._on_closed, key, conn))
            conn.reserve()
            return conn

    def stream_done(self, conn: HboneConnection) -> None:
        """A stream on ``conn`` ended: start the idle clock if it was the last."""
        if conn.active_streams == 0 and not conn.closed.done():
            if conn.goaway:
                conn.close()
                return
            loop = asyncio.get_running_loop()
            self._idle_since[conn] = loop.time()
            if conn not in self._idle:
                self._idle[conn] = loop.call_later(self.idle_timeout, self._expire, conn)

    def _expire(self, conn: HboneConnection) -> None:
        self._idle.pop(conn, None)
        since = self._idle_since.get(conn)
        if since is None or conn.active_streams:
            return  # in use: the end of its last stream arms the clock again
        loop = asyncio.get_running_loop()
        left = since + self.idle_timeout - loop.time()
        if left > 0:  # used and idle again since this timer was armed
            self._idle[conn] = loop.call_later(left, self._expire, conn)
            return
        del self._idle_since[conn]
        log.debug("closing idle HBONE connection")
        conn.close()

    def _cancel_idle(self, conn: HboneConnection) -> None:
        self._idle_since.pop(conn, None)
        timer = self._idle.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def _on_closed(self, key: WorkloadKey, conn: HboneConnection, _f: object) -> None:
        self._cancel_idle(conn)
        conns = self._conns.get(key)
        if conns and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._conns[key]
                lock = self._locks.get(key)
                if lock is not None and not lock.locked():
                    del self._locks[key]

    def connections(self, key: WorkloadKey | None = None) -> list[HboneConnection]:
        if key is not None:
            return list(self._conns.get(key, ()))
        return [c for cs in self._conns.values() for c in cs]

    def close(self) -> None:
        for conn in self.connections():
            conn.close()
        for timer in self._idle.values():
            timer.cancel()
        self._idle.clear()
        self._idle_since.clear()
