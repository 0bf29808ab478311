"""Name expansion, search-domain stripping and wildcards (istio/ztunnel src/dns/server.rs and
src/dns/name_util.rs tests)."""

from __future__ import annotations

import pytest

from ztunnel.dns import names
from ztunnel.dns.names import Alias

n = names.from_text
CD = n("cluster.local")


# Rust: server.rs tests::test_to_kube_fqdns (every case, same expectations).
@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("name", ["name.ns1.svc.cluster.local"]),
        ("name.", ["name.ns1.svc.cluster.local"]),
        ("name.ns2", ["name.ns2.svc.cluster.local", "name.ns2.ns1.svc.cluster.local"]),
        ("name.ns2.svc.", ["name.ns2.svc.cluster.local", "name.ns2.svc.svc.cluster.local"]),
        ("name.ns2.not-svc.", ["name.ns2.not-svc.svc.cluster.local"]),
        ("pod.sub-domain.ns.svc", ["pod.sub-domain.ns.svc.cluster.local"]),
        ("pod.sub-domain.ns.not-svc", []),
        ("name.ns2.svc.cluster.", []),
        ("name.ns2.svc.cluster.local", []),
        ("www.google.com.", ["www.google.com.svc.cluster.local"]),
    ],
)
def test_to_kube_fqdns(host: str, expected: list[str]) -> None:
    assert names.to_kube_fqdns(n(host), "ns1", CD) == [n(e) for e in expected]


def test_to_kube_fqdns_other_cluster_domain() -> None:
    # CLUSTER_DOMAIN is honoured (reference section 9 row 11).
    assert names.to_kube_fqdns(n("svc"), "ns", n("corp.example")) == [n("svc.ns.svc.corp.example")]


# Rust: server.rs tests::test_get_wildcards.
def test_get_wildcards() -> None:
    assert names.get_wildcards(n("svc1.")) == [n("svc1")]
    assert names.get_wildcards(n("svc1.ns1.svc.cluster.local.")) == [
        n("svc1.ns1.svc.cluster.local"),
        n("*.ns1.svc.cluster.local"),
        n("*.svc.cluster.local"),
        n("*.cluster.local"),
        n("*.local"),
    ]


# Rust: name_util.rs tests::test_has_domain, test_trim_domain.
def test_has_and_trim_domain() -> None:
    dom = n("svc.cluster.local")
    assert names.has_domain(n("name.ns.svc.cluster.local"), dom)
    assert not names.has_domain(n("name.ns.a.different.domain"), dom)
    assert not names.has_domain(n("cluster.com"), dom)
    assert names.trim_domain(n("name.ns.svc.cluster.local"), dom) == n("name.ns")
    assert names.trim_domain(n("name.ns.a.different.domain"), dom) is None
    assert names.trim_domain(n("svc.cluster.local"), dom) is None  # nothing left
    assert not names.has_domain(n("a.b.c"), n("*.c"))  # a wildcard is never a domain


# Rust: server.rs tests::search_domains (SystemForwarder, per_pod).
def test_search_domains_per_pod() -> None:
    assert names.search_domains("default-ns", CD) == [
        n("default-ns.svc.cluster.local"),
        n("svc.cluster.local"),
        n("cluster.local"),
    ]


# Rust: server.rs Store::get_aliases: requested name, its k8s FQDNs, then per search domain the
# stripped name and its FQDNs (each marked as stripped), no duplicate names.
def test_get_aliases() -> None:
    search = names.search_domains("ns1", CD)
    got = list(names.get_aliases(n("productpage.ns1.ns1.svc.cluster.local"), "ns1", CD, search))
    stripped = n("productpage.ns1")
    assert got == [
        Alias(n("productpage.ns1.ns1.svc.cluster.local")),
        # ns1.svc.cluster.local stripped, and its FQDN (the other one is the requested name)
        Alias(stripped, stripped),
        Alias(n("productpage.ns1.svc.cluster.local"), stripped),
        # svc.cluster.local and cluster.local stripped; their FQDNs are all repeats
        Alias(n("productpage.ns1.ns1"), n("productpage.ns1.ns1")),
        Alias(n("productpage.ns1.ns1.svc"), n("productpage.ns1.ns1.svc")),
    ]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ((b"Foo", b"BAR", b""), ("foo", "bar")),
        ((b"a.b", b""), None),  # an escaped dot inside a label is never one of our names
        ((b"caf\xc3\xa9", b""), None),
        ((b"sp ace", b""), None),
        ((b"",), ()),
    ],
)
def test_from_wire_labels(labels: tuple[bytes, ...], expected: tuple[str, ...] | None) -> None:
    assert names.from_wire_labels(labels) == expected
