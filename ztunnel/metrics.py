"""Prometheus metrics in ztunnel's names and label sets, and an encoder that keeps label order.

One :class:`Metrics` is built by the composition root on one ``CollectorRegistry`` (never the
global one) and passed down. Invariants:

* Values are mutated only from the event-loop thread; a scrape may run in another thread and only
  reads them (a float/int attribute read is atomic under the GIL). New label sets are added under a
  small lock so a concurrent scrape never sees a dict change size.
* The exposition is what Rust's prometheus-client writes (OpenMetrics text, ``# UNIT`` lines,
  ``# EOF``), label values in the Rust encoding order (reference 6.1), which prometheus_client's
  own encoders cannot do (they sort label names): use :func:`encode` for the wire format.
  ``registry.get_sample_value`` still works on everything here.
* The data path never looks labels up per chunk: a :class:`ConnectionMetrics` handle resolves its
  counters once, when the connection is opened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as _om_latest
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ztunnel import __version__, proctree
from ztunnel.core.errors import ProxyError, ResponseFlag

if TYPE_CHECKING:
    from ztunnel.core.identity import Identity
    from ztunnel.state.model import Service, Workload

__all__ = [
    "OPENMETRICS_CONTENT_TYPE",
    "TEXT_CONTENT_TYPE",
    "TRAFFIC_LABEL_NAMES",
    "BaggageLike",
    "Cell",
    "ConnectionMetrics",
    "CrlMetrics",
    "DnsMetrics",
    "Family",
    "HistogramCell",
    "HistogramFamily",
    "InpodMetrics",
    "Metrics",
    "ProcessMetrics",
    "Reporter",
    "SecurityPolicy",
    "crl_metrics",
    "dns_labels",
    "encode",
    "encode_chunks",
    "encode_chunks_async",
    "export_certificate_expiry",
    "export_state_store",
    "export_xds",
    "flag_for",
    "reporter_for_direction",
    "traffic_labels",
    "wants_openmetrics",
]

# The body is OpenMetrics text either way; these are the content types Rust labels it with
# (src/metrics/server.rs ContentType), the second when the client's Accept names OpenMetrics.
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text;charset=utf-8;version=1.0.0"

UNKNOWN = "unknown"


class Reporter(enum.Enum):
    """Which side reports: ``source`` for outbound, ``destination`` for inbound."""

    SOURCE = "source"
    DESTINATION = "destination"


class SecurityPolicy(enum.Enum):
    UNKNOWN = "unknown"  # plaintext, passthrough
    MUTUAL_TLS = "mutual_tls"  # HBONE


# The full traffic label set, in the Rust encoding order (istio/ztunnel src/proxy/metrics.rs
# CommonTrafficLabels). The last four (locality) are present only when a source or destination
# workload is known (Rust OptionallyEncode): traffic_labels() then returns 23 values, not 27.
TRAFFIC_LABEL_NAMES: tuple[str, ...] = (
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
_FLAG_INDEX = TRAFFIC_LABEL_NAMES.index("response_flags")
_NO_FLAG: str = ResponseFlag.NONE.value  # (an enum's .value is a descriptor call each time)


class BaggageLike(Protocol):
    """The fields of an incoming ``baggage`` header (``ztunnel.hbone.headers.Baggage`` fits)."""

    @property
    def cluster_id(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def workload_name(self) -> str: ...
    @property
    def service_name(self) -> str: ...
    @property
    def service_version(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def zone(self) -> str: ...


def _v(s: str | None) -> str:
    return s if s else UNKNOWN


def traffic_labels(
    reporter: Reporter,
    *,
    source: Workload | None = None,
    source_identity: Identity | None = None,
    baggage: BaggageLike | None = None,
    destination: Workload | None = None,
    destination_service: Service | None = None,
    destination_identity: Identity | None = None,
    destination_baggage: BaggageLike | None = None,
    security_policy: SecurityPolicy = SecurityPolicy.UNKNOWN,
    response_flag: ResponseFlag = ResponseFlag.NONE,
) -> tuple[str, ...]:
    """The traffic label values, in :data:`TRAFFIC_LABEL_NAMES` order. Pure.

    Rules (Rust ``ConnectionOpen`` -> ``CommonTrafficLabels``):

    * ``source_*`` come from ``baggage`` first (destination reporter: the peer's ``baggage``;
      ``source_app`` = baggage workload name, ``source_canonical_service`` = ``service.name``),
      then, when ``source`` (the xDS workload: the local one outbound, the one found by source IP
      inbound) is known, from it entirely (``source_app`` = canonical name there).
    * ``source_principal`` is ``source_identity`` only: the mTLS identity (outbound: our own when
      we do mTLS; inbound: the verified peer). Never taken from the workload record.
    * ``destination_*`` from ``destination`` (the chosen upstream); ``destination_principal`` is
      ``destination_identity`` if given, else the destination workload's identity.
    * ``destination_baggage`` (double HBONE: the inner tunnel's response) replaces them all but
      the principal, which stays ``destination_identity`` (Rust ``with_derived_destination``:
      ``destination_app`` is the workload name there).
    * Missing or empty values are ``unknown``. Locality labels are appended only when a source,
      baggage or destination is known.
    """
    s_workload = s_canon = s_rev = s_ns = s_app = s_ver = s_cluster = s_region = s_zone = ""
    if baggage is not None:
        s_workload = baggage.workload_name
        s_canon = baggage.service_name
        s_rev = baggage.service_version
        s_ns = baggage.namespace
        s_app = baggage.workload_name
        s_ver = baggage.service_version
        s_cluster = baggage.cluster_id
        s_region, s_zone = baggage.region, baggage.zone
    if source is not None:
        s_workload = source.workload_name
        s_canon = source.canonical_name
        s_rev = source.canonical_revision
        s_ns = source.namespace
        s_app = source.canonical_name
        s_ver = source.canonical_revision
        s_cluster = source.cluster_id
        s_region, s_zone = source.locality.region, source.locality.zone

    d_region = destination.locality.region if destination is not None else ""
    d_zone = destination.locality.zone if destination is not None else ""
    if destination_baggage is not None:
        b = destination_baggage
        dst: tuple[str, ...] = (
            _v(b.workload_name),
            _v(b.service_name),
            _v(b.service_version),
            _v(b.namespace),
            str(destination_identity) if destination_identity is not None else UNKNOWN,
            _v(b.workload_name),
            _v(b.service_version),
            _v(b.cluster_id),
        )
        d_region, d_zone = b.region, b.zone
    elif destination is not None:
        d = destination
        principal = destination_identity if destination_identity is not None else d.identity
        dst = (
            _v(d.workload_name),
            _v(d.canonical_name),
            _v(d.canonical_revision),
            _v(d.namespace),
            str(principal),
            _v(d.canonical_name),
            _v(d.canonical_revision),
            _v(d.cluster_id),
        )
    else:
        principal_s = str(destination_identity) if destination_identity is not None else UNKNOWN
        dst = (UNKNOWN,) * 4 + (principal_s,) + (UNKNOWN,) * 3

    svc = destination_service
    labels = (
        reporter.value,
        _v(s_workload),
        _v(s_canon),
        _v(s_rev),
        _v(s_ns),
        str(source_identity) if source_identity is not None else UNKNOWN,
        _v(s_app),
        _v(s_ver),
        _v(s_cluster),
        _v(svc.hostname) if svc is not None else UNKNOWN,
        _v(svc.namespace) if svc is not None else UNKNOWN,
        _v(svc.name) if svc is not None else UNKNOWN,
        *dst,
        "tcp",
        response_flag.value,
        security_policy.value,
    )
    if source is None and baggage is None and destination is None and destination_baggage is None:
        return labels
    return (*labels, _v(s_region), _v(s_zone), _v(d_region), _v(d_zone))


def with_flag(labels: tuple[str, ...], flag: ResponseFlag) -> tuple[str, ...]:
    """``labels`` with ``response_flags`` replaced."""
    if labels[_FLAG_INDEX] == flag.value:
        return labels
    return (*labels[:_FLAG_INDEX], flag.value, *labels[_FLAG_INDEX + 1 :])


def flag_for(error: BaseException | str | None) -> ResponseFlag:
    """The response flag an outcome carries (Rust ``ConnectionResult::record``,
    ``extract_failure_reason``): ``-`` for success, a ``ProxyError``'s own flag, and
    ``CONNECT`` for any other failure (an unclassified error, an error text)."""
    if error is None:
        return ResponseFlag.NONE
    if isinstance(error, ProxyError) and error.flag is not ResponseFlag.NONE:
        return error.flag
    return ResponseFlag.CONNECT


def reporter_for_direction(direction: str) -> Reporter:
    """``"outbound"`` -> source, anything else (``"inbound"``) -> destination."""
    return Reporter.SOURCE if direction == "outbound" else Reporter.DESTINATION


# --- cells and families --------------------------------------------------------------------------


class Cell:
    """One time series. Mutate from the event-loop thread only."""

    __slots__ = ("key", "text", "value")

    def __init__(self, key: tuple[str, ...] = ()) -> None:
        self.key = key
        self.value: int | float = 0
        self.text: str | None = None  # rendered ``{k="v",...}``, filled lazily by the encoder

    def inc(self, amount: int | float = 1) -> None:
        self.value += amount

    def dec(self, amount: int | float = 1) -> None:
        self.value -= amount

    def set(self, value: int | float) -> None:
        self.value = value

    def get(self) -> int | float:
        return self.value


def _escape(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        v = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _render_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not values:
        return ""
    return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=False)) + "}"


def _fmt_value(v: int | float) -> str:
    if isinstance(v, int):
        return str(v)
    return floatToGoString(v)  # type: ignore[no-untyped-call, no-any-return]


def _escape_help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def _descriptor(name: str, doc: str, kind: str, unit: str) -> Iterator[str]:
    """prometheus-client's ``encode_descriptor``: HELP, TYPE and, with a unit, UNIT."""
    yield f"# HELP {name} {_escape_help(doc)}\n"
    yield f"# TYPE {name} {kind}\n"
    if unit:
        yield f"# UNIT {name} {unit}\n"


class Family:
    """A counter or gauge family whose label values are tuples in a fixed order.

    A tuple may be shorter than ``labelnames``: the missing trailing labels are simply absent from
    that series (Rust's optionally-encoded label groups). A collector for prometheus_client.
    ``documentation`` is the HELP text as written (prometheus-client's ``Registry::register``
    adds a period to Rust's texts: so do ours); ``unit`` adds the ``# UNIT`` line of Rust's
    ``register_with_unit`` (``name`` then ends with ``_<unit>``).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: Literal["counter", "gauge"],
        labelnames: Sequence[str] = (),
        *,
        unit: str = "",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.kind = kind
        self.unit = unit
        self.labelnames = tuple(labelnames)
        self._cells: dict[tuple[str, ...], Cell] = {}
        self._lock = threading.Lock()
        self._sample_name = name + "_total" if kind == "counter" else name
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> Cell:
        """The series for ``values`` (created on first use). Cache the result on hot paths."""
        cell = self._cells.get(values)
        if cell is None:
            if len(values) > len(self.labelnames):
                raise ValueError(
                    f"{self.name}: {len(values)} label values for {len(self.labelnames)} names"
                )
            with self._lock:
                cell = self._cells.setdefault(values, Cell(values))
        return cell

    def __len__(self) -> int:
        return len(self._cells)

    def _snapshot(self) -> list[Cell]:
        # values(), not items(): one list, no per-series tuples for the GC to chase.
        with self._lock:
            return list(self._cells.values())

    # prometheus_client collector protocol
    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> Iterator[Metric]:
        yield _FamilySnapshot(self, self._snapshot())

    def render(self, cells: list[Cell]) -> Iterator[str]:
        """OpenMetrics lines for this family (HELP, TYPE, UNIT, samples), labels in tuple
        order; a counter's samples are ``<name>_total``."""
        yield from _descriptor(self.name, self.documentation, self.kind, self.unit)
        prefix = self._sample_name
        names = self.labelnames
        for cell in cells:
            text = cell.text
            if text is None:
                text = cell.text = _render_labels(names, cell.key)
            yield f"{prefix}{text} {_fmt_value(cell.value)}\n"


class _FamilySnapshot(Metric):
    """A point-in-time view of a :class:`Family`; ``samples`` is built only if someone asks
    (subclasses say how in :meth:`_build`)."""

    def __init__(self, family: Family, cells: list[Cell]) -> None:
        super().__init__(family.name, family.documentation, family.kind)
        self.family = family
        self.cells = cells
        self._built = False

    def _build(self) -> list[Sample]:
        name, names = self.family._sample_name, self.family.labelnames
        return [
            Sample(name, dict(zip(names, cell.key, strict=False)), cell.value, None, None)
            for cell in self.cells
        ]

    @property
    def samples(self) -> list[Sample]:
        if not self._built:
            self._samples = self._build()
            self._built = True
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        # Metric.__init__ assigns an empty list; anything assigned later replaces the view.
        self._samples = value
        self._built = bool(value)


class _One:
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


def _lines(registry: CollectorRegistry) -> Iterator[str]:
    for metric in registry.collect():
        if isinstance(metric, _FamilySnapshot):
            yield from metric.family.render(metric.cells)
        else:  # another collector: prometheus_client's own OpenMetrics encoder
            chunk = _om_latest(_One(metric)).decode("utf-8")  # type: ignore[no-untyped-call]
            yield chunk.removesuffix("# EOF\n")
    yield "# EOF\n"


def encode_chunks(
    registry: CollectorRegistry, *, chunk_size: int = 64 * 1024, yield_gil: bool = False
) -> list[bytes]:
    """The exposition as a list of roughly ``chunk_size`` byte strings.

    Chunks keep every allocation small, so no single C call (join, encode, page faults of one
    huge buffer) holds the GIL for long, and the server can write the body piecewise. In a worker
    thread pass ``yield_gil=True``: the thread then releases the GIL after each chunk, so the
    event loop does not wait out whole switch intervals (5 ms each) to run.
    """
    chunks: list[bytes] = []
    pending: list[str] = []
    size = 0
    for line in _lines(registry):
        pending.append(line)
        size += len(line)
        if size >= chunk_size:
            chunks.append("".join(pending).encode("utf-8"))
            pending.clear()
            size = 0
            if yield_gil:
                time.sleep(0)
    if pending:
        chunks.append("".join(pending).encode("utf-8"))
    return chunks


async def encode_chunks_async(
    registry: CollectorRegistry, *, chunk_size: int = 64 * 1024
) -> list[bytes]:
    """:func:`encode_chunks` on the event loop, yielding to other tasks after every chunk: no
    thread, no GIL hand-offs; each loop turn does at most one chunk of work."""
    chunks: list[bytes] = []
    pending: list[str] = []
    size = 0
    for line in _lines(registry):
        pending.append(line)
        size += len(line)
        if size >= chunk_size:
            chunks.append("".join(pending).encode("utf-8"))
            pending.clear()
            size = 0
            await asyncio.sleep(0)
    if pending:
        chunks.append("".join(pending).encode("utf-8"))
    return chunks


def encode(registry: CollectorRegistry) -> bytes:
    """The registry in OpenMetrics 1.0.0 text, as Rust's prometheus-client encodes it (the body
    Rust sends whatever the client accepts).

    Families built here keep their label order; any other collector is encoded by
    prometheus_client itself. Thread-safe against event-loop mutation; CPU-bound, so run it off
    the loop (``asyncio.to_thread``) for large registries, or use :func:`encode_chunks`.
    """
    return b"".join(encode_chunks(registry))


def wants_openmetrics(accept: Iterable[str]) -> bool:
    """Whether the ``Accept`` headers' values name ``application/openmetrics-text`` (Rust
    ``metrics::server::content_type``: each comma-separated member lower-cased, its media
    type the text before the first ``;``, compared as is: a member after ``, `` starts with
    the space and does not count). Only the content type depends on it."""
    return any(
        member.lower().split(";", 1)[0] == "application/openmetrics-text"
        for value in accept
        for member in value.split(",")
    )


# --- the metric set ------------------------------------------------------------------------------


ON_DEMAND_DNS_LABEL_NAMES = (
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "hostname",
)


class InpodMetrics:
    """In-pod proxy counts. Names as istio/ztunnel HEAD registers them: on the root registry
    under ``workload_manager_`` (the README's ``istio_active_proxy_count_total`` etc. are older
    names)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.active_proxy_count = Family(
            "workload_manager_active_proxy_count",
            "The total number current workloads with active proxies (unstable).",
            "gauge",
            registry=registry,
        ).labels()
        self.pending_proxy_count = Family(
            "workload_manager_pending_proxy_count",
            "The total number current workloads with pending proxies (unstable).",
            "gauge",
            registry=registry,
        ).labels()
        self.proxies_started = Family(
            "workload_manager_proxies_started",
            "The total number of proxies that were started (unstable).",
            "counter",
            registry=registry,
        ).labels()
        self.proxies_stopped = Family(
            "workload_manager_proxies_stopped",
            "The total number of proxies that were stopped (unstable).",
            "counter",
            registry=registry,
        ).labels()


class _Sourced(Family):
    """A family whose values are copied from ``source`` (label tuple -> value) when scraped:
    the counting stays a plain dict increment where it happens, and the exporter costs nothing
    until someone scrapes. Series never disappear once seen (counters), unless ``replace``
    (gauges of a current set, e.g. one per live certificate)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: Literal["counter", "gauge"],
        labelnames: Sequence[str],
        source: Callable[[], Iterable[tuple[tuple[str, ...], int | float]]],
        *,
        registry: CollectorRegistry,
        replace: bool = False,
        unit: str = "",
    ) -> None:
        super().__init__(name, documentation, kind, labelnames, unit=unit, registry=registry)
        self._source = source
        self._replace = replace

    def collect(self) -> Iterator[Metric]:
        try:
            values = list(self._source())
        except Exception:  # a scrape never fails because one source did
            values = []
        if self._replace:
            with self._lock:
                self._cells.clear()
        for key, value in values:
            self.labels(*key).set(value)
        yield from super().collect()


