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
    """Rust ``Error::SelfCall``: a connection to one of ztunnel's own ports."""

    status = 400

    def __init__(self, target: object = None) -> None:
        super().__init__("attempted recursive call to ourselves")
        self.target = target


class NoHealthyUpstream(ProxyError):
    """Rust ``Error::NoHealthyUpstream``: a service with no usable endpoint; ``target`` is the
    address the client asked for (the VIP and port)."""

    def __init__(self, target: object) -> None:
        super().__init__(f"no healthy upstream: {target}")


class UnknownLocalWorkload(ProxyError):
    """Rust ``Error::UnknownSourceWorkload``: the workload this proxy serves is not in state
    (after waiting for it), named as Rust's ``WorkloadInfo`` displays it."""

    def __init__(self, namespace: str, name: str, service_account: str) -> None:
        super().__init__(
            "failed to fetch information about local workload: "
            f"{service_account}.{namespace} ({name})"
        )


class PolicyLateRejection(ProxyError):
    """Rust ``Error::AuthorizationPolicyLateRejection``: a live connection closed because the
    policies changed and no longer allow it (response flag DENY)."""

    flag = ResponseFlag.DENY
    status = 401

    def __init__(self) -> None:
        super().__init__("connection closed due to policy change")


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
