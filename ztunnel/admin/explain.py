"""Turn an explain query into an authorization :class:`~ztunnel.state.authz.Explanation`.

Shared by the admin endpoint ``GET /debug/authz`` and the ``ztunnel explain`` command. The query
is a flat string mapping (the URL query or the command's options):

* ``dst`` (required): the destination workload, as its uid (``cluster1//v1/Pod/ns/name``), its
  ``namespace/name``, or one of its IPs (looked up on ``network``; that IP is then the
  destination IP);
* ``port`` (required): the destination port *after* target-port resolution, i.e. the port the
  workload's app listens on (what the proxy checks);
* ``src`` (optional): a SPIFFE id (``spiffe://td/ns/x/sa/y``, an mTLS client with that
  identity), an IP (a plaintext client: no identity), or a workload uid or ``namespace/name``
  (an mTLS client with that workload's identity and first IP); absent: plaintext from an
  unknown IP;
* ``src_ip`` (optional): the client IP, overriding the one implied by ``src`` (it matters for
  ``sourceIps`` rules);
* ``network`` (optional): the network for IP lookups (default: the proxy's own network).

Bad input raises ``ValueError`` (HTTP 400); an unknown workload raises :class:`UnknownWorkload`,
a ``LookupError`` (HTTP 404). The decision is computed exactly as the proxy computes it (the
same :class:`~ztunnel.state.authz.PolicyIndex` when one is given).
"""

from __future__ import annotations

from collections.abc import Mapping

from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.core.identity import SPIFFE_PREFIX, Identity
from ztunnel.state.authz import Explanation, PolicyIndex, explain
from ztunnel.state.model import NetworkAddress, Workload
from ztunnel.state.store import State

__all__ = ["QUERY_KEYS", "UnknownWorkload", "explain_query", "find_workload"]

QUERY_KEYS = ("src", "dst", "port", "src_ip", "network")


class UnknownWorkload(LookupError):
    """No workload answers to the name or IP given."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown workload"


def _ip_or_none(text: str) -> IPAddr | None:
    try:
        return parse_ip(text)
    except ValueError:
        return None


def find_workload(state: State, text: str, network: str = "") -> tuple[Workload, IPAddr | None]:
    """The workload ``text`` names (uid, IP on ``network``, or ``namespace/name``) and, when it
    was named by IP, that IP. Raises :class:`UnknownWorkload`."""
    w = state.find_workload_by_uid(text)
    if w is not None:
        return w, None
    ip = _ip_or_none(text)
    if ip is not None:
        w = state.find_workload_by_addr(NetworkAddress(network, ip))
        if w is None:
            raise UnknownWorkload(f"no workload with IP {ip} on network {network!r}")
        return w, ip
    ns, sep, name = text.partition("/")
    if sep and ns and name and "/" not in name:
        found = sorted(
            (w for w in state.workloads() if w.namespace == ns and w.name == name),
            key=lambda w: w.uid,
        )
        if found:
            return found[0], None
    raise UnknownWorkload(f"no workload {text!r} (want a uid, namespace/name or IP)")


def _port(text: str | None) -> int:
    if text is None or not text.strip():
        raise ValueError("port is required")
    try:
        port = int(text.strip())
    except ValueError:
        raise ValueError(f"invalid port {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def explain_query(
    state: State,
    params: Mapping[str, str],
    *,
    policies: PolicyIndex | None = None,
    network: str = "",
) -> Explanation:
    """Explain the decision for the connection ``params`` describes (see the module docstring)."""
    unknown = sorted(set(params) - set(QUERY_KEYS))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)}; known: {', '.join(QUERY_KEYS)}"
        )
    net = params.get("network", network)
    dst_text = (params.get("dst") or "").strip()
    if not dst_text:
        raise ValueError("dst is required (a workload uid, namespace/name or IP)")
    port = _port(params.get("port"))
    dst, dst_ip = find_workload(state, dst_text, net)

    src_text = (params.get("src") or "").strip()
    src: Identity | IPAddr | Workload | None = None
    if src_text.startswith(SPIFFE_PREFIX):
        src = Identity.parse(src_text)  # ValueError for a malformed id
    elif src_text:
        ip = _ip_or_none(src_text)
        src = ip if ip is not None else find_workload(state, src_text, net)[0]
    src_ip: IPAddr | None = None
    if raw := (params.get("src_ip") or "").strip():
        src_ip = parse_ip(raw)
    return explain(
        policies if policies is not None else state,
        src,
        dst,
        port,
        src_ip=src_ip,
        dst_ip=dst_ip,
    )
