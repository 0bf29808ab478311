"""``/config_dump``: the state model, certificates and config as ztunnel's camelCase JSON. Pure.

Shapes follow the Rust serde output (istio/ztunnel ``src/admin.rs`` ``ConfigDump``,
``src/state.rs`` ``ProxyStateSerialization``, ``src/state/workload.rs``, ``src/state/service.rs``,
``src/rbac.rs``, ``src/xds.rs`` ``LocalConfig``): top-level ``workloads`` (sorted by uid),
``services`` (sorted by hostname, then namespace), ``policies`` (sorted by key),
``stagedServices``, ``staticConfig``, ``version``, ``config``, ``certificates``, then any extra
sections (in-pod: ``workloadState``). Rust enum spellings (``HBONE``, ``Healthy``, ``Deny``),
``"<network>/<ip>"`` addresses, ``{"Exact": "x"}`` string matches; optional fields are omitted
when empty, as serde's ``skip_serializing_if`` does.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ztunnel.core.addr import SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.manager import CertificateStatus
from ztunnel.state.model import (
    ApplicationTunnel,
    Authorization,
    GatewayAddress,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancing,
    Match,
    NetworkAddress,
    NetworkCidr,
    Service,
    ServiceVisibility,
    StringMatch,
    TunnelProtocol,
    Workload,
    WorkloadStatus,
)

JSON = Any


class StateView(Protocol):
    """What the dump reads from ``ztunnel.state.store.State``."""

    def workloads(self) -> Iterable[Workload]: ...
    def services(self) -> Iterable[Service]: ...
    def policies(self) -> Iterable[Authorization]: ...
    def endpoints(self, service: Service) -> list[Workload]: ...


class LocalConfigView(Protocol):
    """``ztunnel.state.localconfig.LocalConfig``."""

    @property
    def workloads(self) -> tuple[Workload, ...]: ...
    @property
    def services(self) -> tuple[Service, ...]: ...
    @property
    def policies(self) -> tuple[Authorization, ...]: ...


# --- small pieces -------------------------------------------------------------------------------


def network_address(a: NetworkAddress) -> str:
    return f"{a.network}/{a.address}"


def _ports(m: Mapping[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(m.items())}


def gateway(g: GatewayAddress) -> JSON:
    if g.address is not None:
        dest: JSON = network_address(g.address)
    elif g.hostname is not None:
        dest = f"{g.hostname.namespace}/{g.hostname.hostname}"
    else:
        dest = None
    return {"destination": dest, "hboneMtlsPort": g.hbone_mtls_port}


def _app_tunnel(t: ApplicationTunnel) -> JSON:
    return {"protocol": t.protocol.name, "port": t.port}


_PROTOCOL = {TunnelProtocol.NONE: "TCP", TunnelProtocol.HBONE: "HBONE"}
_STATUS = {WorkloadStatus.HEALTHY: "Healthy", WorkloadStatus.UNHEALTHY: "Unhealthy"}
_LB_MODE = {
    LoadBalancerMode.UNSPECIFIED: "Standard",
    LoadBalancerMode.STRICT: "Strict",
    LoadBalancerMode.FAILOVER: "Failover",
    LoadBalancerMode.PASSTHROUGH: "Passthrough",
}
_IP_FAMILIES = {IPFamilies.DUAL: "Dual", IPFamilies.IPV4_ONLY: "IPv4", IPFamilies.IPV6_ONLY: "IPv6"}
_VISIBILITY = {ServiceVisibility.PUBLIC: "Public", ServiceVisibility.NAMESPACE: "Namespace"}


def _pascal(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


def camel(name: str) -> str:
    """``snake_case`` -> ``camelCase``."""
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


# --- workloads, services, policies ----------------------------------------------------------------


def workload(w: Workload, *, port_maps: bool = False) -> JSON:
    """One workload. ``services`` is the list of ``"ns/hostname"`` keys (the state view); with
    ``port_maps`` it is the local-file map ``{"ns/hostname": {"80": 8080}}`` instead."""
    out: dict[str, JSON] = {"workloadIps": [str(ip) for ip in w.addresses]}
    if w.waypoint is not None:
        out["waypoint"] = gateway(w.waypoint)
    if w.network_gateway is not None:
        out["networkGateway"] = gateway(w.network_gateway)
    out["protocol"] = _PROTOCOL[w.protocol]
    out["networkMode"] = _pascal(w.network_mode.name)
    if w.uid:
        out["uid"] = w.uid
    out["name"] = w.name
    out["namespace"] = w.namespace
    for key, value in (
        ("trustDomain", w.trust_domain),
        ("serviceAccount", w.service_account),
        ("network", w.network),
        ("workloadName", w.workload_name),
        ("workloadType", w.workload_type),
        ("canonicalName", w.canonical_name),
        ("canonicalRevision", w.canonical_revision),
        ("hostname", w.hostname),
        ("node", w.node),
    ):
        if value:
            out[key] = value
    if w.native_tunnel:
        out["nativeTunnel"] = True
    if w.application_tunnel is not None:
        out["applicationTunnel"] = _app_tunnel(w.application_tunnel)
    if w.authorization_policies:
        out["authorizationPolicies"] = list(w.authorization_policies)
    out["status"] = _STATUS[w.status]
    out["clusterId"] = w.cluster_id
    loc = w.locality
    if loc.region or loc.zone or loc.subzone:
        out["locality"] = {"region": loc.region, "zone": loc.zone, "subzone": loc.subzone}
    if port_maps:
        out["services"] = {k: _ports(v) for k, v in sorted(w.services.items())}
    elif w.services:
        out["services"] = sorted(w.services)
    out["capacity"] = w.capacity
    return out


def _load_balancer(lb: LoadBalancing) -> JSON:
    return {
        "routingPreferences": [_pascal(s.name) for s in lb.routing_preference],
        "mode": _LB_MODE[lb.mode],
        "healthPolicy": _pascal(lb.health_policy.name),
    }


def cidr_vip(c: NetworkCidr) -> JSON:
    """Rust ``NetworkCidr`` (derived serde, not a string): ``{"network", "cidr"}``."""
    return {"network": c.network, "cidr": str(c.cidr)}


def service(s: Service, endpoints: Iterable[Workload] = ()) -> JSON:
    """One service; ``endpoints`` (the workloads listing it) become ``{uid: {...}}``. Fields in
    Rust's order (``src/state/service.rs``): ``cidrVips`` and ``weightedWaypoints`` omitted when
    empty, ``visibility`` always there (``Public`` or ``Namespace``)."""
    eps: dict[str, JSON] = {}
    for w in sorted(endpoints, key=lambda w: w.uid):
        eps[w.uid] = {
            "workloadUid": w.uid,
            "port": _ports(w.services.get(s.key, {})),
            "status": _STATUS[w.status],
        }
    out: dict[str, JSON] = {
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": [network_address(v) for v in s.vips],
    }
    if s.cidr_vips:
        out["cidrVips"] = [cidr_vip(c) for c in s.cidr_vips]
    out["ports"] = _ports({p.service_port: p.target_port for p in s.ports})
    out["endpoints"] = eps
    out["subjectAltNames"] = list(s.subject_alt_names)
    if s.waypoint is not None:
        out["waypoint"] = gateway(s.waypoint)
    if s.weighted_waypoints:
        out["weightedWaypoints"] = [
            {"destination": gateway(w.destination), "weight": w.weight}
            for w in s.weighted_waypoints
        ]
    if s.load_balancing is not None:
        out["loadBalancer"] = _load_balancer(s.load_balancing)
    if s.ip_families in _IP_FAMILIES:
        out["ipFamilies"] = _IP_FAMILIES[s.ip_families]
    out["canonical"] = s.canonical
    out["visibility"] = _VISIBILITY[s.visibility]
    return out


def string_match(m: StringMatch) -> JSON:
    if m.kind.value == "presence":
        return {"Presence": []}
    return {m.kind.value.capitalize(): m.value}


def _match(m: Match) -> JSON:
    out: dict[str, JSON] = {}
    for key, values in (
        ("namespaces", [string_match(x) for x in m.namespaces]),
        ("notNamespaces", [string_match(x) for x in m.not_namespaces]),
        (
            "serviceAccounts",
            [
                {"namespace": x.namespace, "serviceAccount": x.service_account}
                for x in m.service_accounts
            ],
        ),
        (
            "notServiceAccounts",
            [
                {"namespace": x.namespace, "serviceAccount": x.service_account}
                for x in m.not_service_accounts
            ],
        ),
        ("principals", [string_match(x) for x in m.principals]),
        ("notPrincipals", [string_match(x) for x in m.not_principals]),
        ("sourceIps", [str(n) for n in m.source_ips]),
        ("notSourceIps", [str(n) for n in m.not_source_ips]),
        ("destinationIps", [str(n) for n in m.destination_ips]),
        ("notDestinationIps", [str(n) for n in m.not_destination_ips]),
        ("destinationPorts", list(m.destination_ports)),
        ("notDestinationPorts", list(m.not_destination_ports)),
    ):
        if values:
            out[key] = values
    return out


def policy(p: Authorization) -> JSON:
    return {
        "name": p.name,
        "namespace": p.namespace,
        "scope": _pascal(p.scope.name),
        "action": _pascal(p.action.name),
        "rules": [[[_match(m) for m in c.matches] for c in r.clauses] for r in p.rules],
        "dryRun": p.dry_run,
    }


def proxy_state(state: StateView) -> dict[str, JSON]:
    """``workloads``, ``services``, ``policies``, ``stagedServices`` (always empty here: our store
    keeps early endpoints in its own index)."""
    return {
        "workloads": [workload(w) for w in sorted(state.workloads(), key=lambda w: w.uid)],
        "services": [
            service(s, state.endpoints(s))
            for s in sorted(state.services(), key=lambda s: (s.hostname, s.namespace))
        ],
        "policies": [policy(p) for p in sorted(state.policies(), key=lambda p: p.key)],
        "stagedServices": {},
    }


def static_config(local: LocalConfigView | None) -> JSON:
    """The local config file as loaded (Rust re-reads it); empty lists when none was used."""
    if local is None:
        return {"workloads": [], "policies": [], "services": []}
    return {
        "workloads": [workload(w, port_maps=True) for w in local.workloads],
        "policies": [policy(p) for p in local.policies],
        "services": [service(s) for s in local.services],
    }


# --- certificates ----------------------------------------------------------------------------------


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cert_entry(cert: x509.Certificate) -> JSON:
    """``pem`` is base64 of the PEM text, as Rust does; serial in decimal."""
    pem = cert.public_bytes(serialization.Encoding.PEM)
    return {
        "pem": base64.b64encode(pem).decode("ascii"),
        "serialNumber": str(cert.serial_number),
        "validFrom": rfc3339(cert.not_valid_before_utc),
        "expirationTime": rfc3339(cert.not_valid_after_utc),
    }


def _chain(cert: WorkloadCertificate) -> tuple[list[JSON], list[JSON]]:
    return (
        [cert_entry(c) for c in (cert.leaf, *cert.intermediates)],
        [cert_entry(c) for c in cert.roots],
    )


def certificates(statuses: Iterable[CertificateStatus]) -> list[JSON]:
    """From ``SecretManager.statuses()``: ``identity``, ``state`` (``Initializing``,
    ``Available``, ``Unavailable: <error>``), ``certChain`` (leaf then intermediates) and
    ``rootCerts``, both empty unless Available. Sorted by identity."""
    out = []
    for st in sorted(statuses, key=lambda s: str(s.identity)):
        chain: list[JSON] = []
        roots: list[JSON] = []
        if st.state == "Available" and st.certificate is not None:
            state = "Available"
            chain, roots = _chain(st.certificate)
        elif st.state == "Unavailable":
            state = f"Unavailable: {st.error}" if st.error else "Unavailable"
        else:
            state = st.state
        out.append(
            {"identity": str(st.identity), "state": state, "certChain": chain, "rootCerts": roots}
        )
    return out


def camel_config(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``Config.summary()`` with camelCase keys (Rust's Config serializes camelCase)."""
    return {camel(k): v for k, v in summary.items()}


