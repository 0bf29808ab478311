"""Compact records for the shared state store: workloads and services as bytes, and back.

A record is a ``marshal`` dump of a tuple of ints, bytes and the few strings unique to the
object (uid, name). Every string that repeats across objects (namespaces, service accounts,
trust domains, nodes, networks, cluster IDs, service keys, ...) is stored once, in the store's
string table, and the record holds its id: ``encode_*`` take an ``intern(str) -> int`` and
``decode_*`` a ``lookup(int) -> str``. IPs are their packed bytes. Pure: no I/O, no store.

``marshal`` is CPython's own format for code objects: the writer and every reader are processes
of one ztunnel, the same interpreter, so its version never differs between them, and it loads a
tuple of ints and bytes several times faster than pickle or protobuf. Nothing outside the store
ever sees these bytes.
"""

from __future__ import annotations

import ipaddress
import marshal
from collections.abc import Callable
from typing import Any

from ztunnel.core.addr import IPAddr, IPNet
from ztunnel.state.model import (
    ApplicationTunnel,
    AppProtocol,
    AppTunnelProtocol,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    Service,
    ServicePort,
    ServiceVisibility,
    TunnelProtocol,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
)

__all__ = [
    "FORMAT",
    "Intern",
    "Lookup",
    "decode_service",
    "decode_workload",
    "encode_service",
    "encode_workload",
    "ip_bytes",
    "service_from_tuple",
    "service_ids",
    "service_tuple",
    "workload_from_tuple",
    "workload_ids",
    "workload_tuple",
]

Intern = Callable[[str], int]
Lookup = Callable[[int], str]

FORMAT = 1  # bumped when a record's layout changes (the store is rebuilt at every start)

_PROTOCOLS = tuple(TunnelProtocol)
_STATUSES = tuple(WorkloadStatus)
_NET_MODES = tuple(NetworkMode)
_TUNNEL_PROTOCOLS = tuple(AppTunnelProtocol)
_APP_PROTOCOLS = tuple(AppProtocol)
_SCOPES = tuple(LoadBalancerScope)
_LB_MODES = tuple(LoadBalancerMode)
_HEALTH = tuple(HealthPolicy)
_FAMILIES = tuple(IPFamilies)
_VISIBILITY = tuple(ServiceVisibility)
_NO_LOCALITY = Locality()
_NO_IDS = (0, 0, 0)  # id 0 is always "" (the string table's first entry)
_MEMO_MAX = 4096  # the shared small values a decoder memo holds (few distinct in a mesh)
_V4 = ipaddress.IPv4Address
_V6 = ipaddress.IPv6Address


def ip_bytes(ip: IPAddr) -> bytes:
    return ip.packed


def _ip(raw: bytes) -> IPAddr:
    return _V4(raw) if len(raw) == 4 else _V6(raw)


# --- gateways -------------------------------------------------------------------------------


def _enc_gw(gw: GatewayAddress | None, intern: Intern) -> tuple[Any, ...] | None:
    if gw is None:
        return None
    if gw.address is not None:
        return (0, intern(gw.address.network), gw.address.address.packed, gw.hbone_mtls_port)
    if gw.hostname is not None:
        h = gw.hostname
        return (1, intern(h.namespace), intern(h.hostname), gw.hbone_mtls_port)
    return (2, 0, 0, gw.hbone_mtls_port)


def _dec_gw(t: tuple[Any, ...] | None, lookup: Lookup) -> GatewayAddress | None:
    if t is None:
        return None
    kind, a, b, port = t
    if kind == 0:
        return GatewayAddress(address=NetworkAddress(lookup(a), _ip(b)), hbone_mtls_port=port)
    if kind == 1:
        return GatewayAddress(
            hostname=NamespacedHostname(lookup(a), lookup(b)), hbone_mtls_port=port
        )
    return GatewayAddress(hbone_mtls_port=port)


# --- workloads ------------------------------------------------------------------------------


# Positions in a workload record (what the store's indexes read without decoding it).
W_UID, W_NAME, W_NS, W_ADDRS, W_HOSTNAME, W_NETWORK, W_PROTOCOL, W_TD, W_SA = range(9)
W_WAYPOINT, W_NETGW, W_NODE, W_CNAME, W_CREV, W_WTYPE, W_WNAME, W_NATIVE = range(9, 17)
W_TUNNEL, W_SERVICES, W_AUTHZ, W_STATUS, W_CLUSTER, W_LOCALITY, W_NETMODE = range(17, 24)
W_CAPACITY = 24


