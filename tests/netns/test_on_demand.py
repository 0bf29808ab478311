"""XDS_ON_DEMAND and DNS-resolved ServiceEntry endpoints end to end: shared-mode ztunnels fed
by the fake istiod, which serves on-demand requests as istiod does (node-local pods pushed,
each other address fetched when a connection needs it, answered under the resource's own name
with the requested address as an alias). Rust DemandProxyState::fetch_address /
fetch_on_demand, resolve_on_demand_dns (istio_on_demand_dns_total)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.state.model import NetworkAddress, Service, ServicePort, TunnelProtocol, Workload
from ztunnel.testing.apps import App, connect_from, recv_line, start_app
from ztunnel.testing.xdsbed import MeshPod, XdsMesh, http_get, metric, xds_mesh
from ztunnel.xds.convert import ADDRESS_TYPE_URL

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(90),
]

PODS = (MeshPod("a", "n1", "sa-a"), MeshPod("b", "n2", "sa-b"), MeshPod("c", "n2", "sa-c"))
ECHO = 9300
DNS_PORT = 9301


@dataclass
class Bed:
    mesh: XdsMesh
    apps: list[App]

    def dump_uids(self, node: str) -> set[str]:
        status, body = http_get(self.mesh.nodes[node], 15000, "/config_dump")
        assert status == 200
        return {w["uid"] for w in json.loads(body)["workloads"]}

    def demanded(self) -> list[str]:
        names: list[str] = []
        for rec in self.mesh.istiod.call(lambda: list(self.mesh.istiod.istiod.requests)):
            r = rec.request
            if r.type_url == ADDRESS_TYPE_URL and not r.response_nonce:
                names.extend(n for n in r.resource_names_subscribe if n != "*")
        return names


def wait_until(cond: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    # (DNS capture off: the DNS proxy with on-demand xDS is a config error, config.rs)
    on_demand = {"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"}
    with xds_mesh(PODS, extra_env=on_demand) as mesh:
        b, a = mesh.pods["b"], mesh.pods["a"]
        svc = Service(
            name="web",
            namespace="default",
            hostname="web.default.svc.cluster.local",
            vips=(NetworkAddress("", parse_ip("10.96.0.50")),),
            ports=(ServicePort(80, ECHO),),
        )
        # A ServiceEntry with DNS resolution: an endpoint known only by hostname. "localhost"
        # resolves through the system resolver without touching the machine's files; ztunnel
        # dials it from the client pod's namespace, where an echo server listens.
        ext = Service(
            name="ext",
            namespace="default",
            hostname="ext.example.com",
            vips=(NetworkAddress("", parse_ip("10.96.0.60")),),
            ports=(ServicePort(80, DNS_PORT),),
        )
        se = Workload(
            uid="c1/networking.istio.io/ServiceEntry/default/ext/localhost",
            name="ext",
            namespace="default",
            hostname="localhost",
            protocol=TunnelProtocol.NONE,
            services={ext.key: {80: DNS_PORT}},
        )
        b_wl = mesh.workload("b", services={svc.key: {}})
        mesh.istiod.call(mesh.istiod.istiod.set_addresses, b_wl, svc, ext, se)
        apps = [
            start_app(b, "echo", "--announce", ports=(ECHO,)),
            start_app(a, "echo", "--announce", ports=(DNS_PORT,)),
        ]
        try:
            yield Bed(mesh, apps)
        finally:
            for app in apps:
                app.stop()


def test_on_demand_fetches_only_what_connections_need(bed: Bed) -> None:
    m = bed.mesh
    a, b = m.pods["a"], m.pods["b"]
    uid = {p: m.workload(p).uid for p in ("a", "b", "c")}
    # Subscribed to nothing; the node-local pod came unasked.
    wait_until(lambda: uid["a"] in bed.dump_uids("n1"))
    assert uid["b"] not in bed.dump_uids("n1") and uid["c"] not in bed.dump_uids("n1")
    # A connection to b's IP fetches b, then goes over HBONE to b's ztunnel.
    with connect_from(a, b.ip4, ECHO, timeout=10) as s:
        peer = recv_line(s).split()
    assert peer[1] == a.ip4  # b's app sees a (HBONE, source IP kept)
    assert f"/{b.ip4}" in bed.demanded()
    uids = bed.dump_uids("n1")
    assert uid["b"] in uids and uid["c"] not in uids
    rec = m.ztunnel_of("a").wait_for(
        lambda r: (
            r.get("message") == "connection complete" and r.get("dst.addr") == f"{b.ip4}:15008"
        )
    )
    assert rec["direction"] == "outbound"
    # On b's node the source was unknown too: the inbound side fetched it (Rust
    # fetch_workload_by_address), so its access log names the source workload.
    inbound = m.ztunnel_of("b").wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and r.get("dst.hbone_addr") == f"{b.ip4}:{ECHO}"
        )
    )
    assert inbound.get("src.workload") == "a", inbound
    assert uid["a"] in bed.dump_uids("n2")
    # A service VIP: the service and the pods behind it come in one answer.
    with connect_from(a, "10.96.0.50", 80, timeout=10) as s:
        peer = recv_line(s).split()
    assert peer[3:] == [b.ip4, str(ECHO)]
    assert "/10.96.0.50" in bed.demanded()


def test_dns_resolved_service_entry_endpoint(bed: Bed) -> None:
    m = bed.mesh
    a = m.pods["a"]
    with connect_from(a, "10.96.0.60", 80, timeout=10) as s:
        peer = recv_line(s).split()
    # The echo server in pod a was reached at the resolved address of "localhost".
    assert peer[3:] == ["127.0.0.1", str(DNS_PORT)]
    _, text = http_get(m.nodes["n1"], 15020, "/stats/prometheus")
    assert metric(text, "istio_on_demand_dns_total", hostname="localhost") >= 1
