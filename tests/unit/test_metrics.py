"""Metrics: exact traffic label sets and values, per-connection handles, and the encoder."""

from __future__ import annotations

import gzip
import threading

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.core.errors import (
    AuthorizationDenied,
    CertificateRevoked,
    NoHealthyUpstream,
    PolicyLateRejection,
    ProxyError,
    ResponseFlag,
    TlsFailure,
    UpstreamConnectError,
)
from ztunnel.core.identity import Identity
from ztunnel.hbone.headers import parse_baggage
from ztunnel.metrics import (
    TRAFFIC_LABEL_NAMES,
    Family,
    Metrics,
    Reporter,
    SecurityPolicy,
    crl_metrics,
    encode,
    export_xds,
    flag_for,
    traffic_labels,
    wants_openmetrics,
)
from ztunnel.state.model import Locality, Service, Workload

pytestmark = pytest.mark.timeout(30)

CLIENT = Workload(
    uid="Kubernetes//Pod/ns-a/client-1",
    name="client-1",
    namespace="ns-a",
    service_account="client-sa",
    workload_name="client",
    canonical_name="client-app",
    canonical_revision="v1",
    cluster_id="c1",
    locality=Locality("us-east", "us-east-1a"),
)
SERVER = Workload(
    uid="Kubernetes//Pod/ns-b/server-1",
    name="server-1",
    namespace="ns-b",
    service_account="server-sa",
    workload_name="server",
    canonical_name="server-app",
    canonical_revision="v2",
    cluster_id="c2",
    locality=Locality("eu-west", "eu-west-1b"),
)
SVC = Service(name="server", namespace="ns-b", hostname="server.ns-b.svc.cluster.local")


def as_dict(labels: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(TRAFFIC_LABEL_NAMES, labels, strict=False))


