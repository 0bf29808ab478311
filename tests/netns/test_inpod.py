"""In-pod (shared) mode: one ztunnel per node fed by a node agent over ZDS, listening inside each
pod's network namespace; pods added and deleted, agent and ztunnel restarts, upgrades, bad input."""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.testing.apps import connect_from, recv_line, start_app
from ztunnel.testing.netns import Node, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import ZtunnelProcess

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root")]


def config(pods: list[Pod]) -> str:
    out = ["workloads:"]
    for p in pods:
        assert p.node is not None
        out.append(
            f"""- uid: cluster1//v1/Pod/default/{p.name}
  name: {p.name}
  namespace: default
  serviceAccount: sa-{p.name}
  trustDomain: cluster.local
  workloadIps: ["{p.ip4}", "{p.ip6}"]
  protocol: HBONE
  node: {p.node.name}"""
        )
    return "\n".join(out) + "\n"


def info(p: Pod) -> WorkloadInfo:
    return WorkloadInfo(name=p.name, namespace="default", service_account=f"sa-{p.name}")


@dataclass
class Cluster:
    tb: Testbed
    n1: Node
    n2: Node
    c1: Pod
    c2: Pod
    s1: Pod
    env: dict[str, str]
    agents: dict[str, FakeNodeAgent] = field(default_factory=dict)
    zts: list[ZtunnelProcess] = field(default_factory=list)
    tmp: str = ""

    def ztunnel(self, node: Node, loop: str = "uvloop", **extra: str) -> ZtunnelProcess:
        env = {**self.env, "NODE_NAME": node.name, "INPOD_UDS": self.uds(node), **extra}
        zt = ZtunnelProcess(node, env, loop=loop).start()
        self.zts.append(zt)
        return zt

    def uds(self, node: Node) -> str:
        return os.path.join(self.tmp, f"{node.name}.sock")

    def agent(self, node: Node) -> FakeNodeAgent:
        agent = FakeNodeAgent(self.uds(node)).start()
        self.agents[node.name] = agent
        return agent

    def start(self, *n1_pods: Pod) -> tuple[FakeNodeAgent, ZtunnelProcess, ZtunnelProcess]:
        """Node agents knowing c1 (plus ``n1_pods``) on n1 and s1 on n2, a ztunnel per node with
        its snapshot applied, and an echo app on s1:8080."""
        a1, a2 = self.agent(self.n1), self.agent(self.n2)
        for pod in (self.c1, *n1_pods):
            a1.put_pod(f"uid-{pod.name}", info(pod), pod)  # known before start: in the snapshot
        a2.put_pod("uid-s1", info(self.s1), self.s1)
        z1, z2 = self.ztunnel(self.n1), self.ztunnel(self.n2)
        a1.wait_for_snapshot()
        a2.wait_for_snapshot()
        start_app(self.s1, "echo", ports=(8080,))
        return a1, z1, z2


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        c1, c2, s1 = n1.add_pod("c1"), n1.add_pod("c2"), n2.add_pod("s1")
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": config([c1, c2, s1]),
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
            "CONNECTION_TERMINATION_DEADLINE": "2s",
        }
        cl = Cluster(tb, n1, n2, c1, c2, s1, env, tmp=tmp)
        try:
            yield cl
        finally:
            codes = [(zt.stop(), zt.internal_errors()) for zt in cl.zts]
            for agent in cl.agents.values():
                agent.close()
            for rc, errors in codes:
                assert rc == 0, errors


def echo_through(src: Pod, dst: Pod, port: int, msg: bytes = b"hi\n") -> str:
    with connect_from(src, dst.ip4, port, timeout=5) as s:
        s.sendall(msg)
        return recv_line(s)


