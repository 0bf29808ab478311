"""ZDS codec and session rules against protobuf bytes built by hand from the reference tables."""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
from collections.abc import Iterator, Sequence

import pytest

from ztunnel.inpod import protocol
from ztunnel.inpod.protocol import (
    MAX_RECORD_SIZE,
    NSFS_MAGIC,
    Ack,
    Add,
    Del,
    Keep,
    KeepProxy,
    Reconcile,
    SnapshotSent,
    StartProxy,
    StopProxy,
    WorkloadInfo,
    ZdsErrorKind,
    ZdsMessage,
    ZdsProtocolError,
    ZdsSession,
    check_netns_fd,
    decode_hello,
    decode_request,
    decode_response,
    encode_ack,
    encode_add,
    encode_del,
    encode_hello,
    encode_keep,
    encode_request,
    encode_snapshot_sent,
    fds_from_ancdata,
    netns_identity,
)

pytestmark = pytest.mark.timeout(10)

# --------------------------------------------------------------------------------------------
# protobuf by hand: tag = field_number << 3 | wire_type (0 = varint, 2 = length-delimited)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fld(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string or sub-message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def fvarint(number: int, value: int) -> bytes:
    return varint(number << 3 | 0) + varint(value)


# reference 3.2, field by field
def hand_workload_info(name: str, namespace: str, sa: str) -> bytes:
    return fld(1, name.encode()) + fld(2, namespace.encode()) + fld(3, sa.encode())


def hand_add(uid: str, info: bytes | None) -> bytes:
    body = fld(1, uid.encode()) + (fld(2, info) if info is not None else b"")
    return fld(1, body)  # WorkloadRequest.add = 1


def hand_keep(uid: str) -> bytes:
    return fld(5, fld(1, uid.encode()))  # WorkloadRequest.keep = 5, KeepWorkload.uid = 1


def hand_del(uid: str) -> bytes:
    return fld(2, fld(2, uid.encode()))  # WorkloadRequest.del = 2, DelWorkload.uid = 2 (!)


HAND_SNAPSHOT_SENT = fld(3, b"")  # WorkloadRequest.snapshot_sent = 3
INFO = WorkloadInfo("productpage-v1-abc", "bookinfo", "bookinfo-productpage")


@pytest.fixture
def fds() -> Iterator[list[int]]:
    """Fresh fds to hand to the decoder; any still open at the end are closed."""
    made: list[int] = []
    yield made
    for fd in made:
        if is_open(fd):
            os.close(fd)


def new_fd(fds: list[int], path: str = "/proc/self/ns/net") -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fds.append(fd)
    return fd


def is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as e:
        assert e.errno == errno.EBADF
        return False
    return True


# --------------------------------------------------------------------------------------------
# the example encodings of reference 3.2


def test_reference_example_bytes() -> None:
    assert encode_hello() == bytes.fromhex("0801")
    assert encode_ack() == bytes.fromhex("0a00")
    assert encode_ack("") == bytes.fromhex("0a00")
    assert encode_snapshot_sent() == bytes.fromhex("1a00")
    assert encode_del("u") == bytes.fromhex("1203120175")
    assert encode_keep("u") == bytes.fromhex("2a030a0175")


def test_hand_helpers_match_reference_examples() -> None:
    assert fvarint(1, 1) == bytes.fromhex("0801")
    assert fld(3, b"") == bytes.fromhex("1a00")
    assert hand_del("u") == bytes.fromhex("1203120175")
    assert hand_keep("u") == bytes.fromhex("2a030a0175")


def test_encode_nack_and_add_match_hand_bytes() -> None:
    assert encode_ack("boom") == fld(1, fld(1, b"boom"))
    raw = hand_add("uid-1", hand_workload_info(INFO.name, INFO.namespace, INFO.service_account))
    assert encode_add("uid-1", INFO) == raw
    assert encode_add("uid-1", None) == hand_add("uid-1", None)
    assert encode_add("u", WorkloadInfo("", "", "")) == hand_add("u", b"")  # present but empty
    assert encode_del("") == fld(2, b"")  # the oneof is still set


def test_encode_request_dispatch(fds: list[int]) -> None:
    fd = new_fd(fds)
    assert encode_request(Add("a", INFO, fd)) == encode_add("a", INFO)
    assert encode_request(Keep("k")) == hand_keep("k")
    assert encode_request(Del("d")) == hand_del("d")
    assert encode_request(SnapshotSent()) == HAND_SNAPSHOT_SENT


