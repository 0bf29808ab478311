"""Outbound 15001: recover the original destination, decide the route, execute it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence

from ztunnel.core.addr import IPAddr, SocketAddr, canonical_ip
from ztunnel.core.errors import ProxyError, reportable
from ztunnel.net.copy import CopyCounters
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
        )

    async def handle(self, sock: socket.socket) -> None:
        ctx = self.ctx
        try:
            src = peer_addr(sock)
            dst = original_dst(sock)
        except OSError:
            return  # the client is already gone
        source = ctx.local_workload()
        if source is None:
            # Rust outbound: the source workload is waited for (up to 5 s, a new pod's first
            # connections racing istiod's push), else the connection is refused. Never routed
            # without it: a mesh destination would lose its mTLS, or be passed through.
            source = await ctx.wait_local_workload()
            if source is None:
                log_failed("outbound", src, dst, ctx.unknown_local_workload())
                return
        try:
            if ctx.state.demander is None:
                route = decide_outbound(
                    ctx.state, source, dst, network=ctx.config.network, local_ips=ctx.local_ips()
                )
            else:  # XDS_ON_DEMAND: the destination may have to be fetched first
                route = await self._decide_async(source, dst)
        except NeedsDns:  # a hostname-only endpoint (ServiceEntry, DNS resolution)
            try:
                route = await self._decide_async(source, dst)
            except ProxyError as e:
                log_failed("outbound", src, dst, e)
                return
        except ProxyError as e:
            log_failed("outbound", src, dst, e)
            return
        hbone = route.kind is RouteKind.HBONE or route.kind is RouteKind.DOUBLE_HBONE
        rec = ConnectionRecord(
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
        del dst  # the record keeps what it needs: this frame lives as long as the connection
        if route.kind is RouteKind.DOUBLE_HBONE:
            # Opened once the inner tunnel's response names the destination (Rust builds the
            # connection's result after it), or when the connection ends first.
            rec.open_deferred = lambda: ctx.open_metrics(rec, mtls=True)
        else:
            ctx.open_metrics(rec, mtls=hbone)
        with ctx.tracked(rec):
            if not hbone:
                await ctx.proxy_tcp(rec, sock, route.target)
            elif ctx.hbone is None:
                rec.log_complete("HBONE is not available in this build")
            elif (opened := await ctx.hbone.open_stream(route, rec)) is not None:
                # Bridged from this frame: one coroutine frame fewer for the connection's life.
                conn, sid = opened
                del opened, route
                try:
                    # Cancellation (drain, policy, deleted pod) is logged by ctx.tracked.
                    bridge = await conn.bridge(sid, sock, rec.counters)
                    rec.bytes_sent, rec.bytes_recv = bridge.tcp_to_h2, bridge.h2_to_tcp
                    rec.log_complete(reportable(bridge.error))
                finally:
                    ctx.hbone.stream_done(conn)
