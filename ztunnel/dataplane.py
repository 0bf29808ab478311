"""The data plane of one process: what serves pods' connections, built from the Config.

Shared by the two composition roots that run proxies: ``App`` with one worker (everything in one
process) and each data-plane worker process (``ztunnel.workers.worker``). It builds the proxy
instances' shared parts (metrics, policy index, pipe pool, the DNS companions) and runs their
housekeeping: policy re-checks of live connections after a state change, byte-counter flushes,
CRL reloads and the idle malloc trim.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from ztunnel.config import Config, CopyMode, ProxyMode, WorkloadInfo
from ztunnel.identity.crl import RELOAD_CHECK_INTERVAL as CRL_RELOAD_CHECK_INTERVAL
from ztunnel.identity.crl import CrlError, CrlManager
from ztunnel.identity.manager import CertificateSource
from ztunnel.identity.tls import TlsPolicy
from ztunnel.metrics import Metrics, crl_metrics
from ztunnel.net.copy import PipePool
from ztunnel.proxy.instance import CompanionBuilder, ProxyInstance
from ztunnel.proxy.socks5 import DnsExchange
from ztunnel.state.authz import PolicyIndex
from ztunnel.state.store import ChangeKind, State, StateChange

if TYPE_CHECKING:
    from ztunnel.net.malloc import IdleTrimmer

log = logging.getLogger("ztunnel.app")


class DataPlaneError(Exception):
    """The data plane cannot be built from this config (a bad CRL file, ...)."""


def tls_policy(config: Config, registry: CollectorRegistry) -> tuple[TlsPolicy, CrlManager | None]:
    """TLS12_ENABLED and CRL_PATH for every context built from our certificates, counting in
    ``registry``'s ``istio_crl_*`` counters (registered with or without CRL_PATH, as Rust)."""
    counters = crl_metrics(registry)
    crl = None
    if config.crl_path is not None:
        try:
            crl = CrlManager(
                config.crl_path, on_reject=counters.rejected, on_untracked=counters.untracked
            )
        except CrlError as e:
            raise DataPlaneError(f"CRL_PATH: {e}") from None
    return TlsPolicy(tls12=config.tls12_enabled, crl=crl), crl