def test_nack_is_clipped_to_fit_one_record() -> None:
    data = encode_ack("é" * 5000)
    assert len(data) < MAX_RECORD_SIZE
    ack = decode_response(data)
    assert not ack.ok and ack.error.endswith("...")
    assert decode_response(encode_ack("short")).error == "short"


# --------------------------------------------------------------------------------------------
# decoding good records


def test_decode_add_hand_built_with_nested_info(fds: list[int]) -> None:
    fd = new_fd(fds)
    raw = hand_add("pod-uid", hand_workload_info("name", "ns", "sa"))
    msg = decode_request(raw, [fd])
    assert msg == Add("pod-uid", WorkloadInfo("name", "ns", "sa"), fd)
    assert is_open(fd), "the fd is handed over inside the Add"


def test_decode_add_tolerates_reserved_trust_domain_field(fds: list[int]) -> None:
    fd = new_fd(fds)
    info = hand_workload_info("n", "ns", "sa") + fld(4, b"cluster.local")  # old trust_domain
    msg = decode_request(hand_add("u", info), [fd])
    assert isinstance(msg, Add) and msg.workload_info == WorkloadInfo("n", "ns", "sa")


def test_decode_add_with_empty_info_is_present(fds: list[int]) -> None:
    fd = new_fd(fds)
    msg = decode_request(hand_add("u", b""), [fd])
    assert msg == Add("u", WorkloadInfo("", "", ""), fd)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (bytes.fromhex("1203120175"), Del("u")),
        (bytes.fromhex("2a030a0175"), Keep("u")),
        (bytes.fromhex("1a00"), SnapshotSent()),
        (hand_del("9f1c-uid"), Del("9f1c-uid")),
        (hand_keep("9f1c-uid"), Keep("9f1c-uid")),
        (fld(2, b""), Del("")),
    ],
    ids=["del", "keep", "snapshot", "del-long", "keep-long", "del-empty"],
)
def test_decode_non_add(raw: bytes, expected: ZdsMessage) -> None:
    assert decode_request(raw) == expected


def test_del_uid_field_number_is_two() -> None:
    # a DelWorkload with the uid in field 1 decodes, but the uid is lost: field 2 is the uid
    assert decode_request(fld(2, fld(1, b"u"))) == Del("")


# --------------------------------------------------------------------------------------------
# bad records: typed errors, and no fd survives


