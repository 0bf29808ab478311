"""The outbound routing decision, checked with no sockets (like outbound.rs's unit tests)."""

import random

import pytest

from ztunnel.config import Config
from ztunnel.core.addr import SocketAddr, parse_ip
from ztunnel.core.errors import NoHealthyUpstream, NoValidDestination, SelfCallError
from ztunnel.core.identity import Identity
from ztunnel.proxy.route import Route, RouteKind, decide_outbound
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.store import State

CONFIG = """
workloads:
- uid: c//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["10.0.1.2"]
  protocol: HBONE
  node: node1
- uid: c//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["10.0.2.2", "fd00:2::2"]
  protocol: HBONE
  node: node2
  services:
    "default/echo.default.svc.cluster.local": {80: 8080}
- uid: c//v1/Pod/default/legacy
  name: legacy
  namespace: default
  serviceAccount: legacy
  trustDomain: cluster.local
  workloadIps: ["10.0.2.3"]
  protocol: TCP
  services:
    "default/legacy.default.svc.cluster.local": {80: 9090}
- uid: c//v1/Pod/default/sick
  name: sick
  namespace: default
  trustDomain: cluster.local
  workloadIps: ["10.0.2.4"]
  protocol: HBONE
  status: Unhealthy
  services:
    "default/sick.default.svc.cluster.local": {80: 80}
- uid: c//v1/Pod/default/waypoint
  name: waypoint
  namespace: default
  serviceAccount: waypoint
  trustDomain: cluster.local
  workloadIps: ["10.0.3.2"]
  protocol: HBONE
- uid: c//v1/Pod/remote/far
  name: far
  namespace: remote
  trustDomain: cluster.local
  workloadIps: ["10.9.0.2"]
  network: other
  protocol: HBONE
  services:
    "default/far.default.svc.cluster.local": {80: 80}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/10.96.0.10", "/fd96::10"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/echo-alt", "not-a-spiffe-id"]
- name: legacy
  namespace: default
  hostname: legacy.default.svc.cluster.local
  vips: ["/10.96.0.11"]
  ports: {80: 9090}
- name: sick
  namespace: default
  hostname: sick.default.svc.cluster.local
  vips: ["/10.96.0.12"]
  ports: {80: 80}
- name: empty-passthrough
  namespace: default
  hostname: pt.default.svc.cluster.local
  vips: ["/10.96.0.13"]
  ports: {80: 80}
  loadBalancer: {mode: Passthrough}
- name: with-waypoint
  namespace: default
  hostname: wp.default.svc.cluster.local
  vips: ["/10.96.0.14"]
  ports: {80: 8080}
  waypoint: {destination: "/10.0.3.2", hboneMtlsPort: 15008}
- name: far
  namespace: default
  hostname: far.default.svc.cluster.local
  vips: ["/10.96.0.15"]
  ports: {80: 80}
"""


@pytest.fixture
def state() -> State:
    s = State()
    load_local_config(CONFIG).apply_to(s)
    return s


def route(state: State, dst: str, **kw: object) -> Route:
    client = state.find_workload_by_uid("c//v1/Pod/default/client")
    return decide_outbound(state, client, SocketAddr.parse(dst), rng=random.Random(1), **kw)  # type: ignore[arg-type]


def test_unknown_destination_is_passthrough(state: State) -> None:
    r = route(state, "192.0.2.7:443")
    assert r == Route(RouteKind.PASSTHROUGH, SocketAddr.parse("192.0.2.7:443"))


def test_hbone_workload_by_ip(state: State) -> None:
    r = route(state, "10.0.2.2:8080")
    assert r.kind is RouteKind.HBONE
    assert str(r.target) == "10.0.2.2:15008"
    assert str(r.authority) == "10.0.2.2:8080"
    assert r.expected_identities == (Identity("cluster.local", "default", "server"),)
    assert r.destination_service is None


def test_hbone_ipv6_authority(state: State) -> None:
    r = route(state, "[fd00:2::2]:8080")
    assert str(r.target) == "[fd00:2::2]:15008"
    assert str(r.authority) == "[fd00:2::2]:8080"


def test_service_vip_maps_port_and_adds_service_sans(state: State) -> None:
    r = route(state, "10.96.0.10:80")
    assert r.kind is RouteKind.HBONE
    assert str(r.authority) == "10.0.2.2:8080"
    assert r.destination_service is not None and r.destination_service.name == "echo"
    assert r.expected_identities == (
        Identity("cluster.local", "default", "server"),
        Identity("cluster.local", "default", "echo-alt"),
    )


def test_service_v6_vip(state: State) -> None:
    r = route(state, "[fd96::10]:80")
    assert r.kind is RouteKind.HBONE and r.authority is not None and r.authority.port == 8080


def test_tcp_workload_is_direct(state: State) -> None:
    r = route(state, "10.96.0.11:80")
    assert r == Route(
        RouteKind.DIRECT,
        SocketAddr.parse("10.0.2.3:9090"),
        destination_workload=state.find_workload_by_uid("c//v1/Pod/default/legacy"),
        destination_service=state.find_service("default/legacy.default.svc.cluster.local"),
    )


def test_unexposed_service_port_has_no_upstream(state: State) -> None:
    with pytest.raises(NoHealthyUpstream):
        route(state, "10.96.0.10:81")


def test_unhealthy_only_endpoint_has_no_upstream(state: State) -> None:
    with pytest.raises(NoHealthyUpstream):
        route(state, "10.96.0.12:80")


def test_passthrough_service_without_endpoints(state: State) -> None:
    r = route(state, "10.96.0.13:80")
    assert r.kind is RouteKind.PASSTHROUGH and str(r.target) == "10.96.0.13:80"


def test_service_waypoint(state: State) -> None:
    r = route(state, "10.96.0.14:80")
    assert r.kind is RouteKind.HBONE and r.via_waypoint
    assert str(r.target) == "10.0.3.2:15008"
    assert str(r.authority) == "10.96.0.14:80"  # the original VIP:port
    assert r.expected_identities == (Identity("cluster.local", "default", "waypoint"),)


def test_cross_network_without_gateway_is_refused_clearly(state: State) -> None:
    """Rust build_request_through_gateway: no network gateway -> NoValidDestination."""
    with pytest.raises(NoValidDestination, match="no network gateway"):
        route(state, "10.96.0.15:80")


@pytest.mark.parametrize(
    "dst", ["127.0.0.1:15001", "[::1]:15008", "0.0.0.0:15006", "10.0.1.2:15001"]
)
def test_self_calls_refused(state: State, dst: str) -> None:
    with pytest.raises(SelfCallError):
        route(state, dst, local_ips=frozenset({parse_ip("10.0.1.2")}))


def test_socks5_port_is_a_self_call_only_with_socks5_on(state: State) -> None:
    """Rust proxy_to: a loopback destination on a port of cfg.illegal_ports is SelfCall, and
    construct_config adds 15080 to them with UNSTABLE_ENABLE_SOCKS5."""
    dst = SocketAddr.parse("127.0.0.1:15080")
    assert decide_outbound(state, None, dst).kind is RouteKind.PASSTHROUGH
    with pytest.raises(SelfCallError):
        decide_outbound(state, None, dst, illegal_ports=Config(socks5=True).illegal_ports)


def test_other_pods_port_15008_is_not_a_self_call(state: State) -> None:
    assert route(state, "192.0.2.1:15008").kind is RouteKind.PASSTHROUGH


def test_route_is_frozen(state: State) -> None:
    r = route(state, "10.0.2.2:8080")
    with pytest.raises(AttributeError):
        r.kind = RouteKind.DIRECT  # type: ignore[misc]
