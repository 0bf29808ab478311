"""Socket options ztunnel needs: SO_ORIGINAL_DST recovery, SO_MARK, transparent binds, keepalive.

All functions work on plain ``socket.socket`` objects and raise OSError as the kernel does.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from ztunnel.core.addr import IPAddr, SocketAddr, canonical_ip, parse_ip

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
        return _original_dst_v4(sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, 16))
    except OSError:
        pass
    try:
        return _original_dst_v6(sock.getsockopt(SOL_IPV6, SO_ORIGINAL_DST, 28))
    except OSError:
        pass
    return _from_sockaddr(sock.getsockname())


# Per-connection parsing memoised: a proxy sees the same few destinations and client IPs over and
# over, and building an ipaddress object (from text, with the IPv4 attempt failing first for the
# ``::ffff:a.b.c.d`` form a dual-stack listener reports) was a few microseconds per connection.
# The values are immutable; the caches are bounded.
@functools.lru_cache(maxsize=1024)
def _original_dst_v4(raw: bytes) -> SocketAddr:
    port, packed = struct.unpack_from("!2xH4s", raw)
    return SocketAddr(ipaddress.IPv4Address(packed), port)


@functools.lru_cache(maxsize=1024)
def _original_dst_v6(raw: bytes) -> SocketAddr:
    port, packed = struct.unpack_from("!2xH4x16s", raw)
    return SocketAddr(canonical_ip(ipaddress.IPv6Address(packed)), port)


@functools.lru_cache(maxsize=4096)
def _parse_host(host: str) -> IPAddr:
    return parse_ip(host.split("%", 1)[0])


def _from_sockaddr(sa: tuple[object, ...]) -> SocketAddr:
    """``SocketAddr.from_sockaddr`` with the IP parsing memoised."""
    host, port = sa[0], sa[1]
    assert isinstance(host, str) and isinstance(port, int)
    return SocketAddr(_parse_host(host), port)


def set_mark(sock: socket.socket, mark: int | None) -> None:
    if mark:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)


def set_transparent(sock: socket.socket, family: int) -> None:
    """Allow binding a foreign address (spoofing the client's IP on the way to the app).

    A connecting socket is then bound to ``(ip, 0)`` and the kernel picks its port at bind time,
    as Rust's ``freebind_connect`` does (no IP_BIND_ADDRESS_NO_PORT): bind(0) takes odd ports
    first and connect() even ones, so our spoofed tuple never equals a live connection of a
    client (which connect()s) to the same app port. A port picked at connect() would be even
    like the client's, and a clash is two connections in one conntrack entry: the client's SYN
    is delivered to the app's established socket instead of 15006 (it hangs in SYN-SENT), or
    ours is redirected to 15006 (see tests/netns/test_inpod.py)."""
    if family == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        sock.setsockopt(SOL_IPV6, IPV6_FREEBIND, 1)
    else:
        sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        sock.setsockopt(SOL_IP, IP_FREEBIND, 1)


SockOpt = tuple[int, int, int]  # (level, option, value) for setsockopt


@dataclass(frozen=True, slots=True)
class SocketConfig:
    """TCP keepalive and user timeout (Rust ``config::SocketConfig``, the same defaults): set on
    every stream socket ztunnel dials and, through its listening socket, on every connection
    accepted on 15001 and 15006 (Rust ``socket::Listener::accept``)."""

    keepalive_enabled: bool = True
    keepalive_time: timedelta = timedelta(seconds=180)
    keepalive_interval: timedelta = timedelta(seconds=180)
    keepalive_retries: int = 9
    user_timeout_enabled: bool = False

    def options(self) -> tuple[SockOpt, ...]:
        """What Rust's ``DefaultSocketFactory::setup_socket`` sets, in order: keepalive when
        enabled, and ``TCP_USER_TIMEOUT`` = time + retries x interval when enabled (with or
        without keepalive)."""
        opts: list[SockOpt] = []
        if self.keepalive_enabled:
            opts += [
                (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _seconds(self.keepalive_time)),
                (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _seconds(self.keepalive_interval)),
                (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.keepalive_retries),
            ]
        if self.user_timeout_enabled:
            timeout = self.keepalive_time + self.keepalive_interval * self.keepalive_retries
            opts.append((socket.IPPROTO_TCP, TCP_USER_TIMEOUT, int(timeout.total_seconds() * 1000)))
        return tuple(opts)


def _seconds(d: timedelta) -> int:
    return max(1, int(d.total_seconds()))


def peer_addr(sock: socket.socket, accepted: tuple[object, ...] | None = None) -> SocketAddr:
    """The peer's address: ``accepted`` (what accept() returned, saving a ``getpeername``) when
    given."""
    return _from_sockaddr(sock.getpeername() if accepted is None else accepted)


def local_addr(sock: socket.socket) -> SocketAddr:
    return _from_sockaddr(sock.getsockname())


def bind_listener(
    addr: tuple[str, int],
    *,
    family: int | None = None,
    reuse_port: bool = False,
    transparent: bool = False,
    backlog: int = 128,
    options: Iterable[SockOpt] = (),
) -> socket.socket:
    """A non-blocking listening TCP socket. ``[::]`` is dual-stack; any other IPv6 address is
    IPv6 only. ``family`` defaults to the address's. ``options`` are set before ``bind``: Linux
    copies SO_MARK, TCP_NODELAY, SO_KEEPALIVE, TCP_KEEP* and TCP_USER_TIMEOUT from a listening
    socket to each connection it accepts, so they cost no syscall per connection."""
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
        for level, name, value in options:
            sock.setsockopt(level, name, value)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
