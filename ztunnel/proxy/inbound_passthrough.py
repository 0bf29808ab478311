"""Inbound plaintext 15006: traffic from clients outside the mesh, redirected by iptables.

Recover the original destination, refuse ztunnel's own ports, find the local workload (waiting
for it like inbound HBONE does, and refusing the connection if it stays unknown: its policies
cannot be checked without it), authorize with no source identity, connect to the app (spoofing
the client's source IP when the kernel allows) and copy.
"""

from __future__ import annotations

import socket
from typing import Any

from ztunnel.core.errors import AuthorizationDenied, SelfCallError
from ztunnel.net.copy import CopyCounters
from ztunnel.net.sockopt import original_dst, peer_addr
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, log_failed
from ztunnel.state.model import NetworkAddress


class InboundPassthrough:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def handle(self, sock: socket.socket, peer: tuple[Any, ...] | None = None) -> None:
        """Serve one accepted connection; ``peer`` is the address accept() returned."""
        ctx = self.ctx
        try:
            src = peer_addr(sock, peer)
            dst = original_dst(sock)
        except OSError:
            return
        if dst.port in ctx.config.illegal_ports:
            log_failed("inbound", src, dst, SelfCallError(dst))
            return
        local = await ctx.wait_local_workload()
        if local is None:
            # Fail closed: without the workload its policies (e.g. STRICT) cannot be applied.
            # Rust inbound_passthrough: log_early_deny, nothing counted.
            log_failed("inbound", src, dst, ctx.unknown_local_workload())
            return
        rec = ConnectionRecord(
            "inbound",
            src,
            dst,
            src_workload=ctx.state.find_workload_by_addr(
                NetworkAddress(ctx.config.network, src.ip)
            ),
            dst_workload=local,
            counters=CopyCounters(),
            sent_is_down_to_up=False,  # inbound "sent" is the app's reply: upstream -> downstream
        )
        ctx.open_metrics(rec, mtls=False)
        try:
            ctx.authorize(rec, local)  # plaintext: no identity, so STRICT-style DENYs apply
        except AuthorizationDenied as e:
            rec.log_complete(e)
            return
        with ctx.tracked(rec):
            await ctx.proxy_tcp(rec, sock, dst, spoof_source=src.ip)
