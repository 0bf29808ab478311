"""Inbound HBONE 15008: terminate mTLS and HTTP/2, validate each CONNECT, connect to the app.

Status codes follow istio/ztunnel ``src/proxy/inbound.rs`` (reference 2.3): 400 for a bad method,
authority or IP mismatch, 503 when the local workload is unknown or the app refuses, 200 then raw
bytes. Error responses are headers-only with END_STREAM.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import ssl

from ztunnel.config import ILLEGAL_PORTS
from ztunnel.core.addr import IPAddr, SocketAddr
from ztunnel.core.errors import AuthorizationDenied, ProxyError, reportable
from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.headers import BAGGAGE, FORWARDED, baggage, forwarded_host, parse_baggage
from ztunnel.hbone.transport import HboneConnection, HboneError, tls_handshake
from ztunnel.identity.manager import CertificateError, SecretManager
from ztunnel.identity.tls import TlsIdentityError, server_context, verify_client_trust_domain
from ztunnel.net.copy import CopyCounters
from ztunnel.net.sockopt import local_addr, peer_addr
from ztunnel.proxy.context import UNKNOWN_LOCAL_WORKLOAD, ConnectionRecord, ProxyContext
from ztunnel.proxy.hbone_outbound import HboneSettings
from ztunnel.state.model import NetworkAddress, Workload

log = logging.getLogger("ztunnel.proxy.inbound")


class InboundHbone:
    def __init__(self, ctx: ProxyContext, secrets: SecretManager) -> None:
        self.ctx = ctx
        self.secrets = secrets
        self.settings = HboneSettings.from_config(ctx.config)
        self.connections: set[HboneConnection] = set()

    def send_goaway(self) -> None:
        """Drain: tell every peer to open no new streams here."""
        for conn in list(self.connections):
            conn.send_goaway()

    async def handle(self, sock: socket.socket) -> None:
        ctx = self.ctx
        try:
            src, arrival = peer_addr(sock), local_addr(sock)
        except OSError:
            return
        identity = ctx.local_identity()
        if identity is None:
            log.warning("inbound HBONE from %s: no local identity; closing", src)
            return
        try:
            cert = await self.secrets.fetch_certificate(identity)
            sslobj, inbio, outbio = await tls_handshake(
                sock, server_context(cert), server_side=True
            )
            peer_der = sslobj.getpeercert(binary_form=True) or b""
            peer_id = verify_client_trust_domain(peer_der, cert.identity.trust_domain)
        except (CertificateError, TlsIdentityError) as e:
            log.warning("inbound HBONE from %s rejected: %s", src, e)
            return
        except (ssl.SSLError, OSError, HboneError, TimeoutError) as e:
            log.warning("inbound HBONE from %s: TLS handshake failed: %s", src, e)
            return
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        # Shared by the connection's stream tasks and their done callbacks (see Listener).
        context = contextvars.copy_context()

        def on_request(conn: HboneConnection, ev: h2.RequestReceived) -> None:
            task = loop.create_task(
                self._serve(conn, ev, src, arrival.ip, peer_id), context=context
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard, context=context)

        h2c = h2.H2Connection(
            client=False,
            initial_window_size=self.settings.stream_window,
            connection_window_size=self.settings.connection_window,
            max_frame_size=self.settings.frame_size,
            max_concurrent_streams=200,
        )
        conn = HboneConnection(sock, sslobj, inbio, outbio, h2c, on_request=on_request)
        self.connections.add(conn)
        try:
            await asyncio.shield(conn.closed)
            if conn.error is not None and not isinstance(conn.error, HboneError):
                log.debug("inbound HBONE connection from %s ended: %s", src, conn.error)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            conn.close()
            raise
        finally:
            self.connections.discard(conn)

    async def _serve(
        self,
        conn: HboneConnection,
        ev: h2.RequestReceived,
        src: SocketAddr,
        arrival: IPAddr,
        peer_id: Identity,
    ) -> None:
        # This frame lives as long as the stream, so it stays small: the checks run in a
        # transient one, no closure, and the request event (its header list is most of its size)
        # is dropped once read.
        sid = ev.stream_id
        rec = await self._admit(conn, ev, src, arrival, peer_id)
        del ev
        if rec is None:
            return
        ctx = self.ctx
        with ctx.tracked(rec):
            try:
                upstream = await ctx.sockets.connect(rec.dst, spoof_source=src.ip)
            except ProxyError as e:
                _reject(conn, sid, src, 503, e, rec)
                return
            conn.respond(sid, 200, self._response_headers(rec.dst_workload), end_stream=False)
            bridge = await conn.bridge(sid, upstream, rec.counters)
            # Inbound: "sent" is what the local app sent back.
            rec.bytes_recv, rec.bytes_sent = bridge.h2_to_tcp, bridge.tcp_to_h2
            rec.log_complete(reportable(bridge.error))

    async def _admit(
        self,
        conn: HboneConnection,
        ev: h2.RequestReceived,
        src: SocketAddr,
        arrival: IPAddr,
        peer_id: Identity,
    ) -> ConnectionRecord | None:
        """Validate the CONNECT, open the connection's record and metrics, authorize it: the
        record, or None once the stream was refused (and that logged)."""
        ctx = self.ctx
        sid = ev.stream_id
        bad = h2.connect_request_error(ev)
        if bad is not None:
            _reject(conn, sid, src, 400, bad)
            return None
        assert ev.authority is not None
        try:
            target = SocketAddr.parse(ev.authority)
        except ValueError:
            _reject(conn, sid, src, 400, f"invalid authority {ev.authority!r}")
            return None
        local = await ctx.wait_local_workload()
        rec = ConnectionRecord(
            "inbound",
            src,
            target,
            hbone_addr=target,
            src_workload=ctx.state.find_workload_by_addr(
                NetworkAddress(ctx.config.network, src.ip)
            ),
            dst_workload=local,
            src_identity=peer_id,
            dst_identity=ctx.local_identity(),
            counters=CopyCounters(),
        )
        ctx.open_metrics(
            rec,
            mtls=True,
            baggage=parse_baggage(_header(ev.headers, BAGGAGE)),
            for_host=forwarded_host(_header(ev.headers, FORWARDED)),
        )
        if local is None:
            _reject(conn, sid, src, 503, UNKNOWN_LOCAL_WORKLOAD, rec)
            return None
        if target.ip != arrival and target.ip not in local.addresses:
            _reject(
                conn,
                sid,
                src,
                400,
                f"authority IP {target.ip} does not match the destination {arrival}",
                rec,
            )
            return None
        if target.port in ILLEGAL_PORTS:
            _reject(conn, sid, src, 400, f"call to ztunnel's own port refused: {target}", rec)
            return None
        try:
            ctx.authorize(rec, local)
        except AuthorizationDenied as e:
            _reject(conn, sid, src, 401, e, rec)
            return None
        return rec

    def _response_headers(self, local: Workload | None) -> list[tuple[str, str]]:
        cfg = self.ctx.config
        if (
            local is not None
            and cfg.enable_response_baggage
            and (value := baggage(local, cfg.cluster_id))
        ):
            return [(BAGGAGE, value)]
        return []


def _reject(
    conn: HboneConnection,
    sid: int,
    src: SocketAddr,
    status: int,
    why: str | BaseException,
    rec: ConnectionRecord | None = None,
) -> None:
    """Refuse the stream with a headers-only response; log it (as the connection's outcome
    once it has a record)."""
    conn.respond(sid, status, [], end_stream=True)
    if rec is not None:
        rec.log_complete(why)
    else:
        log.warning(
            "inbound HBONE request rejected",
            extra={"fields": {"src.addr": str(src), "status": status, "error": str(why)}},
        )


def _header(headers: h2.Headers, name: str) -> str | None:
    for k, v in headers:
        if k == name:
            return v
    return None
