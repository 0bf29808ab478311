"""Profiling on the admin port (``/debug/pprof/*``, as the Rust ztunnel's ``src/admin.rs`` names
them): a sampling CPU profile for N seconds and a ``tracemalloc`` heap snapshot.

CPU: a sampler thread wakes ``frequency`` times a second, reads every other thread's Python stack
(``sys._current_frames``) and charges each stack with the CPU time its thread used since the
previous tick (``pthread_getcpuclockid``), so a thread idle in ``epoll`` costs nothing and the
profile is CPU, not wall time. It is a statistical attribution: the CPU a thread used since the
last tick goes to the stack seen at this tick, which is where the thread gave up the GIL (a
forced switch inside Python code, or a C call such as the event loop's own ``run`` while uvloop
dispatches); a higher ``frequency`` sharpens it. The result is a **pprof protobuf** (gzipped ``profile.proto``,
what ``go tool pprof`` and the Rust ztunnel's endpoint produce; sample types ``samples/count``
and ``cpu/nanoseconds``), or with ``format=collapsed`` the **collapsed-stack** text that
``flamegraph.pl`` and speedscope read (``frame;frame;leaf <cpu microseconds>``).

Heap: ``tracemalloc`` top allocations by traceback, as text. ``/debug/pprof/heap/profiling
?activate=true|false`` switches tracing on or off (it slows every allocation while on); a
``/debug/pprof/heap`` request while tracing is off traces for ``seconds`` (default 10), answers,
and switches it off again.

Nothing runs unless a request asks: no thread, no hook, no tracing. Encoding is pure and tested
against ``go tool pprof``.
"""

from __future__ import annotations

import asyncio
import gzip
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

# tracemalloc (with pickle) is imported by the first heap request: memory at rest (issue 18).
if TYPE_CHECKING:
    import tracemalloc

# (filename, function name, function's first line, current line), outermost first.
Frame = tuple[str, str, int, int]
Stack = tuple[Frame, ...]

MAX_SECONDS = 300
MAX_FREQUENCY = 1000
DEFAULT_SECONDS = 10
DEFAULT_FREQUENCY = 100
MAX_DEPTH = 128
HEAP_FRAMES = 16
HEAP_TOP = 50


class ProfileBusy(Exception):
    """Another CPU profile is running (one at a time)."""


@dataclass
class CpuProfile:
    """Stacks and the CPU nanoseconds (and busy samples) charged to each."""

    frequency: int
    duration_ns: int = 0
    start_ns: int = 0
    cpu_ns: dict[Stack, int] = field(default_factory=dict)
    samples: dict[Stack, int] = field(default_factory=dict)

    def add(self, stack: Stack, cpu_ns: int) -> None:
        self.cpu_ns[stack] = self.cpu_ns.get(stack, 0) + cpu_ns
        self.samples[stack] = self.samples.get(stack, 0) + 1

    def merge(self, other: CpuProfile) -> None:
        """Add another process's profile of the same period (data-plane workers)."""
        for stack, ns in other.cpu_ns.items():
            self.cpu_ns[stack] = self.cpu_ns.get(stack, 0) + ns
        for stack, n in other.samples.items():
            self.samples[stack] = self.samples.get(stack, 0) + n


def _stack(frame: FrameType | None) -> Stack:
    out: list[Frame] = []
    while frame is not None and len(out) < MAX_DEPTH:
        code = frame.f_code
        out.append((code.co_filename, code.co_name, code.co_firstlineno, frame.f_lineno or 0))
        frame = frame.f_back
    out.reverse()
    return tuple(out)


