"""Benchmark the byte-copy engine (ztunnel.net.copy) against HAProxy and a direct path, on loopback.

Usage: ``python benchmarks/bench_copy.py [--quick] [--rounds N]`` (quick: ~80 s; full: ~4.5 min).

Throughput: iperf3 single stream (``-t T``) through each target, interleaved rounds, median. Targets:
direct; HAProxy 2.x TCP mode with splice-request/response, tune.pipesize 1 MiB, nbthread 1; and a tiny
proxy built from ``copy_bidirectional`` (splice and buffered paths, on uvloop and stdlib asyncio).
Proxy CPU is utime+stime from /proc/PID/stat over each run. The proxies share one CopyCounters, so
the bytes they moved are checked against what iperf3 moved (proves the proxy was in the path).

Connection rate: a blocking client does connect / 1-byte request / 1-byte reply / close in a loop
against an echo server through each target; reports conn/s and proxy CPU microseconds per
connection, plus pipes created during the run (short flows must not create pipes after warm-up).

Results: a Markdown table on stdout and JSON in benchmarks/results/copy.json.
Internal sub-commands (spawned by the driver): ``proxy``, ``echo``, ``crr``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ztunnel.net.copy import CopyCounters, PipePool, copy_bidirectional  # noqa: E402

HAPROXY = "/usr/sbin/haproxy"
CLK_TCK = os.sysconf("SC_CLK_TCK")
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# sub-command: the tiny proxy


def run_proxy(
    maps: list[tuple[int, int]], loop_kind: str, path: str, pipe_size: int, profile: str | None
) -> None:
    """accept -> connect upstream -> copy_bidirectional. SIGUSR1 prints cumulative stats as JSON."""
    pool = PipePool(pipe_size=pipe_size) if path == "splice" else None
    counters = CopyCounters()
    stats = {"conns": 0, "done": 0, "errors": 0}

    async def handle(loop: asyncio.AbstractEventLoop, down: socket.socket, upstream: int) -> None:
        stats["conns"] += 1
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        try:
            await loop.sock_connect(up, ("127.0.0.1", upstream))
        except OSError:
            up.close()
            down.close()
            stats["errors"] += 1
            return
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        res = await copy_bidirectional(down, up, pipes=pool, counters=counters)
        stats["done"] += 1
        if res.error is not None:
            stats["errors"] += 1

    async def serve(listen: int, upstream: int, tasks: set[asyncio.Task[None]]) -> None:
        loop = asyncio.get_running_loop()
        lst = socket.create_server(("127.0.0.1", listen), backlog=1024, reuse_port=False)
        lst.setblocking(False)
        while True:
            s, _ = await loop.sock_accept(lst)
            t = asyncio.create_task(handle(loop, s, upstream))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        def dump() -> None:
            out: dict[str, Any] = dict(stats)
            out["down_to_up"] = counters.down_to_up
            out["up_to_down"] = counters.up_to_down
            if pool is not None:
                st = pool.stats()
                out["pipes_created"] = st.created
                out["pipes_in_use"] = st.in_use
                out["pipes_idle"] = st.idle
            print(json.dumps(out), flush=True)

        loop.add_signal_handler(signal.SIGUSR1, dump)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        servers = [asyncio.create_task(serve(lp, up, tasks)) for lp, up in maps]
        await asyncio.sleep(0.05)
        print("READY", flush=True)
        await stop.wait()
        for t in (*servers, *tasks):
            t.cancel()
        await asyncio.gather(*servers, *tasks, return_exceptions=True)
        if pool is not None:
            pool.close()

    if loop_kind == "uvloop":
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with runner:
        runner.run(main())
    if prof is not None and profile:
        prof.disable()
        prof.dump_stats(profile)


# ---------------------------------------------------------------------------------------------
# sub-commands: echo server and connect/request/response/close client


def run_echo(port: int) -> None:
    """uvloop Protocol echo server (closes on EOF; never calls write_eof)."""
    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t: Any = transport  # uvloop's TCPTransport is not an asyncio.Transport subclass
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
        srv = await loop.create_server(Echo, "127.0.0.1", port, backlog=1024)
        print("READY", flush=True)
        await stop.wait()
        srv.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def run_crr(port: int, seconds: float) -> None:
    """connect, send 1 byte, read 1 byte, close; as fast as possible for `seconds`."""
    addr = ("127.0.0.1", port)
    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while (now := time.perf_counter()) < end:
        try:
            with socket.create_connection(addr) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(b"x")
                if s.recv(1) != b"x":
                    errors += 1
        except OSError:
            errors += 1
        lat.append(time.perf_counter() - now)
    elapsed = time.perf_counter() - t0
    lat.sort()
    print(
        json.dumps(
            {
                "conns": len(lat),
                "errors": errors,
                "seconds": elapsed,
                "p50_us": lat[len(lat) // 2] * 1e6 if lat else 0,
                "p99_us": lat[int(len(lat) * 0.99)] * 1e6 if lat else 0,
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is state (field 3); utime/stime are fields 14/15 -> indexes 11/12
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def listening(port: int) -> bool:
    hexport = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[1].endswith(hexport) and parts[3] == "0A":
                    return True
    return False


def wait_listening(port: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not listening(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listening on {port}")
        time.sleep(0.01)


@dataclass
class Target:
    name: str
    tput_port: int  # where iperf3 connects
    crr_port: int  # where the CRR client connects
    proc: subprocess.Popen[str] | None = None
    kind: str = "proxy"  # direct | haproxy | proxy
    tput: list[dict[str, float]] = field(default_factory=list)
    paced: list[dict[str, float]] = field(default_factory=list)
    crr: list[dict[str, float]] = field(default_factory=list)

    def stats(self) -> dict[str, Any] | None:
        """Ask one of our proxies for its cumulative counters (SIGUSR1 -> one JSON line)."""
        if self.kind != "proxy" or self.proc is None:
            return None
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGUSR1)
        line = self.proc.stdout.readline()
        return dict(json.loads(line))


def haproxy_cfg(maps: list[tuple[int, int]]) -> str:
    out = [
        "global",
        "  nbthread 1",
        "  maxconn 4000",
        "  tune.pipesize 1048576",
        "  tune.bufsize 65536",
        # no UDP socket towards /etc/resolv.conf's server (HAProxy 2.6's default resolvers)
        "resolvers default",
        "  nameserver lo 127.0.0.1:53",
        "defaults",
        "  mode tcp",
        "  timeout connect 5s",
        "  timeout client 60s",
        "  timeout server 60s",
        "  option splice-request",
        "  option splice-response",
    ]
    for i, (lp, up) in enumerate(maps):
        out += [f"listen l{i}", f"  bind 127.0.0.1:{lp}", f"  server s{i} 127.0.0.1:{up}"]
    return "\n".join(out) + "\n"


def run_iperf(
    target: Target, iperf_port: int, seconds: int, rate: str | None = None
) -> dict[str, float]:
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-p", str(iperf_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(iperf_port)
        pid = target.proc.pid if target.proc is not None else None
        before = target.stats()
        cpu0 = cpu_seconds(pid) if pid else 0.0
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", str(target.tput_port), "-t", str(seconds), "-J"]
            + (["-b", rate] if rate else []),
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 30,
        )
        cpu1 = cpu_seconds(pid) if pid else 0.0
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    end = json.loads(out.stdout)["end"]
    secs = float(end["sum_received"]["seconds"])
    rbytes = float(end["sum_received"]["bytes"])
    sbytes = float(end["sum_sent"]["bytes"])
    res: dict[str, float] = {
        "gbps": float(end["sum_received"]["bits_per_second"]) / 1e9,
        "bytes": rbytes,
        "seconds": secs,
    }
    if pid:
        cpu = cpu1 - cpu0
        res["cpu_s"] = cpu
        res["cores"] = cpu / secs
        res["gbps_per_core"] = rbytes * 8 / 1e9 / cpu if cpu else float("nan")
        res["cpu_s_per_gib"] = cpu / (rbytes / GiB)
    if before is not None:
        time.sleep(0.2)  # let the sessions finish
        after = target.stats()
        assert after is not None
        res["proxy_bytes_ratio"] = (after["down_to_up"] - before["down_to_up"]) / sbytes
    return res


def run_crr_once(target: Target, seconds: float) -> dict[str, float]:
    pid = target.proc.pid if target.proc is not None else None
    before = target.stats()
    cpu0 = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "crr",
            "--port",
            str(target.crr_port),
            "--seconds",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 30,
    )
    cpu1 = cpu_seconds(pid) if pid else 0.0
    r = json.loads(out.stdout)
    res: dict[str, float] = {
        "conn_per_s": r["conns"] / r["seconds"],
        "conns": r["conns"],
        "errors": r["errors"],
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
    }
    if pid:
        cpu = cpu1 - cpu0
        res["cpu_s"] = cpu
        res["cores"] = cpu / r["seconds"]
        res["cpu_us_per_conn"] = cpu / r["conns"] * 1e6 if r["conns"] else float("nan")
    if before is not None:
        time.sleep(0.2)
        after = target.stats()
        assert after is not None
        if "pipes_created" in after:
            res["pipes_created"] = after["pipes_created"] - before["pipes_created"]
        res["proxy_errors"] = after["errors"] - before["errors"]
    return res


def start(cmd: list[str], ready_port: int | None = None) -> subprocess.Popen[str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    if ready_port is None:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{cmd} did not start: {line!r}")
    else:
        wait_listening(ready_port)
    return p


def med(runs: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def tool_version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


@dataclass(frozen=True)
class Params:
    quick: bool
    seconds: int  # iperf3 -t
    rounds: int
    crr_seconds: float
    rate: str | None  # iperf3 -b for the paced table; None skips it
    only: str | None

    @property
    def command(self) -> str:
        cmd = "python benchmarks/bench_copy.py" + (" --quick" if self.quick else "")
        if self.rounds != 3:
            cmd += f" --rounds {self.rounds}"
        if self.only:
            cmd += f" --only {self.only}"
        return cmd


def drive(p: Params) -> None:
    iperf_port = free_port()
    echo_port = free_port()
    targets: list[Target] = [Target("direct", iperf_port, echo_port, kind="direct")]
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs.append(start([sys.executable, __file__, "echo", "--port", str(echo_port)]))
            hp = Target("haproxy splice 1MiB pipes", free_port(), free_port(), kind="haproxy")
            cfg = Path(tmp) / "haproxy.cfg"
            cfg.write_text(haproxy_cfg([(hp.tput_port, iperf_port), (hp.crr_port, echo_port)]))
            hp.proc = start([HAPROXY, "-db", "-f", str(cfg)], ready_port=hp.crr_port)
            procs.append(hp.proc)
            targets.append(hp)
            for path in ("splice", "buffered"):
                for loop in ("uvloop", "asyncio"):
                    t = Target(f"copy.py {path} / {loop}", free_port(), free_port())
                    maps = [f"{t.tput_port}:{iperf_port}", f"{t.crr_port}:{echo_port}"]
                    cmd = [sys.executable, __file__, "proxy", "--loop", loop, "--path", path]
                    t.proc = start(cmd + [a for m in maps for a in ("--map", m)])
                    procs.append(t.proc)
                    targets.append(t)
            # warm-up (creates the pool's first pipes, fills caches); not recorded
            for t in targets:
                run_crr_once(t, 0.3)
            if p.only in (None, "tput"):
                for rnd in range(p.rounds):
                    for t in targets:
                        t.tput.append(run_iperf(t, iperf_port, p.seconds))
                        print(f"  tput round {rnd + 1} {t.name}: {t.tput[-1]}", file=sys.stderr)
                for rnd in range(p.rounds if p.rate else 0):
                    for t in targets:
                        t.paced.append(run_iperf(t, iperf_port, p.seconds, p.rate))
                        print(f"  paced round {rnd + 1} {t.name}: {t.paced[-1]}", file=sys.stderr)
            if p.only in (None, "crr"):
                for rnd in range(p.rounds):
                    for t in targets:
                        t.crr.append(run_crr_once(t, p.crr_seconds))
                        print(f"  crr  round {rnd + 1} {t.name}: {t.crr[-1]}", file=sys.stderr)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    report(targets, p)


def tput_table(title: str, targets: list[Target], attr: str) -> tuple[list[str], dict[str, Any]]:
    """Markdown rows for one throughput phase, and per-target medians."""
    hp = next(t for t in targets if t.kind == "haproxy")
    hp_eff = med(getattr(hp, attr), "gbps_per_core")
    lines = [
        title,
        "",
        "| target | Gbit/s | runs | proxy CPU (cores) | Gbit/s per proxy core | proxy CPU s/GiB "
        "| per-core vs HAProxy | proxy bytes / iperf bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, Any] = {}
    for t in targets:
        runs_ = getattr(t, attr)
        eff = med(runs_, "gbps_per_core")
        ratio = eff / hp_eff if eff is not None and hp_eff else None
        m = {
            "gbps": med(runs_, "gbps"),
            "cores": med(runs_, "cores"),
            "gbps_per_core": eff,
            "cpu_s_per_gib": med(runs_, "cpu_s_per_gib"),
            "per_core_ratio_vs_haproxy": ratio,
            "proxy_bytes_ratio": med(runs_, "proxy_bytes_ratio"),
        }
        medians[t.name] = m
        run_list = ", ".join(f"{r['gbps']:.2f}" for r in runs_)
        lines.append(
            f"| {t.name} | {fmt(m['gbps'])} | {run_list} "
            f"| {fmt(m['cores'])} | {fmt(eff, '.1f')} | {fmt(m['cpu_s_per_gib'], '.3f')} "
            f"| {fmt(ratio, '.2f')}{'x' if ratio else ''} | {fmt(m['proxy_bytes_ratio'], '.3f')} |"
        )
    return lines, medians


def report(targets: list[Target], p: Params) -> None:
    hp = next(t for t in targets if t.kind == "haproxy")
    hp_crr_cpu = med(hp.crr, "cpu_us_per_conn")
    lines, tput = tput_table(
        f"### Throughput: iperf3 single stream, -t {p.seconds}, {p.rounds} interleaved rounds, "
        "median",
        targets,
        "tput",
    )
    paced: dict[str, Any] = {}
    if p.rate:
        more, paced = tput_table(
            f"### Same load for everyone: iperf3 -b {p.rate} (paced), -t {p.seconds}, "
            f"{p.rounds} rounds, median",
            targets,
            "paced",
        )
        lines += ["", *more]
    lines += [
        "",
        f"### Connection rate: connect / 1-byte RR / close, {p.crr_seconds} s x {p.rounds} "
        "rounds, median",
        "",
        "| target | conn/s | p50 µs | p99 µs | proxy CPU µs/conn | CPU/conn vs HAProxy "
        "| pipes created (all rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary: list[dict[str, Any]] = []
    for t in targets:
        crr_cpu = med(t.crr, "cpu_us_per_conn")
        ratio = crr_cpu / hp_crr_cpu if crr_cpu and hp_crr_cpu else None
        pipes = sum(int(r.get("pipes_created", 0)) for r in t.crr) if t.kind == "proxy" else None
        summary.append(
            {
                "target": t.name,
                **tput[t.name],
                "paced": paced.get(t.name),
                "conn_per_s": med(t.crr, "conn_per_s"),
                "crr_p50_us": med(t.crr, "p50_us"),
                "crr_cpu_us_per_conn": crr_cpu,
                "crr_cpu_ratio_vs_haproxy": ratio,
                "crr_pipes_created": pipes,
            }
        )
        lines.append(
            f"| {t.name} | {fmt(med(t.crr, 'conn_per_s'), '.0f')} "
            f"| {fmt(med(t.crr, 'p50_us'), '.0f')} | {fmt(med(t.crr, 'p99_us'), '.0f')} "
            f"| {fmt(crr_cpu, '.0f')} | {fmt(ratio, '.2f')}{'x' if ratio else ''} "
            f"| {'-' if pipes is None else pipes} |"
        )
    table = "\n".join(lines)
    print(table)
    import uvloop

    doc = {
        "command": p.command,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "uvloop": getattr(uvloop, "__version__", "?"),
            "haproxy": tool_version([HAPROXY, "-v"]),
            "iperf3": tool_version(["iperf3", "--version"]),
            "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
        },
        "params": {
            "iperf_seconds": p.seconds,
            "rounds": p.rounds,
            "crr_seconds": p.crr_seconds,
            "paced_rate": p.rate,
        },
        "summary": summary,
        "runs": {t.name: {"tput": t.tput, "paced": t.paced, "crr": t.crr} for t in targets},
        "markdown": table,
    }
    out = ROOT / "benchmarks" / "results" / "copy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    ap.add_argument("--quick", action="store_true", help="2 s iperf runs, 1.5 s CRR runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument(
        "--rate", default="3G", help="iperf3 -b for the paced table ('off' to skip; quick skips)"
    )
    ap.add_argument("--only", choices=["tput", "crr"], help="run one half (for development)")
    p = sub.add_parser("proxy")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument("--path", choices=["splice", "buffered"], default="splice")
    p.add_argument("--pipe-size", type=int, default=1 << 20)
    p.add_argument("--profile", help="write cProfile stats here on exit")
    p.add_argument("--map", action="append", required=True, help="LISTEN_PORT:UPSTREAM_PORT")
    e = sub.add_parser("echo")
    e.add_argument("--port", type=int, required=True)
    c = sub.add_parser("crr")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if args.cmd == "proxy":
        maps = [tuple(int(x) for x in m.split(":")) for m in args.map]
        run_proxy([(a, b) for a, b in maps], args.loop, args.path, args.pipe_size, args.profile)
    elif args.cmd == "echo":
        run_echo(args.port)
    elif args.cmd == "crr":
        run_crr(args.port, args.seconds)
    else:
        drive(
            Params(
                quick=args.quick,
                seconds=2 if args.quick else 5,
                rounds=args.rounds,
                crr_seconds=1.5 if args.quick else 3.0,
                rate=None if args.quick or args.rate == "off" else args.rate,
                only=args.only,
            )
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
