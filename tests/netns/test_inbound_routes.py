"""Inbound HBONE routing, end to end: the Rust ztunnel's ``test_svc_hostname_port``,
``test_svc_hostname_named_port``, ``sandwich_waypoint_plain`` and
``sandwich_waypoint_proxy_protocol`` (``tests/namespaced.rs``), with real ztunnels in network
namespaces carrying istio-cni's rules.

* Hostname authorities: a raw HBONE client (python-hyper ``h2``, independent of ztunnel's own
  HTTP/2) on an external host sends ``CONNECT b.default.svc.cluster.local:80`` to ztunnel-b,
  which must find the service and dial the pod's own target port (numeric, or named and mapped
  by the endpoint).
* Sandwich waypoints: pod a's app calls a workload whose waypoint is a pod with an application
  tunnel. ztunnel-a sends HBONE to the waypoint with the workload's address as authority; the
  waypoint's ztunnel accepts it although the authority is not its own IP, and hands it to the
  waypoint app: as plain TCP from the client's IP (protocol NONE), or on 127.0.0.1:15088 behind
  a PROXY protocol v2 header naming the client, the HBONE target and the client's identity
  (protocol PROXY), parsed by the test app from the spec.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ztunnel.core.identity import Identity
from ztunnel.testing.apps import App, PeerInfo, connect_from, recv_all, recv_line, start_app
from ztunnel.testing.hbone import (
    TRUST_DOMAIN,
    HboneClient,
    Mesh,
    PodSpec,
    mesh,
    no_leaks,
    workload_yaml,
)
from ztunnel.testing.netns import Pod
from ztunnel.testing.proc import Record, ZtunnelProcess

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

SA_A = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-a"
B_HOSTNAME = "b.default.svc.cluster.local"
NAMED_HOSTNAME = "named.default.svc.cluster.local"
SRV_PLAIN = "10.96.1.20"  # a workload whose waypoint is pod wp (app tunnel NONE)
SRV_PROXY = "10.96.1.21"  # ... pod wpp (app tunnel PROXY on 15088)
PROXY_PORT = 15088


EXT_IP = "10.0.0.201"  # the bed's first external host (testing/netns.py add_external)


def config(pods: dict[str, Pod]) -> str:
    a, b, wp, wpp = pods["a"], pods["b"], pods["wp"], pods["wpp"]

    def server(name: str, ip: str, waypoint: Pod) -> str:
        return (
            f"- uid: cluster1//v1/Pod/default/{name}\n  name: {name}\n  namespace: default\n"
            "  trustDomain: cluster.local\n  serviceAccount: default\n"
            f'  workloadIps: ["{ip}"]\n  protocol: HBONE\n'
            f'  waypoint: {{destination: "/{waypoint.ip4}", hboneMtlsPort: 15008}}\n'
        )

    return (
        "workloads:\n"
        + workload_yaml(a, "sa-a")
        + workload_yaml(b, "sa-b")
        + "  services:\n"
        + f'    "default/{B_HOSTNAME}": {{80: 8080}}\n'
        + f'    "default/{NAMED_HOSTNAME}": {{81: 9090}}\n'
        + workload_yaml(wp, "wp", applicationTunnel="{protocol: NONE}")
        + workload_yaml(wpp, "wpp", applicationTunnel=f"{{protocol: PROXY, port: {PROXY_PORT}}}")
        # the external host as a workload, for the origin-network test
        + "- uid: cluster1//v1/Pod/default/ext-wl\n  name: ext-wl\n  namespace: default\n"
        + "  trustDomain: cluster.local\n  serviceAccount: default\n"
        + f'  workloadIps: ["{EXT_IP}"]\n  protocol: HBONE\n'
        + server("srv-plain", SRV_PLAIN, wp)
        + server("srv-proxy", SRV_PROXY, wpp)
        + "services:\n"
        + f'- name: b\n  namespace: default\n  hostname: {B_HOSTNAME}\n  vips: ["/10.96.0.20"]\n'
        + "  ports: {80: 8080}\n"
        # target port 0: a named port, resolved by each endpoint's own mapping (81 -> 9090)
        + f"- name: named\n  namespace: default\n  hostname: {NAMED_HOSTNAME}\n"
        + '  vips: ["/10.96.0.21"]\n  ports: {81: 0}\n'
    )


@pytest.fixture(scope="module")
def bed() -> Iterator[Mesh]:
    extra = [
        PodSpec("wp", "n2", service_account=None, ztunnel="default/wp/wp"),
        PodSpec("wpp", "n2", service_account=None, ztunnel="default/wpp/wpp"),
    ]
    with mesh(
        extra_env={"POOL_UNUSED_RELEASE_TIMEOUT": "200ms"},
        extra_pods=extra,
        external=True,
        config=config,
    ) as m:
        # Warm up: ztunnel-b fetches pod b's certificate (and starts its renewal timer) now,
        # so the per-test baselines are steady.
        echo = start_app(m.b, "echo", ports=(8080,))
        with hbone_client(m) as c:
            sid = c.connect_stream(f"{m.b.ip4}:8080")
            c.send(sid, b"warm\n", end_stream=True)
            assert c.read_to_end(sid) == b"warm\n"
        echo.stop()
        yield m


@pytest.fixture
def apps(bed: Mesh) -> Iterator[dict[str, App]]:
    started = {
        "b": start_app(bed.b, "echo", "--announce", ports=(8080, 9090)),
        "wp": start_app(bed.pods["wp"], "echo", "--announce", ports=(8080,)),
        "wpp": start_app(
            bed.pods["wpp"], "echo", "--proxy-protocol", "--host", "127.0.0.1", ports=(PROXY_PORT,)
        ),
    }
    yield started
    for app in started.values():
        app.stop()


def hbone_client(bed: Mesh) -> HboneClient:
    assert bed.ext is not None
    cert = bed.ca.issue(Identity(TRUST_DOMAIN, "default", "ext-client"))
    return HboneClient.connect(bed.ext, bed.b.ip4, cert=cert, roots_pem=bed.ca.root_pem)


def inbound_record(zt: ZtunnelProcess, since: int, hbone_addr: str) -> Record:
    return zt.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and r.get("dst.hbone_addr") == hbone_addr
        ),
        start=since,
    )


@pytest.mark.parametrize(
    ("authority", "port", "service"),
    [
        (f"{B_HOSTNAME}:80", 8080, B_HOSTNAME),  # Rust test_svc_hostname_port
        (f"{NAMED_HOSTNAME}:81", 9090, NAMED_HOSTNAME),  # Rust test_svc_hostname_named_port
    ],
)
def test_svc_hostname_authority(
    bed: Mesh, apps: dict[str, App], authority: str, port: int, service: str
) -> None:
    """Rust find_inbound_upstream: a hostname authority names a service; the dial goes to this
    pod on the endpoint's port for it (else the service's target port)."""
    since = len(bed.ztb.records)
    with no_leaks(bed.ztb), hbone_client(bed) as c:
        sid = c.connect_stream(authority)
        c.send(sid, b"by hostname\n", end_stream=True)
        announced, echoed = c.read_to_end(sid).split(b"\n", 1)
    assert echoed == b"by hostname\n"
    peer = PeerInfo.parse(announced.decode())
    assert (peer.local_ip, peer.local_port) == (bed.b.ip4, port)  # where ztunnel dialled
    rec = inbound_record(bed.ztb, since, authority)
    assert rec["dst.addr"] == f"{bed.b.ip4}:15008"  # Rust logs the connection's own address
    assert rec["dst.service"] == service
    assert rec["bytes_recv"] == len(b"by hostname\n") and "error" not in rec


def test_svc_hostname_unknown_is_503(bed: Mesh) -> None:
    since = len(bed.ztb.records)
    with no_leaks(bed.ztb), hbone_client(bed) as c:
        sid = c.request("nope.default.svc.cluster.local:80")
        assert c.response(sid) == 503
    bed.ztb.wait_for(
        lambda r: r.get("message") == "connection failed" and "hostname" in str(r.get("error")),
        start=since,
    )


@pytest.mark.parametrize(
    ("origin", "src_workload"), [(None, "ext-wl"), ("", "ext-wl"), ("remote", None)]
)
def test_request_from_another_network_has_no_source_workload(
    bed: Mesh, apps: dict[str, App], origin: str | None, src_workload: str | None
) -> None:
    """Rust build_inbound_request: x-forwarded-network naming another network means the request
    crossed a gateway, so the source address is not looked up as a local workload."""
    assert bed.ext is not None and bed.ext.ip4 == EXT_IP
    since = len(bed.ztb.records)
    headers = [("x-forwarded-network", origin)] if origin is not None else []
    with no_leaks(bed.ztb), hbone_client(bed) as c:
        sid = c.request(f"{bed.b.ip4}:8080", headers=headers)
        assert c.response(sid) == 200
        c.send(sid, b"x\n", end_stream=True)
        assert c.read_to_end(sid).endswith(b"\nx\n")  # (after the app's PEER line)
    rec = inbound_record(bed.ztb, since, f"{bed.b.ip4}:8080")
    assert rec.get("src.workload") == src_workload, rec


def test_sandwich_waypoint_plain(bed: Mesh, apps: dict[str, App]) -> None:
    """Rust sandwich_waypoint_plain: the waypoint's ztunnel accepts an authority that is not its
    own IP (it has an application tunnel) and connects to its own pod on the authority's port,
    from the client's IP."""
    wp_zt = bed.ztunnels["wp"]
    since = len(wp_zt.records)
    with connect_from(bed.a, SRV_PLAIN, 8080, timeout=10) as s:
        peer = PeerInfo.parse(recv_line(s, timeout=10))
        s.sendall(b"through the sandwich\n")
        s.shutdown(1)
        assert recv_all(s, timeout=10) == b"through the sandwich\n"
    assert peer.peer_ip == bed.a.ip4  # the waypoint app sees the real client
    assert (peer.local_ip, peer.local_port) == (bed.pods["wp"].ip4, 8080)
    rec = inbound_record(wp_zt, since, f"{SRV_PLAIN}:8080")
    assert rec["src.identity"] == SA_A and "error" not in rec


