"""The composition root: build every component from the Config, bind every listener, run, drain.

Nothing else constructs long-lived components; they are built here and passed down. Every listener
is bound before any of them starts accepting, so a bind failure stops start-up cleanly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field

from ztunnel import __version__
from ztunnel.config import (
    HBONE_PORT,
    INBOUND_PLAINTEXT_PORT,
    OUTBOUND_PORT,
    Config,
    CopyMode,
    ProxyMode,
)
from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.core.identity import Identity
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import SecretManager
from ztunnel.net.copy import PipePool
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.hbone_outbound import HboneConnector
from ztunnel.proxy.inbound import InboundHbone
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.proxy.listener import Listener
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import Workload
from ztunnel.state.store import State

log = logging.getLogger("ztunnel.app")


class StartupError(Exception):
    """Start-up could not complete (bad local config, a port already taken, ...)."""


@dataclass
class App:
    config: Config
    state: State = field(default_factory=State)
    listeners: list[Listener] = field(default_factory=list)
    pipes: PipePool | None = None
    secrets: SecretManager | None = None
    connectors: list[HboneConnector] = field(default_factory=list)
    inbound_hbone: list[InboundHbone] = field(default_factory=list)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    # --- build ----------------------------------------------------------------------------------

    def load_local_config(self) -> None:
        cfg = self.config
        if cfg.local_xds_path is not None:
            text, source = cfg.local_xds_path.read_text(), str(cfg.local_xds_path)
        elif cfg.local_xds is not None:
            text, source = cfg.local_xds, "LOCAL_XDS"
        else:
            return
        try:
            local = load_local_config(text, source)
        except ValueError as e:
            raise StartupError(f"local config: {e}") from None
        local.apply_to(self.state)
        log.info(
            "loaded local config %s: %d workloads, %d services, %d policies",
            source,
            len(local.workloads),
            len(local.services),
            len(local.policies),
        )

    def _dedicated_workload(self) -> Workload | None:
        info = self.config.proxy_workload_info
        if info is None:
            return None
        return self.state.find_workload_by_info(
            info.name, info.namespace, info.service_account, self.config.node_name or None
        )

    def _dedicated_identity(self) -> Identity | None:
        info = self.config.proxy_workload_info
        if info is None:
            return None
        wl = self._dedicated_workload()
        trust_domain = wl.trust_domain if wl is not None else self.config.trust_domain
        return Identity(trust_domain, info.namespace, info.service_account)

    def _build_secrets(self) -> SecretManager:
        cfg = self.config
        if cfg.ca_address is not None:
            raise StartupError(
                f"CA_ADDRESS={cfg.ca_address}: the Istio CA client is not available yet; "
                "unset CA_ADDRESS to use the local CA"
            )
        if cfg.local_ca_dir is not None:
            ca = LocalCA.load_or_create(
                cfg.local_ca_dir, trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl
            )
            log.info("local CA: root shared through %s", cfg.local_ca_dir)
        else:
            ca = LocalCA.ephemeral(trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl)
            log.info("local CA: ephemeral in-memory root (set ZTUNNEL_LOCAL_CA_DIR to share one)")
        return SecretManager(ca)

    def _local_ips(self) -> frozenset[IPAddr]:
        ips: set[IPAddr] = set()
        if self.config.instance_ip:
            ips.add(parse_ip(self.config.instance_ip))
        wl = self._dedicated_workload()
        if wl is not None:
            ips.update(wl.addresses)
        return frozenset(ips)

    def _bind_dedicated(self) -> None:
        cfg = self.config
        sockets = SocketFactory(
            mark=cfg.packet_mark,
            keepalive=(cfg.keepalive_time, cfg.keepalive_interval, cfg.keepalive_retries)
            if cfg.keepalive_enabled
            else None,
            user_timeout=cfg.user_timeout_enabled,
        )
        ctx = ProxyContext(
            config=cfg,
            state=self.state,
            sockets=sockets,
            pipes=self.pipes,
            local_workload=self._dedicated_workload,
            local_identity=self._dedicated_identity,
            local_ips=self._local_ips(),
        )
        assert self.secrets is not None
        connector = HboneConnector(cfg, sockets, self.secrets)
        ctx.hbone = connector
        inbound = InboundHbone(ctx, self.secrets)
        self.connectors.append(connector)
        self.inbound_hbone.append(inbound)
        family = socket.AF_INET6 if cfg.ipv6_enabled and socket.has_ipv6 else socket.AF_INET
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        for port, name, handler in (
            (OUTBOUND_PORT, "outbound", Outbound(ctx).handle),
            (INBOUND_PLAINTEXT_PORT, "inbound_passthrough", InboundPassthrough(ctx).handle),
            (HBONE_PORT, "inbound", inbound.handle),
        ):
            try:
                sock = sockets.listener(
                    (wildcard, port),
                    family=family,
                    reuse_port=cfg.inpod_port_reuse,
                    transparent=self._want_transparent(),
                )
            except OSError as e:
                if cfg.enable_orig_src is None and self._want_transparent():
                    sock = sockets.listener(
                        (wildcard, port),
                        family=family,
                        reuse_port=cfg.inpod_port_reuse,
                        transparent=False,
                    )
                else:
                    raise StartupError(
                        f"cannot bind {name} listener on {wildcard}:{port}: {e}"
                    ) from None
            self.listeners.append(Listener(sock, handler, name))

    def _want_transparent(self) -> bool:
        return self.config.enable_orig_src is not False

    # --- run ------------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        log.info("ztunnel %s starting, mode=%s", __version__, cfg.proxy_mode.value)
        log.info("effective config: %s", cfg.summary())
        if cfg.xds_address is not None:
            log.warning("xDS client is not available yet; ignoring XDS_ADDRESS=%s", cfg.xds_address)
        self.load_local_config()
        if cfg.copy_mode is CopyMode.SPLICE:
            self.pipes = PipePool()
        if cfg.proxy_mode is ProxyMode.SHARED:
            raise StartupError(
                "PROXY_MODE=shared (in-pod) is not available yet; run with PROXY_MODE=dedicated "
                "and PROXY_WORKLOAD_INFO=<namespace>/<name>/<service account>"
            )
        self.secrets = self._build_secrets()
        try:
            self._bind_dedicated()
        except BaseException:
            for lst in self.listeners:
                lst.sock.close()
            self.listeners.clear()
            raise
        for lst in self.listeners:
            lst.start()
            log.info("listener %s on %s:%d", lst.name, *lst.address)

    def runtime_stats(self) -> dict[str, int]:
        stats = {
            "tasks": len(asyncio.all_tasks()),
            "fds": len(os.listdir("/proc/self/fd")),
            "connections": sum(lst.active for lst in self.listeners),
        }
        if self.pipes is not None:
            stats.update(
                {f"pipes_{k}": v for k, v in dataclasses.asdict(self.pipes.stats()).items()}
            )
        return stats

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> int:
        """Graceful drain: stop accepting now, give connections until the termination deadline.

        Returns how many connections were cut at the deadline."""
        deadline = self.config.connection_termination_deadline.total_seconds()
        cut = sum(await asyncio.gather(*(lst.drain(deadline) for lst in self.listeners)))
        if cut:
            log.warning(
                "drain duration expired with %d pending connections, forcefully shutting down", cut
            )
        if self.pipes is not None:
            self.pipes.close()
        return cut
