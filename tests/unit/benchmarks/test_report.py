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


@pytest.mark.timeout(10)
def test_readme_table_is_generated_from_the_committed_results() -> None:
    doc = json.loads((ROOT / "benchmarks" / "results" / "suite.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert report.readme_block(doc) in readme, "run: python benchmarks/report.py"
