"""xDS decoding against protobuf bytes built field by field from the reference tables.

The bytes are made with a tiny encoder here (tag = field number << 3 | wire type), never with
the generated classes, so a wrong field number in our .proto files fails a test.
"""

from __future__ import annotations

import ipaddress

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.state.model import (
    ApplicationTunnel,
    AppProtocol,
    AppTunnelProtocol,
    Authorization,
    Clause,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    Match,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    PolicyAction,
    PolicyScope,
    Rule,
    Service,
    ServiceAccountMatch,
    ServicePort,
    ServiceVisibility,
    StringMatch,
    StringMatchKind,
    TunnelProtocol,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
)
from ztunnel.xds.convert import (
    ConversionError,
    address_key,
    address_to_proto,
    authorization_to_proto,
    decode_address,
    decode_authorization,
)
from ztunnel.xds.protos import ca_pb2
from ztunnel.xds.protos import discovery_pb2 as ds

pytestmark = pytest.mark.timeout(30)

# --- a minimal protobuf encoder -----------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def vi(field: int, n: int) -> bytes:
    """A varint field (wire type 0): ints, enums, bools."""
    return varint(field << 3) + varint(n)


def ld(field: int, *parts: bytes) -> bytes:
    """A length-delimited field (wire type 2): bytes, strings, sub-messages, packed repeats."""
    body = b"".join(parts)
    return varint(field << 3 | 2) + varint(len(body)) + body


def s(field: int, text: str) -> bytes:
    return ld(field, text.encode())


def packed(field: int, *nums: int) -> bytes:
    return ld(field, b"".join(varint(n) for n in nums))


def ip(text: str) -> bytes:
    return ipaddress.ip_address(text).packed


# istio.workload helpers, by the reference field numbers.
def network_address(network: str, addr: str, length: int | None = None) -> bytes:
    return s(1, network) + ld(2, ip(addr)) + (vi(3, length) if length is not None else b"")


def namespaced_hostname(ns: str, host: str) -> bytes:
    return s(1, ns) + s(2, host)


def port(service_port: int, target_port: int, app_protocol: int = 0) -> bytes:
    return vi(1, service_port) + vi(2, target_port) + vi(3, app_protocol)


def workload_address(*fields: bytes) -> bytes:
    return ld(1, *fields)  # Address.workload = 1


def service_address(*fields: bytes) -> bytes:
    return ld(2, *fields)  # Address.service = 2


# --- Workload ------------------------------------------------------------------------------------


FULL_WORKLOAD = workload_address(
    s(20, "cluster1//v1/Pod/default/sleep-1"),  # uid
    s(1, "sleep-1"),  # name
    s(2, "default"),  # namespace
    ld(3, ip("10.0.0.5")),  # addresses (repeated bytes)
    ld(3, ip("fd00::5")),
    s(21, "sleep.example"),  # hostname
    s(4, "net1"),  # network
    vi(5, 1),  # tunnel_protocol HBONE
    s(6, "td.example"),  # trust_domain
    s(7, "sleep"),  # service_account
    ld(8, ld(2, network_address("net1", "10.0.0.9")), vi(3, 15008)),  # waypoint -> address
    ld(19, ld(1, namespaced_hostname("istio-system", "ewgw.example")), vi(3, 15009)),
    s(9, "node-a"),  # node
    s(10, "sleep-canonical"),  # canonical_name
    s(11, "v1"),  # canonical_revision
    vi(12, 2),  # workload_type POD
    s(13, "sleep-deploy"),  # workload_name
    vi(14, 1),  # native_tunnel
    ld(23, vi(1, 1), vi(2, 15088)),  # application_tunnel PROXY:15088
    ld(22, s(1, "default/sleep.default.svc.cluster.local"), ld(2, ld(1, port(80, 8080)))),
    ld(22, s(1, "default/other.example"), ld(2, ld(1, port(443, 8443)), ld(1, port(90, 9090)))),
    s(16, "default/allow-sleep"),  # authorization_policies
    s(16, "default/deny-x"),
    vi(17, 1),  # status UNHEALTHY
    s(18, "cluster1"),  # cluster_id
    ld(24, s(1, "region-a"), s(2, "zone-b"), s(3, "sub-c")),  # locality
    vi(25, 1),  # network_mode HOST_NETWORK
    ld(26, s(1, "ext"), ld(2, s(1, "type.googleapis.com/x"), ld(2, b"cfg"))),  # extensions
    ld(27, vi(1, 7)),  # capacity UInt32Value{value=7}
)


