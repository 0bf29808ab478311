"""Executes an HBONE route: pooled mTLS HTTP/2 connection to <ip>:15008, CONNECT, then copy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass

from ztunnel.config import Config
from ztunnel.core.errors import (
    CertificateRevoked,
    H2Failure,
    HboneRejected,
    IdentityError,
    ProxyError,
    ResponseFlag,
    TlsFailure,
    UpstreamConnectError,
)
from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.budget import DEFAULT_BUDGET, BufferBudget
from ztunnel.hbone.headers import (
    BAGGAGE,
    X_FORWARDED_NETWORK,
    header_value,
    parse_baggage,
    request_headers,
)
from ztunnel.hbone.pool import ConnectionPool, WorkloadKey
from ztunnel.hbone.transport import HboneConnection, HboneError, StreamRefused, tls_handshake
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.manager import CertificateError, CertificateSource
from ztunnel.identity.osslverify import VerifiedChain
from ztunnel.identity.tls import (
    TlsIdentityError,
    client_context,
    crl_of,
    peer_identity,
    verify_server_identity,
)
from ztunnel.net.copy import CopyCounters
from ztunnel.proxy.context import ConnectionRecord
from ztunnel.proxy.route import Route, RouteKind
from ztunnel.proxy.sockets import SocketFactory

log = logging.getLogger("ztunnel.proxy.hbone")

# A stream the peer did not process (RST_STREAM REFUSED_STREAM, above a GOAWAY's last stream id)
# is tried again on another pooled connection (RFC 9113 8.7), at most this many times.
REFUSED_STREAM_RETRIES = 2


class NetworkPolicyError(UpstreamConnectError):
    flag = ResponseFlag.NETWORK_POLICY


@dataclass
class HboneSettings:
    stream_window: int
    connection_window: int
    frame_size: int
    buffer_budget: int = DEFAULT_BUDGET  # this process's share of ZTUNNEL_H2_BUFFER_BUDGET

    @classmethod
    def from_config(cls, cfg: Config) -> HboneSettings:
        return cls(
            cfg.http2_stream_window_size,
            cfg.http2_connection_window_size,
            cfg.http2_frame_size,
            # Split evenly: each worker process runs its own loop and budget (ARCHITECTURE.md).
            max(1, cfg.h2_buffer_budget // max(1, cfg.num_worker_threads)),
        )

    def budget(self) -> BufferBudget:
        """The budget every HBONE connection of this process (its loop) holds bytes against."""
        return BufferBudget.of_loop(asyncio.get_running_loop(), self.buffer_budget)


async def dial_hbone(
    sockets: SocketFactory,
    secrets: CertificateSource,
    settings: HboneSettings,
    key: WorkloadKey,
) -> HboneConnection:
    """TCP connect, TLS 1.3 handshake as ``key.src_identity``, check the server's SAN, start h2."""
    cert = await secrets.fetch_certificate(key.src_identity)
    try:
        sock = await sockets.connect(key.dst)
    except UpstreamConnectError as e:
        if "timed out" in str(e):
            raise NetworkPolicyError(
                f"connection timed out, maybe a NetworkPolicy is blocking HBONE port {key.dst.port}"
            ) from None
        raise
    crl = crl_of(cert)
    crl_generation = crl.generation if crl is not None else 0
    try:
        sslobj, inbio, outbio, chain = await tls_handshake(
            sock, client_context(cert), server_side=False
        )
        if sslobj.selected_alpn_protocol() != "h2":
            raise H2Failure(f"server at {key.dst} did not negotiate ALPN h2")
        peer_der = sslobj.getpeercert(binary_form=True) or b""
        verify_server_identity(peer_der, key.dst_identities)
        chain = _recheck_new(crl, crl_generation, peer_der, chain, cert)
    except TlsIdentityError as e:
        sock.close()
        raise IdentityError(
            f"{e} (expected one of {', '.join(map(str, key.dst_identities))})"
        ) from None
    except (ssl.SSLError, OSError, HboneError, TimeoutError) as e:
        sock.close()
        raise TlsFailure(f"TLS handshake with {key.dst} failed: {e}") from None
    except BaseException:
        sock.close()
        raise
    h2c = h2.H2Connection(
        client=True,
        initial_window_size=settings.stream_window,
        connection_window_size=settings.connection_window,
        max_frame_size=settings.frame_size,
    )
    return HboneConnection(
        sock, sslobj, inbio, outbio, h2c, peer_chain=chain, budget=settings.budget()
    )


def _recheck_new(
    crl: CrlManager | None,
    generation: int,
    peer_der: bytes,
    chain: VerifiedChain,
    cert: WorkloadCertificate,
) -> VerifiedChain:
    """The chain a new connection is re-checked against after CRL reloads (had the callback
    recorded none, our own CA certificates, which a mesh peer's chain shares); refuses the
    connection when the CRLs changed during its handshake and now revoke it (Rust
    ``revoked_after_reload``: the reload's own re-check could not see it yet)."""
    if not chain:
        if crl is not None:  # (not tracked by its own chain: counted, as Rust's untracked)
            crl.untracked("source", f"{peer_identity(peer_der)}")
        chain = (*cert.intermediates, *cert.roots)
    if crl is not None and crl.generation != generation and crl.revoked_chain(peer_der, chain):
        crl.rejected("source", f"{peer_identity(peer_der)} (reload during the handshake)")
        raise CertificateRevoked()
    return chain


