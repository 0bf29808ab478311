"""The data plane of one process: what it builds and which housekeeping it runs."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.config import Config, WorkloadInfo
from ztunnel.dataplane import DataPlane, DataPlaneError, tls_policy
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import SecretManager
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(20)


def _dataplane(**kw: object) -> DataPlane:
    cfg = Config()
    secrets = SecretManager(LocalCA.ephemeral(trust_domain="cluster.local"))
    return DataPlane(cfg, State(), secrets, CollectorRegistry(), tag="t", **kw)  # type: ignore[arg-type]


async def test_builds_instances_of_the_chosen_class() -> None:
    dp = _dataplane()
    inst = dp.build(WorkloadInfo("ns", "a", "sa"), None, "ns/a")
    assert type(inst) is ProxyInstance and inst.companions  # (the DNS proxy is on by default)

    class Other(ProxyInstance):
        pass

    dp.instance_class = Other
    assert type(dp.build(WorkloadInfo("ns", "b", "sa"), None)) is Other
    await dp.close()


async def test_a_supervisor_runs_only_the_malloc_trim() -> None:
    dp = _dataplane()
    dp.start(proxies=False)
    await asyncio.sleep(0)
    assert len(dp._tasks) == (1 if dp.trimmer is not None and dp.trimmer.available else 0)
    await dp.close()
    full = _dataplane()
    full.start()
    assert len(full._tasks) >= 1  # (the byte-counter flush at least)
    await full.close()


def test_worker_metrics_leave_the_build_info_to_the_supervisor() -> None:
    reg = CollectorRegistry()
    secrets = SecretManager(LocalCA.ephemeral(trust_domain="cluster.local"))
    DataPlane(Config(), State(), secrets, reg, tag="t", build_info=False, process_metrics=False)
    assert reg.get_sample_value("istio_build", {"component": "ztunnel", "tag": "t"}) is None
    assert reg.get_sample_value("process_open_fds") is None


def test_a_bad_crl_file_is_a_data_plane_error(tmp_path: object) -> None:
    from dataclasses import replace
    from pathlib import Path

    bad = Path(str(tmp_path)) / "crl.pem"
    bad.write_bytes(b"not a CRL")
    with pytest.raises(DataPlaneError, match="CRL_PATH"):
        tls_policy(replace(Config(), crl_path=bad), CollectorRegistry())


@pytest.mark.parametrize(("workers", "share"), [(1, 32 << 20), (2, 16 << 20), (8, 4 << 20)])
async def test_each_process_gets_its_share_of_the_node_copy_budget(
    workers: int, share: int
) -> None:
    """ZTUNNEL_COPY_BUDGET bounds the whole node: each of N worker processes' pipe pools gets
    budget/N (ARCHITECTURE "Workers")."""
    cfg = Config.from_env({"ZTUNNEL_WORKER_THREADS": str(workers), "PROXY_MODE": "shared"})
    assert cfg.copy_budget == 32 << 20
    secrets = SecretManager(LocalCA.ephemeral(trust_domain="cluster.local"))
    dp = DataPlane(cfg, State(), secrets, CollectorRegistry(), tag="t")
    assert dp.pipes is not None and dp.pipes.stats().budget == share
    await dp.close()
    half = Config.from_env({"ZTUNNEL_COPY_BUDGET": str(8 << 20)})
    assert half.copy_budget == 8 << 20
