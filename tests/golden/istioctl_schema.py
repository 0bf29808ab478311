"""istioctl's view of ``/config_dump``, as a schema: the Go structs' JSON field names and Go types,
written by hand from reading istio/istio ``istioctl/pkg/writer/ztunnel/configdump/api.go`` and
``configdump.go`` (the ``rawDump`` that ``Prime`` decodes). Not istioctl's code.

:func:`decode` follows ``encoding/json``'s rules for these types: object keys match field tags
case-insensitively and unknown keys are ignored; ``null`` leaves any field at its zero value; a
JSON value of the wrong kind fails with Go's message (``cannot unmarshal number into Go struct
field WorkloadState.workloadstate.connections of type configdump.WorkloadConnections``);
unsigned integers must be whole numbers in range; map keys of an integer type must parse.
``services``/``workloads``/``policies``/``certificates`` may each be a list or a map of
entries (``unmarshalListOrMap``). The result is plain Python values with Go's zero values filled
in, so tests can read fields as istioctl would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DecodeError(Exception):
    pass


@dataclass(frozen=True)
class GoType:
    go: str  # the Go type name used in error messages


@dataclass(frozen=True)
class Scalar(GoType):
    kind: str  # "string" | "bool" | "uint" | "int" | "any"
    bits: int = 64


@dataclass(frozen=True)
class Slice(GoType):
    elem: GoType


@dataclass(frozen=True)
class Map(GoType):
    key: Scalar
    value: GoType


@dataclass(frozen=True)
class Ptr(GoType):
    elem: GoType


@dataclass(frozen=True)
class Struct(GoType):
    fields: tuple[tuple[str, GoType], ...]  # (json tag name, type)


STRING = Scalar("string", "string")
BOOL = Scalar("bool", "bool")
UINT16 = Scalar("uint16", "uint", 16)
UINT32 = Scalar("uint32", "uint", 32)
INT = Scalar("int", "int", 64)
ANY = Scalar("interface {}", "any")


def slice_(t: GoType) -> Slice:
    return Slice(f"[]{t.go}", t)


def ptr(t: GoType) -> Ptr:
    return Ptr(f"*{t.go}", t)


def struct(name: str, *fields: tuple[str, GoType]) -> Struct:
    return Struct(f"configdump.{name}", tuple(fields))


LOCALITY = struct("Locality", ("region", STRING), ("zone", STRING), ("subzone", STRING))
GATEWAY = struct("GatewayAddress", ("destination", STRING))
APP_TUNNEL = struct("ApplicationTunnel", ("protocol", STRING), ("port", ptr(UINT16)))
WORKLOAD = struct(
    "ZtunnelWorkload",
    ("uid", STRING),
    ("workloadIps", slice_(STRING)),
    ("waypoint", ptr(GATEWAY)),
    ("networkGateway", ptr(GATEWAY)),
    ("protocol", STRING),
    ("name", STRING),
    ("namespace", STRING),
    ("serviceAccount", STRING),
    ("workloadName", STRING),
    ("workloadType", STRING),
    ("canonicalName", STRING),
    ("canonicalRevision", STRING),
    ("clusterId", STRING),
    ("trustDomain", STRING),
    ("locality", LOCALITY),
    ("node", STRING),
    ("network", STRING),
    ("status", STRING),
    ("hostname", STRING),
    ("capacity", UINT32),
    ("applicationTunnel", APP_TUNNEL),
    ("authorizationPolicies", slice_(STRING)),
)
LOAD_BALANCER = struct(
    "LoadBalancer",
    ("mode", STRING),
    ("routingPreferences", slice_(STRING)),
    ("healthPolicy", STRING),
)
ENDPOINT = struct(
    "ZtunnelEndpoint",
    ("workloadUid", STRING),
    ("service", STRING),
    ("address", STRING),
    ("port", Map("map[uint16]uint16", UINT16, UINT16)),
)
# CIDRVIP has its own UnmarshalJSON: an object, or a "network/cidr" string.
CIDR_VIP = struct("CIDRVIP", ("cidr", STRING), ("network", STRING))
SERVICE = struct(
    "ZtunnelService",
    ("name", STRING),
    ("namespace", STRING),
    ("hostname", STRING),
    ("vips", slice_(STRING)),
    ("cidrVips", slice_(CIDR_VIP)),
    ("ports", Map("map[string]int", STRING, INT)),
    ("loadBalancer", ptr(LOAD_BALANCER)),
    ("waypoint", ptr(GATEWAY)),
    ("endpoints", Map("map[string]*configdump.ZtunnelEndpoint", STRING, ptr(ENDPOINT))),
    ("subjectAltNames", slice_(STRING)),
    ("ipFamilies", STRING),
    ("canonical", BOOL),
    ("visibility", STRING),
)
STRING_MATCH = struct(
    "StringMatch", ("Exact", STRING), ("Suffix", STRING), ("Prefix", STRING), ("Presence", ANY)
)
SA_MATCH = struct("ServiceAccountMatch", ("namespace", STRING), ("serviceAccount", STRING))
POLICY_MATCH = struct(
    "PolicyMatch",
    ("namespaces", slice_(STRING_MATCH)),
    ("notNamespaces", slice_(STRING_MATCH)),
    ("principals", slice_(STRING_MATCH)),
    ("notPrincipals", slice_(STRING_MATCH)),
    ("sourceIps", slice_(STRING)),
    ("notSourceIps", slice_(STRING)),
    ("destinationIps", slice_(STRING)),
    ("notDestinationIps", slice_(STRING)),
    ("destinationPorts", slice_(UINT16)),
    ("notDestinationPorts", slice_(UINT16)),
    ("serviceAccounts", slice_(SA_MATCH)),
    ("notServiceAccounts", slice_(SA_MATCH)),
)
POLICY = struct(
    "ZtunnelPolicy",
    ("name", STRING),
    ("namespace", STRING),
    ("scope", STRING),
    ("action", STRING),
    ("rules", slice_(slice_(slice_(ptr(POLICY_MATCH))))),
)
CERT = struct(
    "Cert",
    ("pem", STRING),
    ("serialNumber", STRING),
    ("validFrom", STRING),
    ("expirationTime", STRING),
)
CERTS = struct(
    "CertsDump",
    ("identity", STRING),
    ("state", STRING),
    ("certChain", slice_(ptr(CERT))),
    ("rootCerts", slice_(ptr(CERT))),
)
CONNECTION = struct(
    "InboundConnection",
    ("src", STRING),
    ("originalDst", STRING),
    ("actualDst", STRING),
    ("protocol", STRING),
)
OUT_CONNECTION = struct(
    "OutboundConnection",
    ("src", STRING),
    ("originalDst", STRING),
    ("actualDst", STRING),
    ("protocol", STRING),
)
CONNECTIONS = struct(
    "WorkloadConnections",
    ("inbound", slice_(CONNECTION)),
    ("outbound", slice_(OUT_CONNECTION)),
)
WORKLOAD_INFO = struct(
    "WorkloadInfo",
    ("name", STRING),
    ("namespace", STRING),
    ("trustDomain", STRING),
    ("serviceAccount", STRING),
)
WORKLOAD_STATE = struct(
    "WorkloadState", ("state", STRING), ("connections", CONNECTIONS), ("info", WORKLOAD_INFO)
)
# configdump.go rawDump: the four lists kept raw, workloadstate decoded at once.
LISTS = {
    "services": SERVICE,
    "workloads": WORKLOAD,
    "policies": POLICY,
    "certificates": CERTS,
}
RAW_DUMP_STATE = Map("map[string]configdump.WorkloadState", STRING, WORKLOAD_STATE)


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _zero(t: GoType) -> Any:
    if isinstance(t, Scalar):
        return {"string": "", "bool": False, "uint": 0, "int": 0, "any": None}[t.kind]
    if isinstance(t, Struct):
        return {name: _zero(ft) for name, ft in t.fields}
    return None  # slices, maps, pointers


def _fail(v: Any, t: GoType, owner: str, path: str) -> DecodeError:
    at = f" into Go struct field {owner}.{path}" if path else " into Go value"
    what = _kind(v)
    if what == "number" and isinstance(t, Scalar) and t.kind in ("int", "uint"):
        what = f"number {v}"  # Go quotes the literal when a number does not fit a number type
    return DecodeError(f"json: cannot unmarshal {what}{at} of type {t.go}")


def _int_in_range(v: float | int, t: Scalar) -> bool:
    if isinstance(v, float) and not v.is_integer():
        return False
    n = int(v)
    if t.kind == "uint":
        return 0 <= n < (1 << t.bits)
    return -(1 << (t.bits - 1)) <= n < (1 << (t.bits - 1))


def _decode(v: Any, t: GoType, owner: str = "", path: str = "") -> Any:
    """``owner``: the struct type holding the field being decoded; ``path``: the field names
    from the top (what Go's UnmarshalTypeError prints)."""
    if v is None:
        return _zero(t)
    if isinstance(t, Ptr):
        return _decode(v, t.elem, owner, path)
    if isinstance(t, Scalar):
        if t.kind == "any":
            return v
        if t.kind == "string":
            if not isinstance(v, str):
                raise _fail(v, t, owner, path)
            return v
        if t.kind == "bool":
            if not isinstance(v, bool):
                raise _fail(v, t, owner, path)
            return v
        if isinstance(v, bool) or not isinstance(v, int | float) or not _int_in_range(v, t):
            raise _fail(v, t, owner, path)
        return int(v)
    if isinstance(t, Slice):
        if not isinstance(v, list):
            raise _fail(v, t, owner, path)
        return [_decode(x, t.elem, owner, path) for x in v]
    if isinstance(t, Map):
        if not isinstance(v, dict):
            raise _fail(v, t, owner, path)
        out = {}
        for k, x in v.items():
            key: Any = k
            if t.key.kind == "uint":
                if not k.isdigit() or not _int_in_range(int(k), t.key):
                    raise DecodeError(
                        f"json: cannot unmarshal number {k} into Go value of type {t.key.go}"
                    )
                key = int(k)
            out[key] = _decode(x, t.value, owner, path)
        return out
    assert isinstance(t, Struct)
    if t is CIDR_VIP and not isinstance(v, dict):
        # CIDRVIP.UnmarshalJSON: not an object, so it must be a "network/cidr" string
        if not isinstance(v, str):
            raise _fail(v, STRING, owner, path)
        network, sep, cidr = v.partition("/")
        if not sep:
            raise DecodeError(f'invalid cidrVip "{v}"')
        return {"cidr": cidr, "network": network}
    if not isinstance(v, dict):
        raise _fail(v, t, owner, path)
    out = _zero(t)
    exact = dict(t.fields)
    by_fold = {name.lower(): name for name, _ in t.fields}
    me = t.go.removeprefix("configdump.")
    for k, x in v.items():
        name = k if k in exact else by_fold.get(k.lower())
        if name is None:
            continue  # unknown fields are ignored
        out[name] = _decode(x, exact[name], me, f"{path}.{name}" if path else name)
    return out


def decode(dump: Any) -> dict[str, Any]:
    """The dump as istioctl's ``Prime`` leaves it: ``workloads``, ``services``, ``policies``,
    ``certificates`` (lists) and ``workloadState`` (a map), or DecodeError with Go's message."""
    prefix = "error unmarshalling config dump response from ztunnel: "
    if not isinstance(dump, dict):
        raise DecodeError(
            f"{prefix}json: cannot unmarshal {_kind(dump)} into Go value of type configdump.rawDump"
        )

    def field(key: str) -> Any:
        # Go prefers an exact tag match, else the last case-insensitive one.
        if key in dump:
            return dump[key]
        return next((x for k, x in reversed(dump.items()) if k.lower() == key.lower()), None)

    try:
        states = _decode(field("workloadstate"), RAW_DUMP_STATE, "rawDump", "workloadstate")
    except DecodeError as e:
        raise DecodeError(prefix + str(e)) from None
    out: dict[str, Any] = {"workloadState": states or {}}
    for key, t in LISTS.items():
        raw = field(key)
        if raw is None:
            out[key] = []
        elif isinstance(raw, dict):
            out[key] = [_decode(x, ptr(t)) for x in raw.values()]
        else:
            out[key] = _decode(raw, slice_(ptr(t)))
    return out
