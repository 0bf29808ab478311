"""Observability end to end, against real ztunnel processes in network namespaces.

* Prometheus ``/metrics`` and ``/stats/prometheus``: the exact Istio traffic label sets (reference
  6.1, in encoding order, ``unknown`` for missing values) and exact values, on the source and the
  destination side, for HBONE through a service VIP, a raw HBONE client with baggage, plaintext
  passthrough both ways and a connection the app refuses; byte counters that move while a
  connection is still open; OpenMetrics when asked for.
* The access log (reference 7) in JSON and in plain text, ``connection opened`` and
  ``connection complete``: fields, their order and values; a runtime level change via
  ``/logging``.
* Admin (reference 6.2): ``/config_dump`` of a live ztunnel (dedicated and in-pod),
  ``/quitquitquit``, localhost only. Readiness (6.3), in-pod through a node agent outage.
* Graceful drain (10.1): the termination deadline, a new ztunnel taking over with nothing refused,
  GOAWAY to the peer's pool, exit codes.

Most tests share one two-node mesh (dedicated mode): ztunnel-a logs JSON with access=debug from the
start, ztunnel-b logs plain text (``LOG_FORMAT`` unset) at ``info`` so its access debug level is
switched on at run time. Metric assertions compare a scrape before and after each step, so the
tests do not depend on each other's traffic.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import json
import os
import re
import signal
import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from backports import zstd
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import LocalCA
from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.testing.apps import (
    Digest,
    Hasher,
    connect_from,
    echo_roundtrip,
    payload_chunks,
    recv_all,
    recv_digest,
    recv_line,
    send_payload,
    start_app,
)
from ztunnel.testing.hbone import HboneClient
from ztunnel.testing.netns import External, Host, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import Record, ZtunnelProcess

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root")]


VIP = "10.96.0.20"
SVC_HOST = "b.default.svc.cluster.local"
TARGET_PORT = 8080  # service b: 80 -> 8080, where a "source" app answers
ECHO_PORT = 9000  # an echo app in pods a and b (no service)
EXT_ECHO_PORT = 9100  # an echo app on the external host
REQUEST_BYTES = 100_000
RESPONSE_BYTES = 200_000
RESPONSE_SEED = 3
FLUSH = "300ms"  # ZTUNNEL_METRICS_FLUSH_INTERVAL for the shared mesh
U = "unknown"

ALT_PORTS = {
    "ZTUNNEL_ADMIN_PORT": "25000",
    "ZTUNNEL_STATS_PORT": "25020",
    "ZTUNNEL_READINESS_PORT": "25021",
}


# --------------------------------------------------------------------------------------------
# the workloads, as the local config describes them


@dataclass(frozen=True)
class Meta:
    """A workload's metric-relevant fields (or what a peer's baggage claims)."""

    name: str
    workload: str
    canonical: str
    revision: str
    sa: str
    region: str
    zone: str
    cluster: str = "cluster1"
    namespace: str = "default"

    @property
    def principal(self) -> str:
        return f"spiffe://cluster.local/ns/{self.namespace}/sa/{self.sa}"


A = Meta("a", "a-deploy", "a-app", "v1", "sa-a", "region-1", "zone-1a")
B = Meta("b", "b-deploy", "b-app", "v2", "sa-b", "region-2", "zone-2b")
# What the raw HBONE client's baggage says; its certificate says sa "tester".
BAGGAGE = Meta(
    "bag", "bag-deploy", "bag-app", "v9", "tester", "region-9", "zone-9z", "cluster9", "ns-bag"
)
BAGGAGE_HEADER = (
    "k8s.cluster.name=cluster9,k8s.namespace.name=ns-bag,k8s.deployment.name=bag-deploy,"
    "service.name=bag-app,service.version=v9,cloud.region=region-9,"
    "cloud.availability_zone=zone-9z"
)
TESTER = Identity("cluster.local", "default", "tester")


def workload_yaml(pod: Pod, m: Meta, extra: str = "") -> str:
    assert pod.node is not None
    return f"""- uid: {m.cluster}//v1/Pod/default/{pod.name}
  name: {pod.name}
  namespace: default
  serviceAccount: {m.sa}
  trustDomain: cluster.local
  workloadIps: ["{pod.ip4}", "{pod.ip6}"]
  protocol: HBONE
  node: {pod.node.name}
  clusterId: {m.cluster}
  workloadName: {m.workload}
  canonicalName: {m.canonical}
  canonicalRevision: {m.revision}
  locality:
    region: {m.region}
    zone: {m.zone}
{extra}"""


def mesh_yaml(a: Pod, b: Pod) -> str:
    b_services = f'  services:\n    "default/{SVC_HOST}": {{80: {TARGET_PORT}}}\n'
    return (
        "workloads:\n"
        + workload_yaml(a, A)
        + workload_yaml(b, B, b_services)
        + f"""services:
- name: b
  namespace: default
  hostname: {SVC_HOST}
  vips: ["/{VIP}"]
  ports: {{80: {TARGET_PORT}}}
policies:
- name: deny-nothing
  namespace: other
  scope: Namespace
  action: Deny
  rules:
  - - - destinationPorts: [1]
"""
    )


# --------------------------------------------------------------------------------------------
# the expected traffic label sets (reference 6.1), written out independently of the product

TRAFFIC_LABEL_NAMES = (
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
    "source_region",
    "source_zone",
    "destination_region",
    "destination_zone",
)

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]

OPENED = "istio_tcp_connections_opened_total"
CLOSED = "istio_tcp_connections_closed_total"
RECEIVED = "istio_tcp_received_bytes_total"  # request bytes, downstream -> upstream
SENT = "istio_tcp_sent_bytes_total"  # response bytes, upstream -> downstream
FAILED = "istio_tcp_connections_failed_total"
TRAFFIC_METRICS = (OPENED, CLOSED, RECEIVED, SENT, FAILED)


def traffic(
    reporter: str,
    *,
    source: Meta | None,
    principal: str,
    dest: Meta | None,
    service: bool,
    flags: str = "-",
    security: str = "mutual_tls",
    from_baggage: bool = False,
) -> Labels:
    """The full label set, in encoding order. ``source`` from xDS, or (``from_baggage``) from the
    peer's baggage, where ``source_app`` is the workload name instead of the canonical name."""
    s = source
    if s is None:
        src = [U, U, U, U, principal, U, U, U]
    else:
        app = s.workload if from_baggage else s.canonical
        src = [s.workload, s.canonical, s.revision, s.namespace, principal, app, s.revision]
        src.append(s.cluster)
    svc = [SVC_HOST, "default", "b"] if service else [U, U, U]
    d = dest
    if d is None:
        dst = [U] * 8
    else:
        dst = [d.workload, d.canonical, d.revision, d.namespace, d.principal]
        dst += [d.canonical, d.revision, d.cluster]
    values = [reporter, *src, *svc, *dst, "tcp", flags, security]
    if s is not None or d is not None:
        values += [
            s.region if s else U,
            s.zone if s else U,
            d.region if d else U,
            d.zone if d else U,
        ]
    return tuple(zip(TRAFFIC_LABEL_NAMES, values, strict=False))


def counted(
    labels: Labels, request: int, response: int, *, close_flags: str | None = None
) -> dict[SeriesKey, float]:
    """One connection: opened and closed once, these byte counts; with ``close_flags`` the close
    carries that response flag and also counts as failed."""
    out: dict[SeriesKey, float] = {(OPENED, labels): 1}
    if close_flags is None:
        out[(CLOSED, labels)] = 1
    else:
        flagged = tuple((k, close_flags if k == "response_flags" else v) for k, v in labels)
        out[(CLOSED, flagged)] = 1
        out[(FAILED, flagged)] = 1
    if request:
        out[(RECEIVED, labels)] = request
    if response:
        out[(SENT, labels)] = response
    return out


