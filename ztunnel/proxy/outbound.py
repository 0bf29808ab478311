"""Outbound: decide the route of one connection from the pod, execute it.

From 15001 the destination is the captured connection's original one; from SOCKS5
(``proxy/socks5.py``) the one its CONNECT named. Both are Rust's ``OutboundConnection::proxy_to``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ztunnel.core.addr import IPAddr, SocketAddr, canonical_ip
from ztunnel.core.errors import ProxyError, ResponseFlag, reportable
from ztunnel.net.copy import CopyCounters, copy_bidirectional
from ztunnel.net.sockopt import original_dst, peer_addr
from ztunnel.proxy.context import (
    ConnectionRecord,
    ProxyContext,
    log_failed,
)
from ztunnel.proxy.route import NeedsResolution as NeedsDns
from ztunnel.proxy.route import Route, RouteKind, decide_outbound, decide_outbound_resolving
from ztunnel.state.model import Workload

log = logging.getLogger("ztunnel.proxy.outbound")


async def resolve_host(hostname: str) -> Sequence[IPAddr]:
    """The system resolver (ztunnel's own resolv.conf, as Rust's on-demand DNS uses)."""
    infos = await asyncio.get_running_loop().getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    out: list[IPAddr] = []
    for _family, _type, _proto, _name, addr in infos:
        ip = canonical_ip(ipaddress.ip_address(addr[0]))
        if ip not in out:
            out.append(ip)
    return out


class Outbound:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def _decide_async(self, source: Workload | None, dst: SocketAddr) -> Route:
        ctx = self.ctx
        metrics = ctx.metrics

        def on_dns(src: Workload | None, wl: Workload) -> None:
            if metrics is not None:
                metrics.on_demand_dns_used(src, wl.hostname)

        return await decide_outbound_resolving(
            ctx.state,
            source,
            dst,
            resolve=resolve_host,
            network=ctx.config.network,
            local_ips=ctx.local_ips(),
            on_dns=on_dns,
            illegal_ports=ctx.config.illegal_ports,
        )

    async def handle(
        self,
        sock: socket.socket,
        peer: tuple[Any, ...] | None = None,
        *,
        src: SocketAddr | None = None,
        dst: SocketAddr | None = None,
        answer: Answer | None = None,
    ) -> None:
        """Route one outbound connection and carry it (Rust ``OutboundConnection::proxy_to``).

        From 15001 ``sock`` and ``peer`` (what accept() returned) are given: the destination is
        the original one. SOCKS5 gives the client's address, the destination its CONNECT named,
        and ``answer``, which is told how it went before any byte is copied: None once the
        upstream is established (TCP connected, or HBONE's CONNECT answered 200), else the
        failure the access log names."""
        ctx = self.ctx
        if dst is None:
            try:
                src = peer_addr(sock, peer)
                dst = original_dst(sock)
            except OSError:
                return  # the client is already gone
        assert src is not None
        source = ctx.local_workload()
        if source is None:
            # Rust outbound: the source workload is waited for (up to 5 s, a new pod's first
            # connections racing istiod's push), else the connection is refused. Never routed
            # without it: a mesh destination would lose its mTLS, or be passed through.
            source = await ctx.wait_local_workload()
            if source is None:
                _refused(src, dst, ctx.unknown_local_workload(), answer)
                return
        try:
            if ctx.state.demander is None:
                route = decide_outbound(
                    ctx.state,
                    source,
                    dst,
                    network=ctx.config.network,
                    local_ips=ctx.local_ips(),
                    illegal_ports=ctx.config.illegal_ports,
                )
            else:  # XDS_ON_DEMAND: the destination may have to be fetched first
                route = await self._decide_async(source, dst)
        except NeedsDns:  # a hostname-only endpoint (ServiceEntry, DNS resolution)
            try:
                route = await self._decide_async(source, dst)
            except ProxyError as e:
                _refused(src, dst, e, answer)
                return
        except ProxyError as e:
            _refused(src, dst, e, answer)
            return
        hbone = route.kind is RouteKind.HBONE or route.kind is RouteKind.DOUBLE_HBONE
        rec = (ConnectionRecord if answer is None else _AnsweredRecord)(
            "outbound",
            src,
            route.target,
            hbone_addr=route.authority,
            orig_dst=None if dst == route.target else dst,
            double_hbone=route.kind is RouteKind.DOUBLE_HBONE,
            src_workload=source,
            dst_workload=route.destination_workload,
            dst_service=route.destination_service,
            src_identity=source.identity if hbone and source is not None else None,
            counters=CopyCounters(),
        )
        if isinstance(rec, _AnsweredRecord):
            rec.answer = answer
        del dst  # the record keeps what it needs: this frame lives as long as the connection
        if route.kind is RouteKind.DOUBLE_HBONE:
            # Opened once the inner tunnel's response names the destination (Rust builds the
            # connection's result after it), or when the connection ends first.
            rec.open_deferred = lambda: ctx.open_metrics(rec, mtls=True)
        else:
            ctx.open_metrics(rec, mtls=hbone)
        with ctx.tracked(rec):
            if not hbone:
                await self._tcp(rec, sock, route.target)
            elif ctx.hbone is None:
                rec.log_complete("HBONE is not available in this build")
            elif (opened := await ctx.hbone.open_stream(route, rec)) is not None:
                # Bridged from this frame: one coroutine frame fewer for the connection's life.
                conn, sid = opened
                del opened, route
                _established(rec)
                try:
                    # Cancellation (drain, policy, deleted pod) is logged by ctx.tracked.
                    bridge = await conn.bridge(sid, sock, rec.counters)
                    rec.bytes_sent, rec.bytes_recv = bridge.tcp_to_h2, bridge.h2_to_tcp
                    rec.log_complete(reportable(bridge.error))
                finally:
                    ctx.hbone.stream_done(conn)

    async def _tcp(self, rec: ConnectionRecord, sock: socket.socket, target: SocketAddr) -> None:
        """Plain TCP to ``target`` (passthrough, or a workload without HBONE), then copy both
        ways until both end; logs the outcome."""
        ctx = self.ctx
        try:
            upstream = await ctx.sockets.connect(target)
        except ProxyError as e:
            rec.log_complete(e)
            return
        _established(rec)
        result = await copy_bidirectional(sock, upstream, pipes=ctx.pipes, counters=rec.counters)
        rec.log_complete(reportable(result.error))


# An outbound connection's outcome, for a client that must be told it (SOCKS5's reply): None
# once the upstream is established, else why it never was.
Answer = Callable[[BaseException | str | None], None]


@dataclass(eq=False, slots=True)
class _AnsweredRecord(ConnectionRecord):
    """The record of a connection whose client is told how it went before any byte is copied:
    :func:`_established`, or else the outcome it is logged with (however it fails: connect,
    TLS, the peer's CONNECT status, no HBONE)."""

    answer: Answer | None = None

    def log_complete(
        self, error: BaseException | str | None, flag: ResponseFlag | None = None
    ) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not self._done:
            answer(error if error is not None else "connection closed before it was established")
        ConnectionRecord.log_complete(self, error, flag)


def _established(rec: ConnectionRecord) -> None:
    if isinstance(rec, _AnsweredRecord) and (answer := rec.answer) is not None:
        rec.answer = None
        answer(None)


def _refused(
    src: SocketAddr, dst: SocketAddr, error: BaseException | str, answer: Answer | None
) -> None:
    """Refused before any upstream was chosen: Rust's early denial line, and the answer."""
    log_failed("outbound", src, dst, error)
    if answer is not None:
        answer(error)
