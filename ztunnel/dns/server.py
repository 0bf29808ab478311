"""The DNS proxy's listeners for one workload: UDP and TCP on 15053 (``istio/ztunnel:
src/dns/server.rs`` ``Server``, ``src/dns/handler.rs`` ``Handler``).

One :class:`DnsServer` lives beside each ProxyInstance (in shared mode inside the pod's netns,
created through the instance's socket factory) and shares its lifecycle: bound with its
listeners, started, drained and closed with them. ``localhost:<port>`` binds 127.0.0.1 and
``[::1]`` where IPv6 works on ``lo`` in that netns; a missing ``::1`` only skips it.

Bounds (per server; what a client can make us hold): UDP queries that need a task (forwarding,
waiting for the client's workload) are capped, and a datagram over the cap is dropped; TCP
connections are capped and closed after an idle or read deadline; messages are at most 64 KiB
by construction; every log line a client can trigger is rate limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ztunnel.config import Config, ProxyMode
from ztunnel.core.addr import SocketAddr
from ztunnel.dns import wire
from ztunnel.dns.forwarder import Forwarder, ResolvConfSource
from ztunnel.dns.resolver import Resolver, is_supported_type
from ztunnel.logs import RateLimitedLog
from ztunnel.metrics import Cell, DnsMetrics, HistogramCell, dns_labels
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.model import Workload
from ztunnel.state.store import State

if TYPE_CHECKING:
    from ztunnel.proxy.instance import ProxyInstance

log = logging.getLogger("ztunnel.dns")
# Rust's per-query DNS access log (server.rs access_log: target "dns", debug; RUST_LOG=dns=debug)
dns_log = logging.getLogger("dns")

MAX_UDP_TASKS = 256  # queries in flight that need a task (forwarded, or waiting for the client)
MAX_TCP_CONNECTIONS = 128
TCP_REQUEST_TIMEOUT = 5.0  # server.rs DEFAULT_TCP_REQUEST_TIMEOUT: idle or slow reads close
CLIENT_WAIT = 5.0  # proxy.rs get_workload: wait_for_workload(.., 5 s), then SERVFAIL
_UDP_BATCH = 64
HOT_SIZE = 256  # replies remembered per server by request bytes (see DnsServer._on_udp)
HOT_MAX_REQUEST = 512
_IPV6_LO_DISABLED = "/proc/sys/net/ipv6/conf/lo/disable_ipv6"


def bind_addresses(addr: str, ipv6_localhost: bool) -> list[tuple[str, int]]:
    """``config::Address`` into bind addresses: ``localhost:<port>`` is 127.0.0.1 plus [::1]
    when IPv6 works on lo (``Address::into_iter``, ``maybe_downgrade_ipv6``)."""
    if addr.startswith("localhost:"):
        port = int(addr.split(":", 1)[1])
        out = [("127.0.0.1", port)]
        if ipv6_localhost:
            out.append(("::1", port))
        return out
    sa = SocketAddr.parse(addr)
    return [(str(sa.ip), sa.port)]


class DnsServer:
    def __init__(
        self,
        *,
        config: Config,
        state: State,
        sockets: SocketFactory,
        client: Callable[[], Workload | None],
        resolv: ResolvConfSource,
        metrics: DnsMetrics | None = None,
        name: str = "",
        client_wait: float = CLIENT_WAIT,
    ) -> None:
        self.config = config
        self.state = state
        self.sockets = sockets
        self.client = client
        self.metrics = metrics
        self.name = name
        self.client_wait = client_wait
        self.forwarder = Forwarder(sockets, resolv, name=name)
        dedicated = config.proxy_mode is ProxyMode.DEDICATED
        fwd = self.forwarder
        self.resolver = Resolver(
            state,
            cluster_domain=config.cluster_domain,
            ipv6_enabled=config.ipv6_enabled,
            preferred_namespace=config.prefered_service_namespace or "",
            # SearchDomains::Static in dedicated mode: the client's resolv.conf is ztunnel's.
            search=(lambda _client: fwd.search_domains()) if dedicated else None,
        )
        self.udp: list[socket.socket] = []
        self.tcp: list[Listener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buf = bytearray(65535)
        self._view = memoryview(self._buf)
        self._log = RateLimitedLog(log)
        self._cells: dict[tuple[int, bool, int], _Series] = {}
        self.dropped = 0
        # The hot case: the same query again (a client asking for one service over and over).
        # Our answer from state is a function of the request's bytes after the ID, the state and
        # the client; so for one state generation, request[2:] -> reply[2:] (+ its counter).
        # Only single-address answers (nothing to shuffle), UDP, bounded.
        self._hot: dict[bytes, tuple[bytes, Cell | None]] = {}
        self._hot_gen = -1

    # --- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind UDP and TCP on every address (inside the netns); on failure none stay open."""
        lo6 = self.config.ipv6_enabled and self.sockets.read_sysctl(_IPV6_LO_DISABLED) != "1"
        cfg = self.config
        try:
            for host, port in bind_addresses(cfg.dns_proxy_addr, lo6):
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                try:
                    tcp = self.sockets.listener(
                        (host, port),
                        family=family,
                        reuse_port=cfg.inpod_port_reuse,
                        transparent=False,
                    )
                except OSError as e:
                    if family == socket.AF_INET6 and e.errno in (
                        errno.EADDRNOTAVAIL,
                        errno.EAFNOSUPPORT,
                    ):
                        # Reference section 9 row 7 (istio/istio#52858): lo without ::1.
                        log.info("dns %s: no [::1] in this netns (%s); IPv4 only", self.name, e)
                        continue
                    raise OSError(
                        e.errno, f"cannot bind DNS [{host}]:{port}/tcp: {e.strerror}"
                    ) from None
                self.tcp.append(Listener(tcp, self._tcp_conn, f"{self.name} dns"))
                try:
                    udp = self.sockets.bind_datagram(
                        (host, port), family=family, reuse_port=cfg.inpod_port_reuse
                    )
                except OSError as e:
                    raise OSError(
                        e.errno, f"cannot bind DNS [{host}]:{port}/udp: {e.strerror}"
                    ) from None
                self.udp.append(udp)
        except BaseException:
            self.abort()
            raise

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        for sock in self.udp:
            loop.add_reader(sock.fileno(), self._on_udp, sock)
            log.info("%s dns listening on %s:%d/udp", self.name, *sock.getsockname()[:2])
        for lst in self.tcp:
            lst.start()
            log.info("%s dns listening on %s:%d/tcp", self.name, *lst.address)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [s.getsockname()[:2] for s in self.udp]

    @property
    def active(self) -> int:
        return len(self._tasks) + sum(lst.active for lst in self.tcp)

    def _close_udp(self) -> None:
        for sock in self.udp:
            if self._loop is not None and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self.udp.clear()

    def abort(self) -> None:
        """Close every socket now (a sibling listener failed to bind)."""
        self._close_udp()
        for lst in self.tcp:
            lst.sock.close()
        self.tcp.clear()

    async def drain(self, deadline: float | None) -> int:
        """Stop taking queries, let the ones in flight finish until ``deadline``; idle TCP
        connections close at once."""
        self._close_udp()
        for t in self._idle:
            t.cancel()
        cut = 0
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=deadline)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            cut += len(pending)
        for lst in self.tcp:
            cut += await lst.drain(deadline)
        self.tcp.clear()
        return cut

    # --- UDP ----------------------------------------------------------------------------------

    def _on_udp(self, sock: socket.socket) -> None:
        buf, view = self._buf, self._view
        # (with the DNS access log on, every query takes the logged path)
        hot = self._hot if not dns_log.isEnabledFor(logging.DEBUG) else {}
        gen = self.state.generation
        if gen != self._hot_gen:
            hot.clear()
            self._hot_gen = gen
        for _ in range(_UDP_BATCH):
            try:
                n, addr = sock.recvfrom_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._log.warning("udp-recv", "dns %s: recv failed: %s", self.name, e)
                return
            if n > 12:
                tmpl = hot.get(view[2:n].tobytes())
                if tmpl is not None:
                    try:  # (inline, not _sendto: this is the per-query hot loop)
                        sock.sendto(view[:2].tobytes() + tmpl[0], addr)
                    except OSError:  # a full buffer: it is UDP, the client retries
                        self.dropped += 1
                    if tmpl[1] is not None:
                        tmpl[1].value += 1
                    continue
            data = bytes(view[:n])
            reply = self.answer_now(data, True)
            if reply is None:
                continue
            if isinstance(reply, bytes):
                _sendto(sock, reply, addr)
                continue
            if len(self._tasks) >= MAX_UDP_TASKS:
                self.dropped += 1
                self._log.warning(
                    "udp-busy", "dns %s: %d queries in flight; dropping", self.name, MAX_UDP_TASKS
                )
                continue
            assert self._loop is not None
            task = self._loop.create_task(self._udp_slow(sock, reply, addr))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _udp_slow(self, sock: socket.socket, req: wire.Request, addr: Any) -> None:
        reply = await self.answer_later(req, True)
        if reply is not None and sock.fileno() >= 0:
            _sendto(sock, reply, addr)

    # --- TCP ----------------------------------------------------------------------------------

    async def _tcp_conn(self, conn: socket.socket) -> None:
        if sum(lst.active for lst in self.tcp) > MAX_TCP_CONNECTIONS:
            self._log.warning("tcp-busy", "dns %s: too many TCP connections", self.name)
            return  # the listener closes it
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        try:
            while True:
                self._idle.add(task)
                try:
                    async with asyncio.timeout(TCP_REQUEST_TIMEOUT):
                        head = await _recv_exactly(loop, conn, 2)
                finally:
                    self._idle.discard(task)
                if head is None:
                    return
                (n,) = struct.unpack("!H", head)
                async with asyncio.timeout(TCP_REQUEST_TIMEOUT):
                    body = await _recv_exactly(loop, conn, n)
                if body is None:
                    self._log.debug("tcp-short", "dns %s: TCP message cut short", self.name)
                    return
                reply = self.answer_now(body, False)
                if isinstance(reply, wire.Request):
                    reply = await self.answer_later(reply, False)
                if reply is None:
                    continue
                async with asyncio.timeout(TCP_REQUEST_TIMEOUT):
                    await loop.sock_sendall(conn, struct.pack("!H", len(reply)) + reply)
        except (TimeoutError, OSError, asyncio.CancelledError):
            return

    # --- the handler --------------------------------------------------------------------------

    def answer_now(self, data: bytes, udp: bool) -> bytes | wire.Request | None:
        """The reply if it needs no waiting (parse errors, answers from state), None to drop,
        or the parsed request to finish in :meth:`answer_later`."""
        req = wire.parse(data)
        if isinstance(req, wire.Drop):
            self.dropped += 1
            self._log.debug("drop", "dns %s: dropped a message: %s", self.name, req.reason)
            return None
        if isinstance(req, wire.FormErr):
            self._log.info("formerr", "dns %s: malformed query: %s", self.name, req.reason)
            return req.reply
        if req.opcode != 0:
            self._log.info(
                "notimp", "dns %s: unimplemented opcode %s", self.name, wire.opcode_text(req.opcode)
            )
            return wire.error(req, wire.NOTIMP)
        client = self.client()
        if client is None:
            return req
        return self._lookup(req, client, udp)

    async def answer_later(self, req: wire.Request, udp: bool) -> bytes | None:
        client = self.client()
        if client is None:
            client = await self._wait_client()
            if client is None:
                self._count(req, udp, None)
                self._log.info(
                    "noclient", "dns %s: the client is not a known workload: SERVFAIL", self.name
                )
                return wire.error(req, wire.SERVFAIL)
        reply = self._lookup(req, client, udp)
        if isinstance(reply, bytes):
            return reply
        return await self._forward(req, client, udp)

    async def _wait_client(self) -> Workload | None:
        end = time.monotonic() + self.client_wait
        while time.monotonic() < end:
            await asyncio.sleep(0.05)
            client = self.client()
            if client is not None:
                return client
        return None

    def _lookup(self, req: wire.Request, client: Workload, udp: bool) -> bytes | wire.Request:
        if req.qcount != 1:
            # request_info(): BadQueryCount -> LookupError -> send_lookup_error: SERVFAIL.
            return wire.error(req, wire.SERVFAIL)
        if not is_supported_type(req.qtype) or req.qname is None:
            return self._cached(req, client, udp)
        ans = self.resolver.resolve(client, req.qname, req.qtype)
        if ans is None:
            return self._cached(req, client, udp)
        cell = self._count(req, udp, client)
        reply = wire.fit(req, wire.answer(req, ans.addresses, cname=ans.cname), udp)
        if dns_log.isEnabledFor(logging.DEBUG):
            # Rust counts the answers before adding the address records: the CNAME only.
            access(req, client, ans.result, 1 if ans.cname is not None else 0)
        raw = req.raw
        if (
            udp
            and len(ans.addresses) <= 1
            and raw is not None
            and len(raw) <= HOT_MAX_REQUEST  # a padded query must not pin 64 KiB each
            and len(self._hot) < HOT_SIZE
        ):
            self._hot[raw[2:]] = (reply[2:], cell)
        return reply

    def _cached(self, req: wire.Request, client: Workload, udp: bool) -> bytes | wire.Request:
        """A forwarded name already in the cache is answered at once (counted as forwarded,
        as hickory's cache sits inside Rust's forwarder too); else the request goes on."""
        got = self.forwarder.cached(req, udp)
        if got is None:
            return req
        self._count_forward(req, udp, client, 0.0, got.failed)
        if dns_log.isEnabledFor(logging.DEBUG):
            access_forwarded(req, client, got.reply, got.failed)
        return got.reply

    async def _forward(self, req: wire.Request, client: Workload, udp: bool) -> bytes:
        start = time.perf_counter()
        result = await self.forwarder.forward(req, udp)
        self._count_forward(req, udp, client, time.perf_counter() - start, result.failed)
        if dns_log.isEnabledFor(logging.DEBUG):
            access_forwarded(req, client, result.reply, result.failed)
        return result.reply

    def _labels(self, req: wire.Request, udp: bool, client: Workload | None) -> tuple[str, ...]:
        qtype = wire.type_text(req.qtype) if req.qcount == 1 else "unknown"
        return dns_labels(qtype, "udp" if udp else "tcp", client)

    def _series(self, req: wire.Request, udp: bool, client: Workload | None) -> _Series | None:
        """The label set's cells, memoised by (type, protocol, client object)."""
        m = self.metrics
        if m is None:
            return None
        key = (req.qtype if req.qcount == 1 else -1, udp, id(client))
        hit = self._cells.get(key)
        if hit is None or hit.client is not client:
            if len(self._cells) > 64:
                self._cells.clear()
            labels = self._labels(req, udp, client)
            hit = self._cells[key] = _Series(
                client,
                m.requests.labels(*labels),
                m.upstream_requests.labels(*labels),
                m.upstream_failures.labels(*labels),
                m.upstream_duration.labels(*labels),
                m.upstream_duration.bounds,
            )
        return hit

    def _count(self, req: wire.Request, udp: bool, client: Workload | None) -> Cell | None:
        series = self._series(req, udp, client)
        if series is None:
            return None
        series.requests.value += 1
        return series.requests

    def _count_forward(
        self, req: wire.Request, udp: bool, client: Workload, took: float, failed: bool
    ) -> None:
        series = self._series(req, udp, client)
        if series is None:
            return
        series.requests.value += 1
        series.upstream.value += 1
        series.duration.observe(took, series.bounds)
        if failed:
            series.failures.value += 1


