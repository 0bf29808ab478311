"""Memory soak: RSS and PSS of each ztunnel sampled through phases of load, then at rest.

Usage: ``python benchmarks/soak.py [--quick] [--phase-seconds S] [--rest-seconds S]`` (root;
``make soak``; about 17 minutes by default, 8 with ``--quick``). Results:
``benchmarks/results/soak.json`` and ``soak.md``. ``--at-rest`` only measures the PSS at rest of
both beds (anonymous and file-backed), in about two minutes.

Two test beds, one after the other:

* the ``bench_hbone.py`` bed (pods ``a``/``b`` with a dedicated ztunnel each, ``c``/``d`` without):
  ``hbone-churn`` (``bench_hbone.py crr``: connect, 1-byte echo, close, a -> b over HBONE),
  ``plaintext-churn`` (the same a -> d, ztunnel-a's TCP passthrough) and ``idle-N`` (``--phase
  idle``: ``--idle-conns`` idle HBONE connections a -> b, 2,000 by default, opened with
  ``suite.py idle``, held for the phase, then closed).
  Here ``POOL_UNUSED_RELEASE_TIMEOUT`` is 10 s (default 5 min), so the pooled HBONE connections
  are closed during the rest and what remains is memory, not open connections;
* the ``ztunnel/testing/xdsbed.py`` bed (two nodes, shared-mode ztunnels fed by a fake node agent
  with a few pods each, xDS and certificates from the fake istiod): ``xds-workload-churn`` (the
  fake istiod adds and removes batches of workloads on other nodes for the phase). The PSS of
  these ztunnels at rest, before any load, is the production-like memory at rest.

Before the phases, a few seconds of each load warm the ztunnels up (the first connections build
what lives as long as the process: the pooled HBONE connection, TLS contexts, certificates).
Each phase: a baseline (mean of the samples over the last seconds of the rest before it), the
load, then ``--rest-seconds`` without load. Reported per ztunnel: the RSS slope under load after
the warm-up (the first third of the phase; least squares, KiB/min) and the residual (mean RSS of
the last quarter of the rest after the phase minus the baseline). Targets (issue 18): slope under
10 KiB/min and residual under 2 MiB in every phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
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
import suite  # noqa: E402

ROOT = bh.ROOT
RESULTS = ROOT / "benchmarks" / "results"
T_SLOPE_KIB_PER_MIN = 10.0
T_RESIDUAL_KIB = 2048.0
IDLE_CONNS = 2000


def mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB from /proc/PID/smaps_rollup, summed over the process and its workers
    (PSS adds up; RSS counts the pages the workers share with the supervisor once per process)."""
    rss = pss = 0
    for p in bh.proc_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:  # (a worker that just exited)
            pass
    return rss, pss


def smaps_breakdown(pid: int) -> dict[str, int]:
    """RSS KiB by kind of mapping: the glibc main heap, anonymous maps (thread arenas, pymalloc
    arenas, big buffers), files (libraries, code) and the rest (stack, vdso)."""
    out = {"heap": 0, "anon": 0, "file": 0, "other": 0}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else ""
                kind = (
                    "heap" if name == "[heap]" else "anon" if not name
                    else "file" if name.startswith("/") else "other"
                )  # fmt: skip
            elif head and head[0] == "Rss:":
                out[kind] += int(head[1])
    return out


def rest_detail(pid: int) -> dict[str, int]:
    """The smaps_rollup fields that explain PSS at rest, KiB: anonymous (private to the process:
    Python objects, heaps) and file-backed (libraries, shared with every process mapping them)."""
    out: dict[str, int] = {"processes": 0}
    for p in bh.proc_tree(pid):
        out["processes"] += 1
        with open(f"/proc/{p}/smaps_rollup") as f:
            for line in f:
                head = line.split()
                if len(head) >= 2 and head[0] in ("Rss:", "Pss:", "Pss_Anon:", "Pss_File:"):
                    out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


