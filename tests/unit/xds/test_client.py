"""The delta ADS client against the fake istiod: sync, deltas, NACKs, reconnect and resume, auth."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status

from ztunnel.config import Config
from ztunnel.core.addr import parse_ip
from ztunnel.state.model import (
    Authorization,
    Clause,
    Match,
    NetworkAddress,
    PolicyAction,
    PolicyScope,
    Rule,
    Service,
    ServicePort,
    TunnelProtocol,
    Workload,
)
from ztunnel.state.store import State
from ztunnel.testing.fakeistiod import ISTIOD_SAN, FakeIstiod
from ztunnel.xds.client import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    AdsClient,
    StateUpdater,
    build_node,
)
from ztunnel.xds.convert import address_to_proto
from ztunnel.xds.protos import workload_pb2 as wl_pb

pytestmark = pytest.mark.timeout(20)

FAST = {"initial_backoff": 0.01, "max_backoff": 0.05}


def wl(name: str, ip: str, **kw: object) -> Workload:
    return Workload(
        uid=f"cluster1//v1/Pod/default/{name}",
        name=name,
        namespace="default",
        addresses=(parse_ip(ip),),
        protocol=TunnelProtocol.HBONE,
        **kw,  # type: ignore[arg-type]
    )


def svc(name: str, vip: str, ports: tuple[ServicePort, ...] = (ServicePort(80, 8080),)) -> Service:
    return Service(
        name=name,
        namespace="default",
        hostname=f"{name}.default.svc.cluster.local",
        vips=(NetworkAddress("", parse_ip(vip)),),
        ports=ports,
    )


def deny_port(name: str, port: int) -> Authorization:
    return Authorization(
        name=name,
        namespace="default",
        scope=PolicyScope.NAMESPACE,
        action=PolicyAction.DENY,
        rules=(Rule((Clause((Match(destination_ports=(port,)),)),)),),
    )


def config(istiod: FakeIstiod, **env: str) -> Config:
    base = {"XDS_ADDRESS": istiod.address, "AUTH_TOKEN": "test-token", "POD_NAME": "ztunnel-x"}
    base.update(POD_NAMESPACE="istio-system", NODE_NAME="node-1")
    base.update(env)
    return Config.from_env(base)


class RecordingUpdater(StateUpdater):
    def __init__(self, state: State) -> None:
        super().__init__(state)
        self.batches: list[tuple[str, int]] = []

    def response_applied(self, type_url: str, changes: int) -> None:
        self.batches.append((type_url, changes))


@contextlib.asynccontextmanager
async def running(client: AdsClient) -> AsyncIterator[AdsClient]:
    client.start()
    try:
        yield client
    finally:
        await client.close()


async def synced_client(
    istiod: FakeIstiod, state: State, **env: str
) -> tuple[AdsClient, RecordingUpdater]:
    updater = RecordingUpdater(state)
    client = AdsClient(config(istiod, **env), updater, **FAST)  # type: ignore[arg-type]
    return client, updater


# --- initial sync --------------------------------------------------------------------------------


@pytest.mark.both_loops
async def test_initial_sync_applies_everything_and_signals_ready() -> None:
    async with FakeIstiod() as istiod:
        istiod.set_addresses(wl("a", "10.0.0.1"), wl("b", "10.0.0.2"), svc("web", "10.96.0.1"))
        istiod.set_policies(deny_port("deny-9999", 9999))
        state = State()
        client, updater = await synced_client(istiod, state)
        assert not client.synced.is_set()
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            assert {w.name for w in state.workloads()} == {"a", "b"}
            assert state.find_service("default/web.default.svc.cluster.local") is not None
            assert state.find_policy("default/deny-9999") is not None
            assert state.find_workload_by_addr(NetworkAddress("", parse_ip("10.0.0.2"))) is not None

            (stream,) = istiod.streams
            initial = stream.initial_requests()
            assert [r.type_url for r in initial] == [ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL]
            for r in initial:
                assert list(r.resource_names_subscribe) == []  # wildcard
                assert list(r.resource_names_unsubscribe) == []
                assert dict(r.initial_resource_versions) == {}
                assert (
                    r.node.id
                    == "ztunnel~1.1.1.1~ztunnel-x.istio-system~istio-system.svc.cluster.local"
                )
            await istiod.wait_answered(stream)
            assert len(istiod.acks()) == 2 and not istiod.nacks()
            assert updater.batches == [(ADDRESS_TYPE_URL, 3), (AUTHORIZATION_TYPE_URL, 1)]
            assert client.metrics.acks == 2
            assert client.metrics.messages == {ADDRESS_TYPE_URL: 1, AUTHORIZATION_TYPE_URL: 1}
            assert client.resource_versions(ADDRESS_TYPE_URL).keys() == {
                "cluster1//v1/Pod/default/a",
                "cluster1//v1/Pod/default/b",
                "default/web.default.svc.cluster.local",
            }


async def test_empty_control_plane_still_syncs() -> None:
    async with FakeIstiod() as istiod:
        client, _ = await synced_client(istiod, State())
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)


async def test_on_demand_subscribes_to_no_addresses() -> None:
    async with FakeIstiod() as istiod:
        istiod.set_addresses(wl("a", "10.0.0.1"))
        state = State()
        # (DNS capture off: with the DNS proxy, on-demand xDS is a config error, as in Rust)
        client, _ = await synced_client(
            istiod, state, XDS_ON_DEMAND="true", ISTIO_META_DNS_CAPTURE="false"
        )
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)  # Authorization alone gates it
            stream = await istiod.wait_streams(1)
            await istiod.wait_for(lambda: len(stream.initial_requests()) == 2)
            addr = stream.initial_requests()[0]
            assert list(addr.resource_names_subscribe) == ["*"]
            assert list(addr.resource_names_unsubscribe) == ["*"]
            assert list(state.workloads()) == []


# --- incremental changes -------------------------------------------------------------------------


async def test_workload_add_update_remove() -> None:
    async with FakeIstiod() as istiod:
        state = State()
        client, updater = await synced_client(istiod, state)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            (nonce,) = istiod.set_addresses(wl("a", "10.0.0.1"))
            assert (await istiod.wait_response(nonce)).is_ack
            a = state.find_workload_by_uid("cluster1//v1/Pod/default/a")
            assert a is not None and a.addresses == (parse_ip("10.0.0.1"),)

            (nonce,) = istiod.set_addresses(wl("a", "10.0.0.9", node="node-1"))
            assert (await istiod.wait_response(nonce)).is_ack
            a = state.find_workload_by_uid("cluster1//v1/Pod/default/a")
            assert a is not None and a.node == "node-1"
            assert state.find_workload_by_addr(NetworkAddress("", parse_ip("10.0.0.1"))) is None
            assert state.find_workload_by_addr(NetworkAddress("", parse_ip("10.0.0.9"))) == a

            (nonce,) = istiod.remove_addresses("cluster1//v1/Pod/default/a")
            assert (await istiod.wait_response(nonce)).is_ack
            assert list(state.workloads()) == []
            assert "cluster1//v1/Pod/default/a" not in client.resource_versions(ADDRESS_TYPE_URL)
            assert updater.batches[-3:] == [(ADDRESS_TYPE_URL, 1)] * 3


async def test_service_add_update_remove() -> None:
    async with FakeIstiod() as istiod:
        state = State()
        client, _ = await synced_client(istiod, state)
        key = "default/web.default.svc.cluster.local"
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            (nonce,) = istiod.set_addresses(svc("web", "10.96.0.1"), wl("a", "10.0.0.1"))
            assert (await istiod.wait_response(nonce)).is_ack
            assert state.find_service(key) is not None

            (nonce,) = istiod.set_addresses(svc("web", "10.96.0.2", (ServicePort(81, 9090),)))
            assert (await istiod.wait_response(nonce)).is_ack
            s = state.find_service(key)
            assert s is not None and s.ports == (ServicePort(81, 9090),)
            assert state.find_service_by_vip(NetworkAddress("", parse_ip("10.96.0.1"))) is None
            assert state.find_service_by_vip(NetworkAddress("", parse_ip("10.96.0.2"))) == s

            # Removal by "namespace/hostname"; the workload of the same response stays.
            (nonce,) = istiod.remove_addresses(key)
            assert (await istiod.wait_response(nonce)).is_ack
            assert state.find_service(key) is None
            assert state.find_workload_by_uid("cluster1//v1/Pod/default/a") is not None


async def test_policy_add_update_remove() -> None:
    async with FakeIstiod() as istiod:
        state = State()
        client, updater = await synced_client(istiod, state)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            (nonce,) = istiod.set_policies(deny_port("p", 80))
            assert (await istiod.wait_response(nonce)).is_ack
            p = state.find_policy("default/p")
            assert p is not None and p.rules[0].clauses[0].matches[0].destination_ports == (80,)

            (nonce,) = istiod.set_policies(deny_port("p", 443))
            assert (await istiod.wait_response(nonce)).is_ack
            p = state.find_policy("default/p")
            assert p is not None and p.rules[0].clauses[0].matches[0].destination_ports == (443,)

            (nonce,) = istiod.remove_policies("default/p")
            assert (await istiod.wait_response(nonce)).is_ack
            assert state.find_policy("default/p") is None
            assert updater.batches[-3:] == [(AUTHORIZATION_TYPE_URL, 1)] * 3


# --- rejection ------------------------------------------------------------------------------------


@pytest.mark.both_loops
async def test_nack_names_bad_resources_and_applies_the_good_ones() -> None:
    async with FakeIstiod() as istiod:
        good_b = wl("b", "10.0.0.2")
        istiod.set_addresses(good_b, version="b-v1")
        state = State()
        client, _ = await synced_client(istiod, state)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)

            bad_b = address_to_proto(wl("b", "10.0.0.3"))
            bad_b.workload.addresses[0] = b"\x01\x02\x03"  # 3-byte IP
            legacy = address_to_proto(wl("c", "10.0.0.4"))
            legacy.workload.tunnel_protocol = wl_pb.LEGACY_ISTIO_MTLS
            (nonce,) = istiod.push(
                ADDRESS_TYPE_URL,
                [
                    ("cluster1//v1/Pod/default/a", address_to_proto(wl("a", "10.0.0.1"))),
                    ("cluster1//v1/Pod/default/b", bad_b),
                    ("cluster1//v1/Pod/default/c", legacy),
                ],
                removals=["never-existed"],
                version="v2",
            )
            reply = await istiod.wait_response(nonce)
            assert reply.is_nack
            msg = reply.error_message
            assert msg == (
                "cluster1//v1/Pod/default/b: workload.addresses[0]: IP address must be 4 or 16 "
                "bytes, got 3; cluster1//v1/Pod/default/c: workload.tunnel_protocol: "
                "LEGACY_ISTIO_MTLS is not supported"
            )
            # The good one applied, the bad update kept the previous b, the new bad c is absent.
            assert state.find_workload_by_uid("cluster1//v1/Pod/default/a") is not None
            b = state.find_workload_by_uid("cluster1//v1/Pod/default/b")
            assert b == good_b
            assert state.find_workload_by_uid("cluster1//v1/Pod/default/c") is None
            assert client.resource_versions(ADDRESS_TYPE_URL) == {
                "cluster1//v1/Pod/default/a": "v2",
                "cluster1//v1/Pod/default/b": "b-v1",
            }

            # Undecodable bytes, a resource without payload, a payload of the wrong type.
            (n1,) = istiod.push_raw(ADDRESS_TYPE_URL, "garbage", b"\xff\xff\xff")
            (n2,) = istiod.push_raw(AUTHORIZATION_TYPE_URL, "default/empty", None)
            (n3,) = istiod.push_raw(
                AUTHORIZATION_TYPE_URL, "default/x", b"", any_type_url=ADDRESS_TYPE_URL
            )
            assert (
                "garbage: address: cannot decode" in (await istiod.wait_response(n1)).error_message
            )
            assert (await istiod.wait_response(n2)).error_message == (
                "default/empty: resource: xDS resource without a payload"
            )
            assert "default/x: resource.type_url:" in (await istiod.wait_response(n3)).error_message
            assert client.metrics.nacks == 4

            # A later good version of b is applied and ACKed.
            (nonce,) = istiod.set_addresses(wl("b", "10.0.0.3"))
            assert (await istiod.wait_response(nonce)).is_ack
            b = state.find_workload_by_uid("cluster1//v1/Pod/default/b")
            assert b is not None and b.addresses == (parse_ip("10.0.0.3"),)


async def test_handler_exception_rejects_only_that_resource() -> None:
    class Picky(StateUpdater):
        def upsert_workload_proto(self, pb: wl_pb.Workload) -> None:
            if pb.name == "boom":
                raise RuntimeError("handler refused")
            super().upsert_workload_proto(pb)

    async with FakeIstiod() as istiod:
        state = State()
        client = AdsClient(config(istiod), Picky(state), **FAST)  # type: ignore[arg-type]
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            (nonce,) = istiod.set_addresses(wl("ok", "10.0.0.1"), wl("boom", "10.0.0.2"))
            reply = await istiod.wait_response(nonce)
            assert (
                reply.error_message
                == "cluster1//v1/Pod/default/boom: RuntimeError: handler refused"
            )
            assert [w.name for w in state.workloads()] == ["ok"]


async def test_not_ready_until_first_ack_of_every_type() -> None:
    async with FakeIstiod() as istiod:
        bad = address_to_proto(wl("a", "10.0.0.1"))
        bad.workload.status = 7  # type: ignore[assignment]
        istiod.push(ADDRESS_TYPE_URL, [("cluster1//v1/Pod/default/a", bad)])
        client, _ = await synced_client(istiod, State())
        async with running(client):
            stream = await istiod.wait_streams(1)
            await istiod.wait_answered(stream)
            assert len(istiod.nacks()) == 1 and len(istiod.acks()) == 1
            assert not client.synced.is_set()  # ztunnel: readiness needs an ACK per type
            (nonce,) = istiod.set_addresses(wl("a", "10.0.0.1"))
            assert (await istiod.wait_response(nonce)).is_ack
            assert client.synced.is_set()


# --- reconnects ----------------------------------------------------------------------------------


@pytest.mark.both_loops
async def test_reconnect_resumes_with_initial_resource_versions() -> None:
    async with FakeIstiod() as istiod:
        istiod.set_addresses(wl("a", "10.0.0.1"), wl("b", "10.0.0.2"), version="v1")
        istiod.set_policies(deny_port("p", 80), version="pv1")
        state = State()
        client, _ = await synced_client(istiod, state)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            first = istiod.streams[0]
            await istiod.wait_answered(first)

            # Stream failure: the client reconnects and says what it holds.
            assert istiod.fail_streams(Status.UNAVAILABLE, "maintenance") == 1
            second = await istiod.wait_streams(2)
            await istiod.wait_answered(second)
            addr, authz = second.initial_requests()
            assert dict(addr.initial_resource_versions) == {
                "cluster1//v1/Pod/default/a": "v1",
                "cluster1//v1/Pod/default/b": "v1",
            }
            assert dict(authz.initial_resource_versions) == {"default/p": "pv1"}
            assert client.metrics.connection_terminations == {"Error": 1}

            # An outage during which b is deleted and c added: the resumed session converges.
            await istiod.stop()
            istiod.remove_addresses("cluster1//v1/Pod/default/b")
            istiod.set_addresses(wl("c", "10.0.0.3"), version="v2")
            await istiod.start()
            third = await istiod.wait_streams(3)
            await istiod.wait_answered(third)
            assert {w.name for w in state.workloads()} == {"a", "c"}
            assert state.find_policy("default/p") is not None  # kept across reconnects
            assert client.resource_versions(ADDRESS_TYPE_URL) == {
                "cluster1//v1/Pod/default/a": "v1",
                "cluster1//v1/Pod/default/c": "v2",
            }
            assert client.metrics.connection_terminations.get("Reconnect", 0) >= 1


async def test_backoff_until_istiod_comes_up() -> None:
    with socket.socket() as probe:  # a free port with nothing listening yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    istiod = FakeIstiod()
    cfg = Config.from_env({"XDS_ADDRESS": f"http://127.0.0.1:{port}", "AUTH_TOKEN": "t"})
    client = AdsClient(cfg, StateUpdater(State()), **FAST)  # type: ignore[arg-type]
    async with running(client):
        async with asyncio.timeout(5):
            while client.metrics.connection_terminations.get("ConnectionError", 0) < 3:
                await asyncio.sleep(0.01)
        await istiod.start(port=port)
        try:
            await asyncio.wait_for(client.wait_synced(), 5)
        finally:
            await istiod.stop()


async def test_refused_streams_are_retried() -> None:
    async with FakeIstiod() as istiod:
        istiod.refuse_streams = 2
        client, _ = await synced_client(istiod, State())
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
        assert len(istiod.streams) == 3
        assert client.metrics.connection_terminations == {"Error": 2}


@pytest.mark.both_loops
async def test_dropped_connection_reconnects_quickly() -> None:
    async with FakeIstiod() as istiod:
        istiod.set_addresses(wl("a", "10.0.0.1"))
        client, _ = await synced_client(istiod, State())
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            await istiod.wait_answered(istiod.streams[0])
            assert istiod.drop_connections() == 1
            second = await istiod.wait_streams(2)
            await istiod.wait_answered(second)
            assert client.metrics.connection_terminations == {"Reconnect": 1}


@pytest.mark.parametrize(
    ("status", "message", "reason"),
    [
        (None, "", "Complete"),  # the server ended the stream normally (max connection age)
        (Status.UNAVAILABLE, "received prior goaway", "Reconnect"),
        (Status.UNAVAILABLE, "transport is closing", "Reconnect"),
        (Status.CANCELLED, "", "Reconnect"),
        (Status.DEADLINE_EXCEEDED, "", "Reconnect"),
        (Status.UNKNOWN, "", "Reconnect"),
        (Status.UNAVAILABLE, "overloaded", "Error"),
        (Status.PERMISSION_DENIED, "no", "Error"),
    ],
)
async def test_stream_end_reasons(status: Status | None, message: str, reason: str) -> None:
    async with FakeIstiod() as istiod:
        client, _ = await synced_client(istiod, State())
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
            if status is None:
                assert istiod.end_streams() == 1
            else:
                assert istiod.fail_streams(status, message) == 1
            second = await istiod.wait_streams(2)
            await istiod.wait_answered(second)
            assert client.metrics.connection_terminations == {reason: 1}


# --- authentication, headers, node ---------------------------------------------------------------


async def test_token_file_is_reread_on_reconnect(tmp_path: Path) -> None:
    token = tmp_path / "istio-token"
    token.write_text("expired\n")
    async with FakeIstiod(accept_tokens=["fresh"]) as istiod:
        client, _ = await synced_client(istiod, State(), AUTH_TOKEN=str(token))
        async with running(client):
            await istiod.wait_streams(2)  # refused (UNAUTHENTICATED) and retried
            assert not client.synced.is_set()
            token.write_text("fresh\n")  # the kubelet rotates the projected token
            await asyncio.wait_for(client.wait_synced(), 5)
            headers = [s.header("authorization") for s in istiod.streams]
            assert headers[0] == "Bearer expired"
            assert headers[-1] == "Bearer fresh"
            assert client.metrics.connection_terminations.get("Error", 0) >= 2

            # Later the token is replaced again and the stream is cut: the new one is sent.
            istiod.accept_tokens = {"rotated"}
            token.write_text("rotated")
            n = len(istiod.streams)
            istiod.fail_streams()
            stream = await istiod.wait_streams(n + 1)
            assert stream.header("authorization") == "Bearer rotated"


async def test_missing_token_file_is_a_connection_error(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")  # a file when the config is read (Rust AuthSource::Token) ...
    async with FakeIstiod() as istiod:
        client, _ = await synced_client(istiod, State(), AUTH_TOKEN=str(token))
        token.unlink()  # ... gone when connecting
        async with running(client):
            async with asyncio.timeout(5):
                while client.metrics.connection_terminations.get("ConnectionError", 0) < 2:
                    await asyncio.sleep(0.01)
            assert istiod.streams == []
            token.write_text("t")
            await asyncio.wait_for(client.wait_synced(), 5)


async def test_no_token_connects_without_authorization(tmp_path: Path) -> None:
    # Rust config.rs auth: AUTH_TOKEN unset and no ./var/run/secrets/tokens/istio-token ->
    # AuthSource::None, whose insert_headers adds neither authorization nor clusterid.
    old = os.getcwd()
    os.chdir(tmp_path)  # (the default token path is relative)
    try:
        async with FakeIstiod(accept_tokens=None) as istiod:
            env = {"XDS_ADDRESS": istiod.address, "POD_NAME": "ztunnel-x", "CLUSTER_ID": "c7"}
            client = AdsClient(Config.from_env(env), StateUpdater(State()), **FAST)  # type: ignore[arg-type]
            assert client.target.auth_token is None
            async with running(client):
                await asyncio.wait_for(client.wait_synced(), 5)
            assert istiod.streams[0].header("authorization") is None
            assert istiod.streams[0].header("clusterid") is None
    finally:
        os.chdir(old)


async def test_headers_and_node_metadata() -> None:
    env = {
        "CLUSTER_ID": "cluster-7",
        "INSTANCE_IP": "10.1.1.5",
        "XDS_HEADER_X_TENANT": "blue",
        "XDS_HEADER_AUTHORIZATION": "ignored: the bearer token wins",
        "ISTIO_META_DNS_CAPTURE": "true",
        "ISTIO_META_CLUSTER_ID": "cluster-7",
        "ISTIO_METAJSON_LABELS": '{"app": "ztunnel", "n": 2, "ok": true, "l": [1, "x"]}',
        "ISTIO_METAJSON_BROKEN": "{not json",
    }
    async with FakeIstiod() as istiod:
        cfg = config(istiod, **env)
        client = AdsClient(cfg, StateUpdater(State()), env=env, **FAST)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
        (stream,) = istiod.streams
        assert stream.header("authorization") == "Bearer test-token"
        assert stream.header("clusterid") == "cluster-7"
        assert stream.header("x_tenant") == "blue"
        assert [k for k, _ in stream.metadata].count("authorization") == 1
        node = stream.node
        assert node is not None
        assert node.id == "ztunnel~10.1.1.5~ztunnel-x.istio-system~istio-system.svc.cluster.local"
        meta = {k: v for k, v in node.metadata.fields.items()}
        assert meta["NAME"].string_value == "ztunnel-x"
        assert meta["NAMESPACE"].string_value == "istio-system"
        assert meta["INSTANCE_IPS"].string_value == "10.1.1.5"
        assert meta["NODE_NAME"].string_value == "node-1"
        assert meta["DNS_CAPTURE"].string_value == "true"
        assert meta["CLUSTER_ID"].string_value == "cluster-7"
        labels = meta["LABELS"].struct_value.fields
        assert labels["app"].string_value == "ztunnel"
        assert labels["n"].number_value == 2
        assert labels["ok"].bool_value is True
        assert [v.WhichOneof("kind") for v in labels["l"].list_value.values] == [
            "number_value",
            "string_value",
        ]
        assert "BROKEN" not in meta


def test_node_defaults() -> None:
    node = build_node(Config.from_env({}), {})
    assert node.id == "ztunnel~1.1.1.1~.~.svc.cluster.local"
    fields = node.metadata.fields
    assert fields["INSTANCE_IPS"].string_value == "1.1.1.1"
    assert set(fields) == {"NAME", "NAMESPACE", "INSTANCE_IPS", "NODE_NAME"}


# --- TLS -----------------------------------------------------------------------------------------


@pytest.mark.both_loops
async def test_tls_with_root_file_and_alt_hostname(tmp_path: Path) -> None:
    async with FakeIstiod(tls=True) as istiod:
        root = tmp_path / "root-cert.pem"
        root.write_text(istiod.root_pem)
        istiod.set_addresses(wl("a", "10.0.0.1"))
        state = State()
        # Dial the IP, verify the istiod DNS name (ALT_XDS_HOSTNAME), roots from a file.
        client, _ = await synced_client(
            istiod, state, XDS_ROOT_CA=str(root), ALT_XDS_HOSTNAME=ISTIOD_SAN
        )
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)
        assert istiod.address.startswith("https://")
        assert [w.name for w in state.workloads()] == ["a"]


async def test_tls_inline_root_and_ip_san() -> None:
    async with FakeIstiod(tls=True) as istiod:
        client, _ = await synced_client(istiod, State(), XDS_ROOT_CA=istiod.root_pem)
        async with running(client):
            await asyncio.wait_for(client.wait_synced(), 5)


async def test_tls_wrong_name_or_root_never_connects(tmp_path: Path) -> None:
    other = FakeIstiod(tls=True)  # a different CA
    async with FakeIstiod(tls=True) as istiod:
        for env in (
            {"XDS_ROOT_CA": istiod.root_pem, "ALT_XDS_HOSTNAME": "evil.example"},
            {"XDS_ROOT_CA": other.root_pem},
            {"XDS_ROOT_CA": str(tmp_path / "missing.pem")},
        ):
            client, _ = await synced_client(istiod, State(), **env)
            async with running(client):
                async with asyncio.timeout(5):
                    while client.metrics.connection_terminations.get("ConnectionError", 0) < 2:
                        await asyncio.sleep(0.01)
                assert not client.synced.is_set()
        assert istiod.streams == []


# --- the state updater ---------------------------------------------------------------------------


def test_state_updater_removal_matching() -> None:
    state = State()
    up = StateUpdater(state)
    up.upsert_workload(Workload(uid="cluster1//v1/Pod/ns/a", name="a", namespace="ns"))
    up.upsert_workload(Workload(uid="ns/odd-uid", name="b", namespace="ns"))
    up.upsert_service(Service(name="s", namespace="ns", hostname="odd-uid"))
    up.remove_address("ns/odd-uid")  # a workload uid wins over a service key
    assert state.find_workload_by_uid("ns/odd-uid") is None
    assert state.find_service("ns/odd-uid") is not None
    up.remove_address("ns/odd-uid")
    assert state.find_service("ns/odd-uid") is None
    up.remove_address("cluster1//v1/Pod/ns/a")
    up.remove_address("cluster1//v1/Pod/ns/unknown")  # no-op
    up.remove_address("nothing")
    assert list(state.workloads()) == []


def test_client_needs_an_xds_address() -> None:
    with pytest.raises(ValueError, match="XDS_ADDRESS"):
        AdsClient(Config.from_env({"XDS_ADDRESS": ""}), StateUpdater(State()))


def test_bad_header_fails_at_construction() -> None:
    cfg = Config.from_env({"XDS_ADDRESS": "http://127.0.0.1:1", "XDS_HEADER_X": "caf\u00e9"})
    with pytest.raises(ValueError, match="printable ASCII"):
        AdsClient(cfg, StateUpdater(State()))


def test_ip_helpers_sanity() -> None:
    # The wl() helper builds canonical IPv4 addresses (guards the tests above).
    assert wl("a", "10.0.0.1").addresses == (ipaddress.IPv4Address("10.0.0.1"),)
