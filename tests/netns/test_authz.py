"""L4 authorization end to end, enforced by the destination's ztunnel.

Static policies (local config, dedicated mode, one ztunnel per pod): an ALLOW for one service
account admits it and denies another (401 to the client's ztunnel, its app connection closed,
the deny in the destination's access log and DENY metric), a DENY on one port, and STRICT
(``notPrincipals: [Presence]``) refusing a plaintext client while mTLS passes. The admin
``/debug/authz`` endpoint answers what the proxy did. Dynamic policies (shared mode, all config
from a fake istiod over xDS): policies added while connections are open close exactly the
connections they no longer allow, as Rust logs and counts them (DENY), with Rust's decision lines.
"""

from __future__ import annotations

import contextlib
import json
import socket
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from ztunnel.core.identity import Identity
from ztunnel.state.authz import NOT_ALLOWED
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import Authorization
from ztunnel.testing.apps import App, connect_from, recv_line, start_app
from ztunnel.testing.hbone import workload_yaml
from ztunnel.testing.netns import External, Pod, Testbed
from ztunnel.testing.proc import Record, ZtunnelProcess
from ztunnel.testing.xdsbed import MeshPod, XdsMesh, http_get, metric, xds_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

ADMIN_PORT = 15000
STATS_PORT = 15020


def sid(sa: str) -> str:
    return str(Identity("cluster.local", "default", sa))


def uid(pod: str) -> str:
    return f"cluster1//v1/Pod/default/{pod}"


POLICIES = """policies:
- name: allow-sa-a
  namespace: default
  scope: WorkloadSelector
  action: Allow
  rules:
  - - - serviceAccounts: [{namespace: default, serviceAccount: sa-a}]
- name: deny-9102
  namespace: default
  scope: WorkloadSelector
  action: Deny
  rules:
  - - - destinationPorts: [9102]
- name: strict
  namespace: default
  scope: WorkloadSelector
  action: Deny
  rules:
  - - - notPrincipals: [{Presence: []}]
"""


@dataclass
class Static:
    tb: Testbed
    pods: dict[str, Pod]
    ext: External
    zt: dict[str, ZtunnelProcess]
    apps: list[App]


@pytest.fixture(scope="module")
def static() -> Iterator[Static]:
    """Clients ``a`` (sa-a) and ``c`` (sa-c) on n1; servers on n2: ``s1`` selects allow-sa-a
    and deny-9102, ``s2`` selects strict. An external host ``ext`` is outside the mesh."""
    with Testbed() as tb, tempfile.TemporaryDirectory() as ca_dir:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        pods = {
            "a": n1.add_pod("a"),
            "c": n1.add_pod("c"),
            "s1": n2.add_pod("s1"),
            "s2": n2.add_pod("s2"),
        }
        ext = tb.add_external("ext")
        for p in pods.values():
            p.install_inpod_rules()
        cfg = (
            "workloads:\n"
            + workload_yaml(pods["a"], "sa-a")
            + workload_yaml(pods["c"], "sa-c")
            + workload_yaml(
                pods["s1"],
                "sa-s1",
                authorizationPolicies='["default/allow-sa-a", "default/deny-9102"]',
            )
            + workload_yaml(pods["s2"], "sa-s2", authorizationPolicies='["default/strict"]')
            + POLICIES
        )
        load_local_config(cfg)  # fail here, not in four ztunnels, if the YAML is off
        zts = {
            name: ZtunnelProcess(
                pod,
                {
                    "PROXY_MODE": "dedicated",
                    "LOCAL_XDS": cfg,
                    "ZTUNNEL_LOCAL_CA_DIR": ca_dir,
                    "PROXY_WORKLOAD_INFO": f"default/{name}/sa-{name}",
                    "NODE_NAME": pod.node.name,
                },
            )
            for name, pod in pods.items()
        }
        apps: list[App] = []
        try:
            with ThreadPoolExecutor(len(zts)) as pool:
                for started in [pool.submit(zt.start) for zt in zts.values()]:
                    started.result()
            apps.append(start_app(pods["s1"], "echo", ports=(9101, 9102)))
            apps.append(start_app(pods["s2"], "echo", ports=(9201,)))
            yield Static(tb, pods, ext, zts, apps)
        finally:
            for app in apps:
                app.stop()
            codes = {n: (zt.stop(), zt.internal_errors()) for n, zt in zts.items()}
        assert all(rc == 0 for rc, _ in codes.values()), codes


def echo_ok(src: Pod | External, dst: Pod, port: int, msg: str = "hi") -> bool:
    """True when ``msg`` comes back; False when the connection is closed instead."""
    try:
        with connect_from(src, dst.ip4, port, timeout=5) as s:
            s.sendall(f"{msg}\n".encode())
            return recv_line(s, timeout=10) == msg
    except (EOFError, ConnectionResetError):
        return False


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def completed(zt: ZtunnelProcess, direction: str, **fields: object) -> Record:
    """The first access-log ``connection complete`` record with these fields."""
    return zt.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == direction
            and all(r.get(k) == v for k, v in fields.items())
        )
    )