@dataclass
class Sampler:
    """Samples every process in ``pids`` every ``interval`` seconds in a thread."""

    pids: dict[str, int]
    interval: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "start"
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            row: dict[str, Any] = {"t": time.monotonic() - self._t0, "phase": self.phase}
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    row[name] = mem_kib(pid)
            self.samples.append(row)
            self._stop.wait(self.interval)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _slope_kib_per_min(points: list[tuple[float, int]]) -> float | None:
    if len(points) < 3:
        return None
    ts = [t for t, _ in points]
    vs = [float(v) for _, v in points]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den * 60


def _mean(rows: list[dict[str, Any]], name: str, idx: int) -> float | None:
    vals = [r[name][idx] for r in rows if name in r]
    return statistics.fmean(vals) if vals else None


def analyse(
    sampler: Sampler, phase: str, t_base: tuple[float, float], t_load: tuple[float, float],
    t_rest: tuple[float, float],
) -> dict[str, Any]:  # fmt: skip
    """Slope after warm-up and residual per process, from the samples of one phase."""

    def within(a: float, b: float) -> list[dict[str, Any]]:
        return [r for r in sampler.samples if a <= r["t"] <= b]

    warm = t_load[0] + (t_load[1] - t_load[0]) / 3
    base, load, rest = within(*t_base), within(warm, t_load[1]), within(*t_rest)
    tail = within(t_rest[1] - (t_rest[1] - t_rest[0]) / 4, t_rest[1])
    out: dict[str, Any] = {"phase": phase, "load_seconds": t_load[1] - t_load[0], "by_ztunnel": {}}
    for name in sampler.pids:
        b_rss, b_pss = _mean(base, name, 0), _mean(base, name, 1)
        e_rss, e_pss = _mean(tail, name, 0), _mean(tail, name, 1)
        peak = max((r[name][0] for r in load + rest if name in r), default=None)
        slope = _slope_kib_per_min([(r["t"], r[name][0]) for r in load if name in r])
        residual = e_rss - b_rss if e_rss is not None and b_rss is not None else None
        out["by_ztunnel"][name] = {
            "rss_kib_before": b_rss,
            "pss_kib_before": b_pss,
            "rss_kib_peak": peak,
            "rss_kib_after_rest": e_rss,
            "pss_kib_after_rest": e_pss,
            "slope_kib_per_min": slope,
            "residual_kib": residual,
            "pss_residual_kib": e_pss - b_pss if e_pss is not None and b_pss is not None else None,
            "slope_met": slope is not None and slope < T_SLOPE_KIB_PER_MIN,
            "residual_met": residual is not None and residual < T_RESIDUAL_KIB,
        }
    return out


def run_phase(
    sampler: Sampler, name: str, load: Callable[[float], dict[str, Any]], seconds: float,
    rest: float,
) -> dict[str, Any]:  # fmt: skip
    t_base = (max(0.0, sampler.now() - min(5.0, rest / 2)), sampler.now())
    maps0 = {zt: smaps_breakdown(pid) for zt, pid in sampler.pids.items()}
    print(f"phase {name}: {seconds:.0f} s of load, then {rest:.0f} s at rest", file=sys.stderr)
    sampler.phase = name
    t0 = sampler.now()
    info = load(seconds)
    t1 = sampler.now()
    sampler.phase = f"{name}/rest"
    time.sleep(rest)
    res = analyse(sampler, name, t_base, (t0, t1), (t1, sampler.now()))
    res["load"] = info
    for zt, pid in sampler.pids.items():
        after = smaps_breakdown(pid)
        res["by_ztunnel"][zt]["rss_kib_by_mapping_before"] = maps0[zt]
        res["by_ztunnel"][zt]["rss_kib_by_mapping_after"] = after
        print(f"  {zt}: mappings before {maps0[zt]} after {after}", file=sys.stderr)
    for zt, r in res["by_ztunnel"].items():
        print(
            f"  {zt}: RSS {r['rss_kib_before']:.0f} -> peak {r['rss_kib_peak']} -> "
            f"{r['rss_kib_after_rest']:.0f} KiB (residual {r['residual_kib']:+.0f}), slope "
            f"{bh.fmt(r['slope_kib_per_min'], '.1f')} KiB/min",
            file=sys.stderr,
        )
    return res


