"""New connections through SOCKS5 (``UNSTABLE_ENABLE_SOCKS5``) beside the same connections
captured to 15001, to the same HBONE destination, in one run: the client's time from connect to
the first echoed byte, and the CPU of the client node's ztunnel (every process of its tree) per
connection. Rounds alternate the two paths.

A SOCKS5 connection costs the handshake (two more round trips on loopback, as curl does them:
greeting, then request) and its reply waits for the HBONE CONNECT's 200; a captured connection's
first bytes wait for the same 200 inside ztunnel, so both latencies include it.

Usage (root): ``python benchmarks/bench_socks5.py [--conns 300] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_hbone as bh  # noqa: E402

from ztunnel.inpod.protocol import WorkloadInfo  # noqa: E402
from ztunnel.testing.apps import connect_from, start_app  # noqa: E402
from ztunnel.testing.hbone import workload_yaml  # noqa: E402
from ztunnel.testing.netns import Pod, Testbed  # noqa: E402
from ztunnel.testing.nodeagent import FakeNodeAgent  # noqa: E402
from ztunnel.testing.proc import ZtunnelProcess  # noqa: E402


def cpu_seconds(root: int) -> float:
    total = 0.0
    for pid in bh.proc_tree(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / bh.CLK_TCK
    return total


def _echo(s: socket.socket) -> None:
    s.sendall(b"x\n")
    got = b""
    while not got.endswith(b"\n"):
        chunk = s.recv(64)
        if not chunk:
            raise ConnectionError("closed before the echo")
        got += chunk


def captured(c1: Pod, ip: str) -> None:
    with connect_from(c1, ip, 8080, timeout=10) as s:
        _echo(s)


def socks5(c1: Pod, ip: str) -> None:
    with connect_from(c1, "127.0.0.1", 15080, timeout=10) as s:
        s.sendall(b"\x05\x01\x00")
        assert s.recv(2) == b"\x05\x00"
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(ip) + (8080).to_bytes(2, "big"))
        reply = b""
        while len(reply) < 10:
            chunk = s.recv(10 - len(reply))
            if not chunk:
                raise ConnectionError("closed before the reply")
            reply += chunk
        assert reply[1] == 0, reply
        _echo(s)


@contextlib.contextmanager
def bed() -> Iterator[tuple[Pod, Pod, ZtunnelProcess]]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        c1, s1 = n1.add_pod("c1"), n2.add_pod("s1")
        cfg = "workloads:\n" + workload_yaml(c1, "sa-c1") + workload_yaml(s1, "sa-s1")
        agents = {n: FakeNodeAgent(os.path.join(tmp, f"{n}.sock")).start() for n in ("n1", "n2")}
        for agent, pod in ((agents["n1"], c1), (agents["n2"], s1)):
            info = WorkloadInfo(
                name=pod.name, namespace="default", service_account=f"sa-{pod.name}"
            )
            agent.put_pod(f"uid-{pod.name}", info, pod)
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": cfg,
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
            "UNSTABLE_ENABLE_SOCKS5": "true",
            "RUST_LOG": "info",  # (the access log at info, as by default; no debug lines)
        }
        zts = []
        try:
            for node in (n1, n2):
                zt = ZtunnelProcess(
                    node, {**env, "NODE_NAME": node.name, "INPOD_UDS": agents[node.name].path}
                )
                zts.append(zt)
            for zt in zts:
                zt.start()
            for agent in agents.values():
                agent.wait_for_snapshot()
            app = start_app(s1, "echo", ports=(8080,))
            try:
                yield c1, s1, zts[0]
            finally:
                app.stop()
        finally:
            for zt in zts:
                zt.stop()
            for agent in agents.values():
                agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--conns", type=int, default=300, help="connections per path per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    paths: dict[str, Callable[[Pod, str], None]] = {"15001": captured, "socks5": socks5}
    lat: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    with bed() as (c1, s1, zt):
        for fn in paths.values():  # warm-up: the pooled HBONE connection, imports
            for _ in range(20):
                fn(c1, s1.ip4)
        for r in range(args.rounds):
            for name, fn in paths.items():
                c0 = cpu_seconds(zt.pid)
                for _ in range(args.conns):
                    t0 = time.perf_counter()
                    fn(c1, s1.ip4)
                    lat[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((cpu_seconds(zt.pid) - c0) / args.conns * 1e6)
                print(f"round {r + 1} {name}: {cpu[name][-1]:.0f} us CPU/conn", flush=True)
    print(f"\n{'path':8} {'p50 ms':>8} {'p90 ms':>8} {'CPU us/conn (median of rounds)':>32}")
    for name in paths:
        q = statistics.quantiles(lat[name], n=10)
        print(
            f"{name:8} {statistics.median(lat[name]):8.2f} {q[8]:8.2f} {statistics.median(cpu[name]):32.0f}"
        )


if __name__ == "__main__":
    main()