def workload_tuple(w: Workload, intern: Intern) -> tuple[Any, ...]:
    """``w`` as a record's tuple (``marshal.dumps`` it for the bytes). Strings that repeat go
    through ``intern``, once per occurrence: :func:`workload_ids` lists the same ids."""
    loc = w.locality
    tunnel = w.application_tunnel
    return (
        w.uid,
        w.name,
        intern(w.namespace),
        tuple([ip.packed for ip in w.addresses]),
        intern(w.hostname),
        intern(w.network),
        w.protocol.value,
        intern(w.trust_domain),
        intern(w.service_account),
        None if w.waypoint is None else _enc_gw(w.waypoint, intern),
        None if w.network_gateway is None else _enc_gw(w.network_gateway, intern),
        intern(w.node),
        intern(w.canonical_name),
        intern(w.canonical_revision),
        intern(w.workload_type),
        intern(w.workload_name),
        w.native_tunnel,
        None if tunnel is None else (tunnel.protocol.value, tunnel.port),
        tuple([(intern(k), tuple(v.items())) for k, v in w.services.items()]),
        tuple([intern(p) for p in w.authorization_policies]),
        w.status.value,
        intern(w.cluster_id),
        (intern(loc.region), intern(loc.zone), intern(loc.subzone)),
        w.network_mode.value,
        w.capacity,
    )


def encode_workload(w: Workload, intern: Intern) -> bytes:
    return marshal.dumps(workload_tuple(w, intern))


def _gw_ids(t: tuple[Any, ...] | None, out: list[int]) -> None:
    if t is None:
        return
    if t[0] == 0:
        out.append(t[1])
    elif t[0] == 1:
        out += (t[1], t[2])


def workload_ids(t: tuple[Any, ...]) -> list[int]:
    """Every string id a workload record holds, once per occurrence (what its removal
    releases). Id 0 (the empty string) included."""
    out = [t[W_NS], t[W_HOSTNAME], t[W_NETWORK], t[W_TD], t[W_SA]]
    _gw_ids(t[W_WAYPOINT], out)
    _gw_ids(t[W_NETGW], out)
    out += (t[W_NODE], t[W_CNAME], t[W_CREV], t[W_WTYPE], t[W_WNAME], t[W_CLUSTER])
    out += [k for k, _ in t[W_SERVICES]]
    out += t[W_AUTHZ]
    out += t[W_LOCALITY]
    return out


def decode_workload(raw: bytes, lookup: Lookup, memo: dict[Any, Any]) -> Workload:
    """The workload of a record; ``memo`` is the store's cache of small shared values (one
    Locality object per distinct locality), kept by the caller beside ``lookup``."""
    return workload_from_tuple(marshal.loads(raw), lookup, memo)


def workload_from_tuple(t: tuple[Any, ...], lookup: Lookup, memo: dict[Any, Any]) -> Workload:
    (
        uid,
        name,
        ns,
        addrs,
        hostname,
        network,
        protocol,
        td,
        sa,
        waypoint,
        netgw,
        node,
        cname,
        crev,
        wtype,
        wname,
        native,
        tunnel,
        services,
        authz,
        status,
        cluster,
        loc,
        netmode,
        capacity,
    ) = t
    return Workload(
        uid,
        name,
        lookup(ns),
        (_ip(addrs[0]),) if len(addrs) == 1 else tuple([_ip(a) for a in addrs]),
        lookup(hostname),
        lookup(network),
        _PROTOCOLS[protocol],
        lookup(td),
        lookup(sa),
        None if waypoint is None else _shared(memo, ("gw", waypoint), _dec_gw, waypoint, lookup),
        None if netgw is None else _shared(memo, ("gw", netgw), _dec_gw, netgw, lookup),
        lookup(node),
        lookup(cname),
        lookup(crev),
        lookup(wtype),
        lookup(wname),
        native,
        None if tunnel is None else ApplicationTunnel(_TUNNEL_PROTOCOLS[tunnel[0]], tunnel[1]),
        {lookup(services[0][0]): dict(services[0][1])}
        if len(services) == 1
        else {lookup(k): dict(v) for k, v in services},
        tuple([lookup(p) for p in authz]) if authz else (),
        _STATUSES[status],
        lookup(cluster),
        _NO_LOCALITY if loc == _NO_IDS else _shared(memo, loc, _dec_locality, loc, lookup),
        _NET_MODES[netmode],
        capacity,
    )


def _dec_locality(ids: tuple[int, int, int], lookup: Lookup) -> Locality:
    region, zone, subzone = ids
    return Locality(lookup(region), lookup(zone), lookup(subzone))