def explain(where: Pod | XdsMesh, src: str, dst: str, port: int) -> dict[str, object]:
    host = where if isinstance(where, Pod) else where.nodes["n2"]
    status, body = http_get(host, ADMIN_PORT, f"/debug/authz?src={src}&dst={dst}&port={port}")
    assert status == 200, body
    decision = json.loads(body)["decision"]
    assert isinstance(decision, dict)
    return decision


# --- static policies ------------------------------------------------------------------------


def test_allow_admits_one_service_account_and_denies_another(static: Static) -> None:
    s1 = static.pods["s1"]
    assert echo_ok(static.pods["a"], s1, 9101, "from-a")
    assert not echo_ok(static.pods["c"], s1, 9101, "from-c")

    # The denied client's ztunnel got 401 and closed the app connection.
    out = completed(static.zt["c"], "outbound", **{"dst.hbone_addr": f"{s1.ip4}:9101"})
    assert "401" in str(out["error"]), out
    assert out["src.identity"] == sid("sa-c")
    # The destination logged the deny, with the reason; the allowed one completed cleanly.
    denied = completed(static.zt["s1"], "inbound", **{"src.identity": sid("sa-c")})
    assert denied["error"] == NOT_ALLOWED
    assert (denied["dst.addr"], denied["dst.hbone_addr"]) == (f"{s1.ip4}:15008", f"{s1.ip4}:9101")
    allowed = completed(static.zt["s1"], "inbound", **{"src.identity": sid("sa-a")})
    assert "error" not in allowed
    # istio_tcp_connections_failed_total counts the deny on the destination.
    status, text = http_get(s1, STATS_PORT, "/metrics")
    assert status == 200
    assert (
        metric(
            text,
            "istio_tcp_connections_failed_total",
            reporter="destination",
            response_flags="DENY",
            source_principal=sid("sa-c"),
        )
        >= 1
    ), [line for line in text.splitlines() if "connections_failed" in line]

    # The live explain endpoint agrees with what the proxy did, for the same reason.
    d = explain(s1, sid("sa-c"), uid("s1"), 9101)
    assert (d["allowed"], d["reason"]) == (False, denied["error"])
    d = explain(s1, sid("sa-a"), "default/s1", 9101)
    assert (d["allowed"], d["policy"]) == (True, "default/allow-sa-a")
    status, text = http_get(
        s1,
        ADMIN_PORT,
        f"/debug/authz?src={sid('sa-c')}&dst={s1.ip4}&port=9101",
        headers={"Accept": "text/plain"},
    )
    assert status == 200 and f"decision:    DENY: {NOT_ALLOWED}" in text, text


def test_deny_on_one_port(static: Static) -> None:
    a, s1 = static.pods["a"], static.pods["s1"]
    assert not echo_ok(a, s1, 9102)
    assert echo_ok(a, s1, 9101)
    denied = completed(static.zt["s1"], "inbound", **{"dst.hbone_addr": f"{s1.ip4}:9102"})
    assert denied["error"] == "explicitly denied by: default/deny-9102"
    assert denied["src.identity"] == sid("sa-a")
    out = completed(static.zt["a"], "outbound", **{"dst.hbone_addr": f"{s1.ip4}:9102"})
    assert "401" in str(out["error"]), out
    d = explain(s1, sid("sa-a"), uid("s1"), 9102)
    assert (d["allowed"], d["policy"]) == (False, "default/deny-9102")


def test_strict_refuses_plaintext_and_admits_mtls(static: Static) -> None:
    s2 = static.pods["s2"]
    # A client outside the mesh: plaintext, captured to 15006, no identity.
    assert not echo_ok(static.ext, s2, 9201, "plain")
    denied = static.zt["s2"].wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and str(r.get("src.addr")).startswith(f"{static.ext.ip4}:")
        )
    )
    assert denied["direction"] == "inbound"
    assert denied["error"] == "explicitly denied by: default/strict"
    assert "src.identity" not in denied
    # The same port over HBONE (mTLS) from a mesh pod.
    assert echo_ok(static.pods["a"], s2, 9201, "mtls")
    ok = completed(static.zt["s2"], "inbound", **{"src.identity": sid("sa-a")})
    assert "error" not in ok
    d = explain(s2, static.ext.ip4, uid("s2"), 9201)
    assert (d["allowed"], d["policy"]) == (False, "default/strict")


# --- policies from xDS, while connections are open -------------------------------------------


def _policy(yaml_text: str) -> Authorization:
    [p] = load_local_config("policies:\n" + yaml_text).policies
    return p


def _push(mesh: XdsMesh, policy: Authorization) -> None:
    istiod = mesh.istiod
    answers = istiod.answers(istiod.call(istiod.istiod.set_policies, policy))
    assert answers and all(a.is_ack for a in answers)  # both ztunnels applied it


