"""ztunnel's self-proxy (istio/ztunnel#1507, Rust proxyfactory.rs
``create_ztunnel_self_proxy_listener``): in shared mode, with POD_NAME, POD_NAMESPACE and
SERVICE_ACCOUNT set, an inbound HBONE listener on 15008 in ztunnel's own netns (here the node's)
serves ztunnel's own workload, so a mesh client such as an in-mesh Prometheus scrapes ztunnel's
15020 over mTLS, under ztunnel's authorization policies. It serves only after the first xDS
sync, and with one or two data-plane workers."""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.testing.apps import connect_from, listen_in
from ztunnel.testing.fakeistiod import ISTIOD_SAN
from ztunnel.testing.hbone import workload_yaml
from ztunnel.testing.netns import Host, Node, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import Record, ZtunnelProcess
from ztunnel.testing.xdsbed import ISTIOD_PORT, TOKEN, IstiodThread, http_get, metric

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root"), pytest.mark.timeout(120)]

ZTUNNEL = "ztunnel-n1"  # the node ztunnel's pod, in istio-system, service account "ztunnel"
ZTUNNEL_ID = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
SA = "spiffe://cluster.local/ns/default/sa"
DOWNWARD_API = {"POD_NAME": ZTUNNEL, "POD_NAMESPACE": "istio-system", "SERVICE_ACCOUNT": "ztunnel"}