# --- the whole dump -------------------------------------------------------------------------------


def config_dump(
    *,
    state: StateView,
    config: Mapping[str, Any],
    certificates_: Iterable[CertificateStatus] = (),
    static: LocalConfigView | None = None,
    version: Mapping[str, Any] | None = None,
    extra: Mapping[str, Callable[[], JSON]] | None = None,
) -> dict[str, JSON]:
    """Assemble the dump. ``config`` is ``Config.summary()``; ``extra`` maps a top-level key to a
    provider (in-pod: ``{"workloadState": manager.admin_state}``), called now."""
    out = proxy_state(state)
    out["staticConfig"] = static_config(static)
    out["version"] = dict(version) if version is not None else {}
    out["config"] = camel_config(config)
    out["certificates"] = certificates(certificates_)
    for key, provider in (extra or {}).items():
        out[key] = provider()
    return out


# --- per-workload state and live connections --------------------------------------------------


class ConnectionView(Protocol):
    """What the dump reads from a live ``ztunnel.proxy.context.ConnectionRecord``."""

    @property
    def direction(self) -> str: ...
    @property
    def src(self) -> SocketAddr: ...
    @property
    def dst(self) -> SocketAddr: ...
    @property
    def orig_dst(self) -> SocketAddr | None: ...
    @property
    def for_host(self) -> str | None: ...
    @property
    def mtls(self) -> bool: ...
    @property
    def double_hbone(self) -> bool: ...
    @property
    def src_identity(self) -> Identity | None: ...