def test_policy_added_while_connections_are_open_closes_them() -> None:
    pods = (
        MeshPod("c1", "n1", "sa-c1"),
        MeshPod("c2", "n1", "sa-c2"),
        MeshPod("s1", "n2", "sa-s1"),
    )
    # Decision logs at info (Rust AUTHZ_POLICY_INFO_LOGGING): the re-checks say which policy.
    with xds_mesh(pods, tls=False, extra_env={"AUTHZ_POLICY_INFO_LOGGING": "true"}) as mesh:
        s1 = mesh.pods["s1"]
        zt = mesh.ztunnel_of("s1")
        for node in mesh.nodes:  # all configuration arrived over xDS
            mesh.ztunnels[node].wait_for(lambda r: r.get("message") == "xDS: initial sync complete")
        echo = start_app(s1, "echo", ports=(8080,))
        with contextlib.ExitStack() as stack:
            conns = {}
            for name in ("c1", "c2"):
                s = stack.enter_context(connect_from(mesh.pods[name], s1.ip4, 8080, timeout=5))
                s.sendall(f"{name}\n".encode())
                assert recv_line(s) == name
                conns[name] = s
            # A client outside the mesh (plaintext, through 15006 on s1's pod).
            plain = stack.enter_context(connect_from(mesh.istiod_host, s1.ip4, 8080, timeout=5))
            plain.sendall(b"plain\n")
            assert recv_line(plain) == "plain"
            # Each was checked once, with no policy yet: Rust's "no allow policies, allow".
            zt.wait_for(lambda r: r.get("message") == "no allow policies, allow")
            since = len(zt.records)

            # An ALLOW for sa-c1 only: c2's open connection is closed, c1's lives on.
            _push(
                mesh,
                _policy(
                    """- name: allow-c1
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/sa-c1}]
"""
                ),
            )
            assert closed_by_peer(conns["c2"])
            assert closed_by_peer(plain)
            # Rust Error::AuthorizationPolicyLateRejection, flag DENY
            late = "connection closed due to policy change"
            rec = completed(zt, "inbound", **{"src.identity": sid("sa-c2")})
            assert rec["error"] == late and rec["level"] == "error"
            rec = zt.wait_for(
                lambda r: (
                    r.get("message") == "connection complete"
                    and str(r.get("src.addr")).startswith(f"{mesh.istiod_host.ip4}:")
                )
            )
            assert rec["error"] == late and "src.identity" not in rec
            conns["c1"].sendall(b"still\n")
            assert recv_line(conns["c1"]) == "still"
            # The re-checks logged Rust's decision lines (scope ztunnel::state, at info here)
            # and Rust's close line (ztunnel::proxy).
            decisions = [
                (r["message"], r.get("policy"))
                for r in zt.records[since:]
                if r.get("scope") == "ztunnel::state"
            ]
            assert ("allow policy match", "default/allow-c1") in decisions, decisions
            assert ("no allow policies matched", None) in decisions, decisions
            assert {
                r["level"] for r in zt.records[since:] if r.get("scope") == "ztunnel::state"
            } == {"info"}
            closes = [
                r["message"]
                for r in zt.records[since:]
                if str(r.get("message")).endswith(
                    "closed because it's no longer allowed after a policy update"
                )
            ]
            assert len(closes) == 2 and all(m.startswith("connection ") for m in closes), closes

            # A DENY naming sa-c1: now c1's connection closes too.
            _push(
                mesh,
                _policy(
                    """- name: deny-c1
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/sa-c1}]
"""
                ),
            )
            assert closed_by_peer(conns["c1"])
            rec = completed(zt, "inbound", **{"src.identity": sid("sa-c1")})
            assert rec["error"] == late
            # Rust logs an inbound HBONE connection's own address (15008) as dst.addr
            assert rec["dst.addr"] == f"{s1.ip4}:15008"
            assert rec["dst.hbone_addr"] == f"{s1.ip4}:8080"
            zt.wait_for(
                lambda r: (
                    r.get("scope") == "ztunnel::state"
                    and r.get("message") == "deny policy match"
                    and r.get("policy") == "default/deny-c1"
                )
            )
            # The three closes count as DENY in closed and failed (Rust
            # extract_failure_reason: AuthorizationPolicyLateRejection -> DENY).
            status, text = http_get(mesh.nodes["n2"], STATS_PORT, "/metrics")
            assert status == 200
            for family in (
                "istio_tcp_connections_closed_total",
                "istio_tcp_connections_failed_total",
            ):
                assert metric(text, family, reporter="destination", response_flags="DENY") == 3, [
                    line for line in text.splitlines() if family in line
                ]
        echo.stop()
        # The destination ztunnel's live explain agrees with both closes.
        d = explain(mesh, sid("sa-c1"), uid("s1"), 8080)
        assert (d["allowed"], d["policy"]) == (False, "default/deny-c1")
        d = explain(mesh, sid("sa-c2"), uid("s1"), 8080)
        assert (d["allowed"], d["reason"]) == (False, NOT_ALLOWED)
