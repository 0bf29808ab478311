"""Typed proxy errors. Each carries the metric response flag and, inbound, the HTTP status."""

from __future__ import annotations

import enum
import errno


class ResponseFlag(enum.Enum):
    """The ``response_flags`` metric label values (reference 6.1)."""

    NONE = "-"
    DENY = "DENY"
    CONNECT = "CONNECT"
    TLS_FAILURE = "TLS_FAILURE"
    H2_HANDSHAKE_FAILURE = "H2_HANDSHAKE_FAILURE"
    NETWORK_POLICY = "NETWORK_POLICY"
    IDENTITY_ERROR = "IDENTITY_ERROR"
    CERT_REVOKED = "CERT_REVOKED"


class ProxyError(Exception):
    """A connection-level failure: logged once, counted, never crashes a listener."""

    flag: ResponseFlag = ResponseFlag.NONE
    status: int = 503  # what an HBONE server answers for it

    def __init__(self, message: str) -> None:
        super().__init__(message)


class SelfCallError(ProxyError):
    status = 400

    def __init__(self, target: object) -> None:
        super().__init__(f"call to ztunnel's own port refused: {target}")


class NoHealthyUpstream(ProxyError):
    def __init__(self, service: str) -> None:
        super().__init__(f"no healthy upstream for service {service}")


class UnsupportedRoute(ProxyError):
    pass


class UnknownWaypoint(ProxyError):
    """A service's or workload's waypoint is not in state, or has no usable endpoint (Rust
    ``Error::UnknownWaypoint``, from ``fetch_waypoint``)."""

    def __init__(self, waypoint: str) -> None:
        super().__init__(f"unknown waypoint: waypoint {waypoint} not found")


class NoValidDestination(ProxyError):
    """Rust ``Error::NoValidDestination``: nowhere to send a connection to this workload."""


class UnknownNetworkGateway(ProxyError):
    """A remote workload's network gateway is not in state (Rust ``Error::UnknownNetworkGateway``,
    from ``fetch_network_gateway``)."""

    def __init__(self, gateway: str) -> None:
        super().__init__(f"unknown network gateway: network gateway {gateway} not found")


class UpstreamConnectError(ProxyError):
    flag = ResponseFlag.CONNECT
    status = 503


class HboneRejected(ProxyError):
    """The HBONE server answered our CONNECT with a status other than 200 (401: its policies
    refused us; 503: it could not reach the application)."""

    def __init__(self, authority: object, status: int) -> None:
        super().__init__(f"HBONE CONNECT to {authority} failed with status {status}")
        self.peer_status = status


class AuthorizationDenied(ProxyError):
    flag = ResponseFlag.DENY
    status = 401


class IdentityError(ProxyError):
    flag = ResponseFlag.IDENTITY_ERROR


class TlsFailure(ProxyError):
    flag = ResponseFlag.TLS_FAILURE


class H2Failure(ProxyError):
    flag = ResponseFlag.H2_HANDSHAKE_FAILURE


class CertificateRevoked(ProxyError):
    """The peer's certificate was revoked by a CRL reload while the connection was up (Rust
    ``Error::CertificateRevoked``, response flag CERT_REVOKED)."""

    flag = ResponseFlag.CERT_REVOKED

    def __init__(self) -> None:
        super().__init__("certificate revoked")


_DISCONNECT_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN})


def reportable(error: BaseException | None) -> BaseException | None:
    """A peer resetting or vanishing is a normal end of a proxied connection, as in ztunnel's
    copy.rs: it is not logged or counted as an error."""
    if isinstance(error, OSError) and error.errno in _DISCONNECT_ERRNOS:
        return None
    return error
