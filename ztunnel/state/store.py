"""In-memory indexes of workloads, services and policies, with synchronous ``find_*`` lookups.

Invariant: every secondary index is updated inside the same call that changes the primary map, so
a lookup never sees a half-applied upsert. Nothing here does I/O or awaits; the async layer
(``fetch_*``/``wait_for_*``) sits on top and learns about changes through :meth:`State.subscribe`.
Lookup and load-balancing rules follow istio/ztunnel ``src/state.rs`` and ``src/state/*.rs``.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ztunnel.core.addr import IPAddr
from ztunnel.state.model import (
    Authorization,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    PolicyScope,
    Service,
    ServiceVisibility,
    TunnelProtocol,
    Workload,
    WorkloadStatus,
)

__all__ = ["ChangeKind", "State", "StateChange", "Subscriber"]


class ChangeKind(enum.Enum):
    WORKLOAD = "workload"
    SERVICE = "service"
    POLICY = "policy"


@dataclass(frozen=True, slots=True)
class StateChange:
    """One mutation: ``key`` is the workload uid, the service ``ns/hostname`` or policy ``ns/name``."""

    kind: ChangeKind
    key: str
    removed: bool = False


Subscriber = Callable[[StateChange], None]

_NO_PORTS: dict[int, int] = {}
_K = TypeVar("_K")


def visible_to(service: Service, client_namespace: str) -> bool:
    """Rust ``Service::visible_to``: a NAMESPACE-scoped service is seen only from its own
    namespace; every other service from everywhere."""
    return service.visibility is not ServiceVisibility.NAMESPACE or (
        service.namespace == client_namespace
    )


def find_best_match(
    services: Iterable[Service],
    client_namespace: str | None,
    preferred_namespace: str | None = None,
) -> Service | None:
    """Rust ``ServiceMatch::find_best_match`` over services sharing a key (VIP or hostname), in
    insertion order: one in the client's namespace at once; else the last ``canonical`` one;
    else the last one in ``preferred_namespace`` seen before any canonical one; else the first.
    """
    best: Service | None = None
    rank = 0  # 0 none, 1 first, 2 preferred namespace, 3 canonical
    for s in services:
        if client_namespace is not None and s.namespace == client_namespace:
            return s
        if s.canonical:
            best, rank = s, 3
        elif preferred_namespace is not None and s.namespace == preferred_namespace and rank != 3:
            best, rank = s, 2
        elif rank == 0:
            best, rank = s, 1
    return best


def _addr_rank(w: Workload) -> int:
    # Rust WorkloadByAddr::get: when several workloads claim one IP, prefer Pods (hard to spoof),
    # then mesh (HBONE) workloads.
    return (2 if "//Pod/" in w.uid else 0) + (1 if w.protocol is TunnelProtocol.HBONE else 0)


def _scope_matches(scope: LoadBalancerScope, src: Workload, dst: Workload) -> bool:
    if scope is LoadBalancerScope.REGION:
        return src.locality.region == dst.locality.region
    if scope is LoadBalancerScope.ZONE:
        return src.locality.zone == dst.locality.zone
    if scope is LoadBalancerScope.SUBZONE:
        return src.locality.subzone == dst.locality.subzone
    if scope is LoadBalancerScope.NODE:
        return src.node == dst.node
    if scope is LoadBalancerScope.CLUSTER:
        return src.cluster_id == dst.cluster_id
    if scope is LoadBalancerScope.NETWORK:
        return src.network == dst.network
    return False  # UNSPECIFIED: Rust rejects it at conversion; never a match here


def _rank_endpoints(
    candidates: list[Workload], lb: LoadBalancing, source: Workload | None
) -> list[Workload]:
    """Keep the endpoints with the best locality rank (Rust ``load_balance``, non-Standard modes).

    The rank is the number of leading ``routing_preference`` scopes that match the source; the
    first mismatch stops the count. STRICT drops any endpoint that does not match them all.
    When NETWORK is the first preference ("network preferred"), a network mismatch does not
    stop the count (the other scopes are still tried) and a network match is worth
    ``len(prefs) - 1`` extra, so any same-network endpoint outranks every other-network one.
    """
    prefs = lb.routing_preference
    strict = lb.mode is LoadBalancerMode.STRICT
    network_preferred = bool(prefs) and prefs[0] is LoadBalancerScope.NETWORK
    best = -1
    out: list[Workload] = []
    for wl in candidates:
        rank = 0
        adjust = 0
        if source is not None:  # no source: nothing to compare against, every endpoint ranks 0
            for scope in prefs:
                if scope is LoadBalancerScope.NETWORK and network_preferred:
                    if source.network != wl.network:
                        continue
                    adjust = len(prefs) - 1
                elif not _scope_matches(scope, source, wl):
                    break
                rank += 1
        if strict and rank != len(prefs):
            continue
        rank += adjust
        if rank > best:
            best, out = rank, [wl]
        elif rank == best:
            out.append(wl)
    return out


def _pick_weighted(candidates: list[Workload], rng: random.Random) -> Workload | None:
    """Random choice weighted by ``capacity``; zero-capacity endpoints are never picked and an
    all-zero set yields None (Rust ``choose_weighted`` fails on a zero total)."""
    n = len(candidates)
    if n == 0:
        return None
    total = 0
    uniform = True
    for wl in candidates:
        cap = wl.capacity if wl.capacity > 0 else 0
        total += cap
        if cap != 1:
            uniform = False
    if total == 0:
        return None
    if uniform:  # the common case: every capacity is the default 1
        return candidates[0] if n == 1 else candidates[rng.randrange(n)]
    x = rng.randrange(total)
    for wl in candidates:
        cap = wl.capacity if wl.capacity > 0 else 0
        if x < cap:
            return wl
        x -= cap
    raise AssertionError("unreachable: x < total")


def pick_workload_ip(
    workload: Workload, original_dst: IPAddr, ip_families: IPFamilies = IPFamilies.AUTOMATIC
) -> IPAddr | None:
    """The IP to dial on ``workload`` (Rust ``pick_workload_destination_or_resolve``): the
    original destination when it is one of the workload's IPs; else, among the IPs the
    service's ``ip_families`` allows (AUTOMATIC and DUAL: all), the first of the original
    destination's family, else the first. None: no usable IP (the caller resolves the
    workload's hostname or goes through its network gateway)."""
    ips = workload.addresses
    if original_dst in ips:
        return original_dst
    if ip_families is IPFamilies.IPV4_ONLY:
        ips = tuple(ip for ip in ips if ip.version == 4)
    elif ip_families is IPFamilies.IPV6_ONLY:
        ips = tuple(ip for ip in ips if ip.version == 6)
    want = original_dst.version
    for ip in ips:
        if ip.version == want:
            return ip
    return ips[0] if ips else None


