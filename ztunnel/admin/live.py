"""``/debug/connections`` (ours, beyond Rust): every live connection with what ``ztunnel top``
shows: identities, workloads, service, age and the live byte counts. Pure.

The Rust-shaped view of the same connections is ``/config_dump``'s ``workloadState`` (see
:func:`ztunnel.admin.config_dump.connections`); this one carries what that shape has no room for.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

from ztunnel.core.addr import HostnameAuthority, SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.state.model import Service, Workload


class LiveConnection(Protocol):
    """What is read from a ``ztunnel.proxy.context.ConnectionRecord``."""

    @property
    def direction(self) -> str: ...
    @property
    def src(self) -> SocketAddr: ...
    @property
    def dst(self) -> SocketAddr: ...
    @property
    def orig_dst(self) -> SocketAddr | None: ...
    @property
    def hbone_addr(self) -> SocketAddr | HostnameAuthority | None: ...
    @property
    def mtls(self) -> bool: ...
    @property
    def double_hbone(self) -> bool: ...
    @property
    def src_identity(self) -> Identity | None: ...
    @property
    def dst_identity(self) -> Identity | None: ...
    @property
    def src_workload(self) -> Workload | None: ...
    @property
    def dst_workload(self) -> Workload | None: ...
    @property
    def dst_service(self) -> Service | None: ...
    @property
    def started(self) -> float: ...

    def live_bytes(self) -> tuple[int, int]: ...


def _name(w: Workload | None) -> str | None:
    return f"{w.namespace}/{w.name}" if w is not None else None


def row_id(rec: LiveConnection, prefix: str = "") -> str:
    """Stable for the connection's life, unique in the process (``prefix``: across workers)."""
    return f"{prefix}{id(rec):x}-{int(rec.started * 1e6):x}"


def row(proxy: str, rec: LiveConnection, now: float) -> dict[str, Any]:
    """One connection. ``id`` is stable for the connection's life (for rates between polls);
    ``bytesSent``/``bytesRecv`` are from the local pod's side, as the access log counts them."""
    sent, recv = rec.live_bytes()
    dst_identity = rec.dst_identity
    if dst_identity is None and rec.mtls and rec.dst_workload is not None:
        dst_identity = rec.dst_workload.identity
    return {
        "id": getattr(rec, "row_id", None) or row_id(rec),
        "proxy": proxy,
        "direction": rec.direction,
        "protocol": "DOUBLEHBONE" if rec.double_hbone else "HBONE" if rec.mtls else "TCP",
        "src": str(rec.src),
        "dst": str(rec.dst),
        "originalDst": str(rec.orig_dst) if rec.orig_dst is not None else None,
        "hboneAddr": str(rec.hbone_addr) if rec.hbone_addr is not None else None,
        "srcIdentity": str(rec.src_identity) if rec.src_identity is not None else None,
        "dstIdentity": str(dst_identity) if dst_identity is not None else None,
        "srcWorkload": _name(rec.src_workload),
        "dstWorkload": _name(rec.dst_workload),
        "dstService": rec.dst_service.hostname if rec.dst_service is not None else None,
        "ageSeconds": round(max(0.0, now - rec.started), 3),
        "bytesSent": sent,
        "bytesRecv": recv,
    }


def connections(proxies: Iterable[tuple[str, Iterable[LiveConnection]]]) -> dict[str, Any]:
    """``{"connections": [...]}`` over every proxy (name, its live records), oldest first."""
    now = time.monotonic()
    rows = [row(name, rec, now) for name, live in proxies for rec in list(live)]
    rows.sort(key=lambda r: (-r["ageSeconds"], r["id"]))
    return {"connections": rows}