class _Sampler:
    """The sampling thread of one CPU profile."""

    def __init__(self, frequency: int) -> None:
        self.profile = CpuProfile(frequency)
        self.interval = 1.0 / frequency
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ztunnel-cpu-profiler", daemon=True)
        self._clocks: dict[int, tuple[int, int]] = {}  # thread ident -> (clock id, last cpu ns)

    def _cpu_ns(self, ident: int) -> int | None:
        entry = self._clocks.get(ident)
        try:
            clock = entry[0] if entry is not None else time.pthread_getcpuclockid(ident)
            now = time.clock_gettime_ns(clock)
        except OSError:  # the thread exited
            self._clocks.pop(ident, None)
            return None
        last = entry[1] if entry is not None else now
        self._clocks[ident] = (clock, now)
        return now - last

    def _run(self) -> None:
        me = threading.get_ident()
        self.profile.start_ns = time.time_ns()
        started = time.monotonic_ns()
        for ident in sys._current_frames():
            if ident != me:
                self._cpu_ns(ident)  # baseline
        while not self.stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                used = self._cpu_ns(ident)
                if used:  # None (gone) or 0 (idle): nothing to charge
                    self.profile.add(_stack(frame), used)
        self.profile.duration_ns = time.monotonic_ns() - started


class Profiler:
    """The admin's profiling state: at most one CPU profile at a time."""

    def __init__(
        self, others: Callable[[float, int], Awaitable[list[CpuProfile]]] | None = None
    ) -> None:
        self._busy = False
        self._heap_owned = False  # we started tracemalloc for a one-shot heap request
        # The data-plane workers' profiles of the same period, merged into ours (one view of
        # the whole ztunnel, as Rust's profile covers all its threads).
        self.others = others

    async def cpu(self, seconds: float, frequency: int) -> CpuProfile:
        if self._busy:
            raise ProfileBusy("a CPU profile is already being taken")
        self._busy = True
        sampler = _Sampler(frequency)
        sampler.thread.start()
        try:
            if self.others is not None:
                others = await self.others(seconds, frequency)
            else:
                others = []
                await asyncio.sleep(seconds)
        finally:
            sampler.stop.set()
            await asyncio.get_running_loop().run_in_executor(None, sampler.thread.join)
            self._busy = False
        for other in others:
            sampler.profile.merge(other)
        return sampler.profile

    # -- heap ---------------------------------------------------------------------------------

    @staticmethod
    def heap_active() -> bool:
        import tracemalloc

        return tracemalloc.is_tracing()

    def set_heap(self, active: bool) -> None:
        import tracemalloc

        if active and not tracemalloc.is_tracing():
            tracemalloc.start(HEAP_FRAMES)
        elif not active and tracemalloc.is_tracing():
            tracemalloc.stop()
        self._heap_owned = False

    async def heap(self, seconds: float, top: int = HEAP_TOP) -> str:
        """Top allocations now if tracing is on; else trace for ``seconds`` first."""
        import tracemalloc

        if not tracemalloc.is_tracing():
            if self._heap_owned:
                raise ProfileBusy("a heap profile is already being taken")
            tracemalloc.start(HEAP_FRAMES)
            self._heap_owned = True
            try:
                await asyncio.sleep(seconds)
                return heap_report(tracemalloc.take_snapshot(), top)
            finally:
                if self._heap_owned:
                    tracemalloc.stop()
                    self._heap_owned = False
        return heap_report(tracemalloc.take_snapshot(), top)


def heap_report(snapshot: tracemalloc.Snapshot, top: int = HEAP_TOP) -> str:
    """Text: the total traced, then the ``top`` tracebacks by size (innermost frame first)."""
    import tracemalloc

    snapshot = snapshot.filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
    )
    stats = snapshot.statistics("traceback")
    total = sum(s.size for s in stats)
    count = sum(s.count for s in stats)
    lines = [
        f"tracemalloc: {total} bytes in {count} blocks traced "
        f"(allocations made while tracing; {len(stats)} tracebacks)",
        "",
    ]
    for s in stats[:top]:
        lines.append(f"{s.size} bytes in {s.count} blocks")
        for fr in reversed(s.traceback):  # innermost first
            lines.append(f"    {fr.filename}:{fr.lineno}")
        lines.append("")
    return "\n".join(lines)


# --- query parameters -------------------------------------------------------------------------


