"""Creating ztunnel's sockets in the right network namespace, marked, and connecting them.

In shared (in-pod) mode every socket for a pod is created inside that pod's netns; the switch
happens synchronously around ``socket()`` (and ``bind()`` for listeners) and never spans an await,
so the event loop thread is always back in ztunnel's own namespace when it yields.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Iterator

from ztunnel.core.addr import IPAddr, SocketAddr
from ztunnel.core.errors import UpstreamConnectError
from ztunnel.logs import RateLimitedLog
from ztunnel.net import sockopt
from ztunnel.net.fdbudget import FdBudget
from ztunnel.net.sockopt import SocketConfig, SockOpt

log = logging.getLogger("ztunnel.proxy")
_bind_log = RateLimitedLog(log)

CONNECT_TIMEOUT = 10.0
_STREAM_NONBLOCK = socket.SOCK_STREAM | socket.SOCK_NONBLOCK

ListenKey = tuple[str, int, tuple[str, int]]  # ("tcp" | "udp", family, (address, port))
_NO_KEEPALIVE = SocketConfig(keepalive_enabled=False)


class SocketFactory:
    """Makes sockets for one proxy: in its netns (``netns_fd``, None = current), with its mark."""

    def __init__(
        self,
        *,
        mark: int | None,
        netns_fd: int | None = None,
        socket_config: SocketConfig = _NO_KEEPALIVE,
        budget: FdBudget | None = None,
        mark_listeners: bool = True,
    ) -> None:
        self.mark = mark
        # Sockets are refused (UpstreamConnectError) a reserve of fds before RLIMIT_NOFILE.
        self.budget = budget if budget is not None else FdBudget()
        self.netns_fd = netns_fd
        self.socket_config = socket_config
        # The option values, computed once rather than from timedeltas on every socket: the
        # mark and TCP_NODELAY on every dialled stream socket, and on listening ones with
        # ``mark_listeners`` (accepted ones inherit them, so istio-cni's rules see the mark on
        # both legs: Rust's in-pod factory marks its listeners, its dedicated MarkSocketFactory
        # only what it dials), keepalive on dialled ones and where asked on listeners.
        marked: tuple[SockOpt, ...] = ((socket.SOL_SOCKET, sockopt.SO_MARK, mark),) if mark else ()
        nodelay: SockOpt = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._base_opts = (*marked, nodelay)
        self._sockopts = (*self._base_opts, *socket_config.options())
        self.mark_listeners = mark_listeners
        listen_base = self._base_opts if mark_listeners else (nodelay,)
        self._listen_opts = listen_base
        self._listen_keepalive_opts = (*listen_base, *socket_config.options())
        self.transparent_ok: bool | None = None  # learnt on first spoofed connect
        # Every listening socket made here, by (kind, family, address); with ``adopt`` set,
        # those sockets are taken instead of new ones being bound (data-plane workers serve the
        # listeners their supervisor bound, see ztunnel/workers).
        self.bound: dict[ListenKey, socket.socket] = {}
        self.adopt: dict[ListenKey, socket.socket] | None = None

    @contextlib.contextmanager
    def _in_ns(self) -> Iterator[None]:
        if self.netns_fd is None:
            yield
            return
        from ztunnel.net.netns import enter_netns

        with enter_netns(self.netns_fd):
            yield

    def new_socket(self, family: int) -> socket.socket:
        """A marked non-blocking stream socket. Raises UpstreamConnectError when the process is
        out of fds or within its reserve (``FdBudget``), OSError for other failures."""
        try:
            # Non-blocking from the start (SOCK_NONBLOCK: no FIONBIO ioctl afterwards).
            if self.netns_fd is None:  # (no generator-based context manager per connection)
                sock = socket.socket(family, _STREAM_NONBLOCK)
            else:
                with self._in_ns():
                    sock = socket.socket(family, _STREAM_NONBLOCK)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self.budget.admit(1 << 62)  # (counts the refusal, starts the pressure window)
                raise UpstreamConnectError(f"cannot create a socket: {e.strerror}") from None
            raise
        if not self.budget.admit(sock.fileno()):
            sock.close()
            raise UpstreamConnectError("file descriptor budget exhausted")
        try:
            setsockopt = sock.setsockopt
            for level, name, value in self._sockopts:
                setsockopt(level, name, value)
        except BaseException:
            sock.close()
            raise
        return sock

    def listener(
        self,
        addr: tuple[str, int],
        *,
        family: int,
        reuse_port: bool,
        transparent: bool,
        keepalive: bool = False,
    ) -> socket.socket:
        """A listening socket in this factory's netns. Its connections inherit the mark and
        TCP_NODELAY and, with ``keepalive``, the keepalive and user timeout of the socket config
        (Rust sets them on connections accepted on 15001 and 15006): set once here, not per
        connection."""
        key: ListenKey = ("tcp", family, addr)
        if self.adopt is not None:
            return self._adopted(key)
        with self._in_ns():
            sock = sockopt.bind_listener(
                addr,
                family=family,
                reuse_port=reuse_port,
                transparent=transparent,
                options=self._listen_keepalive_opts if keepalive else self._listen_opts,
            )
        self.bound[key] = sock
        return sock

    def _adopted(self, key: ListenKey) -> socket.socket:
        assert self.adopt is not None
        sock = self.adopt.pop(key, None)
        if sock is None:
            raise OSError(errno.EADDRNOTAVAIL, f"no listening socket was handed over for {key}")
        self.bound[key] = sock
        return sock

    def datagram(self, family: int) -> socket.socket:
        """A non-blocking UDP socket in this factory's netns, with its mark (the DNS proxy's
        upstream queries)."""
        with self._in_ns():
            sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            if self.mark:
                sock.setsockopt(socket.SOL_SOCKET, sockopt.SO_MARK, self.mark)
        except BaseException:
            sock.close()
            raise
        return sock

    def bind_datagram(
        self, addr: tuple[str, int], *, family: int, reuse_port: bool
    ) -> socket.socket:
        """A bound, non-blocking, marked UDP socket in this factory's netns (the DNS listener)."""
        key: ListenKey = ("udp", family, addr)
        if self.adopt is not None:
            return self._adopted(key)
        with self._in_ns():
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if self.mark and self.mark_listeners:
                    sock.setsockopt(socket.SOL_SOCKET, sockopt.SO_MARK, self.mark)
                sock.bind(addr)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        self.bound[key] = sock
        return sock

    def read_sysctl(self, path: str) -> str | None:
        """A ``/proc/sys/net/...`` value as seen from this factory's netns, or None."""
        try:
            with self._in_ns(), open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    async def connect(
        self,
        target: SocketAddr,
        *,
        spoof_source: IPAddr | None = None,
        timeout: float = CONNECT_TIMEOUT,
    ) -> socket.socket:
        """Connect to ``target``; with ``spoof_source``, bind that IP first (IP_TRANSPARENT) and fall
        back to a normal connect when the kernel refuses. Raises UpstreamConnectError."""
        try:
            sock = self.new_socket(target.family)
        except OSError as e:
            raise UpstreamConnectError(
                f"connection to {target} failed: {e.strerror or e}"
            ) from None
        try:
            if (
                spoof_source is not None
                and spoof_source != target.ip
                and self.transparent_ok is not False
            ):
                self._bind_transparent(sock, spoof_source, target.family)
            await _connect(sock, target.sockaddr(), timeout)
        except TimeoutError:
            sock.close()
            raise UpstreamConnectError(f"connection to {target} timed out") from None
        except OSError as e:
            sock.close()
            raise UpstreamConnectError(
                f"connection to {target} failed: {e.strerror or e}"
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _bind_transparent(self, sock: socket.socket, ip: IPAddr, family: int) -> None:
        if (ip.version == 6) != (family == socket.AF_INET6):
            return  # a v4 client to a v6 app (or back) cannot be spoofed
        try:
            sockopt.set_transparent(sock, family)
            sock.bind((str(ip), 0))  # the port is picked here (see set_transparent)
            self.transparent_ok = True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                # Every port of this client IP is taken (TIME_WAIT from a high connection rate):
                # this connection leaves from our own address, as Rust's freebind_connect does
                # when its bind fails.
                _bind_log.warning(
                    "bind", "cannot bind the client source IP %s (%s); connecting without it", ip, e
                )
                return
            if e.errno not in (errno.EPERM, errno.EACCES, errno.EADDRNOTAVAIL, errno.ENOPROTOOPT):
                raise
            if self.transparent_ok is None:
                log.warning("cannot spoof the client source IP (%s); connecting without it", e)
            self.transparent_ok = False


async def _connect(sock: socket.socket, address: tuple[str, int], timeout: float) -> None:
    """Non-blocking connect of ``sock`` (an IP literal, never a name) within ``timeout`` seconds.

    Not ``loop.sock_connect``: uvloop's resolves every INET address with ``getaddrinfo`` on its
    thread pool, IP literals included (it passes type=0, which misses its static fast path), so
    each upstream connect cost a thread hand-off and an extra loop wakeup; ``asyncio.timeout``
    added a context manager and a rescheduled timer. Errors read as the loops' own
    (``OSError(errno, "Connect call failed (ip, port)")``), so the access log is unchanged.
    """
    try:
        sock.connect(address)
        return
    except (BlockingIOError, InterruptedError):
        pass
    # Over loopback or a veth pair the SYN-ACK is usually processed in the softirq that the
    # connect() itself ran, so the handshake is already done: ask once more (0 when established,
    # EALREADY while still in progress, else the connect's error) before involving the loop,
    # which would cost a future, a timer, a poll handle (uvloop: 4 epoll_ctl and an ioctl) and a
    # loop iteration per connection.
    err = sock.connect_ex(address)
    if err == 0 or err == errno.EISCONN:
        return
    if err not in (errno.EALREADY, errno.EINPROGRESS, errno.EINTR):
        raise OSError(err, f"Connect call failed {address}")
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def on_writable() -> None:
        if fut.done():
            return
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err in (errno.EINPROGRESS, errno.EALREADY):
            return  # spurious wakeup: still connecting
        if err:
            fut.set_exception(OSError(err, f"Connect call failed {address}"))
        else:
            fut.set_result(None)

    def on_timeout() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())

    loop.add_writer(fd, on_writable)
    timer = loop.call_later(timeout, on_timeout)
    try:
        await fut
    finally:
        timer.cancel()
        loop.remove_writer(fd)
