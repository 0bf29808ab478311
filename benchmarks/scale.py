"""Scale: memory and time of a ztunnel holding a big mesh, and the per-connection decision cost.

As an operator sizing the DaemonSet would try it: a fake istiod (``ztunnel/testing/fakeistiod``,
delta xDS over TLS) holds N pods and S services of realistic shape (``ztunnel/testing/meshgen``)
plus 10 policies; the real ``ztunnel`` CLI runs in dedicated mode inside a pod with istio-cni's
rules, with 1, 2 or 8 data-plane workers, its xDS and certificates from that istiod.

For each (N, S, workers):

- **served after**: seconds from the ztunnel's start until probe connections through 15001 to a
  mesh pod of the snapshot go over HBONE (the destination pod counts what reaches its 15008 and
  its app port: 20 probes in a row on 15008, none ever on the app port), and readiness;
- **PSS** of the ztunnel's process tree once settled (``/proc/PID/smaps_rollup`` summed over the
  supervisor, the zygote and the workers), the state store's file (its pages are shared by every
  process: PSS counts a mapped page once; pages nobody maps are page cache, charged to the pod
  too, so ``footprint`` = PSS + the store's pages outside it), and the peak RSS of the tree
  during ingest (sampled every 100 ms);
- **1% delta**: one push removing 1% of the pods and adding 1% new ones, and changing the probe
  destination (its IPv6 address joins the mesh): seconds until probes to that address go over
  HBONE, and how many probes failed meanwhile (none may);
- **decision cost** (in this process, the same mesh in a State of its own): ``decide_outbound``
  for a pod IP, a service VIP, an unknown address, and a service of 5,000 endpoints, warm
  (repeated destinations) and cold (a different destination every time), µs per decision.

``python benchmarks/scale.py`` (as root): the full table, 0/0 ... 200k/20k with 1, 2 and 8 workers (about
30 minutes). ``--quick``: 0/0, 10k/2k and 50k/10k with 1 and 2 workers. Results:
``benchmarks/results/scale.{json,md,png}``; ``benchmarks/report.py`` puts the table in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

from ztunnel.core.addr import SocketAddr, parse_ip  # noqa: E402
from ztunnel.proxy.route import decide_outbound  # noqa: E402
from ztunnel.state.model import (  # noqa: E402
    NetworkAddress,
    Service,
    ServicePort,
    TunnelProtocol,
    Workload,
)
from ztunnel.state.shared import SharedStore  # noqa: E402
from ztunnel.state.store import State  # noqa: E402
from ztunnel.testing import meshgen  # noqa: E402
from ztunnel.testing.apps import connect_from, listen_in  # noqa: E402
from ztunnel.testing.fakeistiod import ISTIOD_SAN  # noqa: E402
from ztunnel.testing.netns import Pod, Testbed  # noqa: E402
from ztunnel.testing.proc import ZtunnelProcess  # noqa: E402
from ztunnel.testing.xdsbed import ISTIOD_PORT, TOKEN, IstiodThread, http_get  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FULL_SIZES = [(0, 0), (10_000, 2_000), (50_000, 10_000), (100_000, 20_000), (200_000, 20_000)]
QUICK_SIZES = [(0, 0), (10_000, 2_000), (50_000, 10_000)]
APP_PORT = 8080
BUDGET_MIB = 512  # Istio's chart: the Rust ztunnel's memory request


# --- the process tree ---------------------------------------------------------------------------


def proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_kib(root: int) -> int:
    total = 0
    for p in proc_tree(root):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            total += next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
    return total


def pss_kib(root: int) -> tuple[int, int]:
    """(PSS of the tree, PSS of its mappings of the state store's data file), KiB."""
    pss = store = 0
    for p in proc_tree(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next((int(ln.split()[1]) for ln in f if ln.startswith("Pss:")), 0)
            in_store = False
            with open(f"/proc/{p}/smaps") as f:
                for line in f:
                    head = line.split()
                    if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                        in_store = head[-1].endswith("/data.mdb")
                    elif in_store and head and head[0] == "Pss:":
                        store += int(head[1])
    return pss, store


def store_file_kib(root: int) -> int:
    """Size of the state store's data file (the supervisor's open ``data.mdb``), KiB."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{root}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{root}/fd/{fd}")
                if target.endswith("/data.mdb"):
                    return os.stat(target).st_blocks * 512 // 1024
    return 0


class Sampler:
    """Peak RSS of a process tree, sampled every 100 ms in a thread."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, rss_kib(self.root))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


# --- the bed ------------------------------------------------------------------------------------


class Counter:
    """Counts the connections reaching a listener (and closes them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.count = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _bed_workload(pod: Pod, name: str, node: str, *, ipv6: bool = False) -> Workload:
    addrs = (parse_ip(pod.ip4), parse_ip(pod.ip6)) if ipv6 else (parse_ip(pod.ip4),)
    return Workload(
        uid=f"Kubernetes//Pod/bench/{name}",
        name=name,
        namespace="bench",
        addresses=addrs,
        protocol=TunnelProtocol.HBONE,
        service_account=f"sa-{name}",
        node=node,
    )


@dataclass
class Bed:
    client: Pod
    server: Pod
    istiod: IstiodThread
    app: Counter
    hbone: Counter
    env: dict[str, str]


@contextlib.contextmanager
def bed(mesh: meshgen.Mesh) -> Iterator[Bed]:
    with Testbed() as tb:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        client, server = n1.add_pod("client"), n2.add_pod("server")
        client.install_inpod_rules()
        host = tb.add_external("istiod")
        # (A dedicated ztunnel runs in the pod it serves: its control plane is not captured.)
        client.run(
            "iptables", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-d", host.ip4, "-j", "ACCEPT"
        )
        sock = listen_in(host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=True, server_names=(ISTIOD_SAN, host.ip4), accept_tokens=[TOKEN])
        app = Counter(listen_in(server, APP_PORT, backlog=4096))
        hbone = Counter(listen_in(server, 15008, backlog=4096))
        try:
            items: list[Any] = [
                _bed_workload(client, "client", "n1"),
                _bed_workload(server, "server", "n2"),
            ]
            items += mesh.services
            items += mesh.workloads
            istiod.call(istiod.istiod.set_addresses, *items)
            istiod.call(istiod.istiod.set_policies, *mesh.policies)
            istiod.start(sock)
            root = istiod.istiod.root_pem
            address = f"https://{host.ip4}:{ISTIOD_PORT}"
            env = {
                "PROXY_MODE": "dedicated",
                "PROXY_WORKLOAD_INFO": "bench/client/sa-client",
                "NODE_NAME": "n1",
                "XDS_ADDRESS": address,
                "CA_ADDRESS": address,
                "XDS_ROOT_CA": root,
                "CA_ROOT_CA": root,
                "AUTH_TOKEN": TOKEN,
                "RUST_LOG": "info",
            }
            yield Bed(client, server, istiod, app, hbone, env)
        finally:
            app.close()
            hbone.close()
            istiod.close()


class Prober:
    """Connects to ``ip``:APP_PORT from the client pod again and again, counting failures."""

    def __init__(self, b: Bed, ip: str) -> None:
        self.b = b
        self.ip = ip
        self.made = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = connect_from(self.b.client, self.ip, APP_PORT, timeout=5)
            except OSError:
                self.failed += 1
            else:
                self.made += 1
                s.close()
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _ready(b: Bed) -> bool:
    try:
        return http_get(b.client, 15021, "/healthz/ready", timeout=1)[0] == 200
    except OSError:
        return False


def _wait_over_hbone(counter: Counter, want: int, timeout: float) -> float | None:
    """Seconds until ``counter`` grew by ``want`` (None: not within ``timeout``)."""
    start = counter.count
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if counter.count - start >= want:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def run_one(pods: int, services: int, workers: int, mesh: meshgen.Mesh) -> dict[str, Any]:
    row: dict[str, Any] = {"pods": pods, "services": services, "workers": workers}
    with bed(mesh) as b:
        zt = ZtunnelProcess(b.client, {**b.env, "ZTUNNEL_WORKER_THREADS": str(workers)})
        prober = Prober(b, b.server.ip4)
        t0 = time.monotonic()
        zt.start(timeout=60)
        sampler = Sampler(zt.pid)
        try:
            deadline = t0 + 300
            while not _ready(b):
                if time.monotonic() > deadline:
                    raise TimeoutError("never ready")
                time.sleep(0.05)
            row["ready_s"] = round(time.monotonic() - t0, 2)
            # Served: 20 probes in a row over HBONE (workers share the queue: several of each).
            while _wait_over_hbone(b.hbone, 20, 5) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("never served over HBONE")
            row["served_s"] = round(time.monotonic() - t0, 2)
            row["peak_rss_mib"] = round(sampler.stop() / 1024, 1)
            time.sleep(8)  # settled (the idle trimmer returns the ingest's freed heap)
            row["rss_mib"] = round(rss_kib(zt.pid) / 1024, 1)
            pss, store_pss = pss_kib(zt.pid)
            store = store_file_kib(zt.pid)
            row["pss_mib"] = round(pss / 1024, 1)
            row["store_file_mib"] = round(store / 1024, 1)
            row["footprint_mib"] = round((pss + max(0, store - store_pss)) / 1024, 1)
            row["plaintext_probes"] = b.app.count  # (must stay 0)
            prober.stop()
            if pods:
                row.update(_delta(b, mesh, pods, services))
        finally:
            prober.stop()
            rc = zt.stop()
            if rc != 0:
                row["exit"] = rc
    return row


def _delta(b: Bed, mesh: meshgen.Mesh, pods: int, services: int) -> dict[str, Any]:
    """1% of the pods replaced in one push, with the probe destination's IPv6 joining the mesh."""
    k = max(1, pods // 100)
    removed = [w.uid for w in mesh.workloads[:k]]
    added = [meshgen.pod(i, services, generation=1) for i in range(k)]
    server = _bed_workload(b.server, "server", "n2", ipv6=True)
    ip6 = b.server.ip6
    app_before = b.app.count
    prober = Prober(b, ip6)
    time.sleep(0.5)  # (probes to the IPv6 go to the app port until the push)
    before_failed = prober.failed
    hb = b.hbone.count

    def push() -> None:
        istiod = b.istiod.istiod
        istiod.remove_addresses(*removed)
        istiod.set_addresses(server, *added)

    t0 = time.monotonic()
    b.istiod.call(push)
    took = None
    while time.monotonic() - t0 < 60:
        if b.hbone.count - hb >= 20:
            took = time.monotonic() - t0
            break
        time.sleep(0.01)
    time.sleep(0.5)
    prober.stop()
    return {
        "delta_pods": k,
        "delta_s": None if took is None else round(took, 2),
        "delta_failed_probes": prober.failed - before_failed,
        "delta_plaintext_before": b.app.count - app_before,
    }


# --- the decision cost ---------------------------------------------------------------------------


def decision_costs(pods: int, services: int, mesh: meshgen.Mesh, rounds: int = 9) -> dict[str, Any]:
    """µs per ``decide_outbound`` (median of ``rounds``), warm and cold, in a State that holds the
    mesh and a 5,000-endpoint service, read as a worker reads it (a reader view of the store)."""
    writer = State(store=SharedStore.create())
    big = Service(
        name="big",
        namespace="big",
        hostname="big.big.svc.cluster.local",
        vips=(NetworkAddress("", ipaddress.IPv4Address("10.95.0.1")),),
        ports=(ServicePort(80, 8080),),
    )
    with writer.batch():
        for s in mesh.services:
            writer.upsert_service(s)
        for w in mesh.workloads:
            writer.upsert_workload(w)
        writer.upsert_service(big)
        for i in range(5000):
            writer.upsert_workload(
                replace(
                    meshgen.pod(10_000_000 + i, 0),
                    uid=f"Kubernetes//Pod/big/b{i}",
                    name=f"b{i}",
                    namespace="big",
                    addresses=(ipaddress.IPv4Address(int(ipaddress.IPv4Address("10.96.0.0")) + i),),
                    services={big.key: {80: 8080}},
                )
            )
    state = State(store=writer.store.reader())
    source = mesh.workloads[0] if mesh.workloads else None
    rng = random.Random(1)
    n = 2000
    pod_dsts = (
        [SocketAddr(meshgen.pod_ip(rng.randrange(pods)), 8080) for _ in range(n)] if pods else []
    )
    vip_dsts = (
        [SocketAddr(meshgen.vip(rng.randrange(services)), 80) for _ in range(n)] if services else []
    )
    unknown = [
        SocketAddr(ipaddress.IPv4Address(int(ipaddress.IPv4Address("172.16.0.0")) + i), 80)
        for i in range(n)
    ]
    big_dst = [SocketAddr(ipaddress.IPv4Address("10.95.0.1"), 80)] * n
    out: dict[str, Any] = {}
    for label, dsts in (
        ("pod_ip", pod_dsts),
        ("vip", vip_dsts),
        ("unknown", unknown),
        ("service_5000", big_dst),
    ):
        if not dsts:
            continue
        for mode in ("warm", "cold"):
            runs = []
            for _ in range(rounds):
                batch = dsts if mode == "cold" else dsts[:20] * (n // 20)
                if mode == "cold":
                    state._reset_caches()  # (a different destination every time, none cached)
                gc.collect()
                t = time.thread_time()
                for d in batch:
                    decide_outbound(state, source, d)
                runs.append((time.thread_time() - t) / len(batch) * 1e6)
            # The median says what a loaded node sees; the minimum, the cost itself (the
            # machine this runs on is shared: other work inflates every round differently).
            out[f"{label}_{mode}_us"] = round(statistics.median(runs), 2)
            out[f"{label}_{mode}_min_us"] = round(min(runs), 2)
    # A pick table for the big service after its endpoints changed (once per change, not per
    # connection): one endpoint's upsert, then the first decision.
    b0 = writer.find_workload_by_uid("Kubernetes//Pod/big/b0")
    assert b0 is not None
    with writer.batch():
        writer.upsert_workload(replace(b0, capacity=2))
    state.apply_changes([])
    state._reset_caches()
    t = time.thread_time()
    decide_outbound(state, source, big_dst[0])
    out["service_5000_rebuild_ms"] = round((time.thread_time() - t) * 1e3, 2)
    writer.close()
    writer.store.close()
    return out


# --- report ----------------------------------------------------------------------------------------


def markdown(doc: dict[str, Any]) -> str:
    return "\n".join(report.scale_block(doc)).lstrip("\n") + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for workers in sorted({r["workers"] for r in doc["rows"]}):
        rows = sorted(
            (r for r in doc["rows"] if r["workers"] == workers and "pss_mib" in r),
            key=lambda r: r["pods"],
        )
        ax.plot(
            [r["pods"] / 1000 for r in rows],
            [r["pss_mib"] for r in rows],
            marker="o",
            label=f"{workers} worker(s)",
        )
    ax.axhline(BUDGET_MIB, color="grey", linestyle="--", label="chart budget 512 MiB")
    ax.set_xlabel("pods (thousands)")
    ax.set_ylabel("PSS of the ztunnel tree (MiB)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", help="e.g. 0/0,10000/2000 (default: the full or --quick table)")
    ap.add_argument("--workers", default=None, help="e.g. 1,2,8")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("scale.py needs root (network namespaces)", file=sys.stderr)
        return 2
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = [tuple(int(x) for x in s.split("/")) for s in args.sizes.split(",")]  # type: ignore[misc]
    workers = [int(w) for w in (args.workers or ("1,2" if args.quick else "1,2,8")).split(",")]
    doc: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python benchmarks/scale.py", *sys.argv[1:]]),
        "rows": [],
    }
    biggest = max(sizes)
    for pods, services in sizes:
        mesh = meshgen.mesh(pods, services)
        for w in workers:
            print(f"{pods}/{services} with {w} worker(s)...", flush=True)
            row = run_one(pods, services, w, mesh)
            print("   ", row, flush=True)
            doc["rows"].append(row)
        if (pods, services) == biggest:
            doc["decisions"] = {
                "pods": pods,
                "services": services,
                **decision_costs(pods, services, mesh),
            }
            print("    decisions:", doc["decisions"], flush=True)
        del mesh
        gc.collect()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(doc))
    with contextlib.suppress(ImportError):
        plot(doc, args.out.with_suffix(".png"))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
