"""Syscalls per new connection: ztunnel-py against HAProxy on the same in-pod path.

The suite's bed (``benchmarks/suite.py``): pod ``a``'s ztunnel carries connections to pod ``d``
(TCP passthrough, captured on 15001) or to pod ``b`` (HBONE, both ztunnels); HAProxy ``nbthread
1`` sits behind the same REDIRECT in pod ``h`` and forwards to each connection's original
destination. For each path, ``strace -c -f`` is attached to every process of the proxy's tree
(a ztunnel: supervisor, zygote, workers) while the suite's connection generator (``crr``:
connect, 1-byte echo, close) runs; the counts divided by the connections the generator made are
syscalls per connection, by name. strace slows the proxies down, but counts do not depend on
speed, so this is repeatable on a busy machine; nothing here is timed.

``sudo python benchmarks/syscalls.py`` (about a minute). Results:
``benchmarks/results/syscalls.json``; ``benchmarks/report.py`` puts the table in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import suite

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ("ztunnel-tcp", "haproxy-inpod", "ztunnel-hbone")

# One row of strace -c's table: % time, seconds, usecs/call, calls, [errors], syscall
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?([a-z_0-9]+)\s*$")


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls by syscall name from ``strace -c``'s summary table (the total row left out)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and m.group(2) != "total":
            calls[m.group(2)] = calls.get(m.group(2), 0) + int(m.group(1))
    return calls


def count(p: Any, seconds: float, out: Path) -> dict[str, Any]:
    """strace -c -f over ``p``'s proxy trees during ``seconds`` of new connections."""
    pids = sorted({pid for root in p.pids.values() for pid in suite.proc_tree(root)})
    argv = ["strace", "-c", "-f", "-o", str(out)]
    for pid in pids:
        argv += ["-p", str(pid)]
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # (attached to every process before the first connection)
        r = suite.run_crr(p, seconds, 1)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    calls = parse_strace_summary(out.read_text())
    conns = max(1, int(r["conns"]))
    per = {k: v / conns for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}
    return {
        "processes": len(pids),
        "conns": conns,
        "errors": r.get("errors", 0),
        "per_conn": round(sum(calls.values()) / conns, 2),
        "by_syscall": {k: round(v, 2) for k, v in per.items() if v >= 0.05},
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "syscalls.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("syscalls.py needs root (network namespaces, strace -p)", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/syscalls.py",
        "workers": os.environ.get("ZTUNNEL_WORKER_THREADS", "2"),
        "paths": {},
    }
    with suite.suite_bed("uvloop") as (paths, _), tempfile.TemporaryDirectory() as tmp:
        by_name = {p.name: p for p in paths}
        for name in PATHS:  # warm-up: pooled HBONE connections, caches
            suite.run_crr(by_name[name], 1.0, 1)
        for name in PATHS:
            doc["paths"][name] = count(by_name[name], args.seconds, Path(tmp, f"{name}.txt"))
            print(name, json.dumps(doc["paths"][name]), flush=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