class XdsCounts(Protocol):
    """``ztunnel.xds.client.XdsMetrics``: plain counters kept by the ADS client."""

    @property
    def connection_terminations(self) -> dict[str, int]: ...
    @property
    def messages(self) -> dict[str, int]: ...
    @property
    def message_bytes(self) -> dict[str, int]: ...


class CertificateLike(Protocol):
    """``ztunnel.identity.manager.CertificateStatus`` (only ``Available`` ones are exported)."""

    @property
    def identity(self) -> Identity: ...
    @property
    def state(self) -> str: ...
    @property
    def certificate(self) -> object | None: ...


def export_xds(registry: CollectorRegistry, counts: Callable[[], XdsCounts | None]) -> None:
    """The xDS client's counters, named and labelled as istio/ztunnel ``src/xds/metrics.rs``:
    ``istio_xds_connection_terminations_total{reason}`` (ConnectionError, Error, Reconnect,
    Complete), ``istio_xds_message_total{url}`` and ``istio_xds_message_bytes_total{url}`` (the
    resources' bytes of each response, by type URL)."""

    def items(pick: Callable[[XdsCounts], dict[str, int]]) -> list[tuple[tuple[str], int]]:
        c = counts()
        return [] if c is None else [((k,), v) for k, v in sorted(pick(c).copy().items())]

    _Sourced(
        "istio_xds_connection_terminations",
        "The total number of completed connections to xds server (unstable).",
        "counter",
        ("reason",),
        lambda: items(lambda c: c.connection_terminations),
        registry=registry,
    )
    _Sourced(
        "istio_xds_message",
        "Total number of messages received (unstable).",
        "counter",
        ("url",),
        lambda: items(lambda c: c.messages),
        registry=registry,
    )
    _Sourced(
        "istio_xds_message_bytes",
        "Total number of bytes received (unstable).",
        "counter",
        ("url",),
        lambda: items(lambda c: c.message_bytes),
        unit="bytes",  # (Rust register_with_unit: "# UNIT istio_xds_message_bytes bytes")
        registry=registry,
    )


