"""The delta ADS client: subscribes to istiod's Address and Authorization resources, keeps State.

Behaviour follows istio/ztunnel ``src/xds/client.rs`` and ``src/xds.rs``:

* one bidi stream, ``AggregatedDiscoveryService/DeltaAggregatedResources``, to ``XDS_ADDRESS``
  (TLS to ``XDS_ROOT_CA``/``ALT_XDS_HOSTNAME``, or plaintext ``http://`` for tests), with
  ``authorization``/``clusterid``/``XDS_HEADER_*`` metadata (:mod:`ztunnel.xds.control`);
* one initial request per type URL carrying the Node; an empty subscription is a wildcard;
  after a reconnect it carries ``initial_resource_versions`` (name -> version of every resource
  this client holds) so istiod resumes the session and only sends what changed;
* each response is applied resource by resource through an :class:`XdsHandler`; a resource that
  fails to decode, convert or apply is *rejected* and the others still apply (the state keeps
  the previous version of a rejected one). Then an ACK (``response_nonce``) or a NACK (plus
  ``error_detail.message``, the rejections joined by ``"; "``) goes back;
* :attr:`AdsClient.synced` is set once every subscribed type has been ACKed (readiness);
* with ``XDS_ON_DEMAND=true`` Address subscribes to nothing (``["*"]`` subscribed and
  unsubscribed at once) and :meth:`AdsClient.demand` asks for one name at a time (a uid,
  ``ns/hostname`` or ``<network>/<ip>``), returning once a response names it: as a resource,
  one of its ``aliases`` (istiod answers an IP with the workload or service under its own name)
  or a removal (istiod's answer for a name it does not know). Rust ``Demander``; demanded names
  are subscribed again after a reconnect;
* reconnects back off exponentially (10 ms doubling to 15 s, as ztunnel); a stream that ended
  normally, a goaway-style status or a dropped connection after data reconnect quickly.

Why grpclib rather than grpcio (grpc.aio): grpclib is pure Python on asyncio and the ``h2``
library this project already ships, so it runs on the one event loop we already have (stdlib
or uvloop, no extra threads, no C-core poller bridging into the loop), is typed, and takes a
standard ``ssl.SSLContext`` (custom roots from a path, inline PEM or the system store, plus a
verified-name override) built with the same ``ssl`` module as the HBONE code. Keepalive pings
and an h2 window are configurable. The control plane is a handful of low-rate streams, so
grpcio's C-core throughput buys nothing here, while its own threads, its fork caveats and a
~10 MB binary wheel per platform cost something. Trade-off accepted: grpclib has one main
maintainer; the surface we use (a bidi stream and a unary call) is small enough to replace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf import json_format, struct_pb2
from google.protobuf.message import DecodeError
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from ztunnel.config import Config
from ztunnel.logs import RateLimitedLog
from ztunnel.state.model import Authorization, Service, Workload
from ztunnel.state.store import State, StoreError
from ztunnel.xds.control import CONNECT_TIMEOUT, ControlPlaneError, ControlPlaneTarget
from ztunnel.xds.convert import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    ConversionError,
    decode_authorization,
    parse_address,
    service_from_proto,
    workload_record,
)
from ztunnel.xds.protos import discovery_pb2 as ds
from ztunnel.xds.protos import workload_pb2 as wl_pb
from ztunnel.xds.wire import (
    MAX_RESOURCE_BYTES,
    LazyDeltaResponse,
    MessageTooLarge,
    TooLargeResource,
    recv_bounded,
)

__all__ = [
    "ADDRESS_TYPE_URL",
    "ADS_METHOD",
    "AUTHORIZATION_TYPE_URL",
    "AdsClient",
    "Rejection",
    "StateUpdater",
    "XdsHandler",
    "XdsMetrics",
    "build_node",
]

log = logging.getLogger(__name__)
_slow_demands = RateLimitedLog(log)

_ADS = ds.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"]
ADS_METHOD = f"/{_ADS.full_name}/{_ADS.methods_by_name['DeltaAggregatedResources'].name}"

INITIAL_BACKOFF = 0.01
MAX_BACKOFF = 15.0
DEMAND_TIMEOUT = 5.0  # how long a connection waits for an on-demand answer
MAX_DEMANDED = 10_000  # demanded names kept for resubscription after a reconnect
DEFAULT_INSTANCE_IP = "1.1.1.1"
ISTIO_META_PREFIX = "ISTIO_META_"
ISTIO_METAJSON_PREFIX = "ISTIO_METAJSON_"

# ConnectionTerminationReason in ztunnel src/xds/metrics.rs: the `reason` label of
# istio_xds_connection_terminations_total.
REASON_CONNECTION_ERROR = "ConnectionError"
REASON_ERROR = "Error"
REASON_RECONNECT = "Reconnect"
REASON_COMPLETE = "Complete"


# --- applying updates --------------------------------------------------------------------------


class XdsHandler(Protocol):
    """Where converted updates go. Each method applies one resource; raising rejects just that
    resource (the client NACKs with the exception text), except a :class:`StoreError`, which
    rejects the whole response: every response is applied inside one ``batch()``, so it is
    applied whole or not at all. ``response_applied`` runs after each response with at least one
    successful change, e.g. to re-check connections against changed policies. The versions of
    the resources held are kept beside them (``put_version``/``drop_version``/``versions``), in
    the same batch, for a reconnect's ``initial_resource_versions``."""

    def batch(self) -> AbstractContextManager[None]: ...

    def put_version(self, type_url: str, name: str, version: str) -> None: ...

    def drop_version(self, type_url: str, name: str) -> None: ...

    def versions(self, type_url: str) -> Iterable[tuple[str, str]]: ...

    def upsert_workload(self, workload: Workload) -> None: ...

    def upsert_workload_proto(self, pb: wl_pb.Workload) -> None: ...

    def upsert_service(self, service: Service) -> None: ...

    def remove_address(self, name: str) -> None: ...

    def upsert_policy(self, policy: Authorization) -> None: ...

    def remove_policy(self, name: str) -> None: ...

    def response_applied(self, type_url: str, changes: int) -> None: ...


