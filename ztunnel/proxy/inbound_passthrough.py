"""Inbound plaintext 15006: traffic from clients outside the mesh, redirected by iptables.

Recover the original destination, refuse ztunnel's own ports, connect to the app (spoofing the
client's source IP when the kernel allows) and copy. Authorization comes with the policy layer.
"""

from __future__ import annotations

import socket

from ztunnel.config import ILLEGAL_PORTS
from ztunnel.core.errors import ProxyError, SelfCallError
from ztunnel.net.copy import copy_bidirectional
from ztunnel.net.sockopt import original_dst, peer_addr
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, log_failed
from ztunnel.state.model import NetworkAddress


class InboundPassthrough:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def handle(self, sock: socket.socket) -> None:
        ctx = self.ctx
        try:
            src = peer_addr(sock)
            dst = original_dst(sock)
        except OSError:
            return
        if dst.port in ILLEGAL_PORTS:
            log_failed("inbound", src, dst, SelfCallError(dst))
            return
        rec = ConnectionRecord(
            "inbound",
            src,
            dst,
            src_workload=ctx.state.find_workload_by_addr(
                NetworkAddress(ctx.config.network, src.ip)
            ),
            dst_workload=ctx.local_workload(),
        )
        try:
            upstream = await ctx.sockets.connect(dst, spoof_source=src.ip)
        except ProxyError as e:
            rec.log_complete(e)
            return
        result = await copy_bidirectional(sock, upstream, pipes=ctx.pipes)
        # Inbound: "sent" is what the local app sent back (the response direction).
        rec.bytes_recv, rec.bytes_sent = result.down_to_up, result.up_to_down
        rec.log_complete(result.error)