BAD_CASES: list[tuple[str, bytes, int, int, ZdsErrorKind]] = [
    # (id, record, fds to attach, recvmsg flags, expected kind)
    ("fd-on-del", hand_del("u"), 1, 0, ZdsErrorKind.UNEXPECTED_FD),
    ("fd-on-keep", hand_keep("u"), 1, 0, ZdsErrorKind.UNEXPECTED_FD),
    ("fd-on-snapshot", HAND_SNAPSHOT_SENT, 1, 0, ZdsErrorKind.UNEXPECTED_FD),
    ("two-fds-on-add", hand_add("u", hand_workload_info("n", "ns", "sa")), 2, 0,
     ZdsErrorKind.TOO_MANY_FDS),
    ("three-fds-on-del", hand_del("u"), 3, 0, ZdsErrorKind.TOO_MANY_FDS),
    ("add-without-fd", hand_add("u", hand_workload_info("n", "ns", "sa")), 0, 0,
     ZdsErrorKind.MISSING_FD),
    ("add-without-info", hand_add("u", None), 1, 0, ZdsErrorKind.MISSING_WORKLOAD_INFO),
    ("garbage", b"garbage!", 1, 0, ZdsErrorKind.UNDECODABLE),
    ("cut-short", hand_add("u", hand_workload_info("n", "ns", "sa"))[:-3], 1, 0,
     ZdsErrorKind.UNDECODABLE),
    ("bad-utf8", fld(2, fld(2, b"\xff\xfe")), 0, 0, ZdsErrorKind.UNDECODABLE),
    ("empty", b"", 0, 0, ZdsErrorKind.NO_PAYLOAD),
    ("empty-with-fd", b"", 1, 0, ZdsErrorKind.NO_PAYLOAD),
    ("unknown-oneof-4", fld(4, b""), 0, 0, ZdsErrorKind.NO_PAYLOAD),  # old NoSnapshotPresent
    ("unknown-field-9", fld(9, b"x"), 1, 0, ZdsErrorKind.NO_PAYLOAD),
    ("msg-trunc", hand_add("u", hand_workload_info("n", "ns", "sa")), 1, socket.MSG_TRUNC,
     ZdsErrorKind.TRUNCATED),
    ("msg-ctrunc", hand_add("u", hand_workload_info("n", "ns", "sa")), 1, socket.MSG_CTRUNC,
     ZdsErrorKind.TRUNCATED),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "nfds", "flags", "kind"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_records_raise_typed_errors_and_close_fds(
    fds: list[int], raw: bytes, nfds: int, flags: int, kind: ZdsErrorKind
) -> None:
    given = [new_fd(fds) for _ in range(nfds)]
    with pytest.raises(ZdsProtocolError) as info:
        decode_request(raw, given, msg_flags=flags)
    assert info.value.kind is kind
    assert str(info.value)
    assert not any(is_open(fd) for fd in given), "every received fd is closed on error"


def test_error_messages_are_clear(fds: list[int]) -> None:
    with pytest.raises(ZdsProtocolError, match="expected at most 1 fd, got 2"):
        decode_request(hand_del("u"), [new_fd(fds), new_fd(fds)])
    with pytest.raises(ZdsProtocolError, match="unexpected fd with a del message"):
        decode_request(hand_del("u"), [new_fd(fds)])
    with pytest.raises(ZdsProtocolError, match="workload_info is required"):
        decode_request(hand_add("uid-7", None), [new_fd(fds)])
    with pytest.raises(ZdsProtocolError, match="'uid-7' came without a netns fd"):
        decode_request(hand_add("uid-7", b""), [])
    with pytest.raises(ZdsProtocolError, match="truncated"):
        decode_request(HAND_SNAPSHOT_SENT, [], msg_flags=socket.MSG_TRUNC)


# --------------------------------------------------------------------------------------------
# the other direction (what the node agent decodes)


def test_decode_hello_and_response() -> None:
    assert decode_hello(bytes.fromhex("0801")) == 1
    assert decode_hello(b"") == 0  # NOT_USED
    assert decode_response(bytes.fromhex("0a00")) == Ack("")
    assert decode_response(bytes.fromhex("0a00")).ok
    assert decode_response(fld(1, fld(1, b"nope"))) == Ack("nope")
    with pytest.raises(ZdsProtocolError) as e1:
        decode_response(b"")
    assert e1.value.kind is ZdsErrorKind.NO_PAYLOAD
    with pytest.raises(ZdsProtocolError) as e2:
        decode_response(b"\xff\xff")
    assert e2.value.kind is ZdsErrorKind.UNDECODABLE
    with pytest.raises(ZdsProtocolError):
        decode_hello(b"\x08")


# --------------------------------------------------------------------------------------------
# ancillary data


def test_fds_from_ancdata_over_a_real_socketpair(fds: list[int]) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        sent = [new_fd(fds), new_fd(fds, "/dev/null")]
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))])
        data, anc, flags, _ = b.recvmsg(
            MAX_RECORD_SIZE, socket.CMSG_SPACE(4 * 16), socket.MSG_CMSG_CLOEXEC
        )
        got = fds_from_ancdata(anc)
        fds.extend(got)
        assert data == b"x" and len(got) == 2
        assert not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
        assert netns_identity(got[0]) == netns_identity(sent[0])
        assert fcntl.fcntl(got[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_fds_from_ancdata_ignores_other_messages_and_partial_ints() -> None:
    anc: Sequence[tuple[int, int, bytes]] = [
        (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, b"\x00" * 12),
        (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [7, 9]).tobytes() + b"\x01"),
    ]
    assert fds_from_ancdata(anc) == [7, 9]


# --------------------------------------------------------------------------------------------
# the session state machine (reference 3.3)


def add(uid: str, fd: int = 100) -> Add:
    return Add(uid, INFO, fd)


SESSION_TABLE: list[tuple[str, list[ZdsMessage], list[object]]] = [
    # (id, messages, expected decision or error kind for each)
    ("snapshot-only", [SnapshotSent()], [Reconcile(frozenset())]),
    (
        "adds-and-keeps-are-named",
        [add("a"), Keep("k"), SnapshotSent()],
        [StartProxy("a", INFO, 100), KeepProxy("k"), Reconcile(frozenset({"a", "k"}))],
    ),
    (
        "del-before-snapshot-unnames",
        [add("a"), add("b"), Del("a"), Keep("k"), Del("k"), SnapshotSent()],
        [
            StartProxy("a", INFO, 100),
            StartProxy("b", INFO, 100),
            StopProxy("a", before_snapshot=True),
            KeepProxy("k"),
            StopProxy("k", before_snapshot=True),
            Reconcile(frozenset({"b"})),
        ],
    ),
    (
        "del-of-unknown-before-snapshot",
        [Del("x"), SnapshotSent()],
        [StopProxy("x", before_snapshot=True), Reconcile(frozenset())],
    ),
    (
        "steady-state",
        [SnapshotSent(), add("a"), Del("a"), Del("a")],
        [
            Reconcile(frozenset()),
            StartProxy("a", INFO, 100),
            StopProxy("a", before_snapshot=False),
            StopProxy("a", before_snapshot=False),
        ],
    ),
    (
        "keep-after-snapshot",
        [Keep("a"), SnapshotSent(), Keep("a")],
        [KeepProxy("a"), Reconcile(frozenset({"a"})), ZdsErrorKind.KEEP_AFTER_SNAPSHOT],
    ),
    (
        "second-snapshot",
        [SnapshotSent(), add("a"), SnapshotSent()],
        [Reconcile(frozenset()), StartProxy("a", INFO, 100), ZdsErrorKind.DUPLICATE_SNAPSHOT],
    ),
    (
        "readd-after-del-is-named",
        [add("a"), Del("a"), add("a", 101), SnapshotSent()],
        [
            StartProxy("a", INFO, 100),
            StopProxy("a", before_snapshot=True),
            StartProxy("a", INFO, 101),
            Reconcile(frozenset({"a"})),
        ],
    ),
]


@pytest.mark.parametrize(
    ("messages", "expected"), [c[1:] for c in SESSION_TABLE], ids=[c[0] for c in SESSION_TABLE]
)
def test_session_table(messages: list[ZdsMessage], expected: list[object]) -> None:
    session = ZdsSession()
    for msg, want in zip(messages, expected, strict=True):
        if isinstance(want, ZdsErrorKind):
            with pytest.raises(ZdsProtocolError) as info:
                session.handle(msg)
            assert info.value.kind is want
        else:
            assert session.handle(msg) == want


def test_session_tracks_named_and_snapshot_state() -> None:
    assert not ZdsSession().snapshot_done
    session = ZdsSession()
    session.handle(add("a"))
    session.handle(Keep("k"))
    assert session.named_uids == {"a", "k"}
    decision = session.handle(SnapshotSent())
    assert session.snapshot_done and session.named_uids == frozenset()
    assert isinstance(decision, Reconcile)
    assert decision.to_stop({"a", "k", "old", "pending-gone"}) == {"old", "pending-gone"}
    session.handle(add("late"))
    assert session.named_uids == frozenset(), "adds after the snapshot are not tracked"


# --------------------------------------------------------------------------------------------
# the netns fd


def test_check_netns_fd(fds: list[int]) -> None:
    assert check_netns_fd(new_fd(fds)) is None
    reason = check_netns_fd(new_fd(fds, "/proc/self/ns/uts"))
    assert reason is not None and "not a network namespace" in reason
    reason = check_netns_fd(new_fd(fds, "/dev/null"))
    assert reason is not None and "not a namespace file" in reason


def test_check_netns_fd_fallback_without_ns_get_nstype(
    fds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def old_kernel(fd: int, request: int, *args: object) -> int:
        raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")

    monkeypatch.setattr("fcntl.ioctl", old_kernel)
    net = new_fd(fds)
    assert protocol._fstatfs_type(net) == NSFS_MAGIC
    assert check_netns_fd(net) is None
    assert check_netns_fd(new_fd(fds, "/proc/self/ns/uts")) is None  # weaker check: nsfs only
    reason = check_netns_fd(new_fd(fds, "/dev/null"))
    assert reason is not None and "magic" in reason
    closed = new_fd(fds)
    os.close(closed)
    reason = check_netns_fd(closed)
    assert reason is not None and "fstatfs failed" in reason


def test_netns_identity_same_namespace_same_pair(fds: list[int]) -> None:
    a, b = new_fd(fds), new_fd(fds, "/proc/thread-self/ns/net")
    assert netns_identity(a) == netns_identity(b)
    assert netns_identity(a) != netns_identity(new_fd(fds, "/proc/self/ns/uts"))