class StateUpdater:
    """The plain :class:`XdsHandler`: applies updates to a :class:`State`.

    Subclass it (or wrap it) to hook certificate prefetch or policy re-evaluation.
    Removal matching follows ztunnel ``remove_internal``: an Address name is a workload uid
    first; otherwise, if it has the ``namespace/hostname`` shape, a service key.
    """

    def __init__(self, state: State, local_node: str = "") -> None:
        self.state = state
        self.local_node = local_node  # this node's name: see local_workload_upserted

    def batch(self) -> AbstractContextManager[None]:
        return self.state.batch()

    def put_version(self, type_url: str, name: str, version: str) -> None:
        self.state.put_version(type_url, name, version)

    def drop_version(self, type_url: str, name: str) -> None:
        self.state.drop_version(type_url, name)

    def versions(self, type_url: str) -> Iterable[tuple[str, str]]:
        return self.state.versions(type_url)

    def upsert_workload(self, workload: Workload) -> None:
        self.state.upsert_workload(workload)

    def upsert_workload_proto(self, pb: wl_pb.Workload) -> None:
        """A workload from xDS, stored from its protobuf without a model object in between
        (``convert.workload_record``); a workload on ``local_node`` is then passed to
        :meth:`local_workload_upserted`."""
        state = self.state
        record = workload_record(pb, state.interner)
        state.upsert_workload_record(record)
        if self.local_node and pb.node == self.local_node:
            w = state.find_workload_by_uid(pb.uid)
            if w is not None:
                self.local_workload_upserted(w)

    def local_workload_upserted(self, workload: Workload) -> None:
        """A hook: a workload scheduled on ``local_node`` was added or changed."""
        return None

    def upsert_service(self, service: Service) -> None:
        self.state.upsert_service(service)

    def remove_address(self, name: str) -> None:
        if self.state.remove_workload(name) is not None:
            return
        _, sep, host = name.partition("/")
        # Namespaces and hostnames never contain "/": anything else is a workload uid.
        if sep and "/" not in host and self.state.remove_service(name) is None:
            log.debug("xDS removal of unknown address %s", name)

    def upsert_policy(self, policy: Authorization) -> None:
        self.state.upsert_policy(policy)

    def remove_policy(self, name: str) -> None:
        self.state.remove_policy(name)

    def response_applied(self, type_url: str, changes: int) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A resource that was not applied, and why (one part of a NACK message)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass
