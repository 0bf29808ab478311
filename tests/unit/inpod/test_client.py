"""ZDS client against the fake node agent (and raw SEQPACKET peers), with real netns fds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from ztunnel.inpod.client import Backoff, ZdsClient
from ztunnel.inpod.protocol import (
    MAX_RECORD_SIZE,
    WorkloadInfo,
    check_netns_fd,
    decode_response,
    encode_add,
    encode_del,
    encode_keep,
    encode_snapshot_sent,
    netns_identity,
)
from ztunnel.testing.fds import open_fds
from ztunnel.testing.nodeagent import Exchange, FakeNodeAgent, pod_info

pytestmark = pytest.mark.timeout(30)

NETNS = "/proc/self/ns/net"
INFO = pod_info("app-1", "default", "app")


def own_netns() -> tuple[int, int]:
    fd = os.open(NETNS, os.O_RDONLY)
    try:
        return netns_identity(fd)
    finally:
        os.close(fd)


@pytest.fixture
def fd_guard() -> Iterator[None]:
    """Requested first, torn down last: every fd the test opened (ours, the agent's, the
    client's, the handler's) is closed again."""
    before = open_fds()
    yield
    assert open_fds() == before, "fd leak"


@pytest.fixture
def sock_path(fd_guard: None) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="zds-", dir="/tmp")  # short: unix paths are <= 107 bytes
    yield os.path.join(d, "ztunnel.sock")
    shutil.rmtree(d)


@pytest.fixture
def agent(sock_path: str) -> Iterator[FakeNodeAgent]:
    with FakeNodeAgent(sock_path) as a:
        yield a


class Handler:
    """A WorkloadHandler that records calls and owns the fds like a real one would."""

    def __init__(self, fail: dict[str, str] | None = None, explode: set[str] | None = None):
        self.fail = fail or {}
        self.explode = explode or set()
        self.calls: list[tuple[str, Any]] = []
        self.proxies: dict[str, int] = {}
        self.identities: dict[str, tuple[int, int]] = {}
        self.netns_check: dict[str, str | None] = {}

    async def add(self, uid: str, info: WorkloadInfo, netns_fd: int) -> str | None:
        self.calls.append(("add", uid))
        self.netns_check[uid] = check_netns_fd(netns_fd)
        self.identities[uid] = netns_identity(netns_fd)
        if uid in self.explode:
            os.close(netns_fd)
            raise RuntimeError(f"handler bug on {uid}")
        if uid in self.fail:
            os.close(netns_fd)  # a real handler keeps it for the pending retry
            return self.fail[uid]
        old = self.proxies.pop(uid, None)
        if old is not None:
            os.close(old)
        self.proxies[uid] = netns_fd
        return None

    async def keep(self, uid: str) -> None:
        self.calls.append(("keep", uid))

    async def delete(self, uid: str) -> None:
        self.calls.append(("delete", uid))
        fd = self.proxies.pop(uid, None)
        if fd is not None:
            os.close(fd)

    async def reconcile(self, named_uids: frozenset[str]) -> None:
        self.calls.append(("reconcile", named_uids))
        for uid in list(self.proxies):
            if uid not in named_uids:
                os.close(self.proxies.pop(uid))

    def close_all(self) -> None:
        for fd in self.proxies.values():
            os.close(fd)
        self.proxies.clear()


class Counters:
    def __init__(self) -> None:
        self.snapshots = 0
        self.disconnects = 0

    def snapshot(self) -> None:
        self.snapshots += 1

    def disconnected(self) -> None:
        self.disconnects += 1


class RecordingBackoff(Backoff):
    def __init__(self, **kw: Any) -> None:
        super().__init__(jitter=0.0, **kw)
        self.delays: list[float] = []

    def next(self) -> float:
        d = super().next()
        self.delays.append(d)
        return d


def make_client(
    path: str, handler: Handler, counters: Counters, backoff: Backoff | None = None
) -> ZdsClient:
    return ZdsClient(
        path,
        handler,
        on_snapshot_done=counters.snapshot,
        on_disconnected=counters.disconnected,
        backoff=backoff or Backoff(initial=0.01, cap=0.1),
    )


@contextlib.asynccontextmanager
async def running(client: ZdsClient, handler: Handler) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(client.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        handler.close_all()


async def eventually(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def kinds(exchanges: list[Exchange]) -> list[tuple[str, str | None, bool]]:
    return [(e.kind, e.uid, e.acked) for e in exchanges]


# --------------------------------------------------------------------------------------------
# wire level, no fake agent: bytes by hand over a socketpair


@pytest.mark.both_loops
async def test_wire_bytes_over_socketpair(fd_guard: None) -> None:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.settimeout(5)
    handler, counters = Handler(), Counters()
    client = make_client("(socketpair)", handler, counters)
    serve = asyncio.create_task(client.serve(ours))

    async def exchange(record: bytes, fds: list[int] | None = None) -> bytes:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(memoryview_ints(fds)))] if fds else []
        await asyncio.to_thread(peer.sendmsg, [record], anc)
        return await asyncio.to_thread(peer.recv, MAX_RECORD_SIZE)

    try:
        assert await asyncio.to_thread(peer.recv, MAX_RECORD_SIZE) == bytes.fromhex("0801")
        assert await exchange(bytes.fromhex("2a030a0175")) == bytes.fromhex("0a00")  # keep u
        fd = os.open(NETNS, os.O_RDONLY)
        try:
            # add uid="p" workload_info{name="n", namespace="ns", service_account="sa"}
            add = bytes.fromhex("0a10 0a0170 120b 0a016e 12026e73 1a027361".replace(" ", ""))
            assert await exchange(add, [fd]) == bytes.fromhex("0a00")
        finally:
            os.close(fd)
        assert await exchange(bytes.fromhex("1a00")) == bytes.fromhex("0a00")  # snapshot sent
        assert counters.snapshots == 1 and client.snapshot_done
        assert await exchange(bytes.fromhex("1203120170")) == bytes.fromhex("0a00")  # del p
        nack = await exchange(bytes.fromhex("1a00"))  # a second snapshot: NACK, disconnect
        assert decode_response(nack).error.startswith("failure to read message")
        with pytest.raises(Exception, match="snapshot sent received a second time"):
            await serve
    finally:
        serve.cancel()
        with contextlib.suppress(BaseException):
            await serve
        ours.close()
        peer.close()
        handler.close_all()
    assert handler.calls == [
        ("keep", "u"),
        ("add", "p"),
        ("reconcile", frozenset({"u", "p"})),
        ("delete", "p"),
    ]
    assert handler.identities["p"] == own_netns()
    assert counters.disconnects == 1 and not client.connected


def memoryview_ints(fds: list[int]) -> bytes:
    return b"".join(fd.to_bytes(4, "little", signed=True) for fd in fds)


async def test_serve_returns_on_eof(fd_guard: None) -> None:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = make_client("(socketpair)", Handler(), Counters())
    peer.settimeout(5)
    with ours, peer:
        task = asyncio.create_task(client.serve(ours))
        assert await asyncio.to_thread(peer.recv, MAX_RECORD_SIZE) == bytes.fromhex("0801")
        peer.close()
        await asyncio.wait_for(task, 5)
    assert not client.connected


# --------------------------------------------------------------------------------------------
# with the fake node agent


@pytest.mark.both_loops
async def test_hello_snapshot_and_steady_state(agent: FakeNodeAgent) -> None:
    agent.put_pod("a", pod_info("a"), NETNS)
    agent.put_pod("k", pod_info("k"))  # no netns: sent as keep
    handler, counters = Handler(), Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        conn = await asyncio.to_thread(agent.wait_for_snapshot)
        assert conn.hello_version == 1
        assert kinds(agent.exchanges) == [
            ("add", "a", True),
            ("keep", "k", True),
            ("snapshot_sent", None, True),
        ]
        await eventually(lambda: counters.snapshots == 1)
        assert client.snapshot_done and client.connected
        assert handler.calls == [("add", "a"), ("keep", "k"), ("reconcile", frozenset("ak"))]
        assert handler.netns_check["a"] is None and handler.identities["a"] == own_netns()

        ex = await asyncio.to_thread(agent.add_pod, "b", pod_info("b"), NETNS)
        assert ex.acked and ex.kind == "add" and ex.conn_id == conn.id
        assert "b" in handler.proxies
        dels = await asyncio.to_thread(agent.del_pod, "b")
        assert [d.acked for d in dels] == [True]
        assert "b" not in handler.proxies
        assert handler.calls[-2:] == [("add", "b"), ("delete", "b")]
    assert counters.disconnects == 1 and counters.snapshots == 1
    assert (client.connected, client.snapshot_done) == (False, False)


async def test_reconnect_reconciles_pods_removed_meanwhile(agent: FakeNodeAgent) -> None:
    agent.put_pod("a", pod_info("a"), NETNS)
    agent.put_pod("k", pod_info("k"))
    handler, counters = Handler(), Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        await asyncio.to_thread(agent.wait_for_snapshot)
        assert (await asyncio.to_thread(agent.add_pod, "b", pod_info("b"), NETNS)).acked
        assert set(handler.proxies) == {"a", "b"}
        # pod a goes away while ztunnel is disconnected: the next snapshot does not name it
        agent.forget_pod("a")
        await asyncio.to_thread(agent.drop_connections)
        await asyncio.to_thread(agent.wait_for_snapshot, 2)
        await eventually(lambda: counters.snapshots == 2)
        assert handler.calls[-1] == ("reconcile", frozenset({"k", "b"}))
        assert set(handler.proxies) == {"b"}
        assert counters.disconnects == 1 and client.connections == 2


async def test_del_before_snapshot_unnames(sock_path: str) -> None:
    handler, counters = Handler(), Counters()
    with FakeNodeAgent(sock_path, auto_snapshot=False) as agent:
        client = make_client(sock_path, handler, counters)
        async with running(client, handler):
            await asyncio.to_thread(agent.wait_for_snapshot)  # hello read, nothing sent yet
            fd = os.open(NETNS, os.O_RDONLY)
            try:
                steps = [
                    (encode_add("x", INFO), [fd]),
                    (encode_add("y", INFO), [fd]),
                    (encode_del("x"), []),
                    (encode_keep("z"), []),
                    (encode_snapshot_sent(), []),
                ]
                for data, fds in steps:
                    ex = await asyncio.to_thread(agent.send_raw, data, fds)
                    assert ex.acked, ex
            finally:
                os.close(fd)
            assert handler.calls == [
                ("add", "x"),
                ("add", "y"),
                ("delete", "x"),
                ("keep", "z"),
                ("reconcile", frozenset({"y", "z"})),
            ]
            assert set(handler.proxies) == {"y"} and counters.snapshots == 1
            assert len(agent.all_connections) == 1


@pytest.mark.both_loops
async def test_nack_on_handler_error_keeps_the_connection(agent: FakeNodeAgent) -> None:
    handler = Handler(fail={"bad": "bind [::]:15008: address in use", "huge": "x" * 5000})
    counters = Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        await asyncio.to_thread(agent.wait_for_snapshot)
        ex = await asyncio.to_thread(agent.add_pod, "bad", pod_info("bad"), NETNS)
        assert ex.nacked and ex.ack is not None
        assert ex.ack.error == "failure to start proxy: bind [::]:15008: address in use"
        huge = await asyncio.to_thread(agent.add_pod, "huge", pod_info("huge"), NETNS)
        assert huge.nacked and huge.error is None  # clipped to fit one record
        ok = await asyncio.to_thread(agent.add_pod, "good", pod_info("good"), NETNS)
        assert ok.acked
        assert len(agent.all_connections) == 1 and client.connections == 1
        assert counters.disconnects == 0


async def test_handler_exception_nacks_and_reconnects(agent: FakeNodeAgent) -> None:
    handler, counters = Handler(explode={"boom"}), Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        first = await asyncio.to_thread(agent.wait_for_snapshot)
        ex = await asyncio.to_thread(agent.add_pod, "boom", pod_info("boom"), NETNS)
        assert ex.nacked and ex.ack is not None
        assert ex.ack.error == "failure to process message: RuntimeError: handler bug on boom"
        await asyncio.to_thread(first.closed.wait, 5)
        agent.forget_pod("boom")
        await asyncio.to_thread(agent.wait_for_snapshot, 2)
        assert counters.disconnects == 1


async def test_non_netns_fd_is_only_logged(agent: FakeNodeAgent, caplog: Any) -> None:
    handler, counters = Handler(), Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        await asyncio.to_thread(agent.wait_for_snapshot)
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            with caplog.at_level(logging.WARNING, logger="ztunnel.inpod"):
                ex = await asyncio.to_thread(agent.add_pod, "d", pod_info("d"), fd)
        finally:
            os.close(fd)
        assert ex.acked
        assert handler.netns_check["d"] is not None
        assert "netns fd check failed" in caplog.text


def _fds(n: int) -> list[int]:
    return [os.open(NETNS, os.O_RDONLY) for _ in range(n)]


VIOLATIONS: list[tuple[str, bytes, int]] = [
    # (id, record, number of fds to attach)
    ("garbage", b"garbage!", 0),
    ("garbage-with-fd", b"\xff\xff\xff", 1),
    ("truncated", encode_del("u" * 2000), 0),
    ("too-many-fds-ctrunc", encode_add("u", INFO), 20),
    ("fd-on-del", encode_del("u"), 1),
    ("fd-on-keep", encode_keep("u"), 1),
    ("two-fds", encode_add("u", INFO), 2),
    ("add-without-fd", encode_add("u", INFO), 0),
    ("missing-workload-info", encode_add("u", None), 1),
    ("second-snapshot", encode_snapshot_sent(), 0),
    ("keep-after-snapshot", encode_keep("u"), 0),
    ("unknown-payload", b"\x22\x00", 0),
]


@pytest.mark.parametrize(
    ("record", "nfds"), [v[1:] for v in VIOLATIONS], ids=[v[0] for v in VIOLATIONS]
)
async def test_protocol_violation_nacks_disconnects_and_reconnects(
    agent: FakeNodeAgent, record: bytes, nfds: int
) -> None:
    agent.put_pod("a", pod_info("a"), NETNS)
    handler, counters = Handler(), Counters()
    client = make_client(agent.path, handler, counters)
    async with running(client, handler):
        first = await asyncio.to_thread(agent.wait_for_snapshot)
        fds = _fds(nfds)
        try:
            ex = await asyncio.to_thread(agent.send_raw, record, fds)
        finally:
            for fd in fds:
                os.close(fd)
        assert ex.nacked and ex.ack is not None, ex
        assert ex.ack.error.startswith("failure to read message: ")
        assert await asyncio.to_thread(first.closed.wait, 5)
        assert first.close_reason == "EOF"
        await asyncio.to_thread(agent.wait_for_snapshot, 2)
        await eventually(lambda: counters.snapshots == 2)
        assert counters.disconnects == 1
        assert "u" not in handler.proxies
        assert handler.calls.count(("add", "a")) == 2


@pytest.mark.both_loops
async def test_reconnect_with_backoff_after_agent_restart(sock_path: str) -> None:
    handler, counters = Handler(), Counters()
    backoff = RecordingBackoff(initial=0.01, cap=0.08)
    client = make_client(sock_path, handler, counters, backoff)
    async with running(client, handler):
        with FakeNodeAgent(sock_path) as agent:
            agent.put_pod("a", pod_info("a"), NETNS)
            await asyncio.to_thread(agent.wait_for_snapshot)
        # the agent is gone (socket file removed): connects fail, the delay doubles up to the cap
        await eventually(lambda: counters.disconnects == 1)
        await eventually(lambda: len(backoff.delays) >= 6)
        outage = list(backoff.delays)
        assert outage[:5] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.08])
        assert not client.connected and not client.snapshot_done
        with FakeNodeAgent(sock_path) as agent2:
            agent2.put_pod("b", pod_info("b"), NETNS)
            await asyncio.to_thread(agent2.wait_for_snapshot)
            await eventually(lambda: counters.snapshots == 2)
            assert handler.calls[-1] == ("reconcile", frozenset({"b"}))
            assert set(handler.proxies) == {"b"}
            assert client.connections == 2
            # a completed snapshot resets the backoff
            assert backoff.next() == pytest.approx(0.01)


async def test_connect_refused_by_stale_socket_file(sock_path: str) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(sock_path)
    stale.close()  # the file stays, nobody listens: ECONNREFUSED
    handler, counters = Handler(), Counters()
    backoff = RecordingBackoff(initial=0.01, cap=0.05)
    client = make_client(sock_path, handler, counters, backoff)
    async with running(client, handler):
        await eventually(lambda: len(backoff.delays) >= 3)
        assert client.connections == 0
        with FakeNodeAgent(sock_path) as agent:  # removes the stale file first
            await asyncio.to_thread(agent.wait_for_snapshot)
            await eventually(lambda: counters.snapshots == 1)


# --------------------------------------------------------------------------------------------
# backoff


def test_backoff_doubles_caps_and_resets() -> None:
    b = Backoff(rand=lambda: 0.5)  # 0.5 = no jitter
    delays = [b.next() for _ in range(14)]
    assert delays[:4] == pytest.approx([0.01, 0.02, 0.04, 0.08])
    assert max(delays) == 15.0 and delays[-1] == 15.0
    assert all(x <= y for x, y in itertools.pairwise(delays))
    b.reset()
    assert b.next() == pytest.approx(0.01)


def test_backoff_jitter_bounds() -> None:
    low, high = Backoff(rand=lambda: 0.0), Backoff(rand=lambda: 1.0)
    assert low.next() == pytest.approx(0.008) and high.next() == pytest.approx(0.012)
    capped = Backoff(initial=15.0, rand=lambda: 1.0)
    assert capped.next() == 15.0
    for kwargs in ({"initial": 0}, {"factor": 0.5}, {"cap": 0.001}, {"jitter": 1.0}):
        with pytest.raises(ValueError):
            Backoff(**kwargs)
