"""ZDS codec and session rules, sans-IO: one SEQPACKET record + its fds in, typed messages out.

Reference sections 3.1-3.3. ``decode_request`` turns one received record (bytes, SCM_RIGHTS fds,
recvmsg flags) into a frozen ``Add``/``Keep``/``Del``/``SnapshotSent`` or raises a typed
``ZdsProtocolError``; ``ZdsSession`` applies the per-connection sequence rules and answers with a
*decision* (start, keep, stop, reconcile) for the I/O driver to carry out. Encoders cover both
directions, so the fake node agent in ``ztunnel.testing.nodeagent`` speaks the same bytes.

Invariant (fd ownership): every fd given to ``decode_request`` is either returned inside an
``Add`` (the caller owns it from then on) or closed before the function returns or raises.
Nothing here touches a socket; ``check_netns_fd`` only asks the kernel about an fd.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import enum
import fcntl
import functools
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import DecodeError, Message

from ztunnel.inpod import zds_pb2
from ztunnel.net.netns import CLONE_NEWNET, netns_inode

log = logging.getLogger("ztunnel.inpod")

MAX_RECORD_SIZE: Final = 1024
"""Both sides read into a 1024-byte buffer; a longer record arrives with MSG_TRUNC."""

MAX_FDS: Final = 16
"""Control-buffer room, in fds. Only one is legal, but room for more lets the receiver see (and
close) a sender's extras and reject the message, instead of the kernel silently dropping them."""

ZDS_VERSION_V1: Final = 1
MAX_ERROR_BYTES: Final = 900
"""NACK texts are clipped so that the whole WorkloadResponse stays under MAX_RECORD_SIZE."""

# linux/nsfs.h: NS_GET_NSTYPE = _IO(NSIO=0xb7, 0x3); linux/magic.h
NS_GET_NSTYPE: Final = 0xB703
NSFS_MAGIC: Final = 0x6E736673
PROC_SUPER_MAGIC: Final = 0x9FA0


class ZdsErrorKind(enum.Enum):
    """What was wrong with a record or with the order of messages."""

    TRUNCATED = "truncated"  # MSG_TRUNC or MSG_CTRUNC
    UNDECODABLE = "undecodable"  # not a valid protobuf of the expected type
    NO_PAYLOAD = "no_payload"  # empty or unknown oneof
    MISSING_FD = "missing_fd"  # add without its netns fd
    UNEXPECTED_FD = "unexpected_fd"  # fd beside a non-add message
    TOO_MANY_FDS = "too_many_fds"  # more than one fd
    MISSING_WORKLOAD_INFO = "missing_workload_info"
    KEEP_AFTER_SNAPSHOT = "keep_after_snapshot"
    DUPLICATE_SNAPSHOT = "duplicate_snapshot"
    BAD_VERSION = "bad_version"  # hello with a version other than V1 (node agent side)


