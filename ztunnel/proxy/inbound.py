"""Inbound HBONE 15008: terminate mTLS and HTTP/2, validate each CONNECT, connect to the app.

Status codes follow istio/ztunnel ``src/proxy/inbound.rs`` (reference 2.3): 400 for a bad method,
authority or IP mismatch, 503 when the local workload is unknown or the app refuses, 200 then raw
bytes. Error responses are headers-only with END_STREAM.

Every accepted connection gets one access-log line however it ends ("connection failed" with
the reason when it ends before a stream is served, as Rust's ``log_early_deny``). The HTTP/2
endpoint holds each stream until its task is done (``hold_streams``): a stream closed on the wire
(a rapid reset, say) no longer counts against the peer's 200-stream limit, but against the
connection's budget of held streams while its upstream connect runs; stream tasks start a batch
per loop iteration; new streams are refused (REFUSED_STREAM) while the process is within its fd
reserve, and malformed requests count against the peer's budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ztunnel.config import HBONE_PORT
from ztunnel.core.addr import HostnameAuthority, IPAddr, SocketAddr, parse_ip
from ztunnel.core.errors import AuthorizationDenied, CertificateRevoked, ProxyError, reportable
from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.headers import (
    BAGGAGE,
    FORWARDED,
    X_FORWARDED_NETWORK,
    baggage,
    forwarded_host,
    header_value,
    parse_baggage,
)
from ztunnel.hbone.transport import AlpnRefused, HboneConnection, HboneError, tls_handshake
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.manager import CertificateError, CertificateSource
from ztunnel.identity.tls import (
    TlsIdentityError,
    crl_of,
    server_context,
    verify_client_trust_domain,
)
from ztunnel.net.copy import CopyCounters
from ztunnel.net.sockopt import local_addr, peer_addr
from ztunnel.proxy.context import ConnectionRecord, ProxyContext, log_failed
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
_UNKNOWN_PEER = SocketAddr.parse("0.0.0.0:0")


# New stream tasks started per event-loop iteration (per proxy instance), the rest queued: a
# burst of CONNECTs (200 per connection, from any number of connections) is admitted a batch at
# a time, so other connections' I/O runs between batches instead of after all of it.
START_BATCH = 16


class _FairStarter:
    """Runs submitted starts at most ``batch`` per event-loop iteration, in order."""

    __slots__ = ("armed", "batch", "queue", "started")

    def __init__(self, batch: int = START_BATCH) -> None:
        self.batch = batch
        self.queue: deque[Callable[[], None]] = deque()
        self.started = 0
        self.armed = False

    def submit(self, start: Callable[[], None]) -> None:
        if self.started < self.batch and not self.queue:
            self.started += 1
            self._arm()
            start()
        else:
            self.queue.append(start)
            self._arm()

    def _arm(self) -> None:
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.armed = False
        self.started = 0
        queue = self.queue
        while queue and self.started < self.batch:
            self.started += 1
            queue.popleft()()
        if queue or self.started:
            self._arm()


class InboundHbone:
    def __init__(self, ctx: ProxyContext, secrets: CertificateSource) -> None:
        self.ctx = ctx
        self.secrets = secrets
        self.settings = HboneSettings.from_config(ctx.config)
        cfg = ctx.config
        self.flood_limits = h2.FloodLimits(
            control_frames=cfg.h2_max_control_frames,
            window_updates=cfg.h2_max_window_updates,
            empty_frames=cfg.h2_max_empty_frames,
            early_resets=cfg.h2_max_early_resets,
            max_continuations=cfg.h2_max_continuations,
        )
        self.connections: set[HboneConnection] = set()
        self._warned = 0.0
        self._suppressed = 0
        self._starter = _FairStarter()

    def _guard(self, reason: str) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.guard_event(reason)

    def _early_failure(
        self, src: SocketAddr, dst: SocketAddr, reason: str, error: BaseException | str
    ) -> None:
        """The connection ends before any stream: Rust's ``log_early_deny`` line, and a count."""
        log_failed(
            "inbound", src, dst, error if isinstance(error, BaseException) else Exception(error)
        )
        self._guard(reason)

    def _rate_limited_warning(self, msg: str, *args: object) -> None:
        """At most one such line a second (a hostile peer must not flood the log)."""
        now = time.monotonic()
        if now - self._warned < 1.0:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} similar suppressed)"
            self._suppressed = 0
        self._warned = now
        log.warning(msg, *args)

    def send_goaway(self) -> None:
        """Drain: tell every peer to open no new streams here."""
        for conn in list(self.connections):
            conn.send_goaway()

    def close_revoked(self, crl: CrlManager) -> int:
        """After a CRL reload: close every connection whose peer's verified chain (leaf or an
        intermediate) is now revoked (Rust ``RevocationIndex::navigate``, then the h2 server
        shuts the connection down); their streams end with ``certificate revoked`` (flag
        CERT_REVOKED). Returns how many."""
        closed = 0
        for conn in list(self.connections):
            if conn.closed.done() or not crl.revoked_chain(conn.peer_der, conn.peer_chain):
                continue
            crl.rejected("destination", f"{conn.peer_identity} (live connection)")
            conn.close(CertificateRevoked())
            closed += 1
        return closed

    async def handle(self, sock: socket.socket, peer: tuple[Any, ...] | None = None) -> None:
        """Serve one accepted connection; ``peer`` is the address accept() returned."""
        ctx = self.ctx
        try:
            src, arrival = peer_addr(sock), local_addr(sock)
        except OSError as e:  # reset before we got to it: still one access-log line
            src = _UNKNOWN_PEER
            with contextlib.suppress(ValueError, IndexError, TypeError, AssertionError):
                if peer is not None:
                    src = SocketAddr.from_sockaddr(peer)
            dst = _UNKNOWN_PEER
            with contextlib.suppress(OSError):
                dst = local_addr(sock)
            self._early_failure(src, dst, "tcp", e)
            return
        identity = ctx.local_identity()
        if identity is None:
            self._early_failure(src, arrival, "no_identity", "no local identity")
            return
        try:
            cert = await self.secrets.fetch_certificate(identity)
            crl = crl_of(cert)
            crl_generation = crl.generation if crl is not None else 0
            sslobj, inbio, outbio, chain = await tls_handshake(
                sock, server_context(cert), server_side=True, require_alpn=b"h2"
            )
            peer_der = sslobj.getpeercert(binary_form=True) or b""
            peer_id = verify_client_trust_domain(peer_der, cert.identity.trust_domain)
        except (CertificateError, TlsIdentityError) as e:
            self._early_failure(src, arrival, "identity", e)
            return
        except AlpnRefused as e:
            self._early_failure(src, arrival, "alpn", e)
            return
        except (ssl.SSLError, OSError, HboneError, TimeoutError) as e:
            self._early_failure(
                src, arrival, "tls", f"TLS handshake failed: {e or type(e).__name__}"
            )
            return
        tasks: dict[asyncio.Task[None], int] = {}  # stream task -> its stream id
        # Stream tasks not yet bridged (admission, upstream connect) -> their record, if any:
        # once the connection is gone nobody can be answered, so they are cancelled.
        unbridged: dict[asyncio.Task[None], ConnectionRecord | None] = {}
        loop = asyncio.get_running_loop()
        # Shared by the connection's stream tasks and their done callbacks (see Listener).
        context = contextvars.copy_context()
        budget = ctx.sockets.budget

        def done(t: asyncio.Task[None]) -> None:  # (one per connection, not per stream)
            sid = tasks.pop(t)
            unbridged.pop(t, None)
            conn.release_stream(sid)  # the stream stops counting only now

        def on_request(conn: HboneConnection, ev: h2.RequestReceived) -> None:
            sid = ev.stream_id
            if budget.under_pressure:
                # Within the fd reserve: refuse before any work (the client may retry).
                conn.abandon(sid)
                conn.refuse(sid)
                conn.release_stream(sid)
                self._guard("fd_budget_stream")
                return

            def start() -> None:
                if conn.closed.done():
                    return  # (gone while queued)
                task = loop.create_task(
                    self._serve(conn, ev, src, arrival.ip, peer_id, unbridged), context=context
                )
                tasks[task] = sid
                unbridged[task] = None
                task.add_done_callback(done, context=context)

            self._starter.submit(start)

        h2c = h2.H2Connection(
            client=False,
            initial_window_size=self.settings.stream_window,
            connection_window_size=self.settings.connection_window,
            max_frame_size=self.settings.frame_size,
            max_concurrent_streams=200,
            limits=self.flood_limits,
            hold_streams=True,
        )
        # Had the callback recorded no chain, our own CA certificates (which a mesh peer's
        # chain shares) stand in for it in re-checks: not tracked, for the CRL metrics.
        if not chain:
            if crl is not None:
                crl.untracked("destination", str(peer_id))
            chain = (*cert.intermediates, *cert.roots)
        conn = HboneConnection(
            sock,
            sslobj,
            inbio,
            outbio,
            h2c,
            on_request=on_request,
            peer_chain=chain,
            budget=self.settings.budget(),
        )
        self.connections.add(conn)
        if (
            crl is not None
            and crl.generation != crl_generation
            and crl.revoked_chain(conn.peer_der, chain)
        ):
            # The CRLs changed during the handshake, after its check and before the reload's
            # re-check could see this connection (Rust ``revoked_after_reload``).
            crl.rejected("destination", f"{peer_id} (reload during the handshake)")
            conn.close(CertificateRevoked())
        try:
            await asyncio.shield(conn.closed)
            if conn.protocol_error is not None:
                flood = conn.protocol_error.error_code == h2.ErrorCode.ENHANCE_YOUR_CALM
                self._guard("h2_flood" if flood else "h2_protocol_error")
                self._rate_limited_warning(
                    "inbound HBONE connection from %s closed with GOAWAY: %s",
                    src,
                    conn.protocol_error,
                )
            elif conn.error is not None and not isinstance(conn.error, HboneError):
                log.debug("inbound HBONE connection from %s ended: %s", src, conn.error)
            for t, rec in list(unbridged.items()):
                if rec is not None:
                    rec.close_reason = "HBONE connection closed before the stream was served"
                t.cancel()
            if tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        except asyncio.CancelledError:
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
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
        unbridged: dict[asyncio.Task[None], ConnectionRecord | None],
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
        task = asyncio.current_task()
        ctx = self.ctx
        with ctx.tracked(rec):
            if task in unbridged:
                unbridged[task] = rec
            try:
                upstream = await self._connect_app(rec, tunnel)
            except ProxyError as e:
                _reject(conn, sid, src, 503, e, rec)
                return
            finally:
                unbridged.pop(task, None)  # type: ignore[arg-type]
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
            _reject(conn, sid, src, 503, ctx.unknown_local_workload(), arrival=arrival)
            return None
        network = ctx.config.network
        try:
            validate_destination(ctx.state, network, arrival, local, target)
            decided = find_inbound_upstream(
                ctx.state, network, arrival, local, target, ctx.config.illegal_ports
            )
        except ProxyError as e:
            _reject(conn, sid, src, e.status, e, arrival=arrival)
            return None
        # Rust build_inbound_request: a request that crossed a network gateway (the inner CONNECT
        # of double HBONE names another origin network) comes from an address that means
        # nothing here: the source is known only from its baggage.
        origin = header_value(ev.headers, X_FORWARDED_NETWORK)
        from_gateway = origin is not None and origin.lower() != network.lower()
        src_workload: Workload | None = None
        if not from_gateway:
            src_addr = NetworkAddress(network, src.ip)
            src_workload = ctx.state.find_workload_by_addr(src_addr)
            if src_workload is None and ctx.state.demander is not None:
                # Rust fetch_workload_by_address: with on-demand xDS the source is fetched too
                found = await ctx.state.fetch_address(src_addr)
                src_workload = found if isinstance(found, Workload) else None
        rec = ConnectionRecord(
            "inbound",
            src,
            decided.upstream,
            hbone_addr=target,
            src_workload=src_workload,
            dst_workload=local,
            dst_service=decided.services[0] if isinstance(target, HostnameAuthority) else None,
            src_identity=peer_id,
            dst_identity=ctx.local_identity(),
            counters=CopyCounters(),
        )
        ctx.open_metrics(
            rec,
            mtls=True,
            baggage=parse_baggage(header_value(ev.headers, BAGGAGE)),
            for_host=forwarded_host(header_value(ev.headers, FORWARDED)),
        )
        try:
            ctx.authorize(rec, local)
        except AuthorizationDenied as e:
            _reject(conn, sid, src, 401, e, rec)
            return None
        return rec, decided

    def _response_headers(self, local: Workload | None) -> list[tuple[str, str]]:
        cfg = self.ctx.config
        if local is not None and cfg.enable_response_baggage and (value := baggage(local)):
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
    if status == 400:
        conn.charge()  # a malformed request counts against the peer's budget
    if rec is not None:
        rec.log_complete(why)
    elif arrival is not None:
        log_failed("inbound", src, SocketAddr(arrival, HBONE_PORT), why)
    else:
        log.warning(
            "inbound HBONE request rejected",
            extra={"fields": {"src.addr": str(src), "status": status, "error": str(why)}},
        )
