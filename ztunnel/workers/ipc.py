"""The supervisor <-> worker channel: framed, pickled messages over a private AF_UNIX stream
socketpair, with file descriptors passed beside them (SCM_RIGHTS).

A frame is ``!II`` (payload length, fd count) then the pickled message. The fds of a frame are
sent with its first byte, so they arrive with or before the frame's last byte: the receiver
queues every fd it gets and hands a frame the next ``count`` of them. Both ends are our own
processes (forked from one image, joined by a socketpair nobody else holds), so pickle is safe
here; nothing a pod, istiod or the node agent sends is unpickled.

Sending never blocks: frames queue in memory and the loop writes them when the socket is
writable. The fds of a queued frame are duplicated on ``send``, so the caller may close its own
at once.
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
import os
import pickle
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("ztunnel.workers")

_HEADER = struct.Struct("!II")
MAX_FDS_PER_FRAME = 64  # a pod's listeners and netns are 8 at most
MAX_FRAME = 256 * 1024 * 1024  # a state snapshot of a very large mesh
_RECV_SIZE = 256 * 1024
_ANC_SIZE = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * array.array("i").itemsize)

Handler = Callable[[Any, list[int]], None]


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class ChannelClosed(Exception):
    """The other end is gone."""


class Channel:
    """One end of a supervisor <-> worker socketpair on the running loop.

    ``on_message(msg, fds)`` is called for every frame in order; it owns ``fds``. ``on_close``
    once when the peer hangs up or the channel is closed."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: Handler,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._on_message = on_message
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._rbuf = bytearray()
        self._rfds: collections.deque[int] = collections.deque()
        # (frame bytes still to send, fds still to send with its first byte)
        self._wqueue: collections.deque[tuple[memoryview, list[int]]] = collections.deque()
        self._writing = False
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._on_readable)

    # --- sending -------------------------------------------------------------------------------

    def send(self, msg: Any, fds: Sequence[int] = ()) -> None:
        """Queue ``msg`` (and duplicates of ``fds``). Raises ChannelClosed."""
        self.send_encoded(encode(msg), fds)

    def send_encoded(self, payload: bytes, fds: Sequence[int] = ()) -> None:
        """:meth:`send` of a message :func:`encode` made (one encoding for many channels)."""
        if self.closed:
            raise ChannelClosed("channel closed")
        if len(fds) > MAX_FDS_PER_FRAME:
            raise ValueError(f"at most {MAX_FDS_PER_FRAME} fds per message")
        frame = _HEADER.pack(len(payload), len(fds)) + payload
        self._wqueue.append((memoryview(frame), [os.dup(fd) for fd in fds]))
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        while self._wqueue:
            data, fds = self._wqueue[0]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = self.sock.sendmsg([data], anc)
                else:
                    n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                log.debug("worker channel send failed: %s", e)
                self.close()
                return
            for fd in fds:
                os.close(fd)
            fds.clear()
            if n < len(data):
                self._wqueue[0] = (data[n:], fds)
                break
            self._wqueue.popleft()
        want = bool(self._wqueue)
        if want and not self._writing:
            self._loop.add_writer(self.sock.fileno(), self._flush)
        elif not want and self._writing:
            self._loop.remove_writer(self.sock.fileno())
        self._writing = want

    # --- receiving -----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(_RECV_SIZE, _ANC_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("worker channel receive failed: %s", e)
            data, anc = b"", []
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                self._rfds.extend(fds)
        if not data:
            self.close()
            return
        self._rbuf += data
        self._parse()

    def _parse(self) -> None:
        buf = self._rbuf
        off = 0
        while len(buf) - off >= _HEADER.size:
            size, nfds = _HEADER.unpack_from(buf, off)
            if size > MAX_FRAME or nfds > MAX_FDS_PER_FRAME:
                log.error("worker channel: bad frame (%d bytes, %d fds); closing", size, nfds)
                self.close()
                return
            end = off + _HEADER.size + size
            if len(buf) < end or len(self._rfds) < nfds:
                break
            msg = pickle.loads(buf[off + _HEADER.size : end])
            fds = [self._rfds.popleft() for _ in range(nfds)]
            off = end
            try:
                self._on_message(msg, fds)
            except Exception:
                log.exception("worker channel: handling %s failed", type(msg).__name__)
            if self.closed:
                return
        del buf[:off]

    # --- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        self._loop.remove_reader(fd)
        if self._writing:
            self._loop.remove_writer(fd)
            self._writing = False
        for _, fds in self._wqueue:
            for f in fds:
                os.close(f)
        self._wqueue.clear()
        while self._rfds:
            os.close(self._rfds.popleft())
        self.sock.close()
        self._on_close()

    @property
    def pending_bytes(self) -> int:
        return sum(len(d) for d, _ in self._wqueue)