def test_label_names_are_the_reference_set_in_order() -> None:
    assert TRAFFIC_LABEL_NAMES == (
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


def test_source_reporter_hbone() -> None:
    labels = traffic_labels(
        Reporter.SOURCE,
        source=CLIENT,
        source_identity=CLIENT.identity,
        destination=SERVER,
        destination_service=SVC,
        security_policy=SecurityPolicy.MUTUAL_TLS,
    )
    assert as_dict(labels) == {
        "reporter": "source",
        "source_workload": "client",
        "source_canonical_service": "client-app",
        "source_canonical_revision": "v1",
        "source_workload_namespace": "ns-a",
        "source_principal": "spiffe://cluster.local/ns/ns-a/sa/client-sa",
        "source_app": "client-app",
        "source_version": "v1",
        "source_cluster": "c1",
        "destination_service": "server.ns-b.svc.cluster.local",
        "destination_service_namespace": "ns-b",
        "destination_service_name": "server",
        "destination_workload": "server",
        "destination_canonical_service": "server-app",
        "destination_canonical_revision": "v2",
        "destination_workload_namespace": "ns-b",
        "destination_principal": "spiffe://cluster.local/ns/ns-b/sa/server-sa",
        "destination_app": "server-app",
        "destination_version": "v2",
        "destination_cluster": "c2",
        "request_protocol": "tcp",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
        "source_region": "us-east",
        "source_zone": "us-east-1a",
        "destination_region": "eu-west",
        "destination_zone": "eu-west-1b",
    }
    assert len(labels) == 27


def test_source_reporter_plaintext_passthrough() -> None:
    # No upstream workload, no service, no mTLS: destination_* unknown, no source principal.
    labels = as_dict(traffic_labels(Reporter.SOURCE, source=CLIENT))
    assert labels["source_principal"] == "unknown"
    assert labels["connection_security_policy"] == "unknown"
    assert all(labels[k] == "unknown" for k in TRAFFIC_LABEL_NAMES[9:20])
    assert labels["destination_region"] == "unknown"
    assert labels["source_region"] == "us-east"


def test_empty_values_are_unknown() -> None:
    bare = Workload(uid="u", name="bare", namespace="ns", cluster_id="")
    labels = as_dict(traffic_labels(Reporter.SOURCE, source=bare, destination=bare))
    assert labels["source_workload"] == "unknown"  # workload_name empty: not the pod name
    assert labels["source_canonical_service"] == "unknown"
    assert labels["source_cluster"] == "unknown"
    assert labels["source_zone"] == "unknown"
    assert labels["destination_principal"] == "spiffe://cluster.local/ns/ns/sa/default"


def test_no_workloads_at_all_omits_locality() -> None:
    labels = traffic_labels(Reporter.DESTINATION)
    assert len(labels) == 23
    assert "source_region" not in as_dict(labels)


def test_destination_reporter_from_baggage() -> None:
    bag = parse_baggage(
        "k8s.cluster.name=c9,k8s.namespace.name=ns-x,k8s.deployment.name=web,"
        "service.name=web-svc,service.version=v7,cloud.region=r,cloud.availability_zone=z"
    )
    peer = Identity("cluster.local", "ns-x", "web-sa")
    labels = as_dict(
        traffic_labels(
            Reporter.DESTINATION,
            source_identity=peer,
            baggage=bag,
            destination=SERVER,
            security_policy=SecurityPolicy.MUTUAL_TLS,
        )
    )
    assert labels["reporter"] == "destination"
    assert labels["source_workload"] == "web"
    assert labels["source_app"] == "web"  # baggage: app is the workload name...
    assert labels["source_canonical_service"] == "web-svc"  # ...canonical service is service.name
    assert labels["source_canonical_revision"] == "v7"
    assert labels["source_version"] == "v7"
    assert labels["source_workload_namespace"] == "ns-x"
    assert labels["source_cluster"] == "c9"
    assert labels["source_principal"] == str(peer)
    assert (labels["source_region"], labels["source_zone"]) == ("r", "z")


def test_destination_reporter_xds_source_wins_over_baggage_but_not_principal() -> None:
    bag = parse_baggage("k8s.deployment.name=liar,service.name=liar-svc")
    peer = Identity("cluster.local", "ns-a", "client-sa")
    labels = as_dict(
        traffic_labels(
            Reporter.DESTINATION,
            source=CLIENT,
            source_identity=peer,
            baggage=bag,
            destination=SERVER,
            security_policy=SecurityPolicy.MUTUAL_TLS,
        )
    )
    assert labels["source_workload"] == "client"
    assert labels["source_app"] == "client-app"  # xDS: app is the canonical name
    assert labels["source_principal"] == str(peer)


def test_destination_identity_override_and_flag() -> None:
    other = Identity("td", "ns", "sa")
    labels = as_dict(
        traffic_labels(
            Reporter.SOURCE,
            destination=SERVER,
            destination_identity=other,
            response_flag=ResponseFlag.DENY,
        )
    )
    assert labels["destination_principal"] == "spiffe://td/ns/ns/sa/sa"
    assert labels["response_flags"] == "DENY"


@pytest.mark.parametrize(
    ("outcome", "flag"),
    [
        (None, ResponseFlag.NONE),
        (AuthorizationDenied("no"), ResponseFlag.DENY),
        (PolicyLateRejection(), ResponseFlag.DENY),
        (CertificateRevoked(), ResponseFlag.CERT_REVOKED),
        (TlsFailure("x"), ResponseFlag.TLS_FAILURE),
        (UpstreamConnectError("refused"), ResponseFlag.CONNECT),
        # Unclassified: CONNECT (Rust extract_failure_reason's catch-all)
        (NoHealthyUpstream("10.0.0.1:80"), ResponseFlag.CONNECT),
        (ProxyError("anything"), ResponseFlag.CONNECT),
        (OSError(), ResponseFlag.CONNECT),
        ("HBONE CONNECT to 10.0.0.1:80 failed with status 401", ResponseFlag.CONNECT),
    ],
)
def test_flag_for(outcome: BaseException | str | None, flag: ResponseFlag) -> None:
    # Rust src/proxy/metrics.rs ConnectionResult::record -> extract_failure_reason
    assert flag_for(outcome) is flag


# --- the metric set --------------------------------------------------------------------------


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def test_connection_lifecycle_outbound(reg: CollectorRegistry) -> None:
    m = Metrics(reg, process=False)
    labels = traffic_labels(
        Reporter.SOURCE,
        source=CLIENT,
        source_identity=CLIENT.identity,
        destination=SERVER,
        destination_service=SVC,
        security_policy=SecurityPolicy.MUTUAL_TLS,
    )
    ld = as_dict(labels)
    conn = m.open_connection(labels)
    assert reg.get_sample_value("istio_tcp_connections_opened_total", ld) == 1
    assert reg.get_sample_value("istio_tcp_connections_closed_total", ld) is None

    # Running totals, local perspective: outbound sent = request = received_bytes metric.
    conn.flush(100, 10)
    assert reg.get_sample_value("istio_tcp_received_bytes_total", ld) == 100
    assert reg.get_sample_value("istio_tcp_sent_bytes_total", ld) == 10
    conn.flush(100, 10)  # no change, no double count
    conn.flush(250, 40)
    assert reg.get_sample_value("istio_tcp_received_bytes_total", ld) == 250
    assert reg.get_sample_value("istio_tcp_sent_bytes_total", ld) == 40

    conn.close(300, 50)
    conn.close(999, 999)  # idempotent
    assert reg.get_sample_value("istio_tcp_received_bytes_total", ld) == 300
    assert reg.get_sample_value("istio_tcp_sent_bytes_total", ld) == 50
    assert reg.get_sample_value("istio_tcp_connections_closed_total", ld) == 1
    assert reg.get_sample_value("istio_tcp_connections_failed_total", ld) is None


def test_connection_inbound_bytes_direction(reg: CollectorRegistry) -> None:
    m = Metrics(reg, process=False)
    labels = traffic_labels(Reporter.DESTINATION, destination=SERVER)
    conn = m.open_connection(labels)
    conn.close(bytes_sent=7, bytes_recv=70)  # inbound: recv = request bytes
    ld = as_dict(labels)
    assert reg.get_sample_value("istio_tcp_received_bytes_total", ld) == 70
    assert reg.get_sample_value("istio_tcp_sent_bytes_total", ld) == 7


def test_failed_connection_is_labelled_with_its_flag(reg: CollectorRegistry) -> None:
    m = Metrics(reg, process=False)
    labels = traffic_labels(Reporter.SOURCE, source=CLIENT, destination=SERVER)
    m.open_connection(labels).close(0, 0, flag=ResponseFlag.CONNECT)
    opened = as_dict(labels)
    failed = {**opened, "response_flags": "CONNECT"}
    assert reg.get_sample_value("istio_tcp_connections_opened_total", opened) == 1
    assert reg.get_sample_value("istio_tcp_connections_closed_total", failed) == 1
    assert reg.get_sample_value("istio_tcp_connections_failed_total", failed) == 1
    assert reg.get_sample_value("istio_tcp_connections_closed_total", opened) is None


def test_open_for_record_gates_source_principal_on_mtls(reg: CollectorRegistry) -> None:
    class Rec:
        direction = "outbound"
        src_workload = CLIENT
        dst_workload = SERVER
        dst_service = SVC
        src_identity = CLIENT.identity
        dst_identity = None
        dst_derived = None

    m = Metrics(reg, process=False)
    plain = m.open_for_record(Rec(), mtls=False)
    hbone = m.open_for_record(Rec(), mtls=True)
    assert as_dict(plain.labels)["source_principal"] == "unknown"
    assert as_dict(plain.labels)["connection_security_policy"] == "unknown"
    assert as_dict(hbone.labels)["source_principal"] == str(CLIENT.identity)
    assert as_dict(hbone.labels)["connection_security_policy"] == "mutual_tls"
    assert hbone.labels[0] == "source"


def test_open_for_record_with_baggage_is_memoised_by_what_the_labels_read(
    reg: CollectorRegistry,
) -> None:
    # Inbound from an unknown source: the source labels come from the peer's baggage (Rust
    # CommonTrafficLabels from baggage). Equal baggage shares one series; any field that
    # reaches a label makes another; a known source workload makes the baggage irrelevant.
    peer = Identity("cluster.local", "ns-a", "client")

    class Rec:
        direction = "inbound"
        src_workload: Workload | None = None
        dst_workload = SERVER
        dst_service = SVC
        src_identity = peer
        dst_identity = SERVER.identity
        dst_derived = None

    m = Metrics(reg, process=False)
    bag = (
        "k8s.namespace.name=ns-a,k8s.deployment.name=client,service.name=client,service.version=v1"
    )
    first = m.open_for_record(Rec(), mtls=True, baggage=parse_baggage(bag))
    again = m.open_for_record(Rec(), mtls=True, baggage=parse_baggage(bag))
    want = traffic_labels(
        Reporter.DESTINATION,
        source_identity=peer,
        baggage=parse_baggage(bag),
        destination=SERVER,
        destination_service=SVC,
        destination_identity=SERVER.identity,
        security_policy=SecurityPolicy.MUTUAL_TLS,
    )
    assert first.labels == again.labels == want
    assert first._series is again._series
    opened = reg.get_sample_value("istio_tcp_connections_opened_total", as_dict(want))
    assert opened == 2
    other = m.open_for_record(
        Rec(), mtls=True, baggage=parse_baggage(bag.replace("v1", "v2"))
    ).labels
    assert as_dict(other)["source_canonical_revision"] == "v2"
    assert m.open_for_record(Rec(), mtls=True).labels != want  # no baggage: "unknown" source
    Rec.src_workload = CLIENT
    known = m.open_for_record(Rec(), mtls=True, baggage=parse_baggage(bag)).labels
    assert known == m.open_for_record(Rec(), mtls=True, baggage=parse_baggage("")).labels
    assert as_dict(known)["source_workload"] == CLIENT.workload_name


def test_sockets_build_inpod_process(reg: CollectorRegistry) -> None:
    m = Metrics(reg, tag="1.2.3", inpod=True)
    m.socket_opened(Reporter.SOURCE)
    m.socket_opened(Reporter.SOURCE)
    m.socket_opened(Reporter.DESTINATION)
    m.socket_closed(Reporter.SOURCE)
    assert reg.get_sample_value("istio_tcp_sockets_open", {"reporter": "source"}) == 1
    assert reg.get_sample_value("istio_tcp_sockets_open", {"reporter": "destination"}) == 1
    assert reg.get_sample_value("istio_build", {"component": "ztunnel", "tag": "1.2.3"}) == 1
    assert m.inpod is not None
    m.inpod.active_proxy_count.set(3)
    m.inpod.proxies_started.inc()
    assert reg.get_sample_value("workload_manager_active_proxy_count") == 3
    assert reg.get_sample_value("workload_manager_pending_proxy_count") == 0
    assert reg.get_sample_value("workload_manager_proxies_started_total") == 1
    assert reg.get_sample_value("workload_manager_proxies_stopped_total") == 0
    fds = reg.get_sample_value("process_open_fds")
    assert fds is not None and fds > 0
    assert reg.get_sample_value("process_max_fds") is not None


def test_no_inpod_metrics_by_default(reg: CollectorRegistry) -> None:
    Metrics(reg, process=False)
    assert reg.get_sample_value("workload_manager_active_proxy_count") is None


def test_two_registries_are_independent() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ma, _ = Metrics(a, process=False), Metrics(b, process=False)
    ma.socket_opened(Reporter.SOURCE)
    assert a.get_sample_value("istio_tcp_sockets_open", {"reporter": "source"}) == 1
    assert b.get_sample_value("istio_tcp_sockets_open", {"reporter": "source"}) == 0


# --- encoding --------------------------------------------------------------------------------


def test_encoding_keeps_label_order(reg: CollectorRegistry) -> None:
    m = Metrics(reg, tag="t")
    labels = traffic_labels(Reporter.SOURCE, source=CLIENT, destination=SERVER)
    m.open_connection(labels)
    text = encode(reg).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("istio_tcp_connections_opened"))
    names = [kv.split("=", 1)[0] for kv in line[line.index("{") + 1 : line.index("}")].split(",")]
    assert names == list(TRAFFIC_LABEL_NAMES)
    assert line.endswith("} 1")
    assert 'istio_build{component="ztunnel",tag="t"} 1\n' in text
    assert "_created" not in text


