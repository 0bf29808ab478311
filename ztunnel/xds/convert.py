"""Convert xDS protobuf resources (``Address``, ``Authorization``) to the state model, and back.

This is the one place where protobuf meets the domain types: the ADS client calls
:func:`decode_address` / :func:`decode_authorization` on each resource's bytes and hands the
frozen model objects on; nothing past here sees protobuf. Defaults and rejections follow
istio/ztunnel ``src/state/workload.rs``, ``src/state/service.rs`` and ``src/rbac.rs``:

* empty ``trust_domain`` -> ``cluster.local``, empty ``service_account`` -> ``default``, empty
  ``cluster_id`` -> ``Kubernetes``, unset ``capacity`` -> 1, application tunnel port 0 -> none;
* IPs are raw 4 or 16 bytes; IPv4-mapped IPv6 (``::ffff:a.b.c.d``) stays IPv6, as Rust's
  ``byte_to_ip`` keeps it (only socket addresses are canonicalised, in ``core/addr.py``);
* enums that steer routing or security (tunnel protocol, status, network mode, IP families,
  load balancing, policy scope and action) must hold a known value; the telemetry ones
  (workload type, port app protocol) fall back to their default, and an unknown service
  ``visibility`` means PUBLIC (Rust ``Service::try_from`` fails open there);
* ``LEGACY_ISTIO_MTLS`` tunnels, gateways without a destination, service keys without a ``/``
  and unspecified load-balancing scopes are rejected;
* in an authorization policy, a ``StringMatch`` with no kind set and an address that is not
  a valid CIDR (bad length, prefix longer than the address) are dropped from their list and
  the rest of the policy is kept (Rust ``RbacMatch::try_from`` uses ``filter_map``). Dropping
  entries can widen a rule exactly as it does in Rust: a match left empty is skipped.

Stricter than Rust, on purpose: a port above 65535 is rejected (Rust truncates it). A rejected
resource is NACKed and the previous version stays in force.

Every failure raises :class:`ConversionError` naming the field path, e.g.
``workload.addresses[1]: IP address must be 4 or 16 bytes, got 5``.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from ztunnel.core.addr import IPAddr, IPNet
from ztunnel.state.model import (
    AppProtocol,
    AppTunnelProtocol,
    Authorization,
    Clause,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    Match,
    NamespacedHostname,
    NetworkAddress,
    NetworkCidr,
    NetworkMode,
    PolicyAction,
    PolicyScope,
    Rule,
    Service,
    ServiceAccountMatch,
    ServicePort,
    ServiceVisibility,
    StringMatch,
    StringMatchKind,
    TunnelProtocol,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
    WorkloadType,
)
from ztunnel.state.records import workload_from_tuple
from ztunnel.xds.protos import authorization_pb2 as authz_pb
from ztunnel.xds.protos import workload_pb2 as wl_pb

__all__ = [
    "ADDRESS_TYPE_URL",
    "AUTHORIZATION_TYPE_URL",
    "ConversionError",
    "address_from_proto",
    "address_key",
    "address_to_proto",
    "authorization_from_proto",
    "authorization_to_proto",
    "decode_address",
    "decode_authorization",
    "service_from_proto",
    "service_to_proto",
    "workload_from_proto",
    "workload_to_proto",
]

ADDRESS_TYPE_URL = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE_URL = "type.googleapis.com/istio.security.Authorization"

DEFAULT_TRUST_DOMAIN = "cluster.local"
DEFAULT_SERVICE_ACCOUNT = "default"
DEFAULT_CLUSTER_ID = "Kubernetes"
DEFAULT_CAPACITY = 1
_LEGACY_ISTIO_MTLS = 2  # TunnelProtocol value ztunnel refuses (sidecar-style mTLS)

_E = TypeVar("_E", bound=enum.Enum)
_WORKLOAD_TYPE_VALUES = {t.name.lower(): t.value for t in WorkloadType}


class ConversionError(ValueError):
    """A resource that cannot be converted: ``field`` is the dotted path, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# --- small field converters ----------------------------------------------------------------


