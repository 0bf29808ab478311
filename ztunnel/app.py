"""The composition root: build every component from the Config, bind every listener, run, drain.

Nothing else constructs long-lived components; they are built here and passed down. In dedicated
mode every listener is bound before any starts accepting, so a bind failure stops start-up
cleanly. In shared (in-pod) mode the listeners are bound per pod as the node agent hands pods over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from ztunnel import __version__
from ztunnel.config import Config, CopyMode, ProxyMode
from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.identity.caclient import IstioCAClient
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import SecretManager
from ztunnel.inpod.client import ZdsClient
from ztunnel.inpod.manager import InPodManager
from ztunnel.net.copy import PipePool
from ztunnel.proxy.instance import ProxyInstance, instance_factory
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.state.store import State
from ztunnel.xds.client import AdsClient, StateUpdater

log = logging.getLogger("ztunnel.app")


class StartupError(Exception):
    """Start-up could not complete (bad local config, a port already taken, ...)."""


@dataclass
class App:
    config: Config
    state: State = field(default_factory=State)
    pipes: PipePool | None = None
    secrets: SecretManager | None = None
    dedicated: ProxyInstance | None = None
    inpod: InPodManager | None = None
    _zds_task: asyncio.Task[None] | None = None
    xds: AdsClient | None = None
    ca_client: IstioCAClient | None = None
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

    def _build_secrets(self) -> SecretManager:
        cfg = self.config
        if cfg.ca_address is not None:
            self.ca_client = IstioCAClient.from_config(cfg)
            log.info("certificates from the Istio CA at %s", cfg.ca_address)
            return SecretManager(self.ca_client)
        if cfg.local_ca_dir is not None:
            ca = LocalCA.load_or_create(
                cfg.local_ca_dir, trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl
            )
            log.info("local CA: root shared through %s", cfg.local_ca_dir)
        else:
            ca = LocalCA.ephemeral(trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl)
            log.info("local CA: ephemeral in-memory root (set ZTUNNEL_LOCAL_CA_DIR to share one)")
        return SecretManager(ca)

    def _instance_ips(self) -> frozenset[IPAddr]:
        return (
            frozenset({parse_ip(self.config.instance_ip)})
            if self.config.instance_ip
            else frozenset()
        )

    # --- run ------------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        log.info("ztunnel %s starting, mode=%s", __version__, cfg.proxy_mode.value)
        log.info("effective config: %s", cfg.summary())
        self.load_local_config()
        if cfg.copy_mode is CopyMode.SPLICE:
            self.pipes = PipePool()
        self.secrets = self._build_secrets()
        if cfg.xds_address is not None:
            self.xds = AdsClient(
                cfg, _Updater(self.state, self.secrets, cfg.node_name), env=os.environ
            )
            self.xds.start()
            log.info("xDS: connecting to %s", cfg.xds_address)
        build = instance_factory(cfg, self.state, self.secrets, self.pipes)
        if cfg.proxy_mode is ProxyMode.DEDICATED:
            assert cfg.proxy_workload_info is not None
            proxy = ProxyInstance(
                cfg,
                self.state,
                self.secrets,
                self.pipes,
                cfg.proxy_workload_info,
                extra_local_ips=self._instance_ips(),
            )
            try:
                proxy.bind()
            except OSError as e:
                raise StartupError(f"cannot bind listeners: {e}") from None
            proxy.start()
            self.dedicated = proxy
        else:
            self.inpod = InPodManager(build)
            client = ZdsClient(
                str(cfg.inpod_uds),
                self.inpod,
                on_snapshot_done=lambda: log.info("in-pod: node agent snapshot applied"),
                on_disconnected=lambda: log.warning("in-pod: node agent connection lost"),
            )
            self._zds_task = asyncio.get_running_loop().create_task(client.run())
            log.info("in-pod mode: waiting for pods from the node agent at %s", cfg.inpod_uds)

    def runtime_stats(self) -> dict[str, int]:
        stats = {
            "tasks": len(asyncio.all_tasks()),
            "fds": len(os.listdir("/proc/self/fd")),
            "connections": self._active_connections(),
        }
        if self.inpod is not None:
            stats["proxies"] = self.inpod.active
            stats["pending_proxies"] = self.inpod.pending
        if self.pipes is not None:
            stats.update(
                {f"pipes_{k}": v for k, v in dataclasses.asdict(self.pipes.stats()).items()}
            )
        return stats

    def _active_connections(self) -> int:
        if self.dedicated is not None:
            return self.dedicated.active_connections
        if self.inpod is not None:
            return self.inpod.active_connections
        return 0

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> int:
        """Graceful drain: stop accepting now, give connections until the termination deadline.

        Returns how many connections were cut."""
        deadline = self.config.connection_termination_deadline.total_seconds()
        cut = 0
        if self._zds_task is not None:
            self._zds_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._zds_task
        if self.xds is not None:
            await self.xds.close()
        if self.dedicated is not None:
            cut += await self.dedicated.drain(deadline)
        if self.inpod is not None:
            cut += await self.inpod.shutdown(deadline)
        if cut:
            log.warning(
                "drain duration expired with %d pending connections, forcefully shutting down", cut
            )
        if self.secrets is not None:
            await self.secrets.close()
        if self.ca_client is not None:
            await self.ca_client.close()
        if self.pipes is not None:
            self.pipes.close()
        return cut


class _Updater(StateUpdater):
    """Applies xDS to the state and prefetches certificates for this node's HBONE workloads."""

    def __init__(self, state: State, secrets: SecretManager, node: str) -> None:
        super().__init__(state)
        self.secrets = secrets
        self.node = node

    def upsert_workload(self, workload: Workload) -> None:
        super().upsert_workload(workload)
        if (
            self.node
            and workload.node == self.node
            and (workload.protocol is TunnelProtocol.HBONE or workload.native_tunnel)
        ):
            self.secrets.prefetch(workload.identity)
