"""Istio CA client: gets workload certificates from istiod's ``IstioCertificateService``.

A ``CertificateProvider`` for ``SecretManager`` (which owns renewal at half-life, backoff up to
150 s, single-flight and the limit of 8 concurrent requests; this class only makes one request).
Per istio/ztunnel ``src/identity/caclient.rs``: each ``sign`` makes a fresh ECDSA P-256 key and a
CSR with the SPIFFE id as its only URI SAN, calls ``CreateCertificate`` on ``CA_ADDRESS`` with
``validity_duration`` = ``SECRET_TTL`` in seconds and, in shared (node proxy) mode only, the
metadata ``{"ImpersonatedIdentity": "<spiffe id>"}``; calls carry the same ``authorization`` and
``clusterid`` metadata as xDS plus every ``CA_HEADER_*``. The response chain is leaf first, root
bundle last; a leaf for any other identity than the one asked is rejected.

One gRPC channel is kept and shared by concurrent requests (HTTP/2 multiplexing). It is rebuilt
when the ``CA_ROOT_CA`` file changes (root rotation); the token file is re-read on every call.
"""

from __future__ import annotations

import logging
import ssl
from datetime import timedelta

from cryptography.hazmat.primitives.asymmetric import ec
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.exceptions import GRPCError, StreamTerminatedError

from ztunnel.config import Config, ProxyMode
from ztunnel.core.identity import Identity
from ztunnel.xds.control import ControlPlaneError, ControlPlaneTarget
from ztunnel.xds.protos import ca_pb2

from .certs import WorkloadCertificate, build_csr, parse_pem_chain
from .manager import CertificateError, CertificateMismatch

__all__ = ["CA_METHOD", "CAError", "IstioCAClient"]

log = logging.getLogger(__name__)

_SERVICE = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"]
CA_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['CreateCertificate'].name}"
IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
DEFAULT_CALL_TIMEOUT = 30.0


class CAError(CertificateError):
    """The CA request failed (unreachable, refused, or an unusable response)."""


class IstioCAClient:
    """``CertificateProvider`` backed by istiod's CA (or anything serving the same RPC).

    ``impersonate``: send ``ImpersonatedIdentity`` (shared mode: ztunnel asks for the identities
    of the pods on its node with its own token). ``call_timeout`` bounds each RPC (gRPC deadline).
    Must be used from one event loop; ``close()`` releases the channel.
    """

    def __init__(
        self,
        target: ControlPlaneTarget,
        *,
        secret_ttl: timedelta,
        impersonate: bool,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        if secret_ttl.total_seconds() < 1:
            raise ValueError("secret_ttl must be at least one second")
        self.target = target
        self.secret_ttl = secret_ttl
        self.impersonate = impersonate
        self.call_timeout = call_timeout
        self._channel: Channel | None = None
        self._roots_fingerprint: tuple[int, int, int] | None = None

    @classmethod
    def from_config(cls, config: Config) -> IstioCAClient:
        """From ``CA_ADDRESS``, ``CA_ROOT_CA``, ``ALT_CA_HOSTNAME``, ``AUTH_TOKEN``,
        ``CLUSTER_ID``, ``CA_HEADER_*``, ``SECRET_TTL`` and ``PROXY_MODE``."""
        if config.ca_address is None:
            raise ValueError("CA_ADDRESS is not set: use the local CA")
        return cls(
            ControlPlaneTarget(
                address=config.ca_address,
                root_ca=config.ca_root_ca,
                alt_hostname=config.alt_ca_hostname,
                auth_token=config.auth_token,
                cluster_id=config.cluster_id,
                headers=config.ca_headers,
            ),
            secret_ttl=config.secret_ttl,
            impersonate=config.proxy_mode is ProxyMode.SHARED,
        )

    def build_request(self, identity: Identity, csr_pem: str) -> ca_pb2.IstioCertificateRequest:
        req = ca_pb2.IstioCertificateRequest(
            csr=csr_pem, validity_duration=int(self.secret_ttl.total_seconds())
        )
        if self.impersonate:
            req.metadata.fields[IMPERSONATED_IDENTITY].string_value = str(identity)
        return req

    async def sign(self, identity: Identity) -> WorkloadCertificate:
        """Request a certificate for ``identity``. Raises CAError, or CertificateMismatch when
        the CA signed another identity."""
        key, csr = build_csr(identity)
        req = self.build_request(identity, csr)
        try:
            metadata = self.target.metadata()
            method = UnaryUnaryMethod(
                self._get_channel(),
                CA_METHOD,
                ca_pb2.IstioCertificateRequest,
                ca_pb2.IstioCertificateResponse,
            )
            resp = await method(req, timeout=self.call_timeout, metadata=metadata)
        except GRPCError as e:
            raise CAError(
                f"CA {self.target.address} refused {identity}: {e.status.name} {e.message or ''}"
            ) from e
        except (ControlPlaneError, StreamTerminatedError, OSError, ssl.SSLError, TimeoutError) as e:
            # A broken connection is replaced on the next call (grpclib reconnects lazily).
            raise CAError(f"CA {self.target.address} unreachable: {type(e).__name__}: {e}") from e
        return self._certificate(identity, key, list(resp.cert_chain))

    def _certificate(
        self, identity: Identity, key: ec.EllipticCurvePrivateKey, chain: list[str]
    ) -> WorkloadCertificate:
        if not chain:
            raise CAError(f"CA returned an empty certificate chain for {identity}")
        try:
            parsed = parse_pem_chain(chain)
            cert = WorkloadCertificate(key, parsed.leaf, parsed.intermediates, parsed.roots)
        except (ValueError, TypeError) as e:
            raise CAError(f"CA returned an unusable certificate chain for {identity}: {e}") from e
        if cert.identity != identity:
            raise CertificateMismatch(
                f"CA returned a certificate for {cert.identity}, asked for {identity}"
            )
        return cert

    def _get_channel(self) -> Channel:
        fingerprint = self.target.roots_fingerprint()
        if self._channel is not None and fingerprint != self._roots_fingerprint:
            log.info("CA root certificates changed; reconnecting to %s", self.target.address)
            self._channel.close()
            self._channel = None
        if self._channel is None:
            self._channel = self.target.open_channel()
            self._roots_fingerprint = fingerprint
        return self._channel

    async def close(self) -> None:
        """Close the channel (idempotent); a later ``sign`` opens a new one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