CERT_EXPIRY_METRIC = "istio_workload_cert_expiry_seconds"


def export_certificate_expiry(
    registry: CollectorRegistry,
    statuses: Callable[[], Iterable[CertificateLike]],
    clock: Callable[[], float] = time.time,
) -> None:
    """Beyond Rust (istio/ztunnel#1748): ``istio_workload_cert_expiry_seconds{identity}``, the
    seconds until each available workload certificate (the leaf) expires, computed when
    scraped; an identity no longer managed disappears. (The sidecar's counterpart is
    ``istio_agent_cert_expiry_seconds``.)"""

    def values() -> list[tuple[tuple[str], float]]:
        now = clock()
        out = []
        for st in statuses():
            cert = st.certificate
            if st.state != "Available" or cert is None:
                continue
            not_after = cert.leaf.not_valid_after_utc.timestamp()  # type: ignore[attr-defined]
            out.append(((str(st.identity),), round(not_after - now, 3)))
        return out

    _Sourced(
        CERT_EXPIRY_METRIC,
        "Seconds until the workload certificate of this identity expires (unstable).",
        "gauge",
        ("identity",),
        values,
        registry=registry,
        replace=True,
    )


class StoreLike(Protocol):
    """``ztunnel.state.store.State`` as its metrics read it."""

    def store_sizes(self) -> dict[str, int]: ...
    def counts(self) -> dict[str, int]: ...


