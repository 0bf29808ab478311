"""Frozen domain types for workloads, services and policies (the ``istio.workload`` model).

Every config source (the local YAML file, xDS) converts into these types at its boundary; nothing
past that boundary sees YAML or protobuf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ztunnel.core.addr import IPAddr, IPNet
from ztunnel.core.identity import Identity


class TunnelProtocol(enum.Enum):
    NONE = 0  # plain TCP ("TCP" in the local config file)
    HBONE = 1


class WorkloadStatus(enum.Enum):
    HEALTHY = 0
    UNHEALTHY = 1


class WorkloadType(enum.Enum):
    DEPLOYMENT = 0
    CRONJOB = 1
    POD = 2
    JOB = 3


class NetworkMode(enum.Enum):
    STANDARD = 0
    HOST_NETWORK = 1


class AppTunnelProtocol(enum.Enum):
    NONE = 0
    PROXY = 1


class LoadBalancerScope(enum.Enum):
    UNSPECIFIED = 0
    REGION = 1
    ZONE = 2
    SUBZONE = 3
    NODE = 4
    CLUSTER = 5
    NETWORK = 6


class LoadBalancerMode(enum.Enum):
    UNSPECIFIED = 0  # "Standard" in the local config file
    STRICT = 1
    FAILOVER = 2
    PASSTHROUGH = 3


class HealthPolicy(enum.Enum):
    ONLY_HEALTHY = 0
    ALLOW_ALL = 1


class IPFamilies(enum.Enum):
    AUTOMATIC = 0
    IPV4_ONLY = 1
    IPV6_ONLY = 2
    DUAL = 3


class AppProtocol(enum.Enum):
    """A service port's declared application protocol (xDS ``Port.app_protocol``)."""

    UNKNOWN = 0
    HTTP11 = 1
    HTTP2 = 2
    GRPC = 3
    TCP = 4
    TLS = 5


class ServiceVisibility(enum.Enum):
    """Who may see a service (xDS ``Service.visibility``)."""

    PUBLIC = 0
    NAMESPACE = 1


@dataclass(frozen=True, slots=True)
class NetworkAddress:
    """An IP qualified by the network it lives on (``"<network>/<ip>"`` in the local file)."""

    network: str
    address: IPAddr

    def __str__(self) -> str:
        return f"{self.network}/{self.address}"


@dataclass(frozen=True, slots=True)
class NetworkCidr:
    """A VIP range on a network (xDS ``NetworkAddress`` with a ``length`` shorter than the IP)."""

    network: str
    cidr: IPNet

    def __str__(self) -> str:
        return f"{self.network}/{self.cidr}"


@dataclass(frozen=True, slots=True)
class NamespacedHostname:
    namespace: str
    hostname: str


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """A waypoint or network gateway: exactly one of ``address``/``hostname`` is set."""

    address: NetworkAddress | None = None
    hostname: NamespacedHostname | None = None
    hbone_mtls_port: int = 15008


@dataclass(frozen=True, slots=True)
class WeightedWaypoint:
    """One of several waypoints a service splits traffic across, with its relative weight."""

    destination: GatewayAddress
    weight: int


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""


@dataclass(frozen=True, slots=True)
class ApplicationTunnel:
    protocol: AppTunnelProtocol = AppTunnelProtocol.NONE
    port: int | None = None


# Workload and Service are values: never changed once built (``dataclasses.replace`` makes a
# changed copy). They are not ``frozen`` only for speed: the shared store decodes one whenever a
# lookup misses its cache, and a frozen dataclass's ``__init__`` (every field through
# ``object.__setattr__``) costs about six times a plain one (5.9 against 1.0 µs for a Workload).
# Their hash and equality are the frozen ones (``unsafe_hash``).


@dataclass(slots=True, unsafe_hash=True)
class Workload:
    """One workload (usually a pod). ``services`` maps ``"ns/hostname"`` to servicePort->targetPort
    overrides for this endpoint."""

    uid: str
    name: str
    namespace: str
    addresses: tuple[IPAddr, ...] = ()
    hostname: str = ""
    network: str = ""
    protocol: TunnelProtocol = TunnelProtocol.NONE
    trust_domain: str = "cluster.local"
    service_account: str = "default"
    waypoint: GatewayAddress | None = None
    network_gateway: GatewayAddress | None = None
    node: str = ""
    canonical_name: str = ""
    canonical_revision: str = ""
    # A string, as Rust's: xDS gives one of WorkloadType's names in lower case, a local config
    # file whatever it says (empty when omitted). Only telemetry reads it.
    workload_type: str = "deployment"
    workload_name: str = ""
    native_tunnel: bool = False
    application_tunnel: ApplicationTunnel | None = None
    services: dict[str, dict[int, int]] = field(default_factory=dict, hash=False, compare=True)
    authorization_policies: tuple[str, ...] = ()
    status: WorkloadStatus = WorkloadStatus.HEALTHY
    cluster_id: str = "Kubernetes"
    locality: Locality = Locality()
    network_mode: NetworkMode = NetworkMode.STANDARD
    capacity: int = 1
    # Built on first use: connections keep it (access log, metrics, HBONE pool key), so every
    # connection of this workload shares one object instead of building its own.
    _identity: Identity | None = field(
        default=None, init=False, repr=False, compare=False, hash=False
    )

    @property
    def identity(self) -> Identity:
        ident = self._identity
        if ident is None:
            ident = Identity(self.trust_domain, self.namespace, self.service_account)
            object.__setattr__(self, "_identity", ident)
        return ident