def test_workload_every_field() -> None:
    w = decode_address(FULL_WORKLOAD)
    assert w == Workload(
        uid="cluster1//v1/Pod/default/sleep-1",
        name="sleep-1",
        namespace="default",
        addresses=(parse_ip("10.0.0.5"), parse_ip("fd00::5")),
        hostname="sleep.example",
        network="net1",
        protocol=TunnelProtocol.HBONE,
        trust_domain="td.example",
        service_account="sleep",
        waypoint=GatewayAddress(
            address=NetworkAddress("net1", parse_ip("10.0.0.9")), hbone_mtls_port=15008
        ),
        network_gateway=GatewayAddress(
            hostname=NamespacedHostname("istio-system", "ewgw.example"), hbone_mtls_port=15009
        ),
        node="node-a",
        canonical_name="sleep-canonical",
        canonical_revision="v1",
        workload_type="pod",
        workload_name="sleep-deploy",
        native_tunnel=True,
        application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
        services={
            "default/other.example": {443: 8443, 90: 9090},
            "default/sleep.default.svc.cluster.local": {80: 8080},
        },
        authorization_policies=("default/allow-sleep", "default/deny-x"),
        status=WorkloadStatus.UNHEALTHY,
        cluster_id="cluster1",
        locality=Locality("region-a", "zone-b", "sub-c"),
        network_mode=NetworkMode.HOST_NETWORK,
        capacity=7,
    )
    assert address_key(w) == "cluster1//v1/Pod/default/sleep-1"


def test_workload_defaults() -> None:
    w = decode_address(workload_address(s(20, "uid-1"), s(1, "a"), s(2, "ns")))
    assert isinstance(w, Workload)
    assert w.trust_domain == "cluster.local"
    assert w.service_account == "default"
    assert w.cluster_id == "Kubernetes"
    assert w.capacity == 1
    assert w.protocol is TunnelProtocol.NONE
    assert w.status is WorkloadStatus.HEALTHY
    assert w.network_mode is NetworkMode.STANDARD
    assert w.workload_type == "deployment"
    assert w.locality == Locality()
    assert w.waypoint is None and w.network_gateway is None and w.application_tunnel is None
    assert w.addresses == () and w.services == {}
    assert w.identity.principal == "cluster.local/ns/ns/sa/default"


def test_workload_explicit_zero_capacity_and_app_tunnel_without_port() -> None:
    w = decode_address(workload_address(s(20, "u"), ld(27), ld(23, vi(1, 0))))
    assert isinstance(w, Workload)
    assert w.capacity == 0  # the wrapper is present: 0 is a value, not "unset"
    assert w.application_tunnel == ApplicationTunnel(AppTunnelProtocol.NONE, None)


def test_ipv4_mapped_addresses_stay_ipv6() -> None:
    # Rust byte_to_ip keeps 16 bytes as an IPv6 address (see tests/unit/test_rust_decisions.py).
    w = decode_address(workload_address(s(20, "u"), ld(3, ip("::ffff:10.1.2.3"))))
    assert isinstance(w, Workload)
    assert w.addresses == (ipaddress.IPv6Address("::ffff:10.1.2.3"),)


