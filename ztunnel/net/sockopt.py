"""Socket options ztunnel needs: SO_ORIGINAL_DST recovery, SO_MARK, transparent binds, keepalive.

All functions work on plain ``socket.socket`` objects and raise OSError as the kernel does.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from datetime import timedelta

from ztunnel.core.addr import SocketAddr, canonical_ip

SO_ORIGINAL_DST = 80  # SOL_IP; IP6T_SO_ORIGINAL_DST has the same number on SOL_IPV6
SOL_IP = getattr(socket, "SOL_IP", 0)
SOL_IPV6 = getattr(socket, "SOL_IPV6", 41)
IP_TRANSPARENT = 19
IP_FREEBIND = 15
IPV6_TRANSPARENT = 75
IPV6_FREEBIND = 78
SO_MARK = getattr(socket, "SO_MARK", 36)
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def original_dst(sock: socket.socket) -> SocketAddr:
    """The destination before iptables REDIRECT: SOL_IP, then SOL_IPV6, then the local address
    (reference 1.2). Always canonical (IPv4-mapped IPv6 becomes IPv4)."""
    try:
        raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        return SocketAddr(ipaddress.IPv4Address(packed), port)
    except OSError:
        pass
    try:
        raw = sock.getsockopt(SOL_IPV6, SO_ORIGINAL_DST, 28)
        port, packed = struct.unpack_from("!2xH4x16s", raw)
        return SocketAddr(canonical_ip(ipaddress.IPv6Address(packed)), port)
    except OSError:
        pass
    return SocketAddr.from_sockaddr(sock.getsockname())


def set_mark(sock: socket.socket, mark: int | None) -> None:
    if mark:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)


def set_transparent(sock: socket.socket, family: int) -> None:
    """Allow binding a foreign address (spoofing the client's IP on the way to the app)."""
    if family == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        sock.setsockopt(SOL_IPV6, IPV6_FREEBIND, 1)
    else:
        sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        sock.setsockopt(SOL_IP, IP_FREEBIND, 1)


def set_keepalive(
    sock: socket.socket,
    time: timedelta,
    interval: timedelta,
    retries: int,
    user_timeout: bool = False,
) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(time.total_seconds())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(interval.total_seconds())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, retries)
    if user_timeout:
        ms = int((time + interval * retries).total_seconds() * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, ms)


def peer_addr(sock: socket.socket) -> SocketAddr:
    return SocketAddr.from_sockaddr(sock.getpeername())


def local_addr(sock: socket.socket) -> SocketAddr:
    return SocketAddr.from_sockaddr(sock.getsockname())


def bind_listener(
    addr: tuple[str, int],
    *,
    family: int | None = None,
    reuse_port: bool = False,
    transparent: bool = False,
    backlog: int = 128,
) -> socket.socket:
    """A non-blocking listening TCP socket. ``[::]`` is dual-stack; any other IPv6 address is
    IPv6 only. ``family`` defaults to the address's."""
    if family is None:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if addr[0] == "::" else 1)
        if transparent:
            set_transparent(sock, family)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
