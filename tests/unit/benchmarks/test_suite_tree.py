"""benchmarks/suite.py: a proxy's CPU and memory are summed over its whole process tree (a
ztunnel with workers is a supervisor and worker processes, possibly grandchildren)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_suite", ROOT / "benchmarks" / "suite.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_suite"] = mod
    spec.loader.exec_module(mod)
    return mod


suite = _load()

# a parent that starts a busy child, which starts a busy grandchild, all of them living on;
# each says who it is in one write() (print() makes one write per piece when PYTHONUNBUFFERED
# is set, and the three processes' pieces then interleave in the pipe)
_TREE = """
import os, sys, time
def say(who):
    os.write(1, f"{who} {os.getpid()}\\n".encode())
def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
if os.fork() == 0:
    if os.fork() == 0:
        spin(0.3)
        say("grandchild")
        time.sleep(30)
        os._exit(0)
    spin(0.3)
    say("child")
    time.sleep(30)
    os._exit(0)
say("parent")
time.sleep(30)
"""


@pytest.mark.timeout(20)
def test_tree_counts_children_and_grandchildren() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = {}
        for _ in range(3):
            who, pid = proc.stdout.readline().split()
            pids[who] = int(pid)
        tree = suite.proc_tree(proc.pid)
        assert sorted(tree) == sorted(pids.values())
        by_pid = suite.tree_cpu_by_pid(proc.pid)
        assert by_pid[pids["child"]] >= 0.25 and by_pid[pids["grandchild"]] >= 0.25
        assert suite.tree_cpu_seconds(proc.pid) >= 0.5
        assert suite.tree_run_ns(proc.pid) >= 0.5e9
        # bench_hbone's own helpers (bench_hbone.py, soak) count the same tree
        assert suite.bh.cpu_seconds(proc.pid) >= 0.5
        assert suite.bh._rss_kib(proc.pid) > 2.5 * suite.bh._rss_kib(pids["grandchild"])
        mem = suite.tree_memory_kib(proc.pid)
        assert mem["processes"] == 3
        assert 0 < mem["private"] <= mem["pss"] <= mem["rss"]
        # the tree's PSS counts the pages the forked processes share once, not three times
        one = suite.tree_memory_kib(pids["grandchild"])
        assert mem["rss"] > 2.5 * one["rss"] and mem["pss"] < mem["rss"]
    finally:
        for pid in sorted(suite.proc_tree(proc.pid), reverse=True):
            os.kill(pid, 9)
        proc.wait(5)
        time.sleep(0.05)
        suite.bh.remove_cpu_groups()


# a parent that ignores SIGCHLD (as ztunnel's zygote does: its workers are reaped by the
# kernel), and a child that burns CPU and exits once the first count is taken
_REAPED = """
import os, signal, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
if os.fork() == 0:
    sys.stdin.readline()
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass
    os._exit(0)
os.write(1, b"ready\\n")
time.sleep(30)
"""


@pytest.mark.timeout(20)
def test_cpu_of_a_process_that_exited_unreaped_still_counts() -> None:
    # A ztunnel worker retired after a burst leaves no /proc entry and no parent's cutime.
    if os.geteuid() != 0 or not os.access(suite.bh.CPUACCT, os.W_OK):
        pytest.skip("needs root and cgroup v1 cpuacct (the benchmarks' machine)")
    proc = subprocess.Popen(
        [sys.executable, "-c", _REAPED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "ready\n"
        before = suite.tree_cpu_seconds(proc.pid)
        [child] = [p for p in suite.proc_tree(proc.pid) if p != proc.pid]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}")
        assert suite.tree_cpu_seconds(proc.pid) - before >= 0.35
        assert suite.bh._stat_cpu(suite.proc_tree(proc.pid)) < 0.35  # (what /proc still shows)
        proc.kill()
        proc.wait(5)  # the root gone too: its tree's group still counts what all of it used
        assert suite.tree_cpu_seconds(proc.pid) - before >= 0.35
    finally:
        proc.kill()
        proc.wait(5)
        suite.bh.remove_cpu_groups()
