"""Two designs for one copy of the mesh state per node, side by side (the scale issue's choice).

For a mesh of N pods (``ztunnel/testing/meshgen``), a writer process and W reader processes
(the supervisor and its workers), each reader looking every pod up once by IP (every page
touched: the worst case for sharing):

- **lmdb** (chosen, ``ztunnel/state/shared.py``): the writer fills the store; each reader maps
  it read-only (``State.open``) and looks up through it.
- **replica**: a compact in-memory replica in every process: the same records (``marshal``
  tuples with interned strings, ``state/records.py``) in dicts, with the address, name and
  endpoint indexes as dicts of ints. Every process builds its own, as each worker would from
  the supervisor's stream (sharing after fork does not survive: reading a dict entry writes its
  reference count, which unshares the page).
- **objects** (before): the model objects in every process, as the State of ``--old`` (a
  checkout of the code before the change) keeps them.

Reports the memory the state costs: PSS summed over the W+1 processes (``/proc/PID/smaps_rollup``)
plus the store's pages in the page cache that no process maps, less what each process had after
its imports (separate interpreters here, where ztunnel's workers share their imports with the
zygote they are forked from); and the cost of one lookup by IP, cold (each pod once).

``python benchmarks/bench_state_designs.py --pods 100000 --workers 2,8 [--old PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

READER = r"""
import marshal, os, sys, time
sys.path.insert(0, {root!r})
from ztunnel.testing import meshgen
design, path, pods = sys.argv[1], sys.argv[2], int(sys.argv[3])
import ztunnel.state.store, ztunnel.state.model, gc
gc.collect()
print(next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:")), flush=True)
if design == "lmdb":
    from ztunnel.state.store import State
    from ztunnel.state.model import NetworkAddress
    st = State.open(path)
    look = lambda ip: st.find_workload_by_addr(NetworkAddress("", ip))
elif design == "replica":
    from ztunnel.state.records import workload_tuple, W_ADDRS, W_NS, W_NAME
    strings, ids = [""], {{"": 0}}
    def intern(s):
        i = ids.get(s)
        if i is None:
            i = ids[s] = len(strings); strings.append(s)
        return i
    records, by_addr, by_name, endpoints = {{}}, {{}}, {{}}, {{}}
    for wid in range(pods):
        t = workload_tuple(meshgen.pod(wid, pods // 10), intern)
        records[wid] = marshal.dumps(t)
        for a in t[W_ADDRS]:
            by_addr[a] = wid
        by_name[(t[W_NS], t[W_NAME])] = wid
        for k, _ in t[18]:
            endpoints.setdefault(k, []).append(wid)
    look = lambda ip: marshal.loads(records[by_addr[ip.packed]])
else:
    from ztunnel.state.store import State
    from ztunnel.state.model import NetworkAddress
    st = State()
    for j in range(pods // 10):
        st.upsert_service(meshgen.service(j))
    for i in range(pods):
        st.upsert_workload(meshgen.pod(i, pods // 10))
    look = lambda ip: st.find_workload_by_addr(NetworkAddress("", ip))
import gc; gc.collect()
t = time.perf_counter()
for i in range(pods):
    look(meshgen.pod_ip(i))
print(f"{{(time.perf_counter() - t) / pods * 1e6:.2f}}", flush=True)
sys.stdin.read()
"""


def pss_kib(pid: int) -> tuple[int, int]:
    """(PSS, PSS of mappings of a data.mdb) of one process, KiB."""
    pss = store = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
    in_store = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                in_store = head[-1].endswith("/data.mdb")
            elif in_store and head and head[0] == "Pss:":
                store += int(head[1])
    return pss, store


def run(design: str, pods: int, workers: int, old: Path | None) -> dict[str, Any]:
    root = str(old if design == "objects" and old else ROOT)
    env = {**os.environ, "PYTHONPATH": root}
    store_path = ""
    procs: list[subprocess.Popen[str]] = []
    store_file = 0
    writer = None
    baseline = 0  # PSS of every process after its imports, before any state
    if design == "lmdb":
        # The writer: this benchmark's child that fills a store and stays (the supervisor).
        code = (
            f"import sys; sys.path.insert(0, {root!r})\n"
            "from ztunnel.testing import meshgen\n"
            "from ztunnel.state.shared import SharedStore\n"
            "from ztunnel.state.store import State\n"
            "import gc; gc.collect()\n"
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('Pss:')), flush=True)\n"
            "st = State(store=SharedStore.create())\n"
            "with st.batch():\n"
            f"    for j in range({pods // 10}): st.upsert_service(meshgen.service(j))\n"
            f"    for i in range({pods}): st.upsert_workload(meshgen.pod(i, {pods // 10}))\n"
            "gc.collect()\n"
            "print(st.store.path, flush=True)\nimport sys; sys.stdin.read()\n"
        )
        writer = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert writer.stdout is not None
        baseline = int(writer.stdout.readline())
        store_path = writer.stdout.readline().strip()
        store_file = os.stat(os.path.join(store_path, "data.mdb")).st_blocks * 512 // 1024
        procs.append(writer)
        readers = workers
    else:
        readers = workers + 1  # (the supervisor holds a replica too)
    costs = []
    reader_code = READER.format(root=root)
    for _ in range(readers):
        p = subprocess.Popen(
            [sys.executable, "-c", reader_code, design, store_path, str(pods)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert p.stdout is not None
        baseline += int(p.stdout.readline())
        costs.append(float(p.stdout.readline()))
        procs.append(p)
    time.sleep(1)
    total = mapped_store = 0
    for p in procs:
        pss, store = pss_kib(p.pid)
        total += pss
        mapped_store += store
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(30)
    if store_path:
        import shutil

        shutil.rmtree(store_path, ignore_errors=True)
    footprint = total + max(0, store_file - mapped_store)
    return {
        "design": design,
        "pods": pods,
        "workers": workers,
        "pss_mib": round(total / 1024, 1),
        "state_pss_mib": round((footprint - baseline) / 1024, 1),
        "store_file_mib": round(store_file / 1024, 1),
        "footprint_mib": round(footprint / 1024, 1),
        "lookup_us": round(sorted(costs)[len(costs) // 2], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--workers", default="2,8")
    ap.add_argument("--old", type=Path, help="a checkout of the code before the shared store")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "state_designs.json"
    )
    args = ap.parse_args()
    rows = []
    designs = ["lmdb", "replica"] + (["objects"] if args.old else [])
    for w in [int(x) for x in args.workers.split(",")]:
        for d in designs:
            row = run(d, args.pods, w, args.old)
            print(row, flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print("| design | workers | state MiB (all processes) | PSS MiB | lookup µs (cold) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['design']} | {r['workers']} | {r['state_pss_mib']} | {r['pss_mib']} "
            f"| {r['lookup_us']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
