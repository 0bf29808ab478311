"""glibc malloc tuning for the data path: keep freed buffers during load, give them back after.

Every TLS flush and socket read allocates buffers of ~256 KiB. With glibc's defaults such blocks
sit at the top of the heap (or in fresh mmaps), are given back with brk/munmap on free, and the
next allocation faults the zeroed pages in again: 450k page faults per GiB on the HBONE sender,
about 45% of its CPU (benchmarks/bench_hbone.py profile). Raising the mmap and trim thresholds
keeps that memory in the heap: +50-60% HBONE throughput per core, measured in the same run.

The cost would be that up to the trim threshold of freed memory (128 MiB) stays in the process
after a burst, so :class:`IdleTrimmer` bounds it: every few seconds it asks glibc how much free
memory the heaps hold (``mallinfo2``) and, past :data:`TRIM_MIN_FREE`, calls ``malloc_trim(0)``,
which returns the free pages of every arena to the kernel. Under steady load the buffers are
reused between two trims, so a trim costs a few thousand page faults every interval instead of
hundreds of thousands per GiB (benchmarks/bench_hbone.py: the ``notrim`` variant).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("ztunnel.net")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# Trim once the heaps hold more free memory than this (a trim below it is not worth a syscall).
TRIM_MIN_FREE = 1 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def tune_malloc(
    *, mmap_threshold: int = 32 << 20, trim_threshold: int = 128 << 20, top_pad: int = 16 << 20
) -> bool:
    """Apply the settings; False where the C library has no ``mallopt`` (not glibc)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, mmap_threshold),
            (M_TRIM_THRESHOLD, trim_threshold),
            (M_TOP_PAD, top_pad),
        )
    )
    if not ok:
        log.warning("mallopt refused the data-path malloc settings")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class IdleTrimmer:
    """Returns the heaps' free memory to the kernel once it exceeds ``min_free`` (glibc only).

    ``release``: callables run on every tick before the trim, on the event loop between
    callbacks (buffers held outside the heap give their pages back there).
    """

    def __init__(
        self, min_free: int = TRIM_MIN_FREE, release: tuple[Callable[[], None], ...] = ()
    ) -> None:
        self.min_free = min_free
        self.release = release
        self.trims = 0
        self.seconds = 0.0  # time spent in malloc_trim, for the runtime stats
        libc = _libc()
        trim = getattr(libc, "malloc_trim", None)
        info = getattr(libc, "mallinfo2", None)  # glibc >= 2.33
        if trim is not None:
            trim.argtypes = [ctypes.c_size_t]
            trim.restype = ctypes.c_int
        if info is not None:
            info.argtypes = []
            info.restype = _MallInfo2
        self._trim = trim
        self._info = info

    @property
    def available(self) -> bool:
        return self._trim is not None

    def free_bytes(self) -> int:
        """Free memory in the main heap and every arena (0 without ``mallinfo2``)."""
        if self._info is None:
            return 0
        return int(self._info().fordblks)

    def maybe_trim(self) -> bool:
        """Trim if the free memory is worth it (or if it cannot be asked); True if trimmed."""
        if self._trim is None:
            return False
        if self._info is not None and self.free_bytes() < self.min_free:
            return False
        t = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t
        self.trims += 1
        return True

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for fn in self.release:
                fn()
            self.maybe_trim()