def _addr_key(a: SocketAddr) -> tuple[int, int, int]:
    # Rust's SocketAddr order: every V4 before every V6, then address, then port.
    return (a.ip.version, int(a.ip), a.port)


def connections(live: Iterable[ConnectionView]) -> JSON:
    """One proxy's live connections in Rust's shape (``ConnectionManager``'s serialization,
    istio/ztunnel ``src/proxy/connection_manager.rs``): ``inbound`` entries are ``{src,
    originalDst, actualDst, protocol}`` with ``originalDst`` the ``Forwarded`` host the client
    named (else null), ``actualDst`` the upstream dialled and ``protocol`` ``HBONE`` when the
    peer had an identity, else ``TCP``; ``outbound`` entries are ``{src, originalDst, actualDst,
    protocol}`` with the captured destination, the next hop (``ip:15008`` for HBONE) and
    ``TCP``, ``HBONE`` or ``DOUBLEHBONE``. Sorted, as Rust's ordered outbound set is (its
    inbound map is not, so any order is Rust's)."""
    inbound: list[tuple[SocketAddr, str, SocketAddr, str | None]] = []
    outbound: list[tuple[SocketAddr, SocketAddr, SocketAddr, str]] = []
    for rec in live:
        if rec.direction == "outbound":
            proto = "DOUBLEHBONE" if rec.double_hbone else "HBONE" if rec.mtls else "TCP"
            outbound.append((rec.src, rec.orig_dst or rec.dst, rec.dst, proto))
        else:
            proto = "HBONE" if rec.src_identity is not None else "TCP"
            inbound.append((rec.src, proto, rec.dst, rec.for_host))
    inbound.sort(key=lambda c: (_addr_key(c[0]), _addr_key(c[2]), c[1], c[3] or ""))
    outbound.sort(key=lambda c: (_addr_key(c[0]), _addr_key(c[1]), _addr_key(c[2]), c[3]))
    return {
        "inbound": [
            {"src": str(s), "originalDst": host, "actualDst": str(d), "protocol": p}
            for s, p, d, host in inbound
        ],
        "outbound": [
            {"src": str(s), "originalDst": str(o), "actualDst": str(d), "protocol": p}
            for s, o, d, p in outbound
        ],
    }


@dataclass(frozen=True)
class ProxyView:
    """One proxied workload for ``workloadState``: the key (in-pod: the pod uid from ZDS), the
    workload info, ``Up`` or ``Pending``, and (when up) its live connections."""

    key: str
    name: str
    namespace: str
    service_account: str
    state: str  # "Up" | "Pending"
    live: Iterable[ConnectionView] | None = None


def workload_state(proxies: Iterable[ProxyView]) -> JSON:
    """``workloadState`` (istio/ztunnel ``src/inpod/admin.rs``, ``ProxyState``): ``{key: {state,
    connections, info}}``; ``connections`` is omitted for a pending proxy (Rust: None)."""
    out: dict[str, JSON] = {}
    for p in sorted(proxies, key=lambda p: p.key):
        entry: dict[str, JSON] = {"state": p.state}
        if p.live is not None:
            entry["connections"] = connections(p.live)
        entry["info"] = {
            "name": p.name,
            "namespace": p.namespace,
            "serviceAccount": p.service_account,
        }
        out[p.key] = entry
    return out
