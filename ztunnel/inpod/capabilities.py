"""The in-pod start-up check: can this process switch network namespaces and mark sockets?

In shared mode every pod's sockets are made inside its netns (``setns``, CAP_SYS_ADMIN) and
marked (``SO_MARK``, CAP_NET_ADMIN or CAP_NET_RAW). Without them every pod would be NACKed and
retried, one by one; like Rust's ``WorkloadProxyManager::verify_syscalls``, ztunnel instead
refuses to start, with Rust's messages.
"""

from __future__ import annotations

import errno
import os
import socket

from ztunnel.net import netns
from ztunnel.net.sockopt import SO_MARK

_CHECK_MARK = 1337  # (Rust verify_set_mark sets this value, whatever PACKET_MARK is)

# std::io::ErrorKind of the errors these calls give (Rust's decode_error_kind); others print as
# Rust's catch-all.
_KINDS = {
    errno.EPERM: "PermissionDenied",
    errno.EACCES: "PermissionDenied",
    errno.EINVAL: "InvalidInput",
    errno.ENOENT: "NotFound",
    errno.ENOMEM: "OutOfMemory",
}


class CapabilityError(Exception):
    """ztunnel lacks what in-pod mode needs; the message is Rust's."""


def verify_syscalls() -> None:
    """Raise :class:`CapabilityError` unless ``setns`` into our own netns (a no-op switch) and
    ``SO_MARK`` both work (Rust ``WorkloadProxyManager::verify_syscalls``, in this order)."""
    try:
        own = netns.open_current_netns()
        try:
            netns.setns(own)
        finally:
            os.close(own)
    except OSError as e:
        raise CapabilityError(
            f"failed to start workload proxy manager failed to set netns: {rust_io_error(e)}"
        ) from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_MARK, _CHECK_MARK)
    except OSError as e:
        raise CapabilityError(
            "failed to start workload proxy manager failed to set socket mark: failed to set "
            "mark on socket. make sure ztunnel has CAP_NET_RAW, CAP_NET_ADMIN. error: "
            + rust_io_error(e)
        ) from None


def rust_io_error(e: OSError) -> str:
    """``e`` as Rust's ``std::io::Error`` prints with ``{:?}`` (an OS error)."""
    code = e.errno or 0
    kind = _KINDS.get(code, "Uncategorized")
    message = e.strerror or (errno.errorcode.get(code, "") if code else str(e))
    return f'Os {{ code: {code}, kind: {kind}, message: "{message}" }}'
