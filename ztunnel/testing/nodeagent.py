"""A fake istio-cni node agent: the ZDS server side, to drive a ztunnel under test.

It speaks what istio-cni's ``ztunnelserver.go`` speaks (reference 3.1, 3.3): it listens on a unix
SEQPACKET socket (removing a stale file first), reads each ztunnel's bare ``ZdsHello``, sends its
pod cache as the snapshot (``add`` + the netns fd via SCM_RIGHTS for pods with a netns, ``keep``
for pods without), each one waiting for the answer (5 s deadline), then ``SnapshotSent``. In
steady state ``add_pod`` goes to the newest connection only and ``del_pod`` is broadcast to
every connection. Every request and its answer are recorded as ``Exchange`` objects so tests
can assert ACKs and NACKs; ``send_raw`` sends arbitrary bytes and fds for bad-input tests.
While idle it checks each connection like the real agent: EOF means ztunnel left, an
unsolicited record is a protocol error and closes the connection.

Threading (chosen so sync tests can use it as is): an accept thread plus one thread per
connection, which alone writes to that connection (answers correlate only by order). Public
methods are blocking and thread-safe. From an async test whose event loop runs the ztunnel
client, call them via ``await asyncio.to_thread(agent.add_pod, ...)``: calling them directly
on that loop would block the client that has to answer.

Netns references (``NetnsRef``): an ``ip netns`` name or a path (opened with ``open_netns`` when
sent, closed right after), an int fd (owned by the caller, sent as is), or a test-bed ``Pod``
(its namespace; unless ``install_rules=False`` the agent first installs the in-pod iptables
rules with ``Pod.install_inpod_rules()``, as istio-cni does before it sends the add).
"""

from __future__ import annotations

import array
import concurrent.futures
import contextlib
import functools
import itertools
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

from ztunnel.inpod.protocol import (
    MAX_RECORD_SIZE,
    Ack,
    WorkloadInfo,
    ZdsProtocolError,
    close_fds,
    decode_hello,
    decode_response,
    encode_add,
    encode_del,
    encode_keep,
    encode_snapshot_sent,
    fds_from_ancdata,
)
from ztunnel.net.netns import open_netns
from ztunnel.testing.netns import Pod

READ_WRITE_DEADLINE: Final = 5.0
"""Per-message read/write deadline of the real node agent."""

NetnsRef = str | int | Pod


class NodeAgentError(RuntimeError):
    """The fake agent could not do what was asked (no connection, closed, timed out)."""


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request the agent sent and what came back.

    ``ack`` is ztunnel's answer (None if none arrived); ``error`` is set when the exchange
    failed on the agent's side (send failed, deadline passed, EOF, undecodable answer)."""

    conn_id: int
    kind: str  # "add", "keep", "del", "snapshot_sent" or "raw"
    uid: str | None
    ack: Ack | None
    error: str | None = None

    @property
    def acked(self) -> bool:
        return self.ack is not None and self.ack.ok

    @property
    def nacked(self) -> bool:
        return self.ack is not None and not self.ack.ok


@dataclass
class _Pod:
    info: WorkloadInfo | None
    netns: NetnsRef | None  # None: no netns known -> "keep" in the snapshot


@dataclass
class _Job:
    kind: str
    uid: str | None
    data: bytes
    netns: NetnsRef | None = None
    fds: Sequence[int] = ()
    done: concurrent.futures.Future[Exchange] = field(default_factory=concurrent.futures.Future)


class AgentConnection:
    """One accepted ztunnel connection, as the agent sees it."""

    def __init__(self, conn_id: int, sock: socket.socket) -> None:
        self.id = conn_id
        self.sock = sock
        self.hello_version: int | None = None
        self.snapshot_done = threading.Event()
        self.closed = threading.Event()
        self.close_reason: str | None = None
        self._jobs: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._finished = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closing = False

    def __repr__(self) -> str:
        return f"<AgentConnection {self.id} hello={self.hello_version} reason={self.close_reason}>"

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if not self._finished and not self._closing:
                self._jobs.append(job)
                self._wake()
                return
        job.done.set_result(Exchange(self.id, job.kind, job.uid, None, "connection closed"))

    def _finish(self) -> list[_Job]:
        """Accept no more jobs; the ones never sent."""
        with self._lock:
            self._finished = True
            pending = list(self._jobs)
            self._jobs.clear()
        return pending

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _request_close(self) -> None:
        self._closing = True
        self._wake()