class ZdsProtocolError(Exception):
    """The peer broke the ZDS protocol; ztunnel NACKs with ``str(error)`` and reconnects."""

    def __init__(self, kind: ZdsErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------------------------
# messages


@dataclass(frozen=True, slots=True)
class WorkloadInfo:
    """Who the pod is (ZDS ``WorkloadInfo``); matched against xDS workloads on this node."""

    name: str
    namespace: str
    service_account: str


@dataclass(frozen=True, slots=True)
class Add:
    """Start proxying pod ``uid``; ``netns_fd`` is the pod's network namespace, owned by the
    receiver of this object (close it when the proxy is gone)."""

    uid: str
    workload_info: WorkloadInfo
    netns_fd: int


@dataclass(frozen=True, slots=True)
class Keep:
    """Snapshot only: the node agent knows the pod but has no netns for it; keep its proxy."""

    uid: str


@dataclass(frozen=True, slots=True)
class Del:
    """The pod is gone: stop its proxy."""

    uid: str


@dataclass(frozen=True, slots=True)
class SnapshotSent:
    """The snapshot is complete: stop every proxy not named on this connection."""


ZdsMessage = Add | Keep | Del | SnapshotSent


@dataclass(frozen=True, slots=True)
class Ack:
    """A decoded ``WorkloadResponse``: empty ``error`` = ACK, otherwise a NACK and its reason."""

    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


# --------------------------------------------------------------------------------------------
# decoding (ztunnel side)


def fds_from_ancdata(ancdata: Iterable[tuple[int, int, bytes]]) -> list[int]:
    """The fds carried as SCM_RIGHTS in ``recvmsg`` ancillary data (now owned by the caller).

    Other control messages are ignored. A partial trailing int (only after MSG_CTRUNC) is
    dropped: the kernel did not install that fd.
    """
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
        else:
            log.warning("zds: ignoring unexpected control message level=%d type=%d", level, kind)
    return fds


def decode_request(data: bytes, fds: Sequence[int] = (), *, msg_flags: int = 0) -> ZdsMessage:
    """Decode one record from the node agent (reference 3.1/3.2) with the fds that came with it.

    ``msg_flags`` are recvmsg's flags: MSG_TRUNC / MSG_CTRUNC make the record invalid. Raises
    ``ZdsProtocolError``; any fd not handed over inside the returned ``Add`` is closed first.
    """
    owned = list(fds)
    try:
        if len(owned) > 1:
            raise ZdsProtocolError(
                ZdsErrorKind.TOO_MANY_FDS, f"expected at most 1 fd, got {len(owned)}"
            )
        if msg_flags & socket.MSG_TRUNC:
            raise ZdsProtocolError(
                ZdsErrorKind.TRUNCATED,
                f"received truncated message (record longer than {MAX_RECORD_SIZE} bytes)",
            )
        if msg_flags & socket.MSG_CTRUNC:
            raise ZdsProtocolError(
                ZdsErrorKind.TRUNCATED, "received truncated control data (too many fds)"
            )
        try:
            req = zds_pb2.WorkloadRequest.FromString(data)
        except DecodeError as e:
            raise ZdsProtocolError(
                ZdsErrorKind.UNDECODABLE, f"undecodable WorkloadRequest: {e}"
            ) from e
        kind = req.WhichOneof("payload")
        if kind is None:
            raise ZdsProtocolError(
                ZdsErrorKind.NO_PAYLOAD, "WorkloadRequest has no payload (empty or unknown type)"
            )
        if kind == "add":
            uid = req.add.uid
            if not owned:
                raise ZdsProtocolError(
                    ZdsErrorKind.MISSING_FD, f"add workload {uid!r} came without a netns fd"
                )
            if not req.add.HasField("workload_info"):
                raise ZdsProtocolError(
                    ZdsErrorKind.MISSING_WORKLOAD_INFO,
                    f"add workload {uid!r}: workload_info is required but not present",
                )
            wi = req.add.workload_info
            msg = Add(uid, WorkloadInfo(wi.name, wi.namespace, wi.service_account), owned[0])
            owned.clear()  # handed over
            return msg
        if owned:
            raise ZdsProtocolError(
                ZdsErrorKind.UNEXPECTED_FD, f"unexpected fd with a {kind} message"
            )
        if kind == "keep":
            return Keep(req.keep.uid)
        if kind == "del":
            return Del(getattr(req, "del").uid)  # `del` is a Python keyword
        if kind == "snapshot_sent":
            return SnapshotSent()
        raise ZdsProtocolError(ZdsErrorKind.NO_PAYLOAD, f"unsupported payload {kind!r}")
    finally:
        close_fds(owned)


def close_fds(fds: Iterable[int]) -> None:
    """Close each fd, ignoring errors (each is ours and closed at most once)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def decode_hello(data: bytes) -> int:
    """Node agent side: the version in ztunnel's bare ``ZdsHello``."""
    try:
        return int(zds_pb2.ZdsHello.FromString(data).version)
    except DecodeError as e:
        raise ZdsProtocolError(ZdsErrorKind.UNDECODABLE, f"undecodable ZdsHello: {e}") from e


def decode_response(data: bytes) -> Ack:
    """Node agent side: ztunnel's ``WorkloadResponse`` for the last request."""
    try:
        resp = zds_pb2.WorkloadResponse.FromString(data)
    except DecodeError as e:
        raise ZdsProtocolError(
            ZdsErrorKind.UNDECODABLE, f"undecodable WorkloadResponse: {e}"
        ) from e
    if resp.WhichOneof("payload") != "ack":
        raise ZdsProtocolError(ZdsErrorKind.NO_PAYLOAD, "WorkloadResponse has no ack")
    return Ack(resp.ack.error)


# --------------------------------------------------------------------------------------------
# encoding


def _serialize(msg: Message) -> bytes:
    return bytes(msg.SerializeToString())


def encode_hello(version: int = ZDS_VERSION_V1) -> bytes:
    """ztunnel's first record: a bare ``ZdsHello`` (not wrapped in a WorkloadResponse)."""
    return _serialize(zds_pb2.ZdsHello(version=version))  # type: ignore[arg-type]


def clip_error(error: str) -> str:
    """``error`` cut (on a UTF-8 boundary) to MAX_ERROR_BYTES so the response fits a record."""
    raw = error.encode("utf-8", "replace")
    if len(raw) <= MAX_ERROR_BYTES:
        return error
    return raw[: MAX_ERROR_BYTES - 3].decode("utf-8", "ignore") + "..."


def encode_ack(error: str | None = None) -> bytes:
    """``WorkloadResponse{ack{error}}``: ACK when ``error`` is empty/None, else a NACK."""
    return _serialize(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=clip_error(error or ""))))