@dataclass(frozen=True, slots=True)
class ServicePort:
    service_port: int
    target_port: int  # 0: a named port, resolved only by each endpoint's own mapping
    app_protocol: AppProtocol = AppProtocol.UNKNOWN


@dataclass(frozen=True, slots=True)
class LoadBalancing:
    routing_preference: tuple[LoadBalancerScope, ...] = ()
    mode: LoadBalancerMode = LoadBalancerMode.UNSPECIFIED
    health_policy: HealthPolicy = HealthPolicy.ONLY_HEALTHY


@dataclass(slots=True, unsafe_hash=True)
class Service:
    """A service. Its key (and xDS resource name) is ``"<namespace>/<hostname>"``."""

    name: str
    namespace: str
    hostname: str
    vips: tuple[NetworkAddress, ...] = ()
    ports: tuple[ServicePort, ...] = ()
    subject_alt_names: tuple[str, ...] = ()
    waypoint: GatewayAddress | None = None
    load_balancing: LoadBalancing | None = None
    ip_families: IPFamilies = IPFamilies.AUTOMATIC
    canonical: bool = False
    # Recent xDS fields, carried for the routing code and config dumps.
    cidr_vips: tuple[NetworkCidr, ...] = ()
    ingress_use_waypoint: bool = False
    weighted_waypoints: tuple[WeightedWaypoint, ...] = ()
    visibility: ServiceVisibility = ServiceVisibility.PUBLIC
    # Built on first use, as Workload's identity: every service-addressed connection reads it
    # (load balancing, the endpoint's port mapping).
    _key: str | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    @property
    def key(self) -> str:
        k = self._key
        if k is None:
            k = f"{self.namespace}/{self.hostname}"
            object.__setattr__(self, "_key", k)
        return k

    def target_port(self, service_port: int) -> int | None:
        """The service-level target port for ``service_port``; None if the port is not exposed.

        0 means a named target port: only a per-endpoint mapping can resolve it (as in Rust)."""
        for p in self.ports:
            if p.service_port == service_port:
                return p.target_port
        return None


# --- Authorization (stored now; evaluated by the authorization issue) -------------------------


class PolicyScope(enum.Enum):
    GLOBAL = 0
    NAMESPACE = 1
    WORKLOAD_SELECTOR = 2


class PolicyAction(enum.Enum):
    ALLOW = 0
    DENY = 1


class StringMatchKind(enum.Enum):
    EXACT = "exact"
    PREFIX = "prefix"
    SUFFIX = "suffix"
    PRESENCE = "presence"


@dataclass(frozen=True, slots=True)
class StringMatch:
    kind: StringMatchKind
    value: str = ""

    def matches(self, s: str) -> bool:
        if self.kind is StringMatchKind.EXACT:
            return s == self.value
        if self.kind is StringMatchKind.PREFIX:
            return s.startswith(self.value)
        if self.kind is StringMatchKind.SUFFIX:
            return s.endswith(self.value)
        return s != ""


@dataclass(frozen=True, slots=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str


@dataclass(frozen=True, slots=True)
class Match:
    namespaces: tuple[StringMatch, ...] = ()
    not_namespaces: tuple[StringMatch, ...] = ()
    service_accounts: tuple[ServiceAccountMatch, ...] = ()
    not_service_accounts: tuple[ServiceAccountMatch, ...] = ()
    principals: tuple[StringMatch, ...] = ()
    not_principals: tuple[StringMatch, ...] = ()
    source_ips: tuple[IPNet, ...] = ()
    not_source_ips: tuple[IPNet, ...] = ()
    destination_ips: tuple[IPNet, ...] = ()
    not_destination_ips: tuple[IPNet, ...] = ()
    destination_ports: tuple[int, ...] = ()
    not_destination_ports: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Clause:
    matches: tuple[Match, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    clauses: tuple[Clause, ...] = ()


@dataclass(frozen=True, slots=True)
class Authorization:
    """An L4 authorization policy. Its key is its xDS resource name, which istiod makes
    ``"<namespace>/<name>"`` (namespace "" = global)."""

    name: str
    namespace: str
    scope: PolicyScope
    action: PolicyAction
    rules: tuple[Rule, ...] = ()
    dry_run: bool = False
    # The xDS resource name it arrived under, when that is not ``namespace/name``: Rust keys the
    # policy store by the resource name (ProxyStateUpdater::insert_authorization), so removals
    # and workloads' ``authorization_policies`` refer to that name.
    xds_name: str = ""

    @property
    def key(self) -> str:
        return self.xds_name or f"{self.namespace}/{self.name}"