def test_sandwich_waypoint_proxy_protocol(bed: Mesh, apps: dict[str, App]) -> None:
    """Rust sandwich_waypoint_proxy_protocol: with a PROXY tunnel (and LOCALHOST_APP_TUNNEL on,
    the default) the waypoint's ztunnel connects to 127.0.0.1:<tunnel port> and writes a PROXY
    v2 header first: source the HBONE client, destination the HBONE target, TLV 0xD0 the
    client's SPIFFE identity."""
    wpp_zt = bed.ztunnels["wpp"]
    since = len(wpp_zt.records)
    with connect_from(bed.a, SRV_PROXY, 8080, timeout=10) as s:
        line = recv_line(s, timeout=10)
        s.sendall(b"behind a PROXY header\n")
        s.shutdown(1)
        assert recv_all(s, timeout=10) == b"behind a PROXY header\n"
    kind, src, dst, identity = line.split()
    assert kind == "PROXY", line
    assert src.rsplit(":", 1)[0] == bed.a.ip4  # ztunnel-a's HBONE connection, from pod a
    assert dst == f"{SRV_PROXY}:8080"
    assert identity == SA_A
    rec = inbound_record(wpp_zt, since, f"{SRV_PROXY}:8080")
    # (the app answering on 127.0.0.1:PROXY_PORT is the dial; Rust logs 15008 as dst.addr)
    assert rec["dst.addr"] == f"{bed.pods['wpp'].ip4}:15008" and "error" not in rec