class DataPlane:
    """Builds proxy instances and keeps them in order. ``instances`` lists the live ones (the
    owner knows them: dedicated, or the in-pod manager's)."""

    def __init__(
        self,
        config: Config,
        state: State,
        secrets: CertificateSource,
        registry: CollectorRegistry,
        *,
        crl: CrlManager | None = None,
        tag: str,
        build_info: bool = True,
        process_metrics: bool = True,
    ) -> None:
        self.config = config
        self.state = state
        self.secrets = secrets
        self.crl = crl
        # The node's copy budget, split evenly over the worker processes (ARCHITECTURE "Workers").
        budget = config.copy_budget // max(1, config.num_worker_threads)
        self.pipes = PipePool(budget=budget) if config.copy_mode is CopyMode.SPLICE else None
        self.metrics = Metrics(
            registry,
            inpod=config.proxy_mode is ProxyMode.SHARED and build_info,
            tag=tag,
            dns=config.dns_proxy,
            build_info=build_info,
            process=process_metrics,
        )
        self.policies = PolicyIndex.from_state(state)
        self.companions = self._dns_companions()
        self.instances: Callable[[], list[ProxyInstance]] = list
        # What ``build`` constructs: ProxyInstance, or the supervisor's stand-in that binds a
        # pod's listeners and hands them to the workers (ztunnel.workers.supervisor).
        self.instance_class: Callable[..., ProxyInstance] = ProxyInstance
        self.trimmer: IdleTrimmer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recheck_scheduled = False
        self._unsubscribe: Callable[[], None] | None = None

    def _dns_companions(self) -> CompanionBuilder | None:
        """The DNS proxy beside every ProxyInstance (``ISTIO_META_DNS_CAPTURE``, on by default);
        with SOCKS5 on, it also resolves the instance's SOCKS5 hostnames (Rust: the proxy's
        ``resolver`` is the DNS server's store, so the same answers as the pod's own queries)."""
        cfg = self.config
        if not cfg.dns_proxy:
            return None
        from ztunnel.dns.forwarder import ResolvConfSource
        from ztunnel.dns.server import DnsServer, dns_companions

        build = dns_companions(
            cfg, self.state, self.metrics.dns, ResolvConfSource(str(cfg.dns_resolv_conf))
        )
        if not cfg.socks5:
            return build

        def exchange(server: DnsServer) -> DnsExchange:
            async def ask(query: bytes) -> bytes | None:
                # Over "TCP": the answer is not truncated to fit a datagram.
                got = server.answer_now(query, False)
                if got is None or isinstance(got, bytes):
                    return got
                return await server.answer_later(got, False)

            return ask

        def build_with_socks5(inst: ProxyInstance) -> list[DnsServer]:
            servers = build(inst)
            inst.dns_exchange = exchange(servers[0])
            return servers

        return build_with_socks5

    def build(
        self,
        info: WorkloadInfo,
        netns_fd: int | None,
        name: str = "",
        **kwargs: Any,
    ) -> ProxyInstance:
        self_proxy = self.is_self_proxy(info, netns_fd)
        return self.instance_class(
            self.config,
            self.state,
            self.secrets,
            self.pipes,
            info,
            netns_fd=netns_fd,
            name=name,
            metrics=self.metrics,
            policies=self.policies,
            companions=None if self_proxy else self.companions,
            self_proxy=self_proxy,
            **kwargs,
        )

    def is_self_proxy(self, info: WorkloadInfo, netns_fd: int | None) -> bool:
        """In shared mode every pod's instance lives in the pod's netns; the one for ztunnel's
        own workload in ztunnel's own netns is the self-proxy (:meth:`build_self_proxy`). Told
        apart here, so that a worker handed its listeners builds the same kind of instance."""
        cfg = self.config
        return (
            cfg.proxy_mode is ProxyMode.SHARED
            and netns_fd is None
            and cfg.ztunnel_workload is not None
            and info == cfg.ztunnel_workload
        )

    def build_self_proxy(self) -> ProxyInstance | None:
        """Rust ``create_ztunnel_self_proxy_listener``: in shared mode, with ztunnel's own
        workload known (POD_NAMESPACE, POD_NAME, SERVICE_ACCOUNT), an inbound HBONE listener on
        15008 in ztunnel's own netns, for ztunnel as a workload: mesh clients reach its own
        ports (the metrics on 15020) over mTLS, and its policies apply. Not bound yet."""
        cfg = self.config
        info = cfg.ztunnel_workload
        if cfg.proxy_mode is not ProxyMode.SHARED or info is None:
            return None
        log.info(
            "creating ztunnel self-proxy listener with identity: spiffe://%s/ns/%s/sa/%s",
            cfg.trust_domain,
            info.namespace,
            info.service_account,
        )
        return self.build(info, None, "ztunnel self-proxy")

    # --- housekeeping --------------------------------------------------------------------------

    def start(self, *, proxies: bool = True) -> None:
        """The housekeeping tasks; ``proxies=False`` (a supervisor whose workers run the
        proxies) starts only the malloc trim."""
        if proxies:
            self._unsubscribe = self.state.subscribe(self._on_state_change)
            self._spawn(self._flush_metrics_forever())
        if (trim := self.config.malloc_trim_interval.total_seconds()) > 0:
            from ztunnel.hbone.transport import release_scratch
            from ztunnel.net.malloc import IdleTrimmer

            self.trimmer = IdleTrimmer(release=(release_scratch,))
            if self.trimmer.available or self.trimmer.release:
                self._spawn(self.trimmer.run(trim))
        if self.crl is not None and proxies:
            self._spawn(self._watch_crl(self.crl))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_state_change(self, change: StateChange) -> None:
        # Policies or a workload's policy list changed: re-check live inbound connections, once
        # per burst of changes (an xDS response applies many at a time).
        if change.kind is ChangeKind.SERVICE or self._recheck_scheduled:
            return
        self._recheck_scheduled = True
        asyncio.get_running_loop().call_soon(self._recheck_policies)

    def _recheck_policies(self) -> None:
        self._recheck_scheduled = False
        closed = sum(inst.recheck_policies() for inst in self.instances())
        if closed:
            log.info("policy change closed %d connection(s)", closed)

    async def _flush_metrics_forever(self) -> None:
        """Byte counters move during long connections, not only at close (every
        ``ZTUNNEL_METRICS_FLUSH_INTERVAL``, 5 s by default)."""
        interval = self.config.metrics_flush_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            for inst in self.instances():
                inst.ctx.tracker.flush_metrics()

    async def _watch_crl(self, crl: CrlManager) -> None:
        """CRL_PATH: poll the file (one stat a second) and, when new CRLs are loaded, close the
        live connections, inbound and outbound, whose peer's verified chain now holds a revoked
        certificate (Rust re-checks established connections on reload). Handshakes check the
        file too, so a revocation is never missed between polls."""
        seen = crl.generation
        while True:
            await asyncio.sleep(CRL_RELOAD_CHECK_INTERVAL)
            crl.maybe_reload()
            if crl.generation == seen:
                continue
            seen = crl.generation
            closed = sum(inst.close_revoked(crl) for inst in self.instances())
            if closed:
                log.warning("CRL reload: closed %d connection(s) with a revoked peer", closed)

    def runtime_stats(self) -> dict[str, int]:
        """This process's tasks, fds and connections, the objects the cyclic GC had to free so
        far (per-connection reference cycles show up there), the malloc trimmer's and the pipe
        pool's counters."""
        stats = {
            "tasks": len(asyncio.all_tasks()),
            "fds": len(os.listdir("/proc/self/fd")),
            "connections": sum(inst.active_connections for inst in self.instances()),
            "gc_collected": sum(g["collected"] for g in gc.get_stats()),
        }
        if self.trimmer is not None:
            stats["malloc_trims"] = self.trimmer.trims
            stats["malloc_free_kib"] = self.trimmer.free_bytes() >> 10
        if self.pipes is not None:
            stats.update(
                {f"pipes_{k}": v for k, v in dataclasses.asdict(self.pipes.stats()).items()}
            )
        return stats

    async def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.policies.close()
        if self.pipes is not None:
            self.pipes.close()