def ztunnel_workload_yaml(node: Node, **extra: str) -> str:
    lines = [
        f"- uid: cluster1//v1/Pod/istio-system/{ZTUNNEL}",
        f"  name: {ZTUNNEL}",
        "  namespace: istio-system",
        "  serviceAccount: ztunnel",
        "  trustDomain: cluster.local",
        f'  workloadIps: ["{node.ip4}"]',
        "  protocol: HBONE",
        f"  node: {node.name}",
        *(f"  {k}: {v}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


POLICY = """policies:
- name: deny-c2
  namespace: istio-system
  scope: WorkloadSelector
  action: Deny
  rules:
  - - - serviceAccounts: [{namespace: default, serviceAccount: sa-c2}]
"""


@dataclass
class Cluster:
    n1: Node  # the scraped ztunnel's node (no pods of its own)
    c1: Pod  # on n2: allowed
    c2: Pod  # on n2: denied by ztunnel's policy
    z1: ZtunnelProcess
    z2: ZtunnelProcess


@contextlib.contextmanager
def cluster(workers: str) -> Iterator[Cluster]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        c1, c2 = n2.add_pod("c1"), n2.add_pod("c2")
        cfg = (
            "workloads:\n"
            + ztunnel_workload_yaml(n1, authorizationPolicies='["istio-system/deny-c2"]')
            + workload_yaml(c1, "sa-c1")
            + workload_yaml(c2, "sa-c2")
            + POLICY
        )
        agents = {n: FakeNodeAgent(os.path.join(tmp, f"{n}.sock")).start() for n in ("n1", "n2")}
        for pod in (c1, c2):
            info = WorkloadInfo(
                name=pod.name, namespace="default", service_account=f"sa-{pod.name}"
            )
            agents["n2"].put_pod(f"uid-{pod.name}", info, pod)
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": cfg,
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
            "ZTUNNEL_WORKER_THREADS": workers,
            "CONNECTION_TERMINATION_DEADLINE": "2s",
        }
        zts: list[ZtunnelProcess] = []
        try:
            for node, extra in ((n1, DOWNWARD_API), (n2, {})):
                env_node = {**env, **extra, "NODE_NAME": node.name}
                env_node["INPOD_UDS"] = agents[node.name].path
                zts.append(ZtunnelProcess(node, env_node).start())
            for agent in agents.values():
                agent.wait_for_snapshot()
            yield Cluster(n1, c1, c2, *zts)
        finally:
            codes = [(zt.stop(), zt.internal_errors()) for zt in zts]
            for agent in agents.values():
                agent.close()
        for rc, errors in codes:
            assert rc == 0, errors


def access(zt: ZtunnelProcess, start: int, **fields: str) -> Record:
    return zt.wait_for(
        lambda r: (
            r.get("scope") == "access"
            and r.get("message") == "connection complete"
            and all(r.get(k) == v for k, v in fields.items())
        ),
        start=start,
    )


def raw_get(where: Host, ip: str, port: int, target: str) -> bytes:
    """A GET's whole answer, or b"" when the connection is closed without one."""
    with connect_from(where, ip, port, timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
        return got


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_mesh_pod_on_another_node_scrapes_ztunnel_over_hbone(workers: str) -> None:
    """Rust test_hbone_metrics_access: the client's ztunnel sends it over HBONE to the node
    ztunnel's 15008 (ztunnel's workload is an HBONE workload), whose self-proxy terminates it
    as ztunnel's own identity and connects to its metrics server; the access log and the
    metrics count it as an inbound connection to ztunnel's workload. A Deny policy on that
    workload refuses another client."""
    with cluster(workers) as cl:
        listening = cl.n1.run("ss", "-Hltn", "sport = :15008").stdout
        assert ":15008" in listening, "no self-proxy listener in ztunnel's netns"
        for port in (15001, 15006):  # an inbound HBONE listener only
            assert not cl.n1.run("ss", "-Hltn", f"sport = :{port}").stdout.strip()
        n1, n2 = len(cl.z1.records), len(cl.z2.records)
        status, body = http_get(cl.c1, 15020, "/stats/prometheus", ip=cl.n1.ip4, timeout=10)
        assert status == 200 and "# TYPE istio_build" in body, body[:200]
        out = access(cl.z2, n2, direction="outbound")
        assert out["dst.addr"] == f"{cl.n1.ip4}:15008"
        assert out["dst.hbone_addr"] == f"{cl.n1.ip4}:15020"
        assert out["dst.identity"] == ZTUNNEL_ID
        inbound = access(cl.z1, n1, direction="inbound")
        assert inbound["src.identity"] == f"{SA}/sa-c1"
        assert inbound["src.workload"] == "c1"
        assert inbound["dst.workload"] == ZTUNNEL and inbound["dst.identity"] == ZTUNNEL_ID
        # counted as ztunnel's own inbound (scraped through the self-proxy again)
        _, body = http_get(cl.c1, 15020, "/stats/prometheus", ip=cl.n1.ip4, timeout=10)
        opened = metric(
            body,
            "istio_tcp_connections_opened_total",
            reporter="destination",
            destination_principal=ZTUNNEL_ID,
            source_principal=f"{SA}/sa-c1",
        )
        assert opened >= 1, opened

        # the Deny policy on ztunnel's workload: c2's CONNECT is refused (401) at the self-proxy
        n1 = len(cl.z1.records)
        assert raw_get(cl.c2, cl.n1.ip4, 15020, "/stats/prometheus") == b""
        denied = access(cl.z1, n1, direction="inbound", **{"src.identity": f"{SA}/sa-c2"})
        assert "deny-c2" in str(denied.get("error")), denied
        assert denied["dst.workload"] == ZTUNNEL


def test_no_self_proxy_without_the_downward_api_variables() -> None:
    """Rust create_ztunnel_self_proxy_listener: None unless ztunnel_identity and
    ztunnel_workload are both known (POD_NAMESPACE, SERVICE_ACCOUNT, POD_NAME)."""
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1 = tb.add_node("n1")
        agent = FakeNodeAgent(os.path.join(tmp, "n1.sock")).start()
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": "workloads:\n" + ztunnel_workload_yaml(n1),
            "NODE_NAME": "n1",
            "INPOD_UDS": agent.path,
            "POD_NAME": ZTUNNEL,
            "POD_NAMESPACE": "istio-system",  # (no SERVICE_ACCOUNT)
        }
        zt = ZtunnelProcess(n1, env).start()
        try:
            agent.wait_for_snapshot()
            assert not n1.run("ss", "-Hltn", "sport = :15008").stdout.strip()
        finally:
            rc = zt.stop()
            agent.close()
        assert rc == 0, zt.internal_errors()


def _first_answer_after_connect(host: Host, ip: str, timeout: float) -> float:
    """Connect to ip:15008 (retrying until it is bound) and send a TLS ClientHello: the seconds
    from the connect to the server's first byte (a ServerHello: accepted and served)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = outgoing.read()
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = connect_from(host, ip, 15008, timeout=timeout)
        except ConnectionRefusedError:  # not bound yet
            assert time.monotonic() < deadline, "ztunnel never listened on 15008"
            time.sleep(0.05)
            continue
        with s:
            connected = time.monotonic()
            s.sendall(hello)
            assert s.recv(1) == b"\x16"  # a TLS handshake record
            return time.monotonic() - connected


def test_served_only_after_the_first_xds_sync() -> None:
    """Rust app.rs: the self-proxy's task waits for xds_rx.changed() before it runs. istiod
    answers 5 s late: a connection to ztunnel's 15008 made meanwhile (the listener is bound at
    start, so the kernel completes it) is served only then."""
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        host = tb.add_external("istiod")
        sock = listen_in(host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=True, server_names=(ISTIOD_SAN, host.ip4), accept_tokens=[TOKEN])
        agent = FakeNodeAgent(os.path.join(tmp, "n1.sock")).start()
        zt: ZtunnelProcess | None = None
        try:
            istiod.call(
                istiod.istiod.set_addresses,
                Workload(
                    uid=f"cluster1//v1/Pod/istio-system/{ZTUNNEL}",
                    name=ZTUNNEL,
                    namespace="istio-system",
                    addresses=(parse_ip(n1.ip4),),
                    protocol=TunnelProtocol.HBONE,
                    service_account="ztunnel",
                    node="n1",
                ),
            )
            istiod.istiod.response_delay = 5.0
            istiod.start(sock)
            root = istiod.istiod.root_pem
            address = f"https://{host.ip4}:{ISTIOD_PORT}"
            zt = ZtunnelProcess(
                n1,
                {
                    **DOWNWARD_API,
                    "PROXY_MODE": "shared",
                    "NODE_NAME": "n1",
                    "INPOD_UDS": agent.path,
                    "XDS_ADDRESS": address,
                    "XDS_ROOT_CA": root,
                    "AUTH_TOKEN": TOKEN,
                    "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
                },
            )
            started = threading.Thread(target=zt.start, kwargs={"timeout": 40}, daemon=True)
            started.start()
            waited = _first_answer_after_connect(n2, n1.ip4, timeout=30)
            started.join(40)
            assert waited >= 2.5, f"served {waited:.2f}s after the connect, before the sync"
            zt.wait_for(lambda r: r.get("message") == "xDS: initial sync complete")
        finally:
            rc = zt.stop() if zt is not None else 0
            errors = zt.internal_errors() if zt is not None else []
            agent.close()
            istiod.close()
            sock.close()
        assert rc == 0, errors
