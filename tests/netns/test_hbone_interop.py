"""HBONE interop with an independent HTTP/2 implementation: Node.js's built-in ``http2`` module.

* Node as the HBONE **client** (``interop/hbone_client.js``, on an external host): mTLS 1.3 with
  a certificate from the shared local CA, ALPN h2, ``CONNECT`` with ``:authority = podIP:port``
  to ztunnel-b's 15008, data both ways with half-close, checksums on both ends.
* Node as a busy legal client (``interop/hbone_churn.js``): up to the advertised 200 streams open
  at once, each replaced as soon as it closes; none may be refused.
* Node as the HBONE **server** (``interop/hbone_server.js``, in pod e on 15008 where a ztunnel
  would be): ztunnel-a tunnels pod a's app traffic to it; it checks what ztunnel sends (only
  ``:method``/``:authority`` pseudo-headers, the SPIFFE client certificate, TLS 1.3, h2, the
  baggage/forwarded/traceparent headers) and pipes the stream to the app in pod e.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ztunnel.core.identity import Identity
from ztunnel.testing.apps import (
    Digest,
    connect_from,
    echo_roundtrip,
    recv_digest,
    recv_line,
    send_payload,
    start_app,
)
from ztunnel.testing.hbone import (
    TRUST_DOMAIN,
    CertFiles,
    Mesh,
    PodSpec,
    mesh,
    no_leaks,
    write_cert_files,
)
from ztunnel.testing.netns import Host, NsProcess, Pod
from ztunnel.testing.proc import Record, ZtunnelProcess

from .nodehbone import INTEROP, event, node_binary, start_server

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(60),
]

NODE_CLIENT = Identity(TRUST_DOMAIN, "default", "node-client")
SA_B = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-b"
SA_A = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-a"
SA_E = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/sa-e"
REFUSED_ONCE = 9316  # the node server refuses the first stream to pod e on this port


@pytest.fixture(scope="module")
def node() -> str:
    return node_binary()


@dataclass
class Bed:
    m: Mesh
    node: str
    client_files: CertFiles  # node client: identity node-client
    server: NsProcess  # node server in pod e

    @property
    def ext(self) -> Host:
        assert self.m.ext is not None
        return self.m.ext

    @property
    def e(self) -> Pod:
        return self.m.pods["e"]


@pytest.fixture(scope="module")
def bed(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    certs = tmp_path_factory.mktemp("interop-certs")
    # Pod e is a mesh workload (sa-e) whose 15008 is served by node instead of a ztunnel.
    extra = [PodSpec("e", "n2", service_account="sa-e", ztunnel=None, inpod_rules=False)]
    with mesh(
        extra_env={"POOL_UNUSED_RELEASE_TIMEOUT": "200ms"}, extra_pods=extra, external=True
    ) as m:
        client_files = write_cert_files(m.ca.issue(NODE_CLIENT), certs, "node-client")
        e = m.pods["e"]
        server = start_server(e, m.ca, "sa-e", certs, refuseOnce=[f"{e.ip4}:{REFUSED_ONCE}"])
        # Warm up: both ztunnels fetch their certificates (and start renewal timers) now, so
        # the per-test baselines are steady.
        echo = start_app(m.b, "echo", ports=(9300,))
        assert echo_roundtrip(m.a, m.b.ip4, 9300) == b"hello\n"
        echo.stop()
        yield Bed(m, node, client_files, server)
        server.stop()


def node_client(
    b: Bed, host: str, authority: str, *, send: int, after_end: bool = False
) -> dict[str, Any]:
    """Run the node HBONE client on the external host; return its JSON result."""
    cfg = {
        "host": host,
        "port": 15008,
        "authority": authority,
        "cert": str(b.client_files.cert),
        "key": str(b.client_files.key),
        "ca": str(b.client_files.ca),
        "expectSan": SA_B,
        "sendBytes": send,
        "sendAfterEnd": after_end,
    }
    proc = b.ext.run(b.node, str(INTEROP / "hbone_client.js"), json.dumps(cfg), check=False)
    lines = [ln for ln in proc.stdout.split("\n") if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout, proc.stderr)
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def server_event(b: Bed, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The next JSON line from the node server matching ``pred``."""
    return event(b.server, pred)


def inbound_complete(zt: ZtunnelProcess, since: int, authority: str) -> Record:
    return zt.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("direction") == "inbound"
            and r.get("dst.hbone_addr") == authority
        ),
        start=since,
    )


def authority(ip: str, port: int) -> str:
    return f"{host_part(ip)}:{port}"