def test_exposition_is_prometheus_clients_openmetrics(reg: CollectorRegistry) -> None:
    """What Rust's prometheus-client 0.24 writes (encoding/text.rs): OpenMetrics, a counter
    family named without _total and its samples with it, HELP as registered plus a period
    (Registry::register), a # UNIT line for register_with_unit, one # EOF last."""
    m = Metrics(reg, tag="t", dns=True)
    export_xds(reg, lambda: None)
    m.open_connection(traffic_labels(Reporter.SOURCE, source=CLIENT))
    text = encode(reg).decode()
    assert text.endswith("\n# EOF\n") and text.count("# EOF") == 1
    assert (
        "# HELP istio_tcp_connections_opened The total number of TCP connections opened.\n"
        "# TYPE istio_tcp_connections_opened counter\n"
        "istio_tcp_connections_opened_total{"
    ) in text
    assert (
        "# HELP istio_xds_message_bytes Total number of bytes received (unstable).\n"
        "# TYPE istio_xds_message_bytes counter\n"
        "# UNIT istio_xds_message_bytes bytes\n"
    ) in text
    assert (
        "# TYPE istio_dns_upstream_request_duration_seconds histogram\n"
        "# UNIT istio_dns_upstream_request_duration_seconds seconds\n"
    ) in text
    # Rust's process collector writes its HELP as is (no period added).
    assert "# HELP process_open_fds Number of open file descriptors\n" in text
    assert "# HELP process_max_fds Maximum number of file descriptors\n" in text