class XdsMetrics:
    """Plain counters for the metrics endpoint (``istio_xds_connection_terminations_total``
    by reason, ``istio_xds_message_total`` by type URL, and friends)."""

    connection_terminations: dict[str, int] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    message_bytes: dict[str, int] = field(default_factory=dict)
    connects: int = 0
    acks: int = 0
    nacks: int = 0
    store_errors: int = 0  # responses not applied because the state store refused them
    oversized: int = 0  # messages refused for their size (the stream is then restarted)
    oversized_resources: int = 0  # resources refused for their size (NACKed alone)


def _inc(counter: dict[str, int], key: str, by: int = 1) -> None:
    counter[key] = counter.get(key, 0) + by


# --- the Node ----------------------------------------------------------------------------------


def build_node(config: Config, env: Mapping[str, str]) -> ds.Node:
    """The Node ztunnel sends (src/xds/client.rs ``node()``).

    ``id`` is ``ztunnel~<INSTANCE_IP or 1.1.1.1>~<POD_NAME>.<POD_NAMESPACE>~<POD_NAMESPACE>.svc
    .cluster.local``; metadata holds NAME, NAMESPACE, INSTANCE_IPS and NODE_NAME, then every
    ``ISTIO_META_*`` variable of ``env`` with the prefix stripped (string values), then every
    ``ISTIO_METAJSON_*`` variable parsed as JSON (unparsable ones are logged and skipped).
    """
    ip = config.instance_ip or DEFAULT_INSTANCE_IP
    pod, ns = config.pod_name, config.pod_namespace
    node = ds.Node(id=f"ztunnel~{ip}~{pod}.{ns}~{ns}.svc.cluster.local")
    fields = node.metadata.fields
    for key, value in (
        ("NAME", pod),
        ("NAMESPACE", ns),
        ("INSTANCE_IPS", ip),
        ("NODE_NAME", config.node_name),
    ):
        fields[key].string_value = value
    for key, value in config.proxy_metadata:  # mesh config / PROXY_CONFIG proxyMetadata
        fields[key].string_value = value
    for key in sorted(env):
        if key.startswith(ISTIO_META_PREFIX) and len(key) > len(ISTIO_META_PREFIX):
            fields[key[len(ISTIO_META_PREFIX) :]].string_value = env[key]
    for key in sorted(env):
        if key.startswith(ISTIO_METAJSON_PREFIX) and len(key) > len(ISTIO_METAJSON_PREFIX):
            value = struct_pb2.Value()
            try:
                json_format.Parse(env[key], value)
            except json_format.ParseError:
                log.error("failed to parse %s=%s as JSON; not sent in node metadata", key, env[key])
                continue
            fields[key[len(ISTIO_METAJSON_PREFIX) :]].CopyFrom(value)
    return node


# --- the client --------------------------------------------------------------------------------


class _Attempt:
    """What happened on one connection, for the backoff decision."""

    __slots__ = ("established", "responses")

    def __init__(self) -> None:
        self.established = False  # the request headers went out
        self.responses = 0


