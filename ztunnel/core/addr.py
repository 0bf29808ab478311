"""IP and socket-address values, canonicalised the way ztunnel does (IPv4-mapped IPv6 -> IPv4)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TypeAlias

IPAddr: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNet: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network


def canonical_ip(ip: IPAddr) -> IPAddr:
    """Map an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) to plain IPv4."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_ip(text: str) -> IPAddr:
    """Parse an IP address; raises ValueError with the offending text."""
    try:
        return canonical_ip(ipaddress.ip_address(text.strip()))
    except ValueError:
        raise ValueError(f"invalid IP address {text!r}") from None


def ip_from_bytes(raw: bytes) -> IPAddr:
    """Decode 4 or 16 raw bytes (the xDS wire form) into an address."""
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return canonical_ip(ipaddress.IPv6Address(raw))
    raise ValueError(f"IP address must be 4 or 16 bytes, got {len(raw)}")


@dataclass(frozen=True, slots=True, order=True)
class SocketAddr:
    """An IP and a port. ``str()`` gives ``1.2.3.4:80`` or ``[::1]:80``, the HBONE authority form."""

    ip: IPAddr
    port: int

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range 0-65535")

    def __str__(self) -> str:
        if self.ip.version == 6:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"

    @property
    def family(self) -> int:
        import socket

        return socket.AF_INET6 if self.ip.version == 6 else socket.AF_INET

    def sockaddr(self) -> tuple[str, int]:
        """The tuple form the socket module takes for connect/bind."""
        return (str(self.ip), self.port)

    @classmethod
    def parse(cls, text: str) -> SocketAddr:
        """Parse ``ip:port`` or ``[v6]:port``. Raises ValueError on anything else."""
        text = text.strip()
        if text.startswith("["):
            end = text.find("]")
            if end < 0 or not text[end + 1 :].startswith(":"):
                raise ValueError(f"invalid socket address {text!r}")
            host, port_text = text[1:end], text[end + 2 :]
            if ":" not in host:
                raise ValueError(f"invalid socket address {text!r}: brackets need IPv6")
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep or ":" in host:
                raise ValueError(f"invalid socket address {text!r}")
        if not port_text.isdigit():
            raise ValueError(f"invalid port in socket address {text!r}")
        return cls(parse_ip(host), int(port_text))

    @classmethod
    def from_sockaddr(cls, sa: tuple[object, ...]) -> SocketAddr:
        """Build from what ``socket.getpeername()`` and friends return."""
        host, port = sa[0], sa[1]
        assert isinstance(host, str) and isinstance(port, int)
        return cls(parse_ip(host.split("%", 1)[0]), port)


@dataclass(frozen=True, slots=True)
class HostnameAuthority:
    """An HBONE CONNECT to ``<service hostname>:<service port>`` rather than to an address (Rust
    ``HboneAddress::SvcHostname``). ``str()`` is the authority form."""

    hostname: str
    port: int

    def __str__(self) -> str:
        return f"{self.hostname}:{self.port}"
