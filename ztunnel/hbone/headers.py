"""HBONE request/response headers: baggage, forwarded, traceparent (reference 2.2). Pure."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ztunnel.core.addr import SocketAddr
from ztunnel.state.model import Workload

BAGGAGE = "baggage"
FORWARDED = "forwarded"
TRACEPARENT = "traceparent"
# The origin network on the inner CONNECT of double HBONE (Rust X_FORWARDED_NETWORK_HEADER).
X_FORWARDED_NETWORK = "x-forwarded-network"

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def baggage(wl: Workload | None, cluster_id: str = "") -> str:
    """``k8s.cluster.name=..,k8s.namespace.name=..,k8s.<type>.name=..,service.name=..,..``;
    only non-empty fields are sent."""
    if wl is None:
        return ""
    pairs = [
        ("k8s.cluster.name", wl.cluster_id or cluster_id),
        ("k8s.namespace.name", wl.namespace),
        # (Rust baggage_header_val: the type as it is, even empty: ``k8s..name=``)
        (f"k8s.{wl.workload_type}.name", wl.workload_name),
        ("service.name", wl.canonical_name),
        ("service.version", wl.canonical_revision),
        ("cloud.region", wl.locality.region),
        ("cloud.availability_zone", wl.locality.zone),
    ]
    return ",".join(f"{k}={v}" for k, v in pairs if v)


@dataclass(frozen=True, slots=True)
class Baggage:
    cluster_id: str = ""
    namespace: str = ""
    workload_name: str = ""
    workload_type: str = ""
    service_name: str = ""
    service_version: str = ""
    region: str = ""
    zone: str = ""


def parse_baggage(value: str | None) -> Baggage:
    """Lenient: unknown keys and malformed members are ignored (baggage is only a hint)."""
    if not value:
        return Baggage()
    fields: dict[str, str] = {}
    for member in value.split(","):
        key, sep, val = member.strip().partition("=")
        if not sep:
            continue
        key, val = key.strip(), val.split(";", 1)[0].strip()
        if key == "k8s.cluster.name":
            fields["cluster_id"] = val
        elif key == "k8s.namespace.name":
            fields["namespace"] = val
        elif key.startswith("k8s.") and key.endswith(".name") and key.count(".") == 2:
            fields["workload_type"] = key.split(".")[1]
            fields["workload_name"] = val
        elif key == "service.name":
            fields["service_name"] = val
        elif key == "service.version":
            fields["service_version"] = val
        elif key == "cloud.region":
            fields["region"] = val
        elif key == "cloud.availability_zone":
            fields["zone"] = val
    return Baggage(**fields)


def header_value(headers: Sequence[tuple[str, str]], name: str) -> str | None:
    """The first value of ``name`` in a decoded header list (names are lower-case in HTTP/2)."""
    for k, v in headers:
        if k == name:
            return v
    return None


def forwarded(client: SocketAddr, service_hostname: str | None = None) -> str:
    value = f'for="{client}"'
    if service_hostname:
        value += f";host={service_hostname}"
    return value


def forwarded_host(value: str | None) -> str | None:
    """The ``host=`` of a Forwarded header (the inbound side uses only that, as a hint)."""
    if not value:
        return None
    for element in value.split(","):
        for pair in element.split(";"):
            k, sep, v = pair.strip().partition("=")
            if sep and k.strip().lower() == "host":
                return v.strip().strip('"') or None
    return None


def new_traceparent() -> str:
    """A random W3C traceparent, ``00-<32 hex>-<16 hex>-00`` (55 characters)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-00"


def valid_traceparent(value: str | None) -> bool:
    return value is not None and len(value) == 55 and _TRACEPARENT.fullmatch(value) is not None


def request_headers(
    source: Workload | None,
    client: SocketAddr,
    *,
    cluster_id: str,
    service_hostname: str | None,
) -> list[tuple[str, str]]:
    headers = []
    if bag := baggage(source, cluster_id):
        headers.append((BAGGAGE, bag))
    headers.append((FORWARDED, forwarded(client, service_hostname)))
    headers.append((TRACEPARENT, new_traceparent()))
    return headers