class HboneConnector:
    """Outbound HBONE for one proxy instance (one pod): its pool and its certificates."""

    def __init__(
        self,
        config: Config,
        sockets: SocketFactory,
        secrets: CertificateSource,
        pool: ConnectionPool | None = None,
    ) -> None:
        self.config = config
        self.secrets = secrets
        self.settings = settings = HboneSettings.from_config(config)
        # double HBONE: inner connection -> the task carrying its outer stream; every carrier
        # task is held here until it ends (the loop keeps only weak references to tasks)
        self._carriers: dict[HboneConnection, asyncio.Task[None]] = {}
        self._carrier_tasks: set[asyncio.Task[None]] = set()
        self.pool = pool or ConnectionPool(
            lambda key: dial_hbone(sockets, secrets, settings, key),
            max_streams=config.pool_max_streams_per_connection,
            idle_timeout=config.pool_unused_release_timeout.total_seconds(),
        )

    async def open_stream(
        self, route: Route, rec: ConnectionRecord
    ) -> tuple[HboneConnection, int] | None:
        """CONNECT to ``route`` over a pooled connection: the connection and the stream id once
        the peer answered 200, or None when that failed (logged as the connection's outcome).

        On success the caller bridges the stream (``conn.bridge``: in its own frame, so that no
        extra coroutine frame stays alive for the whole connection), logs the outcome, and
        calls :meth:`stream_done` in any case.

        A DOUBLE_HBONE route gets an inner connection of its own, end to end with the
        destination, carried by a stream of the pooled connection to the network gateway."""
        source = rec.src_workload
        if source is None:
            rec.log_complete("unknown source workload: cannot pick a certificate for HBONE")
            return None
        assert route.authority is not None
        src_id: Identity = source.identity
        rec.src_identity = src_id
        key = WorkloadKey(src_id, route.expected_identities, rec.src.ip, route.target)
        headers = self._headers(route, rec)
        refused: list[HboneConnection] = []  # (a handful at most: REFUSED_STREAM_RETRIES)
        while True:
            try:
                conn = await self.pool.checkout(key, avoid=refused)
            except (ProxyError, CertificateError) as e:
                rec.log_complete(e)
                return None
            retry = len(refused) < REFUSED_STREAM_RETRIES
            try:
                resp = await self._connect(conn, route, headers, rec, reserved=True, retry=retry)
            except StreamRefused as e:
                self.pool.stream_done(conn)
                log.debug("CONNECT to %s not processed (%s): retrying", route.authority, e)
                refused.append(conn)
                continue
            except BaseException:
                self.pool.stream_done(conn)
                raise
            if resp is None:
                self.pool.stream_done(conn)
                return None
            sid = resp.stream_id
            break
        if route.kind is not RouteKind.DOUBLE_HBONE:
            rec.dst_identity = _peer(conn)
            return conn, sid
        return await self._open_inner(conn, sid, route, rec, headers)

    def _headers(self, route: Route, rec: ConnectionRecord) -> list[tuple[str, str]]:
        return request_headers(
            rec.src_workload,
            rec.src,
            service_hostname=route.destination_service.hostname
            if route.destination_service
            else None,
        )

    async def _connect(
        self,
        conn: HboneConnection,
        route: Route,
        headers: list[tuple[str, str]],
        rec: ConnectionRecord,
        *,
        reserved: bool = False,
        retry: bool = False,
    ) -> h2.ResponseReceived | None:
        """Send the CONNECT on ``conn``: the response once the peer answered 200, else None
        (logged as the connection's outcome, the stream reset or abandoned). With ``retry``, a
        stream the peer did not process raises :class:`StreamRefused` instead (nothing logged:
        the caller tries another connection)."""
        try:
            sid, resp = await conn.open_stream(str(route.authority), headers, reserved=reserved)
        except StreamRefused as e:
            if retry:
                raise
            rec.log_complete(H2Failure(f"CONNECT to {route.authority} failed: {e}"))
            return None
        except (HboneError, h2.ProtocolError) as e:
            rec.log_complete(H2Failure(f"CONNECT to {route.authority} failed: {e}"))
            return None
        if resp.status != 200:
            rec.log_complete(HboneRejected(route.authority, resp.status))
            conn.abandon(sid)
            if conn.h2.stream_is_open(sid):
                conn.h2.reset_stream(sid, h2.ErrorCode.CANCEL)
                conn.flush()
            return None
        return resp

    async def _open_inner(
        self,
        outer: HboneConnection,
        outer_sid: int,
        route: Route,
        rec: ConnectionRecord,
        headers: list[tuple[str, str]],
    ) -> tuple[HboneConnection, int] | None:
        """Rust proxy_to_double_hbone: TLS with the final destination's identity and HTTP/2 over
        the outer stream (not pooled: each connection may reach another remote workload), then
        the same CONNECT again with ``x-forwarded-network``. The outer stream is bridged to one
        end of a socket pair and the inner connection runs on the other, as on any socket."""
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        far.setblocking(False)
        carrier = asyncio.get_running_loop().create_task(self._carry(outer, outer_sid, far))
        self._carrier_tasks.add(carrier)
        carrier.add_done_callback(self._carrier_tasks.discard)
        inner: HboneConnection | None = None
        try:
            assert rec.src_identity is not None
            cert = await self.secrets.fetch_certificate(rec.src_identity)
            crl = crl_of(cert)
            crl_generation = crl.generation if crl is not None else 0
            try:
                sslobj, inbio, outbio, chain = await tls_handshake(
                    near, client_context(cert), server_side=False
                )
                if sslobj.selected_alpn_protocol() != "h2":
                    raise H2Failure(f"{route.authority} did not negotiate ALPN h2 (inner tunnel)")
                peer_der = sslobj.getpeercert(binary_form=True) or b""
                verify_server_identity(peer_der, route.final_identities)
                chain = _recheck_new(crl, crl_generation, peer_der, chain, cert)
            except TlsIdentityError as e:
                raise IdentityError(
                    f"{e} (inner tunnel; expected one of "
                    f"{', '.join(map(str, route.final_identities))})"
                ) from None
            except (ssl.SSLError, OSError, HboneError, TimeoutError) as e:
                raise TlsFailure(
                    f"inner TLS handshake with {route.authority} failed: {e}"
                ) from None
            h2c = h2.H2Connection(
                client=True,
                initial_window_size=self.settings.stream_window,
                connection_window_size=self.settings.connection_window,
                max_frame_size=self.settings.frame_size,
            )
            inner = HboneConnection(
                near, sslobj, inbio, outbio, h2c, peer_chain=chain, budget=self.settings.budget()
            )
            inner_headers = [*headers, (X_FORWARDED_NETWORK, self.config.network)]
            resp = await self._connect(inner, route, inner_headers, rec)
            if resp is None:
                inner.close()  # the carrier then sees EOF and ends the outer stream
                return None
        except (ProxyError, CertificateError) as e:
            rec.log_complete(e)
            _drop(inner, near)
            return None
        except BaseException:
            _drop(inner, near)
            raise
        rec.dst_identity = _peer(inner)
        # Rust with_derived_destination: the destination workload is known from the inner
        # response's baggage only (the gateway's view of it is all state has).
        if (bag := header_value(resp.headers, BAGGAGE)) is not None:
            rec.dst_derived = parse_baggage(bag)
        if rec.open_deferred is not None:
            rec.open_deferred()
            rec.open_deferred = None
        self._carriers[inner] = carrier
        return inner, resp.stream_id

    async def _carry(self, outer: HboneConnection, sid: int, sock: socket.socket) -> None:
        """The outer stream of a double-HBONE connection, for as long as its inner one lives
        (it ends when the inner connection closes its end of the pair)."""
        try:
            await outer.bridge(sid, sock, CopyCounters())
        finally:
            self.pool.stream_done(outer)

    def close_revoked(self, crl: CrlManager) -> int:
        """After a CRL reload: close every outbound connection (pooled, and the inner ones of
        double HBONE) whose server's verified chain is now revoked (Rust: the pool's and
        double HBONE's ``RevocationHandle``s, then the h2 client tears the tunnel down); their
        streams end with ``certificate revoked`` (flag CERT_REVOKED). Returns how many."""
        closed = 0
        for conn in [*self.pool.connections(), *self._carriers]:
            if conn.closed.done() or not crl.revoked_chain(conn.peer_der, conn.peer_chain):
                continue
            crl.rejected("source", f"{conn.peer_identity} (live connection)")
            conn.close(CertificateRevoked())
            closed += 1
        return closed

    def stream_done(self, conn: HboneConnection) -> None:
        """A stream from :meth:`open_stream` is over: give its slot back to the pool (for
        double HBONE: close the inner connection; its outer stream then ends by itself)."""
        if self._carriers.pop(conn, None) is not None:
            conn.close()
            return
        self.pool.stream_done(conn)


def _drop(inner: HboneConnection | None, near: socket.socket) -> None:
    """Give up on an inner connection: closing our end of the pair ends the carrier's bridge
    (EOF, then EPIPE), which ends the outer stream and returns its pool slot. The carrier is
    not cancelled: a task cancelled before it first runs would skip its ``finally``."""
    if inner is not None:
        inner.close()
    else:
        with contextlib.suppress(OSError):
            near.close()


def _peer(conn: HboneConnection) -> Identity | None:
    return conn.peer_identity