def _enum(cls: type[_E], value: int, field: str) -> _E:
    """Strict: an unknown wire value is an error (Rust ``TryFrom<i32>``)."""
    try:
        return cls(value)
    except ValueError:
        raise ConversionError(field, f"unknown {cls.__name__} value {value}") from None


def _enum_or(cls: type[_E], value: int, default: _E) -> _E:
    """Lenient: an unknown wire value falls back to ``default`` (prost's enum getters)."""
    try:
        return cls(value)
    except ValueError:
        return default


def _ip(raw: bytes, field: str) -> IPAddr:
    # Rust byte_to_ip: 4 bytes IPv4, 16 bytes IPv6, IPv4-mapped kept as IPv6.
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    raise ConversionError(field, f"IP address must be 4 or 16 bytes, got {len(raw)}")


def _cidr(raw: bytes, length: int, field: str) -> IPNet:
    """A raw IP plus prefix length (Rust ``IpNet::new(byte_to_ip(..), length as u8)``: the
    length is truncated to 8 bits first). Host bits are masked (the network holds the same
    IPs). An IPv4-mapped address stays an IPv6 network, as in Rust."""
    length &= 0xFF
    net: IPNet
    if len(raw) == 4:
        if length > 32:
            raise ConversionError(field, f"prefix length {length} exceeds 32 for an IPv4 address")
        net = ipaddress.IPv4Network((ipaddress.IPv4Address(raw), length), strict=False)
        return net
    if len(raw) == 16:
        if length > 128:
            raise ConversionError(field, f"prefix length {length} exceeds 128 for an IPv6 address")
        net = ipaddress.IPv6Network((ipaddress.IPv6Address(raw), length), strict=False)
        return net
    raise ConversionError(field, f"IP address must be 4 or 16 bytes, got {len(raw)}")


def _port(value: int, field: str) -> int:
    if not 0 <= value <= 65535:
        raise ConversionError(field, f"port {value} out of range 0-65535")
    return value


def _network_address(pb: wl_pb.NetworkAddress, field: str) -> NetworkAddress:
    return NetworkAddress(pb.network, _ip(pb.address, f"{field}.address"))


def _namespaced_hostname(pb: wl_pb.NamespacedHostname) -> NamespacedHostname:
    return NamespacedHostname(pb.namespace, pb.hostname)


def _gateway(pb: wl_pb.GatewayAddress, field: str) -> GatewayAddress:
    port = _port(pb.hbone_mtls_port, f"{field}.hbone_mtls_port")
    which = pb.WhichOneof("destination")
    if which == "address":
        return GatewayAddress(
            address=_network_address(pb.address, f"{field}.address"), hbone_mtls_port=port
        )
    if which == "hostname":
        return GatewayAddress(hostname=_namespaced_hostname(pb.hostname), hbone_mtls_port=port)
    raise ConversionError(field, "gateway address has no destination (want hostname or address)")


