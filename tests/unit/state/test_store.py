"""State indexes: lookups, re-indexing on upsert/remove, hostname choice, policies, load balancing."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from ztunnel.core.addr import parse_ip
from ztunnel.state import store as store_module
from ztunnel.state.model import (
    ApplicationTunnel,
    Authorization,
    GatewayAddress,
    HealthPolicy,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    PolicyAction,
    PolicyScope,
    Service,
    ServicePort,
    TunnelProtocol,
    Workload,
    WorkloadStatus,
)
from ztunnel.state.shared import pack_i
from ztunnel.state.store import (
    ChangeKind,
    State,
    StateChange,
    _evict_oldest,
    _PickTable,
    summarize,
)

SVC_KEY = "ns/svc.ns.svc.cluster.local"


def na(text: str, network: str = "") -> NetworkAddress:
    return NetworkAddress(network, parse_ip(text))


def wl(
    name: str, *ips: str, ns: str = "ns", ports: dict[int, int] | None = None, **kw: Any
) -> Workload:
    """A pod in ``ns``; ``ports`` makes it an endpoint of SVC_KEY with that port map."""
    services = kw.pop("services", {SVC_KEY: ports} if ports is not None else {})
    return Workload(
        uid=kw.pop("uid", f"c//v1/Pod/{ns}/{name}"),
        name=name,
        namespace=ns,
        addresses=tuple(parse_ip(i) for i in ips),
        services=services,
        **kw,
    )


def svc(
    *vips: str,
    ns: str = "ns",
    host: str = "svc.ns.svc.cluster.local",
    ports: tuple[tuple[int, int], ...] = ((80, 8080),),
    **kw: Any,
) -> Service:
    return Service(
        name=host.split(".")[0],
        namespace=ns,
        hostname=host,
        vips=tuple(na(v) for v in vips),
        ports=tuple(ServicePort(a, b) for a, b in ports),
        **kw,
    )


def pol(
    name: str, ns: str, scope: PolicyScope, action: PolicyAction = PolicyAction.ALLOW
) -> Authorization:
    return Authorization(name=name, namespace=ns, scope=scope, action=action)


# --- workload lookups and re-indexing --------------------------------------------------------


def test_workload_lookups() -> None:
    st = State()
    a = wl("a", "10.0.0.1", "fd00::1", node="n1", service_account="sa-a")
    st.upsert_workload(a)
    assert st.find_workload_by_uid(a.uid) is a
    assert st.find_workload_by_addr(na("10.0.0.1")) is a
    assert st.find_workload_by_addr(na("fd00::1")) is a
    assert st.find_workload_by_addr(na("::ffff:10.0.0.1")) is a  # v4-mapped is canonicalised
    assert st.find_workload_by_addr(na("10.0.0.1", "other-net")) is None
    assert st.find_workload_by_addr(na("10.0.0.2")) is None
    assert st.find_workload_by_info("a", "ns", "sa-a") is a
    assert st.find_workload_by_info("a", "ns", "sa-a", node="n1") is a
    assert st.find_workload_by_info("a", "ns", "sa-a", node="n2") is None
    assert st.find_workload_by_info("a", "ns", "default") is None
    assert st.find_workload_by_info("b", "ns", "sa-a") is None
    assert list(st.workloads()) == [a]


@pytest.mark.parametrize(
    ("first", "second", "gone", "found"),
    [
        # Same uid, new IP: the old IP must stop resolving.
        (wl("a", "10.0.0.1"), wl("a", "10.0.0.2"), "10.0.0.1", "10.0.0.2"),
        # Same uid, moved network.
        (wl("a", "10.0.0.1"), wl("a", "10.0.0.1", network="n2"), "10.0.0.1", None),
        # Becomes host-network: no longer owns the IP.
        (
            wl("a", "10.0.0.1"),
            wl("a", "10.0.0.1", network_mode=NetworkMode.HOST_NETWORK),
            "10.0.0.1",
            None,
        ),
    ],
)
def test_upsert_reindexes_addresses(
    first: Workload, second: Workload, gone: str, found: str | None
) -> None:
    st = State()
    st.upsert_workload(first)
    st.upsert_workload(second)
    assert st.find_workload_by_addr(na(gone)) is None
    if found:
        assert st.find_workload_by_addr(na(found)) is second
    assert st.find_workload_by_uid(second.uid) is second


def test_ip_moves_between_workloads() -> None:
    st = State()
    a, b = wl("a", "10.0.0.1"), wl("b")
    st.upsert_workload(a)
    st.upsert_workload(b)
    st.upsert_workload(wl("a"))  # a releases the IP
    b2 = wl("b", "10.0.0.1")
    st.upsert_workload(b2)
    assert st.find_workload_by_addr(na("10.0.0.1")) is b2
    st.remove_workload(b2.uid)
    assert st.find_workload_by_addr(na("10.0.0.1")) is None


def test_shared_ip_prefers_pods_then_hbone() -> None:
    st = State()
    entry = wl("se", "10.0.0.9", uid="c//networking.istio.io/ServiceEntry/ns/se")
    pod_tcp = wl("p1", "10.0.0.9")
    pod_hbone = wl("p2", "10.0.0.9", protocol=TunnelProtocol.HBONE)
    st.upsert_workload(entry)
    assert st.find_workload_by_addr(na("10.0.0.9")) is entry
    st.upsert_workload(pod_hbone)
    st.upsert_workload(pod_tcp)
    assert st.find_workload_by_addr(na("10.0.0.9")) is pod_hbone
    st.remove_workload(pod_hbone.uid)
    assert st.find_workload_by_addr(na("10.0.0.9")) is pod_tcp
    st.remove_workload(pod_tcp.uid)
    assert st.find_workload_by_addr(na("10.0.0.9")) is entry


def test_remove_workload_cleans_every_index() -> None:
    st = State()
    a = wl("a", "10.0.0.1", hostname="a.example.com", ports={80: 8080})
    st.upsert_workload(a)
    s = svc("10.96.0.1")
    st.upsert_service(s)
    assert st.endpoints(s) == [a]
    assert st.remove_workload(a.uid) is a
    assert st.remove_workload(a.uid) is None
    assert st.find_workload_by_uid(a.uid) is None
    assert st.find_workload_by_addr(na("10.0.0.1")) is None
    assert st.find_workload_by_info("a", "ns", "default") is None
    assert st.find_workload_by_hostname("a.example.com") is None
    assert st.endpoints(s) == []


def test_identity_index_follows_service_account_change() -> None:
    st = State()
    st.upsert_workload(wl("a", service_account="old"))
    st.upsert_workload(wl("a", service_account="new"))
    assert st.find_workload_by_info("a", "ns", "old") is None
    assert st.find_workload_by_info("a", "ns", "new") is not None


def test_host_network_workload_not_indexed_by_ip() -> None:
    st = State()
    st.upsert_workload(wl("h", "192.168.1.10", network_mode=NetworkMode.HOST_NETWORK))
    assert st.find_workload_by_addr(na("192.168.1.10")) is None
    assert st.find_workload_by_info("h", "ns", "default") is not None


# --- services ------------------------------------------------------------------------------


def test_service_lookups_and_vip_reindex() -> None:
    st = State()
    s1 = svc("10.96.0.1", "10.96.0.2")
    st.upsert_service(s1)
    assert st.find_service_by_vip(na("10.96.0.1")) is s1
    assert st.find_service(SVC_KEY) is s1
    s2 = svc("10.96.0.2", "10.96.0.3")  # drops .1, adds .3
    st.upsert_service(s2)
    assert st.find_service_by_vip(na("10.96.0.1")) is None
    assert st.find_service_by_vip(na("10.96.0.2")) is s2
    assert st.find_service_by_vip(na("10.96.0.3")) is s2
    assert st.find_service_by_vip(na("10.96.0.3", "elsewhere")) is None
    assert list(st.services()) == [s2]
    assert st.remove_service(SVC_KEY) is s2
    assert st.remove_service(SVC_KEY) is None
    assert st.find_service_by_vip(na("10.96.0.2")) is None
    assert st.find_service_by_hostname(s2.hostname) is None


def test_same_namespace_vip_slot_is_dropped_with_either_service() -> None:
    # Rust ServiceStore::insert_internal replaces the VIP's slot for the namespace (last
    # writer wins within a namespace) and ServiceStore::remove drops that namespace's slot
    # whoever holds it: removing the old service unroutes the VIP for the new one too.
    st = State()
    old = svc("10.96.0.1", host="old.ns.svc.cluster.local")
    new = svc("10.96.0.1", host="new.ns.svc.cluster.local")
    st.upsert_service(old)
    st.upsert_service(new)
    assert st.find_service_by_vip(na("10.96.0.1")) is new
    st.remove_service(old.key)
    assert st.find_service_by_vip(na("10.96.0.1")) is None


def test_find_address_precedence_follows_rust() -> None:
    # Rust ProxyState::find_address looks up workloads first, then service VIPs.
    st = State()
    s = svc("10.0.0.1")
    w = wl("a", "10.0.0.1")
    st.upsert_service(s)
    assert st.find_address(na("10.0.0.1")) is s
    st.upsert_workload(w)
    assert st.find_address(na("10.0.0.1")) is w
    assert st.find_address(na("10.0.0.2")) is None


@pytest.mark.parametrize(
    ("present", "prefer", "want"),
    [
        ({"a": False}, None, "a"),
        ({"a": False}, "zzz", "a"),
        ({"a": False, "b": False}, "b", "b"),
        ({"a": False, "b": False}, None, "a"),  # the first inserted
        ({"a": False, "b": True}, None, "b"),  # canonical wins outside the caller's namespace
        ({"a": False, "b": True}, "c", "b"),
        ({"a": False, "b": True}, "a", "a"),  # caller's namespace beats canonical
        ({"a": False, "b": True, "c": True}, None, "c"),  # the last canonical one
    ],
)
def test_hostname_preference(present: dict[str, bool], prefer: str | None, want: str) -> None:
    # Rust ServiceMatch::find_best_match over by_host in insertion order (here: sorted).
    st = State()
    for ns in sorted(present):
        st.upsert_service(svc(ns=ns, host="api.example.com", canonical=present[ns]))
    got = st.find_service_by_hostname("api.example.com", prefer)
    assert got is not None and got.namespace == want
    assert [s.namespace for s in st.find_services_by_hostname("api.example.com")] == sorted(present)
    assert st.find_service_by_hostname("nope.example.com", prefer) is None


def test_hostname_index_cleanup() -> None:
    st = State()
    st.upsert_service(svc(ns="a", host="h"))
    st.upsert_service(svc(ns="b", host="h"))
    st.remove_service("a/h")
    got = st.find_service_by_hostname("h", "a")
    assert got is not None and got.namespace == "b"
    st.remove_service("b/h")
    assert st.find_service_by_hostname("h") is None


def test_hostname_and_gateway_resolution() -> None:
    st = State()
    s = svc("10.96.0.5", ns="ns", host="wp.ns.svc.cluster.local")
    w = wl("ext", hostname="ext.example.com")
    st.upsert_service(s)
    st.upsert_workload(w)
    assert st.find_hostname("ns", "wp.ns.svc.cluster.local") is s
    assert st.find_hostname("ns", "ext.example.com") is w
    assert st.find_hostname("other", "ext.example.com") is None
    assert st.find_gateway(GatewayAddress(hostname=NamespacedHostname("ns", s.hostname))) is s
    assert st.find_gateway(GatewayAddress(address=na("10.96.0.5"))) is s
    assert st.find_gateway(GatewayAddress()) is None


def test_endpoints_and_services_for() -> None:
    st = State()
    a = wl("a", "10.0.0.1", ports={80: 8080})
    b = wl("b", "10.0.0.2", services={SVC_KEY: {}, "ns/other": {}})
    st.upsert_workload(a)  # before the service exists: still indexed
    st.upsert_workload(b)
    s = svc()
    assert st.endpoints(s) == [a, b]
    st.upsert_service(s)
    assert st.services_for(b) == [s]  # ns/other is unknown
    st.upsert_workload(wl("b", "10.0.0.2", services={"ns/other": {}}))  # b leaves the service
    assert st.endpoints(s) == [a]


# --- target ports --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("svc_ports", "ep_ports", "tunnel", "port", "want"),
    [
        (((80, 8080),), {}, None, 80, 8080),  # service mapping
        (((80, 8080),), {80: 9090}, None, 80, 9090),  # endpoint override wins
        (((80, 0),), {80: 9090}, None, 80, 9090),  # named port resolved per endpoint
        (((80, 0),), {}, None, 80, None),  # named port the endpoint lacks
        (((80, 8080),), {}, None, 81, None),  # port not exposed
        ((), {81: 7070}, None, 81, 7070),  # endpoint mapping alone is enough
        (((80, 0),), {}, ApplicationTunnel(port=15088), 80, 80),  # app tunnel: service port
        (((80, 0),), {}, ApplicationTunnel(), 80, None),  # app tunnel without a port
    ],
)
def test_endpoint_target_port(
    svc_ports: tuple[tuple[int, int], ...],
    ep_ports: dict[int, int],
    tunnel: ApplicationTunnel | None,
    port: int,
    want: int | None,
) -> None:
    st = State()
    s = svc(ports=svc_ports)
    w = wl("a", "10.0.0.1", ports=ep_ports, application_tunnel=tunnel)
    assert st.endpoint_target_port(s, w, port) == want


# --- load balancing ------------------------------------------------------------------------


def lb_state(*workloads: Workload, service: Service | None = None) -> tuple[State, Service]:
    st = State(rng=random.Random(7))
    s = service or svc("10.96.0.1")
    st.upsert_service(s)
    for w in workloads:
        st.upsert_workload(w)
    return st, s


def picks(
    st: State, s: Service, source: Workload | None, n: int = 400, port: int = 80
) -> Counter[str]:
    rng = random.Random(1234)
    out: Counter[str] = Counter()
    for _ in range(n):
        r = st.load_balance(s, port, source, rng)
        out[r[0].name if r else "-"] += 1
    return out


def test_lb_basic_and_port_checks() -> None:
    st, s = lb_state(wl("a", "10.0.0.1", ports={}))
    assert st.load_balance(s, 80, None) == (st.find_workload_by_uid("c//v1/Pod/ns/a"), 8080)
    assert st.load_balance(s, 81, None) is None  # service does not expose 81
    st2, s2 = lb_state(service=svc("10.96.0.1"))
    assert st2.load_balance(s2, 80, None) is None  # no endpoints at all


@pytest.mark.parametrize(
    ("health", "statuses", "want"),
    [
        (None, ("H", "U"), {"w0"}),
        (HealthPolicy.ONLY_HEALTHY, ("H", "U"), {"w0"}),
        (HealthPolicy.ALLOW_ALL, ("H", "U"), {"w0", "w1"}),
        (None, ("U", "U"), {"-"}),
        (HealthPolicy.ALLOW_ALL, ("U",), {"w0"}),
    ],
)
def test_lb_health_policy(
    health: HealthPolicy | None, statuses: tuple[str, ...], want: set[str]
) -> None:
    eps = [
        wl(
            f"w{i}",
            f"10.0.0.{i + 1}",
            ports={},
            status=WorkloadStatus.UNHEALTHY if st == "U" else WorkloadStatus.HEALTHY,
        )
        for i, st in enumerate(statuses)
    ]
    lb = LoadBalancing(health_policy=health) if health is not None else None
    st, s = lb_state(*eps, service=svc("10.96.0.1", load_balancing=lb))
    assert set(picks(st, s, None)) == want


GW = GatewayAddress(address=na("172.16.0.1", "remote"))


@pytest.mark.parametrize(
    ("ep", "src_network", "usable"),
    [
        (wl("e", ports={}), "", False),  # no address, no gateway
        (wl("e", ports={}, network_gateway=GW), "", False),  # same network: never via gateway
        (wl("e", ports={}, network="remote", network_gateway=GW), "", True),
        (wl("e", ports={}, network="remote"), "", False),  # other network, no gateway
        (wl("e", ports={}, hostname="e.example.com"), "", True),  # DNS-resolved workload
        (wl("e", "10.0.0.1", ports={}, network="remote"), "", True),  # has IPs: kept
    ],
)
def test_lb_address_requirements(ep: Workload, src_network: str, usable: bool) -> None:
    st, s = lb_state(ep)
    source = wl("src", "10.1.0.1", network=src_network)
    assert (st.load_balance(s, 80, source) is not None) is usable


def test_lb_named_target_port_needs_endpoint_mapping() -> None:
    with_map = wl("m", "10.0.0.1", ports={80: 9000})
    without = wl("x", "10.0.0.2", ports={})
    st, s = lb_state(with_map, without, service=svc("10.96.0.1", ports=((80, 0),)))
    assert picks(st, s, None) == Counter({"m": 400})
    assert st.load_balance(s, 80, None) == (with_map, 9000)


def loc(region: str, zone: str = "", subzone: str = "") -> Locality:
    return Locality(region, zone, subzone)


SRC = wl("src", "10.1.0.1", locality=loc("r1", "z1", "s1"), node="n1", cluster_id="c1", network="")
# Each endpoint's label says what it shares with SRC.
EPS = (
    wl("all", "10.0.0.1", ports={}, locality=loc("r1", "z1", "s1"), node="n1", cluster_id="c1"),
    wl("zone", "10.0.0.2", ports={}, locality=loc("r1", "z1", "s2"), node="n2", cluster_id="c1"),
    wl("region", "10.0.0.3", ports={}, locality=loc("r1", "z2", "s1"), node="n1", cluster_id="c1"),
    wl("none", "10.0.0.4", ports={}, locality=loc("r2", "z1", "s1"), node="n1", cluster_id="c1"),
)
R_Z_S = (LoadBalancerScope.REGION, LoadBalancerScope.ZONE, LoadBalancerScope.SUBZONE)


@pytest.mark.parametrize(
    ("mode", "prefs", "endpoints", "want"),
    [
        # Standard mode ignores routing preferences entirely.
        (LoadBalancerMode.UNSPECIFIED, R_Z_S, EPS, {"all", "zone", "region", "none"}),
        # FAILOVER: best rank only.
        (LoadBalancerMode.FAILOVER, R_Z_S, EPS, {"all"}),
        (LoadBalancerMode.FAILOVER, R_Z_S, EPS[1:], {"zone"}),
        (LoadBalancerMode.FAILOVER, R_Z_S, EPS[2:], {"region"}),
        # "none" matches zone+subzone but not region: rank stops at the first mismatch -> 0.
        (LoadBalancerMode.FAILOVER, R_Z_S, EPS[3:], {"none"}),
        (LoadBalancerMode.FAILOVER, (LoadBalancerScope.ZONE,), EPS, {"all", "zone", "none"}),
        (LoadBalancerMode.FAILOVER, (LoadBalancerScope.NODE,), EPS, {"all", "region", "none"}),
        (
            LoadBalancerMode.FAILOVER,
            (LoadBalancerScope.CLUSTER, LoadBalancerScope.NETWORK),
            EPS,
            {"all", "zone", "region", "none"},
        ),
        (LoadBalancerMode.FAILOVER, (), EPS, {"all", "zone", "region", "none"}),
        # STRICT: only full matches, else nothing.
        (LoadBalancerMode.STRICT, R_Z_S, EPS, {"all"}),
        (LoadBalancerMode.STRICT, R_Z_S, EPS[1:], {"-"}),
        (LoadBalancerMode.STRICT, (LoadBalancerScope.REGION,), EPS, {"all", "zone", "region"}),
        (
            LoadBalancerMode.STRICT,
            (LoadBalancerScope.REGION, LoadBalancerScope.ZONE),
            EPS[2:],
            {"-"},
        ),
        (LoadBalancerMode.STRICT, (), EPS, {"all", "zone", "region", "none"}),
    ],
)
def test_lb_routing_preference(
    mode: LoadBalancerMode,
    prefs: tuple[LoadBalancerScope, ...],
    endpoints: tuple[Workload, ...],
    want: set[str],
) -> None:
    lb = LoadBalancing(routing_preference=prefs, mode=mode)
    st, s = lb_state(*endpoints, service=svc("10.96.0.1", load_balancing=lb))
    assert set(picks(st, s, SRC)) == want


def test_lb_network_scope_and_cluster_scope() -> None:
    near = wl("near", "10.0.0.1", ports={}, network="", cluster_id="c1")
    far = wl("far", "10.0.0.2", ports={}, network="n2", cluster_id="c1")
    other_cluster = wl("oc", "10.0.0.3", ports={}, network="", cluster_id="c2")
    lb = LoadBalancing(
        routing_preference=(LoadBalancerScope.NETWORK, LoadBalancerScope.CLUSTER),
        mode=LoadBalancerMode.FAILOVER,
    )
    st, s = lb_state(near, far, other_cluster, service=svc("10.96.0.1", load_balancing=lb))
    assert set(picks(st, s, SRC)) == {"near"}
    st.remove_workload(near.uid)
    assert set(picks(st, s, SRC)) == {"oc"}  # network matches, cluster does not: rank 1 > 0


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        (LoadBalancerMode.STRICT, {"-"}),
        (LoadBalancerMode.FAILOVER, {"all", "zone", "region", "none"}),
    ],
)
def test_lb_without_source_ranks_everything_zero(mode: LoadBalancerMode, want: set[str]) -> None:
    lb = LoadBalancing(routing_preference=R_Z_S, mode=mode)
    st, s = lb_state(*EPS, service=svc("10.96.0.1", load_balancing=lb))
    assert set(picks(st, s, None)) == want


def test_lb_capacity_weights() -> None:
    st, s = lb_state(
        wl("one", "10.0.0.1", ports={}, capacity=1),
        wl("three", "10.0.0.2", ports={}, capacity=3),
        wl("zero", "10.0.0.3", ports={}, capacity=0),
    )
    n = 8000
    got = picks(st, s, None, n=n)
    assert got["zero"] == 0
    assert got["one"] + got["three"] == n
    # Expect 25% / 75%; with n=8000 the standard deviation is ~0.5%, so 3% is very safe.
    assert abs(got["three"] / n - 0.75) < 0.03


def test_lb_uniform_is_roughly_even() -> None:
    st, s = lb_state(*(wl(f"w{i}", f"10.0.0.{i + 1}", ports={}) for i in range(4)))
    got = picks(st, s, None, n=8000)
    assert set(got) == {"w0", "w1", "w2", "w3"}
    assert all(abs(c / 8000 - 0.25) < 0.03 for c in got.values())


def test_lb_all_zero_capacity_is_no_upstream() -> None:
    st, s = lb_state(
        wl("z1", "10.0.0.1", ports={}, capacity=0), wl("z2", "10.0.0.2", ports={}, capacity=0)
    )
    assert st.load_balance(s, 80, None) is None


def test_lb_is_deterministic_under_a_seed() -> None:
    st, s = lb_state(*(wl(f"w{i}", f"10.0.0.{i + 1}", ports={}, capacity=i + 1) for i in range(5)))

    def run(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [r[0].name for r in (st.load_balance(s, 80, None, rng) for _ in range(50)) if r]

    assert run(42) == run(42)
    assert run(42) != run(43)
    # Without an explicit rng the state's own (seeded at construction) is used.
    a, sa = lb_state(*(wl(f"w{i}", f"10.0.0.{i + 1}", ports={}) for i in range(5)))
    b, sb = lb_state(*(wl(f"w{i}", f"10.0.0.{i + 1}", ports={}) for i in range(5)))
    seq_a = [a.load_balance(sa, 80, None) for _ in range(20)]
    seq_b = [b.load_balance(sb, 80, None) for _ in range(20)]
    assert seq_a == seq_b


def test_the_plain_pick_table_follows_every_commit_of_the_endpoints() -> None:
    state, s = lb_state(
        wl("one", "10.0.0.1", ports={}, capacity=1), wl("three", "10.0.0.2", ports={}, capacity=3)
    )
    kid = state._kid(s.key)
    assert kid is not None

    def plain() -> _PickTable | None:
        raw = state._cur["eppick"].get(pack_i(kid))
        return None if raw is None else _PickTable.plain(None, raw)

    t = plain()
    assert t is not None and (t.cumulative, t.total) == ([1, 4], 4)
    three = state.find_workload_by_uid("c//v1/Pod/ns/three")
    assert three is not None
    state.upsert_workload(replace(three, status=WorkloadStatus.UNHEALTHY))
    t = plain()
    assert t is not None and (len(t.wids), t.cumulative, t.total) == (1, None, 1)
    assert picks(state, s, None, n=50) == {"one": 50}
    state.remove_workload("c//v1/Pod/ns/one")
    state.remove_workload("c//v1/Pod/ns/three")
    assert state._cur["eppick"].get(pack_i(kid)) is None  # (no endpoints: no entry)
    assert state.load_balance(s, 80, None) is None


def test_a_big_service_changing_faster_than_its_entry_is_built_is_scanned_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (State._update_plain: a 100-byte xDS response must not cost a whole endpoint list, again
    # and again; without its entry the service is scanned, as it was before entries existed)
    now = [1000.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    n = store_module._PLAIN_BIG
    state, s = lb_state(
        *(wl(f"e{i}", f"10.1.{i // 250}.{i % 250 + 1}", ports={}) for i in range(n))
    )
    kid = state._kid(s.key)
    assert kid is not None
    eppick = lambda: state._cur["eppick"].get(pack_i(kid))  # noqa: E731
    assert eppick() is not None
    e0 = state.find_workload_by_uid("c//v1/Pod/ns/e0")
    assert e0 is not None
    now[0] += 0.01
    state.upsert_workload(replace(e0, status=WorkloadStatus.UNHEALTHY))
    assert eppick() is None  # (built 10 ms ago: not again yet)
    got = picks(state, s, None, n=300)
    assert "e0" not in got and "-" not in got
    now[0] += 0.01
    state.upsert_workload(wl("other", "10.9.0.1"))  # (not an endpoint: too soon still)
    assert eppick() is None
    now[0] += store_module._PLAIN_EVERY
    state.upsert_workload(wl("other", "10.9.0.2"))  # any later commit builds it again
    raw = eppick()
    assert raw is not None
    table = _PickTable.plain(None, raw)
    assert table is not None and len(table.wids) == n - 1


@settings(max_examples=150, deadline=None)
@given(
    hst.lists(
        hst.tuples(
            hst.booleans(),  # healthy
            hst.sampled_from([0, 1, 1, 1, 2, 5]),  # capacity
            hst.booleans(),  # address-less (through a gateway)
            hst.sampled_from([None, {}, {80: 9000}]),  # no service (not an endpoint), port maps
        ),
        max_size=12,
    ),
    hst.sampled_from(["", "remote"]),
)
def test_the_writer_s_plain_pick_table_is_the_one_every_endpoint_s_summary_makes(
    eps: list[tuple[bool, int, bool, dict[int, int] | None]], src_network: str
) -> None:
    # (State._plain_table: the eppick entry stands for _pick_table in the common case, picks
    # included: same endpoints, same order, same weights, so the same rng draws pick the same)
    pods = [
        wl(
            f"e{i}",
            *(() if addrless else (f"10.0.1.{i + 1}",)),
            ports=ports,
            capacity=cap,
            status=WorkloadStatus.HEALTHY if healthy else WorkloadStatus.UNHEALTHY,
            network="remote" if addrless else "",
            network_gateway=GW if addrless else None,
        )
        for i, (healthy, cap, addrless, ports) in enumerate(eps)
    ]
    state, s = lb_state(*pods)
    for reader in (state, State(store=state.store.reader())):
        kid = reader._kid(s.key)
        assert kid is not None
        version = reader._cur["epver"].get(pack_i(kid))
        raw = reader._cur["eppick"].get(pack_i(kid))
        endpoints = [p for p in pods if p.services]
        assert (raw is None) is (not endpoints)
        source = wl("src", "10.1.0.1", network=src_network)
        scanned = reader._pick_table(kid, version, 80, 8080, None, source, False)
        plain = _PickTable.plain(version, raw) if raw is not None else None
        if any(not p.addresses for p in endpoints):
            assert plain is None  # (the source's network decides: scanned every time)
            continue
        if plain is None:
            assert not endpoints
            continue
        assert (plain.wids, plain.cumulative, plain.total) == (
            scanned.wids,
            scanned.cumulative,
            scanned.total,
        )
        a, b = random.Random(5), random.Random(5)
        assert [plain.pick(a) for _ in range(20)] == [scanned.pick(b) for _ in range(20)]


def test_lb_waypoint_mode() -> None:
    tunnel = wl("wp", "10.0.0.1", ports={}, application_tunnel=ApplicationTunnel(port=15088))
    plain = wl("plain", "10.0.0.2", ports={})
    st, s = lb_state(tunnel, plain, service=svc("10.96.0.1", ports=((80, 8080),)))
    # Port 15008 is not on the service: only app-tunnel endpoints qualify, on the service port.
    assert st.load_balance(s, 15008, None) is None
    assert st.load_balance(s, 15008, None, for_waypoint=True) == (tunnel, 15008)
    assert set(picks(st, s, None)) == {"wp", "plain"}  # port 80 is fine either way


# --- policies ------------------------------------------------------------------------------


def test_policies_for_workload() -> None:
    st = State()
    ns_pol = pol("ns-pol", "ns", PolicyScope.NAMESPACE)
    other_ns = pol("other", "other", PolicyScope.NAMESPACE)
    global_pol = pol("mesh", "istio-system", PolicyScope.GLOBAL, PolicyAction.DENY)
    selector = pol("sel", "ns", PolicyScope.WORKLOAD_SELECTOR)
    unused_selector = pol("sel2", "ns", PolicyScope.WORKLOAD_SELECTOR)
    for p in (ns_pol, other_ns, global_pol, selector, unused_selector):
        st.upsert_policy(p)
    w = wl("a", authorization_policies=("ns/sel", "ns/missing", "ns/ns-pol"))
    assert st.policies_for(w) == [ns_pol, global_pol, selector]
    assert st.find_policy("ns/sel") is selector
    assert len(list(st.policies())) == 5
    # A policy whose scope changes is re-indexed.
    st.upsert_policy(pol("ns-pol", "ns", PolicyScope.WORKLOAD_SELECTOR))
    assert [p.key for p in st.policies_for(wl("b"))] == ["istio-system/mesh"]
    assert st.remove_policy("istio-system/mesh") is global_pol
    assert st.remove_policy("istio-system/mesh") is None
    assert st.policies_for(wl("b")) == []


# --- notifications -------------------------------------------------------------------------


def test_subscribe_and_generation() -> None:
    st = State()
    seen: list[StateChange] = []
    unsubscribe = st.subscribe(seen.append)
    g0 = st.generation
    a = wl("a", "10.0.0.1")
    st.upsert_workload(a)
    st.upsert_service(svc())
    st.upsert_policy(pol("p", "ns", PolicyScope.NAMESPACE))
    st.remove_workload(a.uid)
    st.remove_workload(a.uid)  # nothing to remove: no event
    assert seen == [
        StateChange(ChangeKind.WORKLOAD, a.uid),
        StateChange(ChangeKind.SERVICE, SVC_KEY),
        StateChange(ChangeKind.POLICY, "ns/p"),
        StateChange(ChangeKind.WORKLOAD, a.uid, removed=True),
    ]
    assert st.generation == g0 + 4
    unsubscribe()
    unsubscribe()  # idempotent
    st.clear()
    assert len(seen) == 4
    assert st.generation == g0 + 6
    assert list(st.services()) == [] and list(st.policies()) == []


def test_workload_identity_is_built_once_and_invisible_to_equality() -> None:
    a = wl("a", "10.0.0.1", service_account="sa")
    assert a.identity is a.identity  # every connection of the workload shares one object
    assert str(a.identity) == "spiffe://cluster.local/ns/ns/sa/sa"
    b = wl("a", "10.0.0.1", service_account="sa")
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)  # a has its cache set, b not
    assert "_identity" not in repr(a)
    moved = replace(a, trust_domain="other.local")
    assert str(moved.identity) == "spiffe://other.local/ns/ns/sa/sa"


# --- waiting for the local workload (Rust DemandProxyState::wait_for_workload) ---------------


async def test_wait_for_workload_returns_at_once_when_known() -> None:
    s = State()
    w = wl("a", "10.0.0.1", service_account="sa-a")
    s.upsert_workload(w)
    assert await s.wait_for_workload("a", "ns", "sa-a", None, 5.0) is w


async def test_wait_for_workload_wakes_on_its_upsert() -> None:
    # Rust test_wait_for_workload_eventually: the workload arrives while the caller waits.
    s = State()
    w = wl("a", "10.0.0.1", service_account="sa-a")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    loop.call_later(0.05, s.upsert_workload, wl("other", "10.0.0.9", service_account="sa-a"))
    loop.call_later(0.1, s.upsert_workload, w)
    waiters = [s.wait_for_workload("a", "ns", "sa-a", None, 5.0) for _ in range(3)]
    assert await asyncio.gather(*waiters) == [w, w, w]
    assert loop.time() - t0 < 1.0  # woken by the upsert, not by the timeout


async def test_wait_for_workload_gives_up_at_the_deadline() -> None:
    # Rust test_wait_for_workload_delay_fails.
    s = State()
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, s.upsert_workload, wl("b", "10.0.0.2", service_account="sa-a"))
    t0 = loop.time()
    assert await s.wait_for_workload("a", "ns", "sa-a", None, 0.1) is None
    assert 0.09 <= loop.time() - t0 < 1.0
    # A node filter is part of the match.
    s.upsert_workload(wl("a", "10.0.0.1", service_account="sa-a", node="n2"))
    assert await s.wait_for_workload("a", "ns", "sa-a", "n1", 0.05) is None


# --- what a snapshot's lookups remember ---------------------------------------------------------


def test_a_reader_remembers_address_lookups_only_until_it_reads_the_next_snapshot() -> None:
    writer = State()
    reader = State(store=writer.store.reader())
    try:
        assert reader.find_workload_by_addr(na("10.0.0.1")) is None
        assert reader.find_service_by_vip(na("10.96.0.1"), "ns") is None
        writer.upsert_workload(wl("a", "10.0.0.1"))
        writer.upsert_service(svc("10.96.0.1"))
        # The reader's snapshot is the old one until it is told of the commit, memo or not.
        assert reader.find_workload_by_addr(na("10.0.0.1")) is None
        reader.apply_changes([])
        got = reader.find_workload_by_addr(na("10.0.0.1"))
        assert got is not None and got.name == "a"
        found = reader.find_service_by_vip(na("10.96.0.1"), "ns")
        assert found is not None and found.name == "svc"
        writer.remove_workload("c//v1/Pod/ns/a")
        writer.remove_service(SVC_KEY)
        reader.apply_changes([])
        assert reader.find_workload_by_addr(na("10.0.0.1")) is None
        assert reader.find_service_by_vip(na("10.96.0.1"), "ns") is None
    finally:
        reader.close()
        writer.close()


def test_the_vip_memo_is_per_client_namespace() -> None:
    # Rust get_best_by_vip: the answer depends on the client's namespace (visibility, own
    # namespace first), so one VIP may have a different answer for each.
    state = State()
    state.upsert_service(svc("10.96.0.1", ns="a", host="s.a.svc.cluster.local"))
    state.upsert_service(svc("10.96.0.1", ns="b", host="s.b.svc.cluster.local"))
    for ns in ("a", "b", "a", "b"):
        found = state.find_service_by_vip(na("10.96.0.1"), ns)
        assert found is not None and found.namespace == ns


def test_a_client_probing_many_destinations_is_held_by_every_cache_bound() -> None:
    # A pod may connect to any address: what a reader remembers stays within its bounds.
    pods = [wl(f"p{i}", f"10.2.{i // 250}.{i % 250 + 1}", ports={}) for i in range(5000)]
    services = [
        svc(f"10.97.{j // 250}.{j % 250 + 1}", host=f"s{j}.ns.svc.cluster.local")
        for j in range(700)
    ]
    writer = State()
    with writer.batch():
        for s in services:
            writer.upsert_service(s)
        for w in pods:
            writer.upsert_workload(replace(w, services={s.key: {} for s in services[:1]}))
    reader = State(store=writer.store.reader())
    for i in range(3 * store_module._CACHE_ADDRESSES):  # unknown addresses
        reader.find_workload_by_addr(na(f"172.{16 + i // 65536}.{i // 256 % 256}.{i % 256}"))
        reader.find_service_by_vip(na(f"172.{16 + i // 65536}.{i // 256 % 256}.{i % 256}"), "x")
    assert len(reader._by_addr) <= store_module._CACHE_ADDRESSES
    assert len(reader._by_vip) <= store_module._CACHE_ADDRESSES
    for w in pods:  # every pod, more than the workload cache holds
        assert reader.find_workload_by_addr(na(str(w.addresses[0]))) is not None
    assert len(reader._wls) <= store_module._CACHE_WORKLOADS
    assert reader.load_balance(services[0], 80, None) is not None  # (its 5,000 endpoints)
    for s in services:  # a pick table each (empty but the first), more than that cache holds
        reader.load_balance(s, 80, None)
    assert len(reader._picks) <= store_module._CACHE_PICKS
    assert reader._pick_endpoints == sum(len(t.wids) for t in reader._picks.values())
    assert reader._pick_endpoints <= store_module._CACHE_PICK_ENDPOINTS
    assert len(reader._svcs) <= store_module._CACHE_SERVICES


def test_the_pick_tables_keep_their_newest_within_both_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A node talking to more services than the cache holds: a full cache drops its oldest
    # quarter (clearing it whole made every table be rebuilt), and the endpoints of all tables
    # are bounded too (a table per service and port; a big service's table is big).
    monkeypatch.setattr(store_module, "_CACHE_PICKS", 8)
    monkeypatch.setattr(store_module, "_CACHE_PICK_ENDPOINTS", 40)
    services = [svc(f"10.97.0.{j + 1}", host=f"s{j}.ns.svc.cluster.local") for j in range(20)]
    sizes = [3] * 19 + [50]  # the last one alone is over the endpoint bound
    writer = State()
    with writer.batch():
        for s in services:
            writer.upsert_service(s)
        for j, (s, n) in enumerate(zip(services, sizes, strict=True)):
            for i in range(n):
                writer.upsert_workload(
                    replace(wl(f"p{j}-{i}", f"10.2.{j}.{i + 1}"), services={s.key: {80: 8080}})
                )
    reader = State(store=writer.store.reader())
    seen = []
    for s, n in zip(services, sizes, strict=True):
        assert reader.load_balance(s, 80, None) is not None
        seen.append(s)
        tables = reader._picks
        assert reader._pick_endpoints == sum(len(t.wids) for t in tables.values())
        assert len(tables) <= 8
        if n <= 40:
            assert reader._pick_endpoints <= 40
        assert [k[0] for k in tables][-1] == reader._kid(s.key)  # the newest is kept
        if len(seen) > 8 and n <= 40:  # full: only the oldest went
            assert len(tables) >= 6
    assert [len(t.wids) for t in reader._picks.values()] == [50]  # kept, alone
    before = dict(reader._picks)
    assert reader.load_balance(services[-1], 80, None) is not None
    assert reader._picks == before  # a hit rebuilds nothing


def test_inside_a_batch_lookups_see_the_batch_s_own_changes() -> None:
    state = State()
    with state.batch():
        assert state.find_workload_by_addr(na("10.0.0.1")) is None
        assert state.find_service_by_vip(na("10.96.0.1")) is None
        state.upsert_workload(wl("a", "10.0.0.1"))
        state.upsert_service(svc("10.96.0.1"))
        assert state.find_workload_by_addr(na("10.0.0.1")) is not None
        assert state.find_service_by_vip(na("10.96.0.1")) is not None
        state.remove_workload("c//v1/Pod/ns/a")
        assert state.find_workload_by_addr(na("10.0.0.1")) is None
    assert state.find_workload_by_addr(na("10.0.0.1")) is None
    assert state.find_service_by_vip(na("10.96.0.1")) is not None


def test_a_full_cache_drops_its_oldest_quarter_not_everything() -> None:
    cache = {i: i for i in range(100)}
    _evict_oldest(cache)
    assert list(cache) == list(range(26, 100))


# --- a big commit, summarized for readers ----------------------------------------------------------


def test_a_commit_past_the_threshold_is_summarized_with_its_policy_changes_kept() -> None:
    wls = [StateChange(ChangeKind.WORKLOAD, f"uid{i}", ref=i) for i in range(5)]
    pols = [StateChange(ChangeKind.POLICY, "ns/p"), StateChange(ChangeKind.POLICY, "ns/q", True)]
    assert summarize(wls + pols, threshold=5) == wls + pols  # (5 workloads: named one by one)
    more = [*wls, StateChange(ChangeKind.SERVICE, "ns/svc", ref=9)]
    assert summarize(more + pols, threshold=5) == [StateChange(ChangeKind.MANY, ""), *pols]
    many_policies = [StateChange(ChangeKind.POLICY, f"ns/p{i}") for i in range(50)]
    assert summarize(many_policies, threshold=5) == many_policies


def test_a_reader_told_many_reads_everything_again_and_its_subscribers_see_the_policies() -> None:
    writer = State()
    reader = State(store=writer.store.reader())
    try:
        writer.upsert_service(svc("10.96.0.1"))
        writer.upsert_workload(wl("a", "10.0.0.1", ports={80: 8080}))
        reader.apply_changes([])
        old = reader.find_workload_by_uid("c//v1/Pod/ns/a")
        assert old is not None and old.addresses == (parse_ip("10.0.0.1"),)
        assert reader.find_service(SVC_KEY) is not None
        told: list[StateChange] = []
        writer.on_commit(lambda changes: told.extend(summarize(changes, threshold=2)))
        seen: list[StateChange] = []
        reader.subscribe(seen.append)
        with writer.batch():
            writer.upsert_workload(wl("a", "10.0.0.2", ports={80: 8080}))
            writer.upsert_workload(wl("b", "10.0.0.3"))
            writer.remove_service(SVC_KEY)
            writer.upsert_policy(pol("p", "ns", PolicyScope.NAMESPACE))
        assert [c.kind for c in told] == [ChangeKind.MANY, ChangeKind.POLICY]
        reader.apply_changes(told)
        assert seen == told
        # Nothing decoded before the commit is served from a cache after it.
        new = reader.find_workload_by_uid("c//v1/Pod/ns/a")
        assert new is not None and new.addresses == (parse_ip("10.0.0.2"),)
        assert reader.find_service(SVC_KEY) is None
        assert reader.find_policy("ns/p") is not None
    finally:
        reader.close()
        writer.close()


async def test_many_wakes_every_waiter_to_look_again() -> None:
    writer = State()
    reader = State(store=writer.store.reader())
    try:
        waiting = asyncio.create_task(reader.wait_for_workload("a", "ns", "sa", None, 5))
        other = asyncio.create_task(reader.wait_for_workload("x", "ns", "other", None, 0.5))
        await asyncio.sleep(0.01)
        writer.upsert_workload(wl("a", "10.0.0.1", service_account="sa"))
        reader.apply_changes([StateChange(ChangeKind.MANY, "")])
        found = await asyncio.wait_for(waiting, 1)
        assert found is not None and found.name == "a"
        assert await other is None  # (woken, looked, waited again until its deadline)
    finally:
        reader.close()
        writer.close()
