"""XDS_ON_DEMAND against the fake istiod serving on-demand requests as istiod does
(Rust DemandProxyState::fetch_address / fetch_on_demand; istiod generateDeltasOndemand)."""

from __future__ import annotations

import asyncio

import pytest

from ztunnel.config import Config
from ztunnel.core.addr import parse_ip
from ztunnel.state.model import NetworkAddress, Service, ServicePort, TunnelProtocol, Workload
from ztunnel.state.store import State
from ztunnel.testing.fakeistiod import FakeIstiod
from ztunnel.xds.client import ADDRESS_TYPE_URL, AdsClient, StateUpdater

pytestmark = pytest.mark.timeout(20)

NODE = "node-1"


def wl(name: str, ip: str, node: str = "node-2", **kw: object) -> Workload:
    return Workload(
        uid=f"c1//v1/Pod/default/{name}",
        name=name,
        namespace="default",
        addresses=(parse_ip(ip),),
        protocol=TunnelProtocol.HBONE,
        node=node,
        **kw,  # type: ignore[arg-type]
    )


SVC = Service(
    name="web",
    namespace="default",
    hostname="web.default.svc.cluster.local",
    vips=(NetworkAddress("", parse_ip("10.96.0.1")),),
    ports=(ServicePort(80, 8080),),
)


async def client_for(istiod: FakeIstiod, state: State) -> AdsClient:
    env = {
        "XDS_ADDRESS": istiod.address,
        "AUTH_TOKEN": "t",
        "NODE_NAME": NODE,
        "XDS_ON_DEMAND": "true",
        "ISTIO_META_DNS_CAPTURE": "false",  # with the DNS proxy, on-demand is a config error
    }
    client = AdsClient(
        Config.from_env(env), StateUpdater(state), initial_backoff=0.01, max_backoff=0.05
    )
    state.demander = client.demand
    client.start()
    await asyncio.wait_for(client.wait_synced(), 5)
    return client


async def test_subscribes_to_nothing_but_gets_node_local_then_fetches_on_demand() -> None:
    async with FakeIstiod() as istiod:
        local = wl("local", "10.1.0.1", node=NODE)
        remote = wl("remote", "10.2.0.1")
        other = wl("other", "10.2.0.2")
        ep = wl("ep", "10.2.0.3", services={SVC.key: {}})
        istiod.set_addresses(local, remote, other, ep, SVC)
        state = State()
        client = await client_for(istiod, state)
        try:
            # Node-local workloads come unasked (istiod's AdditionalPodSubscriptions).
            await istiod.wait_for(lambda: state.find_workload_by_uid(local.uid))
            assert state.find_workload_by_uid(remote.uid) is None
            # A workload IP: istiod answers with the workload under its uid, alias "/10.2.0.1".
            got = await state.fetch_address(NetworkAddress("", parse_ip("10.2.0.1")))
            assert isinstance(got, Workload) and got.uid == remote.uid
            # A VIP: the service and the pods behind it.
            got = await state.fetch_address(NetworkAddress("", parse_ip("10.96.0.1")), "default")
            assert isinstance(got, Service) and got.key == SVC.key
            assert [w.uid for w in state.endpoints(got)] == [ep.uid]
            # Unknown: istiod answers with a removal, the fetch returns at once with nothing.
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await state.fetch_address(NetworkAddress("", parse_ip("10.9.9.9"))) is None
            assert loop.time() - t0 < 2
            # Nothing else was sent.
            assert state.find_workload_by_uid(other.uid) is None
            # Subscribed now: an update of a fetched workload is pushed.
            istiod.set_addresses(wl("remote", "10.2.0.1", canonical_name="v2"))
            await istiod.wait_for(
                lambda: (w := state.find_workload_by_uid(remote.uid)) and w.canonical_name == "v2"
            )
        finally:
            await client.close()


async def test_demanded_names_are_resubscribed_after_a_reconnect() -> None:
    async with FakeIstiod() as istiod:
        remote = wl("remote", "10.2.0.1")
        istiod.set_addresses(remote)
        state = State()
        client = await client_for(istiod, state)
        try:
            await state.fetch_address(NetworkAddress("", parse_ip("10.2.0.1")))
            istiod.drop_connections()
            stream = await istiod.wait_streams(2)
            addr = await istiod.wait_for(
                lambda: next(
                    (r for r in stream.initial_requests() if r.type_url == ADDRESS_TYPE_URL), None
                )
            )
            assert "/10.2.0.1" in addr.resource_names_subscribe
            assert list(addr.resource_names_unsubscribe) == ["*"]
        finally:
            await client.close()


async def test_without_on_demand_fetch_is_a_plain_lookup() -> None:
    state = State()
    assert await state.fetch_address(NetworkAddress("", parse_ip("10.2.0.1"))) is None