# Rust's HELP texts (src/**/metrics.rs, Registry::register adds the period), by family.
RUST_HELP = {
    "istio_build": "Istio component build info.",
    "istio_tcp_connections_opened": "The total number of TCP connections opened.",
    "istio_tcp_connections_closed": "The total number of TCP connections closed.",
    "istio_tcp_received_bytes": (
        "The size of total bytes received during request in case of a TCP connection."
    ),
    "istio_tcp_sent_bytes": (
        "The size of total bytes sent during response in case of a TCP connection."
    ),
    "istio_on_demand_dns": "The total number of requests that used on-demand DNS (unstable).",
    "istio_tcp_connections_failed": (
        "The total number of TCP connections that failed to establish (unstable)."
    ),
    "istio_tcp_sockets_open": "The current number of open TCP sockets (unstable).",
    "istio_crl_policy_rejections": (
        "The total number of connections rejected due to CRL certificate revocation (unstable)."
    ),
    "istio_crl_untracked_connections": (
        "The total number of connections not tracked for CRL enforcement (unstable)."
    ),
    "istio_xds_connection_terminations": (
        "The total number of completed connections to xds server (unstable)."
    ),
    "istio_xds_message": "Total number of messages received (unstable).",
    "istio_xds_message_bytes": "Total number of bytes received (unstable).",
    "istio_dns_requests": "Total number of DNS requests (unstable).",
    "istio_dns_upstream_requests": "Total number of DNS requests forwarded to upstream (unstable).",
    "istio_dns_upstream_failures": (
        "Total number of DNS requests that failed to forward upstream (unstable)."
    ),
    "istio_dns_upstream_request_duration_seconds": (
        "Total time in seconds Istio takes to get DNS response from upstream (unstable)."
    ),
    "workload_manager_active_proxy_count": (
        "The total number current workloads with active proxies (unstable)."
    ),
    "workload_manager_pending_proxy_count": (
        "The total number current workloads with pending proxies (unstable)."
    ),
    "workload_manager_proxies_started": "The total number of proxies that were started (unstable).",
    "workload_manager_proxies_stopped": "The total number of proxies that were stopped (unstable).",
    "process_open_fds": "Number of open file descriptors",
    "process_max_fds": "Maximum number of file descriptors",
}


