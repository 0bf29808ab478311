"""What every listener of one proxy instance shares: config, state, sockets, pipes, local workload.

In dedicated mode there is one instance for the process; in shared (in-pod) mode, one per pod.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ztunnel.config import Config
from ztunnel.core.addr import IPAddr, SocketAddr
from ztunnel.core.identity import Identity
from ztunnel.net.copy import PipePool
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.model import Service, Workload
from ztunnel.state.store import State

if TYPE_CHECKING:
    from ztunnel.proxy.route import Route

access_log = logging.getLogger("access")


@dataclass
class ProxyContext:
    config: Config
    state: State
    sockets: SocketFactory
    pipes: PipePool | None
    local_workload: Callable[[], Workload | None]
    local_identity: Callable[[], Identity | None] = lambda: None
    local_ips: Callable[[], frozenset[IPAddr]] = frozenset
    hbone: HboneOutbound | None = None


class HboneOutbound(Protocol):
    async def proxy_outbound(
        self, sock: socket.socket, route: Route, rec: ConnectionRecord
    ) -> None: ...


@dataclass(slots=True)
class ConnectionRecord:
    """One proxied connection, for the access log (and metrics)."""

    direction: str  # "outbound" | "inbound"
    src: SocketAddr
    dst: SocketAddr  # the address actually dialled
    hbone_addr: SocketAddr | None = None
    src_workload: Workload | None = None
    dst_workload: Workload | None = None
    dst_service: Service | None = None
    src_identity: Identity | None = None
    dst_identity: Identity | None = None
    started: float = field(default_factory=time.monotonic)
    bytes_sent: int = 0  # from the local pod's perspective (see reference 7)
    bytes_recv: int = 0

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"src.addr": str(self.src)}
        if self.src_workload is not None:
            out["src.workload"] = self.src_workload.name
            out["src.namespace"] = self.src_workload.namespace
        if self.src_identity is not None:
            out["src.identity"] = str(self.src_identity)
        out["dst.addr"] = str(self.dst)
        if self.hbone_addr is not None:
            out["dst.hbone_addr"] = str(self.hbone_addr)
        if self.dst_service is not None:
            out["dst.service"] = self.dst_service.hostname
        if self.dst_workload is not None:
            out["dst.workload"] = self.dst_workload.name
            out["dst.namespace"] = self.dst_workload.namespace
        if self.dst_identity is not None:
            out["dst.identity"] = str(self.dst_identity)
        out["direction"] = self.direction
        return out

    def log_complete(self, error: BaseException | str | None) -> None:
        f = self.fields()
        f["bytes_sent"] = self.bytes_sent
        f["bytes_recv"] = self.bytes_recv
        f["duration"] = f"{round((time.monotonic() - self.started) * 1000)}ms"
        if error is not None:
            f["error"] = str(error)
            access_log.error("connection complete", extra={"fields": f})
        else:
            access_log.info("connection complete", extra={"fields": f})


def log_failed(direction: str, src: SocketAddr, dst: SocketAddr, error: BaseException) -> None:
    """An early denial, before any upstream was chosen."""
    access_log.warning(
        "connection failed",
        extra={
            "fields": {
                "src.addr": str(src),
                "dst.addr": str(dst),
                "direction": direction,
                "error": str(error),
            }
        },
    )
