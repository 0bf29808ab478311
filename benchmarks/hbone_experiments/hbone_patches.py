"""Prototype data-path changes for HBONE, applied by monkeypatching inside *benchmark* ztunnels only.

They exist to measure what a change would buy before anyone edits ``ztunnel/``; they are not product
code and are never imported by it. ``ZT_BENCH_PATCH`` is a comma-separated list of:

* ``tx_inplace``: sender. ``recv_into`` one reused buffer, 9 bytes in, write the DATA frame header
  in front with ``struct.pack_into`` and hand ``SSLObject.write`` one memoryview: one DATA frame per
  TCP read (<= the peer's MAX_FRAME_SIZE). Removes the per-read ``recv`` bytes allocation and the
  ``b"".join`` of the frame list in ``HboneConnection.flush``.
* ``rx_sendmsg``: receiver. Consecutive DataReceived events of one stream from one decrypted batch
  go out in one ``sendmsg`` (instead of one ``send`` per DATA frame) and one acknowledgement.
* ``big_frames``: the product path with DATA frames of up to 1 MiB instead of 64 KiB
  (``H2Connection(send_frame_size=...)``, capped by the peer's MAX_FRAME_SIZE): one frame per TCP
  read, so the receiver handles fewer, larger DATA events.
* ``sslsocket``: TLS on the socket itself (OpenSSL socket BIO) instead of ``SSLObject`` + memory
  BIOs: the handshake runs on a non-blocking ``SSLSocket`` over a dup of the connection's fd, then
  ``HboneConnection`` encrypts straight to the kernel (``SSLSocket.write``, retried with the same
  bytes after SSLWantWriteError) and decrypts straight from it (``SSLSocket.recv_into`` per
  record). Removes the ciphertext copies into/out of the BIOs and the per-flush ciphertext bytes.
* ``no_verify_cb``: the product path without the OpenSSL verify callback that makes the
  trust-domain and CRL checks inside the handshake (``ztunnel/identity/osslverify.py``).
* ``mallopt``: call glibc ``mallopt`` at start-up (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD)
  so large transient buffers are reused instead of brk/munmap'ed and re-faulted every flush.

``ZT_BENCH_TUNE="module:NAME=int;..."`` overrides module constants (e.g. transport:_RECV_SIZE).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import ssl
import struct
from typing import Any

_HDR = struct.Struct(">IBI")


def apply_from_env() -> None:
    for kv in filter(None, os.environ.get("ZT_BENCH_TUNE", "").split(";")):
        target, value = kv.split("=")
        mod, name = target.split(":")
        setattr(importlib.import_module(f"ztunnel.hbone.{mod}"), name, int(value))
    for name in filter(None, os.environ.get("ZT_BENCH_PATCH", "").split(",")):
        {
            "tx_inplace": tx_inplace,
            "rx_sendmsg": rx_sendmsg,
            "mallopt": mallopt,
            "big_frames": big_frames,
            "sslsocket": sslsocket,
            "no_verify_cb": no_verify_cb,
        }[name]()


def no_verify_cb() -> None:
    """The product path without the in-handshake verify callback (identity/osslverify.py):
    measures what the trust-domain / CRL hook costs."""
    from ztunnel.identity import osslverify

    osslverify.install = lambda ctx, check: False  # type: ignore[assignment]


def big_frames() -> None:
    from ztunnel.hbone import h2conn as h2

    kw = h2.H2Connection.__init__.__kwdefaults__
    assert kw is not None
    kw["send_frame_size"] = 1 << 20


def mallopt() -> None:
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # fixed: no dynamic threshold games
    libc.mallopt(m_trim_threshold, 128 << 20)
    libc.mallopt(m_top_pad, 16 << 20)


def tx_inplace() -> None:
    from ztunnel.hbone import h2conn as h2
    from ztunnel.hbone import transport as tr

    orig = tr.StreamBridge._on_tcp_readable
    read_size = tr._TCP_READ
    buf = bytearray(9 + read_size)
    view = memoryview(buf)

    batch = getattr(tr, "_READ_BATCH", 1)  # the product reads until EAGAIN in batches

    def _on_tcp_readable(self: Any) -> None:
        conn = self.conn
        h2c = conn.h2
        for _ in range(batch):
            if self.done.done() or (batch > 1 and not self._reading):
                return
            st = h2c._streams.get(self.stream_id)
            if conn.write_blocked or st is None or st.local_closed or h2c._closed:
                orig(self)
                return
            window = min(st.send_window, h2c._conn_send_window)
            if window <= 0:
                self._pause_reading()
                return
            size = min(window, read_size, h2c._remote.max_frame_size)
            try:
                n = self.sock.recv_into(view[9 : 9 + size])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.abort(e)
                return
            if not n:
                self._pause_reading()
                self._tcp_eof = True
                with contextlib.suppress(h2.ProtocolError):
                    h2c.end_stream(self.stream_id)
                conn.flush()
                self._check_done()
                return
            _HDR.pack_into(buf, 0, n << 8, 0, self.stream_id)  # DATA, no flags
            st.send_window -= n
            h2c._conn_send_window -= n
            self.tcp_to_h2 += n
            self.counters.down_to_up += n
            queued = h2c.data_to_send()
            tls_write = getattr(conn, "_tls_write", None)  # the sslsocket experiment
            if tls_write is not None:
                if queued:
                    tls_write(b"".join(queued))
                tls_write(view[: 9 + n], copy=True)
                continue
            try:
                if queued:
                    conn.sslobj.write(b"".join(queued))
                conn.sslobj.write(view[: 9 + n])
            except ssl.SSLError as e:
                conn._fail(e)
                return
            conn.flush()
        if batch > 1:
            conn.loop.call_soon(self._on_tcp_readable)

    tr.StreamBridge._on_tcp_readable = _on_tcp_readable


def rx_sendmsg() -> None:
    from ztunnel.hbone import h2conn as h2
    from ztunnel.hbone import transport as tr

    orig_dispatch = tr.HboneConnection._dispatch
    data_t = h2.DataReceived

    def on_data_batch(b: Any, evs: list[Any]) -> None:
        if b.done.done():
            return
        if b._pending:
            for ev in evs:
                b.on_data(ev.data, ev.flow_controlled_length)
            return
        try:
            sent = b.sock.sendmsg([ev.data for ev in evs])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            b.abort(e)
            return
        b.h2_to_tcp += sent
        b.counters.up_to_down += sent
        ack = 0
        for k, ev in enumerate(evs):
            size = len(ev.data)
            if sent >= size:
                sent -= size
                ack += ev.flow_controlled_length
                continue
            rest = [memoryview(ev.data)[sent:], *(e.data for e in evs[k + 1 :])]
            flow = sum(e.flow_controlled_length for e in evs[k:])
            b._pending.append(tr._PendingWrite(memoryview(b"".join(rest)), flow))
            if not b._writer_armed:
                b.conn.loop.add_writer(b.fd, b._on_tcp_writable)
                b._writer_armed = True
            break
        if ack:
            b.conn.h2.acknowledge_received_data(b.stream_id, ack)

    def _dispatch(self: Any, events: list[Any]) -> None:
        n = len(events)
        i = 0
        while i < n:
            ev = events[i]
            j = i + 1
            if type(ev) is data_t:
                sid = ev.stream_id
                while j < n and type(events[j]) is data_t and events[j].stream_id == sid:
                    j += 1
                b = self._bridges.get(sid)
                if j - i > 1 and b is not None:
                    on_data_batch(b, events[i:j])
                    i = j
                    continue
            else:
                while j < n and type(events[j]) is not data_t:
                    j += 1
            orig_dispatch(self, events[i:j])
            i = j

    tr.HboneConnection._dispatch = _dispatch


class _NoBio:
    """Stands in for the memory BIOs when TLS runs on the socket (nothing is ever pending)."""

    pending = 0

    def read(self, n: int = -1) -> bytes:
        return b""

    def write(self, data: Any) -> int:
        raise RuntimeError("no memory BIO in sslsocket mode")


def sslsocket() -> None:
    import asyncio
    import socket
    import time

    from ztunnel.hbone import transport as tr

    async def _wait(fd: int, write: bool) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        add, remove = (
            (loop.add_writer, loop.remove_writer)
            if write
            else (loop.add_reader, loop.remove_reader)
        )
        add(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            remove(fd)

    async def tls_handshake(
        sock: socket.socket,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        timeout: float = tr._HANDSHAKE_TIMEOUT,
    ) -> tuple[Any, Any, Any]:
        dup = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        dup.setblocking(False)
        try:
            ss = ctx.wrap_socket(dup, server_side=server_side, do_handshake_on_connect=False)
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        ss.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        await _wait(sock.fileno(), False)
                    except ssl.SSLWantWriteError:
                        await _wait(sock.fileno(), True)
        except BaseException:
            dup.close()
            raise
        return ss, _NoBio(), _NoBio()

    tr.tls_handshake = tls_handshake
    conn_cls = tr.HboneConnection
    orig_init = conn_cls.__init__
    orig_teardown = conn_cls._teardown

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._tls_pending = None
        self._tls_queue = []
        orig_init(self, *args, **kwargs)

    def _arm(self: Any) -> None:
        if not self._writer_armed:
            self.loop.add_writer(self.fd, self._on_writable)
            self._writer_armed = True

    def _tls_write(self: Any, data: Any, copy: bool = False) -> None:
        if self.closed.done():
            return
        if self._tls_pending is not None:
            self._tls_queue.append(bytes(data) if copy else data)
            self._out_size += len(data)
            return
        try:
            self.sslobj.write(data)
        except ssl.SSLWantWriteError:
            # OpenSSL has sent part of it: retry later with exactly the same bytes
            self._tls_pending = bytes(data) if copy else data
            self._out_size += len(data)
            _arm(self)
        except (ssl.SSLError, OSError) as e:
            self._fail(e)

    def flush(self: Any) -> None:
        if self.closed.done():
            return
        bufs = self.h2.data_to_send()
        if bufs:
            self._tls_write(bufs[0] if len(bufs) == 1 else b"".join(bufs))

    def _on_writable(self: Any) -> None:
        while self._tls_pending is not None:
            data = self._tls_pending
            try:
                self.sslobj.write(data)
            except ssl.SSLWantWriteError:
                return
            except (ssl.SSLError, OSError) as e:
                self._fail(e)
                return
            self._out_size -= len(data)
            self._tls_pending = None
            if self._tls_queue:
                queued, self._tls_queue = self._tls_queue, []
                joined = b"".join(queued)
                self._out_size -= len(joined)
                self._tls_write(joined)
        self.loop.remove_writer(self.fd)
        self._writer_armed = False
        if self._blocked_bridges:
            blocked, self._blocked_bridges = self._blocked_bridges, set()
            for b in blocked:
                b._resume_reading()

    def _read_and_dispatch(self: Any) -> bool:
        """Decrypt records until the socket is drained; False: nothing more to read now."""
        if getattr(self, "_closing", False) or self.closed.done():
            return False
        plain = self._plain_view
        size = len(plain)
        got = 0
        ss = self.sslobj
        while True:
            try:
                k = ss.recv_into(plain[got:], size - got)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                k = 0
            except (ssl.SSLError, OSError) as e:
                if got:
                    self._feed(plain[:got])
                self._fail(e)
                return False
            if k == 0:
                if got:
                    self._feed(plain[:got])
                self._fail(tr.ConnectionLost("peer closed the connection"))
                return False
            got += k
            if got == size:
                self._feed(plain[:got])
                got = 0
                if self.closed.done():
                    return False
        if got:
            self._feed(plain[:got])
        self.last_active = time.monotonic()
        self.flush()
        return False

    def _teardown(self: Any, error: BaseException | None) -> None:
        orig_teardown(self, error)
        with contextlib.suppress(OSError):
            self.sslobj.close()

    conn_cls.__init__ = __init__
    conn_cls._tls_write = _tls_write
    conn_cls.flush = flush
    conn_cls._on_writable = _on_writable
    conn_cls._read_and_dispatch = _read_and_dispatch
    conn_cls._teardown = _teardown
