"""Same state, same decision: one test per row of issue 16, against the Rust ztunnel.

Every resource is built with the protoc-generated classes (``ztunnel/xds/protos/*_pb2``, whose
field numbers and types match istio/ztunnel ``proto/workload.proto`` and
``proto/authorization.proto``), serialised, and fed to the same entry point istiod's bytes
reach: ``AdsClient._handle_response`` with a serialized ``DeltaDiscoveryResponse``, or ``decode_*``. Each
test asserts the decision the named Rust function makes.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from ztunnel.config import Config, ConfigError, ProxyMode
from ztunnel.core.addr import SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.proxy.route import RouteKind, decide_outbound
from ztunnel.state.authz import Connection, evaluate
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import NetworkAddress, Service, ServiceVisibility, Workload
from ztunnel.state.store import State
from ztunnel.xds.client import AdsClient, StateUpdater
from ztunnel.xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, decode_address
from ztunnel.xds.protos import authorization_pb2 as authz_pb
from ztunnel.xds.protos import discovery_pb2 as ds
from ztunnel.xds.protos import workload_pb2 as wl_pb
from ztunnel.xds.wire import LazyDeltaResponse

pytestmark = pytest.mark.timeout(20)

IP4 = ipaddress.IPv4Address
IP6 = ipaddress.IPv6Address


# --- feeding resources ---------------------------------------------------------------------------


class Feed:
    """An ADS client with no connection: responses go through its real handling path."""

    def __init__(self) -> None:
        self.state = State()
        cfg = Config.from_env({"XDS_ADDRESS": "https://istiod.invalid:15012"})
        self.client = AdsClient(cfg, StateUpdater(self.state))
        self.nonce = 0

    def push(
        self,
        type_url: str,
        resources: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
        removed: list[str] = (),  # type: ignore[assignment]
    ) -> ds.DeltaDiscoveryRequest:
        self.nonce += 1
        resp = ds.DeltaDiscoveryResponse(type_url=type_url, nonce=str(self.nonce))
        for name, body in resources:
            r = resp.resources.add(name=name, version="1")
            r.resource.type_url = type_url
            r.resource.value = body
        resp.removed_resources.extend(removed)
        # (as the wire brings it: ztunnel.xds.wire reads the serialized response lazily)
        return self.client._handle_response(LazyDeltaResponse(resp.SerializeToString()))

    def addresses(self, *items: wl_pb.Address) -> ds.DeltaDiscoveryRequest:
        return self.push(
            ADDRESS_TYPE_URL, [(_address_name(a), a.SerializeToString()) for a in items]
        )

    def policy(self, name: str, pb: authz_pb.Authorization) -> ds.DeltaDiscoveryRequest:
        return self.push(AUTHORIZATION_TYPE_URL, [(name, pb.SerializeToString())])


def _address_name(a: wl_pb.Address) -> str:
    if a.HasField("workload"):
        return a.workload.uid
    return f"{a.service.namespace}/{a.service.hostname}"


def nacked(req: ds.DeltaDiscoveryRequest) -> bool:
    return bool(req.error_detail.message)


def pod(
    name: str,
    ns: str,
    *ips: bytes,
    services: dict[str, dict[int, int]] | None = None,
    hbone: bool = True,
    node: str = "node-1",
    sa: str = "",
    network: str = "",
    **kw: object,
) -> wl_pb.Address:
    w = wl_pb.Workload(
        uid=f"cluster1//v1/Pod/{ns}/{name}",
        name=name,
        namespace=ns,
        addresses=list(ips),
        tunnel_protocol=wl_pb.HBONE if hbone else wl_pb.NONE,
        node=node,
        service_account=sa,
        network=network,
        **kw,  # type: ignore[arg-type]
    )
    for key, ports in (services or {}).items():
        lst = w.services[key]
        for sp, tp in ports.items():
            lst.ports.add(service_port=sp, target_port=tp)
    return wl_pb.Address(workload=w)


def service(
    name: str,
    ns: str,
    *vips: bytes | tuple[bytes, int],
    ports: dict[int, int] | None = None,
    **kw: object,
) -> wl_pb.Address:
    s = wl_pb.Service(name=name, namespace=ns, hostname=f"{name}.{ns}.svc.cluster.local", **kw)  # type: ignore[arg-type]
    for v in vips:
        if isinstance(v, tuple):
            s.addresses.add(network="", address=v[0], length=v[1])
        else:
            s.addresses.add(network="", address=v)
    for sp, tp in (ports or {80: 8080}).items():
        s.ports.add(service_port=sp, target_port=tp)
    return wl_pb.Address(service=s)


def b(ip: str) -> bytes:
    return ipaddress.ip_address(ip).packed


def na(ip: str) -> NetworkAddress:
    return NetworkAddress("", ipaddress.ip_address(ip))


def key(name: str, ns: str) -> str:
    return f"{ns}/{name}.{ns}.svc.cluster.local"


def client_in(feed: Feed, ns: str, ip: str = "10.9.9.9") -> Workload:
    feed.addresses(pod(f"client-{ns}", ns, b(ip)))
    w = feed.state.find_workload_by_addr(na(ip))
    assert w is not None
    return w


# --- row: IP bytes ::ffff:a.b.c.d ----------------------------------------------------------------


def test_ipv4_mapped_bytes_stay_ipv6_in_state() -> None:
    # Rust state/workload.rs byte_to_ip: 16 bytes are an Ipv6Addr, mapped or not; the stores
    # key on it unchanged (WorkloadStore::find_address, ServiceStore::get_best_by_vip), so a
    # lookup of the IPv4 form misses and one of the IPv6 form hits.
    feed = Feed()
    mapped = IP6("::ffff:10.1.2.3").packed
    assert not nacked(
        feed.addresses(pod("a", "ns", mapped), service("s", "ns", IP6("::ffff:10.96.0.1").packed))
    )
    w = feed.state.find_workload_by_uid("cluster1//v1/Pod/ns/a")
    assert w is not None and w.addresses == (IP6("::ffff:10.1.2.3"),)
    assert feed.state.find_workload_by_addr(na("10.1.2.3")) is None
    assert feed.state.find_workload_by_addr(na("::ffff:10.1.2.3")) is w
    assert feed.state.find_service_by_vip(na("10.96.0.1")) is None
    assert feed.state.find_service_by_vip(na("::ffff:10.96.0.1")) is not None


def test_ipv4_mapped_in_local_config_stays_ipv6() -> None:
    # Rust deserialises workloadIps as IpAddr from the string: "::ffff:1.2.3.4" is IPv6.
    cfg = load_local_config(
        "workloads:\n- {namespace: ns, name: a, workloadIps: ['::ffff:1.2.3.4']}\n"
    )
    assert cfg.workloads[0].addresses == (IP6("::ffff:1.2.3.4"),)


# --- row: Service.visibility unknown enum value --------------------------------------------------


def test_unknown_visibility_is_public_not_nack() -> None:
    # Rust Service::try_from: Visibility::try_from(v).unwrap_or_default() -> Public.
    feed = Feed()
    addr = service("s", "ns", b("10.96.0.1"))
    addr.service.visibility = 7  # type: ignore[assignment]
    assert not nacked(feed.addresses(addr))
    s = feed.state.find_service(key("s", "ns"))
    assert s is not None and s.visibility is ServiceVisibility.PUBLIC
    assert feed.state.find_service_by_vip(na("10.96.0.1"), "elsewhere") is s


# --- row: authz entry with an empty match or a /33 range -------------------------------------------


def _allow(*matches: authz_pb.Match) -> authz_pb.Authorization:
    pb = authz_pb.Authorization(
        name="p", namespace="ns", scope=authz_pb.NAMESPACE, action=authz_pb.ALLOW
    )
    pb.rules.add().clauses.add().matches.extend(matches)
    return pb


def _conn(src: str, principal: Identity | None = None, port: int = 8080) -> Connection:
    return Connection(ipaddress.ip_address(src), principal, IP4("10.0.0.1"), port)


def test_authz_empty_string_match_is_dropped_policy_kept() -> None:
    # Rust rbac.rs RbacMatch::try_from: principals.iter().filter_map(From::from): a StringMatch
    # with no match_type becomes None and is dropped; the exact match next to it stays.
    feed = Feed()
    m = authz_pb.Match()
    m.principals.add()  # no exact/prefix/suffix/presence
    m.principals.add(exact="cluster.local/ns/ns/sa/good")
    assert not nacked(feed.policy("ns/p", _allow(m)))
    p = feed.state.find_policy("ns/p")
    assert p is not None
    good = Identity("cluster.local", "ns", "good")
    bad = Identity("cluster.local", "ns", "bad")
    assert evaluate([p], _conn("10.0.0.9", good)).allowed
    assert not evaluate([p], _conn("10.0.0.9", bad)).allowed


def test_authz_bad_cidr_entry_is_dropped_policy_kept() -> None:
    # Rust rbac.rs: source_ips.filter_map(|a| a.try_into().ok()): IpNet::new(ip, 33) fails,
    # that entry is dropped, 10.0.0.0/8 next to it stays.
    feed = Feed()
    m = authz_pb.Match()
    m.source_ips.add(address=b("192.168.0.0"), length=33)
    m.source_ips.add(address=b("10.0.0.0"), length=8)
    assert not nacked(feed.policy("ns/p", _allow(m)))
    p = feed.state.find_policy("ns/p")
    assert p is not None
    assert evaluate([p], _conn("10.2.3.4")).allowed
    assert not evaluate([p], _conn("192.168.0.1")).allowed


def test_authz_match_emptied_by_drops_is_skipped() -> None:
    # Rust Authorization::matches: a match whose every entry was dropped is empty and skipped
    # ("empty clause"), so an ALLOW whose only match was invalid matches nothing.
    feed = Feed()
    m = authz_pb.Match()
    m.source_ips.add(address=b("192.168.0.0"), length=33)
    assert not nacked(feed.policy("ns/p", _allow(m)))
    p = feed.state.find_policy("ns/p")
    assert p is not None and not evaluate([p], _conn("192.168.0.1")).allowed


# --- row: several services on one VIP --------------------------------------------------------------


def test_shared_vip_best_match_per_client_namespace() -> None:
    # Rust ServiceStore::insert_internal keeps one slot per namespace on a VIP and
    # get_best_by_vip picks the client's namespace, else canonical, else the first.
    feed = Feed()
    vip = b("10.96.0.50")
    feed.addresses(
        service("api", "a", vip, ports={80: 8081}),
        service("api", "b", vip, ports={80: 8082}),
        pod("ep-a", "a", b("10.0.1.1"), services={key("api", "a"): {}}),
        pod("ep-b", "b", b("10.0.2.1"), services={key("api", "b"): {}}),
    )
    from_a, from_b, from_c = (
        client_in(feed, "a", "10.9.0.1"),
        client_in(feed, "b", "10.9.0.2"),
        client_in(feed, "c", "10.9.0.3"),
    )
    dst = SocketAddr(IP4("10.96.0.50"), 80)
    ra = decide_outbound(feed.state, from_a, dst)
    rb = decide_outbound(feed.state, from_b, dst)
    rc = decide_outbound(feed.state, from_c, dst)
    assert ra.authority == SocketAddr(IP4("10.0.1.1"), 8081)
    assert rb.authority == SocketAddr(IP4("10.0.2.1"), 8082)
    assert rc.authority == SocketAddr(IP4("10.0.1.1"), 8081)  # first inserted


def test_removing_one_service_of_a_shared_vip_keeps_the_others() -> None:
    # Rust ServiceStore::remove: vip_services.retain(|s| s.namespace != prev.namespace).
    feed = Feed()
    vip = b("10.96.0.50")
    feed.addresses(service("api", "a", vip), service("api", "b", vip))
    feed.push(ADDRESS_TYPE_URL, removed=[key("api", "a")])
    got = feed.state.find_service_by_vip(na("10.96.0.50"), "a")
    assert got is not None and got.namespace == "b"


def test_shared_vip_prefers_canonical_outside_the_namespace() -> None:
    # Rust ServiceMatch::find_best_match: Namespace > Canonical > First.
    feed = Feed()
    vip = b("10.96.0.51")
    feed.addresses(service("api", "a", vip), service("api", "b", vip, canonical=True))
    got = feed.state.find_service_by_vip(na("10.96.0.51"), "c")
    assert got is not None and got.namespace == "b"
    got = feed.state.find_service_by_vip(na("10.96.0.51"), "a")
    assert got is not None and got.namespace == "a"


# --- row: visibility and CIDR VIPs in routing ------------------------------------------------------


def test_namespace_visibility_hides_the_service_from_other_namespaces() -> None:
    # Rust get_best_by_vip filters by Service::visible_to(client namespace); an invisible VIP
    # is not a service for that client, so find_upstream falls through to passthrough.
    feed = Feed()
    feed.addresses(
        service("private", "a", b("10.96.0.60"), visibility=wl_pb.Service.NAMESPACE),
        pod("ep", "a", b("10.0.1.5"), services={key("private", "a"): {}}),
    )
    dst = SocketAddr(IP4("10.96.0.60"), 80)
    inside = decide_outbound(feed.state, client_in(feed, "a", "10.9.0.1"), dst)
    outside = decide_outbound(feed.state, client_in(feed, "b", "10.9.0.2"), dst)
    assert inside.kind is RouteKind.HBONE and inside.authority == SocketAddr(IP4("10.0.1.5"), 8080)
    assert outside.kind is RouteKind.PASSTHROUGH and outside.target == dst
    # Hostname lookups filter the same way (get_best_by_host).
    host = "private.a.svc.cluster.local"
    assert feed.state.find_service_by_hostname(host, "b") is None
    assert feed.state.find_service_by_hostname(host, "a") is not None


def test_cidr_vip_routes_and_ranks_namespace_then_prefix() -> None:
    # Rust Service::try_from: a NetworkAddress with a length below the family's maximum is a
    # CIDR VIP; get_best_by_cidr_vip ranks (in_namespace, prefix_len, canonical).
    feed = Feed()
    feed.addresses(
        service("wide", "a", (b("10.100.0.0"), 16), ports={80: 9001}),
        service("narrow", "b", (b("10.100.5.0"), 24), ports={80: 9002}),
        pod("ep-w", "a", b("10.0.3.1"), services={key("wide", "a"): {}}),
        pod("ep-n", "b", b("10.0.3.2"), services={key("narrow", "b"): {}}),
    )
    dst = SocketAddr(IP4("10.100.5.7"), 80)
    from_c = decide_outbound(feed.state, client_in(feed, "c", "10.9.0.3"), dst)
    from_a = decide_outbound(feed.state, client_in(feed, "a", "10.9.0.1"), dst)
    assert from_c.authority == SocketAddr(IP4("10.0.3.2"), 9002)  # longest prefix
    assert from_a.authority == SocketAddr(IP4("10.0.3.1"), 9001)  # own namespace first
    other = decide_outbound(
        feed.state, client_in(feed, "c", "10.9.0.4"), SocketAddr(IP4("10.100.9.9"), 80)
    )
    assert other.authority == SocketAddr(IP4("10.0.3.1"), 9001)
    # An exact VIP beats any CIDR.
    feed.addresses(
        service("exact", "c", b("10.100.5.7"), ports={80: 9003}),
        pod("ep-e", "c", b("10.0.3.3"), services={key("exact", "c"): {}}),
    )
    assert decide_outbound(
        feed.state, client_in(feed, "d", "10.9.0.5"), dst
    ).authority == SocketAddr(IP4("10.0.3.3"), 9003)


# --- row: dual-stack endpoints -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("families", "dst", "want"),
    [
        (wl_pb.AUTOMATIC, "10.96.0.70", "10.0.4.1"),
        (wl_pb.AUTOMATIC, "fd96::70", "fd00::4:1"),  # the original destination's family
        (wl_pb.DUAL, "fd96::70", "fd00::4:1"),
        (wl_pb.IPV4_ONLY, "fd96::70", "10.0.4.1"),  # restricted by ip_families
        (wl_pb.IPV6_ONLY, "10.96.0.70", "fd00::4:1"),
    ],
)
def test_dual_stack_endpoint_family(families: int, dst: str, want: str) -> None:
    # Rust pick_workload_destination_or_resolve: filter by the service's ip_families, then
    # find_or_first(same family as the original destination).
    feed = Feed()
    feed.addresses(
        service("ds", "a", b("10.96.0.70"), b("fd96::70"), ip_families=families),
        pod("ep", "a", b("10.0.4.1"), b("fd00::4:1"), services={key("ds", "a"): {}}),
    )
    src = client_in(feed, "a")
    route = decide_outbound(feed.state, src, SocketAddr(ipaddress.ip_address(dst), 80))
    assert route.authority is not None and route.authority.ip == ipaddress.ip_address(want)


# --- row: XDS_ON_DEMAND and DNS-resolved endpoints: tests/netns/test_on_demand.py ----------------


def test_on_demand_subscribes_to_nothing() -> None:
    # Rust xds/client.rs: with XDS_ON_DEMAND the Address type subscribes ["*"] and unsubscribes
    # ["*"] in the same request (no wildcard); the fetch is per address (test_on_demand.py).
    # (DNS capture off: the DNS proxy with on-demand xDS is a config error, config.rs)
    cfg = Config.from_env(
        {
            "XDS_ADDRESS": "https://istiod.invalid:15012",
            "XDS_ON_DEMAND": "true",
            "ISTIO_META_DNS_CAPTURE": "false",
        }
    )
    client = AdsClient(cfg, StateUpdater(State()))
    reqs = {r.type_url: r for r in client._initial_requests()}
    addr = reqs[ADDRESS_TYPE_URL]
    assert list(addr.resource_names_subscribe) == ["*"]
    assert list(addr.resource_names_unsubscribe) == ["*"]
    assert list(reqs[AUTHORIZATION_TYPE_URL].resource_names_subscribe) == []


# --- row: ISTIO_META_CLUSTER_ID vs CLUSTER_ID ------------------------------------------------------


def test_istio_meta_cluster_id_wins() -> None:
    # Rust construct_config: parse(ISTIO_META_CLUSTER_ID) first, CLUSTER_ID only when unset.
    env = {"CLUSTER_ID": "from-plain", "ISTIO_META_CLUSTER_ID": "from-meta"}
    assert Config.from_env(env).cluster_id == "from-meta"
    assert Config.from_env({"CLUSTER_ID": "from-plain"}).cluster_id == "from-plain"
    assert Config.from_env({}).cluster_id == "Kubernetes"


# --- row: PROXY_WORKLOAD_INFO ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("ns/name/sa", ("ns", "name", "sa")),
        ("ns/name/sa/extra", ("ns", "name", "sa/extra")),  # splitn(3, "/")
        ("ns//sa", ("ns", "", "sa")),  # empty parts allowed
        ("//", ("", "", "")),
    ],
)
def test_proxy_workload_info_split_like_rust(raw: str, want: tuple[str, str, str]) -> None:
    # Rust construct_config: raw.splitn(3, "/") must give exactly 3 parts.
    c = Config.from_env({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": raw})
    info = c.proxy_workload_info
    assert info is not None and (info.namespace, info.name, info.service_account) == want


def test_proxy_workload_info_two_parts_refused_in_dedicated_mode() -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_env({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/name"})
    assert e.value.var == "PROXY_WORKLOAD_INFO"


def test_proxy_workload_info_not_parsed_in_shared_mode() -> None:
    # Rust: proxy_workload_information is only read when proxy_mode != Shared.
    c = Config.from_env({"PROXY_WORKLOAD_INFO": "garbage"})
    assert c.proxy_mode is ProxyMode.SHARED and c.proxy_workload_info is None


# --- row: local config keys ------------------------------------------------------------------------


LOCAL = """
workloads:
- uid: c//v1/Pod/a/ep
  name: ep
  namespace: a
  workloadIps: [10.0.5.1]
  protocol: HBONE
  workloadType: statefulset
  services: {"a/wide.a.svc.cluster.local": {80: 8080}}
