"""The inbound HBONE decision, with no sockets: the cases of Rust's ``test_find_inbound_upstream``
and ``test_build_inbound_request`` (``src/proxy/inbound.rs``), plus the PROXY v2 header of
``write_proxy_protocol`` (``src/proxy.rs``) decoded by hand from the spec."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from ztunnel.config import ILLEGAL_PORTS
from ztunnel.core.addr import HostnameAuthority, SocketAddr, parse_ip
from ztunnel.core.identity import Identity
from ztunnel.proxy.inbound_route import (
    PROXY_V2_SIGNATURE,
    InboundSelfCall,
    IPMismatch,
    NoUpstream,
    TunnelRequest,
    find_inbound_upstream,
    localhost_tunnel,
    parse_hbone_address,
    proxy_v2_header,
    validate_destination,
)
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import AppTunnelProtocol, NetworkAddress
from ztunnel.state.store import State

# The constants of Rust's inbound.rs tests.
CLIENT_POD_IP = "10.0.0.1"
SERVER_POD_IP = "10.0.0.2"
SERVER_SVC_IP = "10.10.0.1"
SERVER_POD_HOSTNAME = "server.default.svc.cluster.local"
WAYPOINT_POD_IP = "10.0.0.3"
WAYPOINT_SVC_IP = "10.10.0.2"
SERVER_PORT = 80
TARGET_PORT = 8080
PROXY_PORT = 15088
APP_TUNNEL_PROXY = f"{{protocol: PROXY, port: {PROXY_PORT}}}"


def rust_test_state(waypoint: tuple[str, str] | None, app_tunnel: str | None = None) -> State:
    """Rust ``test_state``: services waypoint and server (80 -> 8080, one endpoint each),
    workloads waypoint, client and server. ``waypoint`` is ("service" | "workload", IP): the
    server's service or workload is attached to the waypoint at that IP; ``app_tunnel`` goes on
    the waypoint workload."""

    def wl(name: str, ip: str, extra: str = "") -> str:
        return (
            f"- uid: cluster1//v1/Pod/default/{name}\n  name: workload-{name}\n"
            f"  namespace: default\n  serviceAccount: service-account-{name}\n"
            f'  workloadIps: ["{ip}"]\n  protocol: HBONE\n{extra}'
        )

    def attach(kind: str) -> str:
        if waypoint is None or waypoint[0] != kind:
            return ""
        return f'  waypoint: {{destination: "/{waypoint[1]}", hboneMtlsPort: 15008}}\n'

    def svc(name: str, vip: str, extra: str = "") -> str:
        return (
            f"- name: {name}\n  namespace: default\n"
            f"  hostname: {name}.default.svc.cluster.local\n"
            f'  vips: ["/{vip}"]\n  ports: {{80: 8080}}\n  canonical: true\n{extra}'
        )

    tunnel = f"  applicationTunnel: {app_tunnel}\n" if app_tunnel else ""
    config = (
        "workloads:\n"
        + wl(
            "waypoint",
            WAYPOINT_POD_IP,
            tunnel + '  services:\n    "default/waypoint.default.svc.cluster.local": {}\n',
        )
        + wl("client", CLIENT_POD_IP)
        + wl(
            "server",
            SERVER_POD_IP,
            attach("workload")
            + '  services:\n    "default/server.default.svc.cluster.local": {}\n',
        )
        + "services:\n"
        + svc("waypoint", WAYPOINT_SVC_IP)
        + svc("server", SERVER_SVC_IP, attach("service"))
    )
    s = State()
    load_local_config(config).apply_to(s)
    return s


def decide(state: State, conn_dst: str, authority: str) -> tuple[str, str | None]:
    arrival = parse_ip(conn_dst)
    local = state.find_workload_by_addr(NetworkAddress("", arrival))
    assert local is not None
    target = parse_hbone_address(authority)
    validate_destination(state, "", arrival, local, target)
    out = find_inbound_upstream(state, "", arrival, local, target, ILLEGAL_PORTS)
    return str(out.upstream), str(out.tunnel.target) if out.tunnel else None


@pytest.mark.parametrize(
    ("waypoint", "tunnel", "conn_dst", "authority", "want"),
    [
        # "to workload no waypoint"
        (None, None, SERVER_POD_IP, f"{SERVER_POD_IP}:{TARGET_PORT}", (SERVER_POD_IP, 8080, None)),
        # "svc hostname to workload no waypoint"
        (None, None, SERVER_POD_IP, f"{SERVER_POD_HOSTNAME}:80", (SERVER_POD_IP, 8080, None)),
        # "to workload with waypoint referenced by pod"
        (
            ("workload", WAYPOINT_POD_IP),
            None,
            WAYPOINT_POD_IP,
            f"{SERVER_POD_IP}:8080",
            (WAYPOINT_POD_IP, 8080, None),
        ),
        # "to workload with waypoint referenced by vip"
        (
            ("workload", WAYPOINT_SVC_IP),
            None,
            WAYPOINT_POD_IP,
            f"{SERVER_POD_IP}:8080",
            (WAYPOINT_POD_IP, 8080, None),
        ),
        # "to workload with app tunnel"
        (
            ("workload", WAYPOINT_SVC_IP),
            APP_TUNNEL_PROXY,
            WAYPOINT_POD_IP,
            f"{SERVER_POD_IP}:8080",
            (WAYPOINT_POD_IP, PROXY_PORT, SERVER_POD_IP),
        ),
        # "to service with waypoint referenced by pod"
        (
            ("service", WAYPOINT_POD_IP),
            None,
            WAYPOINT_POD_IP,
            f"{SERVER_SVC_IP}:8080",
            (WAYPOINT_POD_IP, 8080, None),
        ),
        # "to service with waypint referenced by vip"
        (
            ("service", WAYPOINT_SVC_IP),
            None,
            WAYPOINT_POD_IP,
            f"{SERVER_SVC_IP}:8080",
            (WAYPOINT_POD_IP, 8080, None),
        ),
        # "to service with app tunnel"
        (
            ("service", WAYPOINT_SVC_IP),
            APP_TUNNEL_PROXY,
            WAYPOINT_POD_IP,
            f"{SERVER_SVC_IP}:8080",
            (WAYPOINT_POD_IP, PROXY_PORT, SERVER_SVC_IP),
        ),
    ],
)
def test_build_inbound_request(
    waypoint: tuple[str, str] | None,
    tunnel: str | None,
    conn_dst: str,
    authority: str,
    want: tuple[str, int, str | None],
) -> None:
    """Rust test_build_inbound_request / test_find_inbound_upstream, accepted cases."""
    state = rust_test_state(waypoint, tunnel)
    upstream, tunnel_target = decide(state, conn_dst, authority)
    ip, port, proxied = want
    assert upstream == f"{ip}:{port}"
    port_in_authority = authority.rsplit(":", 1)[1]
    assert tunnel_target == (f"{proxied}:{port_in_authority}" if proxied else None)


@pytest.mark.parametrize(
    ("waypoint", "conn_dst", "authority"),
    [
        (None, SERVER_POD_IP, f"{CLIENT_POD_IP}:8080"),  # "to server ip mismatch"
        (None, WAYPOINT_POD_IP, f"{CLIENT_POD_IP}:8080"),  # "to waypoint without attachment"
        # "to workload via waypoint with wrong attachment"
        (("service", WAYPOINT_POD_IP), WAYPOINT_POD_IP, f"{SERVER_POD_IP}:8080"),
        # "to service via waypoint with wrong attachment"
        (("workload", WAYPOINT_POD_IP), WAYPOINT_POD_IP, f"{SERVER_SVC_IP}:8080"),
    ],
)
def test_ip_mismatch(waypoint: tuple[str, str] | None, conn_dst: str, authority: str) -> None:
    """Rust validate_destination: Error::IPMismatch, answered 400."""
    state = rust_test_state(waypoint)
    with pytest.raises(IPMismatch) as e:
        decide(state, conn_dst, authority)
    assert e.value.status == 400
    assert str(e.value) == f"ip mismatch: {conn_dst} != {authority.rsplit(':', 1)[0]}"


def test_ipv6_authority_on_an_ipv4_connection_is_a_mismatch() -> None:
    """The audit hole of issue 17: an IPv6 authority on a connection that arrived at an IPv4
    address of a workload that has both is still not the connection's IP (Rust compares the
    authority IP with the connection's destination only)."""
    state = State()
    load_local_config(
        "workloads:\n- uid: u\n  name: w\n  namespace: default\n"
        '  workloadIps: ["10.0.0.2", "fd00::2"]\n  protocol: HBONE\n'
    ).apply_to(state)
    local = state.find_workload_by_uid("u")
    assert local is not None
    with pytest.raises(IPMismatch):
        validate_destination(
            state, "", parse_ip("10.0.0.2"), local, parse_hbone_address("[fd00::2]:80")
        )