class State:
    """Workloads, services and authorization policies, indexed for the per-connection lookups."""

    __slots__ = (
        "_by_addr",
        "_by_cidr_vip",
        "_by_host",
        "_by_identity",
        "_by_vip",
        "_by_wl_hostname",
        "_endpoints",
        "_generation",
        "_policies",
        "_policies_by_ns",
        "_rng",
        "_services",
        "_subscribers",
        "_wl_waiters",
        "_workloads",
        "demander",
    )

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._workloads: dict[str, Workload] = {}
        # An IP may be claimed by several workloads (Rust keeps them all and ranks on lookup).
        self._by_addr: dict[NetworkAddress, list[Workload]] = {}
        self._by_identity: dict[tuple[str, str], dict[str, Workload]] = {}
        self._by_wl_hostname: dict[str, dict[str, Workload]] = {}
        # service key -> uid -> workload. Kept even before the service arrives (xDS may send
        # workloads first), so endpoints appear as soon as the service does.
        self._endpoints: dict[str, dict[str, Workload]] = {}
        self._services: dict[str, Service] = {}
        # VIP -> namespace -> service: several services (one per namespace) may share a VIP,
        # in insertion order (Rust ServiceStore::by_vip, a list replaced per namespace).
        self._by_vip: dict[NetworkAddress, dict[str, Service]] = {}
        self._by_cidr_vip: list[tuple[NetworkCidr, Service]] = []
        self._by_host: dict[str, dict[str, Service]] = {}  # hostname -> namespace -> service
        self._policies: dict[str, Authorization] = {}
        # namespace ("" = global) -> ordered set of policy keys; selector policies are not here.
        self._policies_by_ns: dict[str, dict[str, None]] = {}
        self._subscribers: list[Subscriber] = []
        # (namespace, service account) -> resolved at the next upsert of a workload with that
        # identity: what connections waiting for their own pod's workload await (one future
        # shared by every waiter of the identity).
        self._wl_waiters: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._generation = 0
        # XDS_ON_DEMAND: asks the control plane for one resource name (a workload uid, a
        # "ns/hostname" or "<network>/<ip>") and returns once it answered (Rust Demander).
        self.demander: Callable[[str], Awaitable[None]] | None = None

    # --- change notification -------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Bumped on every mutation; a cheap "did anything change" check for pollers."""
        return self._generation

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` synchronously after every mutation; returns an unsubscribe function.

        Callbacks run on the mutating thread with the state already updated; an exception from
        one propagates to the mutator (the state change itself is already complete).
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def _notify(self, kind: ChangeKind, key: str, removed: bool) -> None:
        self._generation += 1
        if self._subscribers:
            change = StateChange(kind, key, removed)
            for cb in tuple(self._subscribers):
                cb(change)

    # --- workloads -----------------------------------------------------------------------

    def upsert_workload(self, w: Workload) -> None:
        old = self._workloads.get(w.uid)
        if old is not None:
            self._unindex_workload(old)
        self._workloads[w.uid] = w
        self._index_workload(w)
        if self._wl_waiters:
            fut = self._wl_waiters.pop((w.namespace, w.service_account), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._notify(ChangeKind.WORKLOAD, w.uid, False)

    def remove_workload(self, uid: str) -> Workload | None:
        old = self._workloads.pop(uid, None)
        if old is None:
            return None
        self._unindex_workload(old)
        self._notify(ChangeKind.WORKLOAD, uid, True)
        return old

    def _index_workload(self, w: Workload) -> None:
        # Host-network workloads share the node IP: indexing it would shadow the node (Rust
        # skips them too).
        if w.network_mode is not NetworkMode.HOST_NETWORK:
            for ip in w.addresses:
                self._by_addr.setdefault(NetworkAddress(w.network, ip), []).append(w)
        self._by_identity.setdefault((w.namespace, w.service_account), {})[w.uid] = w
        if w.hostname:
            self._by_wl_hostname.setdefault(w.hostname, {})[w.uid] = w
        for key in w.services:
            self._endpoints.setdefault(key, {})[w.uid] = w

    def _unindex_workload(self, w: Workload) -> None:
        uid = w.uid
        if w.network_mode is not NetworkMode.HOST_NETWORK:
            for ip in w.addresses:
                k = NetworkAddress(w.network, ip)
                lst = self._by_addr.get(k)
                if lst is None:
                    continue
                lst[:] = [x for x in lst if x.uid != uid]
                if not lst:
                    del self._by_addr[k]
        _discard(self._by_identity, (w.namespace, w.service_account), uid)
        if w.hostname:
            _discard(self._by_wl_hostname, w.hostname, uid)
        for key in w.services:
            _discard(self._endpoints, key, uid)

    def find_workload_by_uid(self, uid: str) -> Workload | None:
        return self._workloads.get(uid)

    def find_workload_by_addr(self, addr: NetworkAddress) -> Workload | None:
        # Exact: ::ffff:a.b.c.d is not a.b.c.d here (Rust keys by IpAddr; sockets canonicalise).
        lst = self._by_addr.get(addr)
        if not lst:
            return None
        if len(lst) == 1:
            return lst[0]
        best = lst[0]
        best_rank = _addr_rank(best)
        for w in lst[1:]:
            r = _addr_rank(w)
            if r >= best_rank:  # ties go to the later one, as Rust's max_by_key does
                best, best_rank = w, r
        return best

    def find_workload_by_info(
        self, name: str, namespace: str, service_account: str, node: str | None = None
    ) -> Workload | None:
        """The workload a ZDS WorkloadInfo describes (name, namespace, SA), optionally on ``node``.

        Several matches can only come from bad config; the earliest inserted wins.
        """
        cands = self._by_identity.get((namespace, service_account))
        if not cands:
            return None
        for w in cands.values():
            if w.name == name and (node is None or w.node == node):
                return w
        return None

    async def wait_for_workload(
        self,
        name: str,
        namespace: str,
        service_account: str,
        node: str | None,
        timeout: float,
    ) -> Workload | None:
        """Rust ``DemandProxyState::wait_for_workload``: :meth:`find_workload_by_info`, and
        while it is unknown (a pod handed over before istiod sent its workload), wait for it up
        to ``timeout`` seconds, then give up (None). Woken by upserts of that identity only."""
        found = self.find_workload_by_info(name, namespace, service_account, node)
        if found is not None or timeout <= 0:
            return found
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = (namespace, service_account)
        while (remaining := deadline - loop.time()) > 0:
            fut = self._wl_waiters.get(key)
            if fut is None or fut.done():
                fut = self._wl_waiters[key] = loop.create_future()
            await asyncio.wait((fut,), timeout=remaining)  # (never cancels the shared future)
            found = self.find_workload_by_info(name, namespace, service_account, node)
            if found is not None:
                return found
        return None

    def find_workload_by_hostname(
        self, hostname: str, namespace: str | None = None
    ) -> Workload | None:
        cands = self._by_wl_hostname.get(hostname)
        if not cands:
            return None
        for w in cands.values():
            if namespace is None or w.namespace == namespace:
                return w
        return None

    def workloads(self) -> Iterator[Workload]:
        return iter(tuple(self._workloads.values()))

    def identity_on_node(self, namespace: str, service_account: str, node: str) -> bool:
        """Whether any workload with this identity remains on ``node`` ("" = any node): the
        test behind Rust ``WorkloadStore::was_last_identity_on_node`` (which, like this,
        ignores the trust domain)."""
        cands = self._by_identity.get((namespace, service_account))
        if not cands:
            return False
        return not node or any(w.node == node for w in cands.values())

    # --- services ------------------------------------------------------------------------

    def upsert_service(self, s: Service) -> None:
        key = s.key
        old = self._services.get(key)
        if old is not None:
            self._unindex_service(old)
        self._services[key] = s
        for vip in s.vips:
            # One slot per namespace: a later service of the same namespace takes it over.
            self._by_vip.setdefault(vip, {})[s.namespace] = s
        for cidr in s.cidr_vips:
            self._by_cidr_vip.append((cidr, s))
        self._by_host.setdefault(s.hostname, {})[s.namespace] = s
        self._notify(ChangeKind.SERVICE, key, False)

    def remove_service(self, key: str) -> Service | None:
        old = self._services.pop(key, None)
        if old is None:
            return None
        self._unindex_service(old)
        self._notify(ChangeKind.SERVICE, key, True)
        return old

    def _unindex_service(self, s: Service) -> None:
        key = s.key
        for vip in s.vips:
            # Rust ServiceStore::remove drops the namespace's slot, whoever holds it now.
            slots = self._by_vip.get(vip)
            if slots is not None:
                slots.pop(s.namespace, None)
                if not slots:
                    del self._by_vip[vip]
        if s.cidr_vips:
            self._by_cidr_vip = [(c, x) for c, x in self._by_cidr_vip if x.key != key]
        by_ns = self._by_host.get(s.hostname)
        if by_ns is not None:
            by_ns.pop(s.namespace, None)
            if not by_ns:
                del self._by_host[s.hostname]

    def find_service(self, key: str) -> Service | None:
        """Exact lookup by ``"ns/hostname"``."""
        return self._services.get(key)

    def find_services_by_vip(self, addr: NetworkAddress) -> list[Service]:
        """Every service holding ``addr`` as an exact VIP, in insertion order."""
        slots = self._by_vip.get(addr)
        return list(slots.values()) if slots else []

    def find_service_by_vip(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Service | None:
        """Rust ``ServiceStore::get_best_by_vip``: among the services on this exact VIP that
        are visible to a client in ``namespace`` (None: no filter), the best match
        (:func:`find_best_match`); else the best CIDR VIP containing it."""
        slots = self._by_vip.get(addr)
        if slots:
            if len(slots) == 1 and namespace is None:
                return next(iter(slots.values()))
            cands: Iterable[Service] = slots.values()
            if namespace is not None:
                cands = [s for s in cands if visible_to(s, namespace)]
            best = find_best_match(cands, namespace)
            if best is not None:
                return best
        if self._by_cidr_vip:
            return self._best_by_cidr_vip(addr, namespace)
        return None

    def _best_by_cidr_vip(self, addr: NetworkAddress, namespace: str | None) -> Service | None:
        """Rust ``get_best_by_cidr_vip``: rank (client's namespace, prefix length, canonical),
        the first of equal rank winning."""
        best: Service | None = None
        best_rank: tuple[bool, int, bool] | None = None
        ip = addr.address
        for nc, svc in self._by_cidr_vip:
            if nc.network != addr.network or ip.version != nc.cidr.version or ip not in nc.cidr:
                continue
            if namespace is not None and not visible_to(svc, namespace):
                continue
            rank = (
                namespace is not None and svc.namespace == namespace,
                nc.cidr.prefixlen,
                svc.canonical,
            )
            if best_rank is None or rank > best_rank:
                best, best_rank = svc, rank
        return best

    def find_services_by_hostname(self, hostname: str) -> list[Service]:
        """All services with this hostname, one per namespace, ordered by namespace."""
        by_ns = self._by_host.get(hostname)
        return [by_ns[ns] for ns in sorted(by_ns)] if by_ns else []

    def find_service_by_hostname(
        self,
        hostname: str,
        prefer_namespace: str | None = None,
        *,
        preferred_namespace: str | None = None,
    ) -> Service | None:
        """Rust ``ServiceStore::get_best_by_host``: among same-hostname services (ServiceEntry
        allows one per namespace) visible to a client in ``prefer_namespace`` (None: no
        filter), the client's namespace, else the last ``canonical`` one, else one in
        ``preferred_namespace`` (PREFERED_SERVICE_NAMESPACE), else the first inserted."""
        by_ns = self._by_host.get(hostname)
        if not by_ns:
            return None
        cands: Iterable[Service] = by_ns.values()
        if prefer_namespace is not None:
            cands = [s for s in cands if visible_to(s, prefer_namespace)]
        return find_best_match(cands, prefer_namespace, preferred_namespace)

    def services(self) -> Iterator[Service]:
        return iter(tuple(self._services.values()))

    def services_for(self, workload: Workload) -> list[Service]:
        """The known services this workload is an endpoint of."""
        return [s for k in workload.services if (s := self._services.get(k)) is not None]

    # --- mixed lookups -------------------------------------------------------------------

    def find_address(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """Workload or service at ``addr``. A workload IP wins over a service VIP, as in Rust
        ``ProxyState::find_address`` (outbound routing checks VIPs first itself: use
        :meth:`find_service_by_vip` then :meth:`find_workload_by_addr` for that). ``namespace``
        is the client's, for VIPs shared by several services and visibility."""
        w = self.find_workload_by_addr(addr)
        if w is not None:
            return w
        return self.find_service_by_vip(addr, namespace)

    async def fetch_address(
        self, addr: NetworkAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """:meth:`find_address`, asking the control plane for ``"<network>/<ip>"`` first when
        it is unknown and on-demand xDS is on (Rust ``DemandProxyState::fetch_address``)."""
        found = self.find_address(addr, namespace)
        if found is not None or self.demander is None:
            return found
        await self.demander(str(addr))
        return self.find_address(addr, namespace)

    async def fetch_workload_by_uid(self, uid: str) -> Workload | None:
        """Rust ``fetch_workload_by_uid``: the uid, on demand when unknown."""
        found = self._workloads.get(uid)
        if found is not None or self.demander is None:
            return found
        await self.demander(uid)
        return self._workloads.get(uid)

    def find_hostname(self, namespace: str, hostname: str) -> Workload | Service | None:
        """Service ``namespace/hostname``, else a workload with that hostname in the namespace."""
        s = self._services.get(f"{namespace}/{hostname}")
        if s is not None:
            return s
        return self.find_workload_by_hostname(hostname, namespace)

    def find_gateway(
        self, gw: GatewayAddress, namespace: str | None = None
    ) -> Workload | Service | None:
        """Resolve a waypoint/network-gateway reference to what it names; ``namespace`` is the
        client's (a VIP shared by several services, visibility: Rust find_upstream)."""
        if gw.address is not None:
            return self.find_address(gw.address, namespace)
        if gw.hostname is not None:
            return self.find_hostname(gw.hostname.namespace, gw.hostname.hostname)
        return None

    # --- endpoints and load balancing ----------------------------------------------------

    def endpoints(self, service: Service) -> list[Workload]:
        """Workloads listing ``service`` in their ``services`` map (healthy or not)."""
        eps = self._endpoints.get(service.key)
        return list(eps.values()) if eps else []

    def endpoint_target_port(
        self, service: Service, workload: Workload, service_port: int
    ) -> int | None:
        """The port to dial on ``workload`` for ``service:service_port`` (Rust
        ``find_upstream_from_service``): the endpoint's own mapping, else the service's
        non-zero target port, else the service port itself when the workload has an application
        tunnel port; None means the endpoint cannot serve this port.

        A service target port of 0 means "named port, resolved per endpoint" (istiod sends 0
        when the Kubernetes targetPort is a name), so it never falls back to the service port.
        """
        ov = workload.services.get(service.key)
        if ov is not None:
            p = ov.get(service_port)
            if p is not None:
                return p
        for sp in service.ports:
            if sp.service_port == service_port:
                if sp.target_port > 0:
                    return sp.target_port
                break
        tunnel = workload.application_tunnel
        if tunnel is not None and tunnel.port is not None:
            return service_port
        return None

    def load_balance(
        self,
        service: Service,
        service_port: int,
        source: Workload | None,
        rng: random.Random | None = None,
        *,
        for_waypoint: bool = False,
    ) -> tuple[Workload, int] | None:
        """Pick an endpoint of ``service`` for a connection to ``service_port``; returns the
        workload and the target port to dial, or None ("no healthy upstream").

        Mirrors Rust ``ProxyState::load_balance``:

        1. the service must expose the port (waypoint resolution skips this: a waypoint is
           addressed as ``svc:15008`` and app-tunnel endpoints need no port);
        2. UNHEALTHY endpoints are dropped unless ``health_policy`` is ALLOW_ALL;
        3. an endpoint with neither IPs nor hostname is usable only through its network gateway
           from another network;
        4. with a service target port of 0 the endpoint must map the port itself;
        5. in STRICT/FAILOVER (any mode but Standard) endpoints are ranked by leading
           ``routing_preference`` matches against ``source``; STRICT keeps full matches only,
           and only the best rank survives;
        6. a random pick weighted by ``capacity`` (0 never picked; all zero -> None).

        ``source`` None (no local workload) compares networks against "" and ranks every
        endpoint 0. PASSTHROUGH services are the caller's business: it should not call this.
        """
        svc_target: int | None = None
        for sp in service.ports:
            if sp.service_port == service_port:
                svc_target = sp.target_port
                break
        if svc_target is None and not for_waypoint:
            return None
        members = self._endpoints.get(service.key)
        if not members:
            return None
        lb = service.load_balancing
        allow_unhealthy = lb is not None and lb.health_policy is HealthPolicy.ALLOW_ALL
        src_network = source.network if source is not None else ""
        key = service.key
        candidates: list[Workload] = []
        for wl in members.values():
            if wl.status is WorkloadStatus.UNHEALTHY and not allow_unhealthy:
                continue
            # WDS is client-agnostic: an address-less workload comes with a network gateway
            # even when it is on our own network, where the gateway must not be used.
            if (
                not wl.addresses
                and not wl.hostname
                and (wl.network == src_network or wl.network_gateway is None)
            ):
                continue
            if for_waypoint:
                if svc_target is None and wl.application_tunnel is None:
                    continue
            elif not svc_target and service_port not in wl.services.get(key, _NO_PORTS):
                continue
            candidates.append(wl)
        if lb is not None and lb.mode is not LoadBalancerMode.UNSPECIFIED and candidates:
            candidates = _rank_endpoints(candidates, lb, source)
        chosen = _pick_weighted(candidates, rng if rng is not None else self._rng)
        if chosen is None:
            return None
        port = self.endpoint_target_port(service, chosen, service_port)
        if port is None:  # only reachable in waypoint mode, and Rust gives up here too
            return None
        return chosen, port

    # --- policies ------------------------------------------------------------------------

    def upsert_policy(self, p: Authorization) -> None:
        key = p.key
        old = self._policies.get(key)
        if old is not None:
            self._unindex_policy(old)
        self._policies[key] = p
        ns = self._policy_index_ns(p)
        if ns is not None:
            self._policies_by_ns.setdefault(ns, {})[key] = None
        self._notify(ChangeKind.POLICY, key, False)

    def remove_policy(self, key: str) -> Authorization | None:
        old = self._policies.pop(key, None)
        if old is None:
            return None
        self._unindex_policy(old)
        self._notify(ChangeKind.POLICY, key, True)
        return old

    @staticmethod
    def _policy_index_ns(p: Authorization) -> str | None:
        # GLOBAL policies live in the root namespace but apply everywhere: index them under "".
        # WORKLOAD_SELECTOR policies apply only via Workload.authorization_policies.
        if p.scope is PolicyScope.GLOBAL:
            return ""
        if p.scope is PolicyScope.NAMESPACE:
            return p.namespace
        return None

    def _unindex_policy(self, p: Authorization) -> None:
        ns = self._policy_index_ns(p)
        if ns is not None:
            keys = self._policies_by_ns.get(ns)
            if keys is not None:
                keys.pop(p.key, None)
                if not keys:
                    del self._policies_by_ns[ns]

    def find_policy(self, key: str) -> Authorization | None:
        return self._policies.get(key)

    def policies(self) -> Iterator[Authorization]:
        return iter(tuple(self._policies.values()))

    def policies_for(self, workload: Workload) -> list[Authorization]:
        """Policies that apply to ``workload`` as a destination: its namespace's, the global
        ones, then those its ``authorization_policies`` names; each once, unknown keys skipped
        (the control plane may not have sent them yet)."""
        out: list[Authorization] = []
        seen: set[str] = set()
        groups: tuple[Iterable[str], ...] = (
            self._policies_by_ns.get(workload.namespace, ()),
            self._policies_by_ns.get("", ()) if workload.namespace != "" else (),
            workload.authorization_policies,
        )
        for keys in groups:
            for k in keys:
                if k in seen:
                    continue
                p = self._policies.get(k)
                if p is not None:
                    seen.add(k)
                    out.append(p)
        return out

    # --- bulk ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove everything, notifying subscribers of each removal."""
        for uid in list(self._workloads):
            self.remove_workload(uid)
        for key in list(self._services):
            self.remove_service(key)
        for key in list(self._policies):
            self.remove_policy(key)


def _discard(index: dict[_K, dict[str, Workload]], key: _K, uid: str) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.pop(uid, None)
        if not bucket:
            del index[key]