def encode_add(uid: str, info: WorkloadInfo | None) -> bytes:
    """``WorkloadRequest{add}`` (send the netns fd beside it); ``info=None`` omits workload_info."""
    add = zds_pb2.AddWorkload(uid=uid)
    if info is not None:
        add.workload_info.name = info.name
        add.workload_info.namespace = info.namespace
        add.workload_info.service_account = info.service_account
        add.workload_info.SetInParent()
    return _serialize(zds_pb2.WorkloadRequest(add=add))


def encode_keep(uid: str) -> bytes:
    return _serialize(zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid=uid)))


def encode_del(uid: str) -> bytes:
    req = zds_pb2.WorkloadRequest()
    body = getattr(req, "del")  # `del` is a Python keyword
    body.SetInParent()
    body.uid = uid
    return _serialize(req)


def encode_snapshot_sent() -> bytes:
    return _serialize(zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()))


def encode_request(msg: ZdsMessage) -> bytes:
    """Any request; for an ``Add`` the caller sends ``msg.netns_fd`` beside the bytes."""
    if isinstance(msg, Add):
        return encode_add(msg.uid, msg.workload_info)
    if isinstance(msg, Keep):
        return encode_keep(msg.uid)
    if isinstance(msg, Del):
        return encode_del(msg.uid)
    return encode_snapshot_sent()


# --------------------------------------------------------------------------------------------
# the session state machine (reference 3.3)


@dataclass(frozen=True, slots=True)
class StartProxy:
    """Start (or keep, if the netns is the same) the proxy for ``uid``; the fd is handed over.
    Reply ACK on success, NACK with the reason on failure (the connection stays up)."""

    uid: str
    workload_info: WorkloadInfo
    netns_fd: int


@dataclass(frozen=True, slots=True)
class KeepProxy:
    """Snapshot named ``uid`` without a netns: keep any existing proxy. Reply ACK."""

    uid: str


@dataclass(frozen=True, slots=True)
class StopProxy:
    """Stop the proxy for ``uid`` now (drain Immediate) and drop any pending retry. Reply ACK.

    ``before_snapshot``: upstream only forgets the uid then (reconcile would stop the proxy at
    SnapshotSent, since the uid is no longer named); stopping now reaches the same end state."""

    uid: str
    before_snapshot: bool


@dataclass(frozen=True, slots=True)
class Reconcile:
    """SnapshotSent: stop every proxy whose uid is not in ``named_uids``. Reply ACK."""

    named_uids: frozenset[str]

    def to_stop(self, running: Iterable[str]) -> frozenset[str]:
        """The uids among ``running`` (proxies and pending retries) that must be stopped."""
        return frozenset(running) - self.named_uids


