"""SPIFFE identities: ``spiffe://<trust domain>/ns/<namespace>/sa/<service account>``."""

from __future__ import annotations

from dataclasses import dataclass

SPIFFE_PREFIX = "spiffe://"


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    """A workload identity. ``str()`` gives the URI used in certificates."""

    trust_domain: str
    namespace: str
    service_account: str

    def __str__(self) -> str:
        return f"{SPIFFE_PREFIX}{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    @property
    def principal(self) -> str:
        """The form authorization policies compare against: the URI without ``spiffe://``."""
        return str(self)[len(SPIFFE_PREFIX) :]

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse exactly the ztunnel shape; anything else raises ValueError. As Rust's
        ``Identity::from_str`` (src/identity/manager.rs), the trust domain, namespace and
        service account may be empty (a local config workload without ``trustDomain`` or
        ``serviceAccount`` has such an identity)."""
        if not uri.startswith(SPIFFE_PREFIX):
            raise ValueError(f"identity {uri!r} does not start with {SPIFFE_PREFIX}")
        parts = uri[len(SPIFFE_PREFIX) :].split("/")
        if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa":
            raise ValueError(f"identity {uri!r} is not spiffe://<td>/ns/<ns>/sa/<sa>")
        return cls(parts[0], parts[2], parts[4])