class RefusalCounts(Protocol):
    """``ztunnel.xds.client.XdsMetrics``: what it refused."""

    @property
    def store_errors(self) -> int: ...
    @property
    def oversized(self) -> int: ...
    @property
    def oversized_resources(self) -> int: ...


def export_state_store(
    registry: CollectorRegistry,
    state: StoreLike,
    refusals: Callable[[], RefusalCounts | None],
) -> None:
    """Beyond Rust, the shared state store (``ztunnel/state/shared.py``) and what istiod sent
    that it could not take: ``ztunnel_state_store_bytes{kind}`` (``used``: pages in use,
    ``file``: the data file, ``limit``: ZTUNNEL_STATE_MAX_BYTES), ``ztunnel_state_objects{kind}``
    (workloads, services, policies, strings) and ``ztunnel_xds_refused_total{reason}``
    (``state_store_full``: a response NACKed whole, the last state kept;
    ``message_too_large``: a message over 200 MiB, the stream restarted;
    ``resource_too_large``: a resource over 1 MiB, NACKed alone)."""

    def sizes() -> list[tuple[tuple[str], int]]:
        return [((k,), v) for k, v in sorted(state.store_sizes().items())]

    def objects() -> list[tuple[tuple[str], int]]:
        return [((k,), v) for k, v in sorted(state.counts().items())]

    def refused() -> list[tuple[tuple[str], int]]:
        r = refusals()
        if r is None:
            return []
        return [
            (("message_too_large",), r.oversized),
            (("resource_too_large",), r.oversized_resources),
            (("state_store_full",), r.store_errors),
        ]

    _Sourced(
        "ztunnel_state_store_bytes",
        "Bytes of the shared state store: used, file, limit (unstable).",
        "gauge",
        ("kind",),
        sizes,
        registry=registry,
    )
    _Sourced(
        "ztunnel_state_objects",
        "Workloads, services, policies and strings in the shared state store (unstable).",
        "gauge",
        ("kind",),
        objects,
        registry=registry,
    )
    _Sourced(
        "ztunnel_xds_refused",
        "xDS input refused: message_too_large, resource_too_large, state_store_full (unstable).",
        "counter",
        ("reason",),
        refused,
        registry=registry,
    )


