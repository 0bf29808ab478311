"""The outbound routing decision: a pure function from (state, source, original destination) to a
frozen ``Route`` value. No sockets here; the outbound listener executes the value.

Follows istio/ztunnel ``src/proxy/outbound.rs`` (reference 2.7).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import NamedTuple

from ztunnel.config import ILLEGAL_PORTS
from ztunnel.core.addr import HostnameAuthority, IPAddr, SocketAddr
from ztunnel.core.errors import (
    NoHealthyUpstream,
    NoValidDestination,
    ProxyError,
    SelfCallError,
    UnknownNetworkGateway,
    UnknownWaypoint,
    UnsupportedRoute,
)
from ztunnel.core.identity import Identity
from ztunnel.state.model import (
    GatewayAddress,
    LoadBalancerMode,
    NetworkAddress,
    Service,
    TunnelProtocol,
    Workload,
)
from ztunnel.state.store import State, pick_workload_ip


class RouteKind(enum.Enum):
    PASSTHROUGH = "passthrough"  # not in the mesh: plain TCP to the original destination
    DIRECT = "direct"  # a mesh workload that takes plain TCP (tunnel protocol NONE)
    HBONE = "hbone"  # mTLS + HTTP/2 CONNECT to <ip>:15008
    # Another network: an inner HBONE tunnel to the destination inside an outer one to the
    # network's gateway (Rust OutboundProtocol::DOUBLEHBONE).
    DOUBLE_HBONE = "double-hbone"


class Route(NamedTuple):
    """What to do with one outbound connection: an immutable value (a named tuple, built in
    half the time of a frozen dataclass, once per connection)."""

    kind: RouteKind
    target: SocketAddr  # the address actually dialled
    authority: SocketAddr | HostnameAuthority | None = None  # HBONE: the CONNECT :authority
    expected_identities: tuple[Identity, ...] = ()  # HBONE: SANs the server may present
    # DOUBLE_HBONE: the SANs the final destination may present in the inner tunnel (the outer
    # one is the gateway's, in expected_identities)
    final_identities: tuple[Identity, ...] = ()
    destination_workload: Workload | None = None
    destination_service: Service | None = None
    via_waypoint: bool = False

    def describe(self) -> str:
        if self.kind is RouteKind.HBONE or self.kind is RouteKind.DOUBLE_HBONE:
            return f"hbone {self.target} authority={self.authority}"
        return f"{self.kind.value} {self.target}"


def is_self_call(
    dst: SocketAddr, local_ips: Collection[IPAddr], illegal_ports: Collection[int] = ILLEGAL_PORTS
) -> bool:
    """A connection to one of ztunnel's own listener ports on this host would loop forever."""
    return dst.port in illegal_ports and (
        dst.ip.is_loopback or dst.ip.is_unspecified or dst.ip in local_ips
    )


def decide_outbound(
    state: State,
    source: Workload | None,
    dst: SocketAddr,
    *,
    network: str = "",
    local_ips: Collection[IPAddr] = (),
    rng: random.Random | None = None,
    illegal_ports: Collection[int] = ILLEGAL_PORTS,
) -> Route:
    """Decide how to carry a connection from ``source`` to the original destination ``dst``
    (``illegal_ports``: ``Config.illegal_ports``).

    Raises a ProxyError subclass when the connection must be refused.
    """
    if is_self_call(dst, local_ips, illegal_ports):
        raise SelfCallError(dst)

    # A service VIP wins over a workload IP here (unlike find_address), as in outbound.rs.
    # Among services sharing the VIP (or a CIDR VIP holding it), the best one visible to the
    # source's namespace (Rust find_upstream -> get_best_by_vip).
    net_addr = NetworkAddress(network, dst.ip)
    svc = state.find_service_by_vip(net_addr, source.namespace if source is not None else None)
    if svc is not None:
        # Rust build_request: a service-addressed connection goes to the service's waypoint
        # whoever the source is (fetch_service_waypoint has no from-waypoint check).
        gw = _service_waypoint(svc, rng)
        if gw is not None:
            return _to_waypoint(state, gw, dst, source, rng, service=svc)
        mode = svc.load_balancing.mode if svc.load_balancing else LoadBalancerMode.UNSPECIFIED
        if mode is LoadBalancerMode.PASSTHROUGH:
            # Rust find_upstream: a PASSTHROUGH service always goes to the original destination.
            return Route(RouteKind.PASSTHROUGH, dst, destination_service=svc)
        picked = state.load_balance(svc, dst.port, source, rng)
        if picked is None:
            raise NoHealthyUpstream(dst)
        endpoint, target_port = picked
        if endpoint.network != network:
            return _through_gateway(state, endpoint, svc, dst, source, rng, sans_of=svc)
        # Rust pick_workload_destination_or_resolve: the IP family by ip_families and dst.
        ip = pick_workload_ip(endpoint, dst.ip, svc.ip_families)
        return _to_workload(endpoint, target_port, svc, network, ip=ip)

    wl = state.find_workload_by_addr(net_addr)
    if wl is not None:
        if wl.waypoint is not None and not _is_waypoint_of(source, wl.waypoint, state):
            return _to_waypoint(state, wl.waypoint, dst, source, rng)
        return _to_workload(wl, dst.port, None, network, ip=dst.ip)

    return Route(RouteKind.PASSTHROUGH, dst)


