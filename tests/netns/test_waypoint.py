"""Outbound to waypoints, end to end: the scenarios of the Rust ztunnel's ``tests/namespaced.rs``
(``service_waypoint``, ``workload_waypoint``, ``service_waypoint_hostname``,
``service_waypoint_workload_hostname``) in network namespaces with istio-cni's rules.

Pod a's app connects to a service VIP or a workload IP that has a waypoint; ztunnel-a must carry
it over HBONE to the waypoint pod, which is Node's http2 module (``interop/hbone_server.js`` in
``reply`` mode, an HTTP/2 stack independent of ours): it records the CONNECT it received, answers
``waypoint\\n`` and echoes the stream, as Rust's ``run_hbone_server`` does. The server workloads
themselves have no pod: traffic to them must never leave for anywhere but the waypoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ztunnel.testing.apps import connect_from, recv_all
from ztunnel.testing.hbone import (
    TRUST_DOMAIN,
    Mesh,
    PodSpec,
    mesh,
    no_leaks,
    workload_yaml,
)
from ztunnel.testing.netns import NsProcess, Pod
from ztunnel.testing.proc import Record

from .nodehbone import event, start_server

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

WAYPOINT_MESSAGE = b"waypoint\n"  # Rust: tests/namespaced.rs WAYPOINT_MESSAGE
SA_A = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-a"
SA_WAYPOINT = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/waypoint"

SVC_VIP = "10.96.0.30"  # service "svc" with a waypoint by IP
WAYPOINT_SVC_VIP = "10.96.0.31"  # the waypoint's own service, for waypoints named by hostname
SERVER_BY_IP = "10.96.1.10"  # workload with a waypoint by IP
SERVER_BY_SVC_HOSTNAME = "10.96.1.11"  # ... by the hostname of the waypoint's service
SERVER_BY_WL_HOSTNAME = "10.96.1.12"  # ... by the hostname of the waypoint workload
SERVER_MISSING_WAYPOINT = "10.96.1.13"  # ... by an address nothing in state has
SVC_HOSTNAME = "svc.default.svc.cluster.local"
WAYPOINT_SVC_HOSTNAME = "waypoint.default.svc.cluster.local"
WAYPOINT_WL_HOSTNAME = "waypoint.example.com"


def _server(name: str, ip: str, waypoint: str) -> str:
    return (
        f"- uid: cluster1//v1/Pod/default/{name}\n"
        f"  name: {name}\n"
        "  namespace: default\n"
        f"  serviceAccount: {name}\n"
        "  trustDomain: cluster.local\n"
        f'  workloadIps: ["{ip}"]\n'
        "  protocol: HBONE\n"
        f"  waypoint: {waypoint}\n"
    )


def waypoint_config(pods: dict[str, Pod]) -> str:
    a, w = pods["a"], pods["waypoint"]
    by_ip = f'{{destination: "/{w.ip4}", hboneMtlsPort: 15008}}'
    by_svc = (
        f"{{destination: {{namespace: default, hostname: {WAYPOINT_SVC_HOSTNAME}}}, "
        "hboneMtlsPort: 15008}"
    )
    by_wl = (
        f"{{destination: {{namespace: default, hostname: {WAYPOINT_WL_HOSTNAME}}}, "
        "hboneMtlsPort: 15008}"
    )
    missing = '{destination: "/10.96.1.99", hboneMtlsPort: 15008}'
    return (
        "workloads:\n"
        + workload_yaml(a, "sa-a", canonicalName="a-app", workloadName="a-deploy")
        + workload_yaml(w, "waypoint", hostname=WAYPOINT_WL_HOSTNAME)
        + f'  services:\n    "default/{WAYPOINT_SVC_HOSTNAME}": {{15008: 15008}}\n'
        + _server("server-ip", SERVER_BY_IP, by_ip)
        + _server("server-svc-host", SERVER_BY_SVC_HOSTNAME, by_svc)
        + _server("server-wl-host", SERVER_BY_WL_HOSTNAME, by_wl)
        + _server("server-missing", SERVER_MISSING_WAYPOINT, missing)
        + "services:\n"
        + "- name: svc\n  namespace: default\n"
        + f"  hostname: {SVC_HOSTNAME}\n"
        + f'  vips: ["/{SVC_VIP}"]\n  ports: {{80: 8080}}\n'
        + f"  waypoint: {by_ip}\n"
        + "- name: waypoint\n  namespace: default\n"
        + f"  hostname: {WAYPOINT_SVC_HOSTNAME}\n"
        + f'  vips: ["/{WAYPOINT_SVC_VIP}"]\n  ports: {{15008: 15008}}\n'
    )


@dataclass
class Bed:
    m: Mesh
    server: NsProcess  # the node waypoint stand-in in pod w

    @property
    def w(self) -> Pod:
        return self.m.pods["waypoint"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    certs = tmp_path_factory.mktemp("waypoint-certs")
    extra = [PodSpec("waypoint", "n2", service_account=None, ztunnel=None, inpod_rules=False)]
    with mesh(
        extra_env={"POOL_UNUSED_RELEASE_TIMEOUT": "200ms"},
        extra_pods=extra,
        start_b=False,
        config=waypoint_config,
    ) as m:
        server = start_server(
            m.pods["waypoint"], m.ca, "waypoint", certs, reply=WAYPOINT_MESSAGE.decode()
        )
        # Warm up: ztunnel-a fetches pod a's certificate (and starts its renewal timer) now,
        # so the per-test baselines are steady.
        with connect_from(m.a, SERVER_BY_IP, 9999, timeout=10) as s:
            s.shutdown(1)
            assert recv_all(s, timeout=10) == WAYPOINT_MESSAGE
        yield Bed(m, server)
        server.stop()


def server_event(b: Bed, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    return event(b.server, pred)


def through_waypoint(b: Bed, ip: str, port: int, data: bytes) -> tuple[Record, dict[str, Any]]:
    """Pod a -> ip:port with ``data`` and a half-close; the app must get the waypoint's reply
    and its echo. Returns ztunnel-a's access-log record and the CONNECT the waypoint saw."""
    authority = f"{ip}:{port}"
    since = len(b.m.zta.records)
    with no_leaks(b.m.zta), connect_from(b.m.a, ip, port, timeout=10) as s:
        s.sendall(data)
        s.shutdown(1)  # SHUT_WR
        assert recv_all(s, timeout=10) == WAYPOINT_MESSAGE + data
    req = server_event(b, lambda ev: ev["event"] == "request" and ev["authority"] == authority)
    closed = server_event(b, lambda ev: ev["event"] == "closed" and ev["authority"] == authority)
    assert (closed["up"], closed["rstCode"]) == (len(data), 0)
    rec = b.m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete" and r.get("dst.hbone_addr") == authority
        ),
        start=since,
    )
    return rec, req


