"""SocketFactory.connect: connects without the loop's sock_connect; refusals and timeouts become
UpstreamConnectError with the loops' own error text, and the socket is never left registered."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from ztunnel.core.addr import SocketAddr, parse_ip
from ztunnel.core.errors import UpstreamConnectError
from ztunnel.proxy.sockets import SocketFactory

pytestmark = pytest.mark.timeout(30)


def _addr(sock: socket.socket) -> SocketAddr:
    host, port = sock.getsockname()[:2]
    return SocketAddr(parse_ip(host), port)


@pytest.mark.both_loops
async def test_connect_returns_a_connected_non_blocking_socket() -> None:
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.setblocking(False)
        sock = await SocketFactory(mark=None).connect(_addr(srv))
        try:
            conn, _ = await loop.sock_accept(srv)
            with conn:
                assert sock.getpeername() == srv.getsockname()
                assert sock.getblocking() is False
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                # The fd is no longer registered: registering it again must work.
                fut = loop.create_future()
                loop.add_writer(sock.fileno(), fut.set_result, None)
                await fut
                loop.remove_writer(sock.fileno())
        finally:
            sock.close()


@pytest.mark.both_loops
async def test_a_handshake_done_inside_connect_skips_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Over loopback the SYN-ACK is processed within connect() itself: the second look sees the
    # connection established, so no writer is registered (and no timer armed) for it.
    loop = asyncio.get_running_loop()

    def no_writer(*_a: object) -> None:
        raise AssertionError("the loop was asked to wait for the connect")

    monkeypatch.setattr(loop, "add_writer", no_writer)
    monkeypatch.setattr(loop, "call_later", no_writer)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sock = await SocketFactory(mark=None).connect(_addr(srv))
        with sock:
            conn, _ = srv.accept()
            conn.close()
            assert sock.getpeername() == srv.getsockname()


@pytest.mark.both_loops
async def test_connect_refused_reads_like_the_loops_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        target = _addr(s)  # bound, never listening: the connect is refused
        with pytest.raises(UpstreamConnectError) as info:
            await SocketFactory(mark=None).connect(target)
    assert str(info.value) == (
        f"connection to {target} failed: Connect call failed ('127.0.0.1', {target.port})"
    )


@pytest.mark.both_loops
async def test_connect_times_out_and_can_be_cancelled() -> None:
    # A listener with a full accept queue drops further SYNs: the connect hangs (loopback only).
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
        target = _addr(srv)
        for _ in range(4):
            c = stack.enter_context(socket.socket())
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(target.sockaddr())
        await asyncio.sleep(0.05)
        factory = SocketFactory(mark=None)
        with pytest.raises(UpstreamConnectError, match="timed out"):
            await factory.connect(target, timeout=0.2)
        task = asyncio.ensure_future(factory.connect(target, timeout=10))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_out_of_fds_is_an_upstream_connect_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13 (attack 6): EMFILE creating the upstream socket, or an fd within the reserve,
    is an UpstreamConnectError (503 inbound), never an exception outside the handler's try."""
    import errno
    import resource

    from ztunnel.core.errors import UpstreamConnectError
    from ztunnel.net.fdbudget import FdBudget
    from ztunnel.proxy import sockets as sockets_mod

    factory = SocketFactory(mark=None, budget=FdBudget(reserve=0))

    def emfile(*_a: object, **_k: object) -> socket.socket:
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as m:
        m.setattr(sockets_mod.socket, "socket", emfile)
        with pytest.raises(UpstreamConnectError, match="Too many open files"):
            await factory.connect(SocketAddr.parse("127.0.0.1:1"))
    assert factory.budget.under_pressure
    with monkeypatch.context() as m:
        m.setattr(resource, "getrlimit", lambda _r: (3, 3))
        factory.budget = FdBudget(reserve=0)  # (reads the lowered limit now, not in a second)
        with pytest.raises(UpstreamConnectError, match="budget exhausted"):
            await factory.connect(SocketAddr.parse("127.0.0.1:1"))


@contextlib.contextmanager
def _scratch_netns(port_range: str) -> Iterator[int]:
    """A new network namespace with ``lo`` up and that ephemeral port range; its fd."""
    name = f"zt-unit-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "sysctl",
                "-q",
                f"net.ipv4.ip_local_port_range={port_range}",
            ],
            check=True,
        )
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@pytest.mark.usefixtures("require_root")  # a netns, IP_TRANSPARENT
async def test_no_free_port_for_the_client_ip_connects_from_our_own() -> None:
    """Every port of the client's IP taken: bind(client IP, 0) fails with EADDRINUSE, and the
    connection is made from ztunnel's own address, as Rust's freebind_connect does when its bind
    fails; the next connection spoofs again."""
    with _scratch_netns("40000 40001") as ns:
        factory = SocketFactory(mark=None, netns_fd=ns)
        srv = factory.listener(
            ("127.0.0.1", 7000), family=socket.AF_INET, reuse_port=False, transparent=False
        )
        srv.setblocking(True)
        with srv:
            taken = []  # both ports of the range, from the client's IP
            for _ in range(2):
                s = factory.new_socket(socket.AF_INET)
                s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT
                s.setsockopt(socket.SOL_IP, 24, 1)  # IP_BIND_ADDRESS_NO_PORT: port at connect
                s.bind(("127.0.0.9", 0))
                s.setblocking(True)
                s.connect(("127.0.0.1", 7000))
                taken += [s, srv.accept()[0]]
            sock = await factory.connect(_addr(srv), spoof_source=parse_ip("127.0.0.9"))
            with sock:
                assert sock.getsockname()[0] == "127.0.0.1"
                srv.accept()[0].close()
            for s in taken:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                s.close()
            sock = await factory.connect(_addr(srv), spoof_source=parse_ip("127.0.0.9"))
            with sock:
                assert sock.getsockname()[0] == "127.0.0.9"
                srv.accept()[0].close()
