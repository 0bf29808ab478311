"""Outbound 15001: recover the original destination, decide the route, execute it."""

from __future__ import annotations

import logging
import socket

from ztunnel.core.errors import ProxyError, reportable
from ztunnel.net.copy import CopyCounters
from ztunnel.net.sockopt import original_dst, peer_addr
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, log_failed
from ztunnel.proxy.route import RouteKind, decide_outbound

log = logging.getLogger("ztunnel.proxy.outbound")


class Outbound:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def handle(self, sock: socket.socket) -> None:
        ctx = self.ctx
        try:
            src = peer_addr(sock)
            dst = original_dst(sock)
        except OSError:
            return  # the client is already gone
        source = ctx.local_workload()
        try:
            route = decide_outbound(
                ctx.state, source, dst, network=ctx.config.network, local_ips=ctx.local_ips()
            )
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
