"""Benchmark one HBONE stream end to end (ztunnel-a outbound + ztunnel-b inbound) in netns pods.

Usage: ``python benchmarks/bench_hbone.py [--quick] [--profile]`` (root; quick: under ~2 min).
See benchmarks/README.md for every option and column.

Topology (the netns test bed of ``tests/netns/test_hbone.py``): two nodes; on node n1 pod ``a``
(in-pod iptables rules, its own ztunnel in dedicated mode) and pod ``c`` (no rules); on node n2
pod ``b`` (rules + ztunnel) and pod ``d`` (no rules, a ``protocol: TCP`` workload). Both ztunnels
share one local CA directory. Modes, measured side by side in the same run:

* ``direct``: c -> d, no proxy at all (the ceiling);
* ``tcp``: a -> d, ztunnel-a outbound only, plain TCP (the destination workload takes TCP);
* ``hbone``: a -> b, ztunnel-a outbound -> mTLS HTTP/2 CONNECT -> ztunnel-b inbound -> app;
* ``haproxy-tls (C reference)``: pods e -> f (no rules), HAProxy with one thread per side, plain ->
  mTLS 1.3 (same suite) -> plain over the same network path, no HTTP/2;
* ``hbone-VARIANT`` (``--variant NAME``, repeatable; ``aes128`` and ``malloc`` unless ``--quick``): the
  same over an extra pod pair whose ztunnels get extra environment: ``aes128`` (``OPENSSL_CONF``
  putting TLS_AES_128_GCM_SHA256 first) and ``malloc`` (glibc malloc thresholds), both on
  unmodified product code.

Measurements:

1. Throughput: ``iperf3 -c -t T -J`` one stream, rounds interleaved, median. CPU of each ztunnel
   is utime+stime from /proc/PID/stat across the iperf3 run. **Gbit/s per proxy core** = bits
   moved / (CPU seconds of ztunnel-a + ztunnel-b): the efficiency of the whole tunnel, each byte
   being encrypted once (a) and decrypted once (b). Per-side figures divide by one side's CPU.
   The ratio to ``openssl speed -evp aes-{128,256}-gcm -bytes 16384 -seconds 2`` (single core,
   run in the same process tree, between rounds) is reported against the suite actually
   negotiated (read from the ServerHello on the wire with a packet socket in pod a).
2. Connection rate: ``crr`` clients (several processes) in the client pod loop connect -> 1-byte
   request -> 1-byte echo -> close against a uvloop echo server, over the warm pooled HBONE
   connection (checked: one established connection to :15008 before and after, same port).
3. Proof the proxies carried the bytes: the access-log records (``connection complete``) of each
   ztunnel are summed and compared with what iperf3 sent / the number of CRR connections.

``--profile`` then runs a longer HBONE iperf3 under ``py-spy record --native`` on both ztunnels
(and, in a second run, ``perf record`` for the DSO split) and prints a breakdown of where each
ztunnel spends its time. Raw profiles land in benchmarks/results/.

Results: Markdown on stdout, JSON in benchmarks/results/hbone.json. Internal sub-commands
(spawned inside pods): ``echo``, ``crr``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
IPERF_PORT = 5201
ECHO_PORT = 7000
GiB = 1 << 30
SUITES = {
    0x1301: "TLS_AES_128_GCM_SHA256",
    0x1302: "TLS_AES_256_GCM_SHA384",
    0x1303: "TLS_CHACHA20_POLY1305_SHA256",
}
SUITE_AES = {0x1301: "aes-128-gcm", 0x1302: "aes-256-gcm"}
AES128_FIRST_CNF = """openssl_conf = openssl_init
[openssl_init]
ssl_conf = ssl_sect
[ssl_sect]
system_default = system_default_sect
[system_default_sect]
Ciphersuites = TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384
"""


# ---------------------------------------------------------------------------------------------
# sub-commands that run inside a pod


def run_echo(port: int) -> None:
    """uvloop Protocol echo server on [::]:port (closes on EOF; never calls write_eof)."""
    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t: Any = transport
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data: bytes) -> None:
            self.t.write(data)

        def eof_received(self) -> bool:
            return False  # close

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        lst = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        lst.bind(("::", port))
        lst.listen(4096)
        srv = await loop.create_server(Echo, sock=lst, backlog=4096)
        print("READY", flush=True)
        await stop.wait()
        srv.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def fork_clients(
    procs: int, seconds: float, work: Callable[[float, float], dict[str, Any]]
) -> tuple[list[dict[str, Any]], float]:
    """Run ``work(start, end)`` in ``procs`` forked processes, all from one start 150 ms ahead
    and for ``seconds``. Returns what each returned (None for one that died) and the children's
    CPU seconds."""
    start = time.time() + 0.15
    children: list[tuple[int, int]] = []
    for _ in range(procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                os.write(w, json.dumps(work(start, start + seconds)).encode())
            except BaseException:
                code = 1
            os._exit(code)
        os.close(w)
        children.append((pid, r))
    results: list[dict[str, Any]] = []
    for pid, r in children:
        chunks = []
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        results.append(json.loads(b"".join(chunks) or b"null"))
    t = os.times()
    return results, t.children_user + t.children_system


def _crr_worker(ip: str, port: int, start: float, end: float) -> dict[str, Any]:
    addr = (ip, port)
    lat: list[float] = []
    errors = 0
    n = 0
    while time.time() < start:
        time.sleep(0.001)
    while time.time() < end:
        t0 = time.perf_counter()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.connect(addr)
                s.send(b"x")
                if s.recv(1) != b"x":
                    errors += 1
        except OSError:
            errors += 1
        n += 1
        if len(lat) < 50_000:
            lat.append(time.perf_counter() - t0)
    return {"n": n, "errors": errors, "lat": lat}


def run_crr(ip: str, port: int, seconds: float, procs: int) -> None:
    """``procs`` forked clients: connect / 1-byte request / 1-byte reply / close until the end.

    Prints one JSON line: conns, errors, seconds, p50/p99 latency, the clients' CPU seconds."""
    results, cpu = fork_clients(procs, seconds, functools.partial(_crr_worker, ip, port))
    total = errors = 0
    lat: list[float] = []
    for res in results:
        res = res or {"n": 0, "errors": 1, "lat": []}
        total += res["n"]
        errors += res["errors"]
        lat += res["lat"]
    lat.sort()
    print(
        json.dumps(
            {
                "conns": total,
                "errors": errors,
                "seconds": seconds,
                "p50_us": lat[len(lat) // 2] * 1e6 if lat else 0.0,
                "p99_us": lat[int(len(lat) * 0.99)] * 1e6 if lat else 0.0,
                "client_cpu_s": cpu,
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# helpers


def proc_tree(root: int) -> list[int]:
    """``root`` and every live descendant (walks the ppid of each /proc/PID/stat): a ztunnel with
    ZTUNNEL_WORKER_THREADS >= 2 (the default on 2+ CPUs) is a supervisor, a zygote and workers."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _rss_kib(pid: int) -> int:
    """VmRSS summed over ``pid``'s process tree (a forked worker's shared pages count again)."""
    total = 0
    for p in proc_tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            total += next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
    return total


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (fields[0] is the state); [] once
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _stat_cpu(pids: list[int]) -> float:
    """utime + stime + cutime + cstime of these processes, in seconds."""
    return sum(sum(int(x) for x in _stat_fields(p)[11:15]) for p in pids) / CLK_TCK


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else None


# cgroup v1's CPU accounting. This VM mounts cpuacct apart from cpu, so a tree moved into a
# group of its own is counted, not scheduled differently (where they are mounted together the
# group would also be a scheduling entity of its own).
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


@dataclass
class _CpuGroup:
    start: str | None  # the root's start time (a pid reused later is another tree)
    path: Path | None  # None: no cgroup could be made, the tree is counted from /proc
    base: float  # the CPU seconds the tree had used when it was moved in


_cpu_groups: dict[int, _CpuGroup] = {}


def _cpu_group(pid: int) -> _CpuGroup:
    """The cpuacct cgroup holding ``pid``'s process tree, made on the first call and the tree
    moved in (what it forks later is born in it); after the root exited, the same group (its
    children may live on, and the group keeps what the dead used)."""
    start = _start_time(pid)
    group = _cpu_groups.get(pid)
    if group is not None and (start is None or start == group.start):
        return group
    path = CPUACCT / f"ztbench-{os.getpid()}-{pid}"
    moved: list[int] = []
    try:
        path.mkdir(exist_ok=True)
        base = 0.0
        for _ in range(3):  # (a process forked while moving the others is moved next round)
            fresh = [p for p in proc_tree(pid) if p not in moved]
            if not fresh:
                break
            base += _stat_cpu(fresh)
            for p in fresh:
                with contextlib.suppress(ProcessLookupError):
                    (path / "cgroup.procs").write_text(str(p))
                moved.append(p)
        group = _CpuGroup(start, path, base)
    except OSError:  # (not root, no cpuacct): put back what moved, count from /proc
        for p in moved:
            with contextlib.suppress(OSError):
                (CPUACCT / "cgroup.procs").write_text(str(p))
        with contextlib.suppress(OSError):
            path.rmdir()
        group = _CpuGroup(start, None, 0.0)
    _cpu_groups[pid] = group
    return group


def remove_cpu_groups() -> None:
    """Remove the cgroups of the trees measured (those whose processes are all gone; called at
    exit) and forget them all."""
    for group in _cpu_groups.values():
        if group.path is not None:
            with contextlib.suppress(OSError):
                group.path.rmdir()
    _cpu_groups.clear()


atexit.register(remove_cpu_groups)


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s process tree, for deltas across a measurement. Counted by a
    cgroup of the tree's own where one can be made: it keeps the time of processes that exited.
    A ztunnel replaces a worker a burst left grown (ZTUNNEL_WORKER_RECYCLE_MIB), and its workers
    are reaped by the kernel (SIGCHLD ignored), so a retired worker's CPU is in no /proc file:
    summing /proc alone loses it, and a suite row once read -0.37 cores for ztunnel-b. Else
    utime + stime of the tree, plus what its members reaped (cutime + cstime)."""
    group = _cpu_group(pid)
    if group.path is None:
        return _stat_cpu(proc_tree(pid))
    return group.base + int((group.path / "cpuacct.usage").read_text()) / 1e9


def box_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return float(total - idle), float(total)


def listening_in(pid: int, port: int) -> bool:
    """Is something listening on ``port`` in the netns of process ``pid``?"""
    hexport = f":{port:04X}"
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            return False
        for line in lines:
            parts = line.split()
            if parts[1].endswith(hexport) and parts[3] == "0A":
                return True
    return False


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def tool_version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


def openssl_speed(cipher: str, seconds: int = 2) -> float:
    """Single-core ``openssl speed -evp CIPHER -bytes 16384``: Gbit/s."""
    out = subprocess.run(
        ["openssl", "speed", "-evp", cipher, "-bytes", "16384", "-seconds", str(seconds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds * 3 + 30,
    ).stdout
    m = re.search(rf"^{re.escape(cipher.upper())}\s+([\d.]+)k\s*$", out, re.M)
    if not m:
        raise RuntimeError(f"cannot parse openssl speed output:\n{out}")
    return float(m.group(1)) * 1000 * 8 / 1e9


# ---------------------------------------------------------------------------------------------
# negotiated TLS suite: the ServerHello, read off the wire in the client pod


class HelloSniffer:
    """A packet socket in the client pod's netns that catches the first ServerHello from
    ``port`` (15008 for HBONE)."""

    def __init__(self, host: Any, port: int = 15008) -> None:
        self.port = port
        with host.enter():
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.settimeout(0.2)

    def result(self, timeout: float = 3.0) -> dict[str, Any]:
        stream = b""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    pkt = self.sock.recv(65535)
                except TimeoutError:
                    continue
                payload = _tcp_payload_from(pkt, self.port)
                if payload is None:
                    continue
                stream += payload
                hello = _parse_server_hello(stream)
                if hello is not None:
                    return hello
            return {"error": "no ServerHello seen"}
        finally:
            self.sock.close()


def _tcp_payload_from(pkt: bytes, sport: int) -> bytes | None:
    if len(pkt) < 14 + 20 + 20:
        return None
    ethertype = struct.unpack_from("!H", pkt, 12)[0]
    if ethertype == 0x0800:
        ihl = (pkt[14] & 0x0F) * 4
        if pkt[14 + 9] != 6:
            return None
        tcp = 14 + ihl
        total = struct.unpack_from("!H", pkt, 16)[0]
        end = 14 + total
    elif ethertype == 0x86DD:
        if pkt[14 + 6] != 6:
            return None
        tcp = 14 + 40
        end = tcp + struct.unpack_from("!H", pkt, 18)[0]
    else:
        return None
    if struct.unpack_from("!H", pkt, tcp)[0] != sport:
        return None
    off = (pkt[tcp + 12] >> 4) * 4
    data = pkt[tcp + off : end]
    return data or None


def _parse_server_hello(s: bytes) -> dict[str, Any] | None:
    if len(s) < 5:
        return None
    if s[0] != 0x16 or s[5:6] not in (b"\x02", b""):
        return {"error": f"unexpected first record {s[:6].hex()}"}
    rec_len = struct.unpack_from("!H", s, 3)[0]
    if len(s) < 5 + rec_len:
        return None
    h = s[5 : 5 + rec_len]
    p = 4 + 2 + 32
    sid_len = h[p]
    p += 1 + sid_len
    suite = struct.unpack_from("!H", h, p)[0]
    p += 3  # suite + compression
    version = struct.unpack_from("!H", h, 4)[0]
    ext_end = p + 2 + struct.unpack_from("!H", h, p)[0]
    p += 2
    while p + 4 <= ext_end:
        etype, elen = struct.unpack_from("!HH", h, p)
        if etype == 0x002B and elen == 2:  # supported_versions
            version = struct.unpack_from("!H", h, p + 4)[0]
        p += 4 + elen
    return {
        "suite_id": f"0x{suite:04x}",
        "suite": SUITES.get(suite, f"unknown 0x{suite:04x}"),
        "aes": SUITE_AES.get(suite),
        "tls_version": {0x0304: "TLSv1.3", 0x0303: "TLSv1.2"}.get(version, hex(version)),
    }


# ---------------------------------------------------------------------------------------------
# the test bed


def mesh_config(pods: dict[str, Any]) -> str:
    """Local xDS: every pod but ``c`` is a workload; ``d`` takes plain TCP, the rest HBONE."""
    out = ["workloads:"]
    for name, p in pods.items():
        if name in ("c", "e", "f"):
            continue
        out.append(
            f"""- uid: cluster1//v1/Pod/default/{name}
  name: {name}
  namespace: default
  serviceAccount: sa-{name}
  trustDomain: cluster.local
  workloadIps: ["{p.ip4}", "{p.ip6}"]
  protocol: {"TCP" if name == "d" else "HBONE"}
  node: {"n2" if name.startswith(("b", "d")) else "n1"}"""
        )
    return "\n".join(out) + "\n"


@dataclass
class Mode:
    name: str
    client: Any  # Pod running iperf3 -c / crr
    server: Any  # Pod running iperf3 -s / echo
    zta: Any = None  # ZtunnelProcess on the client side (None: direct)
    ztb: Any = None  # ZtunnelProcess on the server side (None: direct / tcp)
    tput: list[dict[str, Any]] = field(default_factory=list)
    crr: list[dict[str, Any]] = field(default_factory=list)
    tls: dict[str, Any] | None = None
    about: str = ""
    pool: dict[str, Any] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # other proxies to measure (haproxy)
    target: tuple[str, int] | None = None  # iperf3 -c target when not server.ip4:5201
    hello_port: int = 15008  # where the TLS ServerHello comes from
    rss_rest: dict[str, int] = field(default_factory=dict)  # RSS KiB 7 s after the last tput run

    @property
    def dst(self) -> str:
        return str(self.server.ip4)

    def proxy_pids(self) -> dict[str, int]:
        out = dict(self.pids)
        if self.zta is not None:
            out["a"] = self.zta.pid
        if self.ztb is not None:
            out["b"] = self.ztb.pid
        return out

    @property
    def hbone(self) -> bool:
        return self.ztb is not None


def _zt_bytes(zt: Any, start: int, direction: str, port: int, key: str) -> tuple[int, int]:
    """(records, sum of ``key``) of access-log records from index ``start`` for ``:port``."""
    with zt._cond:
        recs = zt.records[start:]
    n = total = 0
    for r in recs:
        if r.get("scope") != "access" or r.get("message") != "connection complete":
            continue
        if r.get("direction") != direction:
            continue
        addr = str(r.get("dst.hbone_addr") or r.get("dst.addr", ""))
        if not addr.endswith(f":{port}"):
            continue
        n += 1
        total += int(r.get(key, 0))
    return n, total


def _nrec(zt: Any) -> int:
    if zt is None:
        return 0
    with zt._cond:
        return len(zt.records)


def _wait_records(zt: Any, start: int, direction: str, port: int, want: int) -> None:
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: _zt_bytes(zt, start, direction, port, "bytes_sent")[0] >= want,
            5.0,
            "access records",
        )


def run_iperf(mode: Mode, seconds: int) -> dict[str, Any]:
    pids = mode.proxy_pids()
    starts = {"a": _nrec(mode.zta), "b": _nrec(mode.ztb)}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    busy0, tot0 = box_busy()
    ip, port = mode.target or (mode.dst, IPERF_PORT)
    out = mode.client.run(
        "iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-J", timeout=seconds + 30,
    )  # fmt: skip
    busy1, tot1 = box_busy()
    cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
    rss = {k: _rss_kib(p) for k, p in pids.items()}
    end = json.loads(out.stdout)["end"]
    secs = float(end["sum_received"]["seconds"])
    rbytes = float(end["sum_received"]["bytes"])
    sbytes = float(end["sum_sent"]["bytes"])
    bits = rbytes * 8
    res: dict[str, Any] = {
        "gbps": float(end["sum_received"]["bits_per_second"]) / 1e9,
        "bytes": rbytes,
        "seconds": secs,
        "box_busy_cores": (busy1 - busy0) / (tot1 - tot0) * (os.cpu_count() or 1),
        "iperf_client_cpu_pct": end["cpu_utilization_percent"]["host_total"],
        "iperf_server_cpu_pct": end["cpu_utilization_percent"]["remote_total"],
    }
    total_cpu = 0.0
    for k in cpu0:
        cpu = cpu1[k] - cpu0[k]
        total_cpu += cpu
        res[f"cpu_{k}_s"] = cpu
        res[f"cores_{k}"] = cpu / secs
        res[f"gbps_per_core_{k}"] = bits / 1e9 / cpu if cpu > 0 else None
        res[f"rss_kib_{k}"] = rss[k]
    if cpu0:
        res["cpu_s"] = total_cpu
        res["cores"] = total_cpu / secs
        res["gbps_per_core"] = bits / 1e9 / total_cpu if total_cpu > 0 else None
        res["cpu_s_per_gib"] = total_cpu / (rbytes / GiB)
    # proof: access-log byte counts of the proxies (iperf3 = control + data connection)
    if mode.zta is not None:
        _wait_records(mode.zta, starts["a"], "outbound", IPERF_PORT, 2)
        n, sent = _zt_bytes(mode.zta, starts["a"], "outbound", IPERF_PORT, "bytes_sent")
        res["zta_conns"] = n
        res["zta_bytes_ratio"] = sent / sbytes
    if mode.ztb is not None:
        _wait_records(mode.ztb, starts["b"], "inbound", IPERF_PORT, 2)
        n, recv = _zt_bytes(mode.ztb, starts["b"], "inbound", IPERF_PORT, "bytes_recv")
        res["ztb_conns"] = n
        res["ztb_bytes_ratio"] = recv / sbytes
    return res


def run_crr_once(mode: Mode, seconds: float, procs: int) -> dict[str, Any]:
    pids = mode.proxy_pids()
    starts = {"a": _nrec(mode.zta), "b": _nrec(mode.ztb)}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    busy0, tot0 = box_busy()
    out = mode.client.run(
        sys.executable, __file__, "crr", "--ip", mode.dst, "--port", str(ECHO_PORT),
        "--seconds", str(seconds), "--procs", str(procs), timeout=seconds + 60,
    )  # fmt: skip
    busy1, tot1 = box_busy()
    cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
    r = json.loads(out.stdout)
    conns = r["conns"]
    res: dict[str, Any] = {
        "conn_per_s": conns / r["seconds"],
        "conns": conns,
        "errors": r["errors"],
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
        "client_cores": r["client_cpu_s"] / r["seconds"],
        "client_cpu_us_per_conn": r["client_cpu_s"] / conns * 1e6 if conns else None,
        "box_busy_cores": (busy1 - busy0) / (tot1 - tot0) * (os.cpu_count() or 1),
    }
    total = 0.0
    for k in cpu0:
        cpu = cpu1[k] - cpu0[k]
        total += cpu
        res[f"cores_{k}"] = cpu / r["seconds"]
        res[f"cpu_us_per_conn_{k}"] = cpu / conns * 1e6 if conns else None
    if cpu0:
        res["cores"] = total / r["seconds"]
        res["cpu_us_per_conn"] = total / conns * 1e6 if conns else None
        res["conn_per_proxy_core_s"] = conns / total if total > 0 else None
    if mode.zta is not None:
        time.sleep(0.3)
        res["zta_conns"] = _zt_bytes(mode.zta, starts["a"], "outbound", ECHO_PORT, "bytes_sent")[0]
    if mode.ztb is not None:
        res["ztb_conns"] = _zt_bytes(mode.ztb, starts["b"], "inbound", ECHO_PORT, "bytes_recv")[0]
    return res


def hbone_conns(pod: Any, dst: str) -> list[str]:
    """Local ports of established connections from ``pod`` to ``dst:15008``."""
    out = pod.run("ss", "-Htn", "state", "established", "dst", f"{dst}:15008").stdout
    return sorted(line.split()[2].rsplit(":", 1)[1] for line in out.splitlines() if line.strip())


@dataclass(frozen=True)
class Variant:
    """An extra HBONE pod pair (``a-NAME`` -> ``b-NAME``) whose two ztunnels get ``env``."""

    name: str
    env: dict[str, str]
    about: str


_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(128 << 20),
    "MALLOC_TOP_PAD_": str(16 << 20),
}


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "aes128",
            {"OPENSSL_CONF": "@AES128_CNF@"},
            "product code; OPENSSL_CONF puts TLS_AES_128_GCM_SHA256 first",
        ),
        Variant(
            "malloc",
            dict(_MALLOC_ENV),
            "product code; glibc MALLOC_MMAP_THRESHOLD_=32M, TRIM_THRESHOLD_=128M, TOP_PAD_=16M",
        ),
        Variant(
            "notrim",
            {"ZTUNNEL_MALLOC_TRIM_INTERVAL": "0"},
            "product code; no idle malloc_trim (ZTUNNEL_MALLOC_TRIM_INTERVAL=0)",
        ),
    )
}


HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
HAPROXY_TLS_PORT = 8443
HAPROXY_LOCAL_PORT = 6000
HAPROXY_SUITE = "TLS_AES_256_GCM_SHA384"


def make_certs(tmp: str) -> tuple[str, str]:
    """A throw-away P-256 CA and one leaf (cert + key in one PEM, as HAProxy wants)."""
    ca_key, ca, key, csr, crt = (
        os.path.join(tmp, n) for n in ("ca.key", "ca.pem", "l.key", "l.csr", "l.crt")
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-subj", "/CN=bench-ca", "-days", "2"],
        ["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=bench-leaf"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "2"],
    ):  # fmt: skip
        subprocess.run(cmd, capture_output=True, check=True)
    leaf = os.path.join(tmp, "leaf.pem")
    Path(leaf).write_text(Path(crt).read_text() + Path(key).read_text())
    return ca, leaf


def haproxy_cfg(listen: str, server: str, ca: str, leaf: str, *, tls_in: bool) -> str:
    """One side of a TLS tunnel: plain -> TLS (client side) or TLS -> plain (server side)."""
    tls = f"ssl crt {leaf} ca-file {ca} ssl-min-ver TLSv1.3 ciphersuites {HAPROXY_SUITE}"
    bind = f"  bind {listen}" + (f" {tls} verify required" if tls_in else "")
    srv = f"  server s {server}" + ("" if tls_in else f" {tls} verify none")
    return "\n".join(
        [
            "global",
            "  nbthread 1",
            "  maxconn 4000",
            "  tune.bufsize 65536",
            # no UDP socket towards /etc/resolv.conf's server (HAProxy 2.6's default resolvers)
            "resolvers default",
            "  nameserver lo 127.0.0.1:53",
            "defaults",
            "  mode tcp",
            "  timeout connect 5s",
            "  timeout client 60s",
            "  timeout server 60s",
            "listen tunnel",
            bind,
            srv,
            "",
        ]
    )