def test_unknown_telemetry_enum_falls_back() -> None:
    w = decode_address(workload_address(s(20, "u"), vi(12, 99)))  # workload_type 99
    assert isinstance(w, Workload)
    assert w.workload_type == "deployment"


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        (
            (s(20, "u"), ld(3, ip("10.0.0.1")), ld(3, b"\x01\x02\x03\x04\x05")),
            "workload.addresses[1]",
            "4 or 16 bytes, got 5",
        ),
        ((s(20, "u"), vi(5, 2)), "workload.tunnel_protocol", "LEGACY_ISTIO_MTLS"),
        ((s(20, "u"), vi(5, 9)), "workload.tunnel_protocol", "unknown TunnelProtocol value 9"),
        ((s(20, "u"), vi(17, 4)), "workload.status", "unknown WorkloadStatus"),
        ((s(20, "u"), vi(25, 3)), "workload.network_mode", "unknown NetworkMode"),
        ((s(20, "u"), ld(8, vi(3, 15008))), "workload.waypoint", "no destination"),
        (
            (s(20, "u"), ld(19, ld(2, network_address("", "10.0.0.1")), vi(3, 70000))),
            "workload.network_gateway.hbone_mtls_port",
            "out of range",
        ),
        (
            (s(20, "u"), ld(8, ld(2, s(1, "n"), ld(2, b"\x0a")))),
            "workload.waypoint.address.address",
            "got 1",
        ),
        (
            (s(20, "u"), ld(22, s(1, "no-slash"), ld(2))),
            "workload.services['no-slash']",
            "<namespace>/<hostname>",
        ),
        (
            (s(20, "u"), ld(22, s(1, "ns/h"), ld(2, ld(1, port(80, 65536))))),
            "workload.services['ns/h'].ports[0].target_port",
            "65536",
        ),
        ((s(20, "u"), ld(23, vi(1, 5))), "workload.application_tunnel.protocol", "unknown"),
        ((s(1, "no-uid"),), "workload.uid", "empty"),
    ],
)
def test_bad_workload_names_the_field(fields: tuple[bytes, ...], field: str, reason: str) -> None:
    with pytest.raises(ConversionError) as ei:
        decode_address(workload_address(*fields))
    assert ei.value.field == field
    assert reason in ei.value.reason
    assert str(ei.value).startswith(field + ": ")


# --- Service -------------------------------------------------------------------------------------


FULL_SERVICE = service_address(
    s(1, "reviews"),  # name
    s(2, "bookinfo"),  # namespace
    s(3, "reviews.bookinfo.svc.cluster.local"),  # hostname
    ld(4, network_address("", "10.96.0.10")),  # addresses
    ld(4, network_address("net2", "fd00:96::10", 128)),  # full-length prefix: a plain VIP
    ld(4, network_address("", "10.200.0.0", 16)),  # a CIDR VIP
    ld(5, port(9080, 9081, 1)),  # ports (HTTP11)
    ld(5, port(9443, 0)),  # named target port
    s(6, "spiffe://cluster.local/ns/bookinfo/sa/extra"),  # subject_alt_names
    ld(7, ld(1, namespaced_hostname("bookinfo", "waypoint.bookinfo.svc")), vi(3, 15008)),
    ld(8, packed(1, 2, 1), vi(2, 2), vi(3, 1)),  # load_balancing [ZONE, REGION] FAILOVER ALLOW_ALL
    vi(9, 3),  # ip_families DUAL
    ld(10, s(1, "ext")),  # extensions
    vi(11, 1),  # canonical
    vi(12, 1),  # ingress_use_waypoint
    ld(13, ld(1, ld(2, network_address("", "10.0.0.20")), vi(3, 15008)), vi(2, 3)),
    vi(14, 1),  # visibility NAMESPACE
)


def test_service_every_field() -> None:
    svc = decode_address(FULL_SERVICE)
    assert svc == Service(
        name="reviews",
        namespace="bookinfo",
        hostname="reviews.bookinfo.svc.cluster.local",
        vips=(
            NetworkAddress("", parse_ip("10.96.0.10")),
            NetworkAddress("net2", parse_ip("fd00:96::10")),
        ),
        ports=(ServicePort(9080, 9081, AppProtocol.HTTP11), ServicePort(9443, 0)),
        subject_alt_names=("spiffe://cluster.local/ns/bookinfo/sa/extra",),
        waypoint=GatewayAddress(
            hostname=NamespacedHostname("bookinfo", "waypoint.bookinfo.svc"), hbone_mtls_port=15008
        ),
        load_balancing=LoadBalancing(
            (LoadBalancerScope.ZONE, LoadBalancerScope.REGION),
            LoadBalancerMode.FAILOVER,
            HealthPolicy.ALLOW_ALL,
        ),
        ip_families=IPFamilies.DUAL,
        canonical=True,
        cidr_vips=(NetworkCidr("", ipaddress.ip_network("10.200.0.0/16")),),
        ingress_use_waypoint=True,
        weighted_waypoints=(
            WeightedWaypoint(GatewayAddress(address=NetworkAddress("", parse_ip("10.0.0.20"))), 3),
        ),
        visibility=ServiceVisibility.NAMESPACE,
    )
    assert address_key(svc) == "bookinfo/reviews.bookinfo.svc.cluster.local"