class CrlMetrics:
    """``istio_crl_policy_rejections_total{reporter}`` and
    ``istio_crl_untracked_connections_total{reporter}`` (Rust ``proxy::Metrics``: registered
    whether or not ``CRL_PATH`` is set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.policy_rejections = Family(
            "istio_crl_policy_rejections",
            "The total number of connections rejected due to CRL certificate revocation "
            "(unstable).",
            "counter",
            ("reporter",),
            registry=registry,
        )
        self.untracked_connections = Family(
            "istio_crl_untracked_connections",
            "The total number of connections not tracked for CRL enforcement (unstable).",
            "counter",
            ("reporter",),
            registry=registry,
        )

    def rejected(self, reporter: str) -> None:
        self.policy_rejections.labels(reporter).value += 1

    def untracked(self, reporter: str) -> None:
        self.untracked_connections.labels(reporter).value += 1


_crl_metrics: weakref.WeakKeyDictionary[CollectorRegistry, CrlMetrics] = weakref.WeakKeyDictionary()


def crl_metrics(registry: CollectorRegistry) -> CrlMetrics:
    """The CRL counters of ``registry``, registered on first use: the TLS policy (built before
    the proxies' metrics) and :class:`Metrics` share them."""
    got = _crl_metrics.get(registry)
    if got is None:
        got = _crl_metrics[registry] = CrlMetrics(registry)
    return got


class ProcessMetrics:
    """``process_*`` of the whole ztunnel: this process and ``pids()``, the others of its tree
    (the zygote and the data-plane workers, set by the supervisor), read from ``/proc`` when
    scraped. ``process_open_fds``, ``process_cpu_seconds_total`` and the memory figures are
    summed over the tree; ``process_max_fds`` is the lowest limit (each process runs out at its
    own). Rust's two (``src/metrics/process.rs``) keep its HELP texts; the others keep
    prometheus_client's names, which Istio's dashboards query. CPU counted by a process that is
    gone (a worker restarted) stays in the total: a counter never goes down."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pids: Callable[[], Iterable[int]] = tuple
        self.open_fds = Family("process_open_fds", "Number of open file descriptors", "gauge")
        self.max_fds = Family("process_max_fds", "Maximum number of file descriptors", "gauge")
        self.cpu = Family(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            "counter",
            unit="seconds",
        )
        self.resident = Family(
            "process_resident_memory_bytes", "Resident memory size in bytes.", "gauge", unit="bytes"
        )
        self.virtual = Family(
            "process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", unit="bytes"
        )
        self.start = Family(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            "gauge",
            unit="seconds",
        )
        self._families = (
            self.open_fds,
            self.max_fds,
            self.cpu,
            self.resident,
            self.virtual,
            self.start,
        )
        self._started = proctree.start_time()
        self._cpu_seen: dict[int, float] = {}  # pid -> its CPU seconds at the last scrape
        self._cpu_gone = 0.0  # of processes no longer in the tree
        registry.register(self)

    def figures(self) -> proctree.ProcessFigures:
        """The tree's figures now (and the CPU of processes gone since the last call kept)."""
        read: dict[int, proctree.ProcessFigures] = {}
        for pid in dict.fromkeys((os.getpid(), *self.pids())):
            got = proctree.read(pid)
            if got is not None:
                read[pid] = got
        for pid in [p for p in self._cpu_seen if p not in read]:
            self._cpu_gone += self._cpu_seen.pop(pid)
        for pid, f in read.items():
            self._cpu_seen[pid] = f.cpu_seconds
        tree = proctree.total(read.values())
        return dataclasses.replace(tree, cpu_seconds=tree.cpu_seconds + self._cpu_gone)

    def describe(self) -> list[Metric]:
        return [m for f in self._families for m in f.describe()]

    def collect(self) -> Iterator[Metric]:
        tree = self.figures()
        self.open_fds.labels().set(tree.open_fds)
        if tree.max_fds is not None:
            self.max_fds.labels().set(tree.max_fds)
        self.cpu.labels().set(round(tree.cpu_seconds, 2))
        self.resident.labels().set(tree.resident_bytes)
        self.virtual.labels().set(tree.virtual_bytes)
        if self._started is not None:
            self.start.labels().set(self._started)
        for f in self._families:
            yield from f.collect()


class Metrics:
    """Every ztunnel metric, registered on ``registry``. Build once; pass down.

    ``inpod`` adds the workload-manager proxy counts (shared mode only, as in Rust); ``dns``
    the DNS proxy's ``istio_dns_*``; ``process`` the ``process_*`` figures of the process tree
    (:class:`ProcessMetrics`); ``build_info`` sets ``istio_build``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        tag: str = __version__,
        inpod: bool = False,
        process: bool = True,
        dns: bool = False,
        build_info: bool = True,
    ) -> None:
        self.registry = registry
        labels = TRAFFIC_LABEL_NAMES
        self.connections_opened = Family(
            "istio_tcp_connections_opened",
            "The total number of TCP connections opened.",
            "counter",
            labels,
            registry=registry,
        )
        self.connections_closed = Family(
            "istio_tcp_connections_closed",
            "The total number of TCP connections closed.",
            "counter",
            labels,
            registry=registry,
        )
        self.received_bytes = Family(
            "istio_tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection.",
            "counter",
            labels,
            registry=registry,
        )
        self.sent_bytes = Family(
            "istio_tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection.",
            "counter",
            labels,
            registry=registry,
        )
        self.connections_failed = Family(
            "istio_tcp_connections_failed",
            "The total number of TCP connections that failed to establish (unstable).",
            "counter",
            labels,
            registry=registry,
        )
        self.sockets_open = Family(
            "istio_tcp_sockets_open",
            "The current number of open TCP sockets (unstable).",
            "gauge",
            ("reporter",),
            registry=registry,
        )
        self._socket_cells = {r: self.sockets_open.labels(r.value) for r in Reporter}
        # open_for_record, memoised by the identity of what the labels derive from (those
        # objects are kept in the value, so their ids cannot be reused meanwhile) and the
        # baggage fields that count (see there):
        # the label tuple and its cells, instead of ~30 label values and three series lookups
        # per connection. Bounded; a state update brings new objects, hence new keys.
        self._series_memo: dict[tuple[object, ...], tuple[_Series, tuple[object, ...]]] = {}
        build = Family(
            "istio_build",
            "Istio component build info.",
            "gauge",
            ("component", "tag"),
            registry=registry,
        )
        if build_info:  # (once per ztunnel: data-plane workers leave it to the supervisor)
            build.labels("ztunnel", tag).set(1)
        # Rust proxy/metrics.rs on_demand_dns (OnDemandDnsLabels): ServiceEntry endpoints
        # resolved by hostname when a connection picks them.
        self.on_demand_dns = Family(
            "istio_on_demand_dns",
            "The total number of requests that used on-demand DNS (unstable).",
            "counter",
            ON_DEMAND_DNS_LABEL_NAMES,
            registry=registry,
        )
        self.inpod = InpodMetrics(registry) if inpod else None
        # Python-only (issue 13): connections, streams and peers refused or cut by a resource
        # limit or a protocol defence, by reason (a fixed small set; README "Security").
        self.guard_events = Family(
            "ztunnel_guard_events",
            "Connections, streams and peers refused or cut by a limit or protocol defence.",
            "counter",
            ("reason",),
            registry=registry,
        )
        self.dns = DnsMetrics(registry) if dns else None  # the DNS proxy, when it is on
        self.crl = crl_metrics(registry)
        self.process = ProcessMetrics(registry) if process else None

    def on_demand_dns_used(self, source: Any, hostname: str) -> None:
        """Count one on-demand DNS resolution of ``hostname`` by a connection from
        ``source`` (a Workload or None)."""
        if source is None:
            values = ("unknown",) * 8
        else:
            values = (
                source.workload_name or "unknown",
                source.canonical_name or "unknown",
                source.canonical_revision or "unknown",
                source.namespace or "unknown",
                str(source.identity),
                source.canonical_name or "unknown",
                source.canonical_revision or "unknown",
                source.cluster_id or "unknown",
            )
        self.on_demand_dns.labels(*values, hostname or "unknown").inc()

    # -- sockets ------------------------------------------------------------------------------

    def socket_opened(self, reporter: Reporter) -> None:
        """An accepted socket (outbound listener: source; inbound listeners: destination)."""
        self._socket_cells[reporter].value += 1

    def socket_closed(self, reporter: Reporter) -> None:
        self._socket_cells[reporter].value -= 1

    def guard_event(self, reason: str) -> None:
        """Count one refusal or cut (``guard_events``)."""
        self.guard_events.labels(reason).value += 1

    # -- connections --------------------------------------------------------------------------

    def open_connection(self, labels: tuple[str, ...]) -> ConnectionMetrics:
        """Count a connection as opened (route chosen) and return its handle.

        ``labels`` come from :func:`traffic_labels` (response flag ``-``)."""
        return ConnectionMetrics(self, labels)

    def open_for_record(
        self,
        rec: RecordLike,
        *,
        mtls: bool,
        baggage: BaggageLike | None = None,
    ) -> ConnectionMetrics:
        """:meth:`open_connection` from a ``ConnectionRecord``-shaped object.

        ``rec.src_identity`` becomes ``source_principal`` only when ``mtls`` (Rust: outbound
        reports its own identity only for HBONE; inbound the verified peer)."""
        if rec.dst_derived is None:
            src_id = rec.src_identity if mtls else None
            refs = (rec.src_workload, src_id, rec.dst_workload, rec.dst_service, rec.dst_identity)
            key: tuple[object, ...] = (rec.direction, mtls, *map(id, refs))
            if baggage is not None and rec.src_workload is None:
                # Inbound from a peer with no known workload: the source labels come from its
                # baggage, so the key holds what traffic_labels reads of it (a known source
                # workload replaces all of that, so then the baggage is no part of the key).
                key = (
                    *key,
                    baggage.cluster_id,
                    baggage.namespace,
                    baggage.workload_name,
                    baggage.service_name,
                    baggage.service_version,
                    baggage.region,
                    baggage.zone,
                )
            hit = self._series_memo.get(key)
            if hit is None:
                series = _Series(self, self._labels_for(rec, mtls, baggage))
                if len(self._series_memo) >= _SERIES_MEMO_MAX:
                    self._series_memo.clear()
                self._series_memo[key] = (series, refs)
            else:
                series = hit[0]
            return ConnectionMetrics(self, series.labels, series)
        return ConnectionMetrics(self, self._labels_for(rec, mtls, baggage))

    def _labels_for(
        self, rec: RecordLike, mtls: bool, baggage: BaggageLike | None
    ) -> tuple[str, ...]:
        reporter = reporter_for_direction(rec.direction)
        return traffic_labels(
            reporter,
            source=rec.src_workload,
            source_identity=rec.src_identity if mtls else None,
            baggage=baggage,
            destination=rec.dst_workload,
            destination_service=rec.dst_service,
            destination_identity=rec.dst_identity,
            destination_baggage=rec.dst_derived,
            security_policy=SecurityPolicy.MUTUAL_TLS if mtls else SecurityPolicy.UNKNOWN,
        )


_SERIES_MEMO_MAX = 1024


class _Series:
    """The cells one traffic label set resolves to, from the local pod's perspective."""

    __slots__ = ("closed", "labels", "opened", "recv", "sent")

    def __init__(self, metrics: Metrics, labels: tuple[str, ...]) -> None:
        self.opened = opened = metrics.connections_opened.labels(*labels)
        # The series' own key, not the caller's tuple: one label tuple (and one copy of each
        # principal string) per label set, however many connections share it.
        self.labels = labels = opened.key
        request = metrics.received_bytes.labels(*labels)
        response = metrics.sent_bytes.labels(*labels)
        # Where the local pod's sent/received bytes go: outbound it sends the request and
        # receives the response; inbound the other way round.
        if labels[0] == Reporter.SOURCE.value:
            self.sent, self.recv = request, response
        else:
            self.sent, self.recv = response, request
        self.closed: Cell | None = None  # connections_closed with flag "-", on first use


class RecordLike(Protocol):
    """What :meth:`Metrics.open_for_record` reads (``ztunnel.proxy.context.ConnectionRecord``)."""

    @property
    def direction(self) -> str: ...
    @property
    def src_workload(self) -> Workload | None: ...
    @property
    def dst_workload(self) -> Workload | None: ...
    @property
    def dst_service(self) -> Service | None: ...
    @property
    def src_identity(self) -> Identity | None: ...
    @property
    def dst_identity(self) -> Identity | None: ...
    @property
    def dst_derived(self) -> BaggageLike | None: ...


class ConnectionMetrics:
    """The metrics of one proxied connection, from "opened" to "closed".

    Creating it bumps ``opened``. ``flush(bytes_sent, bytes_recv)`` takes the connection's
    running totals from the local pod's perspective (``ConnectionRecord.bytes_sent`` /
    ``bytes_recv``) and adds what is new since the last call to the byte counters; call it as
    often as useful (periodically, and at close). Metric direction (Istio convention):
    ``istio_tcp_received_bytes`` = request bytes (downstream -> upstream), ``istio_tcp_sent_bytes``
    = response bytes; so outbound maps sent->received, inbound maps sent->sent.
    ``close()`` bumps ``closed`` (labelled with the response flag) and, for a flag other than
    ``-``, ``failed``. Closing twice is a no-op.
    """

    __slots__ = (
        "_closed",
        "_recv",
        "_recv_cell",
        "_sent",
        "_sent_cell",
        "_series",
        "labels",
        "metrics",
    )

    def __init__(
        self, metrics: Metrics, labels: tuple[str, ...], series: _Series | None = None
    ) -> None:
        if series is None:
            series = _Series(metrics, labels)
        series.opened.value += 1
        self.metrics = metrics
        self._series = series
        self.labels = series.labels
        self._closed = False
        self._sent = 0
        self._recv = 0
        self._sent_cell = series.sent
        self._recv_cell = series.recv

    def flush(self, bytes_sent: int, bytes_recv: int) -> None:
        """Report running totals (local pod's perspective); only the increase is counted."""
        d = bytes_sent - self._sent
        if d > 0:
            self._sent = bytes_sent
            self._sent_cell.value += d
        d = bytes_recv - self._recv
        if d > 0:
            self._recv = bytes_recv
            self._recv_cell.value += d

    def close(
        self,
        bytes_sent: int | None = None,
        bytes_recv: int | None = None,
        *,
        flag: ResponseFlag = ResponseFlag.NONE,
    ) -> None:
        """Final flush (if totals are given), then count the connection as closed."""
        if self._closed:
            return
        self._closed = True
        self.flush(
            self._sent if bytes_sent is None else bytes_sent,
            self._recv if bytes_recv is None else bytes_recv,
        )
        if flag is ResponseFlag.NONE and self.labels[_FLAG_INDEX] == _NO_FLAG:
            series = self._series
            closed = series.closed
            if closed is None:
                closed = series.closed = self.metrics.connections_closed.labels(*self.labels)
            closed.value += 1
            return
        key = with_flag(self.labels, flag)
        self.metrics.connections_closed.labels(*key).value += 1
        if flag is not ResponseFlag.NONE:
            self.metrics.connections_failed.labels(*key).value += 1

    @property
    def closed(self) -> bool:
        return self._closed


# --- the DNS proxy (istio/ztunnel src/dns/metrics.rs) ---------------------------------------------

DNS_LABEL_NAMES: tuple[str, ...] = (
    "request_query_type",
    "request_protocol",
    "source_canonical_service",
    "source_canonical_revision",
)
# dns/metrics.rs: Histogram::new(vec![0.0005, 0.001, 0.01, 0.1, 1.0, 5.0]), printed as Rust does.
DNS_DURATION_BUCKETS: tuple[tuple[float, str], ...] = (
    (0.0005, "0.0005"),
    (0.001, "0.001"),
    (0.01, "0.01"),
    (0.1, "0.1"),
    (1.0, "1.0"),
    (5.0, "5.0"),
)


class HistogramCell:
    __slots__ = ("buckets", "count", "key", "sum", "text")

    def __init__(self, key: tuple[str, ...], n: int) -> None:
        self.key = key
        self.buckets = [0] * n
        self.sum = 0.0
        self.count = 0
        self.text: str | None = None

    def observe(self, value: float, bounds: Sequence[float]) -> None:
        for i, b in enumerate(bounds):
            if value <= b:
                self.buckets[i] += 1
        self.sum += value
        self.count += 1


class HistogramFamily:
    """A histogram family with ordered label tuples (Rust's encoding: _sum, _count, then the
    cumulative buckets with ``le`` last)."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[tuple[float, str]],
        *,
        unit: str = "",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(b for b, _ in buckets)
        self.bound_text = tuple(t for _, t in buckets)
        self.unit = unit
        self._sample_name = name
        self._cells: dict[tuple[str, ...], HistogramCell] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramCell:
        cell = self._cells.get(values)
        if cell is None:
            with self._lock:
                cell = self._cells.setdefault(values, HistogramCell(values, len(self.bounds)))
        return cell

    def observe(self, values: tuple[str, ...], value: float) -> None:
        self.labels(*values).observe(value, self.bounds)

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cells = list(self._cells.values())
        yield _HistogramSnapshot(self, cells)

    def render(self, cells: list[HistogramCell]) -> Iterator[str]:
        fam = self.name
        yield from _descriptor(fam, self.documentation, "histogram", self.unit)
        names = self.labelnames
        for cell in cells:
            text = cell.text
            if text is None:
                text = cell.text = _render_labels(names, cell.key)
            inner = text[1:-1] + "," if text else ""
            yield f"{fam}_sum{text} {_fmt_value(float(cell.sum))}\n"
            yield f"{fam}_count{text} {cell.count}\n"
            for le, n in zip(self.bound_text, cell.buckets, strict=True):
                yield f'{fam}_bucket{{{inner}le="{le}"}} {n}\n'
            yield f'{fam}_bucket{{{inner}le="+Inf"}} {cell.count}\n'


class _HistogramSnapshot(_FamilySnapshot):
    def __init__(self, family: HistogramFamily, cells: list[HistogramCell]) -> None:
        super().__init__(family, cells)  # type: ignore[arg-type]

    def _build(self) -> list[Sample]:
        fam: HistogramFamily = self.family  # type: ignore[assignment]
        out: list[Sample] = []
        for cell in self.cells:
            labels = dict(zip(fam.labelnames, cell.key, strict=False))
            c: HistogramCell = cell  # type: ignore[assignment]
            out.append(Sample(fam.name + "_sum", labels, c.sum, None, None))
            out.append(Sample(fam.name + "_count", labels, c.count, None, None))
            for le, n in zip(fam.bound_text, c.buckets, strict=True):
                out.append(Sample(fam.name + "_bucket", {**labels, "le": le}, n, None, None))
            out.append(Sample(fam.name + "_bucket", {**labels, "le": "+Inf"}, c.count, None, None))
        return out


class DnsMetrics:
    """``istio_dns_*`` (unstable in Rust), labels in DNS_LABEL_NAMES order."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Family(
            "istio_dns_requests",
            "Total number of DNS requests (unstable).",
            "counter",
            DNS_LABEL_NAMES,
            registry=registry,
        )
        self.upstream_requests = Family(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable).",
            "counter",
            DNS_LABEL_NAMES,
            registry=registry,
        )
        self.upstream_failures = Family(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable).",
            "counter",
            DNS_LABEL_NAMES,
            registry=registry,
        )
        self.upstream_duration = HistogramFamily(
            "istio_dns_upstream_request_duration_seconds",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable).",
            DNS_LABEL_NAMES,
            DNS_DURATION_BUCKETS,
            unit="seconds",
            registry=registry,
        )


