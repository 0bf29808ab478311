"""The scrape-time exports: xDS counters (istio/ztunnel ``src/xds/metrics.rs``) and the workload
certificate expiry gauge (ours, istio/ztunnel#1748)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from ztunnel.core.identity import Identity
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import CertificateStatus
from ztunnel.metrics import (
    CERT_EXPIRY_METRIC,
    encode,
    export_certificate_expiry,
    export_xds,
)

pytestmark = pytest.mark.timeout(30)


@dataclass
class Counts:
    connection_terminations: dict[str, int] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    message_bytes: dict[str, int] = field(default_factory=dict)


WDS = "type.googleapis.com/istio.workload.Address"


def test_xds_counters_read_when_scraped() -> None:
    reg = CollectorRegistry()
    counts = Counts()
    export_xds(reg, lambda: counts)
    text = encode(reg).decode()
    # Declared before anything happened (Rust registers the families at start).
    assert "# TYPE istio_xds_message counter" in text
    assert "istio_xds_message_total{" not in text
    counts.messages[WDS] = 3
    counts.message_bytes[WDS] = 1200
    counts.connection_terminations["Reconnect"] = 1
    text = encode(reg).decode()
    assert f'istio_xds_message_total{{url="{WDS}"}} 3\n' in text
    assert f'istio_xds_message_bytes_total{{url="{WDS}"}} 1200\n' in text
    assert 'istio_xds_connection_terminations_total{reason="Reconnect"} 1\n' in text
    assert reg.get_sample_value("istio_xds_message_total", {"url": WDS}) == 3


def test_xds_absent_client_exports_no_series() -> None:
    reg = CollectorRegistry()
    export_xds(reg, lambda: None)
    assert "istio_xds_message_total{" not in encode(reg).decode()


def test_certificate_expiry_gauge_per_available_identity() -> None:
    ca = LocalCA.ephemeral(trust_domain="cluster.local", ttl=dt.timedelta(hours=24))
    ident = Identity("cluster.local", "default", "sa-a")
    cert = ca.issue(ident)
    statuses = [
        CertificateStatus(ident, "Available", cert, None),
        CertificateStatus(Identity("cluster.local", "x", "pending"), "Initializing", None, None),
    ]
    now = cert.leaf.not_valid_after_utc.timestamp() - 3600.0
    reg = CollectorRegistry()
    export_certificate_expiry(reg, lambda: statuses, clock=lambda: now)
    assert reg.get_sample_value(CERT_EXPIRY_METRIC, {"identity": str(ident)}) == 3600.0
    text = encode(reg).decode()
    assert "pending" not in text
    statuses.clear()  # the identity is no longer managed: its series goes
    assert f"{CERT_EXPIRY_METRIC}{{" not in encode(reg).decode()
