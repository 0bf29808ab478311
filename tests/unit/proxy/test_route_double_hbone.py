"""Outbound across networks: Rust's ``build_request_through_gateway`` (``src/proxy/outbound.rs``)
and ``fetch_network_gateway`` (``src/state.rs``), checked with no sockets. The state is the one
of Rust's ``double_hbone1`` / ``double_hbone2`` tests (``tests/namespaced.rs``)."""

import dataclasses
import random

import pytest

from ztunnel.core.addr import HostnameAuthority, SocketAddr
from ztunnel.core.errors import UnknownNetworkGateway
from ztunnel.core.identity import Identity
from ztunnel.proxy.route import Route, RouteKind, decide_outbound
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.store import State

CONFIG = """
workloads:
- uid: c//v1/Pod/default/client
  name: client
  namespace: default
  trustDomain: cluster.local
  serviceAccount: client
  workloadIps: ["10.0.1.2"]
  protocol: HBONE
- uid: c//v1/Pod/default/actual-ew-gtw
  name: actual-ew-gtw
  namespace: default
  trustDomain: cluster.local
  serviceAccount: actual-ew-gtw
  workloadIps: ["10.1.0.9"]
  network: remote
  protocol: HBONE
# The local view of a workload on the remote network: no IP of its own, only its gateway.
- uid: c//v1/Pod/default/local-remote-workload
  name: local-remote-workload
  namespace: default
  trustDomain: cluster.local
  serviceAccount: actual-ew-gtw
  network: remote
  protocol: HBONE
  networkGateway: {destination: "remote/10.1.0.9", hboneMtlsPort: 15008}
  services:
    "default/remote.default.svc.cluster.local": {8080: 8080}
# double_hbone2: the gateway named by its service's hostname, 15009 -> 15008 on the endpoint
- uid: c//v1/Pod/default/ew-gtw-pod
  name: ew-gtw-pod
  namespace: default
  trustDomain: cluster.local
  serviceAccount: actual-ew-gtw
  workloadIps: ["10.1.0.10"]
  network: remote
  protocol: HBONE
  services:
    "default/ew-gtw-svc.default.svc.cluster.local": {15009: 15008}
- uid: c//v1/Pod/default/local-remote-workload-svc-gtw
  name: local-remote-workload-svc-gtw
  namespace: default
  trustDomain: cluster.local
  network: remote
  protocol: HBONE
  networkGateway:
    destination: {namespace: default, hostname: ew-gtw-svc.default.svc.cluster.local}
    hboneMtlsPort: 15009
  services:
    "default/remote-svc-gtw.default.svc.cluster.local": {8080: 8080}
- uid: c//v1/Pod/default/lost
  name: lost
  namespace: default
  trustDomain: cluster.local
  network: remote
  protocol: HBONE
  networkGateway: {destination: "remote/10.1.0.250", hboneMtlsPort: 15008}
  services:
    "default/lost.default.svc.cluster.local": {8080: 8080}
services:
- name: remote
  namespace: default
  hostname: remote.default.svc.cluster.local
  vips: ["/10.96.0.30"]
  ports: {8080: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/echo"]
- name: remote-svc-gtw
  namespace: default
  hostname: remote-svc-gtw.default.svc.cluster.local
  vips: ["/10.96.0.32"]
  ports: {8080: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/echo"]
- name: ew-gtw-svc
  namespace: default
  hostname: ew-gtw-svc.default.svc.cluster.local
  vips: ["/10.96.0.33"]
  ports: {15009: 15008}
- name: lost
  namespace: default
  hostname: lost.default.svc.cluster.local
  vips: ["/10.96.0.31"]
  ports: {8080: 8080}
"""


@pytest.fixture
def state() -> State:
    s = State()
    load_local_config(CONFIG).apply_to(s)
    return s


def route(state: State, dst: str) -> Route:
    client = state.find_workload_by_uid("c//v1/Pod/default/client")
    return decide_outbound(state, client, SocketAddr.parse(dst), rng=random.Random(1))


def test_service_on_another_network_goes_through_its_gateway(state: State) -> None:
    """Rust double_hbone1: outer tunnel to the gateway (its identity), inner one checked against
    the service's SANs; both CONNECTs name the service hostname and the dialled port."""
    r = route(state, "10.96.0.30:8080")
    assert r.kind is RouteKind.DOUBLE_HBONE
    assert str(r.target) == "10.1.0.9:15008"
    assert r.authority == HostnameAuthority("remote.default.svc.cluster.local", 8080)
    assert r.expected_identities == (Identity("cluster.local", "default", "actual-ew-gtw"),)
    assert r.final_identities == (Identity("cluster.local", "default", "echo"),)
    assert r.destination_workload is not None
    assert r.destination_workload.name == "actual-ew-gtw"
    assert r.destination_service is not None
    assert r.destination_service.hostname == "remote.default.svc.cluster.local"


def test_service_without_sans_expects_the_remote_workload_identity(state: State) -> None:
    """No service SANs: the inner tunnel expects the remote workload's own identity."""
    svc = state.find_service("default/remote.default.svc.cluster.local")
    assert svc is not None
    state.upsert_service(dataclasses.replace(svc, subject_alt_names=()))
    r = route(state, "10.96.0.30:8080")
    assert r.final_identities == (Identity("cluster.local", "default", "actual-ew-gtw"),)


def test_gateway_named_by_service_hostname(state: State) -> None:
    """Rust double_hbone2: the gateway service is load-balanced in standard mode on the
    gateway's hbone_mtls_port (15009), dialled at the port the endpoint maps it to (15008)."""
    r = route(state, "10.96.0.32:8080")
    assert r.kind is RouteKind.DOUBLE_HBONE
    assert str(r.target) == "10.1.0.10:15008"
    assert r.authority == HostnameAuthority("remote-svc-gtw.default.svc.cluster.local", 8080)


def test_unknown_network_gateway(state: State) -> None:
    """Rust fetch_network_gateway: Error::UnknownNetworkGateway."""
    with pytest.raises(UnknownNetworkGateway, match=r"network gateway remote/10\.1\.0\.250"):
        route(state, "10.96.0.31:8080")
