"""ConnectionRecord access-log fields and what ProxyContext.open_metrics derives for them:
the inbound destination service guess and the baggage fallbacks (reference 7)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.config import Config
from ztunnel.core.addr import SocketAddr
from ztunnel.hbone.headers import parse_baggage
from ztunnel.metrics import Metrics
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, guess_inbound_service
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import Workload
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(30)

CONFIG = """
workloads:
- uid: c//v1/Pod/default/client
  name: client
  namespace: default
  trustDomain: cluster.local
  serviceAccount: client
  workloadIps: ["10.0.1.2"]
  protocol: HBONE
- uid: c//v1/Pod/default/server
  name: server
  namespace: default
  trustDomain: cluster.local
  serviceAccount: server
  workloadIps: ["10.0.2.2"]
  protocol: HBONE
  services:
    "default/web.default.svc.cluster.local": {80: 8080}
    "default/named.default.svc.cluster.local": {443: 9443}
    "default/api.default.svc.cluster.local": {}
services:
- name: api
  namespace: default
  hostname: api.default.svc.cluster.local
  vips: ["/10.96.0.3"]
  ports: {80: 8080}
- name: web
  namespace: default
  hostname: web.default.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
- name: named
  namespace: default
  hostname: named.default.svc.cluster.local
  vips: ["/10.96.0.2"]
  ports: {443: 0}
"""

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"


@pytest.fixture
def state() -> State:
    st = State()
    load_local_config(CONFIG).apply_to(st)
    return st


def _wl(state: State, name: str) -> Workload:
    w = state.find_workload_by_uid(f"c//v1/Pod/default/{name}")
    assert w is not None
    return w


def test_guess_inbound_service(state: State) -> None:
    server = _wl(state, "server")
    # The Forwarded host wins when the workload backs that service.
    got = guess_inbound_service(state, server, 8080, "api.default.svc.cluster.local")
    assert got is not None and got.name == "api"
    # Else the first of its services whose target port matches, in the workload's order.
    got = guess_inbound_service(state, server, 8080)
    assert got is not None and got.name == "web"
    got = guess_inbound_service(state, server, 8080, "other.default.svc.cluster.local")
    assert got is not None and got.name == "web"
    # A named target port (0) matches through this endpoint's own port mapping.
    got = guess_inbound_service(state, server, 9443)
    assert got is not None and got.name == "named"
    assert guess_inbound_service(state, server, 9000) is None
    assert guess_inbound_service(state, _wl(state, "client"), 8080) is None


def _ctx(state: State) -> ProxyContext:
    return ProxyContext(
        config=Config(),
        state=state,
        sockets=SocketFactory(mark=None),
        pipes=None,
        local_workload=lambda: None,
        metrics=Metrics(CollectorRegistry(), process=False),
    )


def test_outbound_hbone_opened_names_the_expected_peer_identity(state: State) -> None:
    client, server = _wl(state, "client"), _wl(state, "server")
    rec = ConnectionRecord(
        "outbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:15008"),
        hbone_addr=SocketAddr.parse("10.0.2.2:8080"),
        src_workload=client,
        dst_workload=server,
        src_identity=client.identity,
    )
    _ctx(state).open_metrics(rec, mtls=True)
    assert rec.dst_service is None  # outbound: only the route sets it
    assert list(rec.fields().items()) == [
        ("src.addr", "10.0.1.2:40000"),
        ("src.workload", "client"),
        ("src.namespace", "default"),
        ("src.identity", CLIENT_ID),
        ("dst.addr", "10.0.2.2:15008"),
        ("dst.hbone_addr", "10.0.2.2:8080"),
        ("dst.workload", "server"),
        ("dst.namespace", "default"),
        ("dst.identity", SERVER_ID),  # before the handshake: the workload's identity
        ("direction", "outbound"),
    ]


def test_plaintext_has_no_identities(state: State) -> None:
    rec = ConnectionRecord(
        "outbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:8080"),
        src_workload=_wl(state, "client"),
        dst_workload=_wl(state, "server"),
    )
    _ctx(state).open_metrics(rec, mtls=False)
    assert "src.identity" not in rec.fields() and "dst.identity" not in rec.fields()


def test_inbound_from_unknown_source_falls_back_to_baggage(state: State) -> None:
    server = _wl(state, "server")
    rec = ConnectionRecord(
        "inbound",
        SocketAddr.parse("10.9.9.9:40000"),
        SocketAddr.parse("10.0.2.2:8080"),
        hbone_addr=SocketAddr.parse("10.0.2.2:8080"),
        dst_workload=server,
        src_identity=_wl(state, "client").identity,
        dst_identity=server.identity,
    )
    bag = parse_baggage("k8s.namespace.name=ns-x,k8s.deployment.name=x-deploy,service.name=x-app")
    _ctx(state).open_metrics(rec, mtls=True, baggage=bag)
    f = rec.fields()
    assert list(f)[:4] == ["src.addr", "src.workload", "src.namespace", "src.identity"]
    assert (f["src.workload"], f["src.namespace"]) == ("x-app", "ns-x")
    assert f["dst.service"] == "web.default.svc.cluster.local"
    # A known source workload wins over the baggage.
    rec2 = ConnectionRecord(
        "inbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:9000"),
        src_workload=_wl(state, "client"),
        dst_workload=server,
    )
    _ctx(state).open_metrics(rec2, mtls=False, baggage=bag)
    assert rec2.fields()["src.workload"] == "client" and "dst.service" not in rec2.fields()


@pytest.mark.parametrize("text", ["10.0.0.1:80", "[fd00::1]:15008", "[::ffff:1.2.3.4]:1"])
def test_access_log_addresses_read_as_str(text: str) -> None:
    from ztunnel.proxy.context import _addr_text

    addr = SocketAddr.parse(text)
    assert _addr_text(addr) == _addr_text(addr) == str(addr)