def test_service_unpacked_repeated_enum_is_accepted() -> None:
    # A repeated enum may arrive unpacked (one tag per value); both forms are valid protobuf.
    svc = decode_address(service_address(s(3, "h"), ld(8, vi(1, 4), vi(1, 6))))
    assert isinstance(svc, Service)
    assert svc.load_balancing is not None
    assert svc.load_balancing.routing_preference == (
        LoadBalancerScope.NODE,
        LoadBalancerScope.NETWORK,
    )
    assert svc.load_balancing.mode is LoadBalancerMode.UNSPECIFIED


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        (
            (s(3, "h"), ld(4, network_address("", "10.0.0.1")), ld(4, s(1, "n"), ld(2, b"123"))),
            "service.addresses[1].address",
            "got 3",
        ),
        (
            (s(3, "h"), ld(4, network_address("", "10.0.0.0", 33))),
            "service.addresses[0].length",
            "exceeds 32",
        ),
        (
            (s(3, "h"), ld(5, port(80, 80)), ld(5, port(70000, 80))),
            "service.ports[1].service_port",
            "70000",
        ),
        (
            (s(3, "h"), ld(8, packed(1, 1, 0))),
            "service.load_balancing.routing_preference[1]",
            "unspecified",
        ),
        ((s(3, "h"), ld(8, vi(2, 7))), "service.load_balancing.mode", "unknown"),
        ((s(3, "h"), vi(9, 8)), "service.ip_families", "unknown IPFamilies"),
        ((s(3, "h"), ld(13, vi(2, 1))), "service.weighted_waypoints[0].destination", "missing"),
        ((s(1, "no-host"),), "service.hostname", "empty"),
    ],
)
def test_bad_service_names_the_field(fields: tuple[bytes, ...], field: str, reason: str) -> None:
    with pytest.raises(ConversionError) as ei:
        decode_address(service_address(*fields))
    assert ei.value.field == field
    assert reason in ei.value.reason


def test_address_without_type_and_garbage() -> None:
    with pytest.raises(ConversionError) as ei:
        decode_address(b"")
    assert ei.value.field == "address.type"
    with pytest.raises(ConversionError) as ei:
        decode_address(b"\xff\xff\xff\xff")  # a truncated varint tag: not protobuf at all
    assert ei.value.field == "address"
    assert "cannot decode" in ei.value.reason


# --- Authorization -------------------------------------------------------------------------------


def exact(v: str) -> bytes:
    return s(1, v)


def cidr(addr: str, length: int) -> bytes:
    return ld(1, ip(addr)) + vi(2, length)


FULL_MATCH = b"".join(
    [
        ld(1, exact("ns-a")),  # namespaces: exact
        ld(2, s(2, "kube-")),  # not_namespaces: prefix
        ld(3, s(3, "/sa/sleep")),  # principals: suffix
        ld(4, ld(4)),  # not_principals: presence (google.protobuf.Empty)
        ld(5, cidr("10.0.0.0", 8)),  # source_ips
        ld(6, cidr("10.9.0.0", 16)),  # not_source_ips
        ld(7, cidr("fd00::", 64)),  # destination_ips
        ld(8, cidr("192.168.1.7", 32)),  # not_destination_ips
        packed(9, 80, 443),  # destination_ports (packed)
        vi(10, 22),  # not_destination_ports (unpacked)
        vi(10, 23),
        ld(11, s(1, "ns-a"), s(2, "sleep")),  # service_accounts
        ld(12, s(1, "ns-b"), s(2, "bad")),  # not_service_accounts
        ld(13, s(1, "ext")),  # extensions (ignored)
    ]
)

FULL_POLICY = b"".join(
    [
        s(1, "allow-sleep"),  # name
        s(2, "ns-a"),  # namespace
        vi(3, 2),  # scope WORKLOAD_SELECTOR
        vi(4, 1),  # action DENY
        # rules[0].clauses[0].matches = [FULL_MATCH, {}], clauses[1] = {}; rules[1] = {}
        ld(5, ld(1, ld(2, FULL_MATCH), ld(2)), ld(1)),
        ld(5),
        vi(6, 1),  # dry_run
    ]
)