def test_help_texts_are_rusts(reg: CollectorRegistry) -> None:
    Metrics(reg, inpod=True, dns=True)
    export_xds(reg, lambda: None)
    helps = dict(
        line.removeprefix("# HELP ").split(" ", 1)
        for line in encode(reg).decode().splitlines()
        if line.startswith("# HELP ")
    )
    assert {k: v for k, v in helps.items() if k in RUST_HELP} == RUST_HELP


def test_crl_counters_are_registered_without_crl(reg: CollectorRegistry) -> None:
    """Rust proxy::Metrics::new registers both CRL counters whether or not CRL_PATH is set;
    the TLS policy (built first) and the proxies' metrics share them."""
    counters = crl_metrics(reg)
    m = Metrics(reg, process=False)
    assert m.crl is counters
    counters.untracked("destination")
    counters.rejected("source")
    text = encode(reg).decode()
    assert "# TYPE istio_crl_policy_rejections counter\n" in text
    assert 'istio_crl_untracked_connections_total{reporter="destination"} 1\n' in text
    assert 'istio_crl_policy_rejections_total{reporter="source"} 1\n' in text


def test_label_value_escaping(reg: CollectorRegistry) -> None:
    fam = Family("x_things", "Things.", "gauge", ("a", "b"), registry=reg)
    fam.labels('q"uote', "back\\slash\nnl").set(2.5)
    text = encode(reg).decode()
    assert 'x_things{a="q\\"uote",b="back\\\\slash\\nnl"} 2.5\n' in text
    assert reg.get_sample_value("x_things", {"a": 'q"uote', "b": "back\\slash\nnl"}) == 2.5


