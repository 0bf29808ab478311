"""Outbound to waypoints: the decision Rust's ``build_request`` and ``fetch_waypoint`` make
(``src/proxy/outbound.rs``, ``src/state.rs``), checked with no sockets."""

import dataclasses
import random
from collections import Counter

import pytest

from ztunnel.core.addr import SocketAddr, parse_ip
from ztunnel.core.errors import UnknownWaypoint
from ztunnel.core.identity import Identity
from ztunnel.proxy.route import Route, RouteKind, decide_outbound
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import GatewayAddress, NetworkAddress, WeightedWaypoint
from ztunnel.state.store import State

CONFIG = """
workloads:
- uid: c//v1/Pod/default/client
  name: client
  namespace: default
  trustDomain: cluster.local
  serviceAccount: client
  workloadIps: ["10.0.1.2", "fd00:1::2"]
  protocol: HBONE
- uid: c//v1/Pod/default/waypoint
  name: waypoint
  namespace: default
  trustDomain: cluster.local
  serviceAccount: waypoint
  hostname: waypoint.example.com
  workloadIps: ["10.0.3.2", "fd00:3::2"]
  protocol: HBONE
  services:
    "default/waypoint.default.svc.cluster.local": {15008: 15008}
- uid: c//v1/Pod/default/waypoint2
  name: waypoint2
  namespace: default
  trustDomain: cluster.local
  serviceAccount: waypoint2
  workloadIps: ["10.0.3.3"]
  protocol: HBONE
- uid: c//v1/Pod/default/server
  name: server
  namespace: default
  trustDomain: cluster.local
  serviceAccount: server
  workloadIps: ["10.0.2.2", "fd00:2::2"]
  protocol: HBONE
  waypoint: {destination: "/10.0.3.2", hboneMtlsPort: 15008}
  services:
    "default/plain.default.svc.cluster.local": {80: 8080}
- uid: c//v1/Pod/default/server-by-svc-host
  name: server-by-svc-host
  namespace: default
  trustDomain: cluster.local
  workloadIps: ["10.0.2.3", "fd00:2::3"]
  protocol: HBONE
  waypoint:
    destination: {namespace: default, hostname: waypoint.default.svc.cluster.local}
- uid: c//v1/Pod/default/server-by-wl-host
  name: server-by-wl-host
  namespace: default
  trustDomain: cluster.local
  workloadIps: ["10.0.2.4", "fd00:2::4"]
  protocol: HBONE
  waypoint: {destination: {namespace: default, hostname: waypoint.example.com}}
- uid: c//v1/Pod/default/server-by-svc-vip
  name: server-by-svc-vip
  namespace: default
  trustDomain: cluster.local
  workloadIps: ["10.0.2.5"]
  protocol: HBONE
  waypoint: {destination: "/10.96.0.99", hboneMtlsPort: 15008}
- uid: c//v1/Pod/default/server-missing
  name: server-missing
  namespace: default
  trustDomain: cluster.local
  workloadIps: ["10.0.2.6"]
  protocol: HBONE
  waypoint: {destination: "/10.0.9.9", hboneMtlsPort: 15008}
services:
- name: svc
  namespace: default
  hostname: svc.default.svc.cluster.local
  vips: ["/10.96.0.14", "/fd96::14"]
  ports: {80: 8080}
  waypoint: {destination: "/10.0.3.2", hboneMtlsPort: 15008}
- name: plain
  namespace: default
  hostname: plain.default.svc.cluster.local
  vips: ["/10.96.0.15"]
  ports: {80: 8080}
- name: waypoint
  namespace: default
  hostname: waypoint.default.svc.cluster.local
  vips: ["/10.96.0.99"]
  ports: {15008: 15008}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/waypoint-svc"]
"""

WAYPOINT = Identity("cluster.local", "default", "waypoint")


@pytest.fixture
def state() -> State:
    s = State()
    load_local_config(CONFIG).apply_to(s)
    return s


def route(state: State, dst: str, *, source: str = "client", seed: int = 1) -> Route:
    src = state.find_workload_by_uid(f"c//v1/Pod/default/{source}")
    return decide_outbound(state, src, SocketAddr.parse(dst), rng=random.Random(seed))


def test_service_waypoint_by_ip(state: State) -> None:
    """Rust build_request, service branch: CONNECT to the VIP:port as dialled; the destination
    workload is the waypoint, the destination service the one addressed."""
    r = route(state, "10.96.0.14:80")
    assert (r.kind, str(r.target), str(r.authority)) == (
        RouteKind.HBONE,
        "10.0.3.2:15008",
        "10.96.0.14:80",
    )
    assert r.via_waypoint and r.expected_identities == (WAYPOINT,)
    assert r.destination_workload is not None and r.destination_workload.name == "waypoint"
    assert r.destination_service is not None
    assert r.destination_service.hostname == "svc.default.svc.cluster.local"


def test_service_waypoint_by_ip_keeps_the_waypoint_ip_family(state: State) -> None:
    """Rust fetch_waypoint: a waypoint referenced by IP is dialled at that IP, even for an
    IPv6 destination."""
    r = route(state, "[fd96::14]:80")
    assert (str(r.target), str(r.authority)) == ("10.0.3.2:15008", "[fd96::14]:80")


