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

from ztunnel.config import HBONE_PORT, ILLEGAL_PORTS
from ztunnel.core.addr import HostnameAuthority, IPAddr, SocketAddr, parse_ip
from ztunnel.core.errors import AuthorizationDenied, ProxyError, reportable
from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.headers import (
    BAGGAGE,
    FORWARDED,
    X_FORWARDED_NETWORK,
    baggage,
    forwarded_host,
    parse_baggage,
)
from ztunnel.hbone.transport import HboneConnection, HboneError, tls_handshake
from ztunnel.identity.manager import CertificateError, SecretManager
from ztunnel.identity.tls import TlsIdentityError, server_context, verify_client_trust_domain
from ztunnel.net.copy import CopyCounters
from ztunnel.net.sockopt import local_addr, peer_addr
from ztunnel.proxy.context import (
    UNKNOWN_LOCAL_WORKLOAD,
    ConnectionRecord,
    ProxyContext,
    log_failed,
)
from ztunnel.proxy.hbone_outbound import HboneSettings
from ztunnel.proxy.inbound_route import (
    InboundTarget,
    find_inbound_upstream,
    localhost_tunnel,
    parse_hbone_address,
    proxy_v2_header,
    validate_destination,
)
from ztunnel.state.model import AppTunnelProtocol, NetworkAddress, Workload

log = logging.getLogger("ztunnel.proxy.inbound")

_LOOPBACK4 = parse_ip("127.0.0.1")
_LOOPBACK6 = parse_ip("::1")


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
        admitted = await self._admit(conn, ev, src, arrival, peer_id)
        del ev
        if admitted is None:
            return
        rec, tunnel = admitted
        ctx = self.ctx
        with ctx.tracked(rec):
            try:
                upstream = await self._connect_app(rec, tunnel)
            except ProxyError as e:
                _reject(conn, sid, src, 503, e, rec)
                return
            conn.respond(sid, 200, self._response_headers(rec.dst_workload), end_stream=False)
            bridge = await conn.bridge(sid, upstream, rec.counters)
            # Inbound: "sent" is what the local app sent back.
            rec.bytes_recv, rec.bytes_sent = bridge.h2_to_tcp, bridge.tcp_to_h2
            rec.log_complete(reportable(bridge.error))

    async def _connect_app(self, rec: ConnectionRecord, target: InboundTarget) -> socket.socket:
        """Rust serve_connect: connect to the app, from the client's IP (the socket factory
        knows whether spoofing is on: ``ENABLE_ORIG_SRC``); a PROXY application tunnel goes to
        loopback (with ``LOCALHOST_APP_TUNNEL``) and starts with the PROXY v2 header."""
        ctx = self.ctx
        tunnel = target.tunnel
        if localhost_tunnel(tunnel, ctx.config.localhost_app_tunnel):
            loopback = _LOOPBACK4 if rec.dst.ip.version == 4 else _LOOPBACK6
            upstream = await ctx.sockets.connect(SocketAddr(loopback, rec.dst.port))
        else:
            upstream = await ctx.sockets.connect(rec.dst, spoof_source=rec.src.ip)
        if tunnel is not None and tunnel.protocol is AppTunnelProtocol.PROXY:
            header = proxy_v2_header(rec.src, tunnel.target, rec.src_identity)
            try:
                await asyncio.get_running_loop().sock_sendall(upstream, header)
            except BaseException:
                upstream.close()
                raise
        return upstream

    async def _admit(
        self,
        conn: HboneConnection,
        ev: h2.RequestReceived,
        src: SocketAddr,
        arrival: IPAddr,
        peer_id: Identity,
    ) -> tuple[ConnectionRecord, InboundTarget] | None:
        """Rust build_inbound_request: validate the CONNECT and decide its upstream
        (``inbound_route``); then open the connection's record and metrics and authorize it.
        The record and where to connect, or None once the stream was refused (and that
        logged: before a record exists as an early denial, as Rust's log_early_deny)."""
        ctx = self.ctx
        sid = ev.stream_id
        bad = h2.connect_request_error(ev)
        if bad is not None:
            _reject(conn, sid, src, 400, bad)
            return None
        assert ev.authority is not None
        try:
            target = parse_hbone_address(ev.authority)
        except ValueError as e:
            _reject(conn, sid, src, 400, e)
            return None
        local = await ctx.wait_local_workload()
        if local is None:
            _reject(conn, sid, src, 503, UNKNOWN_LOCAL_WORKLOAD, arrival=arrival)
            return None
        network = ctx.config.network
        try:
            validate_destination(ctx.state, network, arrival, local, target)
            decided = find_inbound_upstream(
                ctx.state, network, arrival, local, target, ILLEGAL_PORTS
            )
        except ProxyError as e:
            _reject(conn, sid, src, e.status, e, arrival=arrival)
            return None
        # Rust build_inbound_request: a request that crossed a network gateway (the inner CONNECT
        # of double HBONE names another origin network) comes from an address that means
        # nothing here: the source is known only from its baggage.
        origin = _header(ev.headers, X_FORWARDED_NETWORK)
        from_gateway = origin is not None and origin.lower() != network.lower()
        rec = ConnectionRecord(
            "inbound",
            src,
            decided.upstream,
            hbone_addr=target,
            src_workload=None
            if from_gateway
            else ctx.state.find_workload_by_addr(NetworkAddress(network, src.ip)),
            dst_workload=local,
            dst_service=decided.services[0] if isinstance(target, HostnameAuthority) else None,
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
        try:
            ctx.authorize(rec, local)
        except AuthorizationDenied as e:
            _reject(conn, sid, src, 401, e, rec)
            return None
        return rec, decided

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
    *,
    arrival: IPAddr | None = None,
) -> None:
    """Refuse the stream with a headers-only response; log it: as the connection's outcome once
    it has a record, else as Rust's early denial ("connection failed", dst.addr the address the
    connection arrived at) once the arrival address is known, else as a rejected request."""
    conn.respond(sid, status, [], end_stream=True)
    if rec is not None:
        rec.log_complete(why)
    elif arrival is not None:
        log_failed("inbound", src, SocketAddr(arrival, HBONE_PORT), why)
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