def test_app_tunnel_accepts_any_authority_ip() -> None:
    """Rust validate_destination: a workload with its own tunnel gets the target in the PROXY
    header and decides itself."""
    state = rust_test_state(None, APP_TUNNEL_PROXY)
    assert decide(state, WAYPOINT_POD_IP, f"{CLIENT_POD_IP}:9") == (
        f"{WAYPOINT_POD_IP}:{PROXY_PORT}",
        f"{CLIENT_POD_IP}:9",
    )


def test_hostname_authority_with_app_tunnel_sends_a_vip() -> None:
    """Rust find_inbound_upstream: PROXY cannot carry a hostname, so the service's VIP stands
    in, with the service port."""
    state = rust_test_state(None, APP_TUNNEL_PROXY)
    upstream, target = decide(state, WAYPOINT_POD_IP, "waypoint.default.svc.cluster.local:80")
    assert (upstream, target) == (f"{WAYPOINT_POD_IP}:{PROXY_PORT}", f"{WAYPOINT_SVC_IP}:80")


def test_unknown_hostname_is_503() -> None:
    state = rust_test_state(None)
    with pytest.raises(NoUpstream, match="no service or workload for hostname") as e:
        decide(state, SERVER_POD_IP, "nope.default.svc.cluster.local:80")
    assert e.value.status == 503


