"""Load the Rust ztunnel's local (file) config YAML into the state model.

The accepted shape is the one ztunnel's serde structs take (``LocalConfig`` in src/xds.rs,
``Workload``/``Service`` in src/state/, ``Authorization`` in src/rbac.rs): camelCase keys, Rust
enum spellings, ``"<network>/<ip>"`` VIPs, CIDR strings, ``{Exact: s}`` string matches. Unknown
keys are rejected. Every problem raises one :class:`LocalConfigError` naming the source,
line:column and key path, e.g. ``config.yaml:12:5: workloads[1].workloadIps[0]: invalid IP
address '10.0.0.x'``. The YAML is composed into a node tree (never constructed into Python
objects first) so every value keeps its position.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ztunnel.core.addr import IPAddr, IPNet
from ztunnel.state.model import (
    ApplicationTunnel,
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
)
from ztunnel.state.store import State

__all__ = ["LocalConfig", "LocalConfigError", "load_local_config"]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=enum.Enum)

# Rust deserializes a file workload with serde defaults (src/xds.rs LocalWorkload flattening
# src/state/workload.rs Workload): an omitted trustDomain, serviceAccount, clusterId or
# workloadType is an empty string, never the xDS conversion's cluster.local/default/deployment,
# so its identity is ``spiffe:///ns/<namespace>/sa/`` (which no CA certifies).
DEFAULT_CLUSTER_ID = "Kubernetes"  # only in the uid this loader makes up for uid-less entries
DEFAULT_HBONE_MTLS_PORT = 15008

_TAG = "tag:yaml.org,2002:"
_NULL_TAG = _TAG + "null"
_SCALAR_TEXT_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool"))
_INT_RE = re.compile(r"[-+]?(?:[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+)")

_PROTOCOL = {"TCP": TunnelProtocol.NONE, "HBONE": TunnelProtocol.HBONE}
_NETWORK_MODE = {"Standard": NetworkMode.STANDARD, "HostNetwork": NetworkMode.HOST_NETWORK}
_STATUS = {"Healthy": WorkloadStatus.HEALTHY, "Unhealthy": WorkloadStatus.UNHEALTHY}
_APP_TUNNEL = {"NONE": AppTunnelProtocol.NONE, "PROXY": AppTunnelProtocol.PROXY}
_VISIBILITY = {"Public": ServiceVisibility.PUBLIC, "Namespace": ServiceVisibility.NAMESPACE}
_LB_SCOPE = {
    "Region": LoadBalancerScope.REGION,
    "Zone": LoadBalancerScope.ZONE,
    "Subzone": LoadBalancerScope.SUBZONE,
    "Node": LoadBalancerScope.NODE,
    "Cluster": LoadBalancerScope.CLUSTER,
    "Network": LoadBalancerScope.NETWORK,
}
_LB_MODE = {
    "Standard": LoadBalancerMode.UNSPECIFIED,
    "Strict": LoadBalancerMode.STRICT,
    "Failover": LoadBalancerMode.FAILOVER,
    "Passthrough": LoadBalancerMode.PASSTHROUGH,
}
_HEALTH = {"OnlyHealthy": HealthPolicy.ONLY_HEALTHY, "AllowAll": HealthPolicy.ALLOW_ALL}
_IP_FAMILIES = {"Dual": IPFamilies.DUAL, "IPv4": IPFamilies.IPV4_ONLY, "IPv6": IPFamilies.IPV6_ONLY}
_POLICY_SCOPE = {
    "Global": PolicyScope.GLOBAL,
    "Namespace": PolicyScope.NAMESPACE,
    "WorkloadSelector": PolicyScope.WORKLOAD_SELECTOR,
}
_ACTION = {"Allow": PolicyAction.ALLOW, "Deny": PolicyAction.DENY}
_STRING_MATCH = {
    "Exact": StringMatchKind.EXACT,
    "Prefix": StringMatchKind.PREFIX,
    "Suffix": StringMatchKind.SUFFIX,
    "Presence": StringMatchKind.PRESENCE,
}

_TOP_KEYS = ("workloads", "policies", "services")
_WORKLOAD_KEYS = (
    "uid",
    "name",
    "namespace",
    "workloadIps",
    "hostname",
    "network",
    "protocol",
    "trustDomain",
    "serviceAccount",
    "waypoint",
    "networkGateway",
    "node",
    "canonicalName",
    "canonicalRevision",
    "workloadType",
    "workloadName",
    "nativeTunnel",
    "applicationTunnel",
    "services",
    "authorizationPolicies",
    "status",
    "clusterId",
    "locality",
    "networkMode",
    "capacity",
)
_SERVICE_KEYS = (
    "name",
    "namespace",
    "hostname",
    "vips",
    "ports",
    "subjectAltNames",
    "waypoint",
    "loadBalancer",
    "ipFamilies",
    "canonical",
    "cidrVips",
    "weightedWaypoints",
    "visibility",
)
# Valid in Rust but with no home in this port's model (endpoints come from the workloads'
# ``services`` maps): refuse loudly rather than silently drop routing behaviour.
_SERVICE_UNSUPPORTED = ("endpoints",)
_CIDR_VIP_KEYS = ("network", "cidr")
_WEIGHTED_WAYPOINT_KEYS = ("destination", "weight")
_GATEWAY_KEYS = ("destination", "hboneMtlsPort")
_LB_KEYS = ("routingPreferences", "mode", "healthPolicy")
_LOCALITY_KEYS = ("region", "zone", "subzone")
_APP_TUNNEL_KEYS = ("protocol", "port")
_POLICY_KEYS = ("name", "namespace", "scope", "action", "rules", "dryRun")
_MATCH_KEYS = (
    "namespaces",
    "notNamespaces",
    "serviceAccounts",
    "notServiceAccounts",
    "principals",
    "notPrincipals",
    "sourceIps",
    "notSourceIps",
    "destinationIps",
    "notDestinationIps",
    "destinationPorts",
    "notDestinationPorts",
)
_SA_MATCH_KEYS = ("namespace", "serviceAccount")


class LocalConfigError(ValueError):
    """A local config file is invalid. ``str()`` gives ``source:line:col: path: reason``."""

    def __init__(
        self,
        reason: str,
        *,
        source: str,
        path: str = "",
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.reason = reason
        self.source = source
        self.path = path
        self.line = line  # 1-based
        self.column = column  # 1-based
        where = source if line is None else f"{source}:{line}:{column}"
        super().__init__(f"{where}: {path}: {reason}" if path else f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class LocalConfig:
    """The parsed file: what ztunnel would otherwise learn from istiod."""

    workloads: tuple[Workload, ...] = ()
    services: tuple[Service, ...] = ()
    policies: tuple[Authorization, ...] = ()

    def apply_to(self, state: State) -> None:
        """Make ``state`` hold exactly this config (Rust clears the stores, then inserts).

        Entries absent from the file are removed; the rest are upserted, so subscribers see
        one change per entry rather than a flash of empty state.
        """
        uids = {w.uid for w in self.workloads}
        svc_keys = {s.key for s in self.services}
        pol_keys = {p.key for p in self.policies}
        for w in list(state.workloads()):
            if w.uid not in uids:
                state.remove_workload(w.uid)
        for s in list(state.services()):
            if s.key not in svc_keys:
                state.remove_service(s.key)
        for p in list(state.policies()):
            if p.key not in pol_keys:
                state.remove_policy(p.key)
        for s in self.services:
            state.upsert_service(s)
        for w in self.workloads:
            state.upsert_workload(w)
        for p in self.policies:
            state.upsert_policy(p)


def load_local_config(text: str, source: str = "<inline>") -> LocalConfig:
    """Parse and validate a local config document; raises :class:`LocalConfigError`."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        reason = " ".join(x for x in (e.context, e.problem) if x) or "invalid YAML"
        if mark is None:
            raise LocalConfigError(reason, source=source) from None
        raise LocalConfigError(
            reason, source=source, line=mark.line + 1, column=mark.column + 1
        ) from None
    except yaml.YAMLError as e:
        raise LocalConfigError(f"invalid YAML: {e}", source=source) from None
    if root is None or _is_null(root):
        return LocalConfig()
    return _Parser(source).config(root)