def dns_labels(qtype: str, protocol: str, source: Workload | None) -> tuple[str, ...]:
    """``DnsLabels``: the query type in lower case, ``udp``/``tcp``, the client's canonical
    service and revision (``unknown`` when the client is not known)."""
    if source is None:
        return (qtype, protocol, UNKNOWN, UNKNOWN)
    return (qtype, protocol, _v(source.canonical_name), _v(source.canonical_revision))


# --- one exposition for several processes (data-plane workers) ------------------------------------

# A process's series as plain data: family name -> (label tuple -> value) for counters and gauges,
# (label tuple -> (buckets, sum, count)) for histograms. Pickled from each worker at a scrape.
Values = dict[tuple[str, ...], Any]
RegistryValues = dict[str, Values]


def registry_values(registry: CollectorRegistry) -> RegistryValues:
    """Every series of the families built here (other collectors are left out)."""
    out: RegistryValues = {}
    for metric in registry.collect():
        if isinstance(metric, _HistogramSnapshot):
            cells: list[HistogramCell] = metric.cells  # type: ignore[assignment]
            out[metric.family.name] = {c.key: (tuple(c.buckets), c.sum, c.count) for c in cells}
        elif isinstance(metric, _FamilySnapshot):
            out[metric.family.name] = {c.key: c.value for c in metric.cells}
    return out


