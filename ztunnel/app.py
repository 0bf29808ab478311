"""The composition root: build every component from the Config, bind every listener, run, drain.

Nothing else constructs long-lived components (but a data-plane worker process, which builds its
own proxies in ``ztunnel.workers.worker``); they are built here and passed down. In dedicated
mode every listener is bound before any starts accepting, so a bind failure stops start-up
cleanly. In shared (in-pod) mode the listeners are bound per pod as the node agent hands pods over.
With ``ZTUNNEL_WORKER_THREADS`` >= 2 this process is the supervisor: it still binds every
listener, and ``ztunnel.workers.supervisor`` hands them to the workers that accept from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from ztunnel import __version__, logs
from ztunnel.admin import AdminHandler, bind_admin
from ztunnel.admin.admin import istio_version_from_env
from ztunnel.admin.http import HttpServer
from ztunnel.admin.logctl import LogControl
from ztunnel.admin.profiling import Profiler
from ztunnel.admin.readiness import Readiness, ReadinessHandler, ReadyToken
from ztunnel.admin.stats import StatsHandler
from ztunnel.config import Config, ProxyMode
from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.dataplane import DataPlane, DataPlaneError, tls_policy
from ztunnel.identity.crl import CrlManager
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import SecretManager
from ztunnel.identity.tls import TlsPolicy
from ztunnel.metrics import Metrics, export_certificate_expiry, export_state_store, export_xds
from ztunnel.net.copy import PipePool
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.state.authz import PolicyIndex
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.state.shared import SharedStore, StoreError
from ztunnel.state.store import State

# The control-plane libraries are imported where used (memory at rest, issue 18): grpclib and the
# xDS/CA protobufs only when XDS_ADDRESS/CA_ADDRESS are set, the ZDS protobufs only in shared mode,
# PyYAML only with a local config.
if TYPE_CHECKING:
    from ztunnel.identity.caclient import IstioCAClient
    from ztunnel.inpod.manager import InPodManager
    from ztunnel.state.localconfig import LocalConfig
    from ztunnel.workers.supervisor import WorkerPool
    from ztunnel.workers.zygote import Zygote
    from ztunnel.xds.client import AdsClient, StateUpdater

log = logging.getLogger("ztunnel.app")


class StartupError(Exception):
    """Start-up could not complete (bad local config, a port already taken, ...)."""


@dataclass
class App:
    config: Config
    # The node's one copy of the mesh state (a store in $TMPDIR; workers map it read-only).
    state: State = field(init=False)
    pipes: PipePool | None = None
    secrets: SecretManager | None = None
    dedicated: ProxyInstance | None = None
    inpod: InPodManager | None = None
    self_proxy: ProxyInstance | None = None  # shared mode: ztunnel's own inbound (dataplane.py)
    _zds_task: asyncio.Task[None] | None = None
    _serve_task: asyncio.Task[None] | None = None  # waits for the first sync, then serves
    xds: AdsClient | None = None
    ca_client: IstioCAClient | None = None
    crl: CrlManager | None = None  # CRL_PATH
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    metrics: Metrics | None = None
    policies: PolicyIndex | None = None
    readiness: Readiness = field(default_factory=Readiness)
    servers: list[HttpServer] = field(default_factory=list)
    local_config: LocalConfig | None = None
    dataplane: DataPlane | None = None
    # ZTUNNEL_WORKER_THREADS >= 2 and a zygote to fork workers from (the CLI makes one before
    # the event loop starts): the data plane runs in worker processes; else in this one.
    spawner: Zygote | None = None
    workers: WorkerPool | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _snapshot_done: bool = False
    _shutdown_done: asyncio.Event = field(default_factory=asyncio.Event)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.state = State(store=SharedStore.create(map_size=self.config.state_max_bytes))

    # --- build ----------------------------------------------------------------------------------

    def load_local_config(self) -> None:
        cfg = self.config
        if cfg.local_xds_path is not None:
            text, source = cfg.local_xds_path.read_text(), str(cfg.local_xds_path)
        elif cfg.local_xds is not None:
            text, source = cfg.local_xds, "LOCAL_XDS"
        else:
            return
        from ztunnel.state.localconfig import load_local_config

        try:
            local = load_local_config(text, source)
        except ValueError as e:
            raise StartupError(f"local config: {e}") from None
        try:
            with self.state.batch():
                local.apply_to(self.state)
        except StoreError as e:
            raise StartupError(f"local config: {e}") from None
        self.local_config = local
        log.info(
            "loaded local config %s: %d workloads, %d services, %d policies",
            source,
            len(local.workloads),
            len(local.services),
            len(local.policies),
        )

    def _build_secrets(self, policy: TlsPolicy) -> SecretManager:
        cfg = self.config
        if cfg.ca_address is not None:
            from ztunnel.identity.caclient import IstioCAClient

            self.ca_client = IstioCAClient.from_config(cfg)
            log.info("certificates from the Istio CA at %s", cfg.ca_address)
            return SecretManager(self.ca_client, tls_policy=policy)
        if cfg.local_ca_dir is not None:
            ca = LocalCA.load_or_create(
                cfg.local_ca_dir, trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl
            )
            log.info("local CA: root shared through %s", cfg.local_ca_dir)
        else:
            ca = LocalCA.ephemeral(trust_domain=cfg.trust_domain, ttl=cfg.secret_ttl)
            log.info("local CA: ephemeral in-memory root (set ZTUNNEL_LOCAL_CA_DIR to share one)")
        return SecretManager(ca, tls_policy=policy)

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
        if not cfg.enable_proxy:  # (ProxyInstance binds its DNS companion alone)
            log.info("ENABLE_PROXY=false: no proxy listeners, the DNS proxy only")
        log.info("effective config: %s", cfg.summary())
        if cfg.proxy_mode is ProxyMode.SHARED:  # setns and SO_MARK work, or stop now (as Rust)
            from ztunnel.inpod.capabilities import CapabilityError, verify_syscalls

            try:
                verify_syscalls()
            except CapabilityError as e:
                raise StartupError(str(e)) from None
        # Rust app.rs / inpod/workloadmanager.rs names: "proxy" until the proxies are built,
        # "state manager" until the state is known, "workload proxy manager" while the node
        # agent's pods are not all in (shared mode); "workers" is ours.
        proxy_ready = self.readiness.register("proxy")
        state_ready = self.readiness.register("state manager")
        self.load_local_config()
        try:
            policy, self.crl = tls_policy(cfg, self.registry)
        except DataPlaneError as e:
            raise StartupError(str(e)) from None
        self.secrets = self._build_secrets(policy)
        dp = self.dataplane = DataPlane(
            cfg, self.state, self.secrets, self.registry, crl=self.crl, tag=istio_version_from_env()
        )
        self.metrics, self.policies, self.pipes = dp.metrics, dp.policies, dp.pipes
        dp.instances = self._instances
        export_xds(self.registry, lambda: self.xds.metrics if self.xds is not None else None)
        export_state_store(
            self.registry, self.state, lambda: self.xds.metrics if self.xds is not None else None
        )
        export_certificate_expiry(
            self.registry, lambda: self.secrets.statuses() if self.secrets is not None else ()
        )
        if self.spawner is not None and cfg.num_worker_threads > 1:
            from ztunnel.workers.supervisor import WorkerPool

            self.workers = WorkerPool(
                cfg, self.state, self.secrets, self.spawner, self.readiness, self.registry
            )
            self.workers.attach(dp)
        self._bind_servers()
        if cfg.xds_address is not None:
            from ztunnel.xds.client import AdsClient

            self.xds = AdsClient(
                cfg, _updater(self.state, self.secrets, cfg.node_name), env=os.environ
            )
            if cfg.xds_on_demand:  # lookups of unknown addresses ask istiod (Rust Demander)
                self.state.demander = self.xds.demand
            self.xds.start()
            log.info("xDS: connecting to %s", cfg.xds_address)
        for server in self.servers:
            await server.start()
        if self.workers is not None:
            from ztunnel.workers.supervisor import WorkerStartError

            try:
                await self.workers.start()
            except WorkerStartError as e:
                raise StartupError(str(e)) from None
        dp.start(proxies=self.workers is None)  # (workers keep their own proxies in order)
        if cfg.proxy_mode is ProxyMode.DEDICATED:
            assert cfg.proxy_workload_info is not None
            proxy = dp.build(cfg.proxy_workload_info, None, extra_local_ips=self._instance_ips())
            try:
                proxy.bind()  # (a port already taken stops start-up, before any sync)
            except OSError as e:
                raise StartupError(f"cannot bind listeners: {e}") from None
            self.dedicated = proxy
        elif (own := dp.build_self_proxy()) is not None:
            try:
                own.bind()  # (Rust: a bind failure stops start-up too)
            except OSError as e:
                raise StartupError(f"cannot bind the self-proxy listener: {e}") from None
            self.self_proxy = own
        self._serve_task = asyncio.get_running_loop().create_task(
            self._serve_when_synced(state_ready, proxy_ready)
        )
        self._serve_task.add_done_callback(self._on_serve_done)

    def _on_serve_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("failed to start serving: %s", e, exc_info=e)
            self.request_stop()

    async def _serve_when_synced(self, state_ready: ReadyToken, proxy_ready: ReadyToken) -> None:
        """Serve only once the state is known (Rust ``app.rs``: the in-pod manager and the
        dedicated proxy's accept loop wait for the first xDS sync). Until then no pod is taken
        from the node agent and the dedicated listeners do not accept: their connections wait in
        the kernel's backlog instead of being routed with an empty state (a mesh destination not
        yet known would leave as plaintext passthrough). With workers, every worker must also
        hold that state: readiness waits for each one to have applied it, and a pod's listeners
        reach a worker only after the state that came before them."""
        cfg = self.config
        if self.xds is not None:
            await self.xds.wait_synced()
            log.info("xDS: initial sync complete")
        if self.workers is not None:
            await self.workers.barrier()
        state_ready.done()
        if self.self_proxy is not None:
            self.self_proxy.start()
        if self.dedicated is not None:
            self.dedicated.start()
            proxy_ready.done()
            return
        from ztunnel.inpod.client import ZdsClient
        from ztunnel.inpod.manager import InPodManager

        assert self.dataplane is not None
        pods_ready = self.readiness.register("workload proxy manager")
        self.inpod = InPodManager(
            self.dataplane.build,
            on_change=lambda: self._inpod_readiness(pods_ready),
        )
        client = ZdsClient(
            str(cfg.inpod_uds),
            self.inpod,
            on_snapshot_done=lambda: self._inpod_readiness(pods_ready, snapshot=True),
            on_disconnected=lambda: self._inpod_readiness(pods_ready, snapshot=False),
        )
        proxy_ready.done()
        self._zds_task = asyncio.get_running_loop().create_task(client.run())
        log.info("in-pod mode: waiting for pods from the node agent at %s", cfg.inpod_uds)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _inpod_readiness(self, token: ReadyToken, snapshot: bool | None = None) -> None:
        """In-pod: ready once the node agent's snapshot is in and no pod is pending; not ready
        again while the node agent connection is down."""
        if snapshot is not None:
            self._snapshot_done = snapshot
            if snapshot:
                log.info("in-pod: node agent snapshot applied")
            else:
                log.warning("in-pod: node agent connection lost")
        manager = self.inpod
        if manager is None:
            return
        if self.metrics is not None and self.metrics.inpod is not None:
            self.metrics.inpod.active_proxy_count.set(manager.active)
            self.metrics.inpod.pending_proxy_count.set(manager.pending)
            self.metrics.inpod.proxies_started.set(manager.started_total)
            self.metrics.inpod.proxies_stopped.set(manager.stopped_total)
        if self._snapshot_done and manager.pending == 0:
            token.done()
        else:
            token.not_ready_again()

    def _instances(self) -> list[ProxyInstance]:
        if self.dedicated is not None:
            return [self.dedicated]
        own = [self.self_proxy] if self.self_proxy is not None else []
        if self.inpod is not None:
            return [*own, *self.inpod.instances()]
        return own

    def _bind_servers(self) -> None:
        cfg = self.config
        wildcard = "::" if cfg.ipv6_enabled and socket.has_ipv6 else "0.0.0.0"
        try:
            if cfg.stats_port:
                stats = StatsHandler(
                    self.registry,
                    gather=self.workers.scrape_registry if self.workers is not None else None,
                )
                self.servers.append(HttpServer.bind("stats", [(wildcard, cfg.stats_port)], stats))
            if cfg.readiness_port:
                ready = ReadinessHandler(self.readiness)
                self.servers.append(
                    HttpServer.bind("readiness", [(wildcard, cfg.readiness_port)], ready)
                )
            if cfg.admin_port:
                from ztunnel.admin.explain import explain_query

                handler = AdminHandler(
                    state=lambda: self.state,
                    config=cfg.summary,
                    certificates=lambda: self.secrets.statuses() if self.secrets else (),
                    static=lambda: self.local_config,
                    extra={"workloadState": self._workload_state},
                    on_quit=self._quit,
                    quit_deadline=cfg.connection_termination_deadline.total_seconds() + 1,
                    log_control=self._log_control(),
                    # The same PolicyIndex the proxy enforces with, so the answer is its decision.
                    explain=lambda q: explain_query(
                        self.state, q, policies=self.policies, network=cfg.network
                    ),
                    live=lambda: [(i.name, i.live_connections()) for i in self._instances()],
                    profiler=Profiler(self.workers.profiles if self.workers is not None else None),
                    refresh=self.workers.refresh_live if self.workers is not None else None,
                )
                self.servers.append(bind_admin(handler, port=cfg.admin_port, ipv6=cfg.ipv6_enabled))
        except OSError as e:
            for server in self.servers:
                for sock in server.socks:
                    sock.close()
            self.servers.clear()
            raise StartupError(f"cannot bind the admin/stats/readiness servers: {e}") from None

    def _log_control(self) -> LogControl:
        pool = self.workers
        if pool is None:
            return LogControl(self.config.rust_log)

        def apply(spec: str) -> None:
            logs.apply_directives(spec)
            pool.set_log_spec(spec)

        return LogControl(self.config.rust_log, apply=apply)

    def _workload_state(self) -> dict[str, Any]:
        """``workloadState``: in-pod, every pod the node agent handed over, keyed by its uid (as
        Rust); dedicated mode (Rust has none) shows its one workload, keyed by its uid."""
        from ztunnel.admin.config_dump import ProxyView, workload_state

        views: list[ProxyView] = []
        if self.inpod is not None:
            for uid, pod in self.inpod.pods.items():
                inst = pod.proxy
                views.append(
                    ProxyView(
                        uid,
                        pod.info.name,
                        pod.info.namespace,
                        pod.info.service_account,
                        "Up" if inst is not None else "Pending",
                        inst.live_connections() if inst is not None else None,
                    )
                )
        elif (inst := self.dedicated) is not None:
            wl = inst.workload()
            key = wl.uid if wl is not None and wl.uid else inst.name
            i = inst.info
            views.append(
                ProxyView(
                    key, i.name, i.namespace, i.service_account, "Up", inst.live_connections()
                )
            )
        return workload_state(views)  # type: ignore[no-any-return]

    async def _quit(self) -> None:
        self.request_stop()
        await self._shutdown_done.wait()

    def runtime_stats(self) -> dict[str, int]:
        stats = self.dataplane.runtime_stats() if self.dataplane is not None else {}
        if self.inpod is not None:
            stats["proxies"] = self.inpod.active
            stats["pending_proxies"] = self.inpod.pending
        if self.workers is not None:
            stats.update(self.workers.runtime_stats())
        return stats

    async def total_runtime_stats(self) -> dict[str, int]:
        """:meth:`runtime_stats`, with the workers' tasks, fds and connections added."""
        stats = self.runtime_stats()
        if self.workers is not None:
            stats["connections"] = 0
            for k, v in (await self.workers.stats()).items():
                stats[k] = stats.get(k, 0) + v
        return stats

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> int:
        """Graceful drain: stop accepting now, give connections until the termination deadline.

        Returns how many connections were cut."""
        deadline = self.config.connection_termination_deadline.total_seconds()
        cut = 0
        for task in (self._serve_task, self._zds_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.xds is not None:
            await self.xds.close()
        drains = [p.drain(deadline) for p in (self.dedicated, self.self_proxy) if p is not None]
        if self.inpod is not None:
            drains.append(self.inpod.shutdown(deadline))
        cut += sum(await asyncio.gather(*drains))
        if cut:
            log.warning(
                "drain duration expired with %d pending connections, forcefully shutting down", cut
            )
        if self.workers is not None:
            await self.workers.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.dataplane is not None:
            await self.dataplane.close()
        if self.secrets is not None:
            await self.secrets.close()
        if self.ca_client is not None:
            await self.ca_client.close()
        self._shutdown_done.set()
        for server in self.servers:
            await server.close()
        self.state.close()
        self.state.store.close()
        return cut


def _updater(state: State, secrets: SecretManager, node: str) -> StateUpdater:
    """The xDS state updater; built (and ztunnel.xds imported) only when xDS is configured."""
    from ztunnel.xds.client import StateUpdater

    class _Updater(StateUpdater):
        """Applies xDS to the state and prefetches certificates for this node's HBONE workloads."""

        def __init__(self, state: State, secrets: SecretManager, node: str) -> None:
            super().__init__(state, local_node=node)
            self.secrets = secrets
            self.node = node

        def upsert_workload(self, workload: Workload) -> None:
            super().upsert_workload(workload)
            if self.node and workload.node == self.node:
                self.local_workload_upserted(workload)

        def local_workload_upserted(self, workload: Workload) -> None:
            if workload.protocol is TunnelProtocol.HBONE or workload.native_tunnel:
                self.secrets.prefetch(workload.identity)

        def remove_address(self, name: str) -> None:
            # Rust ProxyStateUpdater::remove_internal: a real removal whose identity was the last
            # on this node clears its certificate (renewal task and key go with it).
            old = self.state.find_workload_by_uid(name)
            super().remove_address(name)
            if old is None or (self.node and old.node != self.node):
                return
            if not self.state.identity_on_node(old.namespace, old.service_account, self.node):
                self.secrets.forget(old.identity)

    return _Updater(state, secrets, node)
