"""Control plane end to end: two nodes, a shared-mode ztunnel on each, and every piece of
configuration from a fake istiod in the test bed (TLS, bearer token): workloads and policies by
delta xDS, workload certificates from its CA. Nothing is served before the first sync (Rust
``app.rs``: no pod is taken from the node agent, so a plaintext client arriving before it is
refused, never let through unchecked), readiness waits for it, HBONE works with CA-issued
certificates, and a policy pushed while a connection is open closes it."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ztunnel.core.identity import Identity
from ztunnel.state.localconfig import load_local_config
from ztunnel.testing.apps import App, connect_from, recv_line, start_app
from ztunnel.testing.netns import Pod
from ztunnel.testing.xdsbed import TOKEN, MeshPod, XdsMesh, xds_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

PODS = (MeshPod("c1", "n1", "sa-c1"), MeshPod("s1", "n2", "sa-s1"))
C1 = Identity("cluster.local", "default", "sa-c1")
S1 = Identity("cluster.local", "default", "sa-s1")


@dataclass
class Bed:
    mesh: XdsMesh
    echo: App
    before: dict[str, tuple[int, str]]  # readiness before istiod answered, by node
    still: dict[str, tuple[int, str]]  # the same, 5 s later (istiod still silent)
    streams_before: int
    after: dict[str, tuple[int, str]]
    early: tuple[bytes, float]  # a plaintext client before the first sync: what came back, when
    agents_before: dict[str, int]  # node agent connections before the first sync, by node


def _wait_ready(mesh: XdsMesh, node: str, timeout: float = 15.0) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        got = mesh.readiness(node)
        if got[0] == 200 or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with xds_mesh(PODS, serve=False) as mesh:
        # ztunnel is up, but istiod has not answered yet.
        before = {n: mesh.readiness(n) for n in mesh.nodes}
        echo = start_app(mesh.pods["s1"], "echo", ports=(8080, 8081))
        try:
            early = _early_plaintext(mesh)
            still = {n: mesh.readiness(n) for n in mesh.nodes}
            streams_before = len(mesh.istiod.call(lambda: list(mesh.istiod.istiod.streams)))
            agents_before = {n: len(a.all_connections) for n, a in mesh.agents.items()}
            mesh.serve()
            mesh.wait_pods()
            after = {n: _wait_ready(mesh, n) for n in mesh.nodes}
            yield Bed(mesh, echo, before, still, streams_before, after, early, agents_before)
        finally:
            _settle(mesh.pods["s1"])
            echo.stop()


def _settle(pod: Pod, timeout: float = 5.0) -> None:
    """Let the app's connections finish closing before it goes away (a quieter teardown)."""
    deadline = time.monotonic() + timeout
    query = ("ss", "-Htn", "state", "established", "( sport = :8080 or sport = :8081 )")
    while pod.run(*query).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.05)


def _early_plaintext(mesh: XdsMesh) -> tuple[bytes, float]:
    """A client outside the mesh connects to s1 while s1's workload (and so its policies) is
    still unknown; returns what it got back before the connection closed, and after how long."""
    t = time.monotonic()
    try:
        s = connect_from(mesh.istiod_host, mesh.pods["s1"].ip4, 8080, timeout=5)
    except ConnectionRefusedError:
        return b"", time.monotonic() - t
    with s:
        s.sendall(b"early\n")
        s.settimeout(10)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while data := s.recv(100):
                got += data
    return got, time.monotonic() - t


def _echo(mesh: XdsMesh, port: int, msg: str = "hi") -> str:
    with connect_from(mesh.pods["c1"], mesh.pods["s1"].ip4, port, timeout=5) as s:
        s.sendall(f"{msg}\n".encode())
        return recv_line(s)


def test_readiness_waits_for_the_first_sync(bed: Bed) -> None:
    # (Rust app.rs: the task is named "state manager")
    for node in ("n1", "n2"):
        for status, body in (bed.before[node], bed.still[node]):
            pending = body.removeprefix("not ready, pending: ").rstrip("\n").split(", ")
            assert status == 500 and "state manager" in pending, (node, body)
        assert bed.after[node] == (200, "ready\n")
    assert bed.streams_before == 0
    istiod = bed.mesh.istiod
    streams = istiod.call(lambda: list(istiod.istiod.streams))
    for zt in bed.mesh.ztunnels.values():
        zt.wait_for(lambda r: r.get("message") == "xDS: initial sync complete")
    # Each stream authenticated with the token and announced its node.
    announced = set()
    for st in streams:
        assert st.header("authorization") == f"Bearer {TOKEN}"
        if (xds_node := st.node) is not None:
            announced.add(xds_node.metadata.fields["NODE_NAME"].string_value)
    assert announced == {"n1", "n2"}