def _to_workload(
    wl: Workload, port: int, svc: Service | None, network: str, ip: IPAddr | None = None
) -> Route:
    if wl.network != network:
        raise UnsupportedRoute(
            f"workload {wl.uid} is on network {wl.network!r}: cross-network (double HBONE) "
            "routing is not supported yet"
        )
    if ip is None:
        if not wl.addresses and wl.hostname:
            raise NeedsResolution(wl, port, svc)
        ip = _pick_ip(wl)  # raises: no usable IP
    if wl.protocol is TunnelProtocol.HBONE:
        expected = (wl.identity, *_service_sans(svc))
        return Route(
            RouteKind.HBONE,
            SocketAddr(ip, 15008),
            authority=SocketAddr(ip, port),
            expected_identities=expected,
            destination_workload=wl,
            destination_service=svc,
        )
    return Route(
        RouteKind.DIRECT, SocketAddr(ip, port), destination_workload=wl, destination_service=svc
    )


class NeedsResolution(Exception):
    """Not a refusal: the chosen endpoint is known only by ``hostname`` (a ServiceEntry with
    DNS resolution); :func:`decide_outbound_resolving` resolves it and finishes the route."""

    def __init__(self, workload: Workload, port: int, service: Service | None) -> None:
        super().__init__(f"workload {workload.uid} needs DNS resolution of {workload.hostname}")
        self.workload = workload
        self.port = port
        self.service = service


class NoResolvedAddresses(ProxyError):
    """Rust Error::NoResolvedAddresses / EmptyResolvedAddresses."""


def _pick_ip(wl: Workload) -> IPAddr:
    if not wl.addresses:
        raise UnsupportedRoute(f"workload {wl.uid} has neither an address nor a hostname")
    return wl.addresses[0]


def _service_sans(svc: Service | None) -> tuple[Identity, ...]:
    if svc is None:
        return ()
    out = []
    for san in svc.subject_alt_names:
        try:
            out.append(Identity.parse(san))
        except ValueError:
            continue  # a non-SPIFFE SAN can never match a workload certificate
    return tuple(out)


def _service_waypoint(svc: Service, rng: random.Random | None) -> GatewayAddress | None:
    """Rust ``fetch_service_waypoint``: one of the weighted waypoints, picked in proportion to
    its weight (``sample_weighted_waypoint``), else the single ``waypoint``. A weighted set whose
    weights are all zero cannot be sampled and falls back the same way."""
    weighted = svc.weighted_waypoints
    if weighted:
        total = sum(max(w.weight, 0) for w in weighted)
        if total > 0:
            pick = (rng or random).uniform(0, total)
            for w in weighted:
                if w.weight <= 0:
                    continue
                pick -= w.weight
                if pick < 0:
                    return w.destination
            return next(w.destination for w in reversed(weighted) if w.weight > 0)
    return svc.waypoint


def _resolve_gateway(
    state: State,
    gw: GatewayAddress,
    dst: SocketAddr,
    source: Workload | None,
    rng: random.Random | None,
    not_found: type[UnknownWaypoint] | type[UnknownNetworkGateway] = UnknownWaypoint,
) -> tuple[Workload, Service | None, SocketAddr]:
    """Rust ``fetch_waypoint`` (and, with ``not_found=UnknownNetworkGateway``,
    ``fetch_network_gateway``, which load-balances a gateway service in standard mode): the
    workload, the service it was picked from (for its SANs), and the address to dial: the HBONE
    port of a workload, or the port a service maps ``hbone_mtls_port`` to on the endpoint
    (``find_upstream_from_service``). A reference by IP is dialled in that IP's family; one by
    hostname adapts to the original destination's."""
    found = state.find_gateway(gw, source.namespace if source is not None else None)
    # The IP whose family is wanted (Rust finalize_upstream): the reference's own, else the
    # original destination's.
    want = gw.address.address if gw.address is not None else dst.ip
    if isinstance(found, Workload):
        ip = pick_workload_ip(found, want)
        if ip is not None:
            return found, None, SocketAddr(ip, gw.hbone_mtls_port)
    elif isinstance(found, Service):
        picked = state.load_balance(
            found, gw.hbone_mtls_port, source, rng, for_waypoint=not_found is UnknownWaypoint
        )
        if picked is not None:
            ip = pick_workload_ip(picked[0], want)
            if ip is not None:
                return picked[0], found, SocketAddr(ip, picked[1])
    raise not_found(_gw_name(gw))


def _gw_name(gw: GatewayAddress) -> str:
    if gw.hostname is not None:
        return f"{gw.hostname.namespace}/{gw.hostname.hostname}"
    return str(gw.address)