def test_authorization_every_field() -> None:
    pol = decode_authorization(FULL_POLICY)
    net = ipaddress.ip_network
    assert pol == Authorization(
        name="allow-sleep",
        namespace="ns-a",
        scope=PolicyScope.WORKLOAD_SELECTOR,
        action=PolicyAction.DENY,
        rules=(
            Rule(
                (
                    Clause(
                        (
                            Match(
                                namespaces=(StringMatch(StringMatchKind.EXACT, "ns-a"),),
                                not_namespaces=(StringMatch(StringMatchKind.PREFIX, "kube-"),),
                                service_accounts=(ServiceAccountMatch("ns-a", "sleep"),),
                                not_service_accounts=(ServiceAccountMatch("ns-b", "bad"),),
                                principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/sleep"),),
                                not_principals=(StringMatch(StringMatchKind.PRESENCE),),
                                source_ips=(net("10.0.0.0/8"),),
                                not_source_ips=(net("10.9.0.0/16"),),
                                destination_ips=(net("fd00::/64"),),
                                not_destination_ips=(net("192.168.1.7/32"),),
                                destination_ports=(80, 443),
                                not_destination_ports=(22, 23),
                            ),
                            Match(),
                        )
                    ),
                    Clause(),
                )
            ),
            Rule(),
        ),
        dry_run=True,
    )
    assert pol.key == "ns-a/allow-sleep"


def test_authorization_defaults_and_cidr_details() -> None:
    body = s(1, "p") + ld(
        5, ld(1, ld(2, ld(5, cidr("10.1.2.3", 24)), ld(7, cidr("::ffff:10.0.0.0", 104))))
    )
    pol = decode_authorization(body)
    assert pol.scope is PolicyScope.GLOBAL and pol.action is PolicyAction.ALLOW
    assert pol.namespace == "" and pol.key == "/p" and not pol.dry_run
    m = pol.rules[0].clauses[0].matches[0]
    assert m.source_ips == (ipaddress.ip_network("10.1.2.0/24"),)  # host bits masked
    assert m.destination_ips == (ipaddress.ip_network("::ffff:10.0.0.0/104"),)  # stays IPv6


def _policy_with_match(*match: bytes) -> bytes:
    return s(1, "p") + s(2, "ns") + ld(5, ld(1, ld(2, *match)))


M0 = "authorization.rules[0].clauses[0].matches[0]"


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        (_policy_with_match(packed(9, 80, 65536)), f"{M0}.destination_ports[1]", "65536"),
        (s(1, "p") + vi(3, 3), "authorization.scope", "unknown PolicyScope value 3"),
        (s(1, "p") + vi(4, 2), "authorization.action", "unknown PolicyAction value 2"),
        (s(2, "ns"), "authorization.name", "empty"),
    ],
)
def test_bad_authorization_names_the_field(body: bytes, field: str, reason: str) -> None:
    with pytest.raises(ConversionError) as ei:
        decode_authorization(body)
    assert ei.value.field == field
    assert reason in ei.value.reason


def test_authorization_garbage() -> None:
    with pytest.raises(ConversionError) as ei:
        decode_authorization(b"\x0a\x05ab")  # field 1 claims 5 bytes, 2 follow
    assert ei.value.field == "authorization"


# --- model -> proto round trips (what the fake istiod sends) -------------------------------------


def test_round_trip_through_the_wire() -> None:
    for raw in (FULL_WORKLOAD, FULL_SERVICE):
        obj = decode_address(raw)
        assert decode_address(address_to_proto(obj).SerializeToString()) == obj
    pol = decode_authorization(FULL_POLICY)
    assert decode_authorization(authorization_to_proto(pol).SerializeToString()) == pol


def test_defaults_round_trip() -> None:
    w = Workload(uid="u", name="n", namespace="ns")
    assert decode_address(address_to_proto(w).SerializeToString()) == w
    svc = Service(name="s", namespace="ns", hostname="s.ns.svc")
    assert decode_address(address_to_proto(svc).SerializeToString()) == svc


# --- the xDS envelope and the CA messages --------------------------------------------------------