@contextlib.contextmanager
def testbed(
    variants: list[Variant], loop: str, haproxy: bool, env: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    from ztunnel.testing.netns import Testbed
    from ztunnel.testing.proc import ZtunnelProcess

    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        pods = {"a": n1.add_pod("a"), "c": n1.add_pod("c", ambient=False)}
        pods |= {"b": n2.add_pod("b"), "d": n2.add_pod("d", ambient=False)}
        pairs: list[tuple[str, str, dict[str, str]]] = [("a", "b", {})]
        for v in variants:
            a, b = f"a-{v.name}", f"b-{v.name}"
            pods |= {a: n1.add_pod(a), b: n2.add_pod(b)}
            pairs.append((a, b, v.env))
        if haproxy:
            pods |= {"e": n1.add_pod("e", ambient=False), "f": n2.add_pod("f", ambient=False)}
        for name, pod in pods.items():
            if name not in ("c", "d", "e", "f"):
                pod.install_inpod_rules()
            # connection churn: TIME_WAIT must not exhaust ephemeral ports
            pod.sysctl("net.ipv4.tcp_tw_reuse", 1)
            pod.sysctl("net.ipv4.ip_local_port_range", "1024 65000")
        ca_dir = os.path.join(tmp, "ca")
        os.mkdir(ca_dir)
        cnf = os.path.join(tmp, "aes128.cnf")
        Path(cnf).write_text(AES128_FIRST_CNF)
        common = {
            "PROXY_MODE": "dedicated",
            "LOCAL_XDS": mesh_config(pods),
            "ZTUNNEL_LOCAL_CA_DIR": ca_dir,
            # the chart's default level: "connection complete" records only (the tests'
            # access=debug also logs every connection's opening)
            "RUST_LOG": "info",
            **(env or {}),
        }
        zts: dict[str, Any] = {}
        for a, b, extra in pairs:
            for name, node in ((a, "n1"), (b, "n2")):
                env = {
                    **common,
                    "PROXY_WORKLOAD_INFO": f"default/{name}/sa-{name}",
                    "NODE_NAME": node,
                    **{k: v.replace("@AES128_CNF@", cnf) for k, v in extra.items()},
                }
                zts[name] = ZtunnelProcess(pods[name], env, loop=loop).start()
        hap: dict[str, int] = {}
        if haproxy:
            ca, leaf = make_certs(tmp)
            cfg_e, cfg_f = os.path.join(tmp, "hap_e.cfg"), os.path.join(tmp, "hap_f.cfg")
            Path(cfg_e).write_text(
                haproxy_cfg(
                    f"127.0.0.1:{HAPROXY_LOCAL_PORT}",
                    f"{pods['f'].ip4}:{HAPROXY_TLS_PORT}", ca, leaf, tls_in=False,
                )
            )  # fmt: skip
            Path(cfg_f).write_text(
                haproxy_cfg(
                    f"0.0.0.0:{HAPROXY_TLS_PORT}", f"127.0.0.1:{IPERF_PORT}", ca, leaf, tls_in=True
                )
            )
            for side, pod, cfg in (("a", pods["e"], cfg_e), ("b", pods["f"], cfg_f)):
                hp = pod.popen(HAPROXY, "-db", "-f", cfg, stdout=subprocess.DEVNULL)
                hap[side] = hp.pid
            wait_until(lambda: listening_in(hap["a"], HAPROXY_LOCAL_PORT), 10, "haproxy e")
            wait_until(lambda: listening_in(hap["b"], HAPROXY_TLS_PORT), 10, "haproxy f")
        for server in ["d", *(b for _, b, _ in pairs), *(["f"] if haproxy else [])]:
            pod = pods[server]
            srv = pod.popen(
                "iperf3", "-s", "-p", str(IPERF_PORT),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            echo = pod.popen(sys.executable, __file__, "echo", "--port", str(ECHO_PORT))
            echo.wait_for_line("READY", timeout=15)
            wait_until(functools.partial(listening_in, srv.pid, IPERF_PORT), 10, "iperf3 -s")
        try:
            yield {"bed": tb, "pods": pods, "zts": zts, "haproxy": hap, "ca_dir": ca_dir}
        finally:
            for zt in zts.values():
                rc = zt.stop()
                if rc != 0:
                    print(f"warning: ztunnel {zt.host.name} exit code {rc}", file=sys.stderr)
                    for r in zt.internal_errors()[:5]:
                        print(f"  {r}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# profiling


def _frame(f: str) -> str:
    """py-spy raw frame without its line number: "func (path.py)" / "sym (lib.so)"."""
    return re.sub(r":\d+\)$", ")", f)


_UNRESOLVED_LIBC = re.compile(r"^0x[0-9a-f]+ \(libc\.so")

# A sample is charged to the first rule matching one of its frames, walking from the leaf up.
_CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (
        "AES-GCM (EVP_EncryptUpdate / EVP_DecryptUpdate)",
        re.compile(r"^(EVP_(En|De)cryptUpdate|EVP_CipherUpdate|CRYPTO_gcm128\w*) "),
    ),
    (
        "OpenSSL record layer, non-AES part of SSL_write/SSL_read",
        re.compile(r"^(SSL_write_ex|SSL_read_ex|SSL_write|SSL_read|SSL_get_error|SSL_pending) "),
    ),
    ("MemoryBIO copy (outbio.read / inbio.write)", re.compile(r"^_ssl_MemoryBIO_(read|write)")),
    (
        "send()/sendmsg() syscall (kernel TCP tx + softirq delivery)",
        re.compile(r"^(sock_send|sock_sendmsg|sock_sendall) "),
    ),
    (
        "recv()/recv_into() syscall (kernel TCP rx + copy)",
        re.compile(r"^(sock_recv|sock_recv_into) "),
    ),
    (
        "malloc/free/brk of large buffers",
        re.compile(r"^(malloc|free|realloc|brk|sbrk|__default_morecore) "),
    ),
    ("epoll_ctl (add/remove reader/writer)", re.compile(r"^epoll_ctl ")),
    (
        "per-connection syscalls (socket/connect/accept/setsockopt/shutdown/close/splice)",
        re.compile(
            r"^(setsockopt|getsockopt|connect|accept4?|close|shutdown|socket|bind|splice|pipe2|ioctl|fcntl|getpid|getsockname|getpeername) "
        ),
    ),
    ("h2 framing (ztunnel/hbone/h2conn.py)", re.compile(r"\(ztunnel/hbone/h2conn\.py\)")),
    ("hpack", re.compile(r"\(hpack/")),
    (
        "access log (logging, json, ztunnel logs)",
        re.compile(r"\((logging/|json/|ztunnel/logs\.py|ztunnel/.*/logs\.py)"),
    ),
    (
        "transport.py Python code (HboneConnection / StreamBridge)",
        re.compile(r"\(ztunnel/hbone/transport\.py\)"),
    ),
    ("other ztunnel Python code", re.compile(r"\(ztunnel/")),
    ("other Python code (stdlib, asyncio)", re.compile(r"\.py\)$")),
    ("event loop (uvloop / libuv)", re.compile(r"\((loop\.c|core\.c|linux\.c|uv-common\.c)\)")),
]
_IDLE = re.compile(r"^epoll_p?wait ")
_DATA_PATH = re.compile(r"^(StreamBridge|HboneConnection|H2Connection)\.\w+ ")


def summarize_pyspy(raw_path: Path) -> dict[str, Any]:
    """Where a ztunnel's busy time goes, from ``py-spy record --native --format raw``.

    Percentages are of busy samples (samples whose leaf is ``epoll_wait`` count as idle)."""
    total = idle = 0
    cats: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    edges: dict[str, Counter[str]] = {}
    self_py: Counter[str] = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        total += n
        if _IDLE.match(frames[-1]):
            idle += n
            continue
        label = "other native (interpreter, unresolved)"
        libc_leaf = bool(_UNRESOLVED_LIBC.match(frames[-1]))
        for fr in reversed(frames):
            hit = next((lab for lab, rx in _CATEGORIES if rx.search(fr)), None)
            if hit is None:
                continue
            if libc_leaf and fr.endswith(".py)"):
                hit = "memcpy/memmove called from Python code (b''.join, bytes copies)"
            label = hit
            break
        cats[label] += n
        py = [f for f in frames if f.endswith(".py)")]
        if py:
            self_py[py[-1]] += n
        seen: set[str] = set()
        for i, fr in enumerate(frames):
            if fr in seen or not (
                _DATA_PATH.match(fr)
                or fr.startswith(
                    (
                        "SSLObject.",
                        "Listener.",
                        "Outbound.",
                        "InboundHbone.",
                        "HboneConnector.",
                        "SocketFactory.",
                    )
                )
            ):
                continue
            seen.add(fr)
            incl[fr] += n
            callee = frames[i + 1] if i + 1 < len(frames) else "(self)"
            if _UNRESOLVED_LIBC.match(callee):
                callee = "libc, unresolved (memcpy/memmove, incl. page faults)"
            edges.setdefault(fr, Counter())[callee] += n
    busy = total - idle

    def pct(v: int) -> float:
        return round(100.0 * v / busy, 1) if busy else 0.0

    tree = [
        {
            "function": fn,
            "inclusive_pct": pct(v),
            "callees_pct": [(c, pct(k)) for c, k in edges[fn].most_common(8) if pct(k) >= 0.5],
        }
        for fn, v in incl.most_common(16)
    ]
    return {
        "samples": total,
        "idle_pct_of_all": round(100.0 * idle / total, 1) if total else 0.0,
        "busy_samples": busy,
        "categories_pct": [(k, pct(v)) for k, v in cats.most_common()],
        "tree": tree,
        "top_self_python_pct": [(k, pct(v)) for k, v in self_py.most_common(20)],
    }


_SYSCALLS = (
    "sendto", "recvfrom", "sendmsg", "write", "read", "epoll_pwait", "epoll_ctl", "brk", "munmap",
)  # fmt: skip
_PERF_CHILDREN = [
    ("page faults", "asm_exc_page_fault"),
    ("brk()", "__do_sys_brk"),
    ("munmap()", "__x64_sys_munmap"),
    ("send()/sendto() syscall", "__sys_sendto"),
    ("sendmsg() syscall", "__sys_sendmsg"),
    ("recv()/recvfrom() syscall", "__sys_recvfrom"),
    ("write() syscall (OpenSSL socket BIO)", "ksys_write"),
    ("read() syscall (OpenSSL socket BIO)", "ksys_read"),
    ("epoll_wait", "do_epoll_wait"),
    ("epoll_ctl", "do_epoll_ctl"),
    ("  of which softirq network processing", "net_rx_action"),
    ("  of which netfilter hooks", "nf_hook_slow"),
    ("  of which copy to/from user", "_copy_from_iter"),
    ("memmove (user, incl. the faults it takes)", "__memmove_avx_unaligned_erms"),
    ("Python eval loop (self)", "_PyEval_EvalFrameDefault"),
]


def perf_stat(pid: int, seconds: float) -> subprocess.Popen[str]:
    events = ",".join(f"syscalls:sys_enter_{s}" for s in _SYSCALLS)
    return subprocess.Popen(
        ["perf", "stat", "-x", ",", "-e", f"{events},page-faults,context-switches,task-clock",
         "-p", str(pid), "--", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def parse_perf_stat(text: str, nbytes: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gib = nbytes / GiB if nbytes else 0.0
    for line in text.splitlines():
        f = line.split(",")
        if len(f) < 3:
            continue
        try:
            v = float(f[0])
        except ValueError:
            continue
        name = f[2].replace("syscalls:sys_enter_", "")
        out[name] = {"count": v, "per_gib": round(v / gib, 1) if gib else None}
        if name in ("sendto", "recvfrom", "sendmsg", "write", "read") and v and nbytes:
            out[name]["avg_bytes_if_all_payload"] = round(nbytes / v)
    return out


def perf_report(data: Path) -> dict[str, Any]:
    def report(*args: str) -> str:
        return subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", *args],
            capture_output=True, text=True, timeout=300,
        ).stdout  # fmt: skip

    dsos = []
    for line in report("--no-children", "--sort", "dso", "--percent-limit", "0.5").splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+(\S.*)$", line)
        if m:
            dsos.append((m.group(2).strip(), float(m.group(1))))
    children: dict[str, tuple[float, float]] = {}
    text = report("--children", "--sort", "sym", "-g", "none", "--percent-limit", "0.1")
    for line in text.splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+([\d.]+)%\s+\[.\]\s+(\S+)", line)
        if m:
            children.setdefault(m.group(3), (float(m.group(1)), float(m.group(2))))
    key = [(lab, children.get(sym, (0.0, 0.0))[0]) for lab, sym in _PERF_CHILDREN]
    top_self = sorted(((sym, s) for sym, (_, s) in children.items()), key=lambda x: -x[1])[:20]
    return {"dso_self_pct": dsos, "key_children_pct": key, "top_self_symbols_pct": top_self}


def profile_hbone(mode: Mode, seconds: int, rate: int) -> dict[str, Any]:
    """Three iperf3 runs through ``mode``: perf stat (syscalls, faults), py-spy record --native on
    both ztunnels, perf record -g on both."""
    result: dict[str, Any] = {"mode": mode.name, "seconds": seconds, "py_spy_rate": rate}
    RESULTS.mkdir(parents=True, exist_ok=True)
    sides = mode.proxy_pids()
    if shutil.which("perf"):
        stats = {side: perf_stat(pid, seconds + 1.5) for side, pid in sides.items()}
        time.sleep(0.3)
        r = run_iperf(mode, seconds)
        result["perf_stat_iperf"] = r
        for side, p in stats.items():
            _, err = p.communicate(timeout=seconds + 60)
            result[f"perf_stat_{side}"] = parse_perf_stat(err, r["bytes"])
    pyspy = shutil.which("py-spy")
    if pyspy:
        procs = {}
        for side, pid in sides.items():
            raw = RESULTS / f"pyspy_{_slug(mode.name)}_{side}.txt"
            procs[side] = (
                raw,
                subprocess.Popen(
                    [pyspy, "record", "--pid", str(pid), "--native", "--rate", str(rate),
                     "--duration", str(seconds + 1), "--format", "raw", "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                ),
            )  # fmt: skip
        time.sleep(1.0)  # attach
        result["pyspy_iperf"] = run_iperf(mode, seconds)
        for side, (raw, p) in procs.items():
            _, err = p.communicate(timeout=seconds + 60)
            if p.returncode != 0 or not raw.exists():
                result[f"pyspy_{side}"] = {"error": err[-2000:]}
                continue
            result[f"pyspy_{side}"] = summarize_pyspy(raw)
            result[f"pyspy_{side}"]["raw"] = str(raw.relative_to(ROOT))
    else:
        result["pyspy_error"] = "py-spy not installed (pip install py-spy)"
    if shutil.which("perf"):
        files = {side: RESULTS / f"perf_{_slug(mode.name)}_{side}.data" for side in sides}
        recs = {
            side: subprocess.Popen(
                ["perf", "record", "-g", "-F", "999", "-p", str(pid), "-o", str(files[side]),
                 "--", "sleep", str(seconds + 1)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            for side, pid in sides.items()
        }  # fmt: skip
        time.sleep(0.5)
        result["perf_iperf"] = run_iperf(mode, seconds)
        for side, p in recs.items():
            _, err = p.communicate(timeout=seconds + 60)
            if p.returncode != 0:
                result[f"perf_{side}"] = {"error": err[-2000:]}
                continue
            result[f"perf_{side}"] = perf_report(files[side])
            with contextlib.suppress(OSError):
                files[side].unlink()
    return result


def profile_crr(modes: list[Mode], seconds: int, rate: int, procs: int) -> dict[str, Any]:
    """py-spy on the proxies while the CRR load runs (py-spy slows them; shares still tell)."""
    out: dict[str, Any] = {}
    pyspy = shutil.which("py-spy")
    if not pyspy:
        return out
    for m in modes:
        res: dict[str, Any] = {}
        if shutil.which("perf"):
            stats = {side: perf_stat(pid, seconds + 1.5) for side, pid in m.proxy_pids().items()}
            time.sleep(0.3)
            load = run_crr_once(m, seconds, procs)
            res["perf_stat_load"] = load
            for side, p in stats.items():
                _, err = p.communicate(timeout=seconds + 60)
                st = parse_perf_stat(err, 0)
                res[f"perf_stat_{side}_per_conn"] = {
                    k: round(v["count"] / load["conns"], 2) for k, v in st.items() if load["conns"]
                }
        spies = {}
        for side, pid in m.proxy_pids().items():
            raw = RESULTS / f"pyspy_crr_{_slug(m.name)}_{side}.txt"
            spies[side] = (
                raw,
                subprocess.Popen(
                    [pyspy, "record", "--pid", str(pid), "--native", "--rate", str(rate),
                     "--duration", str(seconds + 1), "--format", "raw", "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                ),
            )  # fmt: skip
        time.sleep(1.0)
        res["load"] = run_crr_once(m, seconds, procs)
        for side, (raw, p) in spies.items():
            p.communicate(timeout=seconds + 60)
            if raw.exists():
                res[side] = summarize_pyspy(raw)
                res[side]["raw"] = str(raw.relative_to(ROOT))
        out[m.name] = res
    return out


# ---------------------------------------------------------------------------------------------
# driver


def drive(args: argparse.Namespace) -> None:
    quick: bool = args.quick
    seconds = args.seconds or (5 if quick else 10)
    crr_seconds = args.crr_seconds or (2.0 if quick else 4.0)
    rounds = args.rounds
    names = args.variant if args.variant is not None else ([] if quick else ["aes128", "malloc"])
    variants = [VARIANTS[n] for n in dict.fromkeys(names)]
    started = time.monotonic()
    args.source_hashes = {
        f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:12]
        for f in ("ztunnel/hbone/transport.py", "ztunnel/hbone/h2conn.py", "ztunnel/net/copy.py")
    }
    speed: dict[str, list[float]] = {"aes-128-gcm": [], "aes-256-gcm": []}

    def measure_speed() -> None:
        for c in speed:
            speed[c].append(openssl_speed(c, 2))
            print(f"  openssl speed {c}: {speed[c][-1]:.2f} Gbit/s", file=sys.stderr)

    profile: dict[str, Any] | None = None
    haproxy = args.haproxy and os.path.exists(HAPROXY)
    with testbed(variants, args.loop, haproxy) as bed:
        pods, zts = bed["pods"], bed["zts"]
        modes = [
            Mode("direct", pods["c"], pods["d"]),
            Mode("tcp (ztunnel-a only)", pods["a"], pods["d"], zta=zts["a"]),
            Mode("hbone", pods["a"], pods["b"], zta=zts["a"], ztb=zts["b"]),
        ]
        for v in variants:
            a, b = f"a-{v.name}", f"b-{v.name}"
            modes.append(
                Mode(f"hbone-{v.name}", pods[a], pods[b], zta=zts[a], ztb=zts[b], about=v.about)
            )
        if haproxy:
            modes.append(
                Mode(
                    "haproxy-tls (C reference)",
                    pods["e"],
                    pods["f"],
                    about="HAProxy 1 thread per side, TCP mode, plain -> mTLS 1.3 -> plain, "
                    f"{HAPROXY_SUITE}, no HTTP/2; what C achieves on the same path",
                    pids=dict(bed["haproxy"]),
                    target=("127.0.0.1", HAPROXY_LOCAL_PORT),
                    hello_port=HAPROXY_TLS_PORT,
                )
            )
        print(f"testbed up in {time.monotonic() - started:.1f}s", file=sys.stderr)
        # warm-up: the first HBONE connection (its ServerHello is captured), caches, pools
        for m in modes:
            tls = m.hbone or m.target is not None
            sniffer = HelloSniffer(m.client, m.hello_port) if tls else None
            if m.target is None:
                run_crr_once(m, 0.3, 1)
            else:
                run_iperf(m, 1)
            if sniffer is not None:
                m.tls = sniffer.result()
                print(f"  {m.name}: negotiated {m.tls}", file=sys.stderr)
            if m.hbone:
                m.pool["before"] = hbone_conns(m.client, m.dst)
        do_tput = args.only in (None, "tput")
        do_crr = args.only in (None, "crr")
        if do_tput:
            measure_speed()
        for rnd in range(rounds if do_tput else 0):
            for m in modes:
                r = run_iperf(m, seconds)
                m.tput.append(r)
                print(f"  tput round {rnd + 1} {m.name}: {_brief(r)}", file=sys.stderr)
            if not quick and rnd < rounds - 1:
                measure_speed()
        if do_tput:
            measure_speed()
            time.sleep(7)  # memory left once the load stops (the idle malloc trim runs every 5 s)
            for m in modes:
                m.rss_rest = {k: _rss_kib(p) for k, p in m.proxy_pids().items()}
                print(f"  {m.name}: RSS KiB at rest after tput {m.rss_rest}", file=sys.stderr)
        for rnd in range(rounds if do_crr else 0):
            for m in modes:
                if m.about:
                    continue  # variants change the bulk path only: CRR for the base modes
                r = run_crr_once(m, crr_seconds, args.crr_procs)
                m.crr.append(r)
                print(f"  crr  round {rnd + 1} {m.name}: {_brief(r)}", file=sys.stderr)
        for m in modes:
            if m.hbone:
                m.pool["after"] = hbone_conns(m.client, m.dst)
        if args.profile or args.only == "profile":
            want = args.profile_target
            hb = next((m for m in modes if m.name in (want, f"hbone-{want}")), None)
            if hb is None:
                sys.exit(f"--profile-target {want}: no such mode (add it with --variant)")
            profile = profile_hbone(hb, args.profile_seconds, args.profile_rate)
            if args.profile_crr:
                profile["crr"] = profile_crr(
                    [m for m in modes if m.name in ("tcp (ztunnel-a only)", "hbone")],
                    args.profile_seconds,
                    args.profile_rate,
                    args.crr_procs,
                )
    report(args, modes, speed, seconds, crr_seconds, rounds, profile, time.monotonic() - started)


def _brief(r: dict[str, Any]) -> str:
    keys = (
        "gbps", "cores_a", "cores_b", "gbps_per_core", "zta_bytes_ratio", "ztb_bytes_ratio",
        "conn_per_s", "cpu_us_per_conn_a", "cpu_us_per_conn_b", "client_cores", "box_busy_cores",
        "zta_conns", "ztb_conns", "conns", "errors",
    )  # fmt: skip
    return " ".join(
        f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}"
        for k in keys
        if r.get(k) is not None
    )


def report(
    args: argparse.Namespace,
    modes: list[Mode],
    speed: dict[str, list[float]],
    seconds: int,
    crr_seconds: float,
    rounds: int,
    profile: dict[str, Any] | None,
    elapsed: float,
) -> None:
    aes = {c: statistics.median(v) for c, v in speed.items() if v}
    direct = next(m for m in modes if m.name == "direct")
    direct_gbps = med(direct.tput, "gbps")
    direct_crr = med(direct.crr, "conn_per_s")
    tput_lines = [
        f"### HBONE throughput: iperf3 one stream, -t {seconds}, {rounds} interleaved rounds, "
        "median",
        "",
        f"Single-core `openssl speed -evp ... -bytes 16384 -seconds 2` (median of "
        f"{len(speed['aes-128-gcm'])}): AES-128-GCM **{fmt(aes.get('aes-128-gcm'), '.1f')} "
        f"Gbit/s**, AES-256-GCM **{fmt(aes.get('aes-256-gcm'), '.1f')} Gbit/s**.",
        "",
        "| mode | TLS suite (wire) | Gbit/s | runs | vs direct | CPU ztunnel-a (cores) "
        "| CPU ztunnel-b (cores) | **Gbit/s per proxy core** (a+b) | per core a / b "
        "| **% of AES-GCM** (a+b) | % AES-GCM a / b | box busy cores | proxy bytes / iperf bytes "
        "(a, b) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary: list[dict[str, Any]] = []
    for m in modes:
        gbps = med(m.tput, "gbps")
        eff = med(m.tput, "gbps_per_core")
        eff_a, eff_b = med(m.tput, "gbps_per_core_a"), med(m.tput, "gbps_per_core_b")
        cipher = (m.tls or {}).get("aes")
        ref = aes.get(cipher) if cipher else None
        pct = 100 * eff / ref if eff and ref else None
        pct_a = 100 * eff_a / ref if eff_a and ref else None
        pct_b = 100 * eff_b / ref if eff_b and ref else None
        ratio_a, ratio_b = med(m.tput, "zta_bytes_ratio"), med(m.tput, "ztb_bytes_ratio")
        suite = (m.tls or {}).get("suite", "-") if m.tls else "plain TCP"
        runs = ", ".join(f"{r['gbps']:.2f}" for r in m.tput)
        tput_lines.append(
            f"| {m.name} | {suite} | {fmt(gbps)} | {runs} "
            f"| {fmt(gbps / direct_gbps if gbps and direct_gbps else None)}x "
            f"| {fmt(med(m.tput, 'cores_a'))} | {fmt(med(m.tput, 'cores_b'))} "
            f"| {fmt(eff)} | {fmt(eff_a)} / {fmt(eff_b)} | {fmt(pct, '.1f')}% "
            f"| {fmt(pct_a, '.1f')}% / {fmt(pct_b, '.1f')}% | {fmt(med(m.tput, 'box_busy_cores'))} "
            f"| {fmt(ratio_a, '.3f')}, {fmt(ratio_b, '.3f')} |"
        )
        summary.append(
            {
                "mode": m.name,
                "tls": m.tls,
                "gbps": gbps,
                "gbps_vs_direct": gbps / direct_gbps if gbps and direct_gbps else None,
                "cores_a": med(m.tput, "cores_a"),
                "cores_b": med(m.tput, "cores_b"),
                "gbps_per_proxy_core": eff,
                "gbps_per_core_a": eff_a,
                "gbps_per_core_b": eff_b,
                "aes_reference": cipher,
                "aes_reference_gbps": ref,
                "pct_of_aes_gcm": pct,
                "pct_of_aes_gcm_a": pct_a,
                "pct_of_aes_gcm_b": pct_b,
                "pct_of_aes_gcm_target_met": pct >= 25 if pct is not None else None,
                "rss_kib_after_tput": {k: med(m.tput, f"rss_kib_{k}") for k in m.rss_rest},
                "rss_kib_7s_after_tput": m.rss_rest,
                "cpu_s_per_gib": med(m.tput, "cpu_s_per_gib"),
                "box_busy_cores": med(m.tput, "box_busy_cores"),
                "zta_bytes_ratio": ratio_a,
                "ztb_bytes_ratio": ratio_b,
                "conn_per_s": (crr := med(m.crr, "conn_per_s")),
                "crr_vs_direct": crr / direct_crr if crr and direct_crr else None,
                "crr_p50_us": med(m.crr, "p50_us"),
                "crr_p99_us": med(m.crr, "p99_us"),
                "crr_cpu_us_per_conn_a": med(m.crr, "cpu_us_per_conn_a"),
                "crr_cpu_us_per_conn_b": med(m.crr, "cpu_us_per_conn_b"),
                "crr_conn_per_proxy_core_s": med(m.crr, "conn_per_proxy_core_s"),
                "crr_client_cores": med(m.crr, "client_cores"),
                "pool": m.pool,
            }
        )
    tput_lines += [
        "",
        "Gbit/s per proxy core = bits iperf3 delivered / (CPU s of ztunnel-a + CPU s of ztunnel-b);"
        " per core a / b divides by one side's CPU only. % of AES-GCM compares with single-core"
        " `openssl speed` for the suite negotiated. Target: >= 25% (a+b).",
        "",
        *(f"* `{m.name}`: {m.about}" for m in modes if m.about),
        "",
    ]
    crr_lines = [
        f"### New tunnelled connections/s: connect / 1-byte RR / close, {args.crr_procs} client "
        f"processes, {crr_seconds} s x {rounds} rounds, median",
        "",
        "| mode | conn/s | vs direct | p50 µs | p99 µs | ztunnel-a CPU µs/conn "
        "| ztunnel-b CPU µs/conn | conn/s per proxy core | client cores | box busy cores "
        "| access records a / b per conn | pooled :15008 conns before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in zip(modes, summary, strict=True):
        if not m.crr:
            continue
        conns = sum(r["conns"] for r in m.crr)
        ra = sum(r.get("zta_conns", 0) for r in m.crr) / conns if m.zta and conns else None
        rb = sum(r.get("ztb_conns", 0) for r in m.crr) / conns if m.ztb and conns else None
        pool = (
            f"{len(m.pool.get('before', []))} → {len(m.pool.get('after', []))}"
            + (" (same port)" if m.pool.get("before") == m.pool.get("after") else "")
            if m.hbone
            else "-"
        )
        crr_lines.append(
            f"| {m.name} | {fmt(s['conn_per_s'], '.0f')} | {fmt(s['crr_vs_direct'])}x "
            f"| {fmt(s['crr_p50_us'], '.0f')} | {fmt(s['crr_p99_us'], '.0f')} "
            f"| {fmt(s['crr_cpu_us_per_conn_a'], '.0f')} | {fmt(s['crr_cpu_us_per_conn_b'], '.0f')} "
            f"| {fmt(s['crr_conn_per_proxy_core_s'], '.0f')} | {fmt(s['crr_client_cores'])} "
            f"| {fmt(med(m.crr, 'box_busy_cores'))} | {fmt(ra, '.3f')} / {fmt(rb, '.3f')} | {pool} |"
        )
    lines: list[str] = []
    if any(m.tput for m in modes):
        lines += tput_lines
    if any(m.crr for m in modes):
        lines += crr_lines
    if profile:
        lines += ["", *profile_markdown(profile)]
    table = "\n".join(lines)
    print(table)
    import uvloop

    doc = {
        "command": " ".join(["python", "benchmarks/bench_hbone.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(elapsed, 1),
        "env": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "openssl_python": __import__("ssl").OPENSSL_VERSION,
            "openssl_cli": tool_version(["openssl", "version"]),
            "uvloop": getattr(uvloop, "__version__", "?"),
            "iperf3": tool_version(["iperf3", "--version"]),
            "loop": args.loop,
            "git_head": _git("rev-parse", "HEAD"),
            "git_dirty_hbone_files": _git("status", "--short", "ztunnel/hbone", "ztunnel/proxy"),
            "sha256_at_start": args.source_hashes,
            "load_avg_at_end": os.getloadavg(),
        },
        "params": {
            "iperf_seconds": seconds,
            "rounds": rounds,
            "crr_seconds": crr_seconds,
            "crr_procs": args.crr_procs,
        },
        "openssl_speed_gbps": speed,
        "openssl_speed_median_gbps": aes,
        "summary": summary,
        "runs": {m.name: {"tput": m.tput, "crr": m.crr} for m in modes},
        "profile": profile,
        "markdown": table,
    }
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out} ({elapsed:.0f} s)")


def profile_markdown(p: dict[str, Any]) -> list[str]:
    lines = [f"### Profile of `{p['mode']}` under iperf3 ({p['seconds']} s per tool)", ""]
    for key, what in (
        ("perf_stat_iperf", "perf stat"),
        ("pyspy_iperf", f"py-spy --native {p['py_spy_rate']} Hz"),
        ("perf_iperf", "perf record -g"),
    ):
        if key in p:
            r = p[key]
            lines.append(
                f"* {what} run: {r['gbps']:.2f} Gbit/s, ztunnel-a {r.get('cores_a', 0):.2f} cores, "
                f"ztunnel-b {r.get('cores_b', 0):.2f} cores, per core a/b "
                f"{fmt(r.get('gbps_per_core_a'))}/{fmt(r.get('gbps_per_core_b'))} Gbit/s"
            )
    sa, sb = p.get("perf_stat_a"), p.get("perf_stat_b")
    if sa and sb:
        lines += [
            "",
            "perf stat, per GiB carried (sendto/recvfrom avg = bytes carried / calls):",
            "",
            "| event | ztunnel-a per GiB | ztunnel-b per GiB |",
            "|---|---|---|",
        ]
        for ev in (*_SYSCALLS, "page-faults", "context-switches", "task-clock"):
            if ev in sa or ev in sb:
                va, vb = sa.get(ev, {}), sb.get(ev, {})
                extra_a = (
                    f" (avg {va['avg_bytes_if_all_payload'] // 1024} KiB)"
                    if "avg_bytes_if_all_payload" in va
                    else ""
                )
                extra_b = (
                    f" (avg {vb['avg_bytes_if_all_payload'] // 1024} KiB)"
                    if "avg_bytes_if_all_payload" in vb
                    else ""
                )
                unit = " ms" if ev == "task-clock" else ""
                lines.append(
                    f"| {ev} | {fmt(va.get('per_gib'), '.0f')}{unit}{extra_a} "
                    f"| {fmt(vb.get('per_gib'), '.0f')}{unit}{extra_b} |"
                )
    lines.append("")
    titles = {
        "a": "ztunnel-a (sender: TCP -> h2 DATA -> TLS encrypt)",
        "b": "ztunnel-b (receiver: TLS decrypt -> h2 -> TCP)",
    }
    for side, title in titles.items():
        lines += [f"#### {title}", ""]
        ps = p.get(f"pyspy_{side}")
        if ps and "categories_pct" in ps:
            lines += [
                f"py-spy: {ps['busy_samples']} busy samples ({ps['idle_pct_of_all']}% of samples "
                "idle in epoll_wait, excluded). Busy time by category (leaf-most match):",
                "",
                "| category | % busy |",
                "|---|---|",
                *(f"| {k} | {v} |" for k, v in ps["categories_pct"] if v >= 0.5),
                "",
                "Data-path functions (inclusive % of busy) and their direct callees:",
                "",
                "| function | incl % | callees (%) |",
                "|---|---|---|",
            ]
            for t in ps["tree"][:12]:
                callees = "; ".join(f"`{c}` {v}" for c, v in t["callees_pct"])
                lines.append(f"| `{t['function']}` | {t['inclusive_pct']} | {callees} |")
            lines.append("")
        elif ps:
            lines += [f"py-spy failed: {str(ps.get('error', '?'))[:300]}", ""]
        pf = p.get(f"perf_{side}")
        if pf and "dso_self_pct" in pf:
            dsos = ", ".join(f"{k} {v:.1f}%" for k, v in pf["dso_self_pct"][:7])
            lines += [
                f"perf (user + kernel) self time by DSO: {dsos}.",
                "",
                "| perf: inclusive (children) | % |",
                "|---|---|",
                *(f"| {k} | {v:.1f} |" for k, v in pf["key_children_pct"]),
                "",
            ]
    crr = p.get("crr")
    if crr:
        lines += ["### Profile of the CRR load (py-spy; it slows the proxies, read the shares)", ""]
        for name, res in crr.items():
            load = res["load"]
            lines.append(f"#### {name}: {load['conn_per_s']:.0f} conn/s under py-spy")
            pa, pb = res.get("perf_stat_a_per_conn"), res.get("perf_stat_b_per_conn")
            if pa:
                lines += ["", "perf stat per connection (no py-spy):", ""]
                lines += ["| event | ztunnel-a | ztunnel-b |", "|---|---|---|"]
                for ev in pa:
                    unit = " ms" if ev == "task-clock" else ""
                    lines.append(f"| {ev} | {pa[ev]}{unit} | {(pb or {}).get(ev, '-')}{unit} |")
            for side in ("a", "b"):
                ps = res.get(side)
                if not ps:
                    continue
                cats = "; ".join(f"{k} {v}" for k, v in ps["categories_pct"][:9])
                lines += [
                    "",
                    f"ztunnel-{side} categories: {cats}",
                    "",
                    "| function | incl % |",
                    "|---|---|",
                ]
                lines += [f"| `{t['function']}` | {t['inclusive_pct']} |" for t in ps["tree"][:12]]
            lines.append("")
    return lines


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name.split(" (")[0]).strip("-")


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    ap.add_argument(
        "--quick", action="store_true", help="iperf3 -t 5, CRR 2 s, no variants (< 2 min)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--seconds", type=int, help="iperf3 -t (default 5 quick / 10 full)")
    ap.add_argument("--crr-seconds", type=float, help="CRR seconds per round (2 quick / 4 full)")
    ap.add_argument("--crr-procs", type=int, default=4, help="CRR client processes")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--out", default=str(RESULTS / "hbone.json"), help="JSON output path")
    ap.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="extra HBONE pod pair with modified ztunnels (repeatable; default: aes128 and "
        "malloc unless --quick). " + "; ".join(f"{v.name}: {v.about}" for v in VARIANTS.values()),
    )
    ap.add_argument("--no-variants", dest="variant", action="store_const", const=[])
    ap.add_argument(
        "--no-haproxy",
        dest="haproxy",
        action="store_false",
        help="skip the HAProxy TLS tunnel reference (pods e -> f)",
    )
    ap.add_argument(
        "--only", choices=["tput", "crr", "profile"], help="run one part (for development)"
    )
    ap.add_argument("--profile", action="store_true", help="py-spy + perf profile of HBONE")
    ap.add_argument("--profile-seconds", type=int, default=10)
    ap.add_argument("--profile-target", default="hbone", help="mode or variant to profile")
    ap.add_argument(
        "--profile-crr", action="store_true", help="also py-spy the tcp and hbone CRR loads"
    )
    ap.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    e = sub.add_parser("echo")
    e.add_argument("--port", type=int, required=True)
    c = sub.add_parser("crr")
    c.add_argument("--ip", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=2.0)
    c.add_argument("--procs", type=int, default=4)
    args = ap.parse_args()
    if args.cmd == "echo":
        run_echo(args.port)
    elif args.cmd == "crr":
        run_crr(args.ip, args.port, args.seconds, args.procs)
    else:
        if os.geteuid() != 0:
            sys.exit("bench_hbone.py needs root (network namespaces)")
        drive(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
