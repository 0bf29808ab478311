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


SOCKS5_STATE = """
workloads:
- uid: c//v1/Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: sa
  trustDomain: cluster.local
  workloadIps: ["10.0.1.2"]
  protocol: HBONE
services:
- name: s1
  namespace: ns
  hostname: s1.ns.svc.cluster.local
  vips: ["/10.96.0.20"]
  ports: {80: 8080}
"""


async def test_socks5_hostnames_are_answered_by_the_instances_dns_proxy() -> None:
    """Rust ProxyFactory::new_proxies_from_factory: the proxy's resolver is its DNS server's
    (server.resolver()), so a SOCKS5 hostname gets the answer the pod's own query would."""
    from ztunnel.proxy.socks5_proto import first_address, lookup_query
    from ztunnel.state.localconfig import load_local_config

    state = State()
    load_local_config(SOCKS5_STATE).apply_to(state)
    secrets = SecretManager(LocalCA.ephemeral(trust_domain="cluster.local"))
    info = WorkloadInfo("ns", "a", "sa")
    off = DataPlane(Config(), state, secrets, CollectorRegistry(), tag="t")
    assert off.build(info, None).dns_exchange is None
    dp = DataPlane(Config(socks5=True), state, secrets, CollectorRegistry(), tag="t")
    inst = dp.build(info, None)
    assert inst.dns_exchange is not None
    reply = await inst.dns_exchange(lookup_query("s1.ns.svc.cluster.local", False))
    assert str(first_address(reply)) == "10.96.0.20"
    short = await inst.dns_exchange(lookup_query("s1", False))  # expanded in ns, as a pod's
    assert str(first_address(short)) == "10.96.0.20"
    await off.close()
    await dp.close()


def test_the_self_proxy_is_ztunnels_own_inbound_only() -> None:
    """Rust create_ztunnel_self_proxy_listener: only in shared mode and with ztunnel's own
    workload known; an Inbound alone, its sockets unmarked (DefaultSocketFactory) and never
    spoofing the client (disable_inbound_freebind), no DNS proxy. A worker handed its
    listeners (the same info, no netns) builds the same kind of instance."""
    from dataclasses import replace

    from ztunnel.config import ProxyMode

    secrets = SecretManager(LocalCA.ephemeral(trust_domain="cluster.local"))
    own = WorkloadInfo("istio-system", "ztunnel-x", "ztunnel")
    shared = Config(ztunnel_workload=own, socks5=True)
    for cfg in (Config(), replace(shared, proxy_mode=ProxyMode.DEDICATED)):
        assert (
            DataPlane(cfg, State(), secrets, CollectorRegistry(), tag="t").build_self_proxy()
            is None
        )
    dp = DataPlane(shared, State(), secrets, CollectorRegistry(), tag="t")
    inst = dp.build_self_proxy()
    assert inst is not None and inst.self_proxy and inst.info == own
    assert inst.sockets.mark is None and inst.sockets.transparent_ok is False
    assert inst.companions == []
    assert dp.build(own, None).self_proxy  # (the worker's build)
    pod = dp.build(WorkloadInfo("ns", "a", "sa"), None)
    assert not pod.self_proxy and pod.sockets.mark == 1337 and pod.companions
    assert not dp.build(own, 42).self_proxy  # (a pod's netns: never the self-proxy)
