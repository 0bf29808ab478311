"""Double HBONE across networks, end to end: the Rust ztunnel's ``double_hbone1`` scenario
(``tests/namespaced.rs``) in network namespaces.

Pod a's app calls service ``remote`` whose only endpoint is on network ``remote``, reachable
through that network's east-west gateway. ztunnel-a opens an outer HBONE tunnel to the gateway
(Node's http2 in ``forward`` mode, presenting the gateway's identity), which pipes the stream to
the destination's HBONE port; there a second Node http2 server (``reply`` mode, identity
``echo``) terminates the inner tunnel, which is mTLS end to end with ztunnel-a. Both CONNECTs
name ``remote.default.svc.cluster.local:8080``; the inner one carries ``x-forwarded-network``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from ztunnel.testing.apps import connect_from, recv_all
from ztunnel.testing.certs import revocation_list
from ztunnel.testing.hbone import (
    TRUST_DOMAIN,
    Mesh,
    PodSpec,
    mesh,
    no_leaks,
    workload_yaml,
)
from ztunnel.testing.netns import NsProcess, Pod

from .nodehbone import event, start_server
from .test_observability import parse_samples, scrape

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

REMOTE_VIP = "10.96.0.40"
REMOTE_HOSTNAME = "remote.default.svc.cluster.local"
# double_hbone2: a service whose remote endpoint names its gateway by the gateway's service
# hostname, on port 15009 that the gateway maps to 15008
REMOTE2_VIP = "10.96.0.42"
REMOTE2_HOSTNAME = "remote-svc-gtw.default.svc.cluster.local"
GW_SVC_HOSTNAME = "ew-gtw-svc.default.svc.cluster.local"
AUTHORITY = f"{REMOTE_HOSTNAME}:8080"
MESSAGE = b"waypoint\n"  # what the destination's HBONE server answers first (Rust's helper)
SA_A = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-a"
SA_ECHO = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/echo"
SA_GW = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/actual-ew-gtw"
# What the destination's 200 says of it (as a ztunnel's response baggage does)
ECHO_BAGGAGE = (
    "k8s.cluster.name=remote-cluster,k8s.namespace.name=echo-ns,k8s.deployment.name=echo,"
    "service.name=echo-app,service.version=v7"
)


def config(pods: dict[str, Pod]) -> str:
    a, gw = pods["a"], pods["gw"]
    return (
        "workloads:\n"
        + workload_yaml(a, "sa-a")
        # the gateway of network "remote", as the local cluster sees it
        + workload_yaml(gw, "actual-ew-gtw", network="remote")
        + f'  services:\n    "default/{GW_SVC_HOSTNAME}": {{15009: 15008}}\n'
        # the local view of the remote workload: no IP of its own, only its gateway
        + "- uid: cluster1//v1/Pod/default/local-remote-workload\n"
        + "  name: local-remote-workload\n  namespace: default\n"
        + "  serviceAccount: actual-ew-gtw\n  trustDomain: cluster.local\n"
        + "  network: remote\n  protocol: HBONE\n"
        + f'  networkGateway: {{destination: "remote/{gw.ip4}", hboneMtlsPort: 15008}}\n'
        + f'  services:\n    "default/{REMOTE_HOSTNAME}": {{8080: 8080}}\n'
        + "- uid: cluster1//v1/Pod/default/local-remote-workload-svc-gtw\n"
        + "  name: local-remote-workload-svc-gtw\n  namespace: default\n"
        + "  serviceAccount: default\n  trustDomain: cluster.local\n"
        + "  network: remote\n  protocol: HBONE\n"
        + f"  networkGateway: {{destination: {{namespace: default, hostname: {GW_SVC_HOSTNAME}}},"
        + " hboneMtlsPort: 15009}\n"
        + f'  services:\n    "default/{REMOTE2_HOSTNAME}": {{8080: 8080}}\n'
        + "services:\n"
        + f"- name: remote\n  namespace: default\n  hostname: {REMOTE_HOSTNAME}\n"
        + f'  vips: ["/{REMOTE_VIP}"]\n  ports: {{8080: 8080}}\n'
        + f'  subjectAltNames: ["{SA_ECHO}"]\n'
        + f"- name: remote-svc-gtw\n  namespace: default\n  hostname: {REMOTE2_HOSTNAME}\n"
        + f'  vips: ["/{REMOTE2_VIP}"]\n  ports: {{8080: 8080}}\n'
        + f'  subjectAltNames: ["{SA_ECHO}"]\n'
        + f"- name: ew-gtw-svc\n  namespace: default\n  hostname: {GW_SVC_HOSTNAME}\n"
        + '  vips: ["/10.96.0.41"]\n  ports: {15009: 15008}\n'
    )


@dataclass
class Bed:
    m: Mesh
    gateway: NsProcess
    echo: NsProcess
    crl: Path  # ztunnel-a's CRL_PATH (absent until a test writes it)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    certs = tmp_path_factory.mktemp("double-hbone-certs")
    extra = [
        PodSpec("gw", "n2", service_account=None, ztunnel=None, inpod_rules=False),
        PodSpec("echo", "n2", service_account=None, ztunnel=None, inpod_rules=False),
    ]
    crl = certs / "crl.pem"
    with mesh(
        extra_env={"POOL_UNUSED_RELEASE_TIMEOUT": "200ms", "CRL_PATH": str(crl)},
        extra_pods=extra,
        start_b=False,
        config=config,
    ) as m:
        echo = start_echo(m, certs)
        forward = {"host": m.pods["echo"].ip4, "port": 15008}
        gateway = start_server(m.pods["gw"], m.ca, "actual-ew-gtw", certs, forward=forward)
        # Warm up: ztunnel-a fetches pod a's certificate (and starts its renewal timer) now.
        with connect_from(m.a, REMOTE_VIP, 8080, timeout=10) as s:
            s.shutdown(1)
            assert recv_all(s, timeout=10) == MESSAGE
        yield Bed(m, gateway, echo, crl)
        gateway.stop()
        echo.stop()


def start_echo(m: Mesh, certs: Path, service_account: str = "echo") -> NsProcess:
    """The destination behind the gateway: answers MESSAGE, echoes, names itself in baggage."""
    return start_server(
        m.pods["echo"],
        m.ca,
        service_account,
        certs,
        reply=MESSAGE.decode(),
        responseBaggage=ECHO_BAGGAGE,
    )


def test_double_hbone(bed: Bed) -> None:
    """Rust double_hbone1: the bytes make it through both tunnels; the outer CONNECT reaches the
    gateway with pod a's certificate, the inner one the destination, end to end."""
    data = b"across networks\n" * 64
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta), connect_from(bed.m.a, REMOTE_VIP, 8080, timeout=10) as s:
        s.sendall(data)
        s.shutdown(1)
        assert recv_all(s, timeout=10) == MESSAGE + data

    def is_req(ev: dict[str, Any]) -> bool:
        return ev["event"] == "request" and ev["authority"] == AUTHORITY

    outer = event(bed.gateway, is_req)
    inner = event(bed.echo, is_req)
    for req in (outer, inner):
        assert req["method"] == "CONNECT" and (req["alpn"], req["tls"]) == ("h2", "TLSv1.3")
        assert f"URI:{SA_A}" in req["clientSan"]  # the inner TLS is ztunnel-a's too
        assert f";host={REMOTE_HOSTNAME}" in req["forwarded"]
    assert outer["forwardedNetwork"] is None  # only the inner CONNECT names the origin network
    assert inner["forwardedNetwork"] == ""
    rec = bed.m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("dst.hbone_addr") == AUTHORITY
            and r.get("bytes_sent") == len(data)  # not the warm-up's, which may log late
        ),
        start=since,
    )
    want: dict[str, object] = {
        "src.identity": SA_A,
        # Rust with_derived_destination: the destination from the inner response's baggage
        "dst.workload": "echo",
        "dst.namespace": "echo-ns",
        "dst.addr": f"{bed.m.pods['gw'].ip4}:15008",
        "dst.hbone_addr": AUTHORITY,
        "dst.service": REMOTE_HOSTNAME,
        "dst.identity": SA_ECHO,  # the inner tunnel's peer, not the gateway
        "direction": "outbound",
        "bytes_sent": len(data),
        "bytes_recv": len(MESSAGE) + len(data),
    }
    assert {k: rec.get(k) for k in want} == want, rec
    assert "error" not in rec
    # ... and the metrics' destination labels (Rust CommonTrafficLabels::with_derived_destination)
    opened = {
        dict(labels)["destination_workload"]: dict(labels)
        for (name, labels), v in parse_samples(scrape(bed.m.a).text).items()
        if name == "istio_tcp_connections_opened_total" and v > 0
    }
    dst = opened["echo"]
    assert (dst["destination_workload_namespace"], dst["destination_canonical_service"]) == (
        "echo-ns",
        "echo-app",
    )
    assert (dst["destination_canonical_revision"], dst["destination_cluster"]) == (
        "v7",
        "remote-cluster",
    )
    assert dst["destination_principal"] == SA_ECHO
    assert dst["destination_service"] == REMOTE_HOSTNAME


