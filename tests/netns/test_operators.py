"""Operators' tools against live ztunnels with live connections: ``istioctl ztunnel-config``'s view
of ``/config_dump`` for every subcommand, the metrics Istio's ztunnel Grafana dashboard reads, the
profiling endpoints of a loaded ztunnel, and ``ztunnel top --once``.

The bed is :func:`ztunnel.testing.xdsbed.xds_mesh`: two nodes, a shared-mode ztunnel on each fed
by a node agent, and every piece of configuration (workloads, a service, a policy, certificates)
from a fake istiod, as in a cluster. Client ``c1`` on n1 holds a connection open through the
service VIP to ``s1`` on n2 (HBONE), and an external host holds a plaintext one to ``s1``.
istioctl's decoding is checked twice: with the hand-written schema of its Go structs
(tests/golden/istioctl_schema.py) and with the Go stand-in (tests/golden/istioctl).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.golden import SUBCOMMANDS, istioctl, table
from tests.golden.istioctl_schema import decode
from ztunnel.state.localconfig import load_local_config
from ztunnel.testing.apps import connect_from, listen_in, recv_line, start_app
from ztunnel.testing.netns import External, Host, Pod
from ztunnel.testing.xdsbed import ISTIOD_PORT, MeshPod, XdsMesh, metric, xds_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(120),
]

PODS = (MeshPod("c1", "n1", "sa-c1"), MeshPod("s1", "n2", "sa-s1"))
VIP = "10.96.0.40"
CIDR_VIP = "10.97.0.0/24"
SVC = "s1.default.svc.cluster.local"
ECHO = 8080
ISTIO_VERSION = "1.28.1-ztunnel-py-test"
WDS = "type.googleapis.com/istio.workload.Address"
RBAC = "type.googleapis.com/istio.security.Authorization"


def extra_config(s1: Pod) -> str:
    return f"""services:
- name: s1
  namespace: default
  hostname: {SVC}
  vips: ["/{VIP}"]
  cidrVips: [{{network: "", cidr: {CIDR_VIP}}}]
  ports: {{80: {ECHO}}}
  visibility: Namespace
policies:
- name: deny-port-1
  namespace: default
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [1]
"""


@dataclass
class Live:
    mesh: XdsMesh
    c1: Pod
    s1: Pod
    ext: External
    hbone: socket.socket  # c1 -> VIP:80 -> s1:8080, open
    plain: socket.socket  # ext -> s1:8080 plaintext, open

    def admin(self, node: str, target: str, timeout: float = 30.0) -> tuple[int, bytes]:
        return get(self.mesh.nodes[node], 15000, target, timeout=timeout)

    def dump(self, node: str) -> bytes:
        status, body = self.admin(node, "/config_dump")
        assert status == 200, body
        return body


def get(where: Host, port: int, target: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """``GET`` from ``where``'s netns on 127.0.0.1: (status, body bytes)."""
    with connect_from(where, "127.0.0.1", port, timeout=timeout) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def hold(where: Host, ip: str, port: int) -> socket.socket:
    """A connection that echoed once and stays open."""
    s = connect_from(where, ip, port, timeout=10)
    s.sendall(b"hello\n")
    assert recv_line(s, timeout=10) == "hello"
    return s


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with xds_mesh(PODS, extra_env={"ISTIO_META_ISTIO_VERSION": ISTIO_VERSION}) as mesh:
        s1 = mesh.pods["s1"]
        extra = load_local_config(extra_config(s1), "operators.yaml")
        svc_key = f"default/{SVC}"
        mesh.istiod.call(
            mesh.istiod.istiod.set_addresses,
            mesh.workload("c1"),
            mesh.workload("s1", services={svc_key: {80: ECHO}}),
            *extra.services,
        )
        mesh.istiod.call(mesh.istiod.istiod.set_policies, *extra.policies)
        ext = mesh.tb.add_external("ext")
        start_app(s1, "echo", ports=(ECHO,))
        deadline = time.monotonic() + 20
        while True:  # until both ztunnels know the service
            dumps = [json.loads(get(mesh.nodes[n], 15000, "/config_dump")[1]) for n in mesh.nodes]
            if all(any(s["hostname"] == SVC for s in d["services"]) for d in dumps):
                break
            assert time.monotonic() < deadline, "the service never reached both ztunnels"
            time.sleep(0.1)
        hbone = hold(mesh.pods["c1"], VIP, 80)
        plain = hold(ext, s1.ip4, ECHO)
        try:
            yield Live(mesh, mesh.pods["c1"], s1, ext, hbone, plain)
        finally:
            hbone.close()
            plain.close()


