"""Executes an HBONE route: pooled mTLS HTTP/2 connection to <ip>:15008, CONNECT, then copy."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

from ztunnel.config import Config
from ztunnel.core.errors import (
    H2Failure,
    IdentityError,
    ProxyError,
    ResponseFlag,
    TlsFailure,
    UpstreamConnectError,
)
from ztunnel.core.identity import Identity
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.headers import request_headers
from ztunnel.hbone.pool import ConnectionPool, WorkloadKey
from ztunnel.hbone.transport import HboneConnection, HboneError, tls_handshake
from ztunnel.identity.manager import CertificateError, SecretManager
from ztunnel.identity.tls import (
    TlsIdentityError,
    client_context,
    verify_server_identity,
)
from ztunnel.proxy.context import ConnectionRecord
from ztunnel.proxy.route import Route
from ztunnel.proxy.sockets import SocketFactory

log = logging.getLogger("ztunnel.proxy.hbone")


class NetworkPolicyError(UpstreamConnectError):
    flag = ResponseFlag.NETWORK_POLICY


@dataclass
class HboneSettings:
    stream_window: int
    connection_window: int
    frame_size: int

    @classmethod
    def from_config(cls, cfg: Config) -> HboneSettings:
        return cls(
            cfg.http2_stream_window_size, cfg.http2_connection_window_size, cfg.http2_frame_size
        )


async def dial_hbone(
    sockets: SocketFactory,
    secrets: SecretManager,
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
    try:
        sslobj, inbio, outbio = await tls_handshake(sock, client_context(cert), server_side=False)
        if sslobj.selected_alpn_protocol() != "h2":
            raise H2Failure(f"server at {key.dst} did not negotiate ALPN h2")
        peer_der = sslobj.getpeercert(binary_form=True) or b""
        verify_server_identity(peer_der, key.dst_identities)
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
    return HboneConnection(sock, sslobj, inbio, outbio, h2c)


class HboneConnector:
    """Outbound HBONE for one proxy instance (one pod): its pool and its certificates."""

    def __init__(
        self,
        config: Config,
        sockets: SocketFactory,
        secrets: SecretManager,
        pool: ConnectionPool | None = None,
    ) -> None:
        self.config = config
        self.secrets = secrets
        settings = HboneSettings.from_config(config)
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
        calls :meth:`stream_done` in any case."""
        source = rec.src_workload
        if source is None:
            rec.log_complete("unknown source workload: cannot pick a certificate for HBONE")
            return None
        assert route.authority is not None
        src_id: Identity = source.identity
        rec.src_identity = src_id
        try:
            conn = await self.pool.checkout(
                WorkloadKey(src_id, route.expected_identities, rec.src.ip, route.target)
            )
        except (ProxyError, CertificateError) as e:
            rec.log_complete(e)
            return None
        try:
            headers = request_headers(
                source,
                rec.src,
                cluster_id=self.config.cluster_id,
                service_hostname=route.destination_service.hostname
                if route.destination_service
                else None,
            )
            try:
                sid, resp = await conn.open_stream(str(route.authority), headers, reserved=True)
            except (HboneError, h2.ProtocolError) as e:
                rec.log_complete(H2Failure(f"CONNECT to {route.authority} failed: {e}"))
                self.pool.stream_done(conn)
                return None
            rec.dst_identity = _peer(conn)
            if resp.status != 200:
                rec.log_complete(
                    f"HBONE CONNECT to {route.authority} failed with status {resp.status}"
                )
                conn.abandon(sid)
                if conn.h2.stream_is_open(sid):
                    conn.h2.reset_stream(sid, h2.ErrorCode.CANCEL)
                    conn.flush()
                self.pool.stream_done(conn)
                return None
        except BaseException:
            self.pool.stream_done(conn)
            raise
        return conn, sid

    def stream_done(self, conn: HboneConnection) -> None:
        """A stream from :meth:`open_stream` is over: give its slot back to the pool."""
        self.pool.stream_done(conn)


def _peer(conn: HboneConnection) -> Identity | None:
    return conn.peer_identity
