"""Network-namespace switching for the calling thread: setns, open, identify, enter-and-return.

Invariant: ``setns(CLONE_NEWNET)`` changes only the calling *thread*. Code inside
``enter_netns`` must never ``await`` (or otherwise yield to other work on the same thread):
another task would run inside the wrong namespace. Create the socket (and bind it), leave the
block, then hand the socket to the event loop: sockets stay in the namespace they were made in.
Do not start threads inside the block either: a new thread inherits the creating thread's
namespace (watch for executors that spawn their workers lazily on first submit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

CLONE_NEWNET: Final = 0x40000000
NETNS_RUN_DIR: Final = "/run/netns"
THREAD_NETNS_PATH: Final = "/proc/thread-self/ns/net"


class NetnsError(OSError):
    """A namespace switch failed. ``stuck`` is True when the thread could not switch back."""

    def __init__(self, err: int, message: str, *, stuck: bool = False) -> None:
        super().__init__(err, message)
        self.stuck = stuck


@functools.cache
def _libc_setns() -> ctypes._NamedFuncPointer:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.setns
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace referred to by ``fd`` (raises OSError)."""
    os_setns = getattr(os, "setns", None)  # Python >= 3.12
    if os_setns is not None:
        os_setns(fd, nstype)
        return
    if _libc_setns()(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(fd={fd}): {os.strerror(err)}")


def netns_path(name_or_path: str) -> str:
    """``/run/netns/<name>`` for a bare name (``ip netns`` style); a path is returned unchanged."""
    if "/" in name_or_path:
        return name_or_path
    return os.path.join(NETNS_RUN_DIR, name_or_path)


def open_netns(name_or_path: str) -> int:
    """Open a network namespace by ``ip netns`` name or by path; the caller closes the fd."""
    return os.open(netns_path(name_or_path), os.O_RDONLY | os.O_CLOEXEC)


def open_current_netns() -> int:
    """Open the calling thread's current network namespace; the caller closes the fd."""
    return os.open(THREAD_NETNS_PATH, os.O_RDONLY | os.O_CLOEXEC)


def netns_inode(fd: int) -> tuple[int, int]:
    """The (inode, device) pair that identifies a namespace fd (equal pairs = same namespace)."""
    st = os.fstat(fd)
    return st.st_ino, st.st_dev


@contextmanager
def enter_netns(fd: int) -> Iterator[None]:
    """Run the block with the calling thread inside the network namespace ``fd``.

    Always switches back to the thread's previous namespace, even if the block raises.
    Never ``await`` inside the block: other tasks on this thread would run in the wrong
    namespace. If switching back fails the thread is unusable and ``NetnsError(stuck=True)``
    is raised; the caller should treat that as fatal.
    """
    own = open_current_netns()
    try:
        if netns_inode(own) == netns_inode(fd):
            yield
            return
        setns(fd)
        try:
            yield
        finally:
            try:
                setns(own)
            except OSError as e:
                raise NetnsError(
                    e.errno or errno.EINVAL,
                    f"could not switch thread back to its own network namespace: {e}",
                    stuck=True,
                ) from e
    finally:
        os.close(own)