def _is_waypoint_of(source: Workload | None, gw: GatewayAddress, state: State) -> bool:
    """Traffic from the waypoint itself must not be sent back to the waypoint."""
    if source is None:
        return False
    found = state.find_gateway(gw, source.namespace if source is not None else None)
    if isinstance(found, Workload):
        return found.uid == source.uid
    if isinstance(found, Service):
        return any(w.uid == source.uid for w in state.endpoints(found))
    return False


def _to_waypoint(
    state: State,
    gw: GatewayAddress,
    dst: SocketAddr,
    source: Workload | None,
    rng: random.Random | None,
    *,
    service: Service | None = None,
) -> Route:
    """Rust ``build_request`` for a waypoint: HBONE to the waypoint, CONNECT to the original
    destination (VIP or workload address and the port the app dialled, not translated), the
    waypoint's identity and its service's SANs expected. The destination workload (access log,
    metrics) is the waypoint; the destination service the one addressed, if any."""
    wp, wp_svc, target = _resolve_gateway(state, gw, dst, source, rng)
    if source is not None and wp.network != source.network and service is not None:
        # Rust: "picked a waypoint on remote network" -> through that network's gateway
        return _through_gateway(state, wp, service, dst, source, rng, sans_of=wp_svc, waypoint=True)
    return Route(
        RouteKind.HBONE,
        target,
        authority=dst,
        expected_identities=(wp.identity, *_service_sans(wp_svc)),
        destination_workload=wp,
        destination_service=service,
        via_waypoint=True,
    )


def _through_gateway(
    state: State,
    upstream: Workload,
    service: Service,
    dst: SocketAddr,
    source: Workload | None,
    rng: random.Random | None,
    *,
    sans_of: Service | None,
    waypoint: bool = False,
) -> Route:
    """Rust ``build_request_through_gateway``: double HBONE to a workload (or waypoint) on
    another network. The outer tunnel goes to the network gateway of ``upstream`` and is checked
    against the gateway's identity; the inner one, end to end, against the SANs of the service
    ``upstream`` was reached through (``upstream.service_sans()``; the workload's own identity
    when the service lists none). Both CONNECTs name the service hostname and the port the app
    dialled, whatever the waypoint. ``sans_of``: the service ``upstream`` was picked from."""
    gw = upstream.network_gateway
    if gw is None:
        raise NoValidDestination(
            f"no valid routing destination for workload: {upstream.uid} is on network "
            f"{upstream.network!r} and has no network gateway"
        )
    gwl, gw_svc, target = _resolve_gateway(state, gw, dst, source, rng, UnknownNetworkGateway)
    final = _service_sans(sans_of)
    return Route(
        RouteKind.DOUBLE_HBONE,
        target,
        authority=HostnameAuthority(service.hostname, dst.port),
        expected_identities=(gwl.identity, *_service_sans(gw_svc)),
        final_identities=final or (upstream.identity,),
        destination_workload=gwl,
        destination_service=service,
        via_waypoint=waypoint,
    )


Resolver = Callable[[str], Awaitable[Sequence[IPAddr]]]


async def decide_outbound_resolving(
    state: State,
    source: Workload | None,
    dst: SocketAddr,
    *,
    resolve: Resolver,
    network: str = "",
    local_ips: Collection[IPAddr] = (),
    on_dns: Callable[[Workload | None, Workload], None] | None = None,
    rng: random.Random | None = None,
    illegal_ports: Collection[int] = ILLEGAL_PORTS,
) -> Route:
    """:func:`decide_outbound`, with the two things Rust's ``build_request`` awaits first:

    * on-demand xDS: an unknown destination address is fetched from the control plane
      (``DemandProxyState::fetch_address``) when ``state.demander`` is set;
    * a chosen endpoint known only by hostname is resolved (``resolve_on_demand_dns``; counted
      by ``on_dns``): an address of the original destination's family if there is one, else
      any, picked at random; none is ``NoResolvedAddresses``.
    """
    if state.demander is not None:
        ns = source.namespace if source is not None else None
        await state.fetch_address(NetworkAddress(network, dst.ip), ns)
    try:
        return decide_outbound(
            state,
            source,
            dst,
            network=network,
            local_ips=local_ips,
            rng=rng,
            illegal_ports=illegal_ports,
        )
    except NeedsResolution as need:
        wl = need.workload
        if on_dns is not None:
            on_dns(source, wl)
        try:
            ips = list(await resolve(wl.hostname))
        except OSError as e:
            raise NoResolvedAddresses(f"no resolved addresses for {wl.uid}: {e}") from None
        if not ips:
            raise NoResolvedAddresses(f"empty resolved addresses for {wl.uid}") from None
        same = [ip for ip in ips if ip.version == dst.ip.version]
        r = rng if rng is not None else random
        ip = r.choice(same or ips)
        return _to_workload(wl, need.port, need.service, network, ip=ip)
