"""ConnectionRecord access-log fields and what ProxyContext.open_metrics derives for them:
the inbound destination service guess and the baggage fallbacks (reference 7)."""

from __future__ import annotations

import contextlib
import logging

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.config import Config, WorkloadInfo
from ztunnel.core.addr import SocketAddr
from ztunnel.core.errors import PolicyLateRejection
from ztunnel.hbone.headers import parse_baggage
from ztunnel.metrics import Metrics
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, guess_inbound_service
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import Workload
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(30)

CONFIG = """
workloads:
- uid: c//v1/Pod/default/client
  name: client
  namespace: default
  trustDomain: cluster.local
  serviceAccount: client
  workloadIps: ["10.0.1.2"]
  protocol: HBONE
  clusterId: cluster-c
- uid: c//v1/Pod/default/server
  name: server
  namespace: default
  trustDomain: cluster.local
  serviceAccount: server
  workloadIps: ["10.0.2.2"]
  protocol: HBONE
  clusterId: cluster-s
  services:
    "default/web.default.svc.cluster.local": {80: 8080}
    "default/named.default.svc.cluster.local": {443: 9443}
    "default/api.default.svc.cluster.local": {}
services:
- name: api
  namespace: default
  hostname: api.default.svc.cluster.local
  vips: ["/10.96.0.3"]
  ports: {80: 8080}
- name: web
  namespace: default
  hostname: web.default.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
- name: named
  namespace: default
  hostname: named.default.svc.cluster.local
  vips: ["/10.96.0.2"]
  ports: {443: 0}
"""

CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/default/sa/server"


@pytest.fixture
def state() -> State:
    st = State()
    load_local_config(CONFIG).apply_to(st)
    return st


def _wl(state: State, name: str) -> Workload:
    w = state.find_workload_by_uid(f"c//v1/Pod/default/{name}")
    assert w is not None
    return w


def test_guess_inbound_service(state: State) -> None:
    server = _wl(state, "server")
    # The Forwarded host wins when the workload backs that service.
    got = guess_inbound_service(state, server, 8080, "api.default.svc.cluster.local")
    assert got is not None and got.name == "api"
    # Else the first of its services whose target port matches, in the workload's order.
    got = guess_inbound_service(state, server, 8080)
    assert got is not None and got.name == "web"
    got = guess_inbound_service(state, server, 8080, "other.default.svc.cluster.local")
    assert got is not None and got.name == "web"
    # A named target port (0) matches through this endpoint's own port mapping.
    got = guess_inbound_service(state, server, 9443)
    assert got is not None and got.name == "named"
    assert guess_inbound_service(state, server, 9000) is None
    assert guess_inbound_service(state, _wl(state, "client"), 8080) is None


def _ctx(state: State) -> ProxyContext:
    return ProxyContext(
        config=Config(),
        state=state,
        sockets=SocketFactory(mark=None),
        pipes=None,
        local_workload=lambda: None,
        metrics=Metrics(CollectorRegistry(), process=False),
    )


def test_outbound_hbone_opened_names_the_expected_peer_identity(state: State) -> None:
    client, server = _wl(state, "client"), _wl(state, "server")
    rec = ConnectionRecord(
        "outbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:15008"),
        hbone_addr=SocketAddr.parse("10.0.2.2:8080"),
        src_workload=client,
        dst_workload=server,
        src_identity=client.identity,
    )
    _ctx(state).open_metrics(rec, mtls=True)
    assert rec.dst_service is None  # outbound: only the route sets it
    assert list(rec.fields().items()) == [
        ("src.addr", "10.0.1.2:40000"),
        ("src.workload", "client"),
        ("src.namespace", "default"),
        ("src.identity", CLIENT_ID),
        ("src.cluster", "cluster-c"),  # Rust #1994: after src.identity, as Rust logs it
        ("dst.addr", "10.0.2.2:15008"),
        ("dst.hbone_addr", "10.0.2.2:8080"),
        ("dst.workload", "server"),
        ("dst.namespace", "default"),
        ("dst.identity", SERVER_ID),  # before the handshake: the workload's identity
        ("dst.cluster", "cluster-s"),
        ("direction", "outbound"),
    ]


def test_plaintext_has_no_identities(state: State) -> None:
    rec = ConnectionRecord(
        "outbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:8080"),
        src_workload=_wl(state, "client"),
        dst_workload=_wl(state, "server"),
    )
    _ctx(state).open_metrics(rec, mtls=False)
    assert "src.identity" not in rec.fields() and "dst.identity" not in rec.fields()


def test_inbound_from_unknown_source_falls_back_to_baggage(state: State) -> None:
    server = _wl(state, "server")
    rec = ConnectionRecord(
        "inbound",
        SocketAddr.parse("10.9.9.9:40000"),
        SocketAddr.parse("10.0.2.2:8080"),
        hbone_addr=SocketAddr.parse("10.0.2.2:8080"),
        dst_workload=server,
        src_identity=_wl(state, "client").identity,
        dst_identity=server.identity,
    )
    bag = parse_baggage(
        "k8s.cluster.name=cluster-x,k8s.namespace.name=ns-x,k8s.deployment.name=x-deploy,"
        "service.name=x-app"
    )
    _ctx(state).open_metrics(rec, mtls=True, baggage=bag)
    f = rec.fields()
    assert list(f)[:5] == [
        "src.addr",
        "src.workload",
        "src.namespace",
        "src.identity",
        "src.cluster",
    ]
    assert (f["src.workload"], f["src.namespace"], f["src.cluster"]) == (
        "x-app",
        "ns-x",
        "cluster-x",
    )
    assert f["dst.service"] == "web.default.svc.cluster.local"
    # Rust inbound.rs build_inbound_request: dst.addr is the connection's own address (15008).
    assert (f["dst.addr"], f["dst.hbone_addr"]) == ("10.0.2.2:15008", "10.0.2.2:8080")
    assert f["dst.cluster"] == "cluster-s"
    # A known source workload wins over the baggage.
    rec2 = ConnectionRecord(
        "inbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:9000"),
        src_workload=_wl(state, "client"),
        dst_workload=server,
    )
    _ctx(state).open_metrics(rec2, mtls=False, baggage=bag)
    f2 = rec2.fields()
    assert (f2["src.workload"], f2["src.cluster"]) == ("client", "cluster-c")
    assert "dst.service" not in f2
    assert f2["dst.addr"] == "10.0.2.2:9000"  # plaintext inbound: the app's address