# --------------------------------------------------------------------------------------------
# istioctl ztunnel-config, every subcommand, against the live dumps


def wait_connections(live: Live, node: str, want: int) -> dict[str, Any]:
    """The decoded dump once ``node``'s workloadState lists ``want`` connections."""
    deadline = time.monotonic() + 10
    while True:
        d = decode(json.loads(live.dump(node)))
        n = sum(
            len(st["connections"]["inbound"] or []) + len(st["connections"]["outbound"] or [])
            for st in d["workloadState"].values()
        )
        if n >= want or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_config_dump_decodes_as_istioctl_for_every_subcommand(live: Live) -> None:
    c1, s1, ext = live.c1, live.s1, live.ext
    c1_port = live.hbone.getsockname()[1]
    ext_port = live.plain.getsockname()[1]

    # The schema of istioctl's Go structs: every section decodes, with the expected values.
    d1 = wait_connections(live, "n1", 1)
    d2 = wait_connections(live, "n2", 2)
    assert d1["workloadState"].keys() == {"uid-c1"}  # keyed by the ZDS uid, as Rust
    st1 = d1["workloadState"]["uid-c1"]
    assert st1["state"] == "Up"
    assert st1["info"] == {
        "name": "c1",
        "namespace": "default",
        "trustDomain": "",
        "serviceAccount": "sa-c1",
    }
    assert st1["connections"]["inbound"] == []
    assert st1["connections"]["outbound"] == [
        {
            "src": f"{c1.ip4}:{c1_port}",
            "originalDst": f"{VIP}:80",
            "actualDst": f"{s1.ip4}:15008",
            "protocol": "HBONE",
        }
    ]
    st2 = d2["workloadState"]["uid-s1"]
    inbound = sorted(st2["connections"]["inbound"], key=lambda c: c["protocol"])
    # originalDst: the host the client's ztunnel named in Forwarded (Rust build_forwarded: the
    # intended service), none for plaintext.
    assert [(c["protocol"], c["actualDst"], c["originalDst"]) for c in inbound] == [
        ("HBONE", f"{s1.ip4}:{ECHO}", SVC),
        ("TCP", f"{s1.ip4}:{ECHO}", ""),
    ]
    assert inbound[0]["src"].startswith(f"{c1.ip4}:")  # the HBONE connection, from c1's netns
    assert inbound[1]["src"] == f"{ext.ip4}:{ext_port}"
    assert st2["connections"]["outbound"] == []
    for d in (d1, d2):
        assert sorted(w["name"] for w in d["workloads"]) == ["c1", "s1"]
        assert [s["hostname"] for s in d["services"]] == [SVC]
        # the two fields of Rust's Service that istioctl reads besides those (api.go)
        (svc,) = d["services"]
        assert svc["cidrVips"] == [{"cidr": CIDR_VIP, "network": ""}]
        assert svc["visibility"] == "Namespace"
        assert [(p["name"], p["action"], p["scope"]) for p in d["policies"]] == [
            ("deny-port-1", "Deny", "Namespace")
        ]

    # The Go stand-in for `istioctl ztunnel-config <sub> -f dump.json`: every subcommand decodes
    # and prints the expected rows.
    b1, b2 = live.dump("n1"), live.dump("n2")
    out1 = {sub: istioctl(sub, b1) for sub in SUBCOMMANDS}
    out2 = {sub: istioctl(sub, b2) for sub in SUBCOMMANDS}
    for sub, r in [*out1.items(), *out2.items()]:
        assert r.returncode == 0, (sub, r.stderr)
        assert r.stderr == "", (sub, r.stderr)
    # `istioctl ztunnel-config service -o json`: what it decoded, written back
    for body in (b1, b2):
        r = istioctl("service-json", body)
        assert r.returncode == 0, r.stderr
        (svc,) = json.loads(r.stdout)
        assert (svc["cidrVips"], svc["visibility"]) == ([f"/{CIDR_VIP}"], "Namespace")
    rows1 = {sub: table(r.stdout) for sub, r in out1.items()}
    rows2 = {sub: table(r.stdout) for sub, r in out2.items()}
    assert rows1["workload"] == [
        ["NAMESPACE", "POD", "NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"],
        ["default", "c1", f"{c1.ip4},{c1.ip6}", "n1", "None", "HBONE"],
        ["default", "s1", f"{s1.ip4},{s1.ip6}", "n2", "None", "HBONE"],
    ]
    assert rows1["service"][1:] == [["default", "s1", VIP, "None", "1/1"]]
    assert rows1["policy"][1:] == [["default", "deny-port-1", "Deny", "Namespace"]]
    assert rows1["connections"][1:] == [
        [
            "c1.default",
            "Outbound",
            f"c1.default:{c1_port}",
            "s1.default:15008",
            f"{SVC}:80",
            "HBONE",
        ]
    ]
    conns2 = sorted(rows2["connections"][1:], key=lambda r: r[-1])
    assert len(conns2) == 2
    assert conns2[0][:3] == ["s1.default", "Inbound", f"s1.default:{ECHO}"]
    assert re.fullmatch(r"c1\.default:\d+", conns2[0][3]) and conns2[0][4:] == [SVC, "HBONE"]
    assert conns2[1] == [
        "s1.default",
        "Inbound",
        f"s1.default:{ECHO}",
        f"{ext.ip4}:{ext_port}",
        "TCP",
    ]

    # Certificates: the leaf istiod issued for c1, with its serial in hex as istioctl prints it.
    certs = [
        r for r in rows1["certificate"][1:] if r[0] == "spiffe://cluster.local/ns/default/sa/sa-c1"
    ]
    assert certs[0][1:4] == ["Leaf", "Available", "true"]
    assert certs[-1][1] == "Root"
    entry = next(c for c in d1["certificates"] if c["identity"].endswith("/sa/sa-c1"))
    leaf = x509.load_pem_x509_certificate(base64.b64decode(entry["certChain"][0]["pem"]))
    assert certs[0][4] == format(leaf.serial_number, "x")
    assert leaf.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ") == certs[0][5]

    # `all` is the five summaries, in order.
    for rows in (rows1, rows2):
        assert rows["all"] == [
            *rows["workload"],
            *rows["service"],
            *rows["policy"],
            *rows["certificate"],
            *rows["connections"],
        ]


