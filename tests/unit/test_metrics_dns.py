"""The DNS proxy's metrics (istio/ztunnel src/dns/metrics.rs): names, label order, the
histogram's buckets and encoding, parsed back by prometheus_client's own parsers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families

from ztunnel.metrics import DNS_LABEL_NAMES, Metrics, dns_labels, encode
from ztunnel.state.model import Workload

CLIENT = Workload(uid="u", name="c1", namespace="ns1", canonical_name="app", canonical_revision="")


def test_dns_metrics_are_registered_only_when_on() -> None:
    reg = CollectorRegistry()
    assert Metrics(reg, process=False).dns is None
    reg = CollectorRegistry()
    m = Metrics(reg, process=False, dns=True)
    assert m.dns is not None
    text = encode(reg).decode()
    for name in ("istio_dns_requests", "istio_dns_upstream_requests"):
        assert f"# TYPE {name} counter" in text
    assert "# TYPE istio_dns_upstream_request_duration_seconds histogram" in text


def test_labels_and_encoding() -> None:
    assert DNS_LABEL_NAMES == (
        "request_query_type",
        "request_protocol",
        "source_canonical_service",
        "source_canonical_revision",
    )
    assert dns_labels("a", "udp", CLIENT) == ("a", "udp", "app", "unknown")
    assert dns_labels("aaaa", "tcp", None) == ("aaaa", "tcp", "unknown", "unknown")
    reg = CollectorRegistry()
    m = Metrics(reg, process=False, dns=True)
    assert m.dns is not None
    labels = dns_labels("a", "udp", CLIENT)
    m.dns.requests.labels(*labels).value += 2
    m.dns.upstream_duration.observe(labels, 0.0007)
    m.dns.upstream_duration.observe(labels, 2.0)
    text = encode(reg).decode()
    assert (
        'istio_dns_requests_total{request_query_type="a",request_protocol="udp",'
        'source_canonical_service="app",source_canonical_revision="unknown"} 2\n'
    ) in text
    lab = (
        'request_query_type="a",request_protocol="udp",'
        'source_canonical_service="app",source_canonical_revision="unknown"'
    )
    assert f"istio_dns_upstream_request_duration_seconds_count{{{lab}}} 2\n" in text
    # Rust's buckets, cumulative, le last
    for le, n in (("0.0005", 0), ("0.001", 1), ("0.01", 1), ("1.0", 1), ("5.0", 2), ("+Inf", 2)):
        assert (
            f'istio_dns_upstream_request_duration_seconds_bucket{{{lab},le="{le}"}} {n}\n' in text
        )
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hist = fams["istio_dns_upstream_request_duration_seconds"]
    assert hist.type == "histogram"
    assert {s.name for s in hist.samples} >= {
        "istio_dns_upstream_request_duration_seconds_sum",
        "istio_dns_upstream_request_duration_seconds_count",
        "istio_dns_upstream_request_duration_seconds_bucket",
    }
    assert "# UNIT istio_dns_upstream_request_duration_seconds seconds" in text
    omf = {f.name: f for f in om_parse(text)}  # type: ignore[no-untyped-call]
    assert omf["istio_dns_requests"].samples[0].value == 2
    assert (
        reg.get_sample_value(
            "istio_dns_requests_total", dict(zip(DNS_LABEL_NAMES, labels, strict=True))
        )
        == 2
    )
