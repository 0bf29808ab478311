"""benchmarks/syscalls.py: strace -c's summary is read into calls per syscall, and
benchmarks/report.py turns the result into the README's syscall table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


syscalls = _load("syscalls")
report = _load("report")

# strace 6.1's -c output, columns as printed (an errors column only where some call failed)
SUMMARY = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 30.12    0.120000          10     12000           epoll_ctl
 20.00    0.080000          13      6000           splice
  9.50    0.038000          15      2390       390 accept4
  1.00    0.004000           4      1000      1000 connect
  0.01    0.000040          40         1           io_uring_enter
------ ----------- ----------- --------- --------- ----------------
100.00    0.400000          18     21391      1390 total
"""


def test_the_summary_gives_calls_by_name_without_the_total() -> None:
    assert syscalls.parse_strace_summary(SUMMARY) == {
        "epoll_ctl": 12000,
        "splice": 6000,
        "accept4": 2390,
        "connect": 1000,
        "io_uring_enter": 1,
    }


def test_nothing_traced_is_no_calls() -> None:
    assert syscalls.parse_strace_summary("") == {}


def test_the_report_block_has_a_column_per_path_and_the_totals() -> None:
    doc = {
        "started": "2026-12-02T17:00:00Z",
        "workers": "2",
        "paths": {
            "ztunnel-tcp": {"per_conn": 49.2, "by_syscall": {"epoll_ctl": 12.0, "splice": 6.0}},
            "haproxy-inpod": {"per_conn": 31.6, "by_syscall": {"splice": 6.03, "epoll_ctl": 3.09}},
        },
    }
    lines = report.syscalls_block(doc)
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| syscall | ztunnel-py TCP | HAProxy, same in-pod path |"
    assert table[2] == "| **all** | **49.2** | **31.6** |"
    assert "| `epoll_ctl` | 12.00 | 3.09 |" in table
    assert "| `splice` | 6.00 | 6.03 |" in table
    assert report.syscalls_block({"paths": {}}) == []
