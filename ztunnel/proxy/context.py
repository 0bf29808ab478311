"""What every listener of one proxy instance shares: config, state, sockets, pipes, local workload,
metrics, policies; and the record of each live connection (access log, metrics, policy re-checks).

In dedicated mode there is one instance for the process; in shared (in-pod) mode, one per pod.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from ztunnel.config import HBONE_PORT, Config, WorkloadInfo
from ztunnel.core.addr import HostnameAuthority, IPAddr, SocketAddr
from ztunnel.core.errors import (
    AuthorizationDenied,
    PolicyLateRejection,
    ProxyError,
    ResponseFlag,
    UnknownLocalWorkload,
    reportable,
)
from ztunnel.core.identity import Identity
from ztunnel.logs import log_fields
from ztunnel.metrics import BaggageLike, ConnectionMetrics, Metrics, flag_for
from ztunnel.net.copy import CopyCounters, PipePool, copy_bidirectional
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.authz import Connection, Decision, PolicyIndex, decision_log
from ztunnel.state.model import Service, Workload
from ztunnel.state.store import State

if TYPE_CHECKING:
    from ztunnel.hbone.transport import HboneConnection
    from ztunnel.proxy.route import Route

access_log = logging.getLogger("access")
log = logging.getLogger("ztunnel.proxy")
# Rust logs its authorization decisions from ``src/state.rs`` (target ``ztunnel::state``).
authz_log = logging.getLogger("ztunnel.state")

DRAIN_REASON = "connection closed due to connection drain"
# How long an inbound connection waits for its pod's workload to appear in state
# (istio/ztunnel LocalWorkloadInformation); then it fails with UnknownLocalWorkload.
LOCAL_WORKLOAD_WAIT = 5.0


class HboneOutbound(Protocol):
    """Outbound HBONE (``proxy/hbone_outbound.HboneConnector``): CONNECT over a pooled
    connection; the caller bridges the stream, then gives it back."""

    async def open_stream(
        self, route: Route, rec: ConnectionRecord
    ) -> tuple[HboneConnection, int] | None: ...

    def stream_done(self, conn: HboneConnection) -> None: ...


@dataclass(eq=False, slots=True)
class ConnectionRecord:
    """One proxied connection: its access-log fields, live byte counters and metrics handle.

    Slotted: one lives as long as its connection, so it is counted in the per-connection memory.
    """

    direction: str  # "outbound" | "inbound"
    src: SocketAddr
    dst: SocketAddr  # the address actually dialled
    hbone_addr: SocketAddr | HostnameAuthority | None = None
    # Outbound: the captured (original) destination when it differs from ``dst`` (a service VIP,
    # a pod's port before HBONE's 15008), for /config_dump's ``originalDst``.
    orig_dst: SocketAddr | None = None
    double_hbone: bool = False  # outbound through a network gateway (Rust OutboundProtocol)
    src_workload: Workload | None = None
    dst_workload: Workload | None = None
    dst_service: Service | None = None
    src_identity: Identity | None = None
    dst_identity: Identity | None = None
    started: float = field(default_factory=time.monotonic)
    bytes_sent: int = 0  # from the local pod's perspective (reference 7)
    bytes_recv: int = 0
    metrics: ConnectionMetrics | None = None
    # Live counters of the copy in progress; sent = down_to_up when ``sent_is_down_to_up``.
    counters: CopyCounters | None = None
    sent_is_down_to_up: bool = True
    authz: Connection | None = None  # inbound: what the policies were checked against
    # Set by whoever cancels the connection, for the log: an error (a policy change) is the
    # outcome, with its flag; a text (a deleted pod, the HBONE connection gone) is a connection
    # dropped with no error of its own, flag "-" (Rust's drop of an unrecorded result).
    close_reason: str | ProxyError | None = None
    task: asyncio.Task[None] | None = None
    mtls: bool = False  # set by ProxyContext.open_metrics
    # Inbound, source workload unknown: (canonical service, namespace, cluster) from the peer's
    # baggage.
    src_derived: tuple[str, str, str] | None = None
    # Double HBONE: the destination as the inner tunnel's response baggage names it (Rust
    # with_derived_destination); the metrics are opened only once it is known (open_deferred,
    # run at the latest by log_complete).
    dst_derived: BaggageLike | None = None
    open_deferred: Callable[[], None] | None = None
    # Inbound: the host the client named in ``Forwarded: host=`` (Rust's ``for_host``), for
    # /config_dump's ``originalDst``.
    for_host: str | None = None
    _done: bool = False

    def live_bytes(self) -> tuple[int, int]:
        c = self.counters
        if c is None:
            return self.bytes_sent, self.bytes_recv
        if self.sent_is_down_to_up:
            return c.down_to_up, c.up_to_down
        return c.up_to_down, c.down_to_up

    def fields(self) -> dict[str, object]:
        """The access-log fields in Rust's order (``src/proxy/metrics.rs`` ``ConnectionResult``).
        As in Rust, ``src.workload`` falls back to the canonical service and ``src.namespace``
        and ``src.cluster`` to what the peer's baggage names; ``dst.identity`` is the
        destination workload's identity until the peer's certificate is known; the clusters
        are the workloads' ``clusterId`` (absent when empty). Inbound HBONE logs the
        connection's own address as ``dst.addr`` (the pod's IP and 15008, Rust's
        ``original_dst``), the app's address being ``dst.hbone_addr``'s."""
        # (Addresses are formatted for each line, not kept: three strings per connection would
        # cost more memory, ~190 bytes, than their formatting costs CPU.)
        out: dict[str, object] = {"src.addr": _addr_text(self.src)}
        src_cluster = ""
        if self.src_workload is not None:
            out["src.workload"] = self.src_workload.name
            out["src.namespace"] = self.src_workload.namespace
            src_cluster = self.src_workload.cluster_id
        elif self.src_derived is not None:
            canonical, namespace, src_cluster = self.src_derived
            if canonical:
                out["src.workload"] = canonical
            if namespace:
                out["src.namespace"] = namespace
        if self.src_identity is not None:
            out["src.identity"] = str(self.src_identity)
        if src_cluster:
            out["src.cluster"] = src_cluster
        hbone_addr = self.hbone_addr
        if self.direction == "inbound" and hbone_addr is not None:
            # (the upstream's IP is always the one the connection arrived on: inbound_route)
            out["dst.addr"] = f"{_ip_text(self.dst.ip)}:{HBONE_PORT}"
        else:
            out["dst.addr"] = _addr_text(self.dst)
        if hbone_addr is not None:
            out["dst.hbone_addr"] = (
                _addr_text(hbone_addr) if isinstance(hbone_addr, SocketAddr) else str(hbone_addr)
            )
        if self.dst_service is not None:
            out["dst.service"] = self.dst_service.hostname
        derived = self.dst_derived
        dst_cluster = ""
        if derived is not None:
            dst_cluster = derived.cluster_id  # (Rust with_derived_destination: replaced whole)
        if derived is not None and (derived.workload_name or derived.namespace):
            if derived.workload_name:
                out["dst.workload"] = derived.workload_name
            if derived.namespace:
                out["dst.namespace"] = derived.namespace
        elif self.dst_workload is not None:
            out["dst.workload"] = self.dst_workload.name
            out["dst.namespace"] = self.dst_workload.namespace
        if derived is None and self.dst_workload is not None:
            dst_cluster = self.dst_workload.cluster_id
        dst_identity = self.dst_identity
        if dst_identity is None and self.mtls and self.dst_workload is not None:
            dst_identity = self.dst_workload.identity
        if dst_identity is not None:
            out["dst.identity"] = str(dst_identity)
        if dst_cluster:
            out["dst.cluster"] = dst_cluster
        out["direction"] = self.direction
        return out

    def log_opened(self) -> None:
        if access_log.isEnabledFor(logging.DEBUG):
            access_log.debug("connection opened", extra={"fields": self.fields()})

    def log_complete(
        self, error: BaseException | str | None, flag: ResponseFlag | None = None
    ) -> None:
        """The outcome: metrics closed with ``flag`` (by default the error's, see
        :func:`~ztunnel.metrics.flag_for`) and one "connection complete" line."""
        if self._done:
            return
        self._done = True
        if self.open_deferred is not None:
            self.open_deferred()
            self.open_deferred = None
        if self.counters is not None:
            self.bytes_sent, self.bytes_recv = self.live_bytes()
        if self.metrics is not None:
            if flag is None:
                flag = flag_for(error)
            self.metrics.close(self.bytes_sent, self.bytes_recv, flag=flag)
        f = self.fields()
        f["bytes_sent"] = self.bytes_sent
        f["bytes_recv"] = self.bytes_recv
        f["duration"] = f"{round((time.monotonic() - self.started) * 1000)}ms"
        if error is not None:
            f["error"] = str(error)
            log_fields(access_log, logging.ERROR, "connection complete", f)
        else:
            log_fields(access_log, logging.INFO, "connection complete", f)

    def log_cancelled(self) -> None:
        """The connection task was cancelled: by a policy change (its error and flag DENY), a
        deleted pod or the drain (dropped: flag "-", as Rust records a result it drops)."""
        reason = self.close_reason or DRAIN_REASON
        self.log_complete(reason, None if isinstance(reason, ProxyError) else ResponseFlag.NONE)


@functools.lru_cache(maxsize=4096)
def _ip_text(ip: IPAddr) -> str:
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _addr_text(addr: SocketAddr) -> str:
    """``str(addr)`` with the IP's text memoised (a proxy sees the same few IPs again and again;
    ``ipaddress`` formats an address anew for every ``str``)."""
    return f"{_ip_text(addr.ip)}:{addr.port}"


class ConnectionTracker:
    """The live connections of one proxy instance, for metrics flushing and policy re-checks."""

    def __init__(self) -> None:
        self.live: set[ConnectionRecord] = set()

    def add(self, rec: ConnectionRecord) -> None:
        rec.task = asyncio.current_task()
        self.live.add(rec)

    def discard(self, rec: ConnectionRecord) -> None:
        self.live.discard(rec)

    def flush_metrics(self) -> None:
        for rec in self.live:
            if rec.metrics is not None:
                rec.metrics.flush(*rec.live_bytes())

    def recheck(
        self, index: PolicyIndex, workload: Workload | None, log_level: int = logging.DEBUG
    ) -> int:
        """Close every inbound connection the current policies no longer allow (Rust
        ``PolicyWatcher``: the access log says "connection closed due to policy change", flag
        DENY). Each re-check logs its decision at ``log_level``, as the first check did."""
        if workload is None:
            return 0
        closed = 0
        logged = authz_log.isEnabledFor(log_level)
        for rec in list(self.live):
            if rec.authz is None or rec.task is None or rec.task.done():
                continue
            decision = index.evaluate(workload, rec.authz)
            if logged:
                log_decision(decision, log_level)
            if not decision.allowed:
                rec.close_reason = PolicyLateRejection()
                log.info(
                    "connection %s (%s) closed because it's no longer allowed after a policy "
                    "update",
                    rec.authz,
                    workload.uid,
                )
                rec.task.cancel()
                closed += 1
        return closed


class _Tracked:
    """The scope of :meth:`ProxyContext.tracked`. A plain class, not ``contextlib.contextmanager``:
    it lives as long as the connection, and a generator-based one costs ~400 bytes more."""

    __slots__ = ("rec", "tracker")

    def __init__(self, tracker: ConnectionTracker, rec: ConnectionRecord) -> None:
        self.tracker = tracker
        self.rec = rec

    def __enter__(self) -> None:
        self.tracker.add(self.rec)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                self.rec.log_cancelled()
        finally:
            self.tracker.discard(self.rec)


@dataclass
class ProxyContext:
    config: Config
    state: State
    sockets: SocketFactory
    pipes: PipePool | None
    local_workload: Callable[[], Workload | None]
    # Who the local workload is (the ZDS/PROXY_WORKLOAD_INFO name), to wait for it by.
    workload_info: WorkloadInfo | None = None
    local_identity: Callable[[], Identity | None] = lambda: None
    local_info: WorkloadInfo | None = None  # who this proxy serves, for the errors that say it
    local_ips: Callable[[], frozenset[IPAddr]] = frozenset
    hbone: HboneOutbound | None = None
    metrics: Metrics | None = None
    policies: PolicyIndex | None = None
    tracker: ConnectionTracker = field(default_factory=ConnectionTracker)

    def open_metrics(
        self,
        rec: ConnectionRecord,
        *,
        mtls: bool,
        baggage: BaggageLike | None = None,
        for_host: str | None = None,
    ) -> None:
        """The connection is opened: fill in what the access log and the metric labels derive
        (inbound: the destination service guessed as Rust does, the baggage fallbacks), log
        "connection opened" and count it."""
        rec.mtls = mtls
        rec.for_host = for_host
        if rec.direction == "inbound" and rec.dst_service is None and rec.dst_workload is not None:
            rec.dst_service = guess_inbound_service(
                self.state, rec.dst_workload, rec.dst.port, for_host
            )
        if (
            rec.src_workload is None
            and baggage is not None
            and (baggage.service_name or baggage.namespace or baggage.cluster_id)
        ):
            rec.src_derived = (baggage.service_name, baggage.namespace, baggage.cluster_id)
        rec.log_opened()
        if self.metrics is not None:
            rec.metrics = self.metrics.open_for_record(rec, mtls=mtls, baggage=baggage)

    async def wait_local_workload(self, timeout: float = LOCAL_WORKLOAD_WAIT) -> Workload | None:
        """The local workload; while it is unknown (a pod handed over before istiod sent its
        workload), wait for it up to ``timeout`` seconds, then give up (None), as Rust's
        ``LocalWorkloadInformation::get_workload``."""
        wl = self.local_workload()
        if wl is not None or self.workload_info is None:
            return wl
        i = self.workload_info
        return await self.state.wait_for_workload(
            i.name, i.namespace, i.service_account, self.config.node_name or None, timeout
        )

    @property
    def authz_log_level(self) -> int:
        """Rust ``authpol_log!``: info with ``AUTHZ_POLICY_INFO_LOGGING=true``, else debug."""
        return logging.INFO if self.config.authz_policy_info_logging else logging.DEBUG

    def unknown_local_workload(self) -> UnknownLocalWorkload:
        """The error for a connection whose local workload never appeared in state."""
        i = self.local_info
        return UnknownLocalWorkload(*((i.namespace, i.name, i.service_account) if i else ("",) * 3))

    def tracked(self, rec: ConnectionRecord) -> _Tracked:
        """Run a connection's copy phase as a live connection: tracked for metrics and policy
        re-checks, and logged with its close reason if it is cancelled (``with ctx.tracked(rec):``)."""
        return _Tracked(self.tracker, rec)

    async def proxy_tcp(
        self,
        rec: ConnectionRecord,
        sock: socket.socket,
        target: SocketAddr,
        *,
        spoof_source: IPAddr | None = None,
    ) -> None:
        """Plain TCP to ``target``, then copy both ways until both end; logs the outcome."""
        try:
            upstream = await self.sockets.connect(target, spoof_source=spoof_source)
        except ProxyError as e:
            rec.log_complete(e)
            return
        result = await copy_bidirectional(sock, upstream, pipes=self.pipes, counters=rec.counters)
        rec.log_complete(reportable(result.error))

    def authorize(self, rec: ConnectionRecord, workload: Workload) -> None:
        """Check an inbound connection against the policies; raises AuthorizationDenied."""
        if self.policies is None:
            return
        conn = Connection(
            rec.src.ip, rec.src_identity, rec.dst.ip, rec.dst.port, self.config.network
        )
        decision = self.policies.evaluate(workload, conn)
        level = self.authz_log_level
        if authz_log.isEnabledFor(level):  # (one check: nothing is built for a disabled level)
            log_decision(decision, level)
        if not decision.allowed:
            raise AuthorizationDenied(decision.reason)
        rec.authz = conn


def log_decision(decision: Decision, level: int) -> None:
    """Rust ``assert_rbac``'s lines for ``decision`` (``state.authz.decision_log``), each with
    the deciding policy as its ``policy`` field."""
    for msg, policy in decision_log(decision):
        log_fields(authz_log, level, msg, {} if policy is None else {"policy": policy})


def guess_inbound_service(
    state: State, workload: Workload, port: int, for_host: str | None = None
) -> Service | None:
    """The service an inbound connection to ``workload``:``port`` was most likely meant for, for
    the metrics and the access log (Rust ``proxy::guess_inbound_service``): the one the client
    named (``Forwarded: host=``) if the workload backs it, else the first of its services with a
    target port (or this endpoint's own port mapping) equal to ``port``."""
    services = state.services_for(workload)
    if for_host:
        for svc in services:
            if svc.hostname == for_host:
                return svc
    for svc in services:
        endpoint_ports = workload.services.get(svc.key, {})
        for sp in svc.ports:
            if sp.target_port == port or endpoint_ports.get(sp.service_port) == port:
                return svc
    return None


def log_failed(
    direction: str, src: SocketAddr, dst: SocketAddr, error: BaseException | str
) -> None:
    """An early denial, before any upstream was chosen."""
    access_log.warning(
        "connection failed",
        extra={
            "fields": {
                "src.addr": str(src),
                "dst.addr": str(dst),
                "direction": direction,
                "error": str(error),
            }
        },
    )
