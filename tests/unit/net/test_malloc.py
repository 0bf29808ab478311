"""ztunnel.net.malloc: the data-path thresholds keep freed buffers; the idle trimmer returns them."""

from __future__ import annotations

import asyncio
import ctypes.util

import pytest

from ztunnel.net.malloc import IdleTrimmer, tune_malloc

GLIBC = ctypes.util.find_library("c") is not None and IdleTrimmer().available


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_trim_returns_freed_buffers_kept_by_the_thresholds() -> None:
    assert tune_malloc()
    trimmer = IdleTrimmer()
    IdleTrimmer(min_free=0).maybe_trim()  # start from a trimmed heap (earlier tests freed memory)
    before = _rss_kib()
    # 64 MiB in 256 KiB buffers (the TLS/socket buffer size), pinned by small objects after them
    # so that the heap top cannot shrink by itself, then freed: the thresholds keep the pages.
    bufs = [bytearray(256 << 10) for _ in range(256)]
    pins = [bytes(64) + bytes([i % 256]) for i in range(20000)]
    del bufs
    kept = _rss_kib() - before
    assert trimmer.free_bytes() > 32 << 20
    assert kept > 32 << 10, kept
    assert trimmer.maybe_trim()
    assert _rss_kib() - before < kept - (32 << 10)
    assert trimmer.trims == 1
    del pins


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_no_trim_below_the_minimum() -> None:
    trimmer = IdleTrimmer(min_free=1 << 40)
    assert not trimmer.maybe_trim()
    assert trimmer.trims == 0


async def test_run_trims_every_interval() -> None:
    trimmer = IdleTrimmer(min_free=0)
    task = asyncio.create_task(trimmer.run(0.01))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trimmer.trims >= 2 or not trimmer.available


async def test_run_calls_the_releasers_every_interval() -> None:
    calls: list[int] = []
    trimmer = IdleTrimmer(release=(lambda: calls.append(1),))
    task = asyncio.create_task(trimmer.run(0.01))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(calls) >= 2
