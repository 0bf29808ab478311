"""Benchmark metrics: per-connection cost, scrape encode time, and event-loop stall during scrapes.

Usage: ``python benchmarks/bench_metrics.py [--series 10000] [--scrapes 10] [--loop uvloop]``

1. Data path: microseconds for ``open_connection`` (new and existing label set), ``flush`` and
   ``close`` on a ``ConnectionMetrics`` handle.
2. Encode: a registry with ``--series`` distinct traffic label sets (each connection opened,
   flushed and closed, so 4 series per label set: opened, closed, sent, received; plus the process
   figures), encoded with ``ztunnel.metrics.encode`` (OpenMetrics, the body Rust sends) and, for
   reference, prometheus_client's ``generate_latest`` (which sorts labels, so it is not our wire
   format). Then the CPU milliseconds (this thread's CPU time, median of 5) and the size of
   that body in each content coding the stats server can answer with, and in the ones it does
   not (zlib level 6, tower-http's default; brotli at tower-http's quality 4, when the
   ``brotli`` package is installed).
3. Stall: a real ``HttpServer`` + ``StatsHandler`` on loopback; ``curl`` (an external process,
   as Prometheus is) scrapes ``/metrics`` ``--scrapes`` times while a ticker task on the loop sleeps 1 ms in a loop and
   records how late it wakes. Compared: the three ``StatsHandler`` modes (``inline``: encode on
   the loop in one go; ``thread``: worker thread yielding the GIL per chunk; ``cooperative``: on the
   loop, one 64 KiB chunk per loop turn), with and without gzip, in interleaved rounds. Reports the
   max and p99 lateness during scrapes and a no-scrape baseline.

Results: a table on stdout and JSON in benchmarks/results/metrics.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from ztunnel.admin.http import HttpServer  # noqa: E402
from ztunnel.admin.stats import COMPRESSORS, RenderMode, StatsHandler, compress  # noqa: E402
from ztunnel.core.errors import ResponseFlag  # noqa: E402
from ztunnel.metrics import (  # noqa: E402
    Metrics,
    Reporter,
    SecurityPolicy,
    encode,
    encode_chunks,
    traffic_labels,
)
from ztunnel.state.model import Locality, Service, Workload  # noqa: E402


def workloads(n: int) -> list[Workload]:
    return [
        Workload(
            uid=f"Kubernetes//Pod/ns-{i % 50}/pod-{i}",
            name=f"pod-{i}",
            namespace=f"ns-{i % 50}",
            service_account=f"sa-{i % 200}",
            workload_name=f"deploy-{i}",
            canonical_name=f"app-{i}",
            canonical_revision="v1",
            locality=Locality("us-east1", f"us-east1-{'abc'[i % 3]}"),
        )
        for i in range(n)
    ]


def build(n: int) -> tuple[CollectorRegistry, Metrics]:
    reg = CollectorRegistry()
    m = Metrics(reg)
    svc = Service("echo", "default", "echo.default.svc.cluster.local")
    wls = workloads(n)
    server = wls[0]
    for w in wls:
        labels = traffic_labels(
            Reporter.SOURCE,
            source=w,
            source_identity=w.identity,
            destination=server,
            destination_service=svc,
            security_policy=SecurityPolicy.MUTUAL_TLS,
        )
        m.open_connection(labels).close(12345, 678)
    return reg, m


def per_op_us(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def bench_data_path() -> dict[str, float]:
    reg = CollectorRegistry()
    m = Metrics(reg, process=False)
    w = workloads(2)
    labels = traffic_labels(
        Reporter.SOURCE,
        source=w[0],
        source_identity=w[0].identity,
        destination=w[1],
        security_policy=SecurityPolicy.MUTUAL_TLS,
    )
    conn = m.open_connection(labels)
    total = [0]

    def flush() -> None:
        total[0] += 16384
        conn.flush(total[0], total[0])

    def open_close() -> None:
        m.open_connection(labels).close(100, 100)

    def labels_only() -> None:
        traffic_labels(
            Reporter.SOURCE,
            source=w[0],
            source_identity=w[0].identity,
            destination=w[1],
            security_policy=SecurityPolicy.MUTUAL_TLS,
        )

    def open_close_failed() -> None:
        m.open_connection(labels).close(0, 0, flag=ResponseFlag.CONNECT)

    return {
        "traffic_labels_us": per_op_us(labels_only, 20000),
        "open_close_existing_series_us": per_op_us(open_close, 20000),
        "open_close_failed_us": per_op_us(open_close_failed, 20000),
        "flush_us": per_op_us(flush, 200000),
    }


def bench_encode(reg: CollectorRegistry) -> dict[str, Any]:
    out: dict[str, Any] = {}
    encoders: list[tuple[str, Callable[[], bytes]]] = [
        ("encode_openmetrics", lambda: encode(reg)),
        ("prometheus_client_generate_latest", lambda: generate_latest(reg)),
    ]
    for name, fn in encoders:
        times: list[float] = []
        size = 0
        for _ in range(3):
            t0 = time.perf_counter()
            body: bytes = fn()
            times.append(time.perf_counter() - t0)
            size = len(body)
        out[name] = {"ms_median": statistics.median(times) * 1000, "bytes": size}
    return out


def bench_compression(reg: CollectorRegistry) -> dict[str, Any]:
    """CPU ms (this thread, median of 5) and bytes of the scrape body in each content coding."""
    import functools
    import importlib
    import zlib

    chunks = encode_chunks(reg)

    def cpu_ms(fn: Callable[[], list[bytes]]) -> tuple[float, int]:
        times, size = [], 0
        for _ in range(5):
            t0 = time.thread_time()
            out = fn()
            times.append(time.thread_time() - t0)
            size = sum(map(len, out))
        return statistics.median(times) * 1000, size

    out: dict[str, Any] = {}
    encode_ms, size = cpu_ms(lambda: encode_chunks(reg))
    out["encode_only"] = {"cpu_ms": encode_ms, "bytes": size}
    codings: dict[str, Callable[[], list[bytes]]] = {
        name: functools.partial(compress, chunks, name) for name in COMPRESSORS
    }

    def zlib6(wbits: int) -> list[bytes]:
        z = zlib.compressobj(6, zlib.DEFLATED, wbits)
        return [*(z.compress(c) for c in chunks), z.flush()]

    codings["gzip level 6 (not served)"] = lambda: zlib6(31)
    try:
        brotli: Any = importlib.import_module("brotli")  # (not a dependency: for comparison)

        def br() -> list[bytes]:
            b = brotli.Compressor(quality=4)
            return [*(b.process(c) for c in chunks), b.finish()]

        codings["br quality 4 (not served)"] = br
    except ImportError:
        pass
    for name, fn in codings.items():
        ms, size = cpu_ms(fn)
        out[name] = {"cpu_ms": ms, "bytes": size, "with_encode_cpu_ms": ms + encode_ms}
    return out


async def scrape(port: int, n: int, gzip_: bool) -> list[int]:
    """``n`` sequential scrapes by an external client (curl, one keep-alive connection), as
    Prometheus would; returns the body sizes."""
    url = f"http://127.0.0.1:{port}/metrics"
    argv = ["curl", "-sS", "-w", "%{size_download}\\n"]
    if gzip_:
        argv += ["-H", "Accept-Encoding: gzip"]
    for _ in range(n):
        argv += ["-o", "/dev/null", url]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"curl failed ({proc.returncode})")
    return [int(x) for x in out.split()]


async def ticker(stop: asyncio.Event, lateness: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(0.001)
        lateness.append(loop.time() - t - 0.001)


async def stall_run(
    reg: CollectorRegistry, mode: RenderMode, gzip_: bool, scrapes: int
) -> dict[str, Any]:
    srv = HttpServer.bind("stats", [("127.0.0.1", 0)], StatsHandler(reg, mode=mode))
    await srv.start()
    try:
        # Baseline: ticker alone.
        stop, base = asyncio.Event(), list[float]()
        t = asyncio.create_task(ticker(stop, base))
        await asyncio.sleep(0.5)
        stop.set()
        await t
        # During scrapes.
        stop, late = asyncio.Event(), list[float]()
        t = asyncio.create_task(ticker(stop, late))
        t0 = time.perf_counter()
        sizes = await scrape(srv.port, scrapes, gzip_)
        wall = time.perf_counter() - t0
        stop.set()
        await t
    finally:
        await srv.close()
    late.sort()
    return {
        "mode": mode,
        "gzip": gzip_,
        "scrapes": scrapes,
        "scrape_ms_avg": wall / scrapes * 1000,
        "response_bytes": sizes[-1] if sizes else 0,
        "baseline_max_stall_ms": max(base) * 1000,
        "max_stall_ms": late[-1] * 1000,
        "p99_stall_ms": late[int(len(late) * 0.99)] * 1000,
        "ticks": len(late),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--series", type=int, default=10000, help="distinct traffic label sets")
    ap.add_argument("--scrapes", type=int, default=5, help="scrapes per run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per mode")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "metrics.json"))
    args = ap.parse_args()

    data_path = bench_data_path()
    t0 = time.perf_counter()
    reg, m = build(args.series)
    build_s = time.perf_counter() - t0
    enc = bench_encode(reg)
    codings = bench_compression(reg)

    if args.loop == "uvloop":
        import uvloop

        factory: Any = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop

    modes: list[RenderMode] = ["inline", "thread", "cooperative"]

    async def stalls() -> list[dict[str, Any]]:
        out = []
        for _ in range(args.rounds):  # interleaved rounds: the VM is noisy
            for gz in (False, True):
                for mode in modes:
                    out.append(await stall_run(reg, mode, gz, args.scrapes))
        return out

    with asyncio.Runner(loop_factory=factory) as runner:
        stall = runner.run(stalls())

    result = {
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loop": args.loop,
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "series_label_sets": args.series,
        "series_total": sum(
            len(f)
            for f in (m.connections_opened, m.connections_closed, m.sent_bytes, m.received_bytes)
        ),
        "build_s": build_s,
        "data_path": data_path,
        "encode": enc,
        "compression": codings,
        "stall_runs": stall,
        "stall_summary": summary(stall),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"## metrics benchmark ({args.series} label sets, {result['series_total']} series, "
        f"{args.loop}, Python {platform.python_version()})\n"
    )
    print("| data path op | µs |\n|---|---|")
    for k, v in data_path.items():
        print(f"| {k} | {v:.2f} |")
    print("\n| encoder | ms (median of 3) | bytes |\n|---|---|---|")
    for k, v in enc.items():
        print(f"| {k} | {v['ms_median']:.1f} | {v['bytes']} |")
    print("\n| content coding | CPU ms (median of 5) | bytes |\n|---|---|---|")
    for k, v in codings.items():
        print(f"| {k} | {v['cpu_ms']:.1f} | {v['bytes']} |")
    print(
        "\n| scrape mode | gzip | scrape ms (median) | resp bytes | baseline max stall ms "
        "| max stall ms (median run / worst run) | p99 stall ms (median run) |"
        "\n|---|---|---|---|---|---|---|"
    )
    for row in result["stall_summary"]:
        print(
            f"| {row['mode']} | {row['gzip']} | {row['scrape_ms']:.0f} | {row['response_bytes']} | "
            f"{row['baseline_max_stall_ms']:.1f} | "
            f"{row['max_stall_ms_median_run']:.1f} / {row['max_stall_ms']:.1f} | "
            f"{row['p99_stall_ms']:.1f} |"
        )


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["mode"], r["gzip"]) for r in runs}, key=lambda k: (k[1], k[0]))
    for mode, gz in keys:
        rs = [r for r in runs if r["mode"] == mode and r["gzip"] == gz]
        out.append(
            {
                "mode": mode,
                "gzip": gz,
                "scrape_ms": statistics.median(r["scrape_ms_avg"] for r in rs),
                "response_bytes": rs[-1]["response_bytes"],
                "baseline_max_stall_ms": max(r["baseline_max_stall_ms"] for r in rs),
                "max_stall_ms": max(r["max_stall_ms"] for r in rs),
                "max_stall_ms_median_run": statistics.median(r["max_stall_ms"] for r in rs),
                "p99_stall_ms": statistics.median(r["p99_stall_ms"] for r in rs),
            }
        )
    return out


if __name__ == "__main__":
    main()
