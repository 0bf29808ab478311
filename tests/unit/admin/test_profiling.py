"""``/debug/pprof/*``: the sampling CPU profiler, its two encodings, and the heap snapshot. The
pprof encoding is read back by ``go tool pprof`` (an independent decoder)."""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import tempfile
import threading
import time
import tracemalloc

import pytest

from tests.unit.admin import request
from tests.unit.admin.test_servers import make_admin, serve
from ztunnel.admin import profiling

pytestmark = pytest.mark.timeout(60)

F_OUTER = ("/src/app.py", "main", 1, 10)
F_A = ("/src/a.py", "alpha", 5, 7)
F_B = ("/src/b.py", "beta", 20, 22)


def sample_profile() -> profiling.CpuProfile:
    p = profiling.CpuProfile(frequency=100, duration_ns=2_000_000_000, start_ns=1)
    p.add((F_OUTER, F_A), 30_000_000)
    p.add((F_OUTER, F_A), 10_000_000)
    p.add((F_OUTER, F_B), 5_000_000)
    return p


def test_collapsed_is_folded_stacks_largest_first() -> None:
    assert profiling.collapsed(sample_profile()) == (
        "main (/src/app.py);alpha (/src/a.py) 40000\nmain (/src/app.py);beta (/src/b.py) 5000\n"
    )
    assert profiling.collapsed(profiling.CpuProfile(frequency=100)) == ""


def go_pprof(data: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".pb.gz") as f:
        f.write(data)
        f.flush()
        r = subprocess.run(
            ["go", "tool", "pprof", *flags, f.name],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": tempfile.gettempdir()},
        )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_pprof_reads_back_in_go_tool_pprof() -> None:
    data = profiling.pprof(sample_profile())
    assert gzip.decompress(data)  # gzipped, as Go's profiles are
    top = go_pprof(data, "-top")
    assert "Type: cpu" in top and "Duration: 2s" in top
    assert "Total samples = 45ms" in top
    rows = {
        ln.split()[-1]: ln.split()
        for ln in top.splitlines()
        if ln.strip().endswith(("alpha", "beta", "main"))
    }
    assert rows["alpha"][0] == "40ms" and rows["beta"][0] == "5ms" and rows["main"][3] == "45ms"
    # Sample counts are the other value type.
    counts = go_pprof(data, "-top", "-sample_index=samples")
    assert any(ln.split()[:1] == ["2"] and ln.endswith("alpha") for ln in counts.splitlines())
    files = go_pprof(data, "-top", "-files")
    assert "/src/a.py" in files and "/src/b.py" in files


def test_pprof_keeps_names_in_angle_brackets_visible() -> None:
    p = profiling.CpuProfile(frequency=100, duration_ns=10**9)
    p.add((("/x/run.py", "<module>", 1, 3), ("/x/a.py", "<lambda>", 5, 5)), 10**7)
    top = go_pprof(profiling.pprof(p), "-top")
    assert "[lambda]" in top and "[module]" in top, top


def _spin_here(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


async def test_sampler_charges_cpu_to_the_busy_stack_only() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=_spin_here, args=(stop,))
    idle = threading.Thread(target=stop.wait)
    busy.start()
    idle.start()
    try:
        prof = await profiling.Profiler().cpu(0.5, 200)
    finally:
        stop.set()
        busy.join()
        idle.join()
    spinning = sum(ns for st, ns in prof.cpu_ns.items() if any(f[1] == "_spin_here" for f in st))
    waiting = sum(ns for st, ns in prof.cpu_ns.items() if any(f[1] == "wait" for f in st))
    # A spinning thread gets a good share of 0.5 s (the machine is shared); an idle one none.
    assert spinning > 0.05e9, prof.cpu_ns
    assert waiting < spinning / 20, prof.cpu_ns
    assert prof.duration_ns >= 0.45e9
    assert not any(t.name == "ztunnel-cpu-profiler" for t in threading.enumerate())


async def test_one_cpu_profile_at_a_time() -> None:
    p = profiling.Profiler()
    first = asyncio.ensure_future(p.cpu(0.3, 50))
    await asyncio.sleep(0.05)
    with pytest.raises(profiling.ProfileBusy):
        await p.cpu(0.1, 50)
    await first
    await p.cpu(0.05, 50)  # free again


async def test_heap_one_shot_and_toggle() -> None:
    assert not tracemalloc.is_tracing()
    p = profiling.Profiler()
    keep: list[bytes] = []

    async def allocate() -> None:
        await asyncio.sleep(0.05)
        keep.extend(bytes(1000) + bytes([i % 256]) for i in range(2000))

    task = asyncio.ensure_future(allocate())
    text = await p.heap(0.3)
    await task
    assert not tracemalloc.is_tracing()  # the one-shot stopped what it started
    assert text.startswith("tracemalloc: ")
    assert __file__ in text  # the allocating line is in the top tracebacks
    p.set_heap(True)
    try:
        assert p.heap_active()
        assert (await p.heap(100)).startswith("tracemalloc: ")  # active: answers at once
    finally:
        p.set_heap(False)
    assert not p.heap_active()


async def test_admin_endpoints_parameters() -> None:
    srv = await serve(make_admin())
    try:
        t0 = time.monotonic()
        r = await request(srv.port, "GET", "/debug/pprof/profile?seconds=1&format=collapsed")
        assert r.status == 200 and time.monotonic() - t0 >= 1.0
        r = await request(srv.port, "GET", "/debug/pprof/profile?seconds=1")
        assert (r.status, r.headers["content-type"]) == (200, "application/octet-stream")
        assert "Type: cpu" in go_pprof(r.body, "-top")
        # Rust handle_pprof: seconds 1-300, frequency 1-1000, 400 with this text otherwise.
        for q, msg in (
            ("seconds=0", "invalid seconds value; expected 1-300\n"),
            ("seconds=301", "invalid seconds value; expected 1-300\n"),
            ("seconds=x", "invalid seconds value; expected 1-300\n"),
            ("frequency=1001", "invalid frequency value; expected 1-1000\n"),
        ):
            r = await request(srv.port, "GET", f"/debug/pprof/profile?{q}")
            assert (r.status, r.text) == (400, msg)
        r = await request(srv.port, "GET", "/debug/pprof/profile?seconds=1&format=svg")
        assert r.status == 400
        # Rust handle_pprof: any method (here a POST whose parameters are read, then refused).
        r = await request(srv.port, "POST", "/debug/pprof/profile?seconds=0")
        assert (r.status, r.text) == (400, "invalid seconds value; expected 1-300\n")
        r = await request(srv.port, "GET", "/debug/pprof/heap/profiling?activate=maybe")
        assert r.status == 400
        r = await request(srv.port, "GET", "/debug/pprof/heap/profiling?activate=true")
        assert r.text == "heap profiling active: true\n"
        r = await request(srv.port, "GET", "/debug/pprof/heap")
        assert r.status == 200 and r.text.startswith("tracemalloc: ")
        r = await request(srv.port, "GET", "/debug/pprof/heap/profiling?activate=false")
        assert r.text == "heap profiling active: false\n"
    finally:
        tracemalloc.stop()
        await srv.close()