def host_part(ip: str) -> str:
    """How an IP is written before ``:port`` (brackets for IPv6)."""
    return f"[{ip}]" if ":" in ip else ip


# --- node client -> ztunnel ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["ip4", "ip6"])
def test_node_client_to_ztunnel_client_closes_first(bed: Bed, family: str) -> None:
    """node sends 3 MiB and half-closes; the sink app answers with its count and digest after
    the FIN; node gets that and END_STREAM."""
    b = bed.m.b
    ip = getattr(b, family)
    port = 9301 if family == "ip4" else 9302
    sink = start_app(b, "sink", ports=(port,))
    since = len(bed.m.ztb.records)
    with no_leaks(bed.m.ztb):
        out = node_client(bed, ip, authority(ip, port), send=3 << 20)
    sink.stop()
    assert out["status"] == 200, out
    assert (out["alpn"], out["tls"]) == ("h2", "TLSv1.3")
    assert f"URI:{SA_B}" in out["serverSan"]
    head = bytes.fromhex(out["received"]["headHex"]).decode()
    assert head == f"{out['sent']['count']} {out['sent']['sha256']}\n"
    assert out["rstCode"] == 0  # both ends closed with END_STREAM, no reset
    rec = inbound_complete(bed.m.ztb, since, authority(ip, port))
    assert rec["src.identity"] == str(NODE_CLIENT)
    assert rec["src.addr"].startswith(host_part(getattr(bed.ext, family)) + ":")
    assert rec["bytes_recv"] == 3 << 20
    assert "error" not in rec


def test_node_client_to_ztunnel_server_closes_first(bed: Bed) -> None:
    """The source app sends 2 MiB and FIN first; node reads to END_STREAM, then sends 1 MiB
    and half-closes; the app reports what it got."""
    b = bed.m.b
    source = start_app(b, "source", "--bytes", str(2 << 20), "--seed", "11", ports=(9303,))
    with no_leaks(bed.m.ztb):
        out = node_client(bed, b.ip4, f"{b.ip4}:9303", send=1 << 20, after_end=True)
    assert out["status"] == 200, out
    got = Digest(out["received"]["count"], out["received"]["sha256"])
    assert got == Digest.of_payload(2 << 20, seed=11)
    received = source.wait_for_line("RECEIVED", timeout=10).split()
    assert received[1:3] == [str(out["sent"]["count"]), out["sent"]["sha256"]]
    assert received[3] == bed.ext.ip4  # the app saw the real client address
    source.stop()


def test_node_client_gets_ztunnel_status_codes(bed: Bed) -> None:
    """Error statuses reach a foreign client as plain HTTP/2 responses."""
    b = bed.m.b
    with no_leaks(bed.m.ztb):
        assert node_client(bed, b.ip4, f"{b.ip4}:9999", send=0)["status"] == 503
        assert node_client(bed, b.ip4, f"{bed.m.a.ip4}:9999", send=0)["status"] == 400
        assert node_client(bed, b.ip4, f"{b.ip4}:15008", send=0)["status"] == 503


def test_node_client_churning_at_the_stream_limit_is_never_refused(bed: Bed) -> None:
    """A legal client that keeps up to the advertised 200 streams open and opens the next as
    soon as one closes gets none refused: only open and half-closed streams count against
    SETTINGS_MAX_CONCURRENT_STREAMS (RFC 9113 5.1.2; Rust's h2 ``Counts`` frees the slot when
    the stream closes), whatever work the server still does for closed ones."""
    b = bed.m.b
    echo = start_app(b, "echo", ports=(9305,))
    total = 3000
    cfg = {
        "host": b.ip4,
        "port": 15008,
        "authority": f"{b.ip4}:9305",
        "cert": str(bed.client_files.cert),
        "key": str(bed.client_files.key),
        "ca": str(bed.client_files.ca),
        "concurrency": 200,
        "total": total,
        "timeoutSeconds": 50,
    }
    with no_leaks(bed.m.ztb):
        proc = bed.ext.run(bed.node, str(INTEROP / "hbone_churn.js"), json.dumps(cfg), check=False)
    echo.stop()
    lines = [ln for ln in proc.stdout.split("\n") if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout, proc.stderr)
    out = json.loads(lines[-1])
    print(f"[churn] {out}")
    assert out["remoteMaxStreams"] == 200
    assert out["maxOpen"] == 200
    assert (out["refused"], out["resets"], out["statuses"], out["badEcho"]) == (0, {}, {}, 0), out
    assert out["ok"] == total


