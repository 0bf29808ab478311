"""The zygote: a process forked before the event loop starts, from which workers are forked.

Forking the workers from the supervisor's running event loop would copy its loop, its tasks and
its sockets into each child; forking them from a fresh process that has only done the imports
gives each worker a clean image whose pages (the imported modules: uvloop, cryptography, our
data-plane code) stay shared with the supervisor and with each other (what PSS counts once).
The zygote blocks on its control socket: each request carries a worker index and one end of a
fresh socketpair, and it forks a worker to serve it. It exits when the supervisor goes (EOF).
Workers it forked are reaped by the kernel (SIGCHLD ignored); the supervisor sees a worker die as
EOF on its channel.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable

log = logging.getLogger("ztunnel.workers")

WorkerMain = Callable[[socket.socket, int], int]


class Zygote:
    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid

    @classmethod
    def fork(cls, target: WorkerMain) -> Zygote:
        """Fork the zygote now (call before any event loop or listener exists)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote process
            code = 1
            try:
                ours.close()
                code = _serve(theirs, target)
            finally:
                os._exit(code)
        theirs.close()
        return cls(ours, pid)

    def spawn(self, index: int) -> socket.socket:
        """A new worker with this index; returns the supervisor's end of its channel."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [struct.pack("!I", index)], [theirs.fileno()])
        finally:
            theirs.close()
        return ours

    def close(self) -> None:
        self.sock.close()  # the zygote sees EOF and exits
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _serve(control: socket.socket, target: WorkerMain) -> int:  # pragma: no cover - subprocess
    # Ctrl-C reaches the whole process group: the supervisor alone decides when workers drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(control, 4, 1)
        except InterruptedError:
            continue
        except OSError:
            return 0
        if not data or len(data) < 4 or not fds:
            for fd in fds:
                os.close(fd)
            return 0
        (index,) = struct.unpack("!I", data)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = target(socket.socket(fileno=fds[0]), index)
            except BaseException:
                log.exception("worker %d crashed", index)
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(fds[0])