def test_double_hbone_gateway_by_service_hostname(bed: Bed) -> None:
    """Rust double_hbone2: the gateway is a service named by hostname; the outer tunnel goes to
    its endpoint on the port the endpoint maps 15009 to (15008)."""
    data = b"via a gateway service\n"
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta), connect_from(bed.m.a, REMOTE2_VIP, 8080, timeout=10) as s:
        s.sendall(data)
        s.shutdown(1)
        assert recv_all(s, timeout=10) == MESSAGE + data
    rec = bed.m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("dst.hbone_addr") == f"{REMOTE2_HOSTNAME}:8080"
        ),
        start=since,
    )
    assert rec["dst.addr"] == f"{bed.m.pods['gw'].ip4}:15008"
    assert rec["dst.identity"] == SA_ECHO and "error" not in rec


def test_double_hbone_inner_identity_is_checked(bed: Bed, tmp_path: Path) -> None:
    """The inner tunnel must present the service's SAN: behind the same gateway, a destination
    with another identity is refused in the inner handshake, though the outer one succeeded."""
    bed.echo.stop()
    impostor = start_echo(bed.m, tmp_path, "not-echo")
    since = len(bed.m.zta.records)
    try:
        with no_leaks(bed.m.zta), connect_from(bed.m.a, REMOTE_VIP, 8080, timeout=10) as s:
            s.settimeout(10)
            assert s.recv(1) == b""
        rec = bed.m.zta.wait_for(
            lambda r: r.get("message") == "connection complete" and "inner" in str(r.get("error")),
            start=since,
        )
        assert SA_ECHO in rec["error"], rec
    finally:
        impostor.stop()
        bed.echo = start_echo(bed.m, tmp_path)