def test_service_waypoint_applies_to_the_waypoint_itself(state: State) -> None:
    """Rust fetch_service_waypoint has no from-waypoint check: service-addressed traffic goes to
    the waypoint whoever sends it."""
    r = route(state, "10.96.0.14:80", source="waypoint")
    assert r.via_waypoint and str(r.target) == "10.0.3.2:15008"


def test_workload_waypoint(state: State) -> None:
    """Rust build_request, workload branch: the workload's own address and the dialled port
    as authority; no destination service for a workload-addressed connection."""
    r = route(state, "10.0.2.2:8080")
    assert (str(r.target), str(r.authority)) == ("10.0.3.2:15008", "10.0.2.2:8080")
    assert r.destination_workload is not None and r.destination_workload.name == "waypoint"
    assert r.destination_service is None


def test_workload_waypoint_not_applied_from_the_waypoint(state: State) -> None:
    """Rust check_from_waypoint: the waypoint's own traffic to its workload goes direct."""
    r = route(state, "10.0.2.2:8080", source="waypoint")
    assert not r.via_waypoint and str(r.target) == "10.0.2.2:15008"


def test_service_without_waypoint_ignores_the_endpoint_waypoint(state: State) -> None:
    """Rust: workload waypoints apply only when the connection was not service-addressed."""
    r = route(state, "10.96.0.15:80")
    assert not r.via_waypoint and str(r.target) == "10.0.2.2:15008"


@pytest.mark.parametrize(
    ("dst", "target"),
    [("10.0.2.3:8080", "10.0.3.2:15008"), ("[fd00:2::3]:8080", "[fd00:3::2]:15008")],
)
def test_waypoint_by_service_hostname_adapts_to_the_family(
    state: State, dst: str, target: str
) -> None:
    """Rust fetch_waypoint, Hostname -> Service: an endpoint of the waypoint service on the HBONE
    port, in the original destination's family; the service's SANs are expected too."""
    r = route(state, dst)
    assert (str(r.target), str(r.authority)) == (target, dst)
    assert r.expected_identities == (
        WAYPOINT,
        Identity("cluster.local", "default", "waypoint-svc"),
    )


@pytest.mark.parametrize(
    ("dst", "target"),
    [("10.0.2.4:8080", "10.0.3.2:15008"), ("[fd00:2::4]:8080", "[fd00:3::2]:15008")],
)
def test_waypoint_by_workload_hostname(state: State, dst: str, target: str) -> None:
    """Rust fetch_waypoint, Hostname -> Workload (a workload's own ``hostname``)."""
    r = route(state, dst)
    assert str(r.target) == target and r.expected_identities == (WAYPOINT,)
    assert r.destination_workload is not None and r.destination_workload.name == "waypoint"


def test_waypoint_by_service_vip(state: State) -> None:
    """Rust fetch_waypoint, Address that is a service VIP: load-balanced in waypoint mode."""
    r = route(state, "10.0.2.5:8080")
    assert str(r.target) == "10.0.3.2:15008"


def test_unknown_waypoint(state: State) -> None:
    """Rust fetch_waypoint: Error::UnknownWaypoint when nothing in state has that address."""
    with pytest.raises(UnknownWaypoint, match=r"unknown waypoint: waypoint /10\.0\.9\.9 not found"):
        route(state, "10.0.2.6:8080")


def _weighted(state: State, *weights: tuple[str, int]) -> None:
    svc = state.find_service("default/svc.default.svc.cluster.local")
    assert svc is not None
    ww = tuple(
        WeightedWaypoint(GatewayAddress(address=NetworkAddress("", parse_ip(ip))), w)
        for ip, w in weights
    )
    state.upsert_service(dataclasses.replace(svc, weighted_waypoints=ww))


def test_weighted_waypoints_split_by_weight(state: State) -> None:
    """Rust sample_weighted_waypoint: connections split in proportion to the weights."""
    _weighted(state, ("10.0.3.2", 3), ("10.0.3.3", 1))
    rng = random.Random(7)
    src = state.find_workload_by_uid("c//v1/Pod/default/client")
    got = Counter(
        str(decide_outbound(state, src, SocketAddr.parse("10.96.0.14:80"), rng=rng).target)
        for _ in range(4000)
    )
    assert set(got) == {"10.0.3.2:15008", "10.0.3.3:15008"}
    assert 0.70 < got["10.0.3.2:15008"] / 4000 < 0.80  # 0.75 expected
    assert route(state, "10.96.0.14:80").expected_identities in (
        (WAYPOINT,),
        (Identity("cluster.local", "default", "waypoint2"),),
    )


def test_weighted_waypoints_zero_weight_never_picked(state: State) -> None:
    _weighted(state, ("10.0.3.2", 0), ("10.0.3.3", 5))
    targets = {str(route(state, "10.96.0.14:80", seed=i).target) for i in range(50)}
    assert targets == {"10.0.3.3:15008"}


def test_weighted_waypoints_all_zero_fall_back_to_waypoint(state: State) -> None:
    """Rust: an unsamplable set (all weights zero) falls back to the single ``waypoint``."""
    _weighted(state, ("10.0.3.3", 0))
    assert str(route(state, "10.96.0.14:80").target) == "10.0.3.2:15008"