def _port_map(pb: wl_pb.PortList, field: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in pb.ports:
        sp, tp = p.service_port, p.target_port
        if not (0 <= sp <= 65535 and 0 <= tp <= 65535):  # (the error's path built only then)
            for i, q in enumerate(pb.ports):
                _port(q.service_port, f"{field}.ports[{i}].service_port")
                _port(q.target_port, f"{field}.ports[{i}].target_port")
        out[sp] = tp
    return out


def _by_value(cls: type[_E]) -> dict[int, _E]:
    return {m.value: m for m in cls}


# --- Workload --------------------------------------------------------------------------------


_PROTOCOLS = _by_value(TunnelProtocol)
_STATUSES = _by_value(WorkloadStatus)
_NETWORK_MODES = _by_value(NetworkMode)
_APP_TUNNEL_PROTOCOLS = _by_value(AppTunnelProtocol)
_WORKLOAD_TYPE_NAMES = {t.value: t.name.lower() for t in WorkloadType}

Intern = Callable[[str], int]


def _gateway_record(pb: wl_pb.GatewayAddress, field: str, intern: Intern) -> tuple[Any, ...]:
    """:func:`_gateway`'s checks, as a record's gateway tuple (``state/records.py``)."""
    port = pb.hbone_mtls_port
    if not 0 <= port <= 65535:
        _port(port, f"{field}.hbone_mtls_port")
    which = pb.WhichOneof("destination")
    if which == "address":
        addr = pb.address
        raw = addr.address
        if len(raw) != 4 and len(raw) != 16:
            _ip(raw, f"{field}.address.address")
        return (0, intern(addr.network), raw, port)
    if which == "hostname":
        h = pb.hostname
        return (1, intern(h.namespace), intern(h.hostname), port)
    raise ConversionError(field, "gateway address has no destination (want hostname or address)")


def workload_record(pb: wl_pb.Workload, intern: Intern, field: str = "workload") -> tuple[Any, ...]:
    """An ``istio.workload.Workload`` as the state store's record (``state/records.py``'s
    layout; its xDS name is its ``uid``), checked as Rust converts it: the one conversion of a
    workload (:func:`workload_from_proto` decodes what this makes).

    On the path of every workload of a snapshot, so it goes from the protobuf to the record's
    ints and bytes directly: every check comes before the first string is interned, and an
    error's field path is built only when a value is bad."""
    if not pb.uid:
        raise ConversionError(f"{field}.uid", "empty (the uid is the resource's key)")
    proto = pb.tunnel_protocol
    if proto == _LEGACY_ISTIO_MTLS:
        raise ConversionError(f"{field}.tunnel_protocol", "LEGACY_ISTIO_MTLS is not supported")
    if proto not in _PROTOCOLS:
        _enum(TunnelProtocol, proto, f"{field}.tunnel_protocol")
    raw_addrs = tuple(pb.addresses)  # Rust byte_to_ip: 4 or 16 bytes; IPv4-mapped stays IPv6
    for i, a in enumerate(raw_addrs):
        if len(a) != 4 and len(a) != 16:
            _ip(a, f"{field}.addresses[{i}]")
    tunnel: tuple[int, int | None] | None = None
    if pb.HasField("application_tunnel"):
        at = pb.application_tunnel
        tp = _enum(AppTunnelProtocol, at.protocol, f"{field}.application_tunnel.protocol")
        tunnel = (tp.value, _port(at.port, f"{field}.application_tunnel.port") or None)
    pb_services = pb.services
    services: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    if pb_services:
        for key in sorted(pb_services):  # sorted: deterministic errors and dict order
            if "/" not in key:
                raise ConversionError(
                    f"{field}.services[{key!r}]", "service key must be <namespace>/<hostname>"
                )
            ports = _port_map(pb_services[key], f"{field}.services[{key!r}]")
            services.append((key, tuple(ports.items())))
    status = pb.status
    if status not in _STATUSES:
        _enum(WorkloadStatus, status, f"{field}.status")
    mode = pb.network_mode
    if mode not in _NETWORK_MODES:
        _enum(NetworkMode, mode, f"{field}.network_mode")
    has_waypoint, has_gateway = pb.HasField("waypoint"), pb.HasField("network_gateway")
    if has_waypoint:  # (checked before anything is interned)
        _gateway(pb.waypoint, f"{field}.waypoint")
    if has_gateway:
        _gateway(pb.network_gateway, f"{field}.network_gateway")
    loc = (0, 0, 0)
    if pb.HasField("locality"):
        lo = pb.locality
        loc = (intern(lo.region), intern(lo.zone), intern(lo.subzone))
    return (
        pb.uid,
        pb.name,
        intern(pb.namespace),
        raw_addrs,
        intern(pb.hostname),
        intern(pb.network),
        proto,
        intern(pb.trust_domain or DEFAULT_TRUST_DOMAIN),
        intern(pb.service_account or DEFAULT_SERVICE_ACCOUNT),
        _gateway_record(pb.waypoint, f"{field}.waypoint", intern) if has_waypoint else None,
        _gateway_record(pb.network_gateway, f"{field}.network_gateway", intern)
        if has_gateway
        else None,
        intern(pb.node),
        intern(pb.canonical_name),
        intern(pb.canonical_revision),
        # Rust: resource.workload_type().as_str_name().to_lowercase() (unknown: deployment)
        intern(_WORKLOAD_TYPE_NAMES.get(pb.workload_type, "deployment")),
        intern(pb.workload_name),
        pb.native_tunnel,
        tunnel,
        tuple([(intern(k), ports) for k, ports in services]),
        tuple([intern(p) for p in pb.authorization_policies]),
        status,
        intern(pb.cluster_id or DEFAULT_CLUSTER_ID),
        loc,
        mode,
        pb.capacity.value if pb.HasField("capacity") else DEFAULT_CAPACITY,
    )


def workload_from_proto(pb: wl_pb.Workload, field: str = "workload") -> Workload:
    """Convert an ``istio.workload.Workload``; its xDS name is its ``uid``."""
    table: dict[str, int] = {"": 0}
    strings = [""]

    def intern(s: str) -> int:
        i = table.get(s)
        if i is None:
            i = table[s] = len(strings)
            strings.append(s)
        return i

    return workload_from_tuple(workload_record(pb, intern, field), strings.__getitem__, {})


# --- Service ---------------------------------------------------------------------------------


def _load_balancing(pb: wl_pb.LoadBalancing, field: str) -> LoadBalancing:
    prefs: list[LoadBalancerScope] = []
    for i, raw in enumerate(pb.routing_preference):
        sub = f"{field}.routing_preference[{i}]"
        scope = _enum(LoadBalancerScope, raw, sub)
        if scope is LoadBalancerScope.UNSPECIFIED:
            raise ConversionError(sub, "unspecified scope")
        prefs.append(scope)
    return LoadBalancing(
        routing_preference=tuple(prefs),
        mode=_enum(LoadBalancerMode, pb.mode, f"{field}.mode"),
        health_policy=_enum(HealthPolicy, pb.health_policy, f"{field}.health_policy"),
    )


def service_from_proto(pb: wl_pb.Service, field: str = "service") -> Service:
    """Convert an ``istio.workload.Service``; its xDS name is ``"<namespace>/<hostname>"``."""
    if not pb.hostname:
        raise ConversionError(f"{field}.hostname", "empty (namespace/hostname is the key)")
    vips: list[NetworkAddress] = []
    cidr_vips: list[NetworkCidr] = []
    for i, a in enumerate(pb.addresses):
        sub = f"{field}.addresses[{i}]"
        ip = _ip(a.address, f"{sub}.address")
        full = 32 if len(a.address) == 4 else 128
        if a.HasField("length") and a.length != full:
            cidr_vips.append(NetworkCidr(a.network, _cidr(a.address, a.length, f"{sub}.length")))
        else:
            vips.append(NetworkAddress(a.network, ip))
    ports = tuple(
        ServicePort(
            _port(p.service_port, f"{field}.ports[{i}].service_port"),
            _port(p.target_port, f"{field}.ports[{i}].target_port"),
            _enum_or(AppProtocol, p.app_protocol, AppProtocol.UNKNOWN),
        )
        for i, p in enumerate(pb.ports)
    )
    weighted: list[WeightedWaypoint] = []
    for i, ww in enumerate(pb.weighted_waypoints):
        sub = f"{field}.weighted_waypoints[{i}]"
        if not ww.HasField("destination"):
            raise ConversionError(f"{sub}.destination", "missing")
        weighted.append(WeightedWaypoint(_gateway(ww.destination, f"{sub}.destination"), ww.weight))
    return Service(
        name=pb.name,
        namespace=pb.namespace,
        hostname=pb.hostname,
        vips=tuple(vips),
        ports=ports,
        subject_alt_names=tuple(pb.subject_alt_names),
        waypoint=_gateway(pb.waypoint, f"{field}.waypoint") if pb.HasField("waypoint") else None,
        load_balancing=(
            _load_balancing(pb.load_balancing, f"{field}.load_balancing")
            if pb.HasField("load_balancing")
            else None
        ),
        ip_families=_enum(IPFamilies, pb.ip_families, f"{field}.ip_families"),
        canonical=pb.canonical,
        cidr_vips=tuple(cidr_vips),
        ingress_use_waypoint=pb.ingress_use_waypoint,
        weighted_waypoints=tuple(weighted),
        # Unknown values mean PUBLIC (Rust: try_from(..).unwrap_or_default()).
        visibility=_enum_or(ServiceVisibility, pb.visibility, ServiceVisibility.PUBLIC),
    )


# --- Address ---------------------------------------------------------------------------------


def address_from_proto(pb: wl_pb.Address) -> Workload | Service:
    which = pb.WhichOneof("type")
    if which == "workload":
        return workload_from_proto(pb.workload)
    if which == "service":
        return service_from_proto(pb.service)
    raise ConversionError("address.type", "neither workload nor service is set")


def parse_address(data: bytes) -> wl_pb.Address:
    """Parse the bytes of an ``istio.workload.Address`` resource."""
    try:
        pb: wl_pb.Address = wl_pb.Address.FromString(data)
    except DecodeError as e:
        raise ConversionError("address", f"cannot decode istio.workload.Address: {e}") from None
    return pb


def decode_address(data: bytes) -> Workload | Service:
    """Parse and convert the bytes of an ``istio.workload.Address`` resource."""
    try:
        pb = wl_pb.Address.FromString(data)
    except DecodeError as e:
        raise ConversionError("address", f"cannot decode istio.workload.Address: {e}") from None
    return address_from_proto(pb)


def address_key(obj: Workload | Service) -> str:
    """The xDS resource name: a workload's uid, a service's ``"<namespace>/<hostname>"``."""
    return obj.uid if isinstance(obj, Workload) else obj.key


# --- Authorization ---------------------------------------------------------------------------

_STRING_MATCH_KINDS = {
    "exact": StringMatchKind.EXACT,
    "prefix": StringMatchKind.PREFIX,
    "suffix": StringMatchKind.SUFFIX,
    "presence": StringMatchKind.PRESENCE,
}


def _string_matches(items: Iterable[authz_pb.StringMatch]) -> tuple[StringMatch, ...]:
    """Rust ``Option<StringMatch>::from`` + ``filter_map``: a match with no kind is dropped."""
    out: list[StringMatch] = []
    for sm in items:
        which = sm.WhichOneof("match_type")
        if which is None:
            continue
        kind = _STRING_MATCH_KINDS[which]
        value = "" if kind is StringMatchKind.PRESENCE else str(getattr(sm, which))
        out.append(StringMatch(kind, value))
    return tuple(out)


def _cidrs(items: Iterable[authz_pb.Address], field: str) -> tuple[IPNet, ...]:
    """Rust ``filter_map(|a| a.try_into().ok())``: an invalid CIDR is dropped, not an error."""
    out: list[IPNet] = []
    for i, a in enumerate(items):
        try:
            out.append(_cidr(a.address, a.length, f"{field}[{i}]"))
        except ConversionError:
            continue
    return tuple(out)


def _ports(items: Iterable[int], field: str) -> tuple[int, ...]:
    return tuple(_port(p, f"{field}[{i}]") for i, p in enumerate(items))


def _service_accounts(
    items: Iterable[authz_pb.ServiceAccountMatch],
) -> tuple[ServiceAccountMatch, ...]:
    return tuple(ServiceAccountMatch(sa.namespace, sa.service_account) for sa in items)


def _match(pb: authz_pb.Match, field: str) -> Match:
    return Match(
        namespaces=_string_matches(pb.namespaces),
        not_namespaces=_string_matches(pb.not_namespaces),
        service_accounts=_service_accounts(pb.service_accounts),
        not_service_accounts=_service_accounts(pb.not_service_accounts),
        principals=_string_matches(pb.principals),
        not_principals=_string_matches(pb.not_principals),
        source_ips=_cidrs(pb.source_ips, f"{field}.source_ips"),
        not_source_ips=_cidrs(pb.not_source_ips, f"{field}.not_source_ips"),
        destination_ips=_cidrs(pb.destination_ips, f"{field}.destination_ips"),
        not_destination_ips=_cidrs(pb.not_destination_ips, f"{field}.not_destination_ips"),
        destination_ports=_ports(pb.destination_ports, f"{field}.destination_ports"),
        not_destination_ports=_ports(pb.not_destination_ports, f"{field}.not_destination_ports"),
    )


def authorization_from_proto(
    pb: authz_pb.Authorization, field: str = "authorization", *, name: str = ""
) -> Authorization:
    """Convert an ``istio.security.Authorization``. ``name`` is the xDS resource name, its key
    in the store (istiod sends ``"<namespace>/<name>"``; any other name is kept as the key)."""
    if not pb.name:
        raise ConversionError(f"{field}.name", "empty (namespace/name is the key)")
    rules = tuple(
        Rule(
            tuple(
                Clause(
                    tuple(
                        _match(m, f"{field}.rules[{r}].clauses[{c}].matches[{k}]")
                        for k, m in enumerate(clause.matches)
                    )
                )
                for c, clause in enumerate(rule.clauses)
            )
        )
        for r, rule in enumerate(pb.rules)
    )
    return Authorization(
        name=pb.name,
        namespace=pb.namespace,
        scope=_enum(PolicyScope, pb.scope, f"{field}.scope"),
        action=_enum(PolicyAction, pb.action, f"{field}.action"),
        rules=rules,
        dry_run=pb.dry_run,
        xds_name="" if name == f"{pb.namespace}/{pb.name}" else name,
    )


def decode_authorization(data: bytes, name: str = "") -> Authorization:
    """Parse and convert the bytes of an ``istio.security.Authorization`` resource."""
    try:
        pb = authz_pb.Authorization.FromString(data)
    except DecodeError as e:
        raise ConversionError(
            "authorization", f"cannot decode istio.security.Authorization: {e}"
        ) from None
    return authorization_from_proto(pb, name=name)


# --- model -> protobuf (the fake istiod and tests push model objects) --------------------------


def _ip_bytes(ip: IPAddr) -> bytes:
    return ip.packed


def _network_address_to_proto(a: NetworkAddress) -> wl_pb.NetworkAddress:
    return wl_pb.NetworkAddress(network=a.network, address=_ip_bytes(a.address))


def _gateway_to_proto(g: GatewayAddress) -> wl_pb.GatewayAddress:
    pb = wl_pb.GatewayAddress(hbone_mtls_port=g.hbone_mtls_port)
    if g.address is not None:
        pb.address.CopyFrom(_network_address_to_proto(g.address))
    elif g.hostname is not None:
        pb.hostname.namespace = g.hostname.namespace
        pb.hostname.hostname = g.hostname.hostname
    return pb


def workload_to_proto(w: Workload) -> wl_pb.Workload:
    """The inverse of :func:`workload_from_proto` (defaults are written out explicitly)."""
    pb = wl_pb.Workload(
        uid=w.uid,
        name=w.name,
        namespace=w.namespace,
        addresses=[_ip_bytes(ip) for ip in w.addresses],
        hostname=w.hostname,
        network=w.network,
        tunnel_protocol=w.protocol.value,  # type: ignore[arg-type]
        trust_domain=w.trust_domain,
        service_account=w.service_account,
        node=w.node,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        workload_type=_WORKLOAD_TYPE_VALUES.get(w.workload_type, 0),  # type: ignore[arg-type]
        workload_name=w.workload_name,
        native_tunnel=w.native_tunnel,
        authorization_policies=list(w.authorization_policies),
        status=w.status.value,  # type: ignore[arg-type]
        cluster_id=w.cluster_id,
        network_mode=w.network_mode.value,  # type: ignore[arg-type]
    )
    if w.waypoint is not None:
        pb.waypoint.CopyFrom(_gateway_to_proto(w.waypoint))
    if w.network_gateway is not None:
        pb.network_gateway.CopyFrom(_gateway_to_proto(w.network_gateway))
    if w.application_tunnel is not None:
        pb.application_tunnel.protocol = w.application_tunnel.protocol.value  # type: ignore[assignment]
        pb.application_tunnel.port = w.application_tunnel.port or 0
    for key, ports in w.services.items():
        lst = pb.services[key]
        for sp, tp in ports.items():
            lst.ports.add(service_port=sp, target_port=tp)
    if w.locality != Locality():
        pb.locality.region = w.locality.region
        pb.locality.zone = w.locality.zone
        pb.locality.subzone = w.locality.subzone
    pb.capacity.value = w.capacity
    return pb


def service_to_proto(s: Service) -> wl_pb.Service:
    """The inverse of :func:`service_from_proto`."""
    pb = wl_pb.Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        subject_alt_names=list(s.subject_alt_names),
        ip_families=s.ip_families.value,  # type: ignore[arg-type]
        canonical=s.canonical,
        ingress_use_waypoint=s.ingress_use_waypoint,
        visibility=s.visibility.value,  # type: ignore[arg-type]
    )
    for vip in s.vips:
        pb.addresses.append(_network_address_to_proto(vip))
    for c in s.cidr_vips:
        pb.addresses.add(
            network=c.network, address=_ip_bytes(c.cidr.network_address), length=c.cidr.prefixlen
        )
    for p in s.ports:
        pb.ports.add(
            service_port=p.service_port,
            target_port=p.target_port,
            app_protocol=p.app_protocol.value,
        )
    if s.waypoint is not None:
        pb.waypoint.CopyFrom(_gateway_to_proto(s.waypoint))
    if s.load_balancing is not None:
        lb = s.load_balancing
        pb.load_balancing.routing_preference.extend([p.value for p in lb.routing_preference])
        pb.load_balancing.mode = lb.mode.value  # type: ignore[assignment]
        pb.load_balancing.health_policy = lb.health_policy.value  # type: ignore[assignment]
    for ww in s.weighted_waypoints:
        pb.weighted_waypoints.add(destination=_gateway_to_proto(ww.destination), weight=ww.weight)
    return pb