def test_inner_connection_closed_when_the_destination_is_revoked(bed: Bed) -> None:
    """A CRL reload re-checks the inner connections of double HBONE too (Rust
    proxy_to_double_hbone registers the inner TLS connection with the CrlManager): revoking the
    destination's certificate closes a live inner tunnel, its connection logged with
    ``certificate revoked``; the gateway's certificate is not revoked, so the pooled outer
    connection stays, and once the CRL no longer lists the destination it is reached again."""
    m = bed.m
    bed.echo.stop()  # (an earlier test may have restarted it with certificates elsewhere)
    bed.echo = start_echo(m, bed.crl.parent)
    echo_pem = (bed.crl.parent / "echo.crt").read_bytes()
    echo_serial = x509.load_pem_x509_certificate(echo_pem).serial_number

    def write(data: bytes) -> None:
        tmp = bed.crl.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, bed.crl)

    write(revocation_list(m.ca, [], number=1))
    since = len(m.zta.records)
    with connect_from(m.a, REMOTE_VIP, 8080, timeout=10) as s:
        s.settimeout(10)
        got = b""
        while len(got) < len(MESSAGE):
            got += s.recv(100)
        assert got == MESSAGE
        write(revocation_list(m.ca, [echo_serial], number=2))
        try:
            rest = s.recv(100)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
    rec = m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and "certificate revoked" in str(r.get("error", ""))
        ),
        start=since,
    )
    assert rec["dst.identity"] == SA_ECHO, rec
    outer = [
        c
        for c in m.zta.records[since:]
        if "revoked" in str(c.get("message", "")) and "sa/actual-ew-gtw" in str(c)
    ]
    assert not outer, outer  # the gateway's connection was not refused
    write(revocation_list(m.ca, [], number=3))
    deadline = time.monotonic() + 10
    while True:
        try:
            with connect_from(m.a, REMOTE_VIP, 8080, timeout=10) as s:
                s.shutdown(1)
                if recv_all(s, timeout=10) == MESSAGE:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "not reachable again after the CRL changed back"
        time.sleep(0.3)