# --- ztunnel -> node server ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["ip4", "ip6"])
def test_ztunnel_client_to_node_server(bed: Bed, family: str) -> None:
    """Pod a's app -> ztunnel-a -> HBONE -> node (pod e) -> sink app: 4 MiB, half-close,
    digest back; then the other way round with the source app closing first."""
    e, a = bed.e, bed.m.a
    ip = getattr(e, family)
    sink_port, source_port = (9311, 9312) if family == "ip4" else (9313, 9314)
    sink = start_app(e, "sink", ports=(sink_port,))
    source = start_app(e, "source", "--bytes", str(3 << 20), "--seed", "21", ports=(source_port,))
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta):
        with connect_from(a, ip, sink_port, timeout=20) as s:
            sent = send_payload(s, 4 << 20, seed=13)
            s.shutdown(1)  # SHUT_WR
            assert Digest.parse(recv_line(s, timeout=20)) == sent
            assert s.recv(1) == b""
        with connect_from(a, ip, source_port, timeout=20) as s:
            assert recv_digest(s, timeout=20) == Digest.of_payload(3 << 20, seed=21)
            back = send_payload(s, 1 << 20, seed=22)
            s.shutdown(1)
            line = source.wait_for_line("RECEIVED", timeout=10).split()
            assert Digest(int(line[1]), line[2]) == back
    sink.stop()
    source.stop()

    req = server_event(
        bed, lambda ev: ev["event"] == "request" and ev["authority"] == authority(ip, sink_port)
    )
    assert req["method"] == "CONNECT"
    assert req["scheme"] is None and req["path"] is None  # only :method and :authority
    assert (req["alpn"], req["tls"]) == ("h2", "TLSv1.3")
    assert f"URI:{SA_A}" in req["clientSan"]
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]", req["traceparent"])
    a_ip = getattr(a, family)
    assert re.fullmatch(rf'for="{re.escape(host_part(a_ip))}:\d+"', req["forwarded"])
    # Rust Workload::baggage: the source workload's own fields only; it has no clusterId, so
    # no k8s.cluster.name (not ztunnel's CLUSTER_ID instead).
    assert req["baggage"] == "k8s.namespace.name=default,k8s..name=a-deploy,service.name=a-app"
    closed = server_event(
        bed, lambda ev: ev["event"] == "closed" and ev["authority"] == authority(ip, sink_port)
    )
    assert (closed["up"], closed["rstCode"]) == (4 << 20, 0)

    out = bed.m.zta.wait_for(
        lambda r: (
            r.get("message") == "connection complete"
            and r.get("dst.hbone_addr") == authority(ip, sink_port)
        ),
        start=since,
    )
    assert out["dst.addr"] == authority(ip, 15008)
    assert out["dst.identity"] == SA_E
    assert out["bytes_sent"] == 4 << 20
    assert "error" not in out


def test_ztunnel_client_to_node_server_refused(bed: Bed) -> None:
    """node answers 503 for an app port that refuses: ztunnel-a logs it and closes the app's
    connection."""
    e, a = bed.e, bed.m.a
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta), connect_from(a, e.ip4, 9999) as s:
        s.settimeout(5)
        assert s.recv(1) == b""
    rec = bed.m.zta.wait_for(
        lambda r: r.get("message") == "connection complete" and "status 503" in str(r.get("error")),
        start=since,
    )
    assert rec["dst.hbone_addr"] == f"{e.ip4}:9999"


def test_ztunnel_client_retries_a_refused_stream_on_another_connection(bed: Bed) -> None:
    """node resets the first CONNECT to e:9316 with REFUSED_STREAM (nothing was processed, RFC
    9113 8.7): ztunnel-a tries it again on another HBONE connection, and the app's TCP
    connection goes through as if nothing happened."""
    e, a = bed.e, bed.m.a
    target = f"{e.ip4}:{REFUSED_ONCE}"
    echo = start_app(e, "echo", ports=(REFUSED_ONCE,))
    since = len(bed.m.zta.records)
    with no_leaks(bed.m.zta):
        assert echo_roundtrip(a, e.ip4, REFUSED_ONCE, b"retried\n") == b"retried\n"
    echo.stop()
    refused = server_event(bed, lambda ev: ev["event"] == "refused" and ev["authority"] == target)
    served = server_event(bed, lambda ev: ev["event"] == "request" and ev["authority"] == target)
    assert served["client"] != refused["client"]  # another HTTP/2 connection
    rec = bed.m.zta.wait_for(
        lambda r: r.get("message") == "connection complete" and r.get("dst.hbone_addr") == target,
        start=since,
    )
    assert "error" not in rec, rec
    assert rec["bytes_sent"] == rec["bytes_recv"] == len(b"retried\n")
