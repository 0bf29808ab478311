"""The certificate leak of issue 16, end to end: a shared-mode ztunnel fed by the fake istiod
sees workloads with new service accounts come to its node and leave, over and over; every
departed identity's certificate is forgotten (Rust ProxyStateUpdater::remove_internal ->
clear_cert), so its renewal task ends and the process's task count returns to its baseline."""

from __future__ import annotations

import time

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.testing.proc import ZtunnelProcess
from ztunnel.testing.xdsbed import MeshPod, xds_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(240),
]

PODS = (MeshPod("a", "n1", "sa-a"),)
ROUNDS, BATCH = 6, 50  # 300 identities


def rss_kib(zt: ZtunnelProcess) -> int:
    with open(f"/proc/{zt.pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def settled_tasks(zt: ZtunnelProcess, want: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        tasks = int(zt.runtime_stats()["tasks"])
        if tasks <= want or time.monotonic() > deadline:
            return tasks
        time.sleep(0.2)


def test_departed_identities_free_their_renewal_tasks() -> None:
    with xds_mesh(PODS) as m:
        zt = m.ztunnels["n1"]
        istiod = m.istiod
        time.sleep(1)
        base_tasks = int(zt.runtime_stats()["tasks"])
        base_rss = rss_kib(zt)
        csrs0 = istiod.call(lambda: len(istiod.istiod.csrs))
        for r in range(ROUNDS):
            batch = [
                Workload(
                    uid=f"cluster1//v1/Pod/churn/p{r}-{i}",
                    name=f"p{r}-{i}",
                    namespace="churn",
                    addresses=(parse_ip(f"10.77.{r}.{i + 1}"),),
                    protocol=TunnelProtocol.HBONE,
                    service_account=f"sa-{r}-{i}",
                    node="n1",
                )
                for i in range(BATCH)
            ]
            istiod.call(istiod.istiod.set_addresses, *batch)
            want = csrs0 + (r + 1) * BATCH  # one certificate per new identity (prefetch)
            deadline = time.monotonic() + 60
            while istiod.call(lambda: len(istiod.istiod.csrs)) < want:
                assert time.monotonic() < deadline, "certificates were not prefetched"
                time.sleep(0.1)
            istiod.call(istiod.istiod.remove_addresses, *(w.uid for w in batch))
        tasks = settled_tasks(zt, base_tasks)
        grown = rss_kib(zt) - base_rss
        print(
            f"\n{ROUNDS * BATCH} identities came and went: tasks {base_tasks} -> {tasks}, "
            f"RSS +{grown} KiB ({grown / (ROUNDS * BATCH):.2f} KiB per identity)"
        )
        assert tasks <= base_tasks, (base_tasks, tasks)