def parse_int(params: Mapping[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    """A bounded integer parameter; ValueError with the message Rust gives for a bad one."""
    values = params.get(name)
    if not values:
        return default
    try:
        v = int(values[-1])
    except ValueError:
        v = lo - 1
    if not lo <= v <= hi:
        raise ValueError(f"invalid {name} value; expected {lo}-{hi}\n")
    return v


# --- encodings --------------------------------------------------------------------------------


def _frame_name(f: Frame) -> str:
    filename, func, _first, _line = f
    return f"{func} ({filename})"


def collapsed(profile: CpuProfile) -> str:
    """``outer;...;leaf <cpu microseconds>`` per stack (Brendan Gregg's folded format), largest
    first."""
    rows = sorted(profile.cpu_ns.items(), key=lambda kv: -kv[1])
    out = []
    for stack, ns in rows:
        names = ";".join(_frame_name(f).replace(";", ":") for f in stack)
        out.append(f"{names} {max(1, ns // 1000)}")
    return "\n".join(out) + ("\n" if out else "")


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field_no: int, wire: int) -> bytes:
    return _varint(field_no << 3 | wire)


def _int_field(field_no: int, v: int) -> bytes:
    return _key(field_no, 0) + _varint(v) if v else b""


def _bytes_field(field_no: int, data: bytes) -> bytes:
    return _key(field_no, 2) + _varint(len(data)) + data


def _packed(field_no: int, values: list[int]) -> bytes:
    return _bytes_field(field_no, b"".join(_varint(v) for v in values))


class _Strings:
    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}
        self.table: list[str] = [""]

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.table)
            self.table.append(s)
        return i


def _pprof_name(func: str) -> str:
    """pprof simplifies names as C++ and drops ``<...>`` as template arguments, which would
    leave ``<module>``, ``<lambda>`` or ``<genexpr>`` nameless: ``[module]`` etc. instead."""
    if func.startswith("<") and func.endswith(">"):
        return f"[{func[1:-1]}]"
    return func


def pprof(profile: CpuProfile) -> bytes:
    """The gzipped ``perftools.profiles.Profile`` (github.com/google/pprof ``profile.proto``):
    one Function per (file, function), one Location per (function, line), samples leaf first
    with values [samples, cpu nanoseconds]."""
    strings = _Strings()
    functions: dict[tuple[str, str, int], int] = {}
    locations: dict[tuple[int, int], int] = {}
    body = bytearray()

    def value_type(t: str, unit: str) -> bytes:
        return _int_field(1, strings(t)) + _int_field(2, strings(unit))

    body += _bytes_field(1, value_type("samples", "count"))
    body += _bytes_field(1, value_type("cpu", "nanoseconds"))
    loc_msgs = bytearray()
    fn_msgs = bytearray()
    for stack, ns in profile.cpu_ns.items():
        ids: list[int] = []
        for filename, func, first, line in reversed(stack):  # leaf first
            fkey = (filename, func, first)
            fid = functions.get(fkey)
            if fid is None:
                fid = functions[fkey] = len(functions) + 1
                name = _pprof_name(func)
                fn = (
                    _int_field(1, fid)
                    + _int_field(2, strings(name))
                    + _int_field(3, strings(name))
                    + _int_field(4, strings(filename))
                    + _int_field(5, first)
                )
                fn_msgs += _bytes_field(5, fn)
            lkey = (fid, line)
            lid = locations.get(lkey)
            if lid is None:
                lid = locations[lkey] = len(locations) + 1
                line_msg = _int_field(1, fid) + _int_field(2, line)
                loc_msgs += _bytes_field(4, _int_field(1, lid) + _bytes_field(4, line_msg))
            ids.append(lid)
        sample = _packed(1, ids) + _packed(2, [profile.samples.get(stack, 0), ns])
        body += _bytes_field(2, sample)
    body += loc_msgs
    body += fn_msgs
    period_type = value_type("cpu", "nanoseconds")
    for s in strings.table:
        body += _bytes_field(6, s.encode("utf-8"))
    body += _int_field(9, profile.start_ns)
    body += _int_field(10, profile.duration_ns)
    body += _bytes_field(11, period_type)
    body += _int_field(12, 1_000_000_000 // profile.frequency)
    return gzip.compress(bytes(body))