def settled(zt: ZtunnelProcess) -> dict[str, int]:
    """Runtime stats once no connection is open (closing ones finish their teardown first)."""
    deadline = time.monotonic() + 10
    while True:
        stats = zt.runtime_stats()
        if stats["connections"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def listening(pod: Pod, port: int) -> bool:
    out = pod.run("ss", "-Hltn", f"sport = :{port}").stdout
    return bool(out.strip())


def test_pods_added_before_and_after_start_are_proxied() -> None:
    with cluster() as cl:
        a1, z1, z2 = cl.start()
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"
        ex = a1.add_pod("uid-c2", info(cl.c2), cl.c2)  # steady state, after start
        assert ex.acked, ex
        assert echo_through(cl.c2, cl.s1, 8080) == "hi"
        for pod in (cl.c1, cl.c2):
            rec = z1.wait_for(
                lambda r, p=pod: (
                    r.get("message") == "connection complete" and r.get("src.workload") == p.name
                )
            )
            assert rec["src.identity"] == f"spiffe://cluster.local/ns/default/sa/sa-{pod.name}"
            assert rec["dst.addr"] == f"{cl.s1.ip4}:15008"
        inbound = z2.wait_for(lambda r: r.get("direction") == "inbound")
        assert inbound["dst.workload"] == "s1"
        assert z1.runtime_stats()["proxies"] == 2


def test_deleted_pod_closes_listeners_and_connections() -> None:
    with cluster() as cl:
        a1, z1, _z2 = cl.start()
        s = connect_from(cl.c1, cl.s1.ip4, 8080, timeout=5)
        s.sendall(b"one\n")
        assert recv_line(s) == "one"
        assert listening(cl.c1, 15001) and listening(cl.c1, 15008)
        [ex] = a1.del_pod("uid-c1")
        assert ex.acked
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(100) == b""  # closed at once, no grace period
        s.close()
        assert (
            not listening(cl.c1, 15001)
            and not listening(cl.c1, 15006)
            and not listening(cl.c1, 15008)
        )
        assert z1.runtime_stats()["proxies"] == 0


def test_agent_restart_reconciles_and_keeps_surviving_pods() -> None:
    with cluster() as cl:
        a1, z1, _z2 = cl.start(cl.c2)
        live = connect_from(cl.c1, cl.s1.ip4, 8080, timeout=5)
        live.sendall(b"before\n")
        assert recv_line(live) == "before"

        # The node agent restarts and no longer knows c2 (it was deleted meanwhile); c1 comes
        # back as "keep" (its netns could not be reopened), which must keep its proxy running.
        a1.close()
        new_agent = FakeNodeAgent(cl.uds(cl.n1)).start()
        cl.agents["n1"] = new_agent
        new_agent.put_pod("uid-c1", info(cl.c1), None)
        new_agent.wait_for_snapshot(timeout=20)
        z1.wait_for(lambda r: "snapshot applied" in str(r.get("message")), timeout=20)
        deadline = time.monotonic() + 10
        while listening(cl.c2, 15001) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not listening(cl.c2, 15001), "c2 was not in the snapshot: its proxy must stop"
        assert listening(cl.c1, 15001)
        live.sendall(b"after\n")  # the connection through c1 survived the agent restart
        assert recv_line(live) == "after"
        live.close()
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"


def test_ztunnel_restart_gets_snapshot() -> None:
    with cluster() as cl:
        a1, z1, _z2 = cl.start()
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"
        assert z1.stop() == 0
        cl.zts.remove(z1)
        assert not listening(cl.c1, 15001)
        cl.ztunnel(cl.n1)
        a1.wait_for_snapshot(count=2)
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"


def test_upgrade_two_ztunnels_side_by_side_refuse_nothing() -> None:
    with cluster() as cl:
        a1, old, _z2 = cl.start()

        failures: list[BaseException] = []
        done = 0
        stop = threading.Event()

        def traffic() -> None:
            nonlocal done
            while not stop.is_set():
                try:
                    assert echo_through(cl.c1, cl.s1, 8080) == "hi"
                    done += 1
                except BaseException as e:
                    failures.append(e)

        t = threading.Thread(target=traffic)
        t.start()
        try:
            time.sleep(0.5)
            # The new one gets the snapshot and binds in each pod with SO_REUSEPORT. (In a cluster
            # it has a network namespace of its own; here it shares the node's, hence the ports.)
            cl.ztunnel(
                cl.n1,
                ZTUNNEL_ADMIN_PORT="25000",
                ZTUNNEL_STATS_PORT="25020",
                ZTUNNEL_READINESS_PORT="25021",
            )
            a1.wait_for_snapshot(count=2)
            time.sleep(0.5)
            assert old.stop() == 0  # the old one drains and exits
            cl.zts.remove(old)
            time.sleep(0.5)
        finally:
            stop.set()
            t.join(20)
        assert not failures, failures[:3]
        assert done > 20


def test_bad_input_is_rejected_and_other_pods_keep_working() -> None:
    with cluster() as cl:
        a1, z1, _z2 = cl.start()
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"
        base = settled(z1)

        cases: list[tuple[bytes, int]] = [
            (b"\xff\xff\xff garbage", 0),
            (b"\x0a\x05\x0a\x03ab", 0),  # truncated add
            (b"\x12\x03\x12\x01u", 1),  # a del carrying an fd
            (b"\x1a\x00", 2),  # SnapshotSent with two fds (and a second SnapshotSent)
            (b"\x2a\x03\x0a\x01u", 0),  # keep after the snapshot
            (b"\x0a\x03\x0a\x01u", 1),  # add without workload_info
        ]
        for i, (raw, nfds) in enumerate(cases):
            fds = [os.open("/proc/self/ns/net", os.O_RDONLY) for _ in range(nfds)]
            try:
                ex = a1.send_raw(raw, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            assert ex.ack is None or ex.nacked, (i, ex)
            a1.wait_for_snapshot(count=i + 2, timeout=20)  # ztunnel reconnected and resynced
            assert echo_through(cl.c1, cl.s1, 8080) == "hi", i
        after = settled(z1)
        assert after["proxies"] == 1
        # fds that came with bad messages were closed: nothing grew but idle pooled pipes (and,
        # with several workers, the pooled HBONE connection of a worker that had none yet).
        assert after["fds"] - 2 * after.get("pipes_idle", 0) <= base["fds"] - 2 * base.get(
            "pipes_idle", 0
        ) + (z1.workers - 1)


def test_nack_when_listeners_cannot_bind_then_retry() -> None:
    with cluster() as cl:
        a1 = cl.agent(cl.n1)
        cl.ztunnel(cl.n1)
        a1.wait_for_snapshot()
        # Something else already holds 15001 in the pod, without SO_REUSEPORT.
        from ztunnel.testing.apps import socket_in

        blocker = socket_in(cl.c1, socket.AF_INET6)
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("::", 15001))
        blocker.listen()
        ex = a1.add_pod("uid-c1", info(cl.c1), cl.c1)
        assert ex.nacked and "15001" in (ex.ack.error if ex.ack else ""), ex
        blocker.close()
        deadline = time.monotonic() + 12  # retried every 5 s
        while not listening(cl.c1, 15008) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listening(cl.c1, 15008)


def test_a_killed_worker_comes_back_serving_every_pod() -> None:
    """Two data-plane workers (whatever the suite's count): one is killed with SIGKILL; the
    other keeps both pods served, and the one forked in its place gets every pod's listeners
    and the state again and accepts from them."""
    import json
    import re
    import signal

    from ztunnel.testing.xdsbed import http_get

    with cluster() as cl:
        cl.env["ZTUNNEL_WORKER_THREADS"] = "2"
        _a1, z1, _z2 = cl.start(cl.c2)
        z1.expected_errors.append("exited; restarting it")
        victim = z1.data_plane_pids()[0]
        since = len(z1.records)
        os.kill(victim, signal.SIGKILL)
        assert echo_through(cl.c1, cl.s1, 8080) == "hi"  # the other worker serves meanwhile
        z1.wait_for(
            lambda r: (
                re.fullmatch(r"worker \d+ ready \(pid \d+\)", r.get("message", "")) is not None
            ),
            15,
            start=since,
        )
        assert victim not in z1.data_plane_pids()
        held = []
        want = {"default/c1": {"w0", "w1"}, "default/c2": {"w0", "w1"}}
        owners: dict[str, set[str]] = {}
        try:
            # Both pods' listeners are served by both workers, the new one included. Which
            # worker takes a connection from the shared queue is the kernel's choice (runs of
            # one are common), so connections are held in rounds until each pod has seen both.
            for round_ in range(10):
                for pod in (cl.c1, cl.c2):
                    for i in range(10):
                        s = connect_from(pod, cl.s1.ip4, 8080, timeout=5).__enter__()
                        s.sendall(f"{pod.name} {round_} {i}\n".encode())
                        assert recv_line(s) == f"{pod.name} {round_} {i}"
                        held.append(s)
                status, body = http_get(cl.n1, 15000, "/debug/connections")
                assert status == 200
                for r in json.loads(body)["connections"]:
                    target = r["hboneAddr"] or r["originalDst"] or r["dst"]
                    if r["direction"] == "outbound" and target.endswith(":8080"):
                        owners.setdefault(r["proxy"], set()).add(r["id"].split("-")[0])
                if owners == want:
                    break
            assert owners == want, owners
        finally:
            for s in held:
                s.close()


def hold_connections(
    src: Pod, ip: str, port: int, n: int, *, inflight: int = 200, answer_within: float = 5.0
) -> tuple[collections.Counter[str], list[socket.socket]]:
    """Open ``n`` connections from ``src`` to ``ip:port``, each echoing one line, and keep every
    one open; at most ``inflight`` unanswered at once, each given ``answer_within`` seconds.
    Returns the outcomes ("ok", or what went wrong) and the sockets (the caller closes them)."""
    from ztunnel.testing.apps import socket_in

    sel = selectors.DefaultSelector()
    outcomes: collections.Counter[str] = collections.Counter()
    socks: list[socket.socket] = []
    waiting: dict[socket.socket, float] = {}  # -> deadline

    def done(s: socket.socket, outcome: str) -> None:
        sel.unregister(s)
        del waiting[s]
        outcomes[outcome] += 1

    try:
        while len(socks) < n or waiting:
            while len(socks) < n and len(waiting) < inflight:
                s = socket_in(src)
                s.setblocking(False)
                socks.append(s)
                s.connect_ex((ip, port))
                sel.register(s, selectors.EVENT_WRITE, "connecting")
                waiting[s] = time.monotonic() + answer_within
            for key, _ in sel.select(0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                if key.data == "connecting":
                    if err := s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        done(s, f"connect: {os.strerror(err)}")
                        continue
                    s.send(b"hi\n")
                    sel.modify(s, selectors.EVENT_READ, "reading")
                    continue
                try:
                    done(s, "ok" if s.recv(16) == b"hi\n" else "closed")
                except OSError as e:
                    done(s, f"recv: {e.strerror}")
            now = time.monotonic()
            for s, deadline in list(waiting.items()):
                if now > deadline:
                    done(s, f"no answer ({sel.get_key(s).data})")  # connecting / reading
    finally:
        sel.close()
    return outcomes, socks


def test_thousands_of_concurrent_plaintext_inbound_connections_all_succeed() -> None:
    """5,000 connections held open at once from a client outside the mesh into s1's 15006,
    the client's source IP spoofed on the way to the app: every one is answered.

    Both the client and ztunnel's upstream leave from the client's IP to the same app port, and
    the pod's conntrack holds both flows: the client's (redirected to 15006) and ztunnel's
    upstream (marked, not redirected). Two with the same ports are one conntrack entry: the
    client's SYN goes to the app's established socket and is never answered (SYN-SENT), or
    ztunnel's is redirected to 15006. The kernel picks ports for connect() even first, for
    bind(ip, 0) odd first; ztunnel's upstream is bound to (client IP, 0) as in Rust's
    freebind_connect, so it never picks a port the client's connect() uses. With the port
    picked at connect (IP_BIND_ADDRESS_NO_PORT, before) about 6% of these hung."""
    with cluster() as cl:
        cl.start()  # c2 is not enrolled: its traffic reaches s1 in plaintext
        outcomes, socks = hold_connections(cl.c2, cl.s1.ip4, 8080, 5000)
        try:
            assert outcomes == {"ok": 5000}, outcomes
            # All still open at once and working: one more line on each.
            for s in socks:
                s.setblocking(True)
                s.settimeout(5)
                s.sendall(b"again\n")
            assert all(recv_line(s) == "again" for s in socks)
        finally:
            for s in socks:
                s.close()


def accepted_on(pod: Pod, port: int) -> list[str]:
    """``ss -tnoe`` rows of the connections accepted on ``port`` in ``pod``."""
    return pod.run("ss", "-Htnoe", "state", "established", f"sport = :{port}").stdout.splitlines()


def test_accepted_connections_carry_keepalive_and_the_mark() -> None:
    """Connections accepted on 15001 and 15006 get TCP keepalive (KEEPALIVE_TIME, 180 s), as
    Rust's socket::Listener::accept sets it on those two (15008 has HTTP/2 PINGs instead), and
    every accepted connection carries ztunnel's mark 0x539, as Rust's in-pod socket factory
    marks its listening sockets (istio-cni's rules tell ztunnel's own packets by it). Both are
    set once on the listening socket and inherited by each connection."""
    with cluster() as cl:
        cl.start()
        held = [connect_from(cl.c1, cl.s1.ip4, 8080), connect_from(cl.c2, cl.s1.ip4, 8080)]
        try:
            for s in held:  # through 15001 -> HBONE 15008, and plaintext into 15006
                s.sendall(b"ping\n")
                assert recv_line(s) == "ping"
            rows = {
                15001: accepted_on(cl.c1, 15001),
                15006: accepted_on(cl.s1, 15006),
                15008: accepted_on(cl.s1, 15008),
            }
            assert all(len(r) == 1 for r in rows.values()), rows
            for port, [row] in rows.items():
                assert "fwmark:0x539" in row, (port, row)
                assert ("timer:(keepalive," in row) is (port != 15008), (port, row)
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize(
    ("drop", "error"),
    [
        (
            "-net_admin,-net_raw",
            "failed to set socket mark: failed to set mark on socket. make sure ztunnel has "
            'CAP_NET_RAW, CAP_NET_ADMIN. error: Os { code: 1, kind: PermissionDenied, message: "',
        ),
        ("-sys_admin", 'failed to set netns: Os { code: 1, kind: PermissionDenied, message: "'),
    ],
)
def test_shared_mode_without_its_capabilities_fails_at_start(drop: str, error: str) -> None:
    """Without CAP_NET_ADMIN and CAP_NET_RAW (SO_MARK) or CAP_SYS_ADMIN (setns), a shared-mode
    ztunnel exits at start with Rust's message (WorkloadProxyManager::verify_syscalls) instead
    of starting and NACKing the node agent's pods one by one. The capabilities leave the
    bounding set (setpriv), so the exec'd interpreter, root or not, never has them."""
    import subprocess
    import sys

    from ztunnel.testing.netns import _PROJECT_ROOT

    with cluster() as cl:
        agent = cl.agent(cl.n1)
        agent.put_pod("uid-c1", info(cl.c1), cl.c1)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PROXY_", "LOCAL_XDS"))},
            **cl.env,
            "NODE_NAME": cl.n1.name,
            "INPOD_UDS": cl.uds(cl.n1),
            "PYTHONPATH": _PROJECT_ROOT,
            "LOG_FORMAT": "plain",
        }
        proc = cl.n1.popen(
            *("setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"),
            *(sys.executable, "-m", "ztunnel", "proxy", "ztunnel"),
            env=env,
            stderr=subprocess.STDOUT,
        )
        out, _ = proc.popen.communicate(timeout=30)
        text = out.decode(errors="replace")
        assert proc.popen.returncode == 1, text
        assert f"failed to start: failed to start workload proxy manager {error}" in text, text
        assert not agent.all_connections  # it never got as far as the node agent