def _shared(memo: dict[Any, Any], key: Any, build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)``, once per store for each ``key``: a part of a record that many records
    share (a locality, a waypoint, a port list), made of ints and string ids alone (an id is
    never reused for another string, so a key never goes stale). Bounded: cleared when full."""
    v = memo.get(key)
    if v is None:
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        v = memo[key] = build(*args)
    return v


# --- services -------------------------------------------------------------------------------


def _enc_net(n: IPNet) -> tuple[bytes, int]:
    return n.network_address.packed, n.prefixlen


def _dec_net(t: tuple[bytes, int]) -> IPNet:
    raw, plen = t
    if len(raw) == 4:
        return ipaddress.IPv4Network((raw, plen))
    return ipaddress.IPv6Network((raw, plen))


def service_tuple(s: Service, intern: Intern) -> tuple[Any, ...]:
    lb = s.load_balancing
    return (
        intern(s.name),
        intern(s.namespace),
        intern(s.hostname),
        tuple([(intern(v.network), v.address.packed) for v in s.vips]),
        tuple([(p.service_port, p.target_port, p.app_protocol.value) for p in s.ports]),
        tuple([intern(x) for x in s.subject_alt_names]),
        _enc_gw(s.waypoint, intern),
        None
        if lb is None
        else (
            tuple([x.value for x in lb.routing_preference]),
            lb.mode.value,
            lb.health_policy.value,
        ),
        s.ip_families.value,
        s.canonical,
        tuple([(intern(c.network), _enc_net(c.cidr)) for c in s.cidr_vips]),
        s.ingress_use_waypoint,
        tuple([(_enc_gw(w.destination, intern), w.weight) for w in s.weighted_waypoints]),
        s.visibility.value,
    )


def encode_service(s: Service, intern: Intern) -> bytes:
    return marshal.dumps(service_tuple(s, intern))


def service_ids(t: tuple[Any, ...]) -> list[int]:
    out = [t[0], t[1], t[2]]
    out += [n for n, _ in t[3]]
    out += t[5]
    _gw_ids(t[6], out)
    out += [n for n, _ in t[10]]
    for g, _ in t[12]:
        _gw_ids(g, out)
    return out


def decode_service(raw: bytes, lookup: Lookup, memo: dict[Any, Any]) -> Service:
    """The service of a record; ``memo`` as for :func:`decode_workload` (one tuple of
    ServicePort objects per distinct port list, one LoadBalancing per distinct setting)."""
    return service_from_tuple(marshal.loads(raw), lookup, memo)


def service_from_tuple(t: tuple[Any, ...], lookup: Lookup, memo: dict[Any, Any]) -> Service:
    # Positional, empty fields without a loop, and the port list and load balancing shared:
    # a frozen dataclass costs ~0.5 µs to build, and every cold VIP decision decodes one.
    (
        name,
        ns,
        hostname,
        vips,
        ports,
        sans,
        waypoint,
        lb,
        families,
        canonical,
        cidrs,
        ingress_wp,
        weighted,
        visibility,
    ) = t
    return Service(
        lookup(name),
        lookup(ns),
        lookup(hostname),
        tuple([NetworkAddress(lookup(n), _ip(a)) for n, a in vips]) if vips else (),
        _shared(memo, ("ports", ports), _dec_ports, ports) if ports else (),
        tuple([lookup(x) for x in sans]) if sans else (),
        None if waypoint is None else _shared(memo, ("gw", waypoint), _dec_gw, waypoint, lookup),
        None if lb is None else _shared(memo, ("lb", lb), _dec_lb, lb),
        _FAMILIES[families],
        canonical,
        tuple([NetworkCidr(lookup(n), _dec_net(c)) for n, c in cidrs]) if cidrs else (),
        ingress_wp,
        tuple(
            [
                WeightedWaypoint(gw, weight)
                for g, weight in weighted
                if (gw := _dec_gw(g, lookup)) is not None
            ]
        )
        if weighted
        else (),
        _VISIBILITY[visibility],
    )


def _dec_ports(ports: tuple[tuple[int, int, int], ...]) -> tuple[ServicePort, ...]:
    return tuple([ServicePort(sp, tp, _APP_PROTOCOLS[ap]) for sp, tp, ap in ports])


def _dec_lb(lb: tuple[tuple[int, ...], int, int]) -> LoadBalancing:
    prefs, mode, health = lb
    return LoadBalancing(tuple([_SCOPES[x] for x in prefs]), _LB_MODES[mode], _HEALTH[health])