# ---------------------------------------------------------------------------------------------
# loads


def crr_load(client: Any, ip: str, procs: int) -> Callable[[float], dict[str, Any]]:
    """New connections in a loop (``bench_hbone.py crr``) for the phase."""

    def load(seconds: float) -> dict[str, Any]:
        out = client.run(
            sys.executable, bh.__file__, "crr", "--ip", ip, "--port", str(bh.ECHO_PORT),
            "--seconds", str(seconds), "--procs", str(procs), timeout=seconds + 120,
        )  # fmt: skip
        r = json.loads(out.stdout)
        return {"conns": r["conns"], "errors": r["errors"], "conn_per_s": r["conns"] / r["seconds"]}

    return load


def idle_load(
    client: Any, ip: str, n: int, ports: int = 1, at_peak: IdlePeakCheck | None = None,
    per_process: int | None = None, sources: list[str] | None = None,
) -> Callable[[float], dict[str, Any]]:  # fmt: skip
    """``n`` idle connections (``suite.py idle``, over ``ports`` destination ports) opened, held
    for the phase, then closed; by several client processes of at most ``per_process`` each
    (RLIMIT_NOFILE), opening 256 at a time between them, from the ``sources`` IPs in turn (one
    process at least each). ``at_peak``, once all are open, measures what they hold
    (``--idle-settle``); its result is the load's ``at_peak``."""

    def load(seconds: float) -> dict[str, Any]:
        if at_peak is not None:
            at_peak.start()
        k = max(-(-n // (per_process or n)), len(sources or []))
        cmd = [sys.executable, suite.__file__, "idle", "--ip", ip, "--port", str(bh.ECHO_PORT)]
        cmd += ["--ports", str(ports)] if ports > 1 else []
        cmd += ["--inflight", str(max(1, 256 // k))] if k > 1 else []
        procs = []
        for i in range(k):
            src = ["--src", sources[i % len(sources)]] if sources else []
            size = ["--n", str(n // k + (i < n % k))]
            procs.append(client.popen(*cmd, *size, *src, stdin=subprocess.PIPE))
        t0 = time.monotonic()
        deadline = t0 + max(300.0, n / 100)
        done = errors = 0
        for proc in procs:
            line = proc.wait_for_line("READY", timeout=max(1.0, deadline - time.monotonic()))
            done, errors = done + int(line.split()[1]), errors + int(line.split()[2])
        open_s = time.monotonic() - t0
        out: dict[str, Any] = {"opened": done, "errors": errors, "open_seconds": open_s}
        if k > 1:
            out["client_processes"] = k
        stalled = [ln for proc in procs for ln in proc.lines if ln.startswith("STALLED")]
        if stalled:
            out["client_stalled"] = stalled
        if at_peak is not None:
            out["at_peak"] = at_peak(procs, done)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        for proc in procs:
            assert proc.popen.stdin is not None
            proc.popen.stdin.close()
        for proc in procs:
            proc.popen.wait(timeout=max(60.0, n / 1000))
        return out

    return load


def _nofile(pid: int) -> list[int]:
    """[soft, hard] RLIMIT_NOFILE of ``pid``."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    return [int(x) for x in line.split()[3:5]]


def _estab_by_port(pod: Any, local: bool) -> dict[int, int]:
    """Established TCP sockets in ``pod``'s netns, counted by local (else peer) port."""
    out: dict[int, int] = {}
    for line in pod.run("ss", "-Htn", "state", "established", timeout=120).stdout.splitlines():
        cols = line.split()
        if len(cols) >= 4:
            port = int(cols[2 if local else 3].rsplit(":", 1)[1])
            out[port] = out.get(port, 0) + 1
    return out


@dataclass
class IdlePeakCheck:
    """``idle_load``'s ``at_peak`` for the data bed: ``settle`` s after the last connection
    opened, RSS and PSS of each ztunnel (smaps_rollup over its process tree), its fds and
    ``RLIMIT_NOFILE``; the connections counted at every hop (sockets established in pod a to
    ztunnel-a's 15001 and to ztunnel-b's 15008, at the server's ports in pod b; conntrack
    entries); ``probe`` of them, evenly spread, sent one more byte that must echo back; and the
    warnings and errors the ztunnels logged since the load started."""

    bed: dict[str, Any]
    pids: dict[str, int]
    ports: int
    settle: float
    probe: int = 1000
    seen: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        for k, zt in self.bed["zts"].items():
            with zt._cond:
                self.seen[k] = len(zt.records)

    def __call__(self, procs: list[Any], opened: int) -> dict[str, Any]:
        pods, zts = self.bed["pods"], self.bed["zts"]
        server_ports = range(bh.ECHO_PORT, bh.ECHO_PORT + self.ports)
        time.sleep(self.settle)
        out: dict[str, Any] = {"settle_s": self.settle, "opened": opened, "by_ztunnel": {}}
        for name, pid in self.pids.items():
            tree = bh.proc_tree(pid)
            fds = 0
            for p in tree:
                with contextlib.suppress(OSError):
                    fds += len(os.listdir(f"/proc/{p}/fd"))
            rss, pss = mem_kib(pid)
            out["by_ztunnel"][name] = {
                "rss_kib": rss,
                "pss_kib": pss,
                "detail_kib": rest_detail(pid),
                "fds": fds,
                "nofile": {str(p): _nofile(p) for p in tree},
            }
        a_local, a_peer = _estab_by_port(pods["a"], True), _estab_by_port(pods["a"], False)
        b_local = _estab_by_port(pods["b"], True)
        accepted = {str(p): b_local.get(p, 0) for p in server_ports}
        out["sockets"] = {
            "a_accepted_by_ztunnel_a_15001": a_local.get(15001, 0),
            "a_client_to_server_ports": sum(a_peer.get(p, 0) for p in server_ports),
            "a_hbone_to_15008": a_peer.get(15008, 0),
            "b_hbone_at_ztunnel_b_15008": b_local.get(15008, 0),
            "b_server_accepted": accepted,
            "b_server_accepted_total": sum(accepted.values()),
        }
        out["conntrack"] = {}
        for k in ("a", "b"):
            with contextlib.suppress(Exception):
                out["conntrack"][k] = int(pods[k].sysctl("net.netfilter.nf_conntrack_count"))
        for proc in procs:
            assert proc.popen.stdin is not None
            proc.popen.stdin.write(f"PROBE {-(-self.probe // len(procs))}\n".encode())
            proc.popen.stdin.flush()
        out["probe"] = {"sent": 0, "echoed": 0, "failed": 0}
        for proc in procs:
            _, ok, failed = proc.wait_for_line("PROBED", timeout=60).split()
            out["probe"]["echoed"] += int(ok)
            out["probe"]["failed"] += int(failed)
        out["probe"]["sent"] = out["probe"]["echoed"] + out["probe"]["failed"]
        logged: dict[str, dict[str, int]] = {}
        for k, zt in zts.items():
            with zt._cond:
                recs = zt.records[self.seen.get(k, 0) :]
            for r in recs:
                level = str(r.get("level", "")).lower()
                if level in ("warn", "warning", "error", "raw") or "exception" in r:
                    msg = f"{level}: {r.get('message', '')}"
                    if r.get("error"):
                        msg += f" (error: {r['error']})"
                    msg = msg[:300]
                    by = logged.setdefault(k, {})
                    by[msg] = by.get(msg, 0) + 1
        out["logged"] = logged
        print(f"  at peak: {json.dumps(out)}", file=sys.stderr)
        return out


def xds_churn_load(mesh: Any, batch: int, period: float) -> Callable[[float], dict[str, Any]]:
    """The fake istiod adds ``batch`` workloads (on another node), then removes them, in turn."""
    from ztunnel.core.addr import parse_ip
    from ztunnel.state.model import TunnelProtocol, Workload
    from ztunnel.testing.xdsbed import TRUST_DOMAIN

    istiod = mesh.istiod

    def workloads(gen: int) -> list[Workload]:
        return [
            Workload(
                uid=f"cluster1//v1/Pod/churn/w{gen}-{i}",
                name=f"w{gen}-{i}",
                namespace="churn",
                addresses=(parse_ip(f"10.{200 + gen % 50}.{i // 250}.{i % 250 + 1}"),),
                protocol=TunnelProtocol.HBONE,
                trust_domain=TRUST_DOMAIN,
                service_account=f"sa-{i % 10}",
                node="elsewhere",
                workload_name=f"w{gen}-{i}",
            )
            for i in range(batch)
        ]

    def load(seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        gen = pushes = 0
        while time.monotonic() < end:
            wls = workloads(gen)
            istiod.call(istiod.istiod.set_addresses, *wls)
            time.sleep(period / 2)
            istiod.call(istiod.istiod.remove_addresses, *(w.uid for w in wls))
            time.sleep(period / 2)
            gen, pushes = gen + 1, pushes + 2
        return {"pushes": pushes, "workloads_per_push": batch}

    return load


# ---------------------------------------------------------------------------------------------
# beds


# Pooled HBONE connections idle for this long are closed (Rust default and ours: 5 minutes), so
# that the rest after a phase ends with none open: what stays is then memory, not connections.
POOL_RELEASE = "10s"


@contextlib.contextmanager
def data_bed(
    loop: str, workers: int | None = None, extra_env: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    env = {"POOL_UNUSED_RELEASE_TIMEOUT": POOL_RELEASE, **(extra_env or {})}
    if workers is not None:
        env["ZTUNNEL_WORKER_THREADS"] = str(workers)
    with bh.testbed([], loop, haproxy=False, env=env) as bed:
        yield bed


def _forget_records(zts: Any) -> None:
    """Drop the parsed log records the bed keeps (one per connection: GBs over a long soak)."""
    for zt in zts:
        with zt._cond:
            zt.records.clear()


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"### Memory soak ({doc['params']['phase_seconds']:.0f} s per phase, "
        f"{doc['params']['rest_seconds']:.0f} s at rest after each)",
        "",
        "Targets: slope under load (after a third of the phase) < 10 KiB/min, residual (RSS at the "
        "end of the rest minus before the phase) < 2 MiB.",
        "",
        "| phase | ztunnel | RSS before KiB | peak | after rest | residual KiB | PSS before | "
        "PSS after | slope KiB/min | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ph in doc["phases"]:
        for zt, r in ph["by_ztunnel"].items():
            met = "yes" if r["slope_met"] and r["residual_met"] else (
                "slope" if r["residual_met"] else "residual" if r["slope_met"] else "no"
            )  # fmt: skip
            met = {"yes": "met", "slope": "slope missed", "residual": "residual missed"}.get(
                met, "missed"
            )
            lines.append(
                f"| {ph['phase']} | {zt} | {r['rss_kib_before']:.0f} | {r['rss_kib_peak']} "
                f"| {r['rss_kib_after_rest']:.0f} | {r['residual_kib']:+.0f} "
                f"| {r['pss_kib_before']:.0f} | {r['pss_kib_after_rest']:.0f} "
                f"| {bh.fmt(r['slope_kib_per_min'], '.1f')} | {met} |"
            )
    lines += idle_peak_markdown(doc)
    rest = doc.get("at_rest", {})
    if rest:
        lines += ["", "PSS at rest, KiB (smaps_rollup, before any load):"]
        for k, v in rest.items():
            lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def idle_peak_markdown(doc: dict[str, Any]) -> list[str]:
    """The idle phases measured at their peak (``--idle-settle``): memory per connection."""
    lines: list[str] = []
    for ph in doc["phases"]:
        peak = ph.get("load", {}).get("at_peak")
        if not peak:
            continue
        n, load = peak["opened"], ph["load"]
        lines += [
            "",
            f"#### {ph['phase']}: {n} idle HBONE connections open "
            f"({load['errors']} errors, opened in {load['open_seconds']:.1f} s), measured "
            f"{peak['settle_s']:.0f} s after the last opened",
            "",
            "| ztunnel | PSS before KiB | PSS at peak | PSS KiB/conn | RSS before KiB | "
            "RSS at peak | RSS KiB/conn | fds at peak | NOFILE soft/hard |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for zt, r in ph["by_ztunnel"].items():
            at = peak["by_ztunnel"][zt]
            limits = sorted({f"{s}/{h}" for s, h in at["nofile"].values()})
            lines.append(
                f"| {zt} | {r['pss_kib_before']:.0f} | {at['pss_kib']} "
                f"| {(at['pss_kib'] - r['pss_kib_before']) / n:.2f} | {r['rss_kib_before']:.0f} "
                f"| {at['rss_kib']} | {(at['rss_kib'] - r['rss_kib_before']) / n:.2f} "
                f"| {at['fds']} | {', '.join(limits)} |"
            )
        sk, pr = peak["sockets"], peak["probe"]
        lines += [
            "",
            f"Sockets established: pod a {sk['a_client_to_server_ports']} client -> server "
            f"ports, {sk['a_accepted_by_ztunnel_a_15001']} accepted by ztunnel-a on 15001, "
            f"{sk['a_hbone_to_15008']} HBONE connections to ztunnel-b; pod b "
            f"{sk['b_server_accepted_total']} at the server ({sk['b_server_accepted']}). "
            f"Conntrack entries: {peak['conntrack']}. Probe: {pr['echoed']} of {pr['sent']} "
            f"connections echoed one more byte ({pr['failed']} failed).",
        ]
        for zt, msgs in peak["logged"].items():
            for msg, count in sorted(msgs.items(), key=lambda kv: -kv[1])[:10]:
                lines.append(f"- ztunnel-{zt} logged {count} x `{msg}`")
    return lines


def drive(args: argparse.Namespace) -> None:
    seconds: float = args.phase_seconds or (60.0 if args.quick else 180.0)
    rest: float = args.rest_seconds or 30.0
    phases: list[dict[str, Any]] = []
    at_rest: dict[str, Any] = {}
    idle = f"idle-{args.idle_conns}"
    want = set(args.phase or ["hbone-churn", "plaintext-churn", "idle", "xds-workload-churn"])
    if "idle" in want:
        want = (want - {"idle"}) | {idle}
    if args.at_rest:
        return at_rest_only(args.loop, rest)
    started = time.monotonic()
    samples: dict[str, list[dict[str, Any]]] = {}
    nofile = raise_nofile(args.idle_conns) if idle in want else None
    idle_ports: int | None = None
    idle_src: list[str] | None = None
    ztunnel_env = dict(kv.split("=", 1) for kv in args.ztunnel_env or [])
    if want - {"xds-workload-churn"}:
        with data_bed(args.loop, args.workers, ztunnel_env) as bed:
            pods, zts = bed["pods"], bed["zts"]
            pids = {"ztunnel-a": zts["a"].pid, "ztunnel-b": zts["b"].pid}
            per_process = idle_per_process()
            sources = idle_sources(pods["a"], args.idle_conns) if idle in want else None
            ports = 1
            if idle in want:  # one echo server per port, each below its fd limit
                ports = args.idle_ports or -(-args.idle_conns // per_process)
                if args.idle_conns > ports * per_process:
                    sys.exit(f"--idle-ports {ports}: over {per_process} connections per server")
                idle_ports, idle_src = ports, sources
            for port in range(bh.ECHO_PORT + 1, bh.ECHO_PORT + ports):  # (7000 is the bed's)
                echo = pods["b"].popen(sys.executable, bh.__file__, "echo", "--port", str(port))
                echo.wait_for_line("READY", timeout=15)
            time.sleep(rest)  # start-up settled, the first idle trim done
            at_rest["dedicated (one workload, local config, local CA)"] = {
                k: mem_kib(p)[1] for k, p in pids.items()
            }
            sampler = Sampler(pids)
            b, d = pods["b"].ip4, pods["d"].ip4
            peak = None
            if args.idle_settle is not None:
                peak = IdlePeakCheck(bed, pids, ports, args.idle_settle)
            loads = {
                "hbone-churn": crr_load(pods["a"], b, args.procs),
                "plaintext-churn": crr_load(pods["a"], d, args.procs),
                idle: idle_load(pods["a"], b, args.idle_conns, ports, peak, per_process, sources),
            }
            # Warm-up: the first connections of each kind build what lives as long as the process
            # (the pooled HBONE connection, TLS contexts, certificates, caches); not a residual.
            # (The idle phase warms up with 100 connections: warming up with all of them would
            # make the burst itself the baseline.)
            warm = {**loads, idle: idle_load(pods["a"], b, min(100, args.idle_conns), ports)}
            for name, load in warm.items():
                if name in want:
                    load(3.0 if name != idle else 0.0)
            time.sleep(min(10.0, rest))
            try:
                for name, load in loads.items():
                    if name in want:
                        phases.append(run_phase(sampler, name, load, seconds, rest))
                        _forget_records(zts.values())
            finally:
                sampler.close()
            samples["data"] = sampler.samples
    if "xds-workload-churn" in want:
        from ztunnel.testing.xdsbed import MeshPod, xds_mesh

        pods_spec = [MeshPod(f"p{i}", f"n{1 + i % 2}", f"sa-{i}") for i in range(6)]
        with xds_mesh(pods_spec) as mesh:
            pids = {f"ztunnel-{n}": zt.pid for n, zt in mesh.ztunnels.items()}
            time.sleep(rest)
            at_rest["shared (3 pods, xDS + CA from the fake istiod)"] = {
                k: mem_kib(p)[1] for k, p in pids.items()
            }
            sampler = Sampler(pids)
            time.sleep(min(5.0, rest))
            churn = xds_churn_load(mesh, args.batch, 1.0)
            churn(4.0)  # warm-up, as above
            time.sleep(min(10.0, rest))
            try:
                phases.append(
                    run_phase(
                        sampler, "xds-workload-churn", churn, seconds, rest,
                    )
                )  # fmt: skip
            finally:
                sampler.close()
            samples["xds"] = sampler.samples
    doc: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "elapsed_s": time.monotonic() - started,
        "env": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "commit": bh._git("rev-parse", "--short", "HEAD"),
            "note": "shared VM: other engineers' processes ran at the same time",
        },
        "params": {
            "phase_seconds": seconds,
            "rest_seconds": rest,
            "crr_procs": args.procs,
            "idle_conns": args.idle_conns,
            "idle_ports": idle_ports,
            "idle_sources": idle_src,
            "idle_settle_s": args.idle_settle,
            "ztunnel_env": ztunnel_env,
            "rlimit_nofile_raised": nofile,
            "workers": args.workers,
            "xds_batch": args.batch,
        },
        "targets": {"slope_kib_per_min": T_SLOPE_KIB_PER_MIN, "residual_kib": T_RESIDUAL_KIB},
        "at_rest_pss_kib": at_rest,
        "at_rest": at_rest,
        "phases": phases,
        "samples": samples,
    }
    md = markdown(doc)
    doc["markdown"] = md
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)


def raise_nofile(idle_conns: int) -> dict[str, Any] | None:
    """Raise this process's RLIMIT_NOFILE (which the ztunnels, the client and the servers
    inherit; ztunnel raises its soft limit to the hard one) when ``idle_conns`` connections need
    more: the client, the servers and each ztunnel hold a socket per connection (ztunnel-a the
    client's, ztunnel-b the upstream, shared between its workers) plus the pooled HBONE
    connections; 2 N + 10,000 leaves room for ztunnel's fd reserve. Without CAP_SYS_RESOURCE
    the hard limit cannot be raised: the soft one is raised to it, and every process of the bed
    is held to it (the idle phase then spreads clients and servers over several processes).
    Returns what was wanted and set, or None when the limit was enough."""
    want = 2 * idle_conns + 10_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want <= soft:
        return None
    with open("/proc/sys/fs/nr_open") as f:
        if want > int(f.read()):
            sys.exit(f"{idle_conns} idle connections need {want} fds: raise fs.nr_open first")
    doc: dict[str, Any] = {"before": [soft, hard], "wanted": want}
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
    except (ValueError, OSError) as e:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        doc["error"] = f"hard limit not raised ({e}): no CAP_SYS_RESOURCE"
    doc["set"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
    print(f"RLIMIT_NOFILE: {doc}", file=sys.stderr)
    return doc


# In-pod capture REDIRECTs every outbound connection of a pod to one ip:port (15001): conntrack
# needs a distinct source ip:port per connection after NAT, and remaps clashing source ports
# within 1024-65535, so one source IP has at most 64,512 captured connections at a time (past
# that the SYN is dropped: the client hangs). More take more client IPs.
IDLE_PER_SOURCE_IP = 60_000


def idle_sources(pod: Any, n: int) -> list[str] | None:
    """None when ``n`` connections fit one source IP; else pod ``a``'s own IP and enough extra
    ones, added to its ``lo`` (the connections are captured in the pod: the extra IPs are only
    their source, ztunnel-a's HBONE leaves from the pod's IP)."""
    k = -(-n // IDLE_PER_SOURCE_IP)
    if k <= 1:
        return None
    extra = [f"172.31.250.{i}" for i in range(1, k)]
    for ip in extra:
        pod.run("ip", "addr", "add", f"{ip}/32", "dev", "lo")
    return [str(pod.ip4), *extra]


def idle_per_process() -> int:
    """Connections one client or server process of the idle phase may hold (its fd limit)."""
    return max(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 2000)


def at_rest_only(loop: str, rest: float) -> None:
    """``--at-rest``: only the PSS at rest of both beds (each ztunnel ``rest`` s after start,
    summed over its processes), with the anonymous/file split, for 1 and 2 data-plane workers
    (``ZTUNNEL_WORKER_THREADS``); printed as JSON, nothing written."""
    from ztunnel.testing.xdsbed import MeshPod, xds_mesh

    doc: dict[str, Any] = {}
    for workers in ("1", "2"):
        env = {"ZTUNNEL_WORKER_THREADS": workers}
        with bh.testbed([], loop, haproxy=False, env=env) as bed:
            time.sleep(rest)
            doc[f"dedicated, {workers} worker(s)"] = {
                f"ztunnel-{k}": rest_detail(bed["zts"][k].pid) for k in ("a", "b")
            }
        pods_spec = [MeshPod(f"p{i}", f"n{1 + i % 2}", f"sa-{i}") for i in range(6)]
        with xds_mesh(pods_spec, extra_env=env) as mesh:
            time.sleep(rest)
            doc[f"shared, {workers} worker(s)"] = {
                f"ztunnel-{n}": rest_detail(zt.pid) for n, zt in mesh.ztunnels.items()
            }
    print(json.dumps(doc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 s phases")
    ap.add_argument("--phase-seconds", type=float, help="load per phase (default 180, quick 60)")
    ap.add_argument(
        "--rest-seconds",
        type=float,
        help="rest after each (default 30; above the 10 s pool release)",
    )
    ap.add_argument(
        "--phase",
        action="append",
        choices=["hbone-churn", "plaintext-churn", "idle", "xds-workload-churn"],
        help="run only these phases (repeatable)",
    )
    ap.add_argument(
        "--at-rest", action="store_true", help="only PSS at rest of both beds (about 2 minutes)"
    )
    ap.add_argument("--procs", type=int, default=2, help="churn client processes")
    ap.add_argument(
        "--idle-conns", type=int, default=IDLE_CONNS, help="HBONE connections of the idle phase"
    )
    ap.add_argument(
        "--idle-ports",
        type=int,
        help="spread the idle connections over this many server ports (7000, 7001, ...), one "
        "echo server each (default: as many as their fd limit needs, 1 up to ~18k)",
    )
    ap.add_argument(
        "--idle-settle",
        type=float,
        help="idle phase: this long after the last connection opened, measure the ztunnels at "
        "their peak and check every hop (results: the phase's load.at_peak)",
    )
    ap.add_argument(
        "--ztunnel-env",
        action="append",
        metavar="K=V",
        help="extra environment of the data bed's ztunnels (repeatable)",
    )
    ap.add_argument("--workers", type=int, help="ZTUNNEL_WORKER_THREADS of the data-plane bed")
    ap.add_argument("--batch", type=int, default=200, help="workloads per xDS push")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("soak.py needs root (network namespaces)")
    drive(args)


if __name__ == "__main__":
    main()