@dataclass(slots=True)
class _Series:
    client: Workload | None
    requests: Cell
    upstream: Cell
    failures: Cell
    duration: HistogramCell
    bounds: tuple[float, ...]


def access(req: wire.Request, client: Workload | None, result: str, endpoints: int) -> None:
    """One line of Rust's DNS access log (``server.rs`` ``access_log``)."""
    fields = {
        "src.workload": client.name if client is not None else "unknown",
        "src.namespace": client.namespace if client is not None else "unknown",
        "query": wire.type_text(req.qtype).upper() if req.qcount == 1 else None,
        "domain": wire.question_name(req),
        "result": result,
        "endpoints": endpoints,
    }
    dns_log.debug("", extra={"fields": fields})


def access_forwarded(req: wire.Request, client: Workload, reply: bytes, failed: bool) -> None:
    # hickory's failures of a forwarded lookup surface as an error reply (SERVFAIL, NXDOMAIN,
    # or no records): "forwarding failed (...)", else "forwarded" with the answer count.
    (rcode, answers) = (reply[3] & 0x0F, int.from_bytes(reply[6:8])) if len(reply) >= 12 else (2, 0)
    if failed:
        access(req, client, f"forwarding failed ({wire.rcode_text(rcode)})", 0)
    else:
        access(req, client, "forwarded", answers)


def _sendto(sock: socket.socket, data: bytes, addr: Any) -> None:
    # A full socket buffer or a vanished client: it is UDP, the client retries.
    with contextlib.suppress(OSError):
        sock.sendto(data, addr)


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int
) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def dns_companions(
    config: Config,
    state: State,
    metrics: DnsMetrics | None,
    resolv: ResolvConfSource,
) -> Callable[[ProxyInstance], list[DnsServer]]:
    """The ProxyInstance hook: one DnsServer per instance, made with its socket factory."""

    def build(inst: ProxyInstance) -> list[DnsServer]:
        return [
            DnsServer(
                config=config,
                state=state,
                sockets=inst.sockets,
                client=inst.workload,
                resolv=resolv,
                metrics=metrics,
                name=inst.name,
            )
        ]

    return build