def cumulative_families(registry: CollectorRegistry) -> frozenset[str]:
    """The names of the counter and histogram families built here: what only ever grows."""
    return frozenset(
        m.family.name
        for m in registry.collect()
        if isinstance(m, _FamilySnapshot) and m.family.kind in ("counter", "histogram")
    )


def add_values(into: RegistryValues, more: RegistryValues, names: frozenset[str]) -> None:
    """Add ``more``'s series of the families ``names`` into ``into`` (in place)."""
    for name, values in more.items():
        if name not in names:
            continue
        acc = into.setdefault(name, {})
        for key, v in values.items():
            old = acc.get(key)
            if old is None:
                acc[key] = v
            elif isinstance(v, tuple):  # a histogram: (buckets, sum, count)
                acc[key] = (
                    tuple(a + b for a, b in zip(old[0], v[0], strict=True)),
                    old[1] + v[1],
                    old[2] + v[2],
                )
            else:
                acc[key] = old + v


class _Merged:
    """A collector yielding ``registry``'s families with the other processes' values added:
    counters, gauges and histograms sum series by label tuple (what Rust's one registry shared by
    its worker threads shows). ``memo`` carries the merged series from one scrape to the next,
    so each keeps its rendered label text (and only the series present now are shown)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        others: Sequence[RegistryValues],
        memo: dict[str, dict[tuple[str, ...], Any]],
    ) -> None:
        self.registry = registry
        self.others = others
        self.memo = memo

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            if not isinstance(metric, _FamilySnapshot):
                yield metric
                continue
            name = metric.family.name
            extra = [o[name] for o in self.others if name in o]
            if not extra:
                yield metric
                continue
            before = self.memo.get(name, {})
            if isinstance(metric, _HistogramSnapshot):
                hist = _sum_histograms(metric, extra, before)
                self.memo[name] = hist
                yield _HistogramSnapshot(metric.family, list(hist.values()))  # type: ignore[arg-type]
            else:
                cells = _sum_cells(metric.cells, extra, before)
                self.memo[name] = cells
                yield _FamilySnapshot(metric.family, list(cells.values()))


def _sum_cells(
    own: list[Cell], extra: list[Values], before: dict[tuple[str, ...], Any]
) -> dict[tuple[str, ...], Cell]:
    cells: dict[tuple[str, ...], Cell] = {}
    find, reuse = cells.get, before.get  # (one loop, inlined: 40k series a scrape)
    own_values = {c.key: c.value for c in own}
    for values in (own_values, *extra):
        for key, value in values.items():
            c = find(key)
            if c is None:
                c = reuse(key)
                if c is None:
                    c = Cell(key)
                else:
                    c.value = 0
                cells[key] = c
            c.value += value
    return cells


def _sum_histograms(
    metric: _HistogramSnapshot, extra: list[Values], before: dict[tuple[str, ...], Any]
) -> dict[tuple[str, ...], HistogramCell]:
    n = len(metric.family.bounds)  # type: ignore[attr-defined]
    cells: dict[tuple[str, ...], HistogramCell] = {}

    def add(key: tuple[str, ...], buckets: Sequence[int], total: float, count: int) -> None:
        cell = cells.get(key)
        if cell is None:
            cell = before.get(key)
            if cell is None:
                cell = HistogramCell(key, n)
            else:
                cell.buckets = [0] * n
                cell.sum = 0.0
                cell.count = 0
            cells[key] = cell
        for i, b in enumerate(buckets):
            cell.buckets[i] += b
        cell.sum += total
        cell.count += count

    own: list[HistogramCell] = metric.cells  # type: ignore[assignment]
    for c in own:
        add(c.key, c.buckets, c.sum, c.count)
    for values in extra:
        for key, (buckets, total, count) in values.items():
            add(key, buckets, total, count)
    return cells


def merged_registry(
    registry: CollectorRegistry,
    others: Sequence[RegistryValues],
    memo: dict[str, dict[tuple[str, ...], Any]] | None = None,
) -> CollectorRegistry:
    """A registry for one scrape: ``registry`` plus the series of ``others`` (see ``_Merged``;
    pass the same ``memo`` to every scrape)."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Merged(registry, others, {} if memo is None else memo))
    return out