def test_hostname_port_not_exposed_is_503() -> None:
    """Rust NoPortForServices: the service has no such port and the endpoint no mapping."""
    state = rust_test_state(None)
    with pytest.raises(NoUpstream, match="cannot resolve port"):
        decide(state, SERVER_POD_IP, f"{SERVER_POD_HOSTNAME}:81")


@pytest.mark.parametrize("port", sorted(ILLEGAL_PORTS))
def test_self_call_is_503(port: int) -> None:
    """Rust find_inbound_upstream: a final port in illegal_ports is SelfCall (503), checked after
    the hostname's port mapping."""
    state = rust_test_state(None)
    with pytest.raises(InboundSelfCall) as e:
        decide(state, SERVER_POD_IP, f"{SERVER_POD_IP}:{port}")
    assert e.value.status == 503


@pytest.mark.parametrize(
    ("authority", "want"),
    [
        ("10.0.0.2:80", SocketAddr.parse("10.0.0.2:80")),
        ("[fd00::2]:80", SocketAddr.parse("[fd00::2]:80")),
        ("svc.ns.svc.cluster.local:80", HostnameAuthority("svc.ns.svc.cluster.local", 80)),
        ("SVC.NS.svc.cluster.local:8080", HostnameAuthority("svc.ns.svc.cluster.local", 8080)),
        ("10.0.0.256:80", HostnameAuthority("10.0.0.256", 80)),  # http::Uri: a reg-name
    ],
)
def test_parse_hbone_address(authority: str, want: object) -> None:
    assert parse_hbone_address(authority) == want


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "svc",
        "svc:",
        ":80",
        "svc:65536",
        "svc:-1",
        "svc:8o",
        "fd00::2:80",  # IPv6 needs brackets
        "a b:80",
        "svc/x:80",
        "[fd00::2]",
    ],
)
def test_parse_hbone_address_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_hbone_address(bad)


def test_localhost_tunnel() -> None:
    """Rust serve_connect + supports_localhost_send: only PROXY tunnels go to loopback."""
    t = SocketAddr.parse("10.0.0.2:80")
    assert localhost_tunnel(TunnelRequest(AppTunnelProtocol.PROXY, t), True)
    assert not localhost_tunnel(TunnelRequest(AppTunnelProtocol.PROXY, t), False)
    assert not localhost_tunnel(TunnelRequest(AppTunnelProtocol.NONE, t), True)
    assert not localhost_tunnel(None, True)


def _decode_proxy_v2(data: bytes) -> tuple[int, int, bytes, dict[int, bytes]]:
    """A PROXY v2 decoder written from the spec (section 2.2), independent of the encoder."""
    assert data[:12] == PROXY_V2_SIGNATURE
    ver_cmd, fam, length = struct.unpack("!BBH", data[12:16])
    body = data[16 : 16 + length]
    assert len(body) == length and len(data) == 16 + length
    alen = {0x11: 12, 0x21: 36}[fam]
    addrs, rest = body[:alen], body[alen:]
    tlvs: dict[int, bytes] = {}
    while rest:
        t, n = struct.unpack("!BH", rest[:3])
        tlvs[t] = rest[3 : 3 + n]
        rest = rest[3 + n :]
    return ver_cmd, fam, addrs, tlvs


def test_proxy_v2_header_ipv4_with_identity() -> None:
    ident = Identity("cluster.local", "default", "client")
    hdr = proxy_v2_header(
        SocketAddr.parse("10.0.0.1:1234"), SocketAddr.parse("10.10.0.1:80"), ident
    )
    ver_cmd, fam, addrs, tlvs = _decode_proxy_v2(hdr)
    assert (ver_cmd, fam) == (0x21, 0x11)  # v2 PROXY, TCP over IPv4
    src, dst, sport, dport = struct.unpack("!4s4sHH", addrs)
    assert (str(ipaddress.ip_address(src)), str(ipaddress.ip_address(dst))) == (
        "10.0.0.1",
        "10.10.0.1",
    )
    assert (sport, dport) == (1234, 80)
    assert tlvs == {0xD0: b"spiffe://cluster.local/ns/default/sa/client"}


def test_proxy_v2_header_ipv6_and_mixed() -> None:
    hdr = proxy_v2_header(SocketAddr.parse("[fd00::1]:5"), SocketAddr.parse("10.0.0.2:80"), None)
    ver_cmd, fam, addrs, tlvs = _decode_proxy_v2(hdr)
    assert (ver_cmd, fam, tlvs) == (0x21, 0x21, {})
    src, dst, sport, dport = struct.unpack("!16s16sHH", addrs)
    assert ipaddress.ip_address(src) == ipaddress.ip_address("fd00::1")
    assert ipaddress.ip_address(dst) == ipaddress.ip_address("::ffff:10.0.0.2")
    assert (sport, dport) == (5, 80)
