"""The benchmark suite: ztunnel against HAProxy and stunnel, every path in one run, in netns pods.

Usage: ``python benchmarks/suite.py --quick`` (root; ``make bench``; about 3 minutes) or without
``--quick`` for longer runs and more rounds. Results: ``benchmarks/results/suite.json``,
``benchmarks/results/suite.md`` and ``benchmarks/results/suite_*.png`` (plots need matplotlib; the
suite skips them with a message when it is missing).

Topology: the test bed of ``bench_hbone.py`` (nodes n1 and n2; pods ``a`` (n1) and ``b`` (n2) with
in-pod iptables rules and one ztunnel each in dedicated mode; pods ``c`` (n1) and ``d`` (n2)
without rules, ``d`` being a ``protocol: TCP`` workload) plus pods ``g`` (n1, HAProxy), ``e`` (n1,
stunnel client) and ``f`` (n2, stunnel server, iperf3, echo). Paths:

* ``direct``: c -> d, no proxy;
* ``ztunnel-tcp``: a -> d through ztunnel-a (plain passthrough);
* ``ztunnel-hbone``: a -> b, ztunnel-a -> mTLS + HTTP/2 CONNECT -> ztunnel-b -> app;
* ``haproxy-splice``: g -> 127.0.0.1 -> HAProxy (TCP mode, splice, ``tune.pipesize 1048576``,
  1 thread) -> d: the plaintext peer on true loopback;
* ``haproxy-inpod``: the same HAProxy configuration in pod ``h`` (n1), which has the in-pod rules
  of ``a``: h -> d is REDIRECTed to HAProxy on 15001 exactly as a -> d is to ztunnel-a, and
  HAProxy forwards to the original destination (``server 0.0.0.0``); its own upstream leaves the
  capture by uid, as ztunnel's does by mark. The redirected leg costs any proxy more kernel CPU
  per byte than true loopback (the client keeps eth0's MSS of 1448 instead of loopback's 65483,
  and conntrack/NAT run on every packet), so this is the same-path peer of ``ztunnel-tcp``;
* ``stunnel-pair``: e -> 127.0.0.1 -> stunnel -> TLS 1.3 with client certificates -> stunnel ->
  127.0.0.1 in f: the encrypted peer of ``ztunnel-hbone`` (no HTTP/2).

Each path is checked to really go through its proxies: ztunnel access-log byte counts, HAProxy log
lines (``%U`` bytes uploaded), stunnel "Connection closed" byte counts, compared with iperf3.

Internal sub-commands (run inside pods): ``rr`` (paced / max-rate 1 KiB request-response load
generator), ``hs`` (new mTLS connections: full handshakes/s at a server) and ``idle`` (opens N
idle connections). ``benchmarks/report.py`` turns the JSON into the README's table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import platform
import re
import resource
import select
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_hbone as bh  # noqa: E402

ROOT = bh.ROOT
RESULTS = ROOT / "benchmarks" / "results"
IPERF_PORT = bh.IPERF_PORT
ECHO_PORT = bh.ECHO_PORT
SUITE = "TLS_AES_256_GCM_SHA384"  # what ztunnel negotiates (AES_256 first, as upstream)
HAP_IPERF, HAP_ECHO = 6001, 6101
HAP_INPOD_PORT, HAP_INPOD_UID = 15001, 4242
ST_IPERF, ST_ECHO = 6000, 6100
ST_TLS_IPERF, ST_TLS_ECHO = 8443, 8444

CODE_PATHS = ("ztunnel", "benchmarks/*.py", "pyproject.toml")  # what a run's commit must hold

# targets, as ratios in the same run
T_PLAIN_VS_HAPROXY = 1.0
T_HBONE_VS_STUNNEL = 1.0
T_ADDED_P99_MS = 0.5
T_VCPU_PER_KRPS = 0.10
T_KIB_PER_IDLE = 10.0
IP_BIND_ADDRESS_NO_PORT = 24  # (linux/in.h; not in the socket module)
IDLE_STALL_S = 30.0  # idle: in-flight connections with no answer for this long failed


# ---------------------------------------------------------------------------------------------
# sub-commands that run inside a pod


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, int(len(sorted_vals) * q))]


def run_rr(ip: str, port: int, rate: float, conns: int, seconds: float, size: int) -> None:
    """1 KiB request / 1 KiB response on ``conns`` connections, non-blocking, epoll.

    ``rate`` > 0: open loop, request k is due at start + k/rate and goes out on the first free
    connection (latency from the send; ``lag`` = how late the send was vs. the schedule, the check
    that the generator keeps up; ``co_p99`` counts from the due time). ``rate`` = 0: closed loop,
    each connection sends its next request as soon as its reply is complete (maximum rate).
    Prints one JSON line."""
    payload = b"q" * size
    socks = []
    for _ in range(conns):
        s = socket.create_connection((ip, port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(payload)  # warm-up round trip on each connection
        warm = 0
        while warm < size:
            warm += len(s.recv(65536))
        s.setblocking(False)
        socks.append(s)
    ep = select.epoll()
    fdmap = {}
    for i, s in enumerate(socks):
        ep.register(s.fileno(), select.EPOLLIN)
        fdmap[s.fileno()] = i
    got = [0] * conns
    due = [0.0] * conns
    sent = [0.0] * conns
    free = collections.deque(range(conns))
    pending: collections.deque[float] = collections.deque()
    lat: list[float] = []
    lag: list[float] = []
    co: list[float] = []
    errors = 0
    clock = time.perf_counter
    t_cpu0 = os.times()
    start = clock() + 0.02
    end = start + seconds
    k = 0
    busy = 0
    while True:
        now = clock()
        if now < end:
            if rate > 0:
                while True:
                    t = start + k / rate
                    if t > now or t >= end:
                        break
                    pending.append(t)
                    k += 1
            else:
                while len(pending) < len(free):
                    pending.append(now)
        while pending and free:
            i = free.popleft()
            t = pending.popleft()
            try:
                n = socks[i].send(payload)
            except OSError:
                n = -1
            if n != size:
                errors += 1
                continue
            due[i], sent[i] = t, clock()
            lag.append(sent[i] - t)
            busy += 1
        if now >= end and busy == 0:
            break
        if now >= end + 5:
            errors += busy
            break
        timeout = 0.5
        if rate > 0 and now < end:
            timeout = max(0.0, start + k / rate - clock())
        for fd, _ in ep.poll(timeout):
            i = fdmap[fd]
            try:
                data = socks[i].recv(65536)
            except BlockingIOError:
                continue
            if not data:
                errors += 1
                ep.unregister(fd)
                busy -= 1
                continue
            got[i] += len(data)
            if got[i] >= size:
                got[i] = 0
                t = clock()
                lat.append(t - sent[i])
                co.append(t - due[i])
                busy -= 1
                free.append(i)
    t_cpu1 = os.times()
    for s in socks:
        s.close()
    lat.sort()
    lag.sort()
    co.sort()
    cpu = (t_cpu1.user + t_cpu1.system) - (t_cpu0.user + t_cpu0.system)
    ms = 1e3
    print(
        json.dumps(
            {
                "requests": len(lat),
                "errors": errors,
                "seconds": seconds,
                "rps": len(lat) / seconds,
                "p50_ms": (_pct(lat, 0.50) or 0) * ms,
                "p90_ms": (_pct(lat, 0.90) or 0) * ms,
                "p99_ms": (_pct(lat, 0.99) or 0) * ms,
                "co_p99_ms": (_pct(co, 0.99) or 0) * ms,
                "lag_p99_ms": (_pct(lag, 0.99) or 0) * ms,
                "client_cores": cpu / seconds,
            }
        ),
        flush=True,
    )


def run_idle(
    ip: str, port: int, n: int, ports: int = 1, inflight_max: int = 256, src: str | None = None
) -> None:
    """Open ``n`` connections, one 1-byte round trip each (the tunnel is up end to end), print
    ``READY <n> <errors>``, then hold them idle until stdin closes. With ``ports`` > 1 they go
    round-robin to ``port`` .. ``port + ports - 1`` (one source IP gets at most one ephemeral
    port range per destination ip:port); ``src``: from this source IP (bound with
    IP_BIND_ADDRESS_NO_PORT, the port picked at connect). At most ``inflight_max`` are opening
    at a time. A stdin
    line ``PROBE <k>`` sends one more byte on ``k`` of the open connections, evenly spread, and
    prints ``PROBED <echoed> <failed>``."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, n + 100), max(hard, n + 100)))
    socks: list[socket.socket] = []
    ep = select.epoll()
    inflight: dict[int, socket.socket] = {}
    opened = 0
    errors = 0
    done = 0
    quiet_since = time.monotonic()
    reported = 0
    while done + errors < n:
        while opened < n and len(inflight) < inflight_max:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            if src is not None:
                s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                s.bind((src, 0))
            with contextlib.suppress(BlockingIOError):
                s.connect((ip, port + opened % ports))
            inflight[s.fileno()] = s
            ep.register(s.fileno(), select.EPOLLOUT)
            opened += 1
        events = ep.poll(5.0)
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > IDLE_STALL_S:  # no answer at all: count as failed
            print(f"STALLED {len(inflight)}", flush=True)
            for fd, s in inflight.items():
                ep.unregister(fd)
                s.close()
            errors += len(inflight)
            inflight.clear()
        if done + errors >= reported + 10_000:
            reported = (done + errors) // 10_000 * 10_000
            print(f"PROGRESS {done} {errors}", flush=True)
        for fd, ev in events:
            s = inflight[fd]
            if ev & select.EPOLLOUT:
                try:
                    failed = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                    if not failed:
                        s.send(b"i")
                except OSError:  # (reset as soon as accepted)
                    failed = True
                if failed:
                    errors += 1
                    ep.unregister(fd)
                    del inflight[fd]
                    s.close()
                    continue
                ep.modify(fd, select.EPOLLIN)
                continue
            try:
                data = s.recv(16)
            except OSError:
                data = b""
            ep.unregister(fd)
            del inflight[fd]
            if data:
                done += 1
                socks.append(s)
            else:
                errors += 1
                s.close()
    print(f"READY {done} {errors}", flush=True)
    for line in sys.stdin:
        if line.startswith("PROBE ") and socks:
            k = min(int(line.split()[1]), len(socks))
            ok = _probe([socks[i * len(socks) // k] for i in range(k)])
            print(f"PROBED {ok} {k - ok}", flush=True)
    for s in socks:
        s.close()


def _probe(socks: list[socket.socket], timeout: float = 10.0) -> int:
    """One byte sent on each socket; how many echoed it back within ``timeout``."""
    ep = select.epoll()
    waiting: dict[int, socket.socket] = {}
    for s in socks:
        with contextlib.suppress(OSError):
            s.send(b"p")
            ep.register(s.fileno(), select.EPOLLIN)
            waiting[s.fileno()] = s
    ok = 0
    end = time.monotonic() + timeout
    while waiting and time.monotonic() < end:
        for fd, _ev in ep.poll(max(0.0, end - time.monotonic())):
            try:
                data = waiting.pop(fd).recv(16)
            except OSError:
                data = b""
            ok += data == b"p"
            ep.unregister(fd)
    ep.close()
    return ok


def _hs_once(ctx: ssl.SSLContext, addr: tuple[str, int], authority: str | None) -> bool:
    """One new mTLS connection: a full TLS 1.3 handshake with client certificates, then one byte
    echoed end to end (``authority``: through an HBONE CONNECT to it). True if the byte came back."""
    from ztunnel.hbone import h2conn as h2

    with socket.create_connection(addr, timeout=5) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw, server_hostname=None) as s:
            if authority is None:
                s.sendall(b"x")
                return s.recv(1) == b"x"
            conn = h2.H2Connection(client=True)
            sid = conn.open_stream(authority, [("traceparent", _TRACEPARENT)])
            s.sendall(conn.data_to_send_bytes())
            status = 0
            while True:
                data = s.recv(65536)
                if not data:
                    return False
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.ResponseReceived):
                        if ev.status != 200:
                            return False
                        status = ev.status
                        conn.send_data(sid, b"x")
                    elif isinstance(ev, h2.DataReceived) and ev.stream_id == sid:
                        return status == 200 and bytes(ev.data) == b"x"
                    elif isinstance(ev, h2.StreamReset | h2.ConnectionTerminated):
                        return False
                if out := conn.data_to_send_bytes():
                    s.sendall(out)


_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _hs_worker(
    ctx: ssl.SSLContext,
    addr: tuple[str, int],
    authority: str | None,
    start: float,
    end: float,
) -> dict[str, Any]:
    n = errors = 0
    while time.time() < start:
        time.sleep(0.001)
    while time.time() < end:
        try:
            ok = _hs_once(ctx, addr, authority)
        except (OSError, ssl.SSLError):
            ok = False
        n += 1
        errors += not ok
    return {"n": n, "errors": errors}


def run_hs(args: argparse.Namespace) -> None:
    """``procs`` forked clients making new mTLS connections until the end (see ``_hs_once``).

    HBONE (``--ca-dir``): a workload certificate from the test bed's shared local CA, CONNECT to
    ``--authority``. Plain TLS (``--ca``, ``--leaf``): the stunnel pair's CA and leaf. Prints one
    JSON line: connections, errors, seconds, the clients' CPU seconds."""
    if args.ca_dir:  # the client context ztunnel itself uses for HBONE
        from ztunnel.core.identity import Identity
        from ztunnel.identity.localca import LocalCA
        from ztunnel.identity.tls import client_context

        ca = LocalCA.load_or_create(Path(args.ca_dir))
        ctx = client_context(ca.issue(Identity(ca.trust_domain, "default", "sa-bench-hs")))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.options |= ssl.OP_NO_TICKET  # every connection a full handshake, as ztunnel's
        ctx.load_verify_locations(args.ca)
        ctx.load_cert_chain(args.leaf)
    work = functools.partial(_hs_worker, ctx, (args.ip, args.port), args.authority)
    results, cpu = bh.fork_clients(args.procs, args.seconds, work)
    total = sum(r["n"] for r in results if r)
    errors = sum(r["errors"] if r else 1 for r in results)
    out = {"conns": total, "errors": errors, "seconds": args.seconds, "client_cpu_s": cpu}
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# proxies: HAProxy (plaintext peer) and stunnel (encrypted peer)


class LineLog:
    """Collect a process's output lines in a thread."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._t.start()

    def _pump(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip())


def haproxy_splice_cfg(
    maps: list[tuple[int, str]],
    *,
    bind: str = "127.0.0.1",
    uid: int | None = None,
    nbthread: int = 1,
) -> str:
    out = [
        "global",
        *([f"  uid {uid}", f"  gid {uid}"] if uid is not None else []),
        f"  nbthread {nbthread}",
        "  maxconn 4000",
        "  tune.pipesize 1048576",
        "  tune.bufsize 65536",
        "  log stdout format raw local0 info",
        # HAProxy 2.6 makes a "default" resolvers section from /etc/resolv.conf and connect()s a
        # UDP socket to it at start-up; naming our own keeps it on the pod's loopback.
        "resolvers default",
        "  nameserver lo 127.0.0.1:53",
        "defaults",
        "  mode tcp",
        "  log global",
        '  log-format "HAPLOG %U %B"',
        "  timeout connect 5s",
        "  timeout client 60s",
        "  timeout server 60s",
        "  option splice-request",
        "  option splice-response",
    ]
    for i, (lport, server) in enumerate(maps):
        out += [f"listen l{i}", f"  bind {bind}:{lport}", f"  server s{i} {server}"]
    return "\n".join(out) + "\n"


def haproxy_tls_cfg(
    maps: list[tuple[str, str]], ca: str, leaf: str, *, tls_in: bool, nbthread: int
) -> str:
    """One side of an HAProxy mTLS pair (the C peer of HBONE in the worker rows): plain -> TLS 1.3
    (client side, verifying the server's name) or TLS with a required client certificate ->
    plain (server side), the suite ztunnel negotiates, ``HAPLOG %U %B`` per connection."""
    tls = f"ssl crt {leaf} ca-file {ca} ssl-min-ver TLSv1.3 ciphersuites {SUITE}"
    out = [
        "global",
        f"  nbthread {nbthread}",
        "  maxconn 4000",
        "  tune.bufsize 65536",
        "  log stdout format raw local0 info",
        "resolvers default",
        "  nameserver lo 127.0.0.1:53",
        "defaults",
        "  mode tcp",
        "  log global",
        '  log-format "HAPLOG %U %B"',
        "  timeout connect 5s",
        "  timeout client 60s",
        "  timeout server 60s",
    ]
    for i, (listen, server) in enumerate(maps):
        bind = f"  bind {listen}" + (f" {tls} verify required" if tls_in else "")
        srv = f"  server s{i} {server}"
        if not tls_in:
            srv += f" {tls} verify required verifyhost bench-leaf"
        out += [f"listen l{i}", bind, srv]
    return "\n".join(out) + "\n"


def stunnel_cfg(
    services: list[tuple[str, str, str]], ca: str, leaf: str, *, client: bool, pid: str
) -> str:
    out = [
        "foreground = yes",
        f"pid = {pid}",
        "debug = notice",
        "syslog = no",
    ]
    for name, accept, connect in services:
        out += [
            f"[{name}]",
            f"client = {'yes' if client else 'no'}",
            f"accept = {accept}",
            f"connect = {connect}",
            f"cert = {leaf}",
            f"CAfile = {ca}",
            "verifyChain = yes",
            "checkHost = bench-leaf" if client else "requireCert = yes",
            "sslVersionMin = TLSv1.3",
            f"ciphersuites = {SUITE}",
            "socket = l:TCP_NODELAY=1",
            "socket = r:TCP_NODELAY=1",
        ]
    return "\n".join(x for x in out if x) + "\n"


_ST_CLOSED = re.compile(
    r"Connection (?:closed|reset): (\d+) byte\(s\) sent to TLS, (\d+) byte\(s\) sent"
)
_HAP = re.compile(r"HAPLOG (\d+) (\d+)")


# ---------------------------------------------------------------------------------------------
# process trees: a ztunnel with ZTUNNEL_WORKER_THREADS=N > 1 is a supervisor and N worker
# processes (children or grandchildren), so its CPU and memory are summed over the whole tree


proc_tree = bh.proc_tree  # root and every live descendant, from the ppid of /proc/*/stat


def tree_cpu_by_pid(root: int) -> dict[int, float]:
    """CPU seconds of each process of the tree: utime + stime + the cutime + cstime of children
    it has reaped, so a worker that exits between two samples still counts (in its parent)."""
    out: dict[int, float] = {}
    for pid in proc_tree(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = sum(int(x) for x in fields[11:15]) / bh.CLK_TCK
    return out


def tree_cpu_seconds(root: int) -> float:
    return bh.cpu_seconds(root)  # (a cgroup's count: exited workers too)


def tree_run_ns(root: int) -> int:
    """Nanoseconds on CPU of every thread of the tree's live processes (``schedstat``): fine
    enough for one scrape, where the clock-tick counts of /proc/PID/stat read 0 or 10 ms."""
    total = 0
    for pid in proc_tree(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with (
                    contextlib.suppress(OSError, ValueError),
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f,
                ):
                    total += int(f.read().split()[0])
    return total


def process_memory_kib(pid: int) -> dict[str, int]:
    """RSS, PSS and private KiB of one process (``/proc/PID/smaps_rollup``) and its parent."""
    out = {"pid": pid, "ppid": 0, "rss": 0, "pss": 0, "private": 0}
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            out["ppid"] = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f.read().splitlines()[1:]:
                key, _, rest = line.partition(":")
                kib = int(rest.split()[0]) if rest.split() else 0
                if key == "Rss":
                    out["rss"] += kib
                elif key == "Pss":
                    out["pss"] += kib
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["private"] += kib
    return out


def tree_memory_kib(root: int) -> dict[str, int]:
    """RSS, PSS and private (USS) KiB summed over the tree (``/proc/PID/smaps_rollup``), and the
    number of processes. PSS splits each shared page between the processes mapping it, so the
    sum over a supervisor and its forked workers counts their shared pages once."""
    out = {"rss": 0, "pss": 0, "private": 0, "processes": 0}
    for pid in proc_tree(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                text = f.read()
        except OSError:
            continue
        out["processes"] += 1
        for line in text.splitlines()[1:]:
            key, _, rest = line.partition(":")
            kib = int(rest.split()[0]) if rest.split() else 0
            if key == "Rss":
                out["rss"] += kib
            elif key == "Pss":
                out["pss"] += kib
            elif key in ("Private_Clean", "Private_Dirty"):
                out["private"] += kib
    return out


# ---------------------------------------------------------------------------------------------
# paths


@dataclass
class Path_:
    name: str
    kind: str  # direct | ztunnel | haproxy | stunnel
    client: Any
    iperf: tuple[str, int]
    echo: tuple[str, int]
    pids: dict[str, int] = field(default_factory=dict)  # proxy processes measured ("a", "b")
    zta: Any = None
    ztb: Any = None
    logs: dict[str, LineLog] = field(default_factory=dict)
    # new mTLS connections straight at the server side "b": (client pod, address, generator args)
    hs: tuple[Any, tuple[str, int], list[str]] | None = None
    res: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def proxied(self) -> bool:
        return bool(self.pids)


def _proof_start(p: Path_) -> dict[str, int]:
    return {
        "a": bh._nrec(p.zta),
        "b": bh._nrec(p.ztb),
        **{f"log_{k}": len(v.lines) for k, v in p.logs.items()},
    }


def _proof(p: Path_, start: dict[str, int], port: int, sent: float, conns: int) -> dict[str, Any]:
    """Bytes / connections each proxy says it carried, as ratios of what the client sent."""
    out: dict[str, Any] = {}
    if p.kind == "ztunnel":
        for side, zt, direction, key in (
            ("a", p.zta, "outbound", "bytes_sent"),
            ("b", p.ztb, "inbound", "bytes_recv"),
        ):
            if zt is None:
                continue
            bh._wait_records(zt, start[side], direction, port, conns)
            n, nbytes = bh._zt_bytes(zt, start[side], direction, port, key)
            out[f"proof_conns_{side}"] = n
            if sent:
                out[f"proof_bytes_ratio_{side}"] = nbytes / sent
    elif p.kind in ("haproxy", "stunnel"):
        for side, log in p.logs.items():
            deadline = time.monotonic() + 3.0
            while True:
                n = total = 0
                for line in log.lines[start[f"log_{side}"] :]:
                    if p.kind == "haproxy" and (m := _HAP.search(line)):
                        n, total = n + 1, total + int(m.group(1))
                    elif p.kind == "stunnel" and (m := _ST_CLOSED.search(line)):
                        # client side: plaintext from the app is "sent to TLS"; server: "to socket"
                        n, total = n + 1, total + int(m.group(1 if side == "a" else 2))
                if n >= conns or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            out[f"proof_conns_{side}"] = n
            if sent:
                out[f"proof_bytes_ratio_{side}"] = total / sent
    return out


def _cpu(p: Path_) -> dict[str, float]:
    return {k: tree_cpu_seconds(pid) for k, pid in p.pids.items()}


def run_iperf(p: Path_, seconds: int, streams: int) -> dict[str, Any]:
    start = _proof_start(p)
    cpu0 = _cpu(p)
    busy0, tot0 = bh.box_busy()
    ip, port = p.iperf
    out = p.client.run(
        "iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-P", str(streams), "-J",
        timeout=seconds + 30,
    )  # fmt: skip
    busy1, tot1 = bh.box_busy()
    cpu1 = _cpu(p)
    end = json.loads(out.stdout)["end"]
    secs = float(end["sum_received"]["seconds"])
    rbytes = float(end["sum_received"]["bytes"])
    bits = rbytes * 8
    res: dict[str, Any] = {
        "streams": streams,
        "gbps": float(end["sum_received"]["bits_per_second"]) / 1e9,
        "bytes": rbytes,
        "seconds": secs,
        "box_busy_cores": (busy1 - busy0) / (tot1 - tot0) * (os.cpu_count() or 1),
    }
    total = 0.0
    for k in cpu0:
        c = cpu1[k] - cpu0[k]
        total += c
        res[f"cores_{k}"] = c / secs
    if cpu0:
        res["proxy_cores"] = total / secs
        res["gbps_per_proxy_core"] = bits / 1e9 / total if total > 0 else None
    # iperf3: one control connection + `streams` data connections
    res |= _proof(p, start, port, float(end["sum_sent"]["bytes"]), streams + 1)
    return res


def run_rr_load(p: Path_, rate: float, conns: int, seconds: float) -> dict[str, Any]:
    start = _proof_start(p)
    cpu0 = _cpu(p)
    ip, port = p.echo
    out = p.client.run(
        sys.executable, __file__, "rr", "--ip", ip, "--port", str(port), "--rate", str(rate),
        "--conns", str(conns), "--seconds", str(seconds), timeout=seconds + 60,
    )  # fmt: skip
    cpu1 = _cpu(p)
    r: dict[str, Any] = json.loads(out.stdout)
    total = 0.0
    for k in cpu0:
        c = cpu1[k] - cpu0[k]
        total += c
        r[f"cores_{k}"] = c / seconds
    if cpu0 and r["rps"]:
        krps = r["rps"] / 1000
        r["proxy_cores"] = total / seconds
        r["vcpu_per_krps"] = total / seconds / krps
        r["vcpu_per_krps_max_side"] = max(r[f"cores_{k}"] for k in cpu0) / krps
    # the generator's own check: paced sends on time, and it is not saturated
    r["generator_ok"] = (
        r["lag_p99_ms"] < 2.0 and r["rps"] >= 0.97 * rate if rate > 0 else r["client_cores"] < 0.9
    )
    r |= _proof(p, start, port, 0.0, conns)
    return r


def run_crr(p: Path_, seconds: float, procs: int) -> dict[str, Any]:
    start = _proof_start(p)
    cpu0 = _cpu(p)
    ip, port = p.echo
    out = p.client.run(
        sys.executable, bh.__file__, "crr", "--ip", ip, "--port", str(port),
        "--seconds", str(seconds), "--procs", str(procs), timeout=seconds + 60,
    )  # fmt: skip
    cpu1 = _cpu(p)
    r = json.loads(out.stdout)
    res: dict[str, Any] = {
        "conn_per_s": r["conns"] / r["seconds"],
        "conns": r["conns"],
        "errors": r["errors"],
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
    }
    total = sum(cpu1[k] - cpu0[k] for k in cpu0)
    if cpu0 and r["conns"]:
        res["proxy_cpu_us_per_conn"] = total / r["conns"] * 1e6
        res["proxy_cores"] = total / r["seconds"]
    res |= _proof(p, start, port, 0.0, 0)
    return res


def run_handshakes(p: Path_, seconds: float, procs: int) -> dict[str, Any]:
    """Full mTLS handshakes/s at the server side ("b") of an encrypted path, same generator for
    both: each connection is a TLS 1.3 handshake with client certificates plus a 1-byte echo
    (for ztunnel through an HBONE CONNECT, so the handshake is ztunnel's inbound 15008)."""
    assert p.hs is not None
    client, (ip, port), extra = p.hs
    start = _proof_start(p)
    pid = p.pids["b"]
    cpu0 = tree_cpu_seconds(pid)
    out = client.run(
        sys.executable, __file__, "hs", "--ip", ip, "--port", str(port), "--seconds",
        str(seconds), "--procs", str(procs), *extra, timeout=seconds + 60,
    )  # fmt: skip
    cpu = tree_cpu_seconds(pid) - cpu0
    r = json.loads(out.stdout)
    res: dict[str, Any] = {
        "handshakes_per_s": r["conns"] / r["seconds"],
        "conns": r["conns"],
        "errors": r["errors"],
        "server_cores": cpu / r["seconds"],
        "client_cores": r["client_cpu_s"] / r["seconds"],
    }
    if r["conns"]:
        res["server_cpu_us_per_handshake"] = cpu / r["conns"] * 1e6
        res["handshakes_per_server_core_s"] = r["conns"] / cpu if cpu > 0 else None
    # proof: the server side logged every connection
    if p.kind == "ztunnel":
        bh._wait_records(p.ztb, start["b"], "inbound", ECHO_PORT, r["conns"])
        n, _ = bh._zt_bytes(p.ztb, start["b"], "inbound", ECHO_PORT, "bytes_sent")
        res["proof_conns_b"] = n
    else:
        log = p.logs["b"]
        deadline = time.monotonic() + 3.0
        while True:
            n = sum(1 for x in log.lines[start["log_b"] :] if _ST_CLOSED.search(x))
            if n >= r["conns"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        res["proof_conns_b"] = n
    return res


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid``, summed over its process tree (a ztunnel's workers; shared pages then
    count once per process, which deltas such as the idle-connection cost cancel out)."""
    total = 0
    for p in proc_tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            total += next((int(x.split()[1]) for x in f if x.startswith("VmRSS:")), 0)
    return total


def count_estab(pod: Any, sport: int) -> int:
    out = pod.run("ss", "-Htn", "state", "established", f"( sport = :{sport} )").stdout
    return sum(1 for line in out.splitlines() if line.strip())


def run_idle_memory(p: Path_, server: Any, n: int) -> dict[str, Any]:
    """RSS of both ztunnels at rest, then with ``n`` idle tunnelled connections open."""
    time.sleep(1.0)
    rss0 = {k: rss_kib(pid) for k, pid in p.pids.items()}
    base_estab = count_estab(server, ECHO_PORT)
    ip, port = p.echo
    proc = p.client.popen(
        sys.executable, __file__, "idle", "--ip", ip, "--port", str(port), "--n", str(n),
        stdin=subprocess.PIPE,
    )  # fmt: skip
    t0 = time.monotonic()
    line = proc.wait_for_line("READY", timeout=300)
    open_s = time.monotonic() - t0
    _, done, errors = line.split()
    time.sleep(2.0)
    rss1 = {k: rss_kib(pid) for k, pid in p.pids.items()}
    estab = count_estab(server, ECHO_PORT) - base_estab
    assert proc.popen.stdin is not None
    proc.popen.stdin.close()
    proc.popen.wait(timeout=60)
    delta = {k: rss1[k] - rss0[k] for k in rss0}
    opened = int(done)
    return {
        "n": n,
        "opened": opened,
        "errors": int(errors),
        "open_seconds": open_s,
        "app_side_established": estab,
        "rss_kib_at_rest": rss0,
        "rss_kib_loaded": rss1,
        "rss_delta_kib": delta,
        "kib_per_conn": sum(delta.values()) / opened if opened else None,
        "kib_per_conn_by_side": {k: v / opened for k, v in delta.items()} if opened else None,
    }


# ---------------------------------------------------------------------------------------------
# the test bed


# the worker rows' ztunnel pairs (issue 18): a-wN -> b-wN, each ztunnel with N workers
WORKER_VARIANTS = [
    bh.Variant(f"w{n}", {"ZTUNNEL_WORKER_THREADS": str(n)}, f"ZTUNNEL_WORKER_THREADS={n}")
    for n in (1, 2)
]


@contextlib.contextmanager
def suite_bed(loop: str, workers: bool = False) -> Iterator[tuple[list[Path_], list[Path_]]]:
    """The suite's paths and, with ``workers``, the worker rows' paths (else an empty list)."""
    variants = WORKER_VARIANTS if workers else []
    with bh.testbed(variants, loop, haproxy=False) as bed, tempfile.TemporaryDirectory() as tmp:
        tb, pods, zts = bed["bed"], bed["pods"], bed["zts"]
        n1, n2 = tb.host("n1"), tb.host("n2")
        g = n1.add_pod("g", ambient=False)
        h = n1.add_pod("h", ambient=False)
        h.install_inpod_rules()
        e, f = n1.add_pod("e", ambient=False), n2.add_pod("f", ambient=False)
        for pod in (g, h, e, f):
            pod.sysctl("net.ipv4.tcp_tw_reuse", 1)
            pod.sysctl("net.ipv4.ip_local_port_range", "1024 65000")
        d = pods["d"]
        # HAProxy splice in g, towards d's iperf3 and echo
        cfg = Path(tmp, "hap.cfg")
        cfg.write_text(
            haproxy_splice_cfg(
                [(HAP_IPERF, f"{d.ip4}:{IPERF_PORT}"), (HAP_ECHO, f"{d.ip4}:{ECHO_PORT}")]
            )
        )
        hap = g.popen(bh.HAPROXY, "-db", "-f", str(cfg), stdout=subprocess.PIPE)
        hap_log = LineLog(hap.popen.stdout)
        # The same HAProxy behind h's in-pod REDIRECT: "server 0.0.0.0" forwards to each
        # connection's original destination (SO_ORIGINAL_DST), as ztunnel does; its own upstream
        # connections skip the capture by uid, as ztunnel's do by mark.
        h.run(
            "iptables", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-p", "tcp",
            "-m", "owner", "--uid-owner", str(HAP_INPOD_UID), "-j", "ACCEPT",
        )  # fmt: skip
        cfg_h = Path(tmp, "hap_h.cfg")
        cfg_h.write_text(
            haproxy_splice_cfg([(HAP_INPOD_PORT, "0.0.0.0")], bind="0.0.0.0", uid=HAP_INPOD_UID)
        )
        hap_h = h.popen(bh.HAPROXY, "-db", "-f", str(cfg_h), stdout=subprocess.PIPE)
        hap_h_log = LineLog(hap_h.popen.stdout)
        # stunnel pair e -> f, servers in f
        ca, leaf = bh.make_certs(tmp)
        for srv in (
            ("iperf3", "-s", "-p", str(IPERF_PORT)),
            (sys.executable, bh.__file__, "echo", "--port", str(ECHO_PORT)),
        ):
            proc = f.popen(*srv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            if "echo" in srv:
                proc.wait_for_line("READY", timeout=15)
        cf, ce = Path(tmp, "st_f.conf"), Path(tmp, "st_e.conf")
        cf.write_text(
            stunnel_cfg(
                [
                    ("iperf", f"0.0.0.0:{ST_TLS_IPERF}", f"127.0.0.1:{IPERF_PORT}"),
                    ("echo", f"0.0.0.0:{ST_TLS_ECHO}", f"127.0.0.1:{ECHO_PORT}"),
                ],
                ca, leaf, client=False, pid=str(Path(tmp, "f.pid")),
            )
        )  # fmt: skip
        ce.write_text(
            stunnel_cfg(
                [
                    ("iperf", f"127.0.0.1:{ST_IPERF}", f"{f.ip4}:{ST_TLS_IPERF}"),
                    ("echo", f"127.0.0.1:{ST_ECHO}", f"{f.ip4}:{ST_TLS_ECHO}"),
                ],
                ca, leaf, client=True, pid=str(Path(tmp, "e.pid")),
            )
        )  # fmt: skip
        stf = f.popen("stunnel", str(cf), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        ste = e.popen("stunnel", str(ce), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        st_logs = {"a": LineLog(ste.popen.stdout), "b": LineLog(stf.popen.stdout)}
        bh.wait_until(lambda: bh.listening_in(hap.pid, HAP_ECHO), 10, "haproxy")
        bh.wait_until(lambda: bh.listening_in(hap_h.pid, HAP_INPOD_PORT), 10, "haproxy in h")
        bh.wait_until(lambda: bh.listening_in(stf.pid, ST_TLS_ECHO), 10, "stunnel f")
        bh.wait_until(lambda: bh.listening_in(ste.pid, ST_ECHO), 10, "stunnel e")
        bh.wait_until(lambda: bh.listening_in(stf.pid, IPERF_PORT), 10, "iperf3 in f")
        b = pods["b"]
        lo = "127.0.0.1"
        paths = [
            Path_("direct", "direct", pods["c"], (d.ip4, IPERF_PORT), (d.ip4, ECHO_PORT)),
            Path_(
                "ztunnel-tcp", "ztunnel", pods["a"], (d.ip4, IPERF_PORT), (d.ip4, ECHO_PORT),
                pids={"a": zts["a"].pid}, zta=zts["a"],
            ),
            Path_(
                "ztunnel-hbone", "ztunnel", pods["a"], (b.ip4, IPERF_PORT), (b.ip4, ECHO_PORT),
                pids={"a": zts["a"].pid, "b": zts["b"].pid}, zta=zts["a"], ztb=zts["b"],
                hs=(pods["c"], (b.ip4, 15008),
                    ["--ca-dir", bed["ca_dir"], "--authority", f"{b.ip4}:{ECHO_PORT}"]),
            ),
            Path_(
                "haproxy-splice", "haproxy", g, (lo, HAP_IPERF), (lo, HAP_ECHO),
                pids={"a": hap.pid}, logs={"a": hap_log},
            ),
            Path_(
                "haproxy-inpod", "haproxy", h, (d.ip4, IPERF_PORT), (d.ip4, ECHO_PORT),
                pids={"a": hap_h.pid}, logs={"a": hap_h_log},
            ),
            Path_(
                "stunnel-pair", "stunnel", e, (lo, ST_IPERF), (lo, ST_ECHO),
                pids={"a": ste.pid, "b": stf.pid}, logs=st_logs,
                hs=(e, (f.ip4, ST_TLS_ECHO), ["--ca", ca, "--leaf", leaf]),
            ),
        ]  # fmt: skip
        wpaths: list[Path_] = []
        if workers:
            more = {"e": e, "f": f, "h": h}
            wpaths = worker_paths(bed, tmp, ca, leaf, more, (hap_h, hap_h_log))
        yield paths, wpaths


# ---------------------------------------------------------------------------------------------
# report


def med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def summarize(paths: list[Path_]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for p in paths:
        row: dict[str, Any] = {"kind": p.kind}
        for key, runs in p.res.items():
            if key == "idle":
                row["idle"] = runs[0] if runs else None
                continue
            fields = {k for r in runs for k, v in r.items() if isinstance(v, int | float)}
            row[key] = {k: med(runs, k) for k in sorted(fields)}
        s[p.name] = row
    return s


def _get(s: dict[str, Any], path: str, test: str, key: str) -> float | None:
    return (s.get(path, {}).get(test) or {}).get(key)


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def per_core_ratio(what: str, ours: str, peer: str, want: float) -> None:
        for t in ("tput_1", "tput_8"):
            a = _get(s, ours, t, "gbps_per_proxy_core")
            b = _get(s, peer, t, "gbps_per_proxy_core")
            r = a / b if a and b else None
            n = t.split("_")[1]
            out.append(
                {
                    "target": f"{what} Gbit/s per proxy core vs {peer} ({n} stream(s))",
                    "want": f">= {want:.1f}x",
                    "value": r,
                    "shown": f"{fmt(r)}x",
                    "met": None if r is None else r >= want,
                }
            )

    # HAProxy on ztunnel's own capture path is the like-for-like peer; on loopback it pays no
    # REDIRECT (see the module docstring), shown too.
    per_core_ratio("plaintext", "ztunnel-tcp", "haproxy-inpod", T_PLAIN_VS_HAPROXY)
    per_core_ratio("plaintext", "ztunnel-tcp", "haproxy-splice", T_PLAIN_VS_HAPROXY)
    per_core_ratio("HBONE", "ztunnel-hbone", "stunnel-pair", T_HBONE_VS_STUNNEL)
    hb, di = _get(s, "ztunnel-hbone", "rr_paced", "p99_ms"), _get(s, "direct", "rr_paced", "p99_ms")
    added = hb - di if hb is not None and di is not None else None
    out.append(
        {
            "target": "HBONE added p99 latency at 1000 rps (vs direct)",
            "want": f"<= {T_ADDED_P99_MS} ms",
            "value": added,
            "shown": f"{fmt(added, '.3f')} ms",
            "met": None if added is None else added <= T_ADDED_P99_MS,
        }
    )
    for name in ("ztunnel-tcp", "ztunnel-hbone"):
        v = _get(s, name, "rr_paced", "vcpu_per_krps_max_side")
        tot = _get(s, name, "rr_paced", "vcpu_per_krps")
        out.append(
            {
                "target": f"{name}: vCPU per 1000 rps (busiest ztunnel; both: {fmt(tot, '.3f')})",
                "want": f"<= {T_VCPU_PER_KRPS:.2f}",
                "value": v,
                "shown": fmt(v, ".3f"),
                "met": None if v is None else v <= T_VCPU_PER_KRPS,
            }
        )
    idle = s.get("ztunnel-hbone", {}).get("idle") or {}
    v = idle.get("kib_per_conn")
    out.append(
        {
            "target": "memory per idle HBONE connection (RSS delta of both ztunnels / N)",
            "want": f"< {T_KIB_PER_IDLE:.0f} KiB",
            "value": v,
            "shown": f"{fmt(v, '.2f')} KiB",
            "met": None if v is None else v < T_KIB_PER_IDLE,
        }
    )
    return out


def markdown(doc: dict[str, Any], paths: list[Path_]) -> str:
    s = doc["summary"]
    p_ = doc["params"]
    lines = [
        f"## Benchmark suite ({'quick' if p_['quick'] else 'full'}), {doc['when']}",
        "",
        f"{doc['env']['cpus']} vCPU ({doc['env']['cpu_model']}), kernel {doc['env']['kernel']}, "
        f"Python {doc['env']['python']}. iperf3 -t {p_['iperf_seconds']}, {p_['rounds']} "
        "interleaved round(s), median. Proxy CPU = utime+stime of every proxy process on the "
        "path (ztunnel-a + ztunnel-b; both stunnels) from /proc. Shared VM: compare per-core "
        "columns and ratios, not absolute Gbit/s.",
        "",
        "### Targets (ratios in this run)",
        "",
        "| target | want | this run | verdict |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t['target']} | {t['want']} | {t['shown']} | {verdict(t['met'])} |"
        for t in doc["targets"]
    ]
    lines += [
        "",
        "### Throughput",
        "",
        "| path | 1 stream Gbit/s | proxy cores | **Gbit/s per proxy core** | 8 streams Gbit/s "
        "| proxy cores | **Gbit/s per proxy core** | proof: proxy bytes / iperf bytes (a, b) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in paths:
        r1, r8 = s[p.name].get("tput_1") or {}, s[p.name].get("tput_8") or {}
        proof = (
            ", ".join(
                fmt(r1.get(f"proof_bytes_ratio_{k}"), ".3f") + "/" + fmt(r8.get(f"proof_bytes_ratio_{k}"), ".3f")
                for k in p.pids
            )
            if p.proxied
            else "-"
        )  # fmt: skip
        lines.append(
            f"| {p.name} | {fmt(r1.get('gbps'))} | {fmt(r1.get('proxy_cores'))} "
            f"| {fmt(r1.get('gbps_per_proxy_core'))} | {fmt(r8.get('gbps'))} "
            f"| {fmt(r8.get('proxy_cores'))} | {fmt(r8.get('gbps_per_proxy_core'))} | {proof} |"
        )
    lp = doc["params"]
    lines += [
        "",
        f"### Latency, 1 KiB request/response, {lp['rr_conns']} connections, {lp['rr_seconds']} s"
        f" (paced: median of {lp['rounds']} interleaved rounds)",
        "",
        "Paced: fixed schedule at 1000 rps (latency from each send; *lag* = how late sends left vs "
        "the schedule, *CO p99* counts from the scheduled time). Max: closed loop, "
        f"{lp['rr_max_conns']} connections. *gen ok* = sends on time and the generator below 0.9 "
        "core (it is not the bottleneck).",
        "",
        "| path | 1000 rps p50 / p90 / p99 ms | added p99 ms | CO p99 ms | lag p99 ms | proxy "
        "vCPU per 1000 rps (sum / busiest) | gen ok | max rps | max p50 / p90 / p99 ms "
        "| proxy cores at max | gen cores at max | new conn/s | proxy CPU µs/conn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    d99 = _get(s, "direct", "rr_paced", "p99_ms")
    for p in paths:
        a, m, c = (s[p.name].get(k) or {} for k in ("rr_paced", "rr_max", "crr"))
        added = a["p99_ms"] - d99 if a.get("p99_ms") is not None and d99 is not None else None
        ok = all(r.get("generator_ok") for r in p.res.get("rr_paced", []))
        okm = all(r.get("generator_ok") for r in p.res.get("rr_max", []))
        lines.append(
            f"| {p.name} | {fmt(a.get('p50_ms'), '.3f')} / {fmt(a.get('p90_ms'), '.3f')} / "
            f"{fmt(a.get('p99_ms'), '.3f')} | {fmt(added, '.3f')} | {fmt(a.get('co_p99_ms'), '.3f')} "
            f"| {fmt(a.get('lag_p99_ms'), '.3f')} | {fmt(a.get('vcpu_per_krps'), '.3f')} / "
            f"{fmt(a.get('vcpu_per_krps_max_side'), '.3f')} | {'yes' if ok else 'NO'} "
            f"| {fmt(m.get('rps'), '.0f')} | {fmt(m.get('p50_ms'), '.3f')} / "
            f"{fmt(m.get('p90_ms'), '.3f')} / {fmt(m.get('p99_ms'), '.3f')} "
            f"| {fmt(m.get('proxy_cores'))} | {fmt(m.get('client_cores'))}"
            f"{'' if okm else ' (client-bound)'} | {fmt(c.get('conn_per_s'), '.0f')} "
            f"| {fmt(c.get('proxy_cpu_us_per_conn'), '.0f')} |"
        )
    hs_rows = [(p.name, s[p.name]["handshakes"]) for p in paths if s[p.name].get("handshakes")]
    if hs_rows:
        st = _get(s, "stunnel-pair", "handshakes", "handshakes_per_server_core_s")
        lines += [
            "",
            f"### mTLS handshakes, {p_['hs_procs']} client processes, {p_['hs_seconds']} s",
            "",
            "Each connection: TCP connect, TLS 1.3 handshake with client certificates (no "
            "resumption), one byte echoed end to end, close; for ztunnel straight at ztunnel-b's "
            "inbound 15008 with an HBONE CONNECT (the client presents a workload certificate of "
            "the mesh CA), for the stunnel pair at its server side. Server CPU from /proc.",
            "",
            "| path (server side) | handshakes/s | server cores | server CPU µs per handshake "
            "| **handshakes per server core-second** | vs stunnel | client cores | proof: "
            "connections the server logged |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, h in hs_rows:
            per_core = h.get("handshakes_per_server_core_s")
            lines.append(
                f"| {name} | {fmt(h.get('handshakes_per_s'), '.0f')} "
                f"| {fmt(h.get('server_cores'))} "
                f"| {fmt(h.get('server_cpu_us_per_handshake'), '.0f')} | {fmt(per_core, '.0f')} "
                f"| {fmt(per_core / st if per_core and st else None)}x "
                f"| {fmt(h.get('client_cores'))} | {fmt(h.get('proof_conns_b'), '.0f')} "
                f"of {fmt(h.get('conns'), '.0f')} |"
            )
    idle = s.get("ztunnel-hbone", {}).get("idle")
    if idle:
        lines += [
            "",
            f"### Memory: {idle['opened']} idle connections through ztunnel HBONE "
            f"(opened in {idle['open_seconds']:.1f} s, {idle['errors']} errors; "
            f"{idle['app_side_established']} established at the app)",
            "",
            "| ztunnel | RSS at rest KiB | RSS with idle conns KiB | delta KiB | KiB per conn |",
            "|---|---|---|---|---|",
        ]
        for k in idle["rss_kib_at_rest"]:
            lines.append(
                f"| {k} | {idle['rss_kib_at_rest'][k]} | {idle['rss_kib_loaded'][k]} "
                f"| {idle['rss_delta_kib'][k]} | {fmt(idle['kib_per_conn_by_side'][k])} |"
            )
        lines.append(f"| **both** | | | | **{fmt(idle['kib_per_conn'])}** |")
        lines += [
            "",
            f"RSS right after start (before any load): {doc['params'].get('rss_kib_at_start')} "
            "KiB; 'at rest' is measured just before opening the idle connections. RSS is "
            "summed over each ztunnel's processes "
            f"({doc['params'].get('ztunnel_processes')} at start: the default worker count).",
        ]
    lines += [
        "",
        "Paths: `direct` c -> d; `ztunnel-tcp` a -> ztunnel-a -> d (plain); `ztunnel-hbone` a -> "
        "ztunnel-a -> mTLS 1.3 + HTTP/2 CONNECT -> ztunnel-b -> b; `haproxy-splice` g -> "
        "127.0.0.1 -> HAProxy TCP mode, splice, tune.pipesize 1048576, 1 thread -> d; "
        "`haproxy-inpod` the same HAProxy behind the in-pod REDIRECT of pod h, forwarding to the "
        "original destination: ztunnel-tcp's own path; `stunnel-pair` stunnel -> TLS 1.3 "
        f"({SUITE}, client certificates required) -> stunnel. *new conn/s*: connect / 1-byte "
        "request / reply / close, 4 client processes; for `stunnel-pair` each is a full mTLS "
        "handshake (so it is its handshakes/s), ztunnel-hbone reuses its pooled HBONE connection.",
        "",
    ]
    return "\n".join(lines)


def plots(doc: dict[str, Any], paths: list[Path_]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr
        )
        return []
    s = doc["summary"]
    names = [p.name for p in paths]
    out = []
    figs: list[tuple[str, str, list[tuple[str, str, str]]]] = [
        ("suite_throughput.png", "Gbit/s", [("tput_1", "gbps", "1 stream"), ("tput_8", "gbps", "8 streams")]),
        ("suite_per_core.png", "Gbit/s per proxy core",
         [("tput_1", "gbps_per_proxy_core", "1 stream"), ("tput_8", "gbps_per_proxy_core", "8 streams")]),
        ("suite_latency.png", "ms at 1000 rps",
         [("rr_paced", "p50_ms", "p50"), ("rr_paced", "p90_ms", "p90"), ("rr_paced", "p99_ms", "p99")]),
    ]  # fmt: skip
    for fname, ylabel, series in figs:
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.8 / len(series)
        for j, (test, key, label) in enumerate(series):
            vals = [_get(s, n, test, key) or 0 for n in names]
            ax.bar([i + j * w for i in range(len(names))], vals, w, label=label)
        ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(names))], names)
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.set_title(f"{ylabel} ({'quick' if doc['params']['quick'] else 'full'} suite)")
        fig.tight_layout()
        path = RESULTS / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(str(path.relative_to(ROOT)))
    return out


# ---------------------------------------------------------------------------------------------
# worker rows (issue 18): ztunnel with N=1 and N=2 workers beside HAProxy nbthread 1 and 2

T_SCALING_VS_HAPROXY = 0.9  # ztunnel's N=2/N=1 over HAProxy's: "the same scaling", within 10%
T_WORKER_EFFICIENCY = 0.9  # per proxy CPU-second, 2 workers over 1
T_PSS_ONE_WORKER_MIB = 35.0
T_PSS_PER_EXTRA_WORKER_MIB = 10.0
SCRAPE_SERIES = 40_000
# HAProxy mTLS pair e -> f per thread count: client-side iperf / echo ports, server-side TLS ports
HAP_TLS_PORTS = {1: (6011, 6111, 8451, 8452), 2: (6012, 6112, 8461, 8462)}
# (row, its 1-worker / 1-thread path, its 2-worker / 2-thread path)
WORKER_PAIRS = [
    ("ztunnel-tcp", "ztunnel-tcp/w1", "ztunnel-tcp/w2"),
    ("haproxy-inpod", "haproxy-inpod/t1", "haproxy-inpod/t2"),
    ("ztunnel-hbone", "ztunnel-hbone/w1", "ztunnel-hbone/w2"),
    ("haproxy-tls", "haproxy-tls/t1", "haproxy-tls/t2"),
]
PEER_OF = {"ztunnel-tcp": "haproxy-inpod", "ztunnel-hbone": "haproxy-tls"}
WORKER_TESTS = [
    ("tput_1", "gbps", "gbps_per_proxy_core", "Gbit/s, 1 stream"),
    ("tput_8", "gbps", "gbps_per_proxy_core", "Gbit/s, 8 streams"),
    ("crr", "conn_per_s", "conn_per_proxy_core_s", "new connections/s"),
]


def worker_paths(
    bed: dict[str, Any], tmp: str, ca: str, leaf: str, pods: dict[str, Any], hap_h: Any
) -> list[Path_]:
    """The worker rows' paths, on the suite's bed plus: the ztunnel pairs a-wN -> b-wN
    (``WORKER_VARIANTS``), pod ``h2`` (HAProxy ``nbthread 2`` behind in-pod rules, as ``h`` with 1
    thread) and HAProxy mTLS pairs e -> f with 1 and 2 threads (the C peer of HBONE)."""
    tb, zts = bed["bed"], bed["zts"]
    pods = {**bed["pods"], **pods}
    d, e, f = pods["d"], pods["e"], pods["f"]
    hap_h, hap_h_log = hap_h
    h2 = tb.host("n1").add_pod("h2", ambient=False)
    h2.install_inpod_rules()
    h2.sysctl("net.ipv4.tcp_tw_reuse", 1)
    h2.sysctl("net.ipv4.ip_local_port_range", "1024 65000")
    h2.run(
        "iptables", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-p", "tcp",
        "-m", "owner", "--uid-owner", str(HAP_INPOD_UID), "-j", "ACCEPT",
    )  # fmt: skip
    cfg = Path(tmp, "hap_h2.cfg")
    cfg.write_text(
        haproxy_splice_cfg(
            [(HAP_INPOD_PORT, "0.0.0.0")], bind="0.0.0.0", uid=HAP_INPOD_UID, nbthread=2
        )
    )
    hap2 = h2.popen(bh.HAPROXY, "-db", "-f", str(cfg), stdout=subprocess.PIPE)
    hap2_log = LineLog(hap2.popen.stdout)
    tls: dict[int, tuple[Any, Any, LineLog, LineLog]] = {}
    for n, (p_ip, p_echo, t_ip, t_echo) in HAP_TLS_PORTS.items():
        cs, cc = Path(tmp, f"hap_tls_f{n}.cfg"), Path(tmp, f"hap_tls_e{n}.cfg")
        cs.write_text(
            haproxy_tls_cfg(
                [(f"0.0.0.0:{t_ip}", f"127.0.0.1:{IPERF_PORT}"),
                 (f"0.0.0.0:{t_echo}", f"127.0.0.1:{ECHO_PORT}")],
                ca, leaf, tls_in=True, nbthread=n,
            )
        )  # fmt: skip
        cc.write_text(
            haproxy_tls_cfg(
                [(f"127.0.0.1:{p_ip}", f"{f.ip4}:{t_ip}"),
                 (f"127.0.0.1:{p_echo}", f"{f.ip4}:{t_echo}")],
                ca, leaf, tls_in=False, nbthread=n,
            )
        )  # fmt: skip
        sf = f.popen(bh.HAPROXY, "-db", "-f", str(cs), stdout=subprocess.PIPE)
        se = e.popen(bh.HAPROXY, "-db", "-f", str(cc), stdout=subprocess.PIPE)
        tls[n] = (se, sf, LineLog(se.popen.stdout), LineLog(sf.popen.stdout))
        for proc, port in ((sf, t_echo), (se, p_echo)):
            up = functools.partial(bh.listening_in, proc.pid, port)
            bh.wait_until(up, 10, f"haproxy tls {n} thread(s) :{port}")
    bh.wait_until(lambda: bh.listening_in(hap2.pid, HAP_INPOD_PORT), 10, "haproxy in h2")
    out: list[Path_] = []
    for n in (1, 2):
        za, zb, b = zts[f"a-w{n}"], zts[f"b-w{n}"], pods[f"b-w{n}"]
        out.append(
            Path_(
                f"ztunnel-tcp/w{n}", "ztunnel", pods[f"a-w{n}"], (d.ip4, IPERF_PORT),
                (d.ip4, ECHO_PORT), pids={"a": za.pid}, zta=za,
            )
        )  # fmt: skip
    out.append(
        Path_(
            "haproxy-inpod/t1", "haproxy", pods["h"], (d.ip4, IPERF_PORT), (d.ip4, ECHO_PORT),
            pids={"a": hap_h.pid}, logs={"a": hap_h_log},
        )
    )  # fmt: skip
    out.append(
        Path_(
            "haproxy-inpod/t2", "haproxy", h2, (d.ip4, IPERF_PORT), (d.ip4, ECHO_PORT),
            pids={"a": hap2.pid}, logs={"a": hap2_log},
        )
    )  # fmt: skip
    for n in (1, 2):
        za, zb, b = zts[f"a-w{n}"], zts[f"b-w{n}"], pods[f"b-w{n}"]
        out.append(
            Path_(
                f"ztunnel-hbone/w{n}", "ztunnel", pods[f"a-w{n}"], (b.ip4, IPERF_PORT),
                (b.ip4, ECHO_PORT), pids={"a": za.pid, "b": zb.pid}, zta=za, ztb=zb,
                hs=(pods["c"], (b.ip4, 15008),
                    ["--ca-dir", bed["ca_dir"], "--authority", f"{b.ip4}:{ECHO_PORT}"]),
            )
        )  # fmt: skip
    lo = "127.0.0.1"
    for n, (p_ip, p_echo, _, _) in HAP_TLS_PORTS.items():
        se, sf, le, lf = tls[n]
        out.append(
            Path_(
                f"haproxy-tls/t{n}", "haproxy", e, (lo, p_ip), (lo, p_echo),
                pids={"a": se.pid, "b": sf.pid}, logs={"a": le, "b": lf},
            )
        )  # fmt: skip
    return out


def measured(p: Path_, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()`` plus how the CPU of each proxy's process tree split between its processes
    (``cpu_share_a``: the root process (a ztunnel's supervisor) first, then the others, largest
    first: a supervisor, two busy workers and an idle zygote show as ``[0.02, 0.5, 0.48, 0.0]``),
    the number of processes and the box's busy cores."""
    before = {k: tree_cpu_by_pid(pid) for k, pid in p.pids.items()}
    busy0, tot0 = bh.box_busy()
    r = run()
    busy1, tot1 = bh.box_busy()
    for k, pid in p.pids.items():
        after = tree_cpu_by_pid(pid)
        used = {x: after[x] - before[k].get(x, 0.0) for x in after}
        total = sum(used.values())
        r[f"processes_{k}"] = len(after)
        rest = sorted((u / total for x, u in used.items() if x != pid), reverse=True)
        r[f"cpu_share_{k}"] = [used.get(pid, 0.0) / total, *rest] if total else []
    r.setdefault("box_busy_cores", (busy1 - busy0) / (tot1 - tot0) * (os.cpu_count() or 1))
    if r.get("proxy_cpu_us_per_conn"):
        r["conn_per_proxy_core_s"] = 1e6 / r["proxy_cpu_us_per_conn"]
    return r


def standalone_memory(loop: str) -> dict[str, Any]:
    """PSS of one ztunnel alone on a node of its own bed (dedicated mode, one pod, local config
    and CA), with 1 worker and then 2, 3 s after it is ready: the per-node figure of the issue's
    targets. In the suite's bed the ztunnels share their file pages with each other, which
    lowers each one's PSS. Also each process of the tree, root first."""
    from ztunnel.testing.netns import Testbed
    from ztunnel.testing.proc import ZtunnelProcess

    out: dict[str, Any] = {}
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        pod = tb.add_node("n1").add_pod("a")
        pod.install_inpod_rules()
        os.mkdir(os.path.join(tmp, "ca"))
        for n in (1, 2):
            env = {
                "PROXY_MODE": "dedicated",
                "LOCAL_XDS": bh.mesh_config({"a": pod}),
                "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
                "RUST_LOG": "info",
                "PROXY_WORKLOAD_INFO": "default/a/sa-a",
                "NODE_NAME": "n1",
                "ZTUNNEL_WORKER_THREADS": str(n),
            }
            zt = ZtunnelProcess(pod, env, loop=loop).start()
            try:
                time.sleep(3.0)
                out[f"w{n}"] = tree_memory_kib(zt.pid)
                out[f"w{n}_by_process"] = [process_memory_kib(x) for x in proc_tree(zt.pid)]
            finally:
                zt.stop()
    return out


def _by_process(procs: list[dict[str, int]]) -> str:
    """ "supervisor 26.2 + zygote 12.4 + workers 13.4/13.4" (MiB PSS) from process_memory_kib
    rows, root first: a process that is the parent of another is where workers are forked."""
    if len(procs) <= 1:
        return f"one process {procs[0]['pss'] / 1024:.1f}" if procs else "-"
    parents = {p["ppid"] for p in procs[1:]}
    forkers = [p for p in procs[1:] if p["pid"] in parents]
    workers = [p for p in procs[1:] if p["pid"] not in parents]
    out = f"supervisor {procs[0]['pss'] / 1024:.1f}"
    if forkers:
        out += " + zygote " + "/".join(f"{p['pss'] / 1024:.1f}" for p in forkers)
    return out + " + workers " + "/".join(f"{p['pss'] / 1024:.1f}" for p in workers)


def worker_memory(wpaths: list[Path_]) -> dict[str, Any]:
    """PSS / RSS / private KiB of each worker-row ztunnel at rest, summed over its process tree."""
    out: dict[str, Any] = {}
    for p in wpaths:
        if p.name.startswith("ztunnel-hbone/"):  # a-wN and b-wN (the tcp path's a-wN is the same)
            n = p.name.rsplit("/w", 1)[1]
            for side, zt in (("a", p.zta), ("b", p.ztb)):
                out[f"w{n}_{side}"] = tree_memory_kib(zt.pid)
    return out


def run_scrape(p: Path_, sets: int, scrapes: int) -> dict[str, Any]:
    """``sets`` distinct traffic label sets at ``p``'s inbound ztunnel (``series``: HBONE CONNECTs
    with a distinct source workload in their baggage, 4 series each), then GET
    /stats/prometheus on its 15020 ``scrapes`` times, plain and gzip: the scrape's time
    (curl's time_total, from inside the pod) and the ztunnel tree's CPU during it."""
    assert p.hs is not None and p.ztb is not None
    client, (ip, port), extra = p.hs
    zt, pod = p.ztb, p.ztb.host
    cpu0 = tree_cpu_seconds(zt.pid)
    gen = client.run(
        sys.executable, __file__, "series", "--ip", ip, "--port", str(port), "--n", str(sets),
        *extra, timeout=900,
    )  # fmt: skip
    made: dict[str, Any] = json.loads(gen.stdout)
    out: dict[str, Any] = {
        "sets_requested": sets,
        "streams_ok": made["ok"],
        "stream_errors": made["errors"],
        "generate_seconds": made["seconds"],
        "ztunnel_cpu_s_generating": tree_cpu_seconds(zt.pid) - cpu0,
    }
    url = "http://127.0.0.1:15020/stats/prometheus"
    body = ""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every stream's close counted (closed_total) before timing
        body = pod.run("curl", "-sS", url, timeout=60).stdout
        opened = closed = 0.0
        series = ours = 0
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            series += 1
            if 'source_workload="wl-' in line:
                ours += 1
                if line.startswith("istio_tcp_connections_opened_total{"):
                    opened += float(line.rsplit(" ", 1)[1])
                elif line.startswith("istio_tcp_connections_closed_total{"):
                    closed += float(line.rsplit(" ", 1)[1])
        if closed >= made["ok"]:
            break
        time.sleep(0.5)
    out |= {
        "series": series,
        "series_from_generator": ours,
        "opened_total_from_generator": opened,
        "closed_total_from_generator": closed,
        "bytes": len(body.encode()),
        "processes": len(proc_tree(zt.pid)),
    }
    # gzip as Prometheus asks for it (curl --compressed would offer zstd too, which ztunnel
    # then prefers, as Rust's tower-http does).
    for mode, flags in (("plain", []), ("gzip", ["-H", "Accept-Encoding: gzip"])):
        times: list[float] = []
        cpus: list[float] = []
        size = 0
        for _ in range(scrapes):
            c0 = tree_run_ns(zt.pid)
            r = pod.run(
                "curl", "-sS", *flags, "-o", "/dev/null", "-w", "%{time_total} %{size_download}",
                url, timeout=60,
            )  # fmt: skip
            cpus.append((tree_run_ns(zt.pid) - c0) / 1e9)
            t, n = r.stdout.split()
            times.append(float(t))
            size = int(n)
        out[f"{mode}_ms"] = statistics.median(times) * 1e3
        out[f"{mode}_ms_max"] = max(times) * 1e3
        out[f"{mode}_cpu_ms"] = statistics.median(cpus) * 1e3
        out[f"{mode}_bytes"] = size
    return out


def run_workers(
    wpaths: list[Path_],
    wp: dict[str, Any],
    record: Callable[[Path_, str, dict[str, Any]], None],
    alone: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The worker rows: PSS at rest, then rounds (order flipped each round) of iperf3 1 and 8
    streams and new connections/s on every path, then the scrape at many series on N=1 and N=2."""
    started = time.monotonic()
    time.sleep(2.0)
    memory = worker_memory(wpaths)
    print(f"  workers memory at rest: {memory}", file=sys.stderr)
    for p in wpaths:  # warm-up: HBONE pools of every worker, caches
        run_crr(p, 0.5, wp["crr_procs"])
        run_iperf(p, 1, 2)
    for rnd in range(wp["rounds"]):
        order = wpaths if rnd % 2 == 0 else wpaths[::-1]
        for streams in (1, 8):
            for p in order:
                run = functools.partial(run_iperf, p, wp["iperf_seconds"], streams)
                record(p, f"tput_{streams}", _retry_hung(p, functools.partial(measured, p, run)))
        for p in order:
            r = measured(p, functools.partial(run_crr, p, wp["crr_seconds"], wp["crr_procs"]))
            record(p, "crr", r)
    scrape: dict[str, Any] = {}
    if wp["series_sets"] > 0:
        for p in wpaths:
            if p.name.startswith("ztunnel-hbone/"):
                n = p.name.rsplit("/", 1)[1]
                scrape[n] = run_scrape(p, wp["series_sets"], wp["scrapes"])
                print(f"  scrape {n}: {scrape[n]}", file=sys.stderr)
    summary = summarize(wpaths)
    return {
        "params": wp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "memory_kib_at_rest": memory,
        "memory_kib_alone": alone or {},
        "scrape": scrape,
        "summary": summary,
        "ratios": worker_ratios(summary),
        "targets": worker_targets(summary, memory, alone or {}),
        "runs": {p.name: p.res for p in wpaths},
    }


def _retry_hung(p: Path_, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, once more if its client hung (iperf3 with 8 streams through the HAProxy mTLS
    pair with one thread hung past its timeout in two full runs of 2026-12-01 and two of
    2026-12-04, which lost the whole workers part); the row says it was retried. (A server
    still busy with the hung test fails the retry otherwise, and the part is lost as before.)"""
    try:
        return run()
    except subprocess.TimeoutExpired as e:
        print(f"  {p.name}: {e.cmd[-6:]} hung; once more", file=sys.stderr)
        time.sleep(2.0)
        return run() | {"retried_after_hang": 1}


def worker_ratios(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row and test: the medians with 1 and 2 workers / threads, their scaling (2 over 1),
    the per-core efficiency (per proxy CPU-second, 2 over 1) and the box's busy cores."""
    out = []
    for test, key, eff, _ in WORKER_TESTS:
        for row, one, two in WORKER_PAIRS:
            v1, v2 = _get(s, one, test, key), _get(s, two, test, key)
            e1, e2 = _get(s, one, test, eff), _get(s, two, test, eff)
            out.append(
                {
                    "row": row,
                    "test": test,
                    "one": v1,
                    "two": v2,
                    "scaling": v2 / v1 if v1 and v2 else None,
                    "per_core_one": e1,
                    "per_core_two": e2,
                    "efficiency": e2 / e1 if e1 and e2 else None,
                    "proxy_cores_one": _get(s, one, test, "proxy_cores"),
                    "proxy_cores_two": _get(s, two, test, "proxy_cores"),
                    "box_busy_one": _get(s, one, test, "box_busy_cores"),
                    "box_busy_two": _get(s, two, test, "box_busy_cores"),
                }
            )
    return out


def worker_targets(
    s: dict[str, Any], memory: dict[str, Any], alone: dict[str, Any]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ratios = {(r["row"], r["test"]): r for r in worker_ratios(s)}
    for test, _, _, label in WORKER_TESTS:
        for zt, peer in PEER_OF.items():
            a, b = ratios[(zt, test)]["scaling"], ratios[(peer, test)]["scaling"]
            v = a / b if a and b else None
            out.append(
                {
                    "target": f"{zt} {label}: scaling 2 workers / 1 over {peer}'s 2 threads / 1 "
                    f"({fmt(a)}x vs {fmt(b)}x)",
                    "want": f">= {T_SCALING_VS_HAPROXY:.2f}x",
                    "value": v,
                    "shown": f"{fmt(v)}x",
                    "met": None if v is None else v >= T_SCALING_VS_HAPROXY,
                }
            )
    for test, _, _, label in WORKER_TESTS:
        for zt in PEER_OF:
            v = ratios[(zt, test)]["efficiency"]
            out.append(
                {
                    "target": f"{zt} {label}: per proxy core-second, 2 workers / 1",
                    "want": f">= {T_WORKER_EFFICIENCY:.2f}x",
                    "value": v,
                    "shown": f"{fmt(v)}x",
                    "met": None if v is None else v >= T_WORKER_EFFICIENCY,
                }
            )
    mib = {k: v["pss"] / 1024 for k, v in memory.items()}
    one = [mib.get("w1_a"), mib.get("w1_b")]
    extra = [
        mib[f"w2_{x}"] - mib[f"w1_{x}"] if f"w2_{x}" in mib and f"w1_{x}" in mib else None
        for x in ("a", "b")
    ]
    rows: list[tuple[str, list[float | None], float]] = []
    if "w1" in alone and "w2" in alone:  # the per-node figures: a ztunnel alone on its node
        a1, a2 = alone["w1"]["pss"] / 1024, alone["w2"]["pss"] / 1024
        rows += [
            ("PSS at rest, 1 worker, a ztunnel alone on its node", [a1], T_PSS_ONE_WORKER_MIB),
            ("PSS at rest, each extra worker, alone on its node (2 workers minus 1)", [a2 - a1],
             T_PSS_PER_EXTRA_WORKER_MIB),
        ]  # fmt: skip
    rows += [
        ("PSS at rest, 1 worker, in the suite's bed (ztunnel a / b; pages shared with the bed's "
         "other ztunnels)", one, T_PSS_ONE_WORKER_MIB),
        ("PSS at rest, each extra worker, in the bed (2 workers minus 1; a / b)", extra,
         T_PSS_PER_EXTRA_WORKER_MIB),
    ]  # fmt: skip
    for what, vals, want in rows:
        known = [v for v in vals if v is not None]
        out.append(
            {
                "target": what,
                "want": f"<= {want:.0f} MiB",
                "value": max(known) if known else None,
                "shown": " / ".join(f"{fmt(v, '.1f')}" for v in vals) + " MiB",
                "met": max(known) <= want if known else None,
            }
        )
    return out


def workers_markdown(wdoc: dict[str, Any]) -> str:
    s, wp = wdoc["summary"], wdoc["params"]
    lines = [
        f"## Worker rows ({'quick' if wp['quick'] else 'full'}), {wdoc['when']}",
        "",
        f"`{wdoc['command']}`, commit `{(wdoc['env'].get('git_head') or '?')[:12]}`"
        f"{' (uncommitted changes)' if wdoc['env'].get('git_dirty') else ''}. ztunnel pairs "
        "a-wN -> b-wN with `ZTUNNEL_WORKER_THREADS=N`; HAProxy with `nbthread N` on the same "
        f"paths. iperf3 -t {wp['iperf_seconds']}, CRR {wp['crr_seconds']} s x "
        f"{wp['crr_procs']} client processes, {wp['rounds']} interleaved rounds (order flipped "
        "each round), medians. Proxy CPU summed over each proxy's process tree (supervisor + "
        "workers).",
        "",
        "### Targets",
        "",
        "| target | want | this run | verdict |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t['target']} | {t['want']} | {t['shown']} | {verdict(t['met'])} |"
        for t in wdoc["targets"]
    ]
    lines += [
        "",
        "### Scaling, 1 -> 2 workers / threads",
        "",
        "| row | test | 1 | 2 | scaling | per proxy core-s, 1 / 2 | efficiency | proxy cores "
        "1 / 2 | box busy cores 1 / 2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in wdoc["ratios"]:
        lines.append(
            f"| {r['row']} | {r['test']} | {fmt(r['one'])} | {fmt(r['two'])} "
            f"| {fmt(r['scaling'])}x | {fmt(r['per_core_one'])} / {fmt(r['per_core_two'])} "
            f"| {fmt(r['efficiency'])}x | {fmt(r['proxy_cores_one'])} / "
            f"{fmt(r['proxy_cores_two'])} | {fmt(r['box_busy_one'])} / {fmt(r['box_busy_two'])} |"
        )
    lines += [
        "",
        "### Every path (medians) and where the CPU went",
        "",
        "| path | 1 stream Gbit/s | per core | 8 streams Gbit/s | per core | conn/s | µs/conn "
        "| processes | CPU share: root process + others (last round) | proof bytes 1/8 | "
        "proof conns (CRR) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in s.items():
        t1, t8, c = (row.get(k) or {} for k in ("tput_1", "tput_8", "crr"))
        split = []
        for test in ("tput_8", "crr"):
            last = (wdoc["runs"].get(name, {}).get(test) or [{}])[-1]
            split.append(f"{test}: " + "; ".join(
                f"{k[-1]} " + (f"{v[0]:.2f} + " + "/".join(f"{x:.2f}" for x in v[1:]) if len(v) > 1
                                else "1.00")
                for k, v in last.items()
                if k.startswith("cpu_share_") and v
            ))  # fmt: skip
        shares = "<br>".join(split)
        procs = "/".join(f"{fmt(t8.get(f'processes_{k}'), '.0f')}" for k in ("a", "b") if
                         t8.get(f"processes_{k}") is not None)  # fmt: skip
        proof = "/".join(
            f"{fmt(t1.get(f'proof_bytes_ratio_{k}'), '.3f')},{fmt(t8.get(f'proof_bytes_ratio_{k}'), '.3f')}"
            for k in ("a", "b")
            if t1.get(f"proof_bytes_ratio_{k}") is not None
        )  # fmt: skip
        pconn = "/".join(
            fmt(c.get(f"proof_conns_{k}"), ".0f")
            for k in ("a", "b")
            if c.get(f"proof_conns_{k}") is not None
        )
        lines.append(
            f"| {name} | {fmt(t1.get('gbps'))} | {fmt(t1.get('gbps_per_proxy_core'))} "
            f"| {fmt(t8.get('gbps'))} | {fmt(t8.get('gbps_per_proxy_core'))} "
            f"| {fmt(c.get('conn_per_s'), '.0f')} | {fmt(c.get('proxy_cpu_us_per_conn'), '.0f')} "
            f"| {procs} | {shares} | {proof} | {pconn} of {fmt(c.get('conns'), '.0f')} |"
        )
    lines += [
        "",
        "### Memory at rest (KiB, summed over each ztunnel's process tree)",
        "",
        "| ztunnel | processes | PSS | private (USS) | RSS |",
        "|---|---|---|---|---|",
    ]
    for k, m in wdoc["memory_kib_at_rest"].items():
        lines.append(f"| {k} | {m['processes']} | {m['pss']} | {m['private']} | {m['rss']} |")
    alone = wdoc.get("memory_kib_alone") or {}
    for wn in ("w1", "w2"):
        if m := alone.get(wn):
            lines.append(
                f"| {wn}, alone on its node | {m['processes']} | {m['pss']} | {m['private']} "
                f"| {m['rss']} |"
            )
    for wn in ("w1", "w2"):
        if tree := alone.get(f"{wn}_by_process"):
            lines += ["", f"{wn} alone, PSS MiB by process: {_by_process(tree)}."]
    if wdoc["scrape"]:
        lines += [
            "",
            "### Metrics scrape (GET /stats/prometheus on 15020, inbound ztunnel b-wN)",
            "",
            "| ztunnel | processes | series (from generator) | opened / closed total of the "
            "generator's sets | plain ms (max) | plain ztunnel CPU ms | gzip ms | gzip CPU ms "
            "| bytes plain / gzip |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, r in wdoc["scrape"].items():
            lines.append(
                f"| {n} | {r['processes']} | {r['series']} ({r['series_from_generator']}) "
                f"| {r['opened_total_from_generator']:.0f} / {r['closed_total_from_generator']:.0f}"
                f" of {r['streams_ok']} streams ok | {fmt(r['plain_ms'], '.1f')} "
                f"({fmt(r['plain_ms_max'], '.1f')}) | {fmt(r['plain_cpu_ms'], '.1f')} "
                f"| {fmt(r['gzip_ms'], '.1f')} | {fmt(r['gzip_cpu_ms'], '.1f')} "
                f"| {r['plain_bytes']} / {r['gzip_bytes']} |"
            )
    lines += [
        "",
        "Paths: `ztunnel-tcp/wN` a-wN -> REDIRECT -> ztunnel-a-wN -> d; `haproxy-inpod/tN` the "
        "suite's in-pod HAProxy (pod h: 1 thread, pod h2: 2 threads) on the same path; "
        "`ztunnel-hbone/wN` a-wN -> ztunnel -> mTLS + HTTP/2 CONNECT -> ztunnel -> b-wN (new "
        "connections reuse the pooled HBONE connection of each worker); `haproxy-tls/tN` "
        f"e -> HAProxy -> TLS 1.3 ({SUITE}, both certificates verified) -> HAProxy -> f, a TLS "
        "connection per client connection (HAProxy resumes TLS sessions towards the server).",
        "",
    ]
    return "\n".join(lines)


def _baggage(i: int) -> str:
    return f"k8s.deployment.name=wl-{i},k8s.namespace.name=bench,service.name=wl-{i},service.version=v1"


def run_series(args: argparse.Namespace) -> None:
    """``--n`` HBONE CONNECT streams to ``--authority`` over ``--conns`` mTLS connections (one
    after the other, ``--inflight`` streams at a time), each with a distinct source workload in
    its baggage and one byte echoed, then closed: every stream is a new label set in the
    inbound ztunnel's traffic metrics. Prints one JSON line."""
    from ztunnel.core.identity import Identity
    from ztunnel.hbone import h2conn as h2
    from ztunnel.identity.localca import LocalCA
    from ztunnel.identity.tls import client_context

    ca = LocalCA.load_or_create(Path(args.ca_dir))
    ctx = client_context(ca.issue(Identity(ca.trust_domain, "default", "sa-bench-series")))
    ok = errors = 0
    t0 = time.monotonic()
    per = -(-args.n // args.conns)
    for c in range(args.conns):
        todo = list(range(c * per, min(args.n, (c + 1) * per)))[::-1]
        opened: dict[int, int] = {}
        with socket.create_connection((args.ip, args.port), timeout=30) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with ctx.wrap_socket(raw, server_hostname=None) as s:
                conn = h2.H2Connection(client=True)
                while todo or opened:
                    while todo and len(opened) < args.inflight and conn.available_streams > 0:
                        i = todo.pop()
                        headers = [("baggage", _baggage(i)), ("traceparent", _TRACEPARENT)]
                        opened[conn.open_stream(args.authority, headers)] = i
                    if out := conn.data_to_send_bytes():
                        s.sendall(out)
                    data = s.recv(65536)
                    if not data:
                        break
                    for ev in conn.receive_data(data):
                        if isinstance(ev, h2.ResponseReceived):
                            if ev.status == 200:
                                conn.send_data(ev.stream_id, b"x", end_stream=True)
                            else:
                                errors += 1
                                opened.pop(ev.stream_id, None)
                        elif isinstance(ev, h2.DataReceived):
                            conn.acknowledge_received_data(ev.stream_id, ev.flow_controlled_length)
                        elif isinstance(ev, h2.StreamEnded) and ev.stream_id in opened:
                            ok += 1
                            del opened[ev.stream_id]
                        elif isinstance(ev, h2.StreamReset) and ev.stream_id in opened:
                            errors += 1
                            del opened[ev.stream_id]
                        elif isinstance(ev, h2.ConnectionTerminated):
                            errors += len(todo)
                            todo.clear()
                    if out := conn.data_to_send_bytes():
                        s.sendall(out)
        errors += len(opened) + len(todo)
    res = {"ok": ok, "errors": errors, "seconds": time.monotonic() - t0}
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------
# driver


def drive(args: argparse.Namespace) -> None:
    quick = args.quick
    seconds = args.seconds or (3 if quick else 10)
    rounds = args.rounds or (2 if quick else 3)
    rr_seconds = 4.0 if quick else 10.0
    params = {
        "quick": quick,
        "iperf_seconds": seconds,
        "rounds": rounds,
        "rr_seconds": rr_seconds,
        "rr_rate": 1000,
        "rr_conns": 4,
        "rr_max_conns": 16,
        "crr_seconds": 2.0 if quick else 4.0,
        "crr_procs": 4,
        "hs_seconds": 3.0 if quick else 6.0,
        "hs_procs": 2,
        "idle_conns": args.idle_conns,
    }
    wp = {  # the worker rows (issue 18): short, the 2 cores are shared
        "quick": quick,
        "iperf_seconds": args.seconds or (3 if quick else 5),
        "rounds": args.rounds or (2 if quick else 3),
        "crr_seconds": 2.0 if quick else 3.0,
        "crr_procs": 4,
        "series_sets": SCRAPE_SERIES // 4 if args.series_sets is None else args.series_sets,
        "scrapes": 3 if quick else 5,
    }  # fmt: skip
    # 10k idle connections: client, both ztunnels and the echo server need the descriptors
    want = max(args.idle_conns * 2 + 1000, 65536)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    started = time.monotonic()
    alone = None
    if args.only in (None, "workers"):  # before the suite's bed: nothing else of ours runs
        alone = standalone_memory(args.loop)
        print(f"  memory of a ztunnel alone on its node: {alone}", file=sys.stderr)
    with suite_bed(args.loop, workers=args.only in (None, "workers")) as (paths, wpaths):
        print(f"testbed up in {time.monotonic() - started:.1f}s", file=sys.stderr)
        hb = next(p for p in paths if p.name == "ztunnel-hbone")
        time.sleep(1.0)
        params["rss_kib_at_start"] = {k: rss_kib(pid) for k, pid in hb.pids.items()}
        # the main rows' ztunnels run the default worker count: how many processes that is
        params["ztunnel_processes"] = {k: len(proc_tree(pid)) for k, pid in hb.pids.items()}
        for p in paths if args.only != "workers" else []:  # warm-up: HBONE pool, caches
            run_crr(p, 0.3, 1)
            run_iperf(p, 1, 1)

        def record(p: Path_, key: str, r: dict[str, Any]) -> None:
            p.res.setdefault(key, []).append(r)
            brief = " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            )
            print(f"  {p.name} {key}: {brief}", file=sys.stderr)

        if args.only in (None, "tput"):
            for _ in range(rounds):
                for streams in (1, 8):
                    for p in paths:
                        record(p, f"tput_{streams}", run_iperf(p, seconds, streams))
        if args.only in (None, "rr"):
            for _ in range(rounds):  # p99 of one short run is noisy here: median of rounds
                for p in paths:
                    record(p, "rr_paced", run_rr_load(p, 1000, params["rr_conns"], rr_seconds))
            for p in paths:
                record(p, "rr_max", run_rr_load(p, 0, params["rr_max_conns"], rr_seconds / 2))
            for p in paths:
                record(p, "crr", run_crr(p, params["crr_seconds"], params["crr_procs"]))
        if args.only in (None, "hs"):
            for p in paths:
                if p.hs is not None:
                    hs = run_handshakes(p, params["hs_seconds"], params["hs_procs"])
                    record(p, "handshakes", hs)
        if args.only in (None, "idle") and args.idle_conns > 0:
            server = hb.ztb.host
            r = run_idle_memory(hb, server, args.idle_conns)
            hb.res["idle"] = [r]
            print(f"  idle: {r}", file=sys.stderr)
        wres = None
        if wpaths:
            try:
                wres = run_workers(wpaths, wp, record, alone)
            except Exception as e:  # a stuck peer must not lose the main rows measured above
                if args.only == "workers":
                    raise
                print(f"  workers part failed, its results not written: {e!r}", file=sys.stderr)
        summary = summarize(paths)
    doc: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/suite.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(time.monotonic() - started, 1),
        "env": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpu_model": bh._cpu_model(),
            "python": platform.python_version(),
            "iperf3": bh.tool_version(["iperf3", "--version"]),
            "haproxy": bh.tool_version([bh.HAPROXY, "-v"]),
            "stunnel": bh.tool_version(["stunnel", "-version"]),
            "git_head": bh._git("rev-parse", "HEAD"),
            # uncommitted changes to what runs (documentation edits do not count)
            "git_dirty": bool(bh._git("status", "--porcelain", "-uno", "--", *CODE_PATHS)),
            "load_avg_at_end": os.getloadavg(),
        },
        "params": params,
        "summary": summary,
        "runs": {p.name: p.res for p in paths},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    if wres is not None:  # the worker rows have a file of their own (report.py reads both)
        wdoc = {k: doc[k] for k in ("command", "when", "env")} | wres
        wdoc["markdown"] = workers_markdown(wdoc)
        (RESULTS / "suite_workers.json").write_text(json.dumps(wdoc, indent=2, default=str) + "\n")
        (RESULTS / "suite_workers.md").write_text(wdoc["markdown"])
        print(wdoc["markdown"])
        print(f"wrote benchmarks/results/suite_workers.json and .md ({wres['elapsed_s']:.0f} s)")
        if args.only == "workers":
            return
    doc["targets"] = targets(summary)
    md = markdown(doc, paths)
    if not args.no_plots:
        doc["plots"] = plots(doc, paths)
        if doc["plots"]:
            md += "\n" + "\n".join(f"![{Path(x).stem}]({Path(x).name})" for x in doc["plots"])
            md += "\n"
    doc["markdown"] = md
    (RESULTS / "suite.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (RESULTS / "suite.md").write_text(md)
    print(md)
    print(f"wrote benchmarks/results/suite.json and suite.md ({doc['elapsed_s']:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    ap.add_argument("--quick", action="store_true", help="short runs (the `make bench` suite)")
    ap.add_argument("--rounds", type=int, help="interleaved throughput rounds (2 quick / 3)")
    ap.add_argument("--seconds", type=int, help="iperf3 -t (3 quick / 10)")
    ap.add_argument("--idle-conns", type=int, default=10_000, help="0 to skip")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument(
        "--only",
        choices=["tput", "rr", "hs", "idle", "workers"],
        help="one part (development; workers writes only results/suite_workers.*)",
    )
    ap.add_argument(
        "--series-sets", type=int, help="workers: label sets for the scrape (10000: 40k series)"
    )
    ap.add_argument("--no-plots", action="store_true")
    r = sub.add_parser("rr")
    r.add_argument("--ip", required=True)
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--rate", type=float, default=1000.0, help="0 = closed loop (max rate)")
    r.add_argument("--conns", type=int, default=4)
    r.add_argument("--seconds", type=float, default=5.0)
    r.add_argument("--size", type=int, default=1024)
    h = sub.add_parser("hs")
    h.add_argument("--ip", required=True)
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--seconds", type=float, default=3.0)
    h.add_argument("--procs", type=int, default=2)
    h.add_argument("--ca-dir", help="HBONE: the shared local CA directory of the test bed")
    h.add_argument("--authority", help="HBONE: CONNECT to this host:port")
    h.add_argument("--ca", help="plain TLS: CA file")
    h.add_argument("--leaf", help="plain TLS: client certificate + key PEM")
    se = sub.add_parser("series")
    se.add_argument("--ip", required=True)
    se.add_argument("--port", type=int, required=True)
    se.add_argument("--n", type=int, default=10_000)
    se.add_argument("--conns", type=int, default=8)
    se.add_argument("--inflight", type=int, default=32)
    se.add_argument("--ca-dir", required=True)
    se.add_argument("--authority", required=True)
    i = sub.add_parser("idle")
    i.add_argument("--ip", required=True)
    i.add_argument("--port", type=int, required=True)
    i.add_argument("--n", type=int, default=10_000)
    i.add_argument("--ports", type=int, default=1, help="spread over --port .. --port + N - 1")
    i.add_argument("--inflight", type=int, default=256, help="connections opening at a time")
    i.add_argument("--src", help="source IP of the connections (default: the route's)")
    args = ap.parse_args()
    if args.cmd == "rr":
        run_rr(args.ip, args.port, args.rate, args.conns, args.seconds, args.size)
    elif args.cmd == "hs":
        run_hs(args)
    elif args.cmd == "series":
        run_series(args)
    elif args.cmd == "idle":
        run_idle(args.ip, args.port, args.n, args.ports, args.inflight, args.src)
    else:
        if os.geteuid() != 0:
            sys.exit("suite.py needs root (network namespaces)")
        drive(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