def address_to_proto(obj: Workload | Service) -> wl_pb.Address:
    if isinstance(obj, Workload):
        return wl_pb.Address(workload=workload_to_proto(obj))
    return wl_pb.Address(service=service_to_proto(obj))


def _string_match_to_proto(sm: StringMatch) -> authz_pb.StringMatch:
    if sm.kind is StringMatchKind.PRESENCE:
        pb = authz_pb.StringMatch()
        pb.presence.SetInParent()
        return pb
    return authz_pb.StringMatch(**{sm.kind.value: sm.value})


def _cidr_to_proto(net: IPNet) -> authz_pb.Address:
    return authz_pb.Address(address=_ip_bytes(net.network_address), length=net.prefixlen)


def authorization_to_proto(a: Authorization) -> authz_pb.Authorization:
    """The inverse of :func:`authorization_from_proto`."""
    pb = authz_pb.Authorization(
        name=a.name,
        namespace=a.namespace,
        scope=a.scope.value,  # type: ignore[arg-type]
        action=a.action.value,  # type: ignore[arg-type]
        dry_run=a.dry_run,
    )
    for rule in a.rules:
        rpb = pb.rules.add()
        for clause in rule.clauses:
            cpb = rpb.clauses.add()
            for m in clause.matches:
                mpb = cpb.matches.add()
                mpb.namespaces.extend(_string_match_to_proto(x) for x in m.namespaces)
                mpb.not_namespaces.extend(_string_match_to_proto(x) for x in m.not_namespaces)
                for sa in m.service_accounts:
                    mpb.service_accounts.add(
                        namespace=sa.namespace, service_account=sa.service_account
                    )
                for sa in m.not_service_accounts:
                    mpb.not_service_accounts.add(
                        namespace=sa.namespace, service_account=sa.service_account
                    )
                mpb.principals.extend(_string_match_to_proto(x) for x in m.principals)
                mpb.not_principals.extend(_string_match_to_proto(x) for x in m.not_principals)
                mpb.source_ips.extend(_cidr_to_proto(n) for n in m.source_ips)
                mpb.not_source_ips.extend(_cidr_to_proto(n) for n in m.not_source_ips)
                mpb.destination_ips.extend(_cidr_to_proto(n) for n in m.destination_ips)
                mpb.not_destination_ips.extend(_cidr_to_proto(n) for n in m.not_destination_ips)
                mpb.destination_ports.extend(m.destination_ports)
                mpb.not_destination_ports.extend(m.not_destination_ports)
    return pb