def _raw_ip(text: str) -> IPAddr:
    """An IP as written: ``::ffff:a.b.c.d`` stays IPv6, as Rust's ``IpAddr`` parse keeps it."""
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        raise ValueError(f"invalid IP address {text!r}") from None


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == _NULL_TAG


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if _is_null(node):
        return "null"
    return repr(node.value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _one_of(table: Collection[str]) -> str:
    return ", ".join(table)


class _Parser:
    """Walks the composed node tree; every failure carries the node's position and key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    # --- primitives ----------------------------------------------------------------------

    def fail(self, node: Node, path: str, reason: str) -> NoReturn:
        m = node.start_mark
        raise LocalConfigError(
            reason, source=self.source, path=path, line=m.line + 1, column=m.column + 1
        )

    def mapping(
        self,
        node: Node,
        path: str,
        known: Collection[str],
        required: Collection[str] = (),
        unsupported: Collection[str] = (),
    ) -> dict[str, Node]:
        if not isinstance(node, MappingNode):
            self.fail(node, path, f"expected a mapping, got {_describe(node)}")
        out: dict[str, Node] = {}
        for k, v in node.value:
            if not isinstance(k, ScalarNode) or k.tag not in _SCALAR_TEXT_TAGS:
                self.fail(k, path, f"keys must be strings, got {_describe(k)}")
            name = k.value
            kp = _join(path, name)
            if name in out:
                self.fail(k, kp, f"duplicate key {name!r}")
            if name in unsupported:
                self.fail(k, kp, f"key {name!r} is not supported by this ztunnel")
            if name not in known:
                self.fail(k, kp, f"unknown key {name!r} (expected one of: {_one_of(known)})")
            out[name] = v
        for r in required:
            if r not in out:
                self.fail(node, path, f"missing required key {r!r}")
        return out

    def seq(self, node: Node, path: str) -> list[Node]:
        if not isinstance(node, SequenceNode):
            self.fail(node, path, f"expected a list, got {_describe(node)}")
        return list(node.value)

    def string(self, node: Node, path: str) -> str:
        # serde_yaml reads any plain scalar into a String field (``name: 123`` is "123"), so
        # take the source text rather than YAML 1.1's idea of the value (``no`` -> False).
        if not isinstance(node, ScalarNode) or node.tag not in _SCALAR_TEXT_TAGS:
            self.fail(node, path, f"expected a string, got {_describe(node)}")
        return str(node.value)

    def integer(self, node: Node, path: str, lo: int, hi: int, *, quoted_ok: bool = False) -> int:
        if (
            not isinstance(node, ScalarNode)
            or node.tag not in _SCALAR_TEXT_TAGS
            or (node.style is not None and not quoted_ok)
            or not _INT_RE.fullmatch(node.value)
        ):
            self.fail(node, path, f"expected an integer, got {_describe(node)}")
        text = node.value
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        n = sign * (int(digits, 0) if digits[:2] in ("0x", "0o") else int(digits, 10))
        if not lo <= n <= hi:
            self.fail(node, path, f"{n} out of range {lo}-{hi}")
        return n

    def port(self, node: Node, path: str, *, quoted_ok: bool = False) -> int:
        return self.integer(node, path, 0, 65535, quoted_ok=quoted_ok)

    def boolean(self, node: Node, path: str) -> bool:
        # YAML 1.2 booleans only (serde_yaml): yes/no/on/off are not booleans there.
        if isinstance(node, ScalarNode) and node.style is None:
            v = node.value.lower()
            if v == "true":
                return True
            if v == "false":
                return False
        self.fail(node, path, f"expected true or false, got {_describe(node)}")

    def enum(self, node: Node, path: str, table: Mapping[str, _E]) -> _E:
        value = self.string(node, path)
        e = table.get(value)
        if e is None:
            self.fail(node, path, f"invalid value {value!r} (expected one of: {_one_of(table)})")
        return e

    def ip(self, node: Node, path: str) -> IPAddr:
        text = self.string(node, path)
        try:
            # As written: ::ffff:a.b.c.d stays IPv6, as Rust's IpAddr parse keeps it.
            return _raw_ip(text)
        except ValueError as e:
            self.fail(node, path, str(e))

    def cidr(self, node: Node, path: str) -> IPNet:
        text = self.string(node, path)
        if "/" not in text:
            self.fail(node, path, f"invalid CIDR {text!r}: expected <ip>/<prefix length>")
        try:
            # Host bits may be set, as Rust's IpNet allows; matching uses the network part.
            return ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            self.fail(node, path, f"invalid CIDR {text!r}")

    def network_address(self, node: Node, path: str) -> NetworkAddress:
        text = self.string(node, path)
        network, sep, ip_text = text.partition("/")
        if not sep:
            self.fail(node, path, f"invalid address {text!r}: expected '<network>/<ip>'")
        try:
            return NetworkAddress(network, _raw_ip(ip_text))
        except ValueError as e:
            self.fail(node, path, f"invalid address {text!r}: {e}")

    def strings(self, node: Node, path: str) -> tuple[str, ...]:
        return tuple(self.string(n, f"{path}[{i}]") for i, n in enumerate(self.seq(node, path)))

    def list_of(self, node: Node, path: str, item: Callable[[Node, str], _T]) -> tuple[_T, ...]:
        return tuple(item(n, f"{path}[{i}]") for i, n in enumerate(self.seq(node, path)))

    def opt(
        self,
        fields: Mapping[str, Node],
        key: str,
        path: str,
        conv: Callable[[Node, str], _T],
        default: _T,
    ) -> _T:
        """``fields[key]`` converted, or ``default`` when absent or null (serde ``default``)."""
        node = fields.get(key)
        if node is None or _is_null(node):
            return default
        return conv(node, _join(path, key))

    def req(
        self, fields: Mapping[str, Node], key: str, path: str, conv: Callable[[Node, str], _T]
    ) -> _T:
        return conv(fields[key], _join(path, key))

    def port_map(self, node: Node, path: str) -> dict[int, int]:
        """``{servicePort: targetPort}``; keys may be quoted (``"80": 8080``)."""
        if not isinstance(node, MappingNode):
            self.fail(node, path, f"expected a mapping of ports, got {_describe(node)}")
        out: dict[int, int] = {}
        for k, v in node.value:
            sp = self.port(k, path, quoted_ok=True)
            kp = f"{path}[{sp}]"
            if sp in out:
                self.fail(k, kp, f"duplicate port {sp}")
            out[sp] = self.port(v, kp)
        return out

    # --- top level -----------------------------------------------------------------------

    def config(self, root: Node) -> LocalConfig:
        top = self.mapping(root, "", _TOP_KEYS)
        workloads: list[Node] = self.opt(top, "workloads", "", self.seq, [])
        services: list[Node] = self.opt(top, "services", "", self.seq, [])
        policies: list[Node] = self.opt(top, "policies", "", self.seq, [])
        return LocalConfig(
            workloads=self.workloads(workloads),
            services=self.services(services),
            policies=self.policies(policies),
        )

    # --- workloads -----------------------------------------------------------------------

    def workloads(self, nodes: list[Node]) -> tuple[Workload, ...]:
        out: list[Workload] = []
        uid_paths: dict[str, str] = {}
        ip_owner: dict[NetworkAddress, tuple[str, str]] = {}  # -> (uid, path)
        for i, node in enumerate(nodes):
            path = f"workloads[{i}]"
            w, fields = self.workload(node, path)
            uid_node = fields.get("uid", node)
            if w.uid in uid_paths:
                self.fail(
                    uid_node, _join(path, "uid"), f"duplicate uid {w.uid!r} ({uid_paths[w.uid]})"
                )
            uid_paths[w.uid] = path
            # Host-network workloads share the node IP by design; the store skips them too.
            if w.network_mode is not NetworkMode.HOST_NETWORK and "workloadIps" in fields:
                ips_node = fields["workloadIps"]
                for j, ip in enumerate(w.addresses):
                    na = NetworkAddress(w.network, ip)
                    prev = ip_owner.get(na)
                    ip_path = f"{path}.workloadIps[{j}]"
                    if prev is not None and prev[0] != w.uid:
                        assert isinstance(ips_node, SequenceNode)
                        self.fail(
                            ips_node.value[j],
                            ip_path,
                            f"IP {ip} on network {w.network!r} is already used by workload "
                            f"{prev[0]!r} ({prev[1]})",
                        )
                    ip_owner[na] = (w.uid, ip_path)
            out.append(w)
        return tuple(out)

    def workload(self, node: Node, path: str) -> tuple[Workload, dict[str, Node]]:
        f = self.mapping(node, path, _WORKLOAD_KEYS, required=("namespace",))
        name = self.opt(f, "name", path, self.string, "")
        namespace = self.req(f, "namespace", path, self.string)
        cluster_id = self.opt(f, "clusterId", path, self.string, "")
        # Rust leaves uid empty when omitted, and then every uid-less workload overwrites the
        # previous one; name it the way istiod names pods instead.
        uid = self.opt(f, "uid", path, self.string, "") or (
            f"{cluster_id or DEFAULT_CLUSTER_ID}//v1/Pod/{namespace}/{name}"
        )
        w = Workload(
            uid=uid,
            name=name,
            namespace=namespace,
            addresses=self.opt(f, "workloadIps", path, self.ips, ()),
            hostname=self.opt(f, "hostname", path, self.string, ""),
            network=self.opt(f, "network", path, self.string, ""),
            protocol=self.opt(f, "protocol", path, self.enum_of(_PROTOCOL), TunnelProtocol.NONE),
            trust_domain=self.opt(f, "trustDomain", path, self.string, ""),
            service_account=self.opt(f, "serviceAccount", path, self.string, ""),
            waypoint=self.opt(f, "waypoint", path, self.gateway, None),
            network_gateway=self.opt(f, "networkGateway", path, self.gateway, None),
            node=self.opt(f, "node", path, self.string, ""),
            canonical_name=self.opt(f, "canonicalName", path, self.string, ""),
            canonical_revision=self.opt(f, "canonicalRevision", path, self.string, ""),
            # Any string, as Rust's Strng field takes (it only feeds telemetry), kept as is.
            workload_type=self.opt(f, "workloadType", path, self.string, ""),
            workload_name=self.opt(f, "workloadName", path, self.string, ""),
            native_tunnel=self.opt(f, "nativeTunnel", path, self.boolean, False),
            application_tunnel=self.opt(f, "applicationTunnel", path, self.app_tunnel, None),
            services=self.opt(f, "services", path, self.workload_services, {}),
            authorization_policies=self.opt(f, "authorizationPolicies", path, self.strings, ()),
            status=self.opt(f, "status", path, self.enum_of(_STATUS), WorkloadStatus.HEALTHY),
            cluster_id=cluster_id,
            locality=self.opt(f, "locality", path, self.locality, Locality()),
            network_mode=self.opt(
                f, "networkMode", path, self.enum_of(_NETWORK_MODE), NetworkMode.STANDARD
            ),
            capacity=self.opt(f, "capacity", path, self.capacity, 1),
        )
        return w, f

    def enum_of(self, table: Mapping[str, _E]) -> Callable[[Node, str], _E]:
        return lambda node, path: self.enum(node, path, table)

    def ips(self, node: Node, path: str) -> tuple[IPAddr, ...]:
        return self.list_of(node, path, self.ip)

    def capacity(self, node: Node, path: str) -> int:
        return self.integer(node, path, 0, 2**32 - 1)

    def workload_services(self, node: Node, path: str) -> dict[str, dict[int, int]]:
        if not isinstance(node, MappingNode):
            self.fail(node, path, f"expected a mapping of service keys, got {_describe(node)}")
        out: dict[str, dict[int, int]] = {}
        for k, v in node.value:
            key = self.string(k, path)
            kp = f"{path}[{key!r}]"
            ns, sep, host = key.partition("/")
            if not sep or not ns or not host:
                self.fail(k, kp, f"invalid service key {key!r}: expected '<namespace>/<hostname>'")
            if key in out:
                self.fail(k, kp, f"duplicate service key {key!r}")
            out[key] = {} if _is_null(v) else self.port_map(v, kp)
        return out

    def gateway(self, node: Node, path: str) -> GatewayAddress:
        f = self.mapping(node, path, _GATEWAY_KEYS, required=("destination",))
        port = self.opt(f, "hboneMtlsPort", path, self.port, DEFAULT_HBONE_MTLS_PORT)
        dest = f["destination"]
        dpath = _join(path, "destination")
        if isinstance(dest, MappingNode):
            # Not serde's form (a string), but the natural reading of the proto; accept both.
            d = self.mapping(dest, dpath, ("network", "address", "namespace", "hostname"))
            if "address" in d:
                if "namespace" in d or "hostname" in d:
                    self.fail(dest, dpath, "set either network/address or namespace/hostname")
                ip = self.req(d, "address", dpath, self.ip)
                net = self.opt(d, "network", dpath, self.string, "")
                return GatewayAddress(address=NetworkAddress(net, ip), hbone_mtls_port=port)
            if "network" in d:
                self.fail(dest, dpath, "missing required key 'address'")
            if "hostname" not in d or "namespace" not in d:
                self.fail(dest, dpath, "expected {network, address} or {namespace, hostname}")
            nh = NamespacedHostname(
                self.req(d, "namespace", dpath, self.string),
                self.req(d, "hostname", dpath, self.string),
            )
            return GatewayAddress(hostname=nh, hbone_mtls_port=port)
        # serde form: "<network>/<ip>" if the part after the slash is an IP, else
        # "<namespace>/<hostname>" (Destination is an untagged enum of the two).
        text = self.string(dest, dpath)
        left, sep, right = text.partition("/")
        if not sep or not right:
            self.fail(
                dest,
                dpath,
                f"invalid destination {text!r}: expected '<network>/<ip>' or "
                "'<namespace>/<hostname>'",
            )
        try:
            return GatewayAddress(
                address=NetworkAddress(left, _raw_ip(right)),
                hbone_mtls_port=port,
            )
        except ValueError:
            return GatewayAddress(hostname=NamespacedHostname(left, right), hbone_mtls_port=port)

    def app_tunnel(self, node: Node, path: str) -> ApplicationTunnel:
        f = self.mapping(node, path, _APP_TUNNEL_KEYS, required=("protocol",))
        port = self.opt(f, "port", path, self.port, 0)
        return ApplicationTunnel(
            protocol=self.req(f, "protocol", path, self.enum_of(_APP_TUNNEL)),
            port=port or None,  # the proto's 0 means "not set"
        )

    def locality(self, node: Node, path: str) -> Locality:
        f = self.mapping(node, path, _LOCALITY_KEYS)
        return Locality(
            region=self.opt(f, "region", path, self.string, ""),
            zone=self.opt(f, "zone", path, self.string, ""),
            subzone=self.opt(f, "subzone", path, self.string, ""),
        )

    # --- services ------------------------------------------------------------------------

    def services(self, nodes: list[Node]) -> tuple[Service, ...]:
        out: list[Service] = []
        keys: dict[str, str] = {}
        for i, node in enumerate(nodes):
            path = f"services[{i}]"
            s, _ = self.service(node, path)
            if s.key in keys:
                self.fail(node, path, f"duplicate service {s.key!r} ({keys[s.key]})")
            keys[s.key] = path
            # Several services may share a VIP (Rust ServiceStore::by_vip is a list); the
            # client's namespace picks among them.
            out.append(s)
        return tuple(out)

    def service(self, node: Node, path: str) -> tuple[Service, dict[str, Node]]:
        f = self.mapping(
            node,
            path,
            _SERVICE_KEYS,
            required=("name", "namespace", "hostname"),
            unsupported=_SERVICE_UNSUPPORTED,
        )
        ports: dict[int, int] = self.opt(f, "ports", path, self.port_map, {})
        s = Service(
            name=self.req(f, "name", path, self.string),
            namespace=self.req(f, "namespace", path, self.string),
            hostname=self.req(f, "hostname", path, self.string),
            vips=self.opt(f, "vips", path, self.vips, ()),
            ports=tuple(ServicePort(sp, tp) for sp, tp in ports.items()),
            subject_alt_names=self.opt(f, "subjectAltNames", path, self.strings, ()),
            waypoint=self.opt(f, "waypoint", path, self.gateway, None),
            load_balancing=self.opt(f, "loadBalancer", path, self.load_balancer, None),
            ip_families=self.opt(
                f, "ipFamilies", path, self.enum_of(_IP_FAMILIES), IPFamilies.AUTOMATIC
            ),
            canonical=self.opt(f, "canonical", path, self.boolean, False),
            cidr_vips=self.opt(f, "cidrVips", path, self.cidr_vips, ()),
            weighted_waypoints=self.opt(f, "weightedWaypoints", path, self.weighted_waypoints, ()),
            visibility=self.opt(
                f, "visibility", path, self.enum_of(_VISIBILITY), ServiceVisibility.PUBLIC
            ),
        )
        return s, f

    def cidr_vips(self, node: Node, path: str) -> tuple[NetworkCidr, ...]:
        """``[{network: "", cidr: "10.96.0.0/16"}]`` (Rust ``NetworkCidr``'s serde shape)."""

        def one(n: Node, p: str) -> NetworkCidr:
            f = self.mapping(n, p, _CIDR_VIP_KEYS, required=("cidr",))
            return NetworkCidr(
                self.opt(f, "network", p, self.string, ""), self.req(f, "cidr", p, self.cidr)
            )

        return self.list_of(node, path, one)

    def weighted_waypoints(self, node: Node, path: str) -> tuple[WeightedWaypoint, ...]:
        def one(n: Node, p: str) -> WeightedWaypoint:
            f = self.mapping(n, p, _WEIGHTED_WAYPOINT_KEYS, required=("destination", "weight"))
            return WeightedWaypoint(
                self.req(f, "destination", p, self.gateway),
                self.req(f, "weight", p, lambda x, q: self.integer(x, q, 0, 2**32 - 1)),
            )

        return self.list_of(node, path, one)

    def vips(self, node: Node, path: str) -> tuple[NetworkAddress, ...]:
        return self.list_of(node, path, self.network_address)

    def load_balancer(self, node: Node, path: str) -> LoadBalancing:
        f = self.mapping(node, path, _LB_KEYS)
        return LoadBalancing(
            routing_preference=self.opt(
                f,
                "routingPreferences",
                path,
                lambda n, p: self.list_of(n, p, self.enum_of(_LB_SCOPE)),
                (),
            ),
            mode=self.opt(f, "mode", path, self.enum_of(_LB_MODE), LoadBalancerMode.UNSPECIFIED),
            health_policy=self.opt(
                f, "healthPolicy", path, self.enum_of(_HEALTH), HealthPolicy.ONLY_HEALTHY
            ),
        )

    # --- policies ------------------------------------------------------------------------

    def policies(self, nodes: list[Node]) -> tuple[Authorization, ...]:
        out: list[Authorization] = []
        keys: dict[str, str] = {}
        for i, node in enumerate(nodes):
            path = f"policies[{i}]"
            p = self.policy(node, path)
            if p.key in keys:
                self.fail(node, path, f"duplicate policy {p.key!r} ({keys[p.key]})")
            keys[p.key] = path
            out.append(p)
        return tuple(out)

    def policy(self, node: Node, path: str) -> Authorization:
        f = self.mapping(
            node, path, _POLICY_KEYS, required=("name", "namespace", "scope", "action", "rules")
        )
        return Authorization(
            name=self.req(f, "name", path, self.string),
            namespace=self.req(f, "namespace", path, self.string),
            scope=self.req(f, "scope", path, self.enum_of(_POLICY_SCOPE)),
            action=self.req(f, "action", path, self.enum_of(_ACTION)),
            rules=self.req(f, "rules", path, lambda n, p: self.list_of(n, p, self.rule)),
            dry_run=self.opt(f, "dryRun", path, self.boolean, False),
        )

    def rule(self, node: Node, path: str) -> Rule:
        return Rule(clauses=self.list_of(node, path, self.clause))

    def clause(self, node: Node, path: str) -> Clause:
        return Clause(matches=self.list_of(node, path, self.match))

    def match(self, node: Node, path: str) -> Match:
        f = self.mapping(node, path, _MATCH_KEYS)

        def sm(key: str) -> tuple[StringMatch, ...]:
            return self.opt(f, key, path, lambda n, p: self.list_of(n, p, self.string_match), ())

        def sa(key: str) -> tuple[ServiceAccountMatch, ...]:
            return self.opt(f, key, path, lambda n, p: self.list_of(n, p, self.sa_match), ())

        def nets(key: str) -> tuple[IPNet, ...]:
            return self.opt(f, key, path, lambda n, p: self.list_of(n, p, self.cidr), ())

        def ports(key: str) -> tuple[int, ...]:
            return self.opt(f, key, path, lambda n, p: self.list_of(n, p, self.port), ())

        return Match(
            namespaces=sm("namespaces"),
            not_namespaces=sm("notNamespaces"),
            service_accounts=sa("serviceAccounts"),
            not_service_accounts=sa("notServiceAccounts"),
            principals=sm("principals"),
            not_principals=sm("notPrincipals"),
            source_ips=nets("sourceIps"),
            not_source_ips=nets("notSourceIps"),
            destination_ips=nets("destinationIps"),
            not_destination_ips=nets("notDestinationIps"),
            destination_ports=ports("destinationPorts"),
            not_destination_ports=ports("notDestinationPorts"),
        )

    def string_match(self, node: Node, path: str) -> StringMatch:
        """serde's externally tagged enum: ``{Exact: s}`` / ``{Presence: []}``, or the YAML-tag
        form serde_yaml also reads (``!Exact s``, ``!Presence``)."""
        expected = "expected {Exact|Prefix|Suffix: <string>} or {Presence: []}"
        if isinstance(node, ScalarNode) and node.tag.startswith("!"):
            kind = _STRING_MATCH.get(node.tag[1:])
            if kind is None:
                self.fail(node, path, f"invalid string match tag {node.tag!r}: {expected}")
            if kind is StringMatchKind.PRESENCE:
                return StringMatch(kind)
            return StringMatch(kind, str(node.value))
        if not isinstance(node, MappingNode) or len(node.value) != 1:
            self.fail(node, path, f"{expected}, got {_describe(node)}")
        k, v = node.value[0]
        name = self.string(k, path)
        kind = _STRING_MATCH.get(name)
        if kind is None:
            self.fail(k, _join(path, name), f"invalid string match {name!r}: {expected}")
        if kind is StringMatchKind.PRESENCE:
            if not (_is_null(v) or (isinstance(v, SequenceNode | MappingNode) and not v.value)):
                self.fail(v, _join(path, name), "Presence takes no value (write [])")
            return StringMatch(kind)
        return StringMatch(kind, self.string(v, _join(path, name)))

    def sa_match(self, node: Node, path: str) -> ServiceAccountMatch:
        f = self.mapping(node, path, _SA_MATCH_KEYS, required=_SA_MATCH_KEYS)
        return ServiceAccountMatch(
            namespace=self.req(f, "namespace", path, self.string),
            service_account=self.req(f, "serviceAccount", path, self.string),
        )
