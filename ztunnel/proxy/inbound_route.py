"""The inbound HBONE decision: from a CONNECT's authority and the local workload to the address
to dial and the application tunnel to speak. Pure: no sockets; ``proxy/inbound.py`` executes it.

Follows istio/ztunnel ``src/proxy/inbound.rs`` (``build_inbound_request``,
``validate_destination``, ``find_inbound_upstream``) and ``src/proxy.rs`` (``HboneAddress``,
``write_proxy_protocol``):

* the authority is a socket address, or a service hostname and port;
* an authority IP other than the connection's own is accepted only when the local workload has
  an application tunnel, or when the target's waypoint is this workload (a waypoint sandwich);
  anything else is an IP mismatch (400);
* the dial always goes to the connection's destination IP; a hostname authority picks the port
  from the local endpoint's mapping, else the service's target port;
* a final port that is one of ztunnel's own is a self-call (503);
* an application tunnel replaces the port and, with PROXY, puts the original client, the HBONE
  target and the peer's identity in a PROXY protocol v2 header.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Collection
from dataclasses import dataclass

from ztunnel.core.addr import HostnameAuthority, IPAddr, SocketAddr
from ztunnel.core.errors import ProxyError
from ztunnel.core.identity import Identity
from ztunnel.state.model import AppTunnelProtocol, NetworkAddress, Service, Workload
from ztunnel.state.store import State


class IPMismatch(ProxyError):
    """Rust ``Error::IPMismatch``: the authority names an IP this workload does not serve."""

    status = 400

    def __init__(self, arrival: IPAddr, target: IPAddr) -> None:
        super().__init__(f"ip mismatch: {arrival} != {target}")


class InboundSelfCall(ProxyError):
    """Rust ``Error::SelfCall`` from ``find_inbound_upstream``: answered 503."""

    status = 503

    def __init__(self) -> None:
        super().__init__("attempted recursive call to ourselves")


class NoUpstream(ProxyError):
    """Rust ``NoHostname`` / ``NoPortForServices`` / ``NoIPForService``: answered 503."""

    status = 503


HboneAddress = SocketAddr | HostnameAuthority

# A registered name as an authority may spell it (RFC 3986 reg-name, without percent-encoding).
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})")


@functools.lru_cache(maxsize=1024)
def parse_hbone_address(authority: str) -> HboneAddress:
    """Rust ``TryFrom<&Uri> for HboneAddress``: a socket address, else ``host:port`` with a
    hostname. Raises ValueError for anything else (answered 400).

    Memoised (both results are frozen; errors are not cached): a client sends the same few
    authorities on stream after stream, and parsing an IP with ``ipaddress`` is microseconds."""
    try:
        return SocketAddr.parse(authority)
    except ValueError:
        pass
    host, sep, port = authority.rpartition(":")
    if not sep or not _HOSTNAME.fullmatch(host) or not port.isdigit() or len(port) > 5:
        raise ValueError(f"no valid authority pseudo header: {authority}")
    n = int(port)
    if n > 0xFFFF:
        raise ValueError(f"no valid authority pseudo header: {authority}")
    # As for http::Uri, a dotted quad that is no IPv4 address (10.0.0.256) is a reg-name: it
    # becomes a hostname that no service has (503), not a malformed authority.
    return HostnameAuthority(host.lower(), n)


@dataclass(frozen=True, slots=True)
class TunnelRequest:
    """Rust ``TunnelRequest``: what the application tunnel carries."""

    protocol: AppTunnelProtocol
    target: SocketAddr  # the HBONE target as the PROXY header states it


@dataclass(frozen=True, slots=True)
class InboundTarget:
    """Where an admitted CONNECT goes."""

    upstream: SocketAddr  # dialled (its IP is the connection's destination IP)
    tunnel: TunnelRequest | None
    services: tuple[Service, ...]  # candidates for the destination service (metrics)


def validate_destination(
    state: State, network: str, arrival: IPAddr, local: Workload, target: HboneAddress
) -> None:
    """Rust ``validate_destination``; raises :class:`IPMismatch`."""
    if isinstance(target, HostnameAuthority):
        return  # resolved (or refused) by find_inbound_upstream
    if target.ip == arrival or local.application_tunnel is not None:
        return
    found = state.find_address(NetworkAddress(network, target.ip))
    gw = found.waypoint if found is not None else None
    if gw is not None:
        wp = state.find_gateway(gw)
        if isinstance(wp, Service) and any(w.uid == local.uid for w in state.endpoints(wp)):
            return
        if isinstance(wp, Workload) and arrival in wp.addresses:
            return
    raise IPMismatch(arrival, target.ip)


def find_inbound_upstream(
    state: State,
    network: str,
    arrival: IPAddr,
    local: Workload,
    target: HboneAddress,
    illegal_ports: Collection[int],
) -> InboundTarget:
    """Rust ``find_inbound_upstream``; raises :class:`NoUpstream` or :class:`InboundSelfCall`."""
    if isinstance(target, HostnameAuthority):
        svc = state.find_service_by_hostname(target.hostname, local.namespace)
        if svc is None:
            raise NoUpstream(f"no service or workload for hostname: {target.hostname}")
        port = local.services.get(svc.key, {}).get(target.port)
        if port is None:
            port = next((p.target_port for p in svc.ports if p.service_port == target.port), 0)
            if port == 0:
                raise NoUpstream(
                    f"requested service {target.hostname}:{target.port} found, but cannot "
                    "resolve port"
                )
        dest = SocketAddr(arrival, port)
        services: tuple[Service, ...] = (svc,)
    else:
        dest = SocketAddr(arrival, target.port)
        services = tuple(state.services_for(local))
    if dest.port in illegal_ports:
        raise InboundSelfCall()
    tunnel = local.application_tunnel
    if tunnel is None:
        return InboundTarget(dest, None, services)
    upstream = SocketAddr(arrival, tunnel.port if tunnel.port is not None else dest.port)
    if isinstance(target, HostnameAuthority):
        # PROXY cannot carry a hostname: a VIP of the service stands for it, one on our
        # network first, IPv4 first.
        vips = sorted(
            services[0].vips,
            key=lambda v: (v.network == network) * (2 if v.address.version == 4 else 1),
            reverse=True,
        )
        if not vips:
            raise NoUpstream(f"requested service {target.hostname} found, but has no IP addresses")
        tunnel_target = SocketAddr(vips[0].address, target.port)
    else:
        tunnel_target = target
    return InboundTarget(upstream, TunnelRequest(tunnel.protocol, tunnel_target), services)


def localhost_tunnel(tunnel: TunnelRequest | None, localhost_app_tunnel: bool) -> bool:
    """Rust ``serve_connect``: with ``LOCALHOST_APP_TUNNEL`` a PROXY tunnel goes to loopback
    (bound to loopback too; the original source is in the PROXY header). Protocol NONE never
    does (``supports_localhost_send``)."""
    return (
        localhost_app_tunnel and tunnel is not None and tunnel.protocol is AppTunnelProtocol.PROXY
    )


# --- PROXY protocol v2 (https://www.haproxy.org/download/1.8/doc/proxy-protocol.txt) ---------

PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
PROXY_AUTHORITY_TLV = 0xD0  # Rust PROXY_PROTOCOL_AUTHORITY_TLV: the peer's SPIFFE identity


def proxy_v2_header(src: SocketAddr, dst: SocketAddr, identity: Identity | None) -> bytes:
    """Rust ``write_proxy_protocol``: version 2, command PROXY, protocol STREAM, the two
    addresses, and TLV 0xD0 with the peer identity. Mixed families are sent as IPv6, the IPv4
    one mapped (``::ffff:a.b.c.d``)."""
    if src.ip.version == 4 and dst.ip.version == 4:
        fam = 0x11  # AF_INET, STREAM
        addrs = src.ip.packed + dst.ip.packed + struct.pack("!HH", src.port, dst.port)
    else:
        fam = 0x21  # AF_INET6, STREAM
        addrs = _v6(src.ip) + _v6(dst.ip) + struct.pack("!HH", src.port, dst.port)
    tlvs = b""
    if identity is not None:
        value = str(identity).encode()
        tlvs = struct.pack("!BH", PROXY_AUTHORITY_TLV, len(value)) + value
    body = addrs + tlvs
    return PROXY_V2_SIGNATURE + struct.pack("!BBH", 0x21, fam, len(body)) + body


def _v6(ip: IPAddr) -> bytes:
    return ip.packed if ip.version == 6 else b"\x00" * 10 + b"\xff\xff" + ip.packed
