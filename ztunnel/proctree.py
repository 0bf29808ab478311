"""One ztunnel's process tree in figures, from ``/proc``: open fds, the lowest fd limit, CPU and
memory summed over the supervisor, the zygote and the data-plane workers.

The parsers are pure (table-tested on ``/proc`` text); :func:`read` is the thin I/O. A process
that is gone between listing and reading counts for nothing (it is being restarted).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ProcessFigures",
    "parse_limits_nofile",
    "parse_private_dirty",
    "parse_stat",
    "private_dirty",
    "read",
    "start_time",
    "total",
]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class ProcessFigures:
    """One process (or, from :func:`total`, a tree): fds open, the soft ``RLIMIT_NOFILE``
    (None: unlimited), CPU seconds (user + system), resident and virtual bytes."""

    open_fds: int
    max_fds: int | None
    cpu_seconds: float
    resident_bytes: int
    virtual_bytes: int


def parse_stat(text: str) -> tuple[float, int, int, int]:
    """``/proc/<pid>/stat`` -> (CPU seconds, resident bytes, virtual bytes, start time in clock
    ticks after boot). The command name (field 2) may hold spaces and parentheses: the fields
    are counted after its last ``)``."""
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): utime 14, stime 15, starttime 22, vsize 23, rss 24
    utime, stime = int(rest[11]), int(rest[12])
    start, vsize, rss = int(rest[19]), int(rest[20]), int(rest[21])
    return (utime + stime) / CLOCK_TICKS, rss * PAGE_SIZE, vsize, start


def parse_limits_nofile(text: str) -> int | None:
    """The soft limit of ``Max open files`` in ``/proc/<pid>/limits`` (None: unlimited or not
    listed)."""
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft = line[len("Max open files") :].split()[0]
            return int(soft) if soft.isdigit() else None
    return None


def parse_private_dirty(text: str) -> int | None:
    """``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``, in bytes: the pages only this process
    holds and wrote (after a fork: those it unshared from its parent), which exiting gives back.
    None if the line is missing."""
    for line in text.splitlines():
        if line.startswith("Private_Dirty:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def private_dirty(pid: int) -> int | None:
    """``pid``'s private dirty bytes, or None once it is gone (or the kernel has no rollup)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return parse_private_dirty(f.read())
    except OSError:
        return None


def read(pid: int) -> ProcessFigures | None:
    """``pid``'s figures, or None once it is gone. Our own fd count leaves out the descriptor
    that lists the directory (as Rust's ``process_open_fds`` does)."""
    own = pid == os.getpid()
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd")) - (1 if own else 0)
        with open(f"/proc/{pid}/stat") as f:
            cpu, rss, vsize, _ = parse_stat(f.read())
        with open(f"/proc/{pid}/limits") as f:
            limit = parse_limits_nofile(f.read())
    except (OSError, ValueError, IndexError):
        return None
    return ProcessFigures(fds, limit, cpu, rss, vsize)


def total(figures: Iterable[ProcessFigures]) -> ProcessFigures:
    """A tree's figures: fds, CPU and memory summed (resident pages shared between the
    processes count in each, as the kernel's per-process figures do), the lowest fd limit (a
    process runs out of fds at its own limit)."""
    fds = rss = vsize = 0
    cpu = 0.0
    limits: list[int] = []
    for p in figures:
        fds += p.open_fds
        cpu += p.cpu_seconds
        rss += p.resident_bytes
        vsize += p.virtual_bytes
        if p.max_fds is not None:
            limits.append(p.max_fds)
    return ProcessFigures(fds, min(limits) if limits else None, cpu, rss, vsize)


def start_time(pid: int | None = None) -> float | None:
    """When ``pid`` (default: this process) started, in seconds since the epoch."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = parse_stat(f.read())[3]
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / CLOCK_TICKS
