"""The process tree's figures: /proc parsers on their text, and process_* over a real tree."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from ztunnel import proctree
from ztunnel.metrics import ProcessMetrics, encode
from ztunnel.proctree import ProcessFigures

pytestmark = pytest.mark.timeout(30)

# /proc/<pid>/stat of a process whose name holds a space and parentheses
STAT = (
    "4242 (python (worker) 1) S 1 4242 4242 0 -1 4194560 5000 0 0 0 "
    "250 50 0 0 20 0 3 0 123456 104857600 2560 18446744073709551615 "
    "1 1 0 0 0 0 0 16781312 134234626 0 0 0 17 1 0 0 0 0 0"
)

LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max open files            1024                 524288               files
Max locked memory         8388608              8388608              bytes
"""


def test_parse_stat() -> None:
    cpu, rss, vsize, start = proctree.parse_stat(STAT)
    assert cpu == pytest.approx(300 / proctree.CLOCK_TICKS)  # utime 250 + stime 50 ticks
    assert (rss, vsize, start) == (2560 * proctree.PAGE_SIZE, 104857600, 123456)


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        (LIMITS, 1024),
        (LIMITS.replace("1024     ", "unlimited"), None),
        ("Limit Soft Hard\n", None),
    ],
)
def test_parse_limits_nofile(text: str, limit: int | None) -> None:
    assert proctree.parse_limits_nofile(text) == limit


ROLLUP = """557d65b71000-7ffc50a64000 ---p 00000000 00:00 0                          [rollup]
Rss:                1612 kB
Pss:                 500 kB
Shared_Clean:       1428 kB
Private_Clean:        72 kB
Private_Dirty:       112 kB
Anonymous:           112 kB
"""


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (ROLLUP, 112 * 1024),
        (ROLLUP.replace("Private_Dirty:       112 kB\n", ""), None),
        ("Private_Dirty:\n", None),
        ("", None),
    ],
)
def test_parse_private_dirty(text: str, want: int | None) -> None:
    assert proctree.parse_private_dirty(text) == want


def test_private_dirty_of_a_live_and_a_gone_process() -> None:
    own = proctree.private_dirty(os.getpid())
    assert own is not None and own > 1 << 20  # (an interpreter with pytest loaded)
    assert proctree.private_dirty(2**22 + 1) is None  # (above pid_max's default range)


def test_total_sums_and_takes_the_lowest_limit() -> None:
    tree = proctree.total(
        [
            ProcessFigures(35, 1048576, 1.5, 100, 1000),
            ProcessFigures(20, 4096, 0.25, 50, 500),
            ProcessFigures(34, None, 0.25, 50, 500),
        ]
    )
    assert tree == ProcessFigures(89, 4096, 2.0, 200, 2000)
    assert proctree.total([]) == ProcessFigures(0, None, 0.0, 0, 0)


def test_read_own_process_matches_the_kernel() -> None:
    got = proctree.read(os.getpid())
    assert got is not None
    assert got.open_fds == len(os.listdir("/proc/self/fd")) - 1  # less the listing's own fd
    assert got.max_fds == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert got.cpu_seconds > 0 and got.resident_bytes > 0
    assert proctree.read(2**22 + 12345) is None  # (no such process)


def _child(extra_fds: int, nofile: int) -> subprocess.Popen[bytes]:
    """A process holding ``extra_fds`` more descriptors, with a lower fd limit, that used
    a quarter of a second of CPU."""
    code = (
        "import os, resource, sys, time\n"
        "while time.process_time() < 0.25: pass\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))\n"
        f"keep = [os.open('/dev/null', os.O_RDONLY) for _ in range({extra_fds})]\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def test_process_metrics_cover_the_tree() -> None:
    """process_open_fds, the CPU and the memory summed over ours and the other pids,
    process_max_fds the lowest limit; a process gone keeps its CPU in the counter."""
    reg = CollectorRegistry()
    pm = ProcessMetrics(reg)
    alone = pm.figures()
    child = _child(50, 512)
    try:
        pm.pids = lambda: (child.pid,)
        theirs = proctree.read(child.pid)
        assert theirs is not None
        tree = pm.figures()
        assert tree.open_fds == pytest.approx(alone.open_fds + theirs.open_fds, abs=2)
        assert theirs.open_fds >= 53  # stdio and the 50
        assert tree.max_fds == 512
        assert tree.resident_bytes > alone.resident_bytes
        text = encode(reg).decode()
        assert "process_max_fds 512\n" in text
        fds = next(ln for ln in text.splitlines() if ln.startswith("process_open_fds "))
        assert int(fds.split()[1]) >= alone.open_fds + 53
        cpu_with_child = pm.figures().cpu_seconds
    finally:
        child.communicate(b"")
    after = pm.figures()  # the child is gone: its CPU stays counted
    assert cpu_with_child >= alone.cpu_seconds + 0.2
    assert after.cpu_seconds >= cpu_with_child
    assert after.max_fds == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert "# TYPE process_cpu_seconds counter\n# UNIT process_cpu_seconds seconds\n" in text