class FakeNodeAgent:
    """The ZDS server (see the module docstring). Use as a context manager or start()/close()."""

    def __init__(
        self,
        path: str,
        *,
        deadline: float = READ_WRITE_DEADLINE,
        install_rules: bool = True,
        dns_capture: bool = False,
        auto_snapshot: bool = True,
        accept_rate: float | None = None,
    ) -> None:
        """``auto_snapshot=False``: send no snapshot; the test drives everything (``send_raw``).
        ``accept_rate``: at most that many accepts per second, like the real agent (5)."""
        self.path = path
        self.deadline = deadline
        self.install_rules = install_rules
        self.dns_capture = dns_capture
        self.auto_snapshot = auto_snapshot
        self.accept_rate = accept_rate
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pods: dict[str, _Pod] = {}
        self._conns: list[AgentConnection] = []
        self._all_conns: list[AgentConnection] = []
        self._exchanges: list[Exchange] = []
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = False

    # ----------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> FakeNodeAgent:
        """Remove a stale socket file, listen, start accepting."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            lst.bind(self.path)
            lst.listen(16)
        except BaseException:
            lst.close()
            raise
        self._listener = lst
        self._spawn(self._accept_loop, "zds-agent-accept")
        return self

    def close(self) -> None:
        """Stop accepting, close every connection, join the threads, remove the socket file."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c._request_close()
        for t in self._threads:
            t.join(timeout=10)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        close_fds([self._stop_r, self._stop_w])
        for c in self._all_conns:
            close_fds([c._wake_r, c._wake_w])

    def __enter__(self) -> FakeNodeAgent:
        return self.start() if self._listener is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def drop_connections(self, timeout: float = 10.0) -> None:
        """Close every current connection (the agent keeps listening) and wait until closed."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c._request_close()
        for c in conns:
            c.closed.wait(timeout)

    # ----------------------------------------------------------------------------------------
    # the pod cache (what each new connection gets as its snapshot)

    def put_pod(self, uid: str, info: WorkloadInfo | None, netns: NetnsRef | None = None) -> None:
        """Know pod ``uid`` without sending anything now; ``netns=None`` -> "keep" in snapshots."""
        if isinstance(netns, Pod):
            self._prepare_pod(netns)
        with self._lock:
            self._pods[uid] = _Pod(info, netns)

    def forget_pod(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)

    # ----------------------------------------------------------------------------------------
    # steady state

    def add_pod(
        self,
        uid: str,
        info: WorkloadInfo | None,
        netns: NetnsRef,
        *,
        timeout: float | None = None,
    ) -> Exchange:
        """Cache the pod and send ``add`` + its netns fd to the newest connection; the exchange.

        Raises ``NodeAgentError`` when no ztunnel is connected (the real agent then fails the
        pod's CNI ADD). ``info=None`` sends an add without workload_info (a bad-input test)."""
        if isinstance(netns, Pod):
            self._prepare_pod(netns)
        with self._lock:
            self._pods[uid] = _Pod(info, netns)
            conn = self._newest()
        return self._run(conn, _Job("add", uid, encode_add(uid, info), netns=netns), timeout)

    def del_pod(self, uid: str, *, timeout: float | None = None) -> list[Exchange]:
        """Forget the pod and broadcast ``del`` to every connection; one exchange per connection."""
        with self._lock:
            self._pods.pop(uid, None)
            conns = list(self._conns)
        jobs = [(c, _Job("del", uid, encode_del(uid))) for c in conns]
        for c, job in jobs:
            c._submit(job)
        return [self._result(job, timeout) for _, job in jobs]

    def send_raw(
        self,
        data: bytes,
        fds: Sequence[int] = (),
        *,
        conn: AgentConnection | None = None,
        timeout: float | None = None,
    ) -> Exchange:
        """Send one arbitrary record (with these fds, owned by the caller) and await the answer.

        Goes to ``conn`` or the newest connection. ztunnel NACKs a bad record and disconnects,
        so the exchange usually carries the NACK and the connection closes right after."""
        if conn is None:
            with self._lock:
                conn = self._newest()
        return self._run(conn, _Job("raw", None, data, fds=list(fds)), timeout)

    # ----------------------------------------------------------------------------------------
    # observation

    @property
    def connections(self) -> list[AgentConnection]:
        """Open connections, oldest first."""
        with self._lock:
            return list(self._conns)

    @property
    def all_connections(self) -> list[AgentConnection]:
        """Every connection ever accepted, oldest first."""
        with self._lock:
            return list(self._all_conns)

    @property
    def exchanges(self) -> list[Exchange]:
        with self._lock:
            return list(self._exchanges)

    def acked(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.acked]

    def nacked(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.nacked]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Block until ``predicate()`` (checked on every agent state change) or raise."""
        end = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = end - time.monotonic()
                if left <= 0:
                    raise NodeAgentError(f"timed out after {timeout}s waiting for the agent state")
                self._changed.wait(min(left, 0.1))

    def wait_for_snapshot(self, count: int = 1, timeout: float = 10.0) -> AgentConnection:
        """Wait until ``count`` connections (ever) finished their snapshot; the newest such one.

        With ``auto_snapshot=False`` a connection counts once its hello was read."""
        done: list[AgentConnection] = []

        def ready() -> bool:
            done[:] = [c for c in self._all_conns if c.snapshot_done.is_set()]
            return len(done) >= count

        self.wait_for(ready, timeout)
        return done[-1]

    # ----------------------------------------------------------------------------------------
    # internals

    def _prepare_pod(self, pod: Pod) -> None:
        if self.install_rules and pod.inpod_rules is None:
            pod.install_inpod_rules(dns_capture=self.dns_capture)

    def _newest(self) -> AgentConnection:
        if self._closed:
            raise NodeAgentError("the node agent is closed")
        if not self._conns:
            raise NodeAgentError("no ztunnel connection")
        return self._conns[-1]

    def _run(self, conn: AgentConnection, job: _Job, timeout: float | None) -> Exchange:
        conn._submit(job)
        return self._result(job, timeout)

    def _result(self, job: _Job, timeout: float | None) -> Exchange:
        try:
            return job.done.result(timeout if timeout is not None else 2 * self.deadline + 5)
        except concurrent.futures.TimeoutError:
            raise NodeAgentError(f"no result for {job.kind} {job.uid!r}") from None

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        lst = self._listener
        last = 0.0
        while True:
            ready, _, _ = select.select([lst.fileno(), self._stop_r], [], [])
            if self._stop_r in ready:
                return
            if self.accept_rate:
                wait = last + 1.0 / self.accept_rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            try:
                sock, _ = lst.accept()
            except OSError:
                continue
            last = time.monotonic()
            conn = AgentConnection(next(self._ids), sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    close_fds([conn._wake_r, conn._wake_w])
                    return
                self._conns.append(conn)
                self._all_conns.append(conn)
                self._spawn(functools.partial(self._serve, conn), f"zds-agent-conn-{conn.id}")
            self._notify()

    def _serve(self, conn: AgentConnection) -> None:
        try:
            reason = self._serve_inner(conn)
        except Exception as e:  # a bug in the fake: record it rather than lose it in a thread
            reason = f"agent error: {type(e).__name__}: {e}"
        conn.close_reason = reason
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        pending = conn._finish()
        conn.sock.close()
        conn.closed.set()
        for job in pending:
            if not job.done.done():
                job.done.set_result(Exchange(conn.id, job.kind, job.uid, None, "connection closed"))
        self._notify()

    def _serve_inner(self, conn: AgentConnection) -> str:
        sock = conn.sock
        sock.settimeout(self.deadline)
        try:
            data, _ = self._recv(sock)
        except TimeoutError:
            return "no hello within the deadline"
        except OSError as e:
            return f"reading hello: {e}"
        if not data:
            return "EOF before hello"
        try:
            conn.hello_version = decode_hello(data)
        except ZdsProtocolError as e:
            return str(e)
        self._notify()
        if self.auto_snapshot:
            failed = self._send_snapshot(conn)
            if failed is not None:
                return failed
        conn.snapshot_done.set()
        self._notify()
        while True:
            if conn._closing:
                return "closed by the agent"
            if conn._jobs:
                job = conn._jobs.popleft()
                ex, fatal = self._exchange(conn, job)
                job.done.set_result(ex)
                if fatal:
                    return ex.error or "connection failed"
                continue
            ready, _, _ = select.select([sock.fileno(), conn._wake_r], [], [])
            if conn._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(conn._wake_r, 4096)
            if sock.fileno() in ready and not conn._jobs and not conn._closing:
                # liveness check: ztunnel only ever answers, so EOF or a protocol error
                try:
                    data, _ = self._recv(sock)
                except OSError as e:
                    return f"liveness check: {e}"
                return "EOF" if not data else "protocol error: unexpected message from ztunnel"

    def _send_snapshot(self, conn: AgentConnection) -> str | None:
        with self._lock:
            snap = list(self._pods.items())
        for uid, pod in snap:
            if pod.netns is not None:
                job = _Job("add", uid, encode_add(uid, pod.info), netns=pod.netns)
            else:
                job = _Job("keep", uid, encode_keep(uid))
            ex, fatal = self._exchange(conn, job)
            if fatal:
                return ex.error
        ex, fatal = self._exchange(conn, _Job("snapshot_sent", None, encode_snapshot_sent()))
        return ex.error if fatal else None

    def _exchange(self, conn: AgentConnection, job: _Job) -> tuple[Exchange, bool]:
        """Send one request and read its answer: (the recorded exchange, connection is dead)."""
        ex, fatal = self._exchange_inner(conn, job)
        with self._lock:
            self._exchanges.append(ex)
        self._notify()
        return ex, fatal

    def _exchange_inner(self, conn: AgentConnection, job: _Job) -> tuple[Exchange, bool]:
        def result(ack: Ack | None, error: str | None = None) -> Exchange:
            return Exchange(conn.id, job.kind, job.uid, ack, error)

        sock = conn.sock
        opened: list[int] = []
        try:
            fds = list(job.fds)
            if job.netns is not None:
                if isinstance(job.netns, int):
                    fds.append(job.netns)
                else:
                    ref = job.netns.netns_path if isinstance(job.netns, Pod) else job.netns
                    opened.append(open_netns(ref))
                    fds += opened
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sock.sendmsg([job.data], anc)
        except OSError as e:
            return result(None, f"send: {e}"), True
        finally:
            close_fds(opened)
        try:
            data, eof = self._recv(sock)
        except TimeoutError:
            # like the real agent: report it, keep the connection
            return result(None, "timed out waiting for the answer"), False
        except OSError as e:
            return result(None, f"recv: {e}"), True
        if eof:
            return result(None, "EOF"), True
        try:
            return result(decode_response(data)), False
        except ZdsProtocolError as e:
            return result(None, str(e)), False

    @staticmethod
    def _recv(sock: socket.socket) -> tuple[bytes, bool]:
        """One record (fds that came with it are closed); (data, EOF)."""
        data, anc, flags, _ = sock.recvmsg(MAX_RECORD_SIZE, socket.CMSG_SPACE(4 * 4))
        fds = fds_from_ancdata(anc)
        close_fds(fds)
        return data, not data and not fds and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)


def pod_info(
    name: str, namespace: str = "default", service_account: str = "default"
) -> WorkloadInfo:
    """A ``WorkloadInfo`` the way istio-cni builds it from a pod (name, namespace, SA)."""
    return WorkloadInfo(name=name, namespace=namespace, service_account=service_account)
