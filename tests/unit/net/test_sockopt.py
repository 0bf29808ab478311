"""sockopt: addresses read off sockets are canonical (memoised parsing changes nothing), and the
keepalive options are the ones the Rust ztunnel sets."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace
from datetime import timedelta

import pytest

from ztunnel.core.addr import SocketAddr
from ztunnel.net import sockopt
from ztunnel.proxy.sockets import SocketFactory


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_peer_and_local_addr(host: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as srv:
        for _ in range(2):  # the second time from the cache: same values
            with socket.create_connection(srv.getsockname()[:2]) as c:
                conn, _ = srv.accept()
                with conn:
                    assert sockopt.peer_addr(conn) == SocketAddr.parse(
                        f"[{host}]:{c.getsockname()[1]}"
                        if ":" in host
                        else f"{host}:{c.getsockname()[1]}"
                    )
                    assert sockopt.local_addr(conn) == sockopt.peer_addr(c)
                    # No REDIRECT here: the original destination is the local address.
                    assert sockopt.original_dst(conn) == sockopt.local_addr(conn)


def test_v4_mapped_peer_is_ipv4() -> None:
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as srv:
        c = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
        conn, _ = srv.accept()
        with c, conn:
            assert conn.getpeername()[0] == "::ffff:127.0.0.1"
            peer = sockopt.peer_addr(conn)
            assert peer == SocketAddr(ipaddress.IPv4Address("127.0.0.1"), c.getsockname()[1])
            assert str(peer) == f"127.0.0.1:{c.getsockname()[1]}"


def test_socket_config_options_are_rusts() -> None:
    """Rust DefaultSocketFactory::setup_socket: keepalive when enabled; TCP_USER_TIMEOUT =
    time + retries x interval when enabled, with or without keepalive."""
    t, i = timedelta(seconds=180), timedelta(seconds=170)
    keepalive = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 180),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 170),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 9),
    ]
    user_timeout = (socket.IPPROTO_TCP, sockopt.TCP_USER_TIMEOUT, (180 + 170 * 9) * 1000)
    cfg = sockopt.SocketConfig(True, t, i, 9, False)
    assert cfg.options() == tuple(keepalive)
    assert replace(cfg, user_timeout_enabled=True).options() == (*keepalive, user_timeout)
    assert replace(cfg, keepalive_enabled=False, user_timeout_enabled=True).options() == (
        user_timeout,
    )
    assert replace(cfg, keepalive_enabled=False).options() == ()


def test_dialled_sockets_get_the_socket_config() -> None:
    cfg = sockopt.SocketConfig(user_timeout_enabled=True)
    with SocketFactory(mark=None, socket_config=cfg).new_socket(socket.AF_INET) as sock:
        assert not sock.getblocking()
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        for level, name, value in cfg.options():
            assert sock.getsockopt(level, name) == value
    with SocketFactory(mark=None).new_socket(socket.AF_INET6) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)


@pytest.mark.parametrize("keepalive", [True, False])
@pytest.mark.parametrize("host", ["127.0.0.1", "::"])
def test_accepted_connections_inherit_the_listeners_options(keepalive: bool, host: str) -> None:
    """The options are set once on the listening socket (not per connection) and Linux gives
    them to each accepted connection: TCP_NODELAY, and with ``keepalive`` the socket config
    (Rust socket::Listener::accept sets the same on 15001 and 15006)."""
    cfg = sockopt.SocketConfig(user_timeout_enabled=True)
    factory = SocketFactory(mark=None, socket_config=cfg)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with factory.listener(
        (host, 0), family=family, reuse_port=False, transparent=False, keepalive=keepalive
    ) as lst:
        with socket.create_connection(("127.0.0.1", lst.getsockname()[1])):
            lst.setblocking(True)
            conn, _ = lst.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            if keepalive:
                for level, name, value in cfg.options():
                    assert conn.getsockopt(level, name) == value, name
            else:
                assert not conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                assert not conn.getsockopt(socket.IPPROTO_TCP, sockopt.TCP_USER_TIMEOUT)


@pytest.mark.usefixtures("require_root")  # IP_TRANSPARENT needs CAP_NET_ADMIN
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_transparent_socket_gets_its_port_at_bind(family: socket.AddressFamily) -> None:
    """As Rust's freebind_connect binds (no IP_BIND_ADDRESS_NO_PORT): the port is picked by
    bind(ip, 0), odd first, never the even ones a client's connect() takes first (a shared
    port is a conntrack clash, tests/netns/test_inpod.py)."""
    for _ in range(20):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            sockopt.set_transparent(s, family)
            s.bind(("127.0.0.1" if family == socket.AF_INET else "::1", 0))
            port = s.getsockname()[1]
            assert port % 2 == 1, port