def test_encoding_parses_with_prometheus_parser(reg: CollectorRegistry) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics(reg, dns=True)
    export_xds(reg, lambda: None)
    conn = m.open_connection(traffic_labels(Reporter.SOURCE, source=CLIENT, destination=SERVER))
    conn.close(5, 6, flag=ResponseFlag.DENY)
    text = encode(reg).decode()
    om = {f.name: f for f in om_parse(text)}  # type: ignore[no-untyped-call]
    assert om["istio_tcp_received_bytes"].samples[0].value == 5
    assert om["istio_xds_message_bytes"].unit == "bytes"
    # Labelled text/plain (Rust's default content type), a text-format parser reads it too.
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["istio_tcp_connections_failed_total"] == 1


def test_scrape_in_another_thread_while_labels_are_added(reg: CollectorRegistry) -> None:
    m = Metrics(reg, process=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                encode(reg)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(3000):
            w = Workload(uid=f"u{i}", name=f"w{i}", namespace="ns", workload_name=f"w{i}")
            m.open_connection(traffic_labels(Reporter.SOURCE, source=w)).close(i, i)
    finally:
        stop.set()
        t.join()
    assert not errors
    assert len(m.connections_opened) == 3000


def test_wants_openmetrics() -> None:
    # Rust metrics/server.rs content_type (and its test_content_type cases)
    assert not wants_openmetrics([])
    assert not wants_openmetrics(["text/plain"])
    assert not wants_openmetrics(["application/json"])
    assert wants_openmetrics(["application/json", "application/openmetrics-text; other stuff"])
    assert wants_openmetrics(
        [
            "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
            "encoding=delimited;q=0.6,application/openmetrics-text;version=1.0.0;"
            "escaping=allow-utf-8;q=0.5,*/*;q=0.1"
        ]
    )
    assert wants_openmetrics(["Application/OpenMetrics-Text"])
    assert not wants_openmetrics(["text/plain, application/openmetrics-text"])  # not trimmed


def test_gzip_roundtrip_sanity(reg: CollectorRegistry) -> None:
    # The stats handler gzips encode() output; make sure it is plain bytes that survive it.
    Metrics(reg, process=False)
    body = encode(reg)
    assert gzip.decompress(gzip.compress(body)) == body


def test_connections_share_their_label_tuple(reg: CollectorRegistry) -> None:
    """A connection's handle keeps the series' own label tuple, not one of its own."""
    m = Metrics(reg, process=False)
    a = m.open_connection(traffic_labels(Reporter.SOURCE, source=CLIENT, destination=SERVER))
    b = m.open_connection(traffic_labels(Reporter.SOURCE, source=CLIENT, destination=SERVER))
    assert a.labels == b.labels and a.labels is b.labels
    assert m.connections_opened.labels(*a.labels).value == 2


def test_open_for_record_memo_matches_the_labels_and_follows_new_objects(
    reg: CollectorRegistry,
) -> None:
    import dataclasses

    class Rec:
        direction = "outbound"
        src_workload: Workload = CLIENT
        dst_workload: Workload = SERVER
        dst_service = SVC
        src_identity = CLIENT.identity
        dst_identity = None
        dst_derived = None

    m = Metrics(reg, process=False)
    first = m.open_for_record(Rec(), mtls=True)
    second = m.open_for_record(Rec(), mtls=True)
    expected = traffic_labels(
        Reporter.SOURCE,
        source=CLIENT,
        source_identity=CLIENT.identity,
        destination=SERVER,
        destination_service=SVC,
        security_policy=SecurityPolicy.MUTUAL_TLS,
    )
    assert first.labels == second.labels == expected
    first.close(1, 2)
    second.close(3, 4, flag=ResponseFlag.CONNECT)
    ld = as_dict(expected)
    assert reg.get_sample_value("istio_tcp_connections_opened_total", ld) == 2
    assert reg.get_sample_value("istio_tcp_connections_closed_total", ld) == 1
    failed = {**ld, "response_flags": "CONNECT"}
    assert reg.get_sample_value("istio_tcp_connections_closed_total", failed) == 1
    assert reg.get_sample_value("istio_tcp_received_bytes_total", ld) == 4
    assert reg.get_sample_value("istio_tcp_sent_bytes_total", ld) == 6
    # A state update brings a new (changed) workload object: its own labels, not the memo's.
    rec = Rec()
    rec.dst_workload = dataclasses.replace(SERVER, namespace="elsewhere")
    third = m.open_for_record(rec, mtls=True)
    assert as_dict(third.labels)["destination_workload_namespace"] == "elsewhere"


def test_guard_events_count_by_reason(reg: CollectorRegistry) -> None:
    """Issue 13: refusals and cuts by a limit or a protocol defence (Python-only metric)."""
    m = Metrics(reg, process=False)
    m.guard_event("h2_flood")
    m.guard_event("h2_flood")
    m.guard_event("fd_budget_connection")
    text = encode(reg).decode()
    assert 'ztunnel_guard_events_total{reason="h2_flood"} 2' in text
    assert 'ztunnel_guard_events_total{reason="fd_budget_connection"} 1' in text


def test_destination_from_derived_baggage() -> None:
    """Rust CommonTrafficLabels::with_derived_destination (double HBONE): the destination_*
    labels come from the inner tunnel's response baggage, destination_app from its workload
    name, the principal from the TLS peer; the gateway workload's own labels are not used."""
    from ztunnel.hbone.headers import parse_baggage

    derived = parse_baggage(
        "k8s.cluster.name=c2,k8s.namespace.name=ns2,k8s.deployment.name=echo,"
        "service.name=echo-app,service.version=v7,"
        "cloud.region=r2,cloud.availability_zone=z2"
    )
    peer = Identity("cluster.local", "ns2", "echo")
    got = as_dict(
        traffic_labels(
            Reporter.SOURCE,
            source=CLIENT,
            destination=SERVER,  # the gateway, as the route names it
            destination_identity=peer,
            destination_baggage=derived,
        )
    )
    assert got["destination_workload"] == "echo"
    assert got["destination_workload_namespace"] == "ns2"
    assert got["destination_canonical_service"] == "echo-app"
    assert got["destination_canonical_revision"] == "v7"
    assert got["destination_app"] == "echo" and got["destination_version"] == "v7"
    assert got["destination_cluster"] == "c2"
    assert got["destination_principal"] == str(peer)
