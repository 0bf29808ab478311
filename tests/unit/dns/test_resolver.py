"""Answers from state, case by case as istio/ztunnel src/dns/server.rs tests::lookup states them
(the Store's decision; what forwarded names get is in test_forwarder / the netns tests)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.dns import names
from ztunnel.dns.resolver import TYPE_A, TYPE_AAAA, Answer, Resolver, find_best_match
from ztunnel.state.model import (
    IPFamilies,
    NetworkAddress,
    Service,
    ServiceVisibility,
    Workload,
)
from ztunnel.state.store import State

NS1, NS2, NS3, PREFERRED = "ns1", "ns2", "ns3", "preferred-ns"
NW1, NW2 = "nw1", "nw2"


def na(nw: str, ip: str) -> NetworkAddress:
    return NetworkAddress(nw, parse_ip(ip))


def kube(name: str, ns: str) -> str:
    return f"{name}.{ns}.svc.cluster.local"


def svc(name: str, ns: str, vips: list[NetworkAddress], **kw: object) -> Service:
    return Service(name=name, namespace=ns, hostname=kube(name, ns), vips=tuple(vips), **kw)  # type: ignore[arg-type]


def ext(host: str, vips: list[NetworkAddress], ns: str = NS1, **kw: object) -> Service:
    return Service(name=host, namespace=ns, hostname=host, vips=tuple(vips), **kw)  # type: ignore[arg-type]


def wl(name: str, ns: str, ips: list[str], services: list[str], nw: str = NW1) -> Workload:
    return Workload(
        uid=name,
        name=name,
        namespace=ns,
        addresses=tuple(parse_ip(i) for i in ips),
        network=nw,
        services={s: {80: 80} for s in services},
    )


def build_state() -> State:
    """server.rs tests::state(): the same services and workloads."""
    st = State()
    for s in [
        ext("www.google.com", [na(NW1, "1.1.1.1")]),
        svc("productpage", NS1, [na(NW1, "9.9.9.9")]),
        svc("example", NS2, [na(NW1, "10.10.10.10")]),
        svc("nslocal", NS2, [na(NW1, "10.10.10.240")], visibility=ServiceVisibility.NAMESPACE),
        svc("nslocalsame", NS1, [na(NW1, "10.10.10.241")], visibility=ServiceVisibility.NAMESPACE),
        ext("everywhere.io", [na(NW1, "10.10.10.110")], NS2),
        ext("preferred.io", [na(NW1, "10.10.10.210")], NS2),
        ext("everywhere.io", [na(NW1, "10.10.10.111")], PREFERRED),
        ext("preferred.io", [na(NW1, "10.10.10.211")], PREFERRED),
        ext("everywhere.io", [na(NW1, "10.10.10.112")], NS1),
        ext("canonical.svc", [na(NW1, "10.10.10.140")], NS2),
        ext("canonical.svc", [na(NW1, "10.10.10.141")], NS3, canonical=True),
        ext("canonical.with.local", [na(NW1, "10.10.10.150")], NS1),
        ext("canonical.with.local", [na(NW1, "10.10.10.151")], NS2, canonical=True),
        replace(
            svc("details", NS2, [na(NW1, f"{i}.{i}.{i}.{i}") for i in (11, 12, 13, 14)]),
            hostname="details.ns2.svc.cluster.remote",
        ),
        ext("ipv4.localhost", [na(NW1, "2.2.2.2")]),
        ext("ipv6.localhost", [na(NW1, "2001:db8:0:0:0:ff00:42:8329")]),
        ext("dual.localhost", [na(NW1, "2.2.2.2"), na(NW1, "2001:db8:0:0:0:ff00:42:8329")]),
        ext("*.wildcard", [na(NW1, "10.10.10.10")]),
        ext("*.b.wildcard", [na(NW1, "11.11.11.11")]),
        ext("*.svc.mesh.company.net", [na(NW1, "10.1.2.3")]),
        svc("nw2-only", NS1, [na(NW2, "20.20.20.20")]),
        svc("both-networks", NS1, [na(NW1, "21.21.21.21"), na(NW2, "22.22.22.22")]),
        svc("headless", NS1, []),
        ext("headless.example.com", []),
        ext("headless-no-endpoints.example.com", []),
        svc("headless-ipv6", NS1, [], ip_families=IPFamilies.IPV6_ONLY),
    ]:
        st.upsert_service(s)
    headless = f"{NS1}/{kube('headless', NS1)}"
    for w in [
        wl("client", NS1, ["127.0.0.1"], []),
        wl("headless0", NS1, ["30.30.30.30", "2001:db8::30"], [headless]),
        wl("headless1", NS1, ["31.31.31.31", "2001:db8::31"], [headless]),
        wl(
            "headless-external",
            NS1,
            ["32.32.32.32", "2001:db8::32"],
            [f"{NS1}/headless.example.com"],
        ),
        wl(
            "headless2",
            NS1,
            ["33.33.33.33", "2001:db8::33"],
            [f"{NS1}/{kube('headless-ipv6', NS1)}"],
        ),
    ]:
        st.upsert_workload(w)
    return st


FWD = None  # forwarded: not ours


def A(*ips: str) -> list[IPAddr]:
    return sorted((parse_ip(i) for i in ips), key=str)


# (Rust case name, host, type, expected: FWD, or (cname or None, addresses))
CASES: list[tuple[str, str, int, tuple[str | None, list[IPAddr]] | None]] = [
    ("non k8s host in local cache", "www.google.com", TYPE_A, (None, A("1.1.1.1"))),
    (
        "non k8s host with search namespace yields cname+A record",
        "www.google.com.ns1.svc.cluster.local.",
        TYPE_A,
        ("www.google.com", A("1.1.1.1")),
    ),
    ("non k8s host not in local cache", "www.bing.com", TYPE_A, FWD),
    ("k8s host - fqdn", "productpage.ns1.svc.cluster.local.", TYPE_A, (None, A("9.9.9.9"))),
    ("k8s host - name.namespace", "productpage.ns1.", TYPE_A, (None, A("9.9.9.9"))),
    ("k8s host - shortname", "productpage.", TYPE_A, (None, A("9.9.9.9"))),
    (
        "k8s host (name.namespace) with search namespace yields cname+A record",
        "productpage.ns1.ns1.svc.cluster.local.",
        TYPE_A,
        ("productpage.ns1", A("9.9.9.9")),
    ),
    (
        "AAAA query for IPv4 k8s host (name.namespace) with search namespace",
        "productpage.ns1.ns1.svc.cluster.local.",
        TYPE_AAAA,
        (None, []),
    ),
    (
        "k8s host - non local namespace - name.namespace",
        "example.ns2.",
        TYPE_A,
        (None, A("10.10.10.10")),
    ),
    (
        "k8s host - non local namespace - fqdn",
        "example.ns2.svc.cluster.local.",
        TYPE_A,
        (None, A("10.10.10.10")),
    ),
    (
        "visibility: namespace-scoped svc in another namespace is forwarded",
        "nslocal.ns2.svc.cluster.local.",
        TYPE_A,
        FWD,
    ),
    (
        "visibility: namespace-scoped svc in the client namespace resolves",
        "nslocalsame.ns1.svc.cluster.local.",
        TYPE_A,
        (None, A("10.10.10.241")),
    ),
    (
        "k8s host - non local namespace - name.namespace.svc",
        "example.ns2.svc.",
        TYPE_A,
        (None, A("10.10.10.10")),
    ),
    ("k8s host - non local namespace - shortname", "example.", TYPE_A, FWD),
    (
        "remote cluster k8s svc - same ns and different domain - fqdn",
        "details.ns2.svc.cluster.remote.",
        TYPE_A,
        (None, A("11.11.11.11", "12.12.12.12", "13.13.13.13", "14.14.14.14")),
    ),
    (
        "remote cluster k8s svc - same ns and different domain - name.namespace",
        "details.ns2.",
        TYPE_A,
        FWD,
    ),
    ("TypeA query returns A records only", "dual.localhost.", TYPE_A, (None, A("2.2.2.2"))),
    (
        "TypeAAAA query returns AAAA records only",
        "dual.localhost.",
        TYPE_AAAA,
        (None, A("2001:db8::ff00:42:8329")),
    ),
    ("only AAAA records exist for typeA", "ipv6.localhost.", TYPE_A, (None, [])),
    ("only A records exist for typeAAAA", "ipv4.localhost.", TYPE_AAAA, (None, [])),
    ("wild card returns A record correctly", "foo.wildcard.", TYPE_A, (None, A("10.10.10.10"))),
    (
        "specific wild card returns A record correctly",
        "a.b.wildcard.",
        TYPE_A,
        (None, A("11.11.11.11")),
    ),
    ("wild card with domain", "foo.svc.mesh.company.net.", TYPE_A, (None, A("10.1.2.3"))),
    (
        "wild card with namespace with domain",
        "foo.foons.svc.mesh.company.net.",
        TYPE_A,
        (None, A("10.1.2.3")),
    ),
    (
        "wild card with search domain returns A record correctly (no CNAME for a wildcard)",
        "foo.svc.mesh.company.net.ns1.svc.cluster.local.",
        TYPE_A,
        (None, A("10.1.2.3")),
    ),
    (
        "no vip on client network returns no records",
        "nw2-only.ns1.svc.cluster.local.",
        TYPE_A,
        (None, []),
    ),
    (
        "return vip for client network only",
        "both-networks.ns1.svc.cluster.local.",
        TYPE_A,
        (None, A("21.21.21.21")),
    ),
    (
        "headless service returns workload ips for A",
        "headless.ns1.svc.cluster.local.",
        TYPE_A,
        (None, A("30.30.30.30", "31.31.31.31")),
    ),
    (
        "headless service returns workload ips for AAAA",
        "headless.ns1.svc.cluster.local.",
        TYPE_AAAA,
        (None, A("2001:db8::30", "2001:db8::31")),
    ),
    (
        "headless-ipv6 service returns records for AAAA",
        "headless-ipv6.ns1.svc.cluster.local.",
        TYPE_AAAA,
        (None, A("2001:db8::33")),
    ),
    (
        "headless-ipv6 service returns empty for A",
        "headless-ipv6.ns1.svc.cluster.local.",
        TYPE_A,
        (None, []),
    ),
    # TODO in Rust (istio/ztunnel#1119): pod hostnames are forwarded.
    ("todo: k8s pod - fqdn", "headless.pod0.ns1.svc.cluster.local.", TYPE_A, FWD),
    ("todo: k8s pod - name.domain.ns", "headless.pod0.ns1.", TYPE_A, FWD),
    ("headless external without IPs", "headless-no-endpoints.example.com", TYPE_A, FWD),
    ("headless external", "headless.example.com", TYPE_A, FWD),
    (
        "preferred namespace is chosen if local namespace is not defined",
        "preferred.io.",
        TYPE_A,
        (None, A("10.10.10.211")),
    ),
    (
        "external service resolves to local namespace's address",
        "everywhere.io.",
        TYPE_A,
        (None, A("10.10.10.112")),
    ),
    (
        "canonical services are preferred when no ns-local hostname is present",
        "canonical.svc",
        TYPE_A,
        (None, A("10.10.10.141")),
    ),
    (
        "namespace-local service should be preferred over canonical",
        "canonical.with.local",
        TYPE_A,
        (None, A("10.10.10.150")),
    ),
]


@pytest.fixture(scope="module")
def resolver() -> Resolver:
    return Resolver(build_state(), preferred_namespace=PREFERRED, rng=random.Random(1))


def client(st: State) -> Workload:
    w = st.find_workload_by_uid("client")
    assert w is not None
    return w


# Rust: server.rs tests::lookup (Store::lookup through Server; the state-answered cases).
@pytest.mark.parametrize(("case", "host", "qtype", "expected"), CASES, ids=[c[0] for c in CASES])
def test_lookup(
    resolver: Resolver,
    case: str,
    host: str,
    qtype: int,
    expected: tuple[str | None, list[IPAddr]] | None,
) -> None:
    got = resolver.resolve(client(resolver.state), names.from_text(host), qtype)
    if expected is None:
        assert got is None, case
        return
    assert got is not None, case
    cname, ips = expected
    assert got.cname == (names.from_text(cname) if cname else None), case
    assert sorted(got.addresses, key=str) == ips, case


def test_ipv6_disabled_gives_empty_aaaa() -> None:
    # server.rs service_family_allowed: AAAA is empty when IPv6 is off, even for dual stack.
    r = Resolver(build_state(), ipv6_enabled=False)
    got = r.resolve(client(r.state), names.from_text("dual.localhost"), TYPE_AAAA)
    assert got == Answer()
    got = r.resolve(client(r.state), names.from_text("dual.localhost"), TYPE_A)
    assert got is not None and got.addresses == (parse_ip("2.2.2.2"),)


def test_client_namespace_decides_short_names() -> None:
    st = build_state()
    st.upsert_service(svc("productpage", NS2, [na(NW1, "9.9.9.8")]))
    other = replace(client(st), uid="c2", namespace=NS2)
    r = Resolver(st)
    a = r.resolve(client(st), ("productpage",), TYPE_A)
    b = r.resolve(other, ("productpage",), TYPE_A)
    assert a is not None and a.addresses == (parse_ip("9.9.9.9"),)
    assert b is not None and b.addresses == (parse_ip("9.9.9.8"),)


def test_state_changes_are_seen_at_once() -> None:
    st = build_state()
    r = Resolver(st)
    name = names.from_text("productpage.ns1.svc.cluster.local")
    st.upsert_service(svc("productpage", NS1, [na(NW1, "9.9.9.7")]))
    got = r.resolve(client(st), name, TYPE_A)
    assert got is not None and got.addresses == (parse_ip("9.9.9.7"),)
    st.remove_service(f"{NS1}/{kube('productpage', NS1)}")
    assert r.resolve(client(st), name, TYPE_A) is None


def test_addresses_are_shuffled() -> None:
    r = Resolver(build_state(), rng=random.Random(7))
    seen = {
        r.resolve(
            client(r.state), names.from_text("details.ns2.svc.cluster.remote"), TYPE_A
        ).addresses  # type: ignore[union-attr]
        for _ in range(50)
    }
    assert len(seen) > 1


# Rust: ServiceMatch::find_best_match (state/service.rs).
def test_find_best_match_order() -> None:
    a = ext("h", [], "a")
    b = ext("h", [], "b", canonical=True)
    c = ext("h", [], "c")
    p = ext("h", [], "p")
    assert find_best_match([a, b, c], "c", "") is c  # client namespace wins at once
    assert find_best_match([a, p, b], "x", "p") is b  # canonical over preferred
    assert find_best_match([b, p], "x", "p") is b  # preferred never replaces canonical
    assert find_best_match([a, p], "x", "p") is p
    assert find_best_match([a, c], "x", "") is a  # else the first
    assert find_best_match([], "x", "") is None