def test_delta_discovery_response_envelope_field_numbers() -> None:
    resource = b"".join(
        [
            s(1, "v7"),  # Resource.version
            ld(2, s(1, "type.googleapis.com/istio.workload.Address"), ld(2, FULL_WORKLOAD)),
            s(3, "cluster1//v1/Pod/default/sleep-1"),  # Resource.name
            s(4, "alias"),  # Resource.aliases
        ]
    )
    raw = b"".join(
        [
            s(1, "sys-1"),  # system_version_info
            ld(2, resource),  # resources
            s(4, "type.googleapis.com/istio.workload.Address"),  # type_url
            s(5, "nonce-1"),  # nonce
            s(6, "gone-uid"),  # removed_resources
        ]
    )
    resp = ds.DeltaDiscoveryResponse.FromString(raw)
    assert (resp.system_version_info, resp.type_url, resp.nonce) == (
        "sys-1",
        "type.googleapis.com/istio.workload.Address",
        "nonce-1",
    )
    assert list(resp.removed_resources) == ["gone-uid"]
    (r,) = resp.resources
    assert (r.version, r.name, list(r.aliases)) == (
        "v7",
        "cluster1//v1/Pod/default/sleep-1",
        ["alias"],
    )
    assert decode_address(r.resource.value) == decode_address(FULL_WORKLOAD)


def test_delta_discovery_request_encodes_envoy_field_numbers() -> None:
    req = ds.DeltaDiscoveryRequest(type_url="t", response_nonce="n", resource_names_subscribe=["a"])
    req.node.id = "id"
    req.node.metadata.fields["K"].string_value = "v"
    req.resource_names_unsubscribe.append("b")
    req.initial_resource_versions["r"] = "1"
    req.error_detail.message = "bad"
    req.error_detail.code = 3
    struct = ld(1, s(1, "K"), ld(2, s(3, "v")))  # Struct.fields map entry -> Value.string_value
    expected = b"".join(
        [
            ld(1, s(1, "id"), ld(3, struct)),  # node {id = 1, metadata = 3}
            s(2, "t"),  # type_url
            s(3, "a"),  # resource_names_subscribe
            s(4, "b"),  # resource_names_unsubscribe
            ld(5, s(1, "r"), s(2, "1")),  # initial_resource_versions map entry
            s(6, "n"),  # response_nonce
            ld(7, vi(1, 3), s(2, "bad")),  # error_detail {code = 1, message = 2}
        ]
    )
    assert req.SerializeToString(deterministic=True) == expected


def test_ca_messages_field_numbers() -> None:
    req = ca_pb2.IstioCertificateRequest(csr="CSR", validity_duration=86400)
    req.metadata.fields["ImpersonatedIdentity"].string_value = "spiffe://x"
    meta = ld(1, s(1, "ImpersonatedIdentity"), ld(2, s(3, "spiffe://x")))
    assert req.SerializeToString(deterministic=True) == s(1, "CSR") + vi(3, 86400) + ld(4, meta)
    resp = ca_pb2.IstioCertificateResponse.FromString(s(1, "leaf") + s(1, "root"))
    assert list(resp.cert_chain) == ["leaf", "root"]


# --- the record (what the state store keeps), straight from the protobuf ---------------------


def test_the_record_from_xds_is_the_one_the_store_makes_of_the_workload() -> None:
    """``workload_record`` builds the store's record from the protobuf directly (the snapshot's
    hot path); ``records.workload_tuple`` builds it from a model object (a local config). Both
    must give the same tuple, position for position."""
    from ztunnel.state.records import workload_tuple
    from ztunnel.xds.convert import workload_record
    from ztunnel.xds.protos import workload_pb2 as wl_pb

    table: dict[str, int] = {"": 0}

    def intern(text: str) -> int:
        return table.setdefault(text, len(table))

    for raw in (FULL_WORKLOAD, workload_address(s(20, "uid-1"), s(1, "a"), s(2, "ns"))):
        pb = wl_pb.Address.FromString(raw).workload
        w = decode_address(raw)
        assert isinstance(w, Workload)
        assert workload_record(pb, intern) == workload_tuple(w, intern)


def test_a_rejected_workload_leaves_no_string_in_the_store() -> None:
    """Every check comes before the first string is interned; and a string interned for a
    record that is never stored is dropped at commit."""
    from ztunnel.state.store import State
    from ztunnel.xds.convert import workload_record
    from ztunnel.xds.protos import workload_pb2 as wl_pb

    st = State()
    bad = wl_pb.Workload(uid="u", name="n", namespace="some-namespace", status=99)
    with pytest.raises(ConversionError, match="status"), st.batch():
        workload_record(bad, st.interner)
    assert st.counts()["strings"] == 1  # (the empty string, always there)
    with st.batch():
        st.interner("interned-but-never-stored")
    assert st.counts()["strings"] == 1