class AdsClient:
    """Delta ADS client for ``Address`` and ``Authorization``, applying to an :class:`XdsHandler`.

    Own it one of two ways: ``await client.run()`` inside your own task (cancel it to stop), or
    ``client.start()`` and later ``await client.close()``. ``env`` is the process environment
    (only ``ISTIO_META_*``/``ISTIO_METAJSON_*`` are read, for the Node metadata).
    """

    def __init__(
        self,
        config: Config,
        handler: XdsHandler,
        *,
        env: Mapping[str, str] | None = None,
        initial_backoff: float = INITIAL_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        if config.xds_address is None:
            raise ValueError("XDS_ADDRESS is not set: xDS is disabled")
        if not 0 < initial_backoff <= max_backoff:
            raise ValueError("need 0 < initial_backoff <= max_backoff")
        self.target = ControlPlaneTarget(
            address=config.xds_address,
            root_ca=config.xds_root_ca,
            alt_hostname=config.alt_xds_hostname,
            auth_token=config.auth_token,
            cluster_id=config.cluster_id,
            headers=config.xds_headers,
        )
        self._handler = handler
        self._node = build_node(config, env or {})
        self._on_demand = config.xds_on_demand
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._connect_timeout = connect_timeout
        self._decoders: dict[str, Callable[[str, bytes], None]] = {
            ADDRESS_TYPE_URL: self._apply_address,
            AUTHORIZATION_TYPE_URL: self._apply_authorization,
        }
        self._removers: dict[str, Callable[[str], None]] = {
            ADDRESS_TYPE_URL: handler.remove_address,
            AUTHORIZATION_TYPE_URL: handler.remove_policy,
        }
        # Types that must be ACKed once before we count as synced (on-demand Address: none).
        self._awaiting_sync: set[str] = {
            t for t in self._decoders if not (self._on_demand and t == ADDRESS_TYPE_URL)
        }
        self.synced = asyncio.Event()
        if not self._awaiting_sync:
            self.synced.set()
        self.metrics = XdsMetrics()
        self.connection_id = 0
        self._task: asyncio.Task[None] | None = None
        # On-demand: name -> waiters; names asked for (resubscribed on reconnect, bounded);
        # the live stream's sender (None between streams) and a lock serialising its sends.
        self._pending: dict[str, list[asyncio.Future[None]]] = {}
        self._demanded: dict[str, None] = {}
        self._send: Callable[[ds.DeltaDiscoveryRequest], Awaitable[None]] | None = None
        self._send_lock = asyncio.Lock()

    # -- public API -----------------------------------------------------------------------------

    @property
    def node(self) -> ds.Node:
        return self._node

    def resource_versions(self, type_url: str) -> dict[str, str]:
        """Name -> version of the resources of ``type_url`` currently applied."""
        return dict(self._handler.versions(type_url))

    async def demand(self, name: str, timeout: float = DEMAND_TIMEOUT) -> None:
        """Ask istiod for the Address resource ``name`` and wait (at most ``timeout``) until a
        response answers it. A no-op unless XDS_ON_DEMAND; concurrent demands for one name
        share one request."""
        if not self._on_demand:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._pending.setdefault(name, [])
        waiters.append(fut)
        self._demanded.pop(name, None)
        self._demanded[name] = None
        while len(self._demanded) > MAX_DEMANDED:
            del self._demanded[next(iter(self._demanded))]
        try:
            if len(waiters) == 1 and self._send is not None:
                log.debug("xDS on-demand request for %s", name)
                req = ds.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE_URL)
                req.resource_names_subscribe.append(name)
                try:
                    async with self._send_lock:
                        await self._send(req)
                except Exception as e:  # the stream broke: the reconnect asks again
                    log.debug("xDS on-demand request for %s not sent: %s", name, e)
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                # (a pod picks the names: one line per interval, however many time out)
                _slow_demands.warning(
                    "demand-timeout",
                    "xDS on-demand request for %s timed out after %.1fs",
                    name,
                    timeout,
                )
        finally:
            left = self._pending.get(name)
            if left is not None and fut in left:
                left.remove(fut)
                if not left:
                    del self._pending[name]

    def _answered(self, name: str) -> None:
        for fut in self._pending.pop(name, ()):
            if not fut.done():
                fut.set_result(None)

    async def wait_synced(self) -> None:
        """Return once every subscribed type has been ACKed at least once."""
        await self.synced.wait()

    def start(self) -> asyncio.Task[None]:
        """Run in a task owned by this client; ``close()`` ends it."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="xds-client")
        return self._task

    async def close(self) -> None:
        """Stop the task started by ``start()`` (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        """Connect, stream and reconnect forever; returns only by cancellation."""
        backoff = self._initial_backoff
        while True:
            self.connection_id += 1
            attempt = _Attempt()
            try:
                await self._run_stream(attempt)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reason, delay, backoff = self._classify(e, attempt, backoff)
            else:
                reason, delay, backoff = (
                    REASON_COMPLETE,
                    self._initial_backoff,
                    self._initial_backoff,
                )
                log.info("xDS stream %d completed; reconnecting", self.connection_id)
            _inc(self.metrics.connection_terminations, reason)
            await asyncio.sleep(delay)

    # -- connection -----------------------------------------------------------------------------

    def _classify(
        self, e: Exception, attempt: _Attempt, backoff: float
    ) -> tuple[str, float, float]:
        """(metric reason, delay before reconnecting, next backoff): ztunnel's ``run_loop``."""
        if attempt.responses:
            backoff = self._initial_backoff  # the connection worked: start over
        doubled = min(self._max_backoff, backoff * 2)
        cid = self.connection_id
        if isinstance(e, GRPCError):
            msg = e.message or ""
            benign = e.status in (Status.UNKNOWN, Status.CANCELLED, Status.DEADLINE_EXCEEDED) or (
                e.status is Status.UNAVAILABLE
                and ("transport is closing" in msg or "received prior goaway" in msg)
            )
            if benign:
                log.debug("xDS stream %d terminated: %s %s; reconnecting", cid, e.status.name, msg)
                return REASON_RECONNECT, self._initial_backoff, self._initial_backoff
            log.warning(
                "xDS stream %d error: %s %s; retrying in %.2fs", cid, e.status.name, msg, doubled
            )
            return REASON_ERROR, doubled, doubled
        if isinstance(e, MessageTooLarge | DecodeError):
            # Rust: a message over max_decoding_message_size fails the stream.
            self.metrics.oversized += isinstance(e, MessageTooLarge)
            log.error("xDS stream %d: %s; retrying in %.2fs", cid, e, doubled)
            return REASON_ERROR, doubled, doubled
        if not attempt.established or isinstance(e, ControlPlaneError):
            log.warning(
                "xDS connection %d to %s failed: %s; retrying in %.2fs",
                cid,
                self.target.address,
                _describe(e),
                doubled,
            )
            return REASON_CONNECTION_ERROR, doubled, doubled
        if isinstance(e, StreamTerminatedError | ConnectionError | OSError | TimeoutError):
            # The connection dropped under an established stream (tonic reports that as
            # status Unknown, a "Reconnect").
            log.info("xDS stream %d lost: %s; reconnecting", cid, _describe(e))
            return REASON_RECONNECT, self._initial_backoff, self._initial_backoff
        log.error("xDS stream %d failed unexpectedly; retrying in %.2fs", cid, doubled, exc_info=e)
        return REASON_ERROR, doubled, doubled

    def _initial_requests(self) -> list[ds.DeltaDiscoveryRequest]:
        reqs = []
        for type_url in self._decoders:
            req = ds.DeltaDiscoveryRequest(type_url=type_url)
            req.node.CopyFrom(self._node)
            if self._on_demand and type_url == ADDRESS_TYPE_URL:
                # "Subscribe to nothing": xDS has no other way to say it (ztunnel does the same),
                # plus whatever was demanded before a reconnect.
                req.resource_names_subscribe.append("*")
                req.resource_names_unsubscribe.append("*")
                req.resource_names_subscribe.extend(self._demanded)
            req.initial_resource_versions.update(self._handler.versions(type_url))
            reqs.append(req)
        return reqs

    async def _run_stream(self, attempt: _Attempt) -> None:
        metadata = self.target.metadata()  # re-reads the token file on every (re)connect
        channel = self.target.open_channel()  # re-reads the roots file
        try:
            stream = channel.request(
                ADS_METHOD,
                Cardinality.STREAM_STREAM,
                ds.DeltaDiscoveryRequest,
                ds.DeltaDiscoveryResponse,
                metadata=metadata,
            )
            async with stream:
                async with asyncio.timeout(self._connect_timeout):
                    await stream.send_request()
                attempt.established = True
                self.metrics.connects += 1
                async with self._send_lock:
                    for req in self._initial_requests():
                        log.debug(
                            "xDS stream %d: initial request %s (%d known resources)",
                            self.connection_id,
                            req.type_url,
                            len(req.initial_resource_versions),
                        )
                        await stream.send_message(req)
                    self._send = stream.send_message
                log.info("xDS stream %d established to %s", self.connection_id, self.target.address)
                while True:
                    resp = await recv_bounded(stream)
                    if resp is None:
                        # The server closed its side: collect its status (raises if not OK).
                        await stream.end()
                        await stream.recv_trailing_metadata()
                        return
                    attempt.responses += 1
                    ack = self._handle_response(resp)
                    async with self._send_lock:
                        await stream.send_message(ack)
        finally:
            self._send = None
            channel.close()

    # -- responses ------------------------------------------------------------------------------

    def _apply_address(self, name: str, data: bytes) -> None:
        pb = parse_address(data)
        which = pb.WhichOneof("type")
        if which == "workload":
            self._handler.upsert_workload_proto(pb.workload)
        elif which == "service":
            self._handler.upsert_service(service_from_proto(pb.service))
        else:
            raise ConversionError("address.type", "neither workload nor service is set")

    def _apply_authorization(self, name: str, data: bytes) -> None:
        # Keyed by the resource name, as Rust's policy store is (a removal names it).
        self._handler.upsert_policy(decode_authorization(data, name))

    def _apply_all(
        self,
        resp: LazyDeltaResponse,
        type_url: str,
        apply: Callable[[str, bytes], None],
        remove: Callable[[str], None],
        rejections: list[Rejection],
        names: list[str] | None,
    ) -> int:
        """Apply every resource and removal of ``resp``; returns how many changes were made.
        A resource that fails is rejected alone; a StoreError stops everything (the batch
        around this is then not committed). ``names`` collects every name and alias seen
        (on-demand answers)."""
        handler = self._handler
        changes = 0
        payload_bytes = 0
        for res in resp.resources:
            if isinstance(res, TooLargeResource):
                payload_bytes += res.size
                self.metrics.oversized_resources += 1
                rejections.append(
                    Rejection(
                        res.name or "?",
                        f"resource of {res.size} bytes is larger than the "
                        f"{MAX_RESOURCE_BYTES} allowed",
                    )
                )
                continue
            if names is not None:
                names.append(res.name)
                names += res.aliases
            try:
                if not res.HasField("resource"):
                    raise ConversionError("resource", "xDS resource without a payload")
                payload = res.resource
                value = payload.value
                payload_bytes += len(value)
                if payload.type_url and payload.type_url != type_url:
                    raise ConversionError(
                        "resource.type_url", f"{payload.type_url!r} in a {type_url} response"
                    )
                apply(res.name, value)
            except ConversionError as e:
                rejections.append(Rejection(res.name, str(e)))
                continue
            except StoreError:
                raise
            except Exception as e:
                log.error("xDS handler failed to apply %s", res.name, exc_info=e)
                rejections.append(Rejection(res.name, f"{type(e).__name__}: {e}"))
                continue
            handler.put_version(type_url, res.name, res.version)
            changes += 1
        for name in resp.removed_resources:
            if names is not None:
                names.append(name)
            try:
                remove(name)
            except StoreError:
                raise
            except Exception as e:
                log.error("xDS handler failed to remove %s", name, exc_info=e)
                rejections.append(Rejection(name, f"{type(e).__name__}: {e}"))
                continue
            handler.drop_version(type_url, name)
            changes += 1
        # Rust's Recorder<DeltaDiscoveryResponse>: the resources' payload bytes, not the message's.
        _inc(self.metrics.message_bytes, type_url, payload_bytes)
        return changes

    def _handle_response(self, resp: LazyDeltaResponse) -> ds.DeltaDiscoveryRequest:
        """Apply one response; return the ACK or NACK to send."""
        type_url = resp.type_url
        m = self.metrics
        _inc(m.messages, type_url)
        log.debug(
            "xDS response %s: %d resources, %d removals (nonce %s)",
            type_url,
            len(resp.resources),
            len(resp.removed_resources),
            resp.nonce,
        )
        apply = self._decoders.get(type_url)
        remove = self._removers.get(type_url)
        rejections: list[Rejection] = []
        if apply is None or remove is None:
            # ztunnel ACKs unknown types (and logs): NACKing would not make istiod stop.
            log.error("xDS response for unknown type %s ignored", type_url)
        else:
            changes = 0
            names: list[str] | None = [] if self._pending and type_url == ADDRESS_TYPE_URL else None
            try:
                with self._handler.batch():  # (the whole response, or none of it)
                    changes = self._apply_all(resp, type_url, apply, remove, rejections, names)
            except StoreError as e:
                log.error("xDS response %s not applied: %s", type_url, e)
                self.metrics.store_errors += 1
                changes = 0
                rejections = [
                    Rejection(
                        f"{len(resp.resources) + len(resp.removed_resources)} resources",
                        f"not applied: {e}",
                    )
                ]
            if changes:
                try:
                    self._handler.response_applied(type_url, changes)
                except Exception as e:
                    log.error("xDS handler response_applied(%s) failed", type_url, exc_info=e)
            if names:
                # After the state holds them (Rust notify_on_demand after handle()).
                for name in names:
                    self._answered(name)
        ack = ds.DeltaDiscoveryRequest(type_url=type_url, response_nonce=resp.nonce)
        if rejections:
            ack.error_detail.message = "; ".join(str(r) for r in rejections)
            m.nacks += 1
            log.error("xDS NACK %s (nonce %s): %s", type_url, resp.nonce, ack.error_detail.message)
        else:
            m.acks += 1
            if type_url in self._awaiting_sync:
                self._awaiting_sync.discard(type_url)
                if not self._awaiting_sync:
                    log.info("xDS initial sync complete")
                    self.synced.set()
        return ack


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