def test_no_pod_is_taken_before_the_first_sync(bed: Bed) -> None:
    """Rust ``app.rs`` runs the in-pod manager only after the first xDS sync: until then
    ztunnel does not even connect to the node agent, so no pod is served with a state that
    knows nothing (its policies unchecked, its mesh destinations passed through in
    plaintext). A client arriving then meets istio-cni's redirect with nobody listening."""
    assert bed.agents_before == {"n1": 0, "n2": 0}
    got, waited = bed.early
    assert got == b"", "proxied to the app without any authorization check"
    assert waited < 4.5, waited  # refused, not held


def test_hbone_with_certificates_from_the_ca(bed: Bed) -> None:
    mesh = bed.mesh
    assert _echo(mesh, 8080, "over-hbone") == "over-hbone"
    out = mesh.ztunnel_of("c1").wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "outbound"
            and r.get("dst.hbone_addr") == f"{mesh.pods['s1'].ip4}:8080"
        )
    )
    assert out["src.identity"] == str(C1)
    assert out["dst.identity"] == str(S1)
    assert out["dst.addr"] == f"{mesh.pods['s1'].ip4}:15008"
    inbound = mesh.ztunnel_of("s1").wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and r.get("dst.hbone_addr") == f"{mesh.pods['s1'].ip4}:8080"
        )
    )
    assert inbound["src.identity"] == str(C1)
    # Both certificates came from istiod's CA, asked for by impersonation (shared mode).
    istiod = mesh.istiod
    csrs = istiod.call(lambda: list(istiod.istiod.csrs))
    signed = {c.signed for c in csrs}
    assert {C1, S1} <= signed
    for c in csrs:
        assert c.header("authorization") == f"Bearer {TOKEN}"
        assert c.request.metadata.fields["ImpersonatedIdentity"].string_value == str(c.signed)


def _closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def test_policy_pushed_mid_connection_closes_it(bed: Bed) -> None:
    mesh = bed.mesh
    istiod = mesh.istiod
    zt_s1 = mesh.ztunnel_of("s1")
    s = connect_from(mesh.pods["c1"], mesh.pods["s1"].ip4, 8081, timeout=5)
    # Another stream to the same destination, very likely on the same pooled HBONE connection.
    other = connect_from(mesh.pods["c1"], mesh.pods["s1"].ip4, 8080, timeout=5)
    with contextlib.closing(s), contextlib.closing(other):
        s.sendall(b"before\n")
        assert recv_line(s) == "before"
        other.sendall(b"other\n")
        assert recv_line(other) == "other"
        [policy] = load_local_config(
            """
policies:
- name: deny-8081
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [8081]
"""
        ).policies
        answers = istiod.answers(istiod.call(istiod.istiod.set_policies, policy))
        assert answers and all(a.is_ack for a in answers)
        assert _closed_by_peer(s), "the open connection must be closed by the new policy"
        other.sendall(b"unaffected\n")  # closing one stream leaves the others alone
        assert recv_line(other) == "unaffected"
    rec = zt_s1.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and r.get("error") == "connection closed due to policy change"
        )
    )
    assert rec["dst.hbone_addr"] == f"{mesh.pods['s1'].ip4}:8081"
    # New connections to that port are refused; other ports still work.
    with connect_from(mesh.pods["c1"], mesh.pods["s1"].ip4, 8081, timeout=5) as s2:
        s2.sendall(b"after\n")
        assert _closed_by_peer(s2)
    assert _echo(mesh, 8080) == "hi"
    # Removing the policy by xDS lets the port through again.
    answers = istiod.answers(istiod.call(istiod.istiod.remove_policies, "default/deny-8081"))
    assert answers and all(a.is_ack for a in answers)
    assert _echo(mesh, 8081, "again") == "again"
