"""The store's compact records: every workload and service decodes to what was encoded, and
the parts many records share (ports, load balancing, waypoints, localities) are decoded once."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from ztunnel.state.model import (
    AppProtocol,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    Service,
    ServicePort,
    ServiceVisibility,
    WeightedWaypoint,
    Workload,
)
from ztunnel.state.records import (
    decode_service,
    decode_workload,
    encode_service,
    encode_workload,
)

pytestmark = pytest.mark.timeout(120)

_text = hst.sampled_from(["", "a", "ns1", "ns2", "waypoint", "svc.ns1.svc.cluster.local"])
_ip = hst.one_of(
    hst.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
    hst.integers(2**32, 2**128 - 1).map(ipaddress.IPv6Address),
)
_gateway = hst.one_of(
    hst.builds(
        GatewayAddress,
        address=hst.builds(NetworkAddress, _text, _ip),
        hbone_mtls_port=hst.integers(1, 65535),
    ),
    hst.builds(
        GatewayAddress,
        hostname=hst.builds(NamespacedHostname, _text, _text),
        hbone_mtls_port=hst.integers(1, 65535),
    ),
    hst.builds(GatewayAddress, hbone_mtls_port=hst.integers(1, 65535)),
)
_net = hst.one_of(
    hst.tuples(hst.integers(0, 2**32 - 1), hst.integers(0, 32)).map(
        lambda t: ipaddress.IPv4Network(t, strict=False)
    ),
    hst.tuples(hst.integers(0, 2**128 - 1), hst.integers(0, 128)).map(
        lambda t: ipaddress.IPv6Network(t, strict=False)
    ),
)
_services = hst.builds(
    Service,
    name=_text,
    namespace=_text,
    hostname=_text,
    vips=hst.lists(hst.builds(NetworkAddress, _text, _ip), max_size=3).map(tuple),
    ports=hst.lists(
        hst.builds(
            ServicePort,
            hst.integers(1, 65535),
            hst.integers(0, 65535),
            hst.sampled_from(AppProtocol),
        ),
        max_size=3,
    ).map(tuple),
    subject_alt_names=hst.lists(_text, max_size=2).map(tuple),
    waypoint=hst.none() | _gateway,
    load_balancing=hst.none()
    | hst.builds(
        LoadBalancing,
        hst.lists(hst.sampled_from(LoadBalancerScope), max_size=3).map(tuple),
        hst.sampled_from(LoadBalancerMode),
        hst.sampled_from(HealthPolicy),
    ),
    ip_families=hst.sampled_from(IPFamilies),
    canonical=hst.booleans(),
    cidr_vips=hst.lists(hst.builds(NetworkCidr, _text, _net), max_size=2).map(tuple),
    ingress_use_waypoint=hst.booleans(),
    weighted_waypoints=hst.lists(
        hst.builds(WeightedWaypoint, _gateway, hst.integers(0, 100)), max_size=2
    ).map(tuple),
    visibility=hst.sampled_from(ServiceVisibility),
)
_workloads = hst.builds(
    Workload,
    uid=_text,
    name=_text,
    namespace=_text,
    addresses=hst.lists(_ip, max_size=2).map(tuple),
    waypoint=hst.none() | _gateway,
    network_gateway=hst.none() | _gateway,
    services=hst.dictionaries(
        _text, hst.dictionaries(hst.integers(1, 65535), hst.integers(1, 65535), max_size=2)
    ),
    locality=hst.builds(Locality, _text, _text, _text),
    capacity=hst.integers(0, 2**31),
)


class _Table:
    """A string table as the store keeps one: ids handed out once, never reused."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"": 0}
        self.strs: dict[int, str] = {0: ""}

    def intern(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.ids)
            self.strs[i] = s
        return i


@settings(max_examples=300, deadline=None)
@given(hst.lists(_services, min_size=1, max_size=4))
def test_a_service_decodes_to_what_was_encoded(services: list[Service]) -> None:
    table, memo = _Table(), dict[Any, Any]()
    for s in services:
        assert decode_service(encode_service(s, table.intern), table.strs.__getitem__, memo) == s


@settings(max_examples=300, deadline=None)
@given(hst.lists(_workloads, min_size=1, max_size=4))
def test_a_workload_decodes_to_what_was_encoded(workloads: list[Workload]) -> None:
    table, memo = _Table(), dict[Any, Any]()
    for w in workloads:
        raw = encode_workload(w, table.intern)
        assert decode_workload(raw, table.strs.__getitem__, memo) == w


def test_services_alike_share_their_decoded_ports_load_balancing_and_waypoint() -> None:
    table, memo = _Table(), dict[Any, Any]()
    wp = GatewayAddress(hostname=NamespacedHostname("ns1", "waypoint"))
    lb = LoadBalancing((LoadBalancerScope.ZONE,), LoadBalancerMode.FAILOVER)
    ports = (ServicePort(80, 8080), ServicePort(443, 8443, AppProtocol.HTTP2))

    def decoded(name: str) -> Any:
        s = Service(name, "ns1", f"{name}.ns1", ports=ports, waypoint=wp, load_balancing=lb)
        return decode_service(encode_service(s, table.intern), table.strs.__getitem__, memo)

    a, b = decoded("a"), decoded("b")
    assert a.ports == ports and a.waypoint == wp and a.load_balancing == lb
    assert a.ports is b.ports and a.waypoint is b.waypoint and a.load_balancing is b.load_balancing