def merged(*parts: dict[SeriesKey, float]) -> dict[SeriesKey, float]:
    out: dict[SeriesKey, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return out


# --------------------------------------------------------------------------------------------
# HTTP and Prometheus text


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


def http(
    where: Host | str,
    ip: str,
    port: int,
    path: str,
    *,
    method: str = "GET",
    headers: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> HttpResponse:
    """One HTTP/1.1 request from ``where``'s netns (``Connection: close``, read to EOF)."""
    host = f"[{ip}]" if ":" in ip else ip
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers]
    if method == "POST":
        lines.append("Content-Length: 0")
    with connect_from(where, ip, port, timeout=timeout) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = recv_all(s, timeout)
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise ConnectionError(f"no HTTP response from {ip}:{port}: {data!r}")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    response = HttpResponse(int(status_line.split()[1]), hdrs, body)
    assert len(body) == int(hdrs["content-length"]), (len(body), hdrs)
    return response


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_samples(text: str) -> dict[SeriesKey, float]:
    """Every sample of a text exposition, labels in the order written (prometheus_client's own
    parser sorts them into a dict, which would hide an ordering bug)."""
    out: dict[SeriesKey, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.fullmatch(line)
        assert m is not None, f"not a sample line: {line!r}"
        name, body, value = m.groups()
        labels: list[tuple[str, str]] = []
        pos, body = 0, body or ""
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            assert lm is not None, f"bad labels in {line!r}"
            labels.append((lm[1], lm[2].replace('\\"', '"').replace("\\\\", "\\")))
            pos = lm.end()
        key = (name, tuple(labels))
        assert key not in out, f"duplicate series: {line!r}"
        out[key] = float(value)
    return out


def scrape(
    where: Host, path: str = "/metrics", *, port: int = 15020, accept: str | None = None
) -> HttpResponse:
    headers = [("Accept", accept)] if accept else []
    r = http(where, "127.0.0.1", port, path, headers=headers)
    assert r.status == 200, r
    return r


def traffic_series(where: Host, path: str = "/metrics") -> dict[SeriesKey, float]:
    """The istio_tcp_* connection and byte counters of one scrape (validated by
    prometheus_client's parser too)."""
    text = scrape(where, path).text
    list(parse_prometheus(text))  # raises on anything malformed
    return {k: v for k, v in parse_samples(text).items() if k[0] in TRAFFIC_METRICS}


def delta(before: dict[SeriesKey, float], after: dict[SeriesKey, float]) -> dict[SeriesKey, float]:
    """The series that changed, by how much (a new series counts from 0)."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert not set(before) - set(after), "a series disappeared"
    return {k: v for k, v in out.items() if v != 0}


def show(d: dict[SeriesKey, float]) -> str:
    return "\n".join(f"{k[0]} {dict(k[1])} {v}" for k, v in sorted(d.items()))


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout}s"
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# plain-text log lines -> the same dicts as the JSON lines

HEADER_KEYS = ("level", "time", "scope", "message")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_PLAIN_FIELD = re.compile(r' ([A-Za-z_][\w.]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?= |$)')


def parse_plain(line: str) -> Record | None:
    """``<time>\\t<level>\\t<target>\\t<message> key=value ...`` (values JSON-quoted when they
    hold a space, ``=`` or ``"``; digits become ints, as JSON has them)."""
    parts = line.split("\t", 3)
    if len(parts) != 4 or not _TIME.fullmatch(parts[0]):
        return None
    ts, level, target, rest = parts
    matches = list(_PLAIN_FIELD.finditer(rest))
    end = len(rest)
    first = len(matches)
    for i in range(len(matches) - 1, -1, -1):  # the run of key=value tokens ending the line
        if matches[i].end() != end:
            break
        end, first = matches[i].start(), i
    rec: Record = {"level": level.strip(), "time": ts, "scope": target, "message": rest[:end]}
    for m in matches[first:]:
        raw = m.group(2)
        value: object = json.loads(raw) if raw.startswith('"') else raw
        if isinstance(value, str) and value.isdigit() and not raw.startswith('"'):
            value = int(value)
        rec[m.group(1)] = value
    return rec


class PlainZtunnel(ZtunnelProcess):
    """A ztunnel with ``LOG_FORMAT`` unset (plain text); each line parsed with
    :func:`parse_plain` into the record shape :class:`ZtunnelProcess` keeps for JSON."""

    log_env: ClassVar[dict[str, str]] = {}

    def start(self, timeout: float = 15.0) -> ZtunnelProcess:
        assert "LOG_FORMAT" not in self.env
        return super().start(timeout)

    def parse(self, line: str) -> Record:
        return parse_plain(line) or {"message": line, "level": "raw"}


def mark(zt: ZtunnelProcess) -> int:
    return len(zt.records)


def access_record(
    zt: ZtunnelProcess,
    since: int,
    message: str,
    direction: str,
    match: Mapping[str, object] | None = None,
    *,
    src_ip: str | None = None,
    timeout: float = 10.0,
) -> Record:
    """The first access record from index ``since`` on with this message and direction, these
    field values and (``src_ip``) a ``src.addr`` from that IP."""
    want = match or {}
    return zt.wait_for(
        lambda r: (
            r.get("scope") == "access"
            and r.get("message") == message
            and r.get("direction") == direction
            and all(r.get(k) == v for k, v in want.items())
            and (src_ip is None or str(r.get("src.addr", "")).startswith(f"{src_ip}:"))
        ),
        timeout,
        start=since,
    )


def access_records(zt: ZtunnelProcess, since: int, message: str, direction: str) -> list[Record]:
    with zt._cond:
        recs = zt.records[since:]
    return [
        r
        for r in recs
        if r.get("scope") == "access"
        and r.get("message") == message
        and r.get("direction") == direction
    ]


def field_names(rec: Record) -> list[str]:
    return [k for k in rec if k not in HEADER_KEYS]


# --------------------------------------------------------------------------------------------
# the shared mesh


@dataclass
class Obs:
    tb: Testbed
    a: Pod
    b: Pod
    ext: External
    ca: LocalCA
    zta: ZtunnelProcess  # JSON, RUST_LOG=info,access=debug
    ztb: PlainZtunnel  # plain text, RUST_LOG=info

    def hbone_client(self, cert: WorkloadCertificate) -> HboneClient:
        return HboneClient.connect(
            self.ext, self.b.ip4, cert=cert, roots_pem=self.ca.root_pem, timeout=10
        )


def mesh_env(ca_dir: str, cfg: str, **extra: str) -> dict[str, str]:
    return {"PROXY_MODE": "dedicated", "LOCAL_XDS": cfg, "ZTUNNEL_LOCAL_CA_DIR": ca_dir, **extra}


@contextlib.contextmanager
def two_pods() -> Iterator[tuple[Testbed, Pod, Pod, str, LocalCA]]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as ca_dir:
        ca = LocalCA.load_or_create(Path(ca_dir), trust_domain="cluster.local")
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        a, b = n1.add_pod("a"), n2.add_pod("b")
        a.install_inpod_rules()
        b.install_inpod_rules()
        yield tb, a, b, ca_dir, ca


def start_all(*zts: ZtunnelProcess) -> None:
    """Start-up is mostly interpreter start and imports: start them all at once."""
    with ThreadPoolExecutor(len(zts)) as pool:
        for started in [pool.submit(zt.start) for zt in zts]:
            started.result()


def stop_all_cleanly(zts: Sequence[ZtunnelProcess]) -> None:
    codes = {zt.host.name: (zt.stop(), zt.internal_errors()) for zt in zts}
    assert all(rc == 0 for rc, _ in codes.values()), f"exit codes / internal errors: {codes}"


@pytest.fixture(scope="module")
def obs() -> Iterator[Obs]:
    with two_pods() as (tb, a, b, ca_dir, ca):
        ext = tb.add_external("ext")
        # A short drain deadline: at teardown each ztunnel still holds the other's idle pooled
        # HBONE connection, which keeps its drain going until the deadline (see
        # test_drain_does_not_wait_for_idle_pooled_connections).
        env = mesh_env(
            ca_dir,
            mesh_yaml(a, b),
            ZTUNNEL_METRICS_FLUSH_INTERVAL=FLUSH,
            CONNECTION_TERMINATION_DEADLINE="1s",
        )
        zta = ZtunnelProcess(a, {**env, "PROXY_WORKLOAD_INFO": "default/a/sa-a", "NODE_NAME": "n1"})
        ztb = PlainZtunnel(
            b,
            {**env, "PROXY_WORKLOAD_INFO": "default/b/sa-b", "NODE_NAME": "n2", "RUST_LOG": "info"},
        )
        try:
            start_all(zta, ztb)
            start_app(
                b,
                "source",
                "--bytes",
                str(RESPONSE_BYTES),
                "--seed",
                str(RESPONSE_SEED),
                ports=(TARGET_PORT,),
            )
            start_app(b, "echo", ports=(ECHO_PORT,))
            start_app(a, "echo", ports=(ECHO_PORT,))
            start_app(ext, "echo", ports=(EXT_ECHO_PORT,))
            yield Obs(tb, a, b, ext, ca, zta, ztb)
        except BaseException:
            for zt in (zta, ztb):
                zt.stop()
            raise
        stop_all_cleanly([zta, ztb])


def vip_transfer(o: Obs) -> int:
    """a -> service VIP:80 -> b:8080 over HBONE: 100000 bytes up, 200000 down. Returns the client's
    local port (for the access log)."""
    with connect_from(o.a, VIP, 80, timeout=10) as s:
        port = int(s.getsockname()[1])
        send_payload(s, REQUEST_BYTES, seed=1)
        s.shutdown(socket.SHUT_WR)
        assert recv_digest(s) == Digest.of_payload(RESPONSE_BYTES, seed=RESPONSE_SEED)
    return port


def wait_completed(o: Obs, since_a: int, since_b: int, hbone_addr: str) -> tuple[Record, Record]:
    """The outbound (ztunnel-a) and inbound (ztunnel-b) "connection complete" records."""
    match = {"dst.hbone_addr": hbone_addr}
    out = access_record(o.zta, since_a, "connection complete", "outbound", match)
    inb = access_record(o.ztb, since_b, "connection complete", "inbound", match)
    return out, inb


# --------------------------------------------------------------------------------------------
# metrics


@pytest.mark.timeout(60)
def test_metrics_hbone_via_service_exact_labels_and_values(obs: Obs) -> None:
    o = obs
    before_a, before_b = traffic_series(o.a), traffic_series(o.b)
    since_a, since_b = mark(o.zta), mark(o.ztb)
    vip_transfer(o)
    wait_completed(o, since_a, since_b, f"{o.b.ip4}:{TARGET_PORT}")

    src = traffic("source", source=A, principal=A.principal, dest=B, service=True)
    got_a = delta(before_a, traffic_series(o.a))
    assert got_a == counted(src, REQUEST_BYTES, RESPONSE_BYTES), show(got_a)
    # Destination side: source_* from the xDS workload found by the peer's IP, the principal
    # from its certificate, the service guessed from the target port.
    dst = traffic("destination", source=A, principal=A.principal, dest=B, service=True)
    got_b = delta(before_b, traffic_series(o.b))
    assert got_b == counted(dst, REQUEST_BYTES, RESPONSE_BYTES), show(got_b)

    for pod in (o.a, o.b):
        text = scrape(pod, "/metrics")
        prom = scrape(pod, "/stats/prometheus")
        assert text.headers["content-type"] == "text/plain; charset=utf-8"
        assert prom.headers["content-type"] == text.headers["content-type"]
        series = parse_samples(text.text)
        # The same registry on both paths (process_* CPU and memory move between two scrapes).
        assert ours(parse_samples(prom.text)) == ours(series)
        assert series[("istio_build", (("component", "ztunnel"), *_tag(series)))] == 1
        assert "# TYPE istio_tcp_connections_opened counter" in text.text
        assert series[("istio_tcp_sockets_open", (("reporter", "source"),))] == 0
        assert series[("istio_tcp_sockets_open", (("reporter", "destination"),))] >= 0


def ours(series: dict[SeriesKey, float]) -> dict[SeriesKey, float]:
    """What two scrapes agree on: not process_* nor the certificate expiry countdown."""
    return {
        k: v
        for k, v in series.items()
        if not k[0].startswith("process_") and k[0] != "istio_workload_cert_expiry_seconds"
    }


def _tag(series: dict[SeriesKey, float]) -> Labels:
    [labels] = [lbl for name, lbl in series if name == "istio_build"]
    assert [k for k, _ in labels] == ["component", "tag"]
    return labels[1:]


@pytest.mark.timeout(60)
def test_metrics_destination_labels_from_baggage(obs: Obs) -> None:
    """A peer unknown to xDS (the external host, with a mesh certificate): source_* come from
    its baggage, source_principal from its certificate."""
    o = obs
    before_b = traffic_series(o.b)
    since_b = mark(o.ztb)
    with o.hbone_client(o.ca.issue(TESTER)) as c:
        sid = c.request(f"{o.b.ip4}:{ECHO_PORT}", headers=[("baggage", BAGGAGE_HEADER)])
        assert c.response(sid) == 200
        c.send(sid, b"q" * 1234, end_stream=True)
        assert c.read_to_end(sid) == b"q" * 1234
    rec = access_record(o.ztb, since_b, "connection complete", "inbound")
    want = traffic(
        "destination",
        source=BAGGAGE,
        principal=str(TESTER),
        dest=B,
        service=False,
        from_baggage=True,
    )
    got = delta(before_b, traffic_series(o.b))
    assert got == counted(want, 1234, 1234), show(got)
    # The access log falls back to the baggage too: canonical service, namespace and cluster
    # (Rust's src.cluster is the source_cluster label: the baggage's k8s.cluster.name here).
    assert rec["src.addr"].startswith(f"{o.ext.ip4}:")
    assert rec["src.workload"] == "bag-app"
    assert rec["src.namespace"] == "ns-bag"
    assert rec["src.identity"] == str(TESTER)
    assert rec["src.cluster"] == "cluster9"
    assert rec["dst.cluster"] == B.cluster
    assert "dst.service" not in rec


@pytest.mark.timeout(60)
def test_metrics_plaintext_passthrough_and_refused(obs: Obs) -> None:
    o = obs
    before_a, before_b = traffic_series(o.a), traffic_series(o.b)
    since_a, since_b = mark(o.zta), mark(o.ztb)

    # a -> external host: outbound passthrough, no mTLS, nothing known about the destination.
    assert echo_roundtrip(o.a, o.ext.ip4, EXT_ECHO_PORT, b"x" * 700) == b"x" * 700
    # external host -> b: inbound plaintext (15006), source unknown.
    assert echo_roundtrip(o.ext, o.b.ip4, ECHO_PORT, b"y" * 900) == b"y" * 900
    # a -> b:9999, nothing listens: ztunnel-b answers 503 and flags it CONNECT.
    with connect_from(o.a, o.b.ip4, 9999) as s:
        s.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(1) == b""
    ext_dst = f"{o.ext.ip4}:{EXT_ECHO_PORT}"
    access_record(o.zta, since_a, "connection complete", "outbound", {"dst.addr": ext_dst})
    access_record(o.ztb, since_b, "connection complete", "inbound", src_ip=o.ext.ip4)
    refused_out = access_record(
        o.zta, since_a, "connection complete", "outbound", {"dst.hbone_addr": f"{o.b.ip4}:9999"}
    )
    refused_in = access_record(
        o.ztb, since_b, "connection complete", "inbound", {"dst.hbone_addr": f"{o.b.ip4}:9999"}
    )
    assert refused_out["level"] == "error" and "503" in refused_out["error"], refused_out
    assert refused_in["level"] == "error", refused_in

    passthrough = traffic("source", source=A, principal=U, dest=None, service=False, security=U)
    hbone = traffic("source", source=A, principal=A.principal, dest=B, service=False)
    got_a = delta(before_a, traffic_series(o.a))
    # The source side's tunnel was refused (503): an unclassified failure, CONNECT (Rust
    # Error::HttpStatus -> extract_failure_reason's catch-all).
    assert got_a == merged(
        counted(passthrough, 700, 700), counted(hbone, 0, 0, close_flags="CONNECT")
    ), show(got_a)

    plaintext_in = traffic(
        "destination", source=None, principal=U, dest=B, service=False, security=U
    )
    refused = traffic("destination", source=A, principal=A.principal, dest=B, service=False)
    got_b = delta(before_b, traffic_series(o.b))
    assert got_b == merged(
        counted(plaintext_in, 900, 900), counted(refused, 0, 0, close_flags="CONNECT")
    ), show(got_b)


@pytest.mark.timeout(60)
def test_stats_body_and_compression_as_rust(obs: Obs) -> None:
    """Rust metrics/server.rs: prometheus-client's OpenMetrics text (# UNIT lines, # EOF) on
    every request, labelled text/plain unless OpenMetrics is asked for; tower-http's
    compression by Accept-Encoding; the CRL counters declared without CRL_PATH."""
    o = obs
    since_a, since_b = mark(o.zta), mark(o.ztb)
    assert echo_roundtrip(o.a, o.b.ip4, ECHO_PORT) == b"hello\n"
    wait_completed(o, since_a, since_b, f"{o.b.ip4}:{ECHO_PORT}")  # counters settled
    accept = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"
    for pod in (o.a, o.b):
        plain = scrape(pod)
        assert plain.headers["content-type"] == "text/plain; charset=utf-8"
        assert plain.text.endswith("\n# EOF\n")
        families = {f.name: f for f in parse_openmetrics(plain.text)}  # type: ignore[no-untyped-call]
        for name in ("istio_tcp_connections_opened", "istio_tcp_sent_bytes"):
            assert families[name].type == "counter"
            assert f"# TYPE {name} counter\n" in plain.text
        assert "# UNIT istio_xds_message_bytes bytes\n" in plain.text
        assert "# UNIT istio_dns_upstream_request_duration_seconds seconds\n" in plain.text
        for crl in ("istio_crl_policy_rejections", "istio_crl_untracked_connections"):
            assert f"# TYPE {crl} counter\n" in plain.text and families[crl].samples == []
        text = {k: v for k, v in parse_samples(plain.text).items() if k[0] in TRAFFIC_METRICS}
        assert text
        for path in ("/metrics", "/stats/prometheus"):
            om = scrape(pod, path, accept=accept)
            assert om.headers["content-type"] == (
                "application/openmetrics-text;charset=utf-8;version=1.0.0"
            )
            samples = parse_samples(om.text)
            # The same body: series, label order and values.
            assert {k: v for k, v in samples.items() if k[0] in TRAFFIC_METRICS} == text

        def get(encoding: str, pod: Pod = pod) -> HttpResponse:
            return http(
                pod, "127.0.0.1", 15020, "/metrics", headers=[("Accept-Encoding", encoding)]
            )

        for asked, coding, decode in (
            ("gzip", "gzip", gzip.decompress),
            ("deflate", "deflate", zlib.decompress),
            ("deflate, gzip, br, zstd", "zstd", zstd.decompress),  # curl --compressed
            ("gzip;q=0.5, zstd;q=0.1", "gzip", gzip.decompress),
        ):
            r = get(asked)
            assert (r.status, r.headers.get("content-encoding")) == (200, coding), asked
            assert r.headers["vary"] == "accept-encoding"
            body = decode(r.body).decode()
            assert body.endswith("\n# EOF\n")
            assert {k: v for k, v in parse_samples(body).items() if k[0] in TRAFFIC_METRICS} == text
        r = get("br")  # not served here: identity is still acceptable
        assert (r.status, r.headers.get("content-encoding")) == (200, None)
        assert get("identity;q=0").status == 406  # nothing acceptable left


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a ztunnel: supervisor, zygote, workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_fds(pids: Sequence[int]) -> int:
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids)


def nofile_soft(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no fd limit for {pid}")


def gauge(text: str, name: str) -> float:
    [value] = [v for (n, labels), v in parse_samples(text).items() if n == name and not labels]
    return value


def tree_cpu(pids: Sequence[int]) -> float:
    total = 0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


HELD = 50


@pytest.mark.timeout(90)
def test_process_metrics_and_logs_with_two_workers() -> None:
    """Issue "Safe in a live mesh": process_open_fds follows the whole process tree (the
    supervisor, the zygote, two workers) as connections are held open, process_max_fds is the
    lowest limit in it, and the CPU counter covers the tree. The workers' access-log lines
    share ztunnel's stdout (Rust logs to stdout) and never tear; nothing goes to stderr."""
    with two_pods() as (tb, a, b, ca_dir, _ca):
        ext = tb.add_external("ext")
        env = mesh_env(
            ca_dir,
            mesh_yaml(a, b),
            CONNECTION_TERMINATION_DEADLINE="1s",
            PROXY_WORKLOAD_INFO="default/b/sa-b",
            NODE_NAME="n2",
            ZTUNNEL_WORKER_THREADS="2",
        )
        ztb = ZtunnelProcess(b, env)
        try:
            ztb.start()
            start_app(b, "echo", ports=(ECHO_PORT,))
            tree = process_tree(ztb.pid)
            assert len(tree) == 4, tree  # supervisor, zygote, 2 workers

            def figures() -> tuple[float, float, float, int]:
                low = tree_fds(tree)
                text = scrape(b).text
                high = tree_fds(tree)
                return (
                    gauge(text, "process_open_fds"),
                    gauge(text, "process_max_fds"),
                    gauge(text, "process_cpu_seconds_total"),
                    (low + high) // 2,
                )

            cpu_before = tree_cpu(tree)
            fds0, max0, cpu0, real0 = figures()
            own0 = tree_fds([ztb.pid])
            # +1: the scrape's own connection, open in the supervisor while it answers
            assert abs(fds0 - (real0 + 1)) <= 2, (fds0, real0)
            assert max0 == min(nofile_soft(p) for p in tree)
            assert cpu0 >= cpu_before - 0.02, (cpu0, cpu_before)
            since = mark(ztb)
            with contextlib.ExitStack() as stack:
                # Plaintext from outside the mesh (15006): each connection is accepted by
                # whichever worker wakes first, and holds two sockets there.
                for i in range(HELD):
                    s = stack.enter_context(connect_from(ext, b.ip4, ECHO_PORT, timeout=10))
                    s.sendall(f"{i}\n".encode())
                    assert recv_line(s, timeout=10) == str(i)
                fds1, _, _, real1 = figures()
                assert tree_fds([ztb.pid]) - own0 < 5  # not the supervisor's sockets ...
                assert fds1 - fds0 >= 2 * HELD, (fds0, fds1)  # ... but counted
                assert abs(fds1 - (real1 + 1)) <= 2, (fds1, real1)
            wait_until(
                lambda: len(access_records(ztb, since, "connection complete", "inbound")) >= HELD,
                what=f"{HELD} inbound access-log lines",
            )
            # Every stdout line was whole JSON (a torn one would be a "raw" record), and
            # ztunnel wrote nothing to stderr.
            raw = [r for r in ztb.records if r.get("level") == "raw"]
            assert raw == [], raw[:3]
            assert ztb.stderr_records() == []
        except BaseException:
            ztb.stop()
            raise
        stop_all_cleanly([ztb])


def recv_exact(s: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@pytest.mark.timeout(60)
def test_byte_counters_move_while_the_connection_is_open(obs: Obs) -> None:
    o = obs
    src = traffic("source", source=A, principal=A.principal, dest=B, service=False)
    dst = traffic("destination", source=A, principal=A.principal, dest=B, service=False)
    before_a, before_b = traffic_series(o.a), traffic_series(o.b)
    since_a, since_b = mark(o.zta), mark(o.ztb)
    last: list[dict[SeriesKey, float]] = []

    def live_counts_flushed() -> bool:
        got_a = delta(before_a, traffic_series(o.a))
        got_b = delta(before_b, traffic_series(o.b))
        last[:] = [got_a, got_b]
        live = {(OPENED, src): 1, (RECEIVED, src): 50_000, (SENT, src): 50_000}
        live_b = {(OPENED, dst): 1, (RECEIVED, dst): 50_000, (SENT, dst): 50_000}
        return got_a == live and got_b == live_b

    with connect_from(o.a, o.b.ip4, ECHO_PORT, timeout=10) as s:
        s.sendall(b"m" * 50_000)
        assert recv_exact(s, 50_000) == b"m" * 50_000
        try:
            wait_until(live_counts_flushed, 10, "byte counters of a live connection")
        except AssertionError:
            raise AssertionError("\n\n".join(show(d) for d in last)) from None
        assert not access_records(o.zta, since_a, "connection complete", "outbound")
        s.sendall(b"n" * 25_000)
        assert recv_exact(s, 25_000) == b"n" * 25_000
        s.shutdown(socket.SHUT_WR)
        assert recv_all(s) == b""
    wait_completed(o, since_a, since_b, f"{o.b.ip4}:{ECHO_PORT}")
    got_a = delta(before_a, traffic_series(o.a))
    assert got_a == counted(src, 75_000, 75_000), show(got_a)
    got_b = delta(before_b, traffic_series(o.b))
    assert got_b == counted(dst, 75_000, 75_000), show(got_b)


# --------------------------------------------------------------------------------------------
# access log

DURATION = re.compile(r"\d+ms")


def check_access(rec: Record, level: str, expected: dict[str, object]) -> None:
    """``rec`` has exactly these fields in this order (after level, time, scope, message), with
    these values (a compiled pattern must match the whole value)."""
    assert list(rec)[:4] == list(HEADER_KEYS), rec
    assert rec["level"] == level and rec["scope"] == "access", rec
    assert _TIME.fullmatch(str(rec["time"])), rec
    assert field_names(rec) == list(expected), f"{field_names(rec)} != {list(expected)}"
    for k, want in expected.items():
        got = rec[k]
        if isinstance(want, re.Pattern):
            assert isinstance(got, str) and want.fullmatch(got), (k, got, want.pattern)
        else:
            assert got == want, (k, got, want)


def addr_of(ip: str) -> re.Pattern[str]:
    return re.compile(re.escape(ip) + r":\d+")


def completed(opened: dict[str, object], sent: int, recv: int) -> dict[str, object]:
    return {**opened, "bytes_sent": sent, "bytes_recv": recv, "duration": DURATION}


def admin_logging(pod: Pod, query: str, method: str = "POST") -> str:
    r = http(pod, "127.0.0.1", 15000, f"/logging{query}", method=method)
    assert r.status == 200, r
    return r.text


@pytest.mark.timeout(60)
def test_access_log_json_and_plain_text(obs: Obs) -> None:
    o = obs
    a4, b4 = o.a.ip4, o.b.ip4
    echo_b = f"{b4}:{ECHO_PORT}"

    # ztunnel-b runs at RUST_LOG=info: "connection complete" only.
    since_a, since_b = mark(o.zta), mark(o.ztb)
    assert echo_roundtrip(o.a, b4, ECHO_PORT, b"one\n") == b"one\n"
    wait_completed(o, since_a, since_b, echo_b)
    assert not [r for r in o.ztb.records[since_b:] if r.get("message") == "connection opened"]

    # Switch the access log to debug at run time. (GET is 405 as in Rust; POST lists.)
    r = http(o.b, "127.0.0.1", 15000, "/logging")
    assert r.status == 405 and r.text.startswith("Invalid HTTP method\n"), r
    assert admin_logging(o.b, "") == "current log level is info\n"
    assert admin_logging(o.b, "?level=access=debug") == "current log level is access=debug,info\n"
    o.ztb.wait_for(lambda r: str(r.get("message")).startswith("log level changed to"))

    since_a, since_b = mark(o.zta), mark(o.ztb)
    port = vip_transfer(o)  # a -> service b: zta (JSON) outbound, ztb (plain) inbound
    with connect_from(o.b, a4, ECHO_PORT) as s:  # b -> a: ztb (plain) outbound, zta (JSON) inbound
        b_port = s.getsockname()[1]
        s.sendall(b"r" * 12_345)
        s.shutdown(socket.SHUT_WR)
        assert recv_all(s) == b"r" * 12_345
    with connect_from(o.a, o.ext.ip4, EXT_ECHO_PORT) as s:  # a -> outside: plaintext passthrough
        ext_port = s.getsockname()[1]
        s.sendall(b"p" * 700)
        s.shutdown(socket.SHUT_WR)
        assert recv_all(s) == b"p" * 700
    with connect_from(o.ext, b4, ECHO_PORT) as s:  # outside -> b: inbound plaintext (15006)
        in_port = s.getsockname()[1]
        s.sendall(b"i" * 900)
        s.shutdown(socket.SHUT_WR)
        assert recv_all(s) == b"i" * 900

    def both(zt: ZtunnelProcess, since: int, direction: str, **match: object) -> list[Record]:
        want = {k.replace("_", ".", 1): v for k, v in match.items()}
        return [
            access_record(zt, since, msg, direction, want)
            for msg in ("connection opened", "connection complete")
        ]

    # HBONE through the service VIP, source side (JSON).
    opened: dict[str, object] = {
        "src.addr": f"{a4}:{port}",
        "src.workload": "a",
        "src.namespace": "default",
        "src.identity": A.principal,
        "src.cluster": A.cluster,
        "dst.addr": f"{b4}:15008",
        "dst.hbone_addr": f"{b4}:{TARGET_PORT}",
        "dst.service": SVC_HOST,
        "dst.workload": "b",
        "dst.namespace": "default",
        "dst.identity": B.principal,
        "dst.cluster": B.cluster,
        "direction": "outbound",
    }
    rec_open, rec_done = both(o.zta, since_a, "outbound", src_addr=f"{a4}:{port}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, REQUEST_BYTES, RESPONSE_BYTES))

    # ... and its destination side (plain text). dst.addr is the connection's own address,
    # <pod>:15008, as Rust logs it (inbound.rs build_inbound_request: original_dst).
    opened = {
        "src.addr": addr_of(a4),
        "src.workload": "a",
        "src.namespace": "default",
        "src.identity": A.principal,
        "src.cluster": A.cluster,
        "dst.addr": f"{b4}:15008",
        "dst.hbone_addr": f"{b4}:{TARGET_PORT}",
        "dst.service": SVC_HOST,
        "dst.workload": "b",
        "dst.namespace": "default",
        "dst.identity": B.principal,
        "dst.cluster": B.cluster,
        "direction": "inbound",
    }
    rec_open, rec_done = both(o.ztb, since_b, "inbound", dst_hbone_addr=f"{b4}:{TARGET_PORT}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, RESPONSE_BYTES, REQUEST_BYTES))

    # HBONE straight to a pod IP (no service), source side in plain text ...
    opened = {
        "src.addr": f"{b4}:{b_port}",
        "src.workload": "b",
        "src.namespace": "default",
        "src.identity": B.principal,
        "src.cluster": B.cluster,
        "dst.addr": f"{a4}:15008",
        "dst.hbone_addr": f"{a4}:{ECHO_PORT}",
        "dst.workload": "a",
        "dst.namespace": "default",
        "dst.identity": A.principal,
        "dst.cluster": A.cluster,
        "direction": "outbound",
    }
    rec_open, rec_done = both(o.ztb, since_b, "outbound", src_addr=f"{b4}:{b_port}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, 12_345, 12_345))
    # ... and destination side in JSON.
    opened = {
        "src.addr": addr_of(b4),
        "src.workload": "b",
        "src.namespace": "default",
        "src.identity": B.principal,
        "src.cluster": B.cluster,
        "dst.addr": f"{a4}:15008",
        "dst.hbone_addr": f"{a4}:{ECHO_PORT}",
        "dst.workload": "a",
        "dst.namespace": "default",
        "dst.identity": A.principal,
        "dst.cluster": A.cluster,
        "direction": "inbound",
    }
    rec_open, rec_done = both(o.zta, since_a, "inbound", dst_hbone_addr=f"{a4}:{ECHO_PORT}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, 12_345, 12_345))

    # Plaintext: no identities, no dst.hbone_addr; only what is known about each end.
    opened = {
        "src.addr": f"{a4}:{ext_port}",
        "src.workload": "a",
        "src.namespace": "default",
        "src.cluster": A.cluster,
        "dst.addr": f"{o.ext.ip4}:{EXT_ECHO_PORT}",
        "direction": "outbound",
    }
    rec_open, rec_done = both(o.zta, since_a, "outbound", src_addr=f"{a4}:{ext_port}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, 700, 700))
    opened = {
        "src.addr": f"{o.ext.ip4}:{in_port}",
        "dst.addr": echo_b,
        "dst.workload": "b",
        "dst.namespace": "default",
        "dst.cluster": B.cluster,
        "direction": "inbound",
    }
    rec_open, rec_done = both(o.ztb, since_b, "inbound", src_addr=f"{o.ext.ip4}:{in_port}")
    check_access(rec_open, "debug", opened)
    check_access(rec_done, "info", completed(opened, 900, 900))

    # Back to the start-up levels: "connection opened" is gone again.
    assert admin_logging(o.b, "?reset") == "current log level is info\n"
    since_a, since_b = mark(o.zta), mark(o.ztb)
    assert echo_roundtrip(o.a, b4, ECHO_PORT, b"two\n") == b"two\n"
    wait_completed(o, since_a, since_b, echo_b)
    assert not [r for r in o.ztb.records[since_b:] if r.get("message") == "connection opened"]
    assert admin_logging(o.b, "") == "current log level is info\n"


# --------------------------------------------------------------------------------------------
# admin and readiness


def read_until_closed(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    got = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            got += chunk
    return bytes(got)


@pytest.mark.timeout(60)
def test_admin_listens_on_localhost_only(obs: Obs) -> None:
    o = obs
    # Both loopbacks, as Rust's Address::Localhost binds them.
    for lo in ("127.0.0.1", "::1"):
        r = http(o.b, lo, 15000, "/")
        assert r.status == 200 and r.headers["content-type"].startswith("text/html"), r
        assert "config_dump" in r.text
    for ip in o.b.ips:  # the pod's own addresses, from inside the pod: nothing listens
        with pytest.raises(ConnectionRefusedError):
            connect_from(o.b, ip, 15000).close()
    # From another pod (through both ztunnels) and from outside the mesh (captured to 15006):
    # ztunnel-b's connection to the admin port is refused, so the client gets no answer.
    since_a, since_b = mark(o.zta), mark(o.ztb)
    admin_b = f"{o.b.ip4}:15000"
    for where in (o.a, o.ext):
        with connect_from(where, o.b.ip4, 15000) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            assert read_until_closed(s) == b""
    for src in (o.a.ip4, o.ext.ip4):
        rec = access_record(o.ztb, since_b, "connection complete", "inbound", src_ip=src)
        # (HBONE names the app's address in dst.hbone_addr, plaintext in dst.addr)
        target = rec.get("dst.hbone_addr", rec["dst.addr"])
        assert rec["level"] == "error" and target == f"{o.b.ip4}:15000", rec
    access_record(o.zta, since_a, "connection complete", "outbound", {"dst.hbone_addr": admin_b})
    # Stats and readiness listen on the wildcard.
    assert http(o.b, o.b.ip4, 15020, "/metrics").status == 200
    since_a, since_b = mark(o.zta), mark(o.ztb)
    assert http(o.a, o.b.ip4, 15020, "/metrics").status == 200  # via HBONE, as a pod would
    wait_completed(o, since_a, since_b, f"{o.b.ip4}:15020")
    r = http(o.b, o.b.ip4, 15021, "/healthz/ready")
    assert (r.status, r.text) == (200, "ready\n")
    assert http(o.b, "127.0.0.1", 15021, "/healthz/ready", method="POST").status == 405


def rfc3339(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def check_certificate(entry: dict[str, Any], identity: str) -> None:
    """Available, a leaf for ``identity`` valid now for the default 24 h, and the root."""
    import base64

    from cryptography import x509

    assert entry["identity"] == identity and entry["state"] == "Available", entry
    now = dt.datetime.now(dt.UTC)
    [leaf] = entry["certChain"]
    assert entry["rootCerts"], entry
    start, end = rfc3339(leaf["validFrom"]), rfc3339(leaf["expirationTime"])
    assert start <= now + dt.timedelta(seconds=5) < end, leaf
    assert dt.timedelta(hours=23, minutes=50) < end - now <= dt.timedelta(hours=24), leaf
    cert = x509.load_pem_x509_certificate(base64.b64decode(leaf["pem"]))
    assert str(cert.serial_number) == leaf["serialNumber"]
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [identity]


@pytest.mark.timeout(60)
def test_config_dump_of_a_live_ztunnel(obs: Obs) -> None:
    o = obs
    since_a, since_b = mark(o.zta), mark(o.ztb)
    assert echo_roundtrip(o.a, o.b.ip4, ECHO_PORT) == b"hello\n"  # both certificates in use
    wait_completed(o, since_a, since_b, f"{o.b.ip4}:{ECHO_PORT}")
    r = http(o.a, "127.0.0.1", 15000, "/config_dump")
    assert r.status == 200 and r.headers["content-type"] == "application/json", r
    d = json.loads(r.body)
    assert list(d)[:8] == [
        "workloads",
        "services",
        "policies",
        "stagedServices",
        "staticConfig",
        "version",
        "config",
        "certificates",
    ]
    workloads = {w["uid"]: w for w in d["workloads"]}
    assert set(workloads) == {"cluster1//v1/Pod/default/a", "cluster1//v1/Pod/default/b"}
    wa = workloads["cluster1//v1/Pod/default/a"]
    assert wa["workloadIps"] == [o.a.ip4, o.a.ip6]
    assert (wa["name"], wa["serviceAccount"], wa["protocol"]) == ("a", "sa-a", "HBONE")
    assert (wa["canonicalName"], wa["workloadName"], wa["clusterId"]) == (
        "a-app",
        "a-deploy",
        "cluster1",
    )
    assert wa["locality"] == {"region": "region-1", "zone": "zone-1a", "subzone": ""}
    assert workloads["cluster1//v1/Pod/default/b"]["services"] == [f"default/{SVC_HOST}"]
    [svc] = d["services"]
    assert (svc["hostname"], svc["vips"], svc["ports"]) == (SVC_HOST, [f"/{VIP}"], {"80": 8080})
    assert list(svc["endpoints"]) == ["cluster1//v1/Pod/default/b"]
    [pol] = d["policies"]
    assert (pol["name"], pol["namespace"], pol["scope"], pol["action"]) == (
        "deny-nothing",
        "other",
        "Namespace",
        "Deny",
    )
    assert len(d["staticConfig"]["workloads"]) == 2
    assert d["version"]["version"]
    cfg = d["config"]
    assert cfg["proxyMode"] == "dedicated"
    assert (cfg["adminPort"], cfg["statsPort"], cfg["readinessPort"]) == (15000, 15020, 15021)
    assert cfg["connectionTerminationDeadline"] == "1s"
    assert cfg["metricsFlushInterval"] == FLUSH
    certs = {c["identity"]: c for c in d["certificates"]}
    check_certificate(certs[A.principal], A.principal)
    # ztunnel-b holds its own identity's certificate, not a's.
    rb = http(o.b, "127.0.0.1", 15000, "/config_dump")
    certs_b = {c["identity"]: c for c in json.loads(rb.body)["certificates"]}
    assert set(certs_b) == {B.principal}
    check_certificate(certs_b[B.principal], B.principal)


def test_config_dump_connections_in_dedicated_mode(obs: Obs) -> None:
    """Rust has no workloadState in dedicated mode; we show the one workload (keyed by its uid)
    with its live connections, in the shared-mode shape, and istioctl lists them."""
    from tests.golden import istioctl, table
    from tests.golden.istioctl_schema import decode

    o = obs
    with connect_from(o.a, o.b.ip4, ECHO_PORT, timeout=10) as s:
        s.sendall(b"hi\n")
        assert recv_exact(s, 3) == b"hi\n"
        port = s.getsockname()[1]
        body = http(o.a, "127.0.0.1", 15000, "/config_dump").body
        body_b = http(o.b, "127.0.0.1", 15000, "/config_dump").body
    state = json.loads(body)["workloadState"]
    assert state == {
        "cluster1//v1/Pod/default/a": {
            "state": "Up",
            "connections": {
                "inbound": [],
                "outbound": [
                    {
                        "src": f"{o.a.ip4}:{port}",
                        "originalDst": f"{o.b.ip4}:{ECHO_PORT}",
                        "actualDst": f"{o.b.ip4}:15008",
                        "protocol": "HBONE",
                    }
                ],
            },
            "info": {"name": "a", "namespace": "default", "serviceAccount": "sa-a"},
        }
    }
    [inbound] = json.loads(body_b)["workloadState"]["cluster1//v1/Pod/default/b"]["connections"][
        "inbound"
    ]
    assert (inbound["actualDst"], inbound["protocol"]) == (f"{o.b.ip4}:{ECHO_PORT}", "HBONE")
    decode(json.loads(body))
    r = istioctl("connections", body)
    assert r.returncode == 0, r.stderr
    assert table(r.stdout)[1:] == [
        [
            "a.default",
            "Outbound",
            f"a.default:{port}",
            "b.default:15008",
            f"b.default:{ECHO_PORT}",
            "HBONE",
        ]
    ]


# --------------------------------------------------------------------------------------------
# in-pod mode: readiness through a node agent outage, per-pod state in config_dump


def wait_ready_status(node: Host, status: int, timeout: float = 10.0) -> HttpResponse:
    deadline = time.monotonic() + timeout
    while True:
        r = http(node, "127.0.0.1", 15021, "/healthz/ready")
        if r.status == status:
            return r
        assert time.monotonic() < deadline, f"readiness stayed {r.status} {r.text!r}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_inpod_readiness_follows_the_node_agent_and_config_dump_shows_pods() -> None:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        node = tb.add_node("n1")
        pod = node.add_pod("c1")
        uds = os.path.join(tmp, "ztunnel.sock")
        cfg = f"""workloads:
- uid: cluster1//v1/Pod/default/c1
  name: c1
  namespace: default
  serviceAccount: sa-c1
  trustDomain: cluster.local
  workloadIps: ["{pod.ip4}", "{pod.ip6}"]
  protocol: HBONE
  node: n1
"""
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": cfg,
            "INPOD_UDS": uds,
            "NODE_NAME": "n1",
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
        }
        info = WorkloadInfo(name="c1", namespace="default", service_account="sa-c1")
        zt = ZtunnelProcess(node, env).start()  # no node agent yet
        agents: list[FakeNodeAgent] = []
        try:
            # Rust WorkloadProxyManager::not_ready: the task named "workload proxy manager"
            # (what stays pending once the state is in and the in-pod manager runs; "proxy"
            # and "state manager" come first, until the workers hold the state)
            alone = "not ready, pending: workload proxy manager\n"
            deadline = time.monotonic() + 10
            while (r := http(node, "127.0.0.1", 15021, "/healthz/ready")).text != alone:
                assert r.status == 500 and time.monotonic() < deadline, r
                time.sleep(0.05)

            agent = FakeNodeAgent(uds)
            agents.append(agent)
            agent.put_pod("uid-c1", info, pod)  # in the snapshot
            agent.start().wait_for_snapshot()
            assert wait_ready_status(node, 200).text == "ready\n"

            r = http(node, "127.0.0.1", 15000, "/config_dump")
            assert r.status == 200, r
            dump = json.loads(r.body)
            # Rust src/inpod/admin.rs: keyed by the ZDS uid; connections in Rust's shape.
            assert dump["workloadState"] == {
                "uid-c1": {
                    "info": {"name": "c1", "namespace": "default", "serviceAccount": "sa-c1"},
                    "state": "Up",
                    "connections": {"inbound": [], "outbound": []},
                }
            }
            assert dump["config"]["proxyMode"] == "shared"
            assert [w["name"] for w in dump["workloads"]] == ["c1"]
            series = parse_samples(scrape(node).text)
            assert series[("workload_manager_active_proxy_count", ())] == 1
            assert series[("workload_manager_pending_proxy_count", ())] == 0
            assert series[("workload_manager_proxies_started_total", ())] == 1

            # The node agent goes away: not ready until it is back and has resent the snapshot.
            agent.close()
            r = wait_ready_status(node, 500)
            assert r.text == "not ready, pending: workload proxy manager\n"
            time.sleep(0.3)
            assert http(node, "127.0.0.1", 15021, "/healthz/ready").status == 500
            agent = FakeNodeAgent(uds)
            agents.append(agent)
            agent.put_pod("uid-c1", info, pod)  # in the snapshot
            agent.start().wait_for_snapshot()
            assert wait_ready_status(node, 200).text == "ready\n"
            zt.wait_for(lambda r: r.get("message") == "in-pod: node agent connection lost")
            # The same pod in the new snapshot keeps its proxy.
            series = parse_samples(scrape(node).text)
            assert series[("workload_manager_proxies_started_total", ())] == 1
            assert series[("workload_manager_active_proxy_count", ())] == 1
        finally:
            rc = zt.stop()
            for ag in agents:
                ag.close()
        assert rc == 0, zt.internal_errors()


# --------------------------------------------------------------------------------------------
# graceful drain, handover, GOAWAY, exit codes

DEADLINE = 3.0


class Paced:
    """A connection from pod a to b's echo app that sends 16 KiB every 50 ms for ``duration``
    seconds (then half-closes), while another thread reads the echo back until EOF or reset."""

    def __init__(self, a: Pod, b: Pod, duration: float) -> None:
        self.sock = connect_from(a, b.ip4, ECHO_PORT, timeout=30)
        self.port = int(self.sock.getsockname()[1])
        self.duration = duration
        self.sent = Hasher()
        self.received = Hasher()
        self.ended_at: float | None = None
        self.send_error: BaseException | None = None
        self.recv_error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._send, daemon=True),
            threading.Thread(target=self._recv, daemon=True),
        ]

    def start(self) -> Paced:
        for t in self._threads:
            t.start()
        return self

    def _send(self) -> None:
        end = time.monotonic() + self.duration
        chunks = payload_chunks(1 << 30, seed=self.port, chunk=16 * 1024)
        try:
            while time.monotonic() < end and self.ended_at is None:
                chunk = next(chunks)
                self.sock.sendall(chunk)
                self.sent.update(chunk)
                time.sleep(0.05)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            self.send_error = e

    def _recv(self) -> None:
        self.sock.settimeout(30)
        try:
            while data := self.sock.recv(65536):
                self.received.update(data)
        except OSError as e:
            self.recv_error = e
        self.ended_at = time.monotonic()

    def join(self, timeout: float = 20.0) -> None:
        for t in self._threads:
            t.join(timeout)
            assert not t.is_alive()
        self.sock.close()


def spawn(host: Host, env: dict[str, str]) -> tuple[ZtunnelProcess, int]:
    """Start a ztunnel that must fail to start; its exit code."""
    zt = ZtunnelProcess(host, env)
    with pytest.raises(TimeoutError, match="ztunnel exited"):
        zt.start(timeout=15)
    assert zt.proc is not None
    return zt, zt.proc.popen.wait(10)


@pytest.mark.timeout(90)
def test_graceful_drain_handover_goaway_and_exit_codes() -> None:
    with two_pods() as (_tb, a, b, ca_dir, _ca):
        cfg = mesh_yaml(a, b)
        env = mesh_env(ca_dir, cfg, CONNECTION_TERMINATION_DEADLINE=f"{DEADLINE:g}s")
        # ztunnel-a (the client's, not under test) runs one worker: the two early connections
        # then surely share the one pooled connection to the old ztunnel (each worker pools
        # its own). The ztunnels under test, old and new, run the suite's worker count.
        env_a = {
            **env,
            "PROXY_WORKLOAD_INFO": "default/a/sa-a",
            "NODE_NAME": "n1",
            "ZTUNNEL_WORKER_THREADS": "1",
        }
        env_b = {**env, "PROXY_WORKLOAD_INFO": "default/b/sa-b", "NODE_NAME": "n2"}
        zta, old = ZtunnelProcess(a, env_a), ZtunnelProcess(b, env_b)
        new = ZtunnelProcess(b, {**env_b, **ALT_PORTS})
        try:
            start_all(zta, old)
            start_app(b, "echo", ports=(ECHO_PORT,))
            assert echo_roundtrip(a, b.ip4, ECHO_PORT) == b"hello\n"  # ztunnel-a pools a conn
            # The new ztunnel binds alongside (SO_REUSEPORT) before the old one is told to go.
            new.start()
            since_old, since_new, since_a = mark(old), mark(new), mark(zta)

            short = Paced(a, b, duration=2.0).start()  # ends ~1.5 s into the drain
            long = Paced(a, b, duration=30.0).start()  # outlives the deadline
            time.sleep(0.5)
            assert len(access_records(old, since_old, "connection opened", "inbound")) == 2
            t0 = time.monotonic()
            os.kill(old.pid, signal.SIGTERM)

            # New connections during the drain: ztunnel-a's pool got GOAWAY, so it dials again
            # and lands on the new ztunnel; the old one has closed its listeners. None fails.
            time.sleep(0.3)
            ok, failures = 0, []
            while time.monotonic() < t0 + DEADLINE - 0.3:
                try:
                    msg = f"during drain {ok}\n".encode()
                    assert echo_roundtrip(a, b.ip4, ECHO_PORT, msg) == msg
                    ok += 1
                except (OSError, AssertionError) as e:
                    failures.append(e)
                time.sleep(0.02)
            assert not failures, failures[:3]
            assert ok >= 10

            assert old.proc is not None
            rc_old = old.proc.popen.wait(DEADLINE + 5)
            exited = time.monotonic() - t0
            short.join()
            long.join()

            # (a) finished inside the deadline: intact.
            assert short.ended_at is not None and short.ended_at - t0 < DEADLINE - 0.5
            assert short.send_error is None and short.recv_error is None
            assert short.received.digest() == short.sent.digest()
            assert short.sent.count > 200_000
            # (b) outlived it: cut at the deadline, logged as a drain.
            assert long.ended_at is not None
            assert DEADLINE - 0.2 <= long.ended_at - t0 <= DEADLINE + 1.5, long.ended_at - t0
            assert 0 < long.received.count < long.sent.count + 1
            drained = access_record(
                old,
                since_old,
                "connection complete",
                "inbound",
                {"error": "connection closed due to connection drain"},
            )
            assert drained["level"] == "error" and drained["bytes_recv"] > 0, drained
            old.wait_for(
                lambda r: "drain duration expired with 1 pending connections" in str(r["message"])
            )
            # (d) a clean shutdown exits 0, right after the deadline.
            assert rc_old == 0 and not old.internal_errors(), old.internal_errors()
            assert exited < DEADLINE + 2.0, exited
            # GOAWAY: only the two early connections ever reached the old ztunnel; every one
            # opened during the drain went to the new one.
            assert len(access_records(old, since_old, "connection opened", "inbound")) == 2
            assert len(access_records(new, since_new, "connection complete", "inbound")) == ok
            # On ztunnel-a's side every connection but the cut one ended cleanly. (The cut one
            # ends with RST_STREAM CANCEL, which HBONE reads as a clean end: reference 2.4.)
            recs = access_records(zta, since_a, "connection complete", "outbound")
            others = [r for r in recs if r["src.addr"] != f"{a.ip4}:{long.port}"]
            assert len(others) == ok + 1 and not [r for r in others if "error" in r], others

            # (d) a second SIGINT during a drain forces the exit (Rust imp::shutdown: code 0).
            held = connect_from(a, b.ip4, ECHO_PORT)  # keeps the new ztunnel's drain busy
            held.sendall(b"held\n")
            assert recv_exact(held, 5) == b"held\n"
            os.kill(new.pid, signal.SIGINT)
            new.wait_for(lambda r: r.get("message") == "received SIGINT, starting graceful drain")
            time.sleep(0.3)
            assert new.proc is not None and new.proc.returncode is None  # still draining
            t1 = time.monotonic()
            os.kill(new.pid, signal.SIGINT)
            assert new.proc.popen.wait(5) == 0
            assert time.monotonic() - t1 < 1.5
            new.wait_for(lambda r: r.get("message") == "Double Ctrl+C, exit immediately")
            assert read_until_closed(held) == b""
            held.close()

            # (d) failing to start: a port already taken, a bad setting.
            failed, rc = spawn(a, env_a)  # zta holds 15000/15020/15021 in pod a
            assert rc == 1, failed.records[-5:]
            failed.wait_for(lambda r: "failed to start" in str(r.get("message")))
            # (PROXY_MODE is exact in Rust; LOG_FORMAT, used here before, never fails there)
            bad, rc = spawn(a, {**env_a, **ALT_PORTS, "PROXY_MODE": "Dedicated"})
            assert rc == 1, bad.records[-5:]  # (Rust: main returns the error)
            bad.wait_for(lambda r: "invalid configuration: PROXY_MODE" in str(r.get("message")))

            # /quitquitquit: POST only; a graceful shutdown, exit 0.
            assert http(a, "127.0.0.1", 15000, "/quitquitquit").status == 405
            r = http(a, "127.0.0.1", 15000, "/quitquitquit", method="POST")
            assert (r.status, r.text) == (200, "shutdown now\n")
            assert zta.proc is not None and zta.proc.popen.wait(5) == 0
            zta.wait_for(lambda r: r.get("message") == "shutdown complete")
            assert not zta.internal_errors(), zta.internal_errors()
        finally:
            for zt in (zta, old, new):
                zt.stop()


@pytest.mark.timeout(60)
def test_drain_does_not_wait_for_idle_pooled_connections() -> None:
    with two_pods() as (_tb, a, b, ca_dir, _ca):
        env = mesh_env(ca_dir, mesh_yaml(a, b), CONNECTION_TERMINATION_DEADLINE="2s")
        zta = ZtunnelProcess(a, {**env, "PROXY_WORKLOAD_INFO": "default/a/sa-a", "NODE_NAME": "n1"})
        ztb = ZtunnelProcess(b, {**env, "PROXY_WORKLOAD_INFO": "default/b/sa-b", "NODE_NAME": "n2"})
        try:
            start_all(zta, ztb)
            start_app(b, "echo", ports=(ECHO_PORT,))
            since_a, since_b = mark(zta), mark(ztb)
            assert echo_roundtrip(a, b.ip4, ECHO_PORT) == b"hello\n"
            access_record(ztb, since_b, "connection complete", "inbound")
            # ztunnel-a has logged its side too, so its stream is done: the pooled connection is
            # idle. (Had ztunnel-a's stream still been open when the GOAWAY came, its pool would
            # close the connection when the stream ends, which a fixed drain must not rely on.)
            access_record(zta, since_a, "connection complete", "outbound")
            t0 = time.monotonic()
            os.kill(ztb.pid, signal.SIGTERM)
            assert ztb.proc is not None and ztb.proc.popen.wait(10) == 0
            took = time.monotonic() - t0
            assert took < 1.0, f"nothing in flight, yet the drain took {took:.1f}s"
        finally:
            for zt in (zta, ztb):
                zt.stop()