Decision = StartProxy | KeepProxy | StopProxy | Reconcile


class ZdsSession:
    """The rules of one connection, as a table of (state, message) -> decision or error.

    =====================  =========================  ===========================================
    message                before SnapshotSent        after SnapshotSent
    =====================  =========================  ===========================================
    Add(uid)               name uid; StartProxy       StartProxy
    Keep(uid)              name uid; KeepProxy        ZdsProtocolError(KEEP_AFTER_SNAPSHOT)
    Del(uid)               un-name uid; StopProxy     StopProxy
    SnapshotSent           Reconcile(named); -> after ZdsProtocolError(DUPLICATE_SNAPSHOT)
    =====================  =========================  ===========================================

    A new connection gets a new session: "named" means named on *this* connection.
    """

    def __init__(self) -> None:
        self._snapshot_done = False
        self._named: set[str] = set()

    @property
    def snapshot_done(self) -> bool:
        return self._snapshot_done

    @property
    def named_uids(self) -> frozenset[str]:
        """Uids named (add or keep, minus del) so far; empty once the snapshot is reconciled."""
        return frozenset(self._named)

    def handle(self, msg: ZdsMessage) -> Decision:
        """The decision for ``msg``, or ``ZdsProtocolError`` if it breaks the sequence.

        Never raises for an ``Add``, so its fd always reaches the ``StartProxy``."""
        if isinstance(msg, Add):
            if not self._snapshot_done:
                self._named.add(msg.uid)
            return StartProxy(msg.uid, msg.workload_info, msg.netns_fd)
        if isinstance(msg, Keep):
            if self._snapshot_done:
                raise ZdsProtocolError(
                    ZdsErrorKind.KEEP_AFTER_SNAPSHOT,
                    f"keep workload {msg.uid!r} received after the snapshot",
                )
            self._named.add(msg.uid)
            return KeepProxy(msg.uid)
        if isinstance(msg, Del):
            before = not self._snapshot_done
            if before:
                self._named.discard(msg.uid)
            return StopProxy(msg.uid, before_snapshot=before)
        if self._snapshot_done:
            raise ZdsProtocolError(
                ZdsErrorKind.DUPLICATE_SNAPSHOT, "snapshot sent received a second time"
            )
        named = frozenset(self._named)
        self._named.clear()
        self._snapshot_done = True
        return Reconcile(named)


# --------------------------------------------------------------------------------------------
# the netns fd


def netns_identity(fd: int) -> tuple[int, int]:
    """(inode, device) of a netns fd: equal pairs = same namespace (same uid + same pair = no-op)."""
    return netns_inode(fd)


@functools.cache
def _libc_fstatfs() -> ctypes._NamedFuncPointer:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.fstatfs
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def _fstatfs_type(fd: int) -> int:
    # struct statfs starts with `__fsword_t f_type` (a C long) on every Linux ABI we run on;
    # 256 bytes is more than any sizeof(struct statfs).
    buf = ctypes.create_string_buffer(256)
    if _libc_fstatfs()(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def check_netns_fd(fd: int) -> str | None:
    """Why ``fd`` does not look like a network namespace, or None if it does.

    ``ioctl(NS_GET_NSTYPE)`` must say CLONE_NEWNET; kernels without that ioctl get the weaker
    check that the fd lives on nsfs or procfs. Callers only log a failure (as upstream does).
    """
    try:
        nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:
        nstype = None
    if nstype is not None:
        if nstype == CLONE_NEWNET:
            return None
        return f"fd {fd} is a namespace of type {nstype:#x}, not a network namespace"
    try:
        magic = _fstatfs_type(fd)
    except OSError as e:
        return f"fd {fd}: fstatfs failed: {e}"
    if magic in (NSFS_MAGIC, PROC_SUPER_MAGIC):
        return None
    return f"fd {fd} is not a namespace file (filesystem magic {magic:#x})"