services:
- name: wide
  namespace: a
  hostname: wide.a.svc.cluster.local
  vips: []
  cidrVips: [{network: "", cidr: 10.200.0.0/16}]
  ports: {80: 8080}
  visibility: Namespace
  weightedWaypoints:
  - {destination: {destination: "/10.0.9.9", hboneMtlsPort: 15008}, weight: 3}
"""


def test_local_config_accepts_cidr_vips_visibility_weighted_waypoints_any_type() -> None:
    # Rust LocalConfig -> Service/Workload serde structs: cidrVips, visibility,
    # weightedWaypoints are fields; workloadType is a free string.
    cfg = load_local_config(LOCAL)
    (s,) = cfg.services
    assert s.visibility is ServiceVisibility.NAMESPACE
    assert [str(c.cidr) for c in s.cidr_vips] == ["10.200.0.0/16"]
    assert s.weighted_waypoints[0].weight == 3
    st = State()
    cfg.apply_to(st)
    assert st.find_service_by_vip(na("10.200.1.1"), "a") is not None
    assert st.find_service_by_vip(na("10.200.1.1"), "b") is None  # namespace-visible only


# --- row: a file workload with no clusterId ---------------------------------------------------------


def test_file_workload_without_cluster_id_is_empty() -> None:
    # Rust Workload serde: #[serde(default)] cluster_id -> "" (baggage then omits it).
    cfg = load_local_config("workloads:\n- {namespace: ns, name: a}\n")
    assert cfg.workloads[0].cluster_id == ""
    # xDS keeps its default: Workload::try_from maps "" to "Kubernetes".
    w = decode_address(pod("a", "ns").SerializeToString())
    assert isinstance(w, Workload) and w.cluster_id == "Kubernetes"


# --- row: local config defaults (trustDomain, serviceAccount, workloadType) -------------------------


@pytest.mark.parametrize(
    ("fields", "identity", "workload_type", "dumped"),
    [
        # Rust src/xds.rs LocalWorkload flattens src/state/workload.rs Workload, whose
        # trust_domain, service_account and workload_type are #[serde(default)] Strng: omitted
        # means "", never the xDS conversion's cluster.local / default / deployment. The
        # identity is then spiffe://<td>/ns/<ns>/sa/<sa> with empty parts (Identity Display).
        ("", "spiffe:///ns/ns/sa/", "", {}),
        ("serviceAccount: sa", "spiffe:///ns/ns/sa/sa", "", {"serviceAccount": "sa"}),
        ("trustDomain: td", "spiffe://td/ns/ns/sa/", "", {"trustDomain": "td"}),
        # Free strings, shown as given (admin config_dump serializes the Strng); skipped when
        # empty (skip_serializing_if = "is_default").
        ("workloadType: statefulset", "spiffe:///ns/ns/sa/", "statefulset", {}),
        ("workloadType: Pod", "spiffe:///ns/ns/sa/", "Pod", {}),
    ],
)
def test_file_workload_defaults_are_rusts_serde_defaults(
    fields: str, identity: str, workload_type: str, dumped: dict[str, str]
) -> None:
    from ztunnel.admin.config_dump import workload as workload_json

    text = "workloads:\n- namespace: ns\n  name: a\n" + (f"  {fields}\n" if fields else "")
    (w,) = load_local_config(text).workloads
    assert str(w.identity) == identity
    assert w.workload_type == workload_type
    out = workload_json(w)
    for key in ("trustDomain", "serviceAccount"):
        assert out.get(key) == dumped.get(key)
    assert out.get("workloadType") == (workload_type or None)
    # Rust Identity::from_str (src/identity/manager.rs) takes the empty parts back.
    assert Identity.parse(identity) == w.identity


def test_xds_workload_keeps_the_conversion_defaults() -> None:
    # Rust Workload::try_from(XdsWorkload): "" -> cluster.local / default, and workload_type()
    # .as_str_name().to_lowercase() (an unknown number is the enum default, deployment).
    w = decode_address(pod("a", "ns").SerializeToString())
    assert isinstance(w, Workload)
    assert (str(w.identity), w.workload_type) == (
        "spiffe://cluster.local/ns/ns/sa/default",
        "deployment",
    )


def test_baggage_carries_the_file_workload_type_as_is() -> None:
    # Rust baggage_header_val formats k8s.{workload_type}.name with the string as it is.
    from ztunnel.hbone.headers import baggage

    (w,) = load_local_config(
        "workloads:\n- {namespace: ns, name: a, workloadName: a, workloadType: statefulset}\n"
    ).workloads
    assert "k8s.statefulset.name=a" in baggage(w).split(",")
    (w,) = load_local_config("workloads:\n- {namespace: ns, name: a, workloadName: a}\n").workloads
    assert "k8s..name=a" in baggage(w).split(",")


def test_baggage_has_no_cluster_without_the_workloads_cluster_id() -> None:
    # Rust Workload::baggage: cluster_id only when the workload's is not empty (no fallback to
    # the proxy's CLUSTER_ID); from xDS an empty clusterId is already "Kubernetes".
    from ztunnel.core.addr import SocketAddr
    from ztunnel.hbone.headers import request_headers

    def sent(yaml: str) -> str:
        (w,) = load_local_config(yaml).workloads
        client = SocketAddr.parse("10.0.0.1:1234")
        return dict(request_headers(w, client, service_hostname=None))["baggage"]

    assert sent("workloads:\n- {namespace: ns, name: a}\n") == "k8s.namespace.name=ns"
    assert sent("workloads:\n- {namespace: ns, name: a, clusterId: c9}\n") == (
        "k8s.cluster.name=c9,k8s.namespace.name=ns"
    )


# --- row: authorization policy key ------------------------------------------------------------------


def test_policy_keyed_by_xds_resource_name() -> None:
    # Rust ProxyStateUpdater::insert_authorization / remove_authorization key the store by the
    # xDS resource name, whatever the message's namespace/name say.
    feed = Feed()
    pb = _allow(authz_pb.Match(destination_ports=[1]))
    assert not nacked(feed.policy("custom-name", pb))
    assert feed.state.find_policy("custom-name") is not None
    assert feed.state.find_policy("ns/p") is None
    feed.push(AUTHORIZATION_TYPE_URL, removed=["custom-name"])
    assert list(feed.state.policies()) == []


# --- row: ENABLE_ORIG_SRC=false ---------------------------------------------------------------------


def test_enable_orig_src_false_is_read() -> None:
    # Rust config: require_original_source = parse(ENABLE_ORIG_SRC); false turns spoofing off
    # for the listeners and for the upstream connection to the app (proxy.rs
    # maybe_set_transparent); end to end in tests/netns/test_orig_src.py.
    assert Config.from_env({"ENABLE_ORIG_SRC": "false"}).enable_orig_src is False


# --- row: locality-aware ranking incl. network preference ------------------------------------------


def test_network_preferred_ranking() -> None:
    # Rust ProxyState::load_balance: with NETWORK first in routing_preference, a same-network
    # endpoint gets rank += len-1 and a network mismatch does not stop the other scopes, so a
    # same-network endpoint in another region beats another-network one in the same region.
    feed = Feed()
    svc = service("lb", "a", b("10.96.0.80"))
    lb = svc.service.load_balancing
    lb.mode = wl_pb.LoadBalancing.FAILOVER
    lb.routing_preference.extend([wl_pb.LoadBalancing.NETWORK, wl_pb.LoadBalancing.REGION])
    here = pod("ep-here", "a", b("10.0.6.1"), network="", services={key("lb", "a"): {}})
    here.workload.locality.region = "far"
    there = pod("ep-there", "a", b("10.0.6.2"), network="net2", services={key("lb", "a"): {}})
    there.workload.locality.region = "near"
    there.workload.network_gateway.address.address = b("10.0.99.1")
    there.workload.network_gateway.hbone_mtls_port = 15008
    client = pod("client", "a", b("10.9.0.1"))
    client.workload.locality.region = "near"
    feed.addresses(svc, here, there, client)
    src = feed.state.find_workload_by_addr(na("10.9.0.1"))
    s = feed.state.find_service(key("lb", "a"))
    assert src is not None and s is not None
    for _ in range(20):
        picked = feed.state.load_balance(s, 80, src)
        assert picked is not None and picked[0].name == "ep-here"


def test_passthrough_service_always_goes_to_the_original_destination() -> None:
    # Rust find_upstream: a PASSTHROUGH service returns OriginalDestination before load
    # balancing, even with healthy endpoints.
    feed = Feed()
    svc = service("pt", "a", b("10.96.0.90"))
    svc.service.load_balancing.mode = wl_pb.LoadBalancing.PASSTHROUGH
    feed.addresses(svc, pod("ep", "a", b("10.0.7.1"), services={key("pt", "a"): {}}))
    dst = SocketAddr(IP4("10.96.0.90"), 80)
    assert decide_outbound(feed.state, client_in(feed, "a"), dst).kind is RouteKind.PASSTHROUGH


# --- chart settings -----------------------------------------------------------------------------------


def test_mesh_config_and_proxy_config(tmp_path: Path) -> None:
    # Rust construct_proxy_config: mesh config defaultConfig, then PROXY_CONFIG (later wins,
    # metadata merged, ISTIO_META_ stripped); discoveryAddress under XDS_ADDRESS; ports.
    mesh = tmp_path / "mesh"
    mesh.write_text(
        "defaultConfig:\n  discoveryAddress: istiod-mesh:15012\n  proxyAdminPort: 15990\n"
        "  proxyMetadata: {ISTIO_META_A: mesh, B: mesh}\n"
    )
    env = {"PROXY_CONFIG": "statsPort: 15991\nproxyMetadata: {B: env}\nconcurrency: 4\n"}
    c = Config.from_env(env, mesh_config=str(mesh))
    assert c.xds_address == "https://istiod-mesh:15012"
    assert (c.admin_port, c.stats_port, c.concurrency) == (15990, 15991, 4)
    assert dict(c.proxy_metadata) == {"A": "mesh", "B": "env"}
    env["XDS_ADDRESS"] = "https://explicit:15012"
    assert Config.from_env(env, mesh_config=str(mesh)).xds_address == "https://explicit:15012"
    with pytest.raises(ConfigError) as e:
        Config.from_env({"PROXY_CONFIG": "[not, a, mapping]"})
    assert e.value.var == "PROXY_CONFIG"


def test_compliance_policy_pqc_refused_tls12_read() -> None:
    # Rust src/lib.rs: COMPLIANCE_POLICY == "pqc" restricts key exchange (we cannot: refused);
    # TLS12_ENABLED == "true" exactly enables TLS 1.2.
    with pytest.raises(ConfigError) as e:
        Config.from_env({"COMPLIANCE_POLICY": "pqc"})
    assert e.value.var == "COMPLIANCE_POLICY"
    assert Config.from_env({"COMPLIANCE_POLICY": "fips-140-2"}).tls12_enabled is False
    assert Config.from_env({"TLS12_ENABLED": "true"}).tls12_enabled is True
    assert Config.from_env({"TLS12_ENABLED": "1"}).tls12_enabled is False


def test_prefered_service_namespace_ranks_hostnames() -> None:
    # Rust find_best_match(client_ns, preferred_namespace): client's namespace, canonical,
    # preferred namespace, first.
    assert (
        Config.from_env({"PREFERED_SERVICE_NAMESPACE": "istio-system"}).prefered_service_namespace
        == "istio-system"
    )
    st = State()
    for ns in ("a", "istio-system"):
        st.upsert_service(Service(name="h", namespace=ns, hostname="h.example.com"))
    got = st.find_service_by_hostname("h.example.com", "c", preferred_namespace="istio-system")
    assert got is not None and got.namespace == "istio-system"
    got = st.find_service_by_hostname("h.example.com", "c")
    assert got is not None and got.namespace == "a"


# --- row: ServiceEntry endpoints resolved by DNS (workload hostname) ----------------------------


async def test_hostname_endpoint_is_resolved_preferring_the_original_family() -> None:
    # Rust pick_workload_destination_or_resolve -> resolve_workload_address (counts
    # on_demand_dns) -> resolve_on_demand_dns: an address of the original destination's
    # family, else any; none is NoResolvedAddresses.
    from ztunnel.proxy.route import NeedsResolution, NoResolvedAddresses, decide_outbound_resolving

    feed = Feed()
    ep = pod("se", "a", hbone=False, services={key("ext", "a"): {}})
    ep.workload.hostname = "api.example.com"
    feed.addresses(service("ext", "a", b("10.96.0.99"), b("fd96::99"), ports={443: 443}), ep)
    src = client_in(feed, "a")
    dst = SocketAddr(IP4("10.96.0.99"), 443)
    with pytest.raises(NeedsResolution):
        decide_outbound(feed.state, src, dst)
    asked: list[str] = []
    counted: list[str] = []

    async def resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        asked.append(host)
        return [IP6("2001:db8::1"), IP4("192.0.2.7")]

    def on_dns(s: Workload | None, w: Workload) -> None:
        counted.append(w.hostname)

    r = await decide_outbound_resolving(feed.state, src, dst, resolve=resolve, on_dns=on_dns)
    assert r.kind is RouteKind.DIRECT and r.target == SocketAddr(IP4("192.0.2.7"), 443)
    r6 = await decide_outbound_resolving(
        feed.state, src, SocketAddr(IP6("fd96::99"), 443), resolve=resolve, on_dns=on_dns
    )
    assert r6.target == SocketAddr(IP6("2001:db8::1"), 443)
    assert asked == counted == ["api.example.com", "api.example.com"]

    async def nothing(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return []

    with pytest.raises(NoResolvedAddresses):
        await decide_outbound_resolving(feed.state, src, dst, resolve=nothing)


def test_dual_stack_waypoint_follows_the_callers_family() -> None:
    # Rust fetch_waypoint: a waypoint named by hostname is dialled with the original
    # destination as target (pick_workload_destination_or_resolve keeps the caller's family).
    feed = Feed()
    target = service("web", "a", b("10.96.0.71"), b("fd96::71"))
    target.service.waypoint.hostname.namespace = "a"
    target.service.waypoint.hostname.hostname = "wp.a.svc.cluster.local"
    target.service.waypoint.hbone_mtls_port = 15008
    feed.addresses(
        target,
        service("wp", "a", b("10.96.0.72"), ports={15008: 15008}),
        pod("wp", "a", b("10.0.8.1"), b("fd00::8:1"), services={key("wp", "a"): {}}),
    )
    src = client_in(feed, "a")
    r4 = decide_outbound(feed.state, src, SocketAddr(IP4("10.96.0.71"), 80))
    r6 = decide_outbound(feed.state, src, SocketAddr(IP6("fd96::71"), 80))
    assert r4.via_waypoint and r4.target == SocketAddr(IP4("10.0.8.1"), 15008)
    assert r6.via_waypoint and r6.target == SocketAddr(IP6("fd00::8:1"), 15008)
