"""benchmarks/report.py: the README's performance table comes from the suite's JSON."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod
    spec.loader.exec_module(mod)
    return mod


report = _load()

DOC: dict[str, Any] = {
    "command": "python benchmarks/suite.py --quick",
    "when": "2026-11-29T20:00:00+0000",
    "elapsed_s": 150.2,
    "env": {
        "cpus": 2,
        "cpu_model": "AMD EPYC",
        "kernel": "6.18",
        "python": "3.11.7",
        "git_head": "0123456789abcdef0123",
        "git_dirty": False,
    },
    "params": {"quick": True},
    "summary": {
        "direct": {"tput_1": {"gbps": 11.5}, "rr_paced": {"p50_ms": 0.06, "p99_ms": 0.2}},
        "ztunnel-tcp": {
            "tput_1": {"gbps": 7.25, "gbps_per_proxy_core": 16.66},
            "rr_paced": {"p50_ms": 0.17, "p99_ms": 0.45, "vcpu_per_krps_max_side": 0.0981},
        },
        "ztunnel-hbone": {
            "tput_1": {"gbps": 3.04, "gbps_per_proxy_core": 1.97},
            "rr_paced": {"p50_ms": 0.45, "p99_ms": 1.2},
            "handshakes": {"handshakes_per_server_core_s": 321.4},
            "idle": {
                "opened": 10000,
                "kib_per_conn": 30.16,
                "kib_per_conn_by_side": {"a": 14.99, "b": 15.17},
                "rss_kib_at_rest": {"a": 57080, "b": 58716},
            },
        },
        "haproxy-inpod": {"tput_1": {"gbps": 8.1, "gbps_per_proxy_core": 16.02}},
        "haproxy-splice": {"tput_1": {"gbps": 9.4, "gbps_per_proxy_core": 27.04}},
        "stunnel-pair": {"handshakes": {"handshakes_per_server_core_s": 400.0}},
    },
    "targets": [
        {"target": "plain vs HAProxy", "want": ">= 1.0x", "shown": "0.62x", "met": False},
        {"target": "vCPU", "want": "<= 0.10", "shown": "0.098", "met": True},
        {"target": "not measured", "want": "< 10 KiB", "shown": "- KiB", "met": None},
    ],
}


def _row(block: str, label: str) -> list[str]:
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in:\n{block}")


@pytest.mark.timeout(10)
def test_block_carries_the_run_and_its_figures() -> None:
    block = report.readme_block(DOC)
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    assert "2026-11-29T20:00:00+0000" in block and "`0123456789ab`" in block
    assert "`python benchmarks/suite.py --quick`" in block
    assert _row(block, "Gbit/s, 1 stream (iperf3)")[:5] == ["11.50", "7.25", "3.04", "8.10", "9.40"]
    per_core = _row(block, "**Gbit/s per proxy core**, 1 stream")
    assert per_core[:6] == ["-", "16.66", "1.97", "16.02", "27.04", "-"]
    assert _row(block, "added p99 ms vs direct at 1000 rps")[:3] == ["-", "0.250", "1.000"]
    assert _row(block, "mTLS handshakes per server core-second")[2] == "321"
    assert "**30.16 KiB** (15.0 + 15.2)" in _row(block, "proxy memory (RSS)")[2]
    # the Rust column is labelled as published elsewhere, with a source
    assert "measured elsewhere" in block and "istio/ztunnel#1174" in block
    # verdicts of the run, unmeasured ones said so
    assert _row(block, "plain vs HAProxy")[2] == "**MISSED**"
    assert _row(block, "vCPU")[2] == "met"
    assert _row(block, "not measured")[2] == "n/a"


@pytest.mark.timeout(10)
def test_block_flags_uncommitted_changes() -> None:
    doc = copy.deepcopy(DOC)
    doc["env"]["git_dirty"] = True
    assert "(with uncommitted changes to the code)" in report.readme_block(doc)


@pytest.mark.timeout(10)
def test_replace_block_swaps_only_the_marked_lines() -> None:
    text = f"intro\n{report.BEGIN}\nold table\n{report.END}\noutro\n"
    out = report.replace_block(text, f"{report.BEGIN}\nnew\n{report.END}")
    assert out == f"intro\n{report.BEGIN}\nnew\n{report.END}\noutro\n"
    with pytest.raises(ValueError, match="no"):
        report.replace_block("no markers here", "x")


def _ratio(row: str, test: str, one: float, two: float, e1: float, e2: float) -> dict[str, Any]:
    return {"row": row, "test": test, "one": one, "two": two, "scaling": two / one,
            "per_core_one": e1, "per_core_two": e2, "efficiency": e2 / e1}  # fmt: skip


WORKERS: dict[str, Any] = {
    "command": "python benchmarks/suite.py --quick --only workers",
    "when": "2026-12-01T13:30:00+0000",
    "elapsed_s": 95.0,
    "env": {"git_head": "fedcba9876543210", "git_dirty": False},
    "params": {"quick": True, "rounds": 2},
    "summary": {
        "ztunnel-tcp/w1": {"tput_1": {"gbps": 6.0, "box_busy_cores": 1.99, "processes_a": 1}},
        "ztunnel-tcp/w2": {"tput_1": {"gbps": 7.5}, "tput_8": {"processes_a": 3}},
        "haproxy-inpod/t2": {"crr": {"conn_per_s": 3338.4, "conn_per_proxy_core_s": 7588.0}},
        "ztunnel-hbone/w2": {"crr": {"conn_per_s": 784.4}},
    },
    "ratios": [
        _ratio("ztunnel-tcp", "tput_1", 6.0, 7.5, 25.0, 24.0),
        _ratio("haproxy-inpod", "tput_1", 6.4, 6.4, 25.0, 25.0),
    ],
    "memory_kib_at_rest": {
        "w1_a": {"pss": 32256, "private": 30000, "rss": 50000, "processes": 1},
        "w1_b": {"pss": 31744, "private": 30000, "rss": 50000, "processes": 1},
        "w2_a": {"pss": 40960, "private": 38000, "rss": 90000, "processes": 3},
        "w2_b": {"pss": 40448, "private": 38000, "rss": 90000, "processes": 3},
    },
    "memory_kib_alone": {
        "w1": {"pss": 41779, "private": 40000, "rss": 51200, "processes": 1},
        "w2": {"pss": 66560, "private": 39000, "rss": 156000, "processes": 4},
        "w2_by_process": [
            {"pid": 10, "ppid": 1, "pss": 26214, "private": 20000, "rss": 51000},
            {"pid": 11, "ppid": 10, "pss": 12390, "private": 5000, "rss": 33000},
            {"pid": 12, "ppid": 11, "pss": 13414, "private": 6000, "rss": 36000},
            {"pid": 13, "ppid": 11, "pss": 13517, "private": 6000, "rss": 36000},
        ],
    },
    "scrape": {
        "w2": {
            "series": 40123,
            "plain_ms": 151.2,
            "plain_cpu_ms": 140.4,
            "gzip_ms": 250.0,
            "gzip_cpu_ms": 230.0,
            "plain_bytes": 36_000_000,
        },
    },
    "targets": [
        {"target": "scaling vs HAProxy", "want": ">= 0.90x", "shown": "1.25x", "met": True},
        {"target": "PSS extra worker", "want": "<= 10 MiB", "shown": "8.5 / 8.5 MiB", "met": False},
    ],
}


@pytest.mark.timeout(10)
def test_worker_rows_carry_their_own_run_scaling_and_memory() -> None:
    block = report.readme_block(DOC, WORKERS)
    # the main table is unchanged by the worker rows, which follow it
    assert report.readme_block(DOC).split("Every proxied figure")[0] in block
    assert "2026-12-01T13:30:00+0000" in block and "`fedcba987654`" in block
    assert "`python benchmarks/suite.py --quick --only workers`" in block
    assert _row(block, "Gbit/s, 1 stream")[:4] == ["6.00", "7.50", "-", "-"]
    assert _row(block, "box busy cores, 1 stream")[0] == "1.99"
    assert _row(block, "processes per proxy (a side; ztunnel N=2: supervisor, zygote, 2 workers)")[
        :2
    ] == ["-", "3"]
    assert _row(block, "new connections/s")[3] == "3338"
    assert _row(block, "**connections per proxy core-second**")[3] == "7588"
    # scaling 7.5/6.0 = 1.25x beside HAProxy's 1.00x, ratio 1.25x; efficiency 24/25
    assert _row(block, "1 stream")[:3] == ["1.25x", "1.00x", "1.25x"]
    assert _row(block, "1 stream")[6] == "0.96x / -x"
    assert "N=1: **31.5 / 31.0 MiB PSS**" in block and "N=2: **40.0 / 39.5 MiB PSS**" in block
    # alone on its node, by process: the root is the supervisor, the parent of the workers
    # the zygote
    assert "alone on its node: N=1: **40.8 MiB PSS** (one process;" in block
    assert "N=2: **65.0 MiB PSS** (supervisor 25.6 + zygote 12.1 + workers 13.1/13.2;" in block
    assert "N=2, 40123 series" in block and "151 ms and 140 ms of ztunnel CPU" in block
    assert _row(block, "scaling vs HAProxy")[2] == "met"
    assert _row(block, "PSS extra worker")[2] == "**MISSED**"
    assert block.endswith(report.END)


@pytest.mark.timeout(10)
def test_readme_table_is_generated_from_the_committed_results() -> None:
    doc = json.loads((ROOT / "benchmarks" / "results" / "suite.json").read_text())
    wpath = ROOT / "benchmarks" / "results" / "suite_workers.json"
    workers = json.loads(wpath.read_text()) if wpath.exists() else None
    spath = ROOT / "benchmarks" / "results" / "scale.json"
    scale = json.loads(spath.read_text()) if spath.exists() else None
    cpath = ROOT / "benchmarks" / "results" / "syscalls.json"
    syscalls = json.loads(cpath.read_text()) if cpath.exists() else None
    readme = (ROOT / "README.md").read_text()
    block = report.readme_block(doc, workers, scale, syscalls)
    assert block in readme, "run: python benchmarks/report.py"


@pytest.mark.timeout(10)
def test_scale_rows_carry_memory_time_and_decision_costs() -> None:
    scale = {
        "command": "python benchmarks/scale.py",
        "started": "2026-12-02T03:00:00Z",
        "rows": [
            {
                "pods": 200_000,
                "services": 20_000,
                "workers": 2,
                "pss_mib": 320.1,
                "store_file_mib": 160.5,
                "peak_rss_mib": 599.8,
                "ready_s": 33.3,
                "served_s": 33.4,
                "delta_s": 0.84,
                "delta_failed_probes": 0,
            }
        ],
        "decisions": {
            "pods": 200_000,
            "services": 20_000,
            "vip_warm_us": 9.5,
            "vip_warm_min_us": 8.1,
            "vip_cold_us": 40.0,
            "vip_cold_min_us": 30.0,
            "service_5000_rebuild_ms": 60.8,
        },
    }
    block = "\n".join(report.scale_block(scale))
    assert "| 200,000 / 20,000 | 2 | 320.1 | 160.5 | 599.8 | 33.3 | 33.4 | 0.84 | 0 |" in block
    assert "| a service VIP (10 endpoints) | 9.5 (8.1) | 40.0 (30.0) |" in block
    assert "60.8 ms, once per change" in block
    assert "scale.py" in report.readme_block(DOC, None, scale)
