"""app._updater: certificates of workloads that leave the node over xDS are forgotten."""

from __future__ import annotations

import asyncio
import gc

import pytest

from ztunnel.app import _updater
from ztunnel.config import Config
from ztunnel.core.addr import parse_ip
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import SecretManager
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.state.store import State
from ztunnel.testing.fakeistiod import FakeIstiod
from ztunnel.xds.client import AdsClient

pytestmark = pytest.mark.timeout(120)

NODE = "node-1"


def pod(i: int, sa: str, node: str = NODE) -> Workload:
    return Workload(
        uid=f"cluster1//v1/Pod/default/p{i}",
        name=f"p{i}",
        namespace="default",
        addresses=(parse_ip(f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"),),
        protocol=TunnelProtocol.HBONE,
        service_account=sa,
        node=node,
    )


def _tasks() -> int:
    return len(asyncio.all_tasks())


async def test_departed_identities_are_forgotten_over_xds() -> None:
    # Rust ProxyStateUpdater::remove_internal -> was_last_identity_on_node -> clear_cert ->
    # SecretManager::forget_certificate. The soak: 1,000 add/remove cycles, each with a
    # new service account, left one renewal task per departed identity. Here tasks and managed
    # identities must come back to the baseline.
    cycles = 300
    async with FakeIstiod() as istiod:
        state = State()
        secrets = SecretManager(LocalCA.ephemeral())
        env = {"XDS_ADDRESS": istiod.address, "AUTH_TOKEN": "t", "NODE_NAME": NODE}
        client = AdsClient(Config.from_env(env), _updater(state, secrets, NODE))
        client.start()
        try:
            await asyncio.wait_for(client.wait_synced(), 10)
            gc.collect()
            baseline = _tasks()
            for i in range(cycles):
                w = pod(i, f"sa-{i}")
                istiod.set_addresses(w)
                await istiod.wait_for(lambda w=w: state.find_workload_by_uid(w.uid))
                assert w.identity in secrets.identities()
                istiod.remove_addresses(w.uid)
                await istiod.wait_for(lambda w=w: state.find_workload_by_uid(w.uid) is None or None)
            await asyncio.sleep(0.05)  # let cancelled renewal tasks finish
            assert secrets.identities() == []
            assert _tasks() == baseline
            assert len(secrets._tasks) == 0
        finally:
            await client.close()
            await secrets.close()


async def test_identity_kept_while_another_workload_on_the_node_has_it() -> None:
    # Rust was_last_identity_on_node: only the last workload with the identity on this node
    # clears it; workloads on other nodes neither hold nor clear it.
    state = State()
    secrets = SecretManager(LocalCA.ephemeral())
    up = _updater(state, secrets, NODE)
    try:
        a, b, elsewhere = pod(1, "shared"), pod(2, "shared"), pod(3, "shared", node="node-2")
        for w in (a, b, elsewhere):
            up.upsert_workload(w)
        assert secrets.identities() == [a.identity]
        up.remove_address(a.uid)
        assert secrets.identities() == [a.identity]  # b still has it
        up.upsert_workload(a)
        up.remove_address(elsewhere.uid)  # another node's workload: no effect
        assert secrets.identities() == [a.identity]
        up.remove_address(a.uid)
        up.remove_address(b.uid)
        assert secrets.identities() == []
    finally:
        await secrets.close()