def assert_waypoint_request(req: dict[str, Any], service: str | None) -> None:
    assert req["method"] == "CONNECT"
    assert (req["alpn"], req["tls"]) == ("h2", "TLSv1.3")
    assert f"URI:{SA_A}" in req["clientSan"]
    host = f";host={service}" if service else ""
    assert re.fullmatch(rf'for="[0-9.]+:\d+"{re.escape(host)}', req["forwarded"]), req
    assert "k8s.namespace.name=default" in req["baggage"]


def assert_waypoint_record(rec: Record, b: Bed, data: bytes, service: str | None) -> None:
    """The access-log fields Rust's tests assert: the destination is the waypoint workload."""
    want: dict[str, object] = {
        "src.workload": "a",
        "src.identity": SA_A,
        "dst.addr": f"{b.w.ip4}:15008",
        "dst.workload": "waypoint",
        "dst.namespace": "default",
        "dst.identity": SA_WAYPOINT,
        "direction": "outbound",
        "bytes_sent": len(data),
        "bytes_recv": len(WAYPOINT_MESSAGE) + len(data),
    }
    assert {k: rec.get(k) for k in want} == want, rec
    assert rec.get("dst.service") == service, rec
    assert "error" not in rec, rec


def test_service_waypoint(bed: Bed) -> None:
    """Rust ``service_waypoint``: a service VIP with a waypoint by IP -> HBONE to the waypoint,
    CONNECT to the VIP and service port (not translated), the waypoint's identity expected."""
    data = b"to the service\n" * 100
    rec, req = through_waypoint(bed, SVC_VIP, 80, data)
    assert_waypoint_request(req, SVC_HOSTNAME)
    assert_waypoint_record(rec, bed, data, SVC_HOSTNAME)


def test_workload_waypoint(bed: Bed) -> None:
    """Rust ``workload_waypoint``: a workload with a waypoint by IP; the CONNECT names the
    workload's own address and the port the app dialled."""
    data = b"to the workload\n"
    rec, req = through_waypoint(bed, SERVER_BY_IP, 8080, data)
    assert_waypoint_request(req, None)
    assert_waypoint_record(rec, bed, data, None)


def test_workload_waypoint_by_service_hostname(bed: Bed) -> None:
    """Rust ``service_waypoint_hostname``: the waypoint named by its service's hostname; the
    dial goes to the service's endpoint pod on the HBONE port."""
    data = b"via the waypoint service\n"
    rec, req = through_waypoint(bed, SERVER_BY_SVC_HOSTNAME, 8080, data)
    assert_waypoint_request(req, None)
    assert_waypoint_record(rec, bed, data, None)


def test_workload_waypoint_by_workload_hostname(bed: Bed) -> None:
    """Rust ``service_waypoint_workload_hostname``: the waypoint named by a workload's own
    ``hostname``."""
    data = b"via the waypoint workload\n"
    rec, req = through_waypoint(bed, SERVER_BY_WL_HOSTNAME, 8080, data)
    assert_waypoint_request(req, None)
    assert_waypoint_record(rec, bed, data, None)


def test_missing_waypoint_is_refused(bed: Bed) -> None:
    """A waypoint that state does not know: Rust ``fetch_waypoint`` fails with
    ``UnknownWaypoint``; the app's connection is closed and nothing reaches any waypoint."""
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta), connect_from(bed.m.a, SERVER_MISSING_WAYPOINT, 8080) as s:
        s.settimeout(5)
        assert s.recv(1) == b""
    rec = bed.m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection failed"
            and "unknown waypoint" in str(r.get("error", ""))
        ),
        start=since,
        timeout=5,
    )
    assert rec["dst.addr"] == f"{SERVER_MISSING_WAYPOINT}:8080", rec
    assert rec["error"] == "unknown waypoint: waypoint /10.96.1.99 not found", rec
