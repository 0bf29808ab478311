"""HBONE request/response headers: baggage, forwarded, traceparent (reference 2.2). Pure."""

from __future__ import annotations

import functools
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


# baggage() per workload object (frozen; a state update brings a new one): id -> (the workload,
# the value). Every HBONE request sends its source's baggage, and every response the local
# workload's. Bounded: cleared when full.
_BAGGAGE_MEMO: dict[int, tuple[Workload, str]] = {}
_BAGGAGE_MEMO_MAX = 1024


def baggage(wl: Workload | None) -> str:
    """``k8s.cluster.name=..,k8s.namespace.name=..,k8s.<type>.name=..,service.name=..,..``
    from the workload alone (Rust ``Workload::baggage``, ``baggage_header_val``): only its
    non-empty fields are sent, so a workload with no ``clusterId`` sends no cluster."""
    if wl is None:
        return ""
    hit = _BAGGAGE_MEMO.get(id(wl))
    if hit is not None and hit[0] is wl:
        return hit[1]
    value = _baggage(wl)
    if len(_BAGGAGE_MEMO) >= _BAGGAGE_MEMO_MAX:
        _BAGGAGE_MEMO.clear()
    _BAGGAGE_MEMO[id(wl)] = (wl, value)
    return value


def _baggage(wl: Workload) -> str:
    pairs = [
        ("k8s.cluster.name", wl.cluster_id),
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


@functools.lru_cache(maxsize=256)
def parse_baggage(value: str | None) -> Baggage:
    """Lenient: unknown keys and malformed members are ignored (baggage is only a hint).

    Memoised (the result is frozen): a peer sends the same baggage on every stream."""
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
    h = os.urandom(24).hex()  # (one getrandom() for both ids)
    return f"00-{h[:32]}-{h[32:]}-00"


def valid_traceparent(value: str | None) -> bool:
    return value is not None and len(value) == 55 and _TRACEPARENT.fullmatch(value) is not None


def request_headers(
    source: Workload | None, client: SocketAddr, *, service_hostname: str | None
) -> list[tuple[str, str]]:
    headers = []
    if bag := baggage(source):
        headers.append((BAGGAGE, bag))
    headers.append((FORWARDED, forwarded(client, service_hostname)))
    headers.append((TRACEPARENT, new_traceparent()))
    return headers