def test_clusters_are_absent_when_unknown(state: State) -> None:
    # Rust DefaultedUnknown::to_value: an empty clusterId is no field at all.
    rec = ConnectionRecord(
        "outbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("93.184.216.34:443"),
    )
    _ctx(state).open_metrics(rec, mtls=False)
    assert "src.cluster" not in rec.fields() and "dst.cluster" not in rec.fields()


def _labels(ctx: ProxyContext, family: str) -> list[tuple[str, float]]:
    assert ctx.metrics is not None
    return [
        (s.labels["response_flags"], s.value)
        for m in ctx.metrics.registry.collect()
        if m.name == family
        for s in m.samples
    ]


@pytest.mark.parametrize(
    ("reason", "flag", "failed", "error"),
    [
        # Rust PolicyWatcher -> handle_connection!: Err(AuthorizationPolicyLateRejection), DENY
        (PolicyLateRejection(), "DENY", 1, "connection closed due to policy change"),
        # Rust drops the unrecorded ConnectionResult: ClosedFromDrain, flag "-", not failed
        (None, "-", 0, "connection closed due to connection drain"),
        ("pod deleted", "-", 0, "pod deleted"),
    ],
)
def test_cancelled_connection_outcome(
    state: State,
    caplog: pytest.LogCaptureFixture,
    reason: PolicyLateRejection | str | None,
    flag: str,
    failed: int,
    error: str,
) -> None:
    ctx = _ctx(state)
    rec = ConnectionRecord(
        "inbound",
        SocketAddr.parse("10.0.1.2:40000"),
        SocketAddr.parse("10.0.2.2:8080"),
        src_workload=_wl(state, "client"),
        dst_workload=_wl(state, "server"),
    )
    ctx.open_metrics(rec, mtls=False)
    rec.close_reason = reason
    with caplog.at_level(logging.INFO, logger="access"):
        rec.log_cancelled()
    assert _labels(ctx, "istio_tcp_connections_closed") == [(flag, 1)]
    assert _labels(ctx, "istio_tcp_connections_failed") == ([(flag, 1)] if failed else [])
    (line,) = [r for r in caplog.records if r.name == "access"]
    assert line.levelno == logging.ERROR and line.fields["error"] == error  # type: ignore[attr-defined]


def test_unknown_local_workload_says_which(state: State) -> None:
    # Rust Error::UnknownSourceWorkload displays WorkloadInfo as "<sa>.<namespace> (<name>)"
    ctx = _ctx(state)
    ctx.local_info = WorkloadInfo("ns1", "pod-1", "sa1")
    assert str(ctx.unknown_local_workload()) == (
        "failed to fetch information about local workload: sa1.ns1 (pod-1)"
    )


@pytest.mark.parametrize("text", ["10.0.0.1:80", "[fd00::1]:15008", "[::ffff:1.2.3.4]:1"])
def test_access_log_addresses_read_as_str(text: str) -> None:
    from ztunnel.proxy.context import _addr_text

    addr = SocketAddr.parse(text)
    assert _addr_text(addr) == _addr_text(addr) == str(addr)


POLICY = """policies:
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/client}]
"""


@pytest.mark.parametrize(("info", "level"), [(False, logging.DEBUG), (True, logging.INFO)])
def test_authorize_logs_rusts_decision_lines(
    state: State, caplog: pytest.LogCaptureFixture, info: bool, level: int
) -> None:
    """Rust assert_rbac with authpol_log!: debug, or info with AUTHZ_POLICY_INFO_LOGGING,
    target ztunnel::state, the deciding policy as ``policy``."""
    from ztunnel.core.errors import AuthorizationDenied
    from ztunnel.state.authz import PolicyIndex

    state = State()
    load_local_config(CONFIG + POLICY).apply_to(state)
    ctx = _ctx(state)
    ctx.config = Config(authz_policy_info_logging=info)
    ctx.policies = PolicyIndex.from_state(state)
    server = _wl(state, "server")
    client, other = _wl(state, "client"), server

    def attempt(peer: Workload) -> None:
        rec = ConnectionRecord(
            "inbound",
            SocketAddr.parse("10.0.1.2:40000"),
            SocketAddr.parse("10.0.2.2:8080"),
            src_identity=peer.identity,
        )
        with contextlib.suppress(AuthorizationDenied):
            ctx.authorize(rec, server)

    with caplog.at_level(logging.INFO, logger="ztunnel.state"):
        attempt(client)
    lines = [(r.levelno, r.getMessage(), r.fields) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines == (
        [(logging.INFO, "allow policy match", {"policy": "default/allow-client"})] if info else []
    )
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ztunnel.state"):
        attempt(client)
        attempt(other)
    assert [(r.levelno, r.getMessage(), r.fields) for r in caplog.records] == [  # type: ignore[attr-defined]
        (level, "allow policy match", {"policy": "default/allow-client"}),
        (level, "no allow policies matched", {}),
    ]
    assert [r.name for r in caplog.records] == ["ztunnel.state"] * 2