# --------------------------------------------------------------------------------------------
# the dashboard's metrics

# Every metric Istio's ztunnel dashboard queries (istio/istio
# manifests/addons/dashboards/ztunnel-dashboard.gen.json, from ztunnel.libsonnet), with the
# labels it uses beyond the scrape's own (pod, app) and the labels Rust gives each series.
# container_memory_working_set_bytes and container_cpu_usage_seconds_total come from cAdvisor,
# not from ztunnel.
TRAFFIC_LABELS = [
    "reporter",
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "destination_service",
    "destination_service_namespace",
    "destination_service_name",
    "destination_workload",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
]
DASHBOARD: dict[str, list[str] | None] = {
    "istio_tcp_connections_opened_total": TRAFFIC_LABELS,
    "istio_tcp_connections_closed_total": TRAFFIC_LABELS,
    "istio_tcp_received_bytes_total": TRAFFIC_LABELS,
    "istio_tcp_sent_bytes_total": TRAFFIC_LABELS,
    "istio_tcp_sockets_open": ["reporter"],
    "process_open_fds": [],
    "istio_xds_connection_terminations_total": ["reason"],
    "istio_xds_message_total": ["url"],
    "workload_manager_active_proxy_count": [],
    "workload_manager_pending_proxy_count": [],
    "istio_build": ["component", "tag"],
    # The DNS proxy's (the DNS issue); checked below only where this build has one.
    "istio_dns_requests_total": None,
}
SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def series_of(text: str) -> dict[str, list[tuple[list[str], dict[str, str], float]]]:
    out: dict[str, list[tuple[list[str], dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = SERIES.match(line)
        if m is None:
            continue
        pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")
        out.setdefault(m.group(1), []).append(
            ([k for k, _ in pairs], dict(pairs), float(m.group(3)))
        )
    return out


def scrape(live: Live, node: str) -> str:
    status, body = get(live.mesh.nodes[node], 15020, "/metrics")
    assert status == 200
    return body.decode()


def test_every_dashboard_metric_is_exported_with_rusts_labels(live: Live) -> None:
    # Traffic that completes, so opened and closed both have series on both sides.
    with hold(live.c1, VIP, 80):
        pass
    # One xDS stream ends (istiod restarts), so terminations have a series.
    before = series_of(scrape(live, "n1")).get("istio_xds_connection_terminations_total", [])
    mesh = live.mesh
    mesh.istiod.run(mesh.istiod.istiod.stop)
    mesh.istiod.start(listen_in(mesh.istiod_host, ISTIOD_PORT, host="0.0.0.0"))
    deadline = time.monotonic() + 20
    while True:
        got = series_of(scrape(live, "n1")).get("istio_xds_connection_terminations_total", [])
        if sum(v for *_, v in got) > sum(v for *_, v in before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    has_dns = os.path.isdir(Path(__file__).parents[2] / "ztunnel" / "dns")
    for node in ("n1", "n2"):
        text = scrape(live, node)
        series = series_of(text)
        for name, labels in DASHBOARD.items():
            if labels is None:
                # Until the DNS proxy lands this build has no DNS metrics; then it must (declared
                # at least: a series appears with the first DNS request).
                # (OpenMetrics declares a counter family without its _total)
                declared = name in series or f"# TYPE {name.removesuffix('_total')} " in text
                assert declared == has_dns, (name, has_dns)
                continue
            assert name in series, f"{node}: {name} not exported"
            for names, _, _ in series[name]:
                # Rust appends the locality labels to traffic series where a workload is known.
                assert names[: len(labels)] == labels, (name, names)
        build = series["istio_build"]
        assert [(lb, v) for _, lb, v in build] == [
            ({"component": "ztunnel", "tag": ISTIO_VERSION}, 1.0)
        ]
        assert {lb["url"] for _, lb, _ in series["istio_xds_message_total"]} >= {WDS, RBAC}
        assert metric(text, "istio_xds_message_bytes_total", url=WDS) > 0
        reasons = {lb["reason"] for _, lb, _ in series["istio_xds_connection_terminations_total"]}
        assert reasons and reasons <= {"ConnectionError", "Error", "Reconnect", "Complete"}
        assert metric(text, "workload_manager_active_proxy_count") == 1
        assert metric(text, "istio_tcp_sockets_open", reporter="destination") >= 0
        # Beyond Rust: seconds to expiry of the node's workload certificate.
        pod = "sa-c1" if node == "n1" else "sa-s1"
        left = metric(
            text,
            "istio_workload_cert_expiry_seconds",
            identity=f"spiffe://cluster.local/ns/default/sa/{pod}",
        )
        assert 0 < left <= 24 * 3600 + 60
    # ISTIO_META_ISTIO_VERSION reached istiod as node metadata.
    nodes = [s.node for s in live.mesh.istiod.istiod.streams if s.node is not None]
    assert nodes and all(
        n.metadata.fields["ISTIO_VERSION"].string_value == ISTIO_VERSION for n in nodes
    )


# --------------------------------------------------------------------------------------------
# profiling a loaded ztunnel


@contextlib.contextmanager
def load(live: Live) -> Iterator[list[int]]:
    """New connections c1 -> VIP:80 in a loop (HBONE on both ztunnels) until the block ends."""
    stop = threading.Event()
    done = [0]

    def run() -> None:
        while not stop.is_set():
            with connect_from(live.c1, VIP, 80, timeout=10) as s:
                s.sendall(b"x" * 1000 + b"\n")
                recv_line(s, timeout=10, limit=2000)
            done[0] += 1

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield done
    finally:
        stop.set()
        t.join(30)


def go_pprof_top(profile: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".pb.gz") as f:
        f.write(profile)
        f.flush()
        r = subprocess.run(
            ["go", "tool", "pprof", "-top", "-nodecount=200", *flags, f.name],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "PPROF_TMPDIR": tempfile.gettempdir(),
                "HOME": tempfile.gettempdir(),
            },
        )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_profiles_of_a_loaded_ztunnel(live: Live) -> None:
    with load(live) as done:
        status, body = live.admin("n1", "/debug/pprof/profile?seconds=2&frequency=200")
        assert status == 200, body
        status, folded = live.admin("n1", "/debug/pprof/profile?seconds=1&format=collapsed")
        assert status == 200, folded
        status, heap = live.admin("n2", "/debug/pprof/heap?seconds=1")
        assert status == 200, heap
    assert done[0] > 10
    # go tool pprof (an independent decoder) reads the profile: CPU in nanoseconds, and the
    # busy stacks are ztunnel's own data path.
    top = go_pprof_top(body)
    assert "Type: cpu" in top, top
    assert re.search(r"Duration: 2(\.\d+)?s", top), top
    assert "_read_and_dispatch" in top or "handle" in top, top  # HBONE / listener frames
    files = go_pprof_top(body, "-files")
    assert re.search(r"ztunnel/(proxy|hbone|net)/\w+\.py", files), files
    lines = folded.decode().splitlines()
    assert lines and all(re.fullmatch(r".+ \d+", ln) for ln in lines)
    assert any("ztunnel/" in ln for ln in lines)
    text = heap.decode()
    assert text.startswith("tracemalloc: ")
    assert re.search(r"^\d+ bytes in \d+ blocks$", text, re.M), text[:500]
    # Bad parameters, and tracing is off again after a one-shot heap request.
    assert live.admin("n1", "/debug/pprof/profile?seconds=0")[0] == 400
    assert live.admin("n1", "/debug/pprof/profile?frequency=5000")[0] == 400
    assert live.admin("n2", "/debug/pprof/heap/profiling") == (
        200,
        b"heap profiling active: false\n",
    )


# --------------------------------------------------------------------------------------------
# ztunnel top


def test_ztunnel_top_once_lists_the_live_connections(live: Live) -> None:
    c1_port = live.hbone.getsockname()[1]
    node = live.mesh.nodes["n2"]
    r = node.run(
        sys.executable,
        "-m",
        "ztunnel",
        "top",
        "--once",
        "--admin",
        "127.0.0.1:15000",
        check=False,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["DIRECTION", "PROXY", "SOURCE", "DESTINATION"], r.stdout
    body = [ln for ln in lines[1:] if ln.strip()]
    assert any(
        "inbound" in ln and "spiffe://cluster.local/ns/default/sa/sa-c1" in ln and "HBONE" in ln
        for ln in body
    ), r.stdout
    assert any("inbound" in ln and live.ext.ip4 in ln and "TCP" in ln for ln in body), r.stdout
    # Filtered and as JSON, for scripts.
    r = live.mesh.nodes["n1"].run(
        sys.executable,
        "-m",
        "ztunnel",
        "top",
        "--once",
        "--json",
        "--filter",
        "sa-s1",
        check=False,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["direction"], x["src"], x["dstIdentity"]) for x in rows] == [
        ("outbound", f"{live.c1.ip4}:{c1_port}", "spiffe://cluster.local/ns/default/sa/sa-s1")
    ]


def test_ztunnel_top_live_in_tmux(live: Live) -> None:
    """The terminal UI itself, in a real terminal (tmux): it refreshes with rates, ``s`` cycles
    the sort, ``/`` filters, ``q`` quits."""
    node = live.mesh.nodes["n2"]
    session = f"ztunnel-top-{os.getpid()}"
    cmd = f"ip netns exec {node.ns} {sys.executable} -m ztunnel top --admin 127.0.0.1:15000"

    def tmux(*args: str) -> str:
        r = subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def screen_with(text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = tmux("capture-pane", "-p", "-t", session)
            if text in screen or time.monotonic() > deadline:
                return screen
            time.sleep(0.2)

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "320", "-y", "20", cmd],
        check=True,
        timeout=10,
        env=env,
    )
    try:
        screen = screen_with("sort=age")
        assert "ztunnel top - 127.0.0.1:15000" in screen, screen
        assert "2 connections (2 in, 0 out)" in screen, screen
        assert "spiffe://cluster.local/ns/default/sa/sa-c1" in screen, screen
        # A second refresh has rates (B/s) where the first had "-".
        live.hbone.sendall(b"more\n")
        assert recv_line(live.hbone, timeout=10) == "more"
        time.sleep(2.5)
        rows = [
            ln for ln in tmux("capture-pane", "-p", "-t", session).splitlines() if "inbound" in ln
        ]
        assert rows and not any(re.search(r" -\s+-$", ln.rstrip()) for ln in rows), rows
        tmux("send-keys", "-t", session, "s")
        assert "sort=rate" in screen_with("sort=rate")
        tmux("send-keys", "-t", session, "/", live.ext.ip4, "Enter")
        screen = screen_with("filter=")
        assert "1 shown" in screen and "sa-c1" not in screen, screen
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while (
            subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode
            == 0
        ):
            assert time.monotonic() < deadline, "q did not quit"
            time.sleep(0.1)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_pending_pod_in_workload_state(live: Live) -> None:
    """A pod whose proxy cannot start yet (its 15001 is taken) is ``Pending`` with no
    connections, as Rust's ``ProxyState`` serializes it, and istioctl still decodes the dump.
    (Last in this module: the pod is removed again.)"""
    from ztunnel.inpod.protocol import WorkloadInfo

    agent = live.mesh.agents["n1"]
    pod = live.mesh.nodes["n1"].add_pod("p1")
    blocker = listen_in(pod, 15001)
    try:
        info = WorkloadInfo(name="p1", namespace="default", service_account="sa-p1")
        ex = agent.add_pod("uid-p1", info, pod)
        assert ex.nacked, ex
        body = live.dump("n1")
        state = json.loads(body)["workloadState"]
        assert state["uid-p1"] == {
            "state": "Pending",
            "info": {"name": "p1", "namespace": "default", "serviceAccount": "sa-p1"},
        }
        assert state["uid-c1"]["state"] == "Up"
        assert decode(json.loads(body))["workloadState"]["uid-p1"]["state"] == "Pending"
        r = istioctl("connections", body)
        assert r.returncode == 0, r.stderr
        metrics = scrape(live, "n1")
        assert metric(metrics, "workload_manager_pending_proxy_count") == 1
    finally:
        agent.del_pod("uid-p1")
        blocker.close()
