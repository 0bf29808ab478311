"""A data-plane worker process: proxies for every pod, on the listeners its supervisor bound.

It maps the supervisor's shared state store read-only (the node's one copy of the state) and
is told what each commit changed (``StateChanged``, in order); it asks the supervisor for
certificates (and gets every renewal pushed), and builds a ``DataPlane`` of its
own: metrics (summed by the supervisor at each scrape), policy index, DNS companions, and the
housekeeping (policy re-checks, byte-counter flushes, CRL reloads, malloc trim). It ignores
SIGINT/SIGTERM: the supervisor tells it to drain, and it exits when the supervisor goes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import CollectorRegistry

from ztunnel.admin.admin import istio_version_from_env
from ztunnel.admin.live import row_id
from ztunnel.config import Config, ProxyMode
from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.core.identity import Identity
from ztunnel.dataplane import DataPlane, tls_policy
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.manager import CertificateForgotten, CertificateUnavailable
from ztunnel.identity.tls import TLS_POLICY_MEMO, TlsPolicy
from ztunnel.metrics import registry_values
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.state.store import ChangeKind, State, StateChange
from ztunnel.workers import messages as m
from ztunnel.workers.ipc import Channel

log = logging.getLogger("ztunnel.workers")


def main(sock: socket.socket, index: int, loop: str = "uvloop") -> int:
    """The zygote's target: run one worker on its own event loop until told to stop."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(Worker(index).run(sock))


def cert_from_bundle(bundle: m.CertBundle, policy: TlsPolicy) -> WorkloadCertificate:
    key_der, leaf, inters, roots = bundle
    key = serialization.load_der_private_key(key_der, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    cert = WorkloadCertificate(
        key,
        x509.load_der_x509_certificate(leaf),
        tuple(x509.load_der_x509_certificate(c) for c in inters),
        tuple(x509.load_der_x509_certificate(c) for c in roots),
    )
    cert.memo(TLS_POLICY_MEMO, lambda: policy)  # before any context is built from it
    return cert


class RemoteSecrets:
    """The supervisor's SecretManager seen from a worker (a ``CertificateSource``)."""

    def __init__(self, send: Callable[[Any], None], policy: TlsPolicy) -> None:
        self._send = send
        self._policy = policy
        self._certs: dict[Identity, WorkloadCertificate] = {}
        self._waiting: dict[Identity, list[asyncio.Future[WorkloadCertificate]]] = {}

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        cert = self._certs.get(identity)
        if cert is not None and not cert.is_expired(time.time()):
            return cert
        waiters = self._waiting.setdefault(identity, [])
        if not waiters:
            self._send(m.CertRequest(identity))
        fut: asyncio.Future[WorkloadCertificate] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        return await fut

    def update(self, msg: m.Cert) -> None:
        waiters = self._waiting.pop(msg.identity, [])
        if msg.bundle is not None:
            cert = self._certs[msg.identity] = cert_from_bundle(msg.bundle, self._policy)
            for fut in waiters:
                if not fut.done():
                    fut.set_result(cert)
            return
        err = CertificateUnavailable(msg.identity, RuntimeError(msg.error or "unavailable"))
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)

    def forget(self, identity: Identity) -> None:
        self._certs.pop(identity, None)
        for fut in self._waiting.pop(identity, []):
            if not fut.done():
                fut.set_exception(CertificateForgotten(identity))


class Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.state: State | None = None  # (the shared store, mapped at Hello)
        self.proxies: dict[int, tuple[ProxyInstance, int | None]] = {}
        self.dataplane: DataPlane | None = None
        self.secrets: RemoteSecrets | None = None
        self.registry = CollectorRegistry()
        self.config: Config | None = None
        self._demands: dict[int, asyncio.Future[None]] = {}
        self._next = 0
        self._done = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._channel: Channel | None = None
        self._log: Any = None

    async def run(self, sock: socket.socket) -> int:
        self._channel = Channel(sock, self._on_message, self._done.set)
        await self._done.wait()
        await self._stop(0)
        if self.state is not None:
            self.state.close()
            self.state.store.close()
        return 0

    def _send(self, msg: Any) -> None:
        if self._channel is not None and not self._channel.closed:
            self._channel.send(msg)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- messages ------------------------------------------------------------------------------

    def _on_message(self, msg: Any, fds: list[int]) -> None:
        if isinstance(msg, m.StateChanged):
            assert self.state is not None
            self.state.apply_changes(
                StateChange(ChangeKind(kind), key, removed, ref)
                for kind, key, removed, ref in msg.changes
            )
        elif isinstance(msg, m.Cert):
            assert self.secrets is not None
            self.secrets.update(msg)
        elif isinstance(msg, m.CertGone):
            assert self.secrets is not None
            self.secrets.forget(msg.identity)
        elif isinstance(msg, m.AddPod):
            self._add_pod(msg, fds)
        elif isinstance(msg, m.RemovePod):
            self._spawn(self._remove_pod(msg))
        elif isinstance(msg, m.Retire):
            self._spawn(self._retire(msg))
        elif isinstance(msg, m.Query) and msg.what == "profile":
            self._spawn(self._profile(msg))
        elif isinstance(msg, m.Query):
            self._send(m.Reply(msg.request, self._query(msg.what)))
        elif isinstance(msg, m.Demanded):
            fut = self._demands.pop(msg.request, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, m.SetLogLevel):
            if self._log is not None:
                self._log.change(msg.spec, reset=True)
        elif isinstance(msg, m.Hello):
            self._hello(msg)
        elif isinstance(msg, m.Sync):  # (messages are applied in order: the state is in)
            self._send(m.Ready(os.getpid()))
        else:
            for fd in fds:
                os.close(fd)
            log.warning("worker %d: unexpected message %s", self.index, type(msg).__name__)

    def _hello(self, msg: m.Hello) -> None:
        from ztunnel.admin.logctl import LogControl

        cfg = self.config = msg.config
        state = self.state = State.open(msg.store, map_size=cfg.state_max_bytes)
        self._log = LogControl(cfg.rust_log)
        if msg.log_spec != cfg.rust_log:
            self._log.change(msg.log_spec, reset=True)
        policy, crl = tls_policy(cfg, self.registry)
        self.secrets = RemoteSecrets(self._send, policy)
        dp = self.dataplane = DataPlane(
            cfg,
            state,
            self.secrets,
            self.registry,
            crl=crl,
            tag=istio_version_from_env(),
            build_info=False,
            process_metrics=False,
        )
        dp.instances = lambda: [p for p, _ in self.proxies.values()]
        dp.start()
        if cfg.xds_on_demand:
            state.demander = self._demand

    async def _demand(self, name: str) -> None:
        self._next += 1
        rid = self._next
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._demands[rid] = fut
        self._send(m.Demand(name, rid))
        try:
            await fut
        finally:
            self._demands.pop(rid, None)

    def _add_pod(self, msg: m.AddPod, fds: list[int]) -> None:
        assert self.dataplane is not None and self.config is not None
        netns = fds[0] if msg.has_netns else None
        socks = fds[1:] if msg.has_netns else fds
        adopt = {k: socket.socket(fileno=fd) for k, fd in zip(msg.keys, socks, strict=True)}
        extra: frozenset[IPAddr] = frozenset()
        if self.config.proxy_mode is ProxyMode.DEDICATED and self.config.instance_ip:
            extra = frozenset({parse_ip(self.config.instance_ip)})
        proxy = self.dataplane.build(msg.info, netns, msg.name, extra_local_ips=extra)
        proxy.sockets.adopt = adopt
        try:
            proxy.bind()
        except OSError as e:
            log.error("worker %d: cannot serve %s: %s", self.index, msg.name, e)
            for s in adopt.values():
                s.close()
            if netns is not None:
                os.close(netns)
            return
        proxy.start()
        self.proxies[msg.key] = (proxy, netns)

    async def _remove_pod(self, msg: m.RemovePod) -> None:
        cut = 0
        entry = self.proxies.pop(msg.key, None)
        if entry is not None:
            proxy, netns = entry
            try:
                cut = await proxy.drain(msg.deadline)
            finally:
                if netns is not None:
                    os.close(netns)
        self._send(m.Reply(msg.request, cut))

    async def _retire(self, msg: m.Retire) -> None:
        """Replaced by a fresh worker: accept nothing more (the others take the shared
        queues), tell HBONE peers to open no new streams here, and answer once every connection
        has finished, however long that takes (a RemovePod meanwhile cuts a pod's at its
        deadline). The pods stay in ``proxies`` for RemovePod and the admin views."""
        proxies = [p for p, _ in self.proxies.values()]
        live = sum(p.active_connections for p in proxies)
        log.info("worker %d retiring: waiting for %d connection(s) to finish", self.index, live)
        await asyncio.gather(*(p.drain(None) for p in proxies))
        self._send(m.Reply(msg.request, live))

    async def _stop(self, deadline: float) -> int:
        entries = list(self.proxies.values())
        self.proxies.clear()
        cut = sum(await asyncio.gather(*(p.drain(deadline) for p, _ in entries)))
        for _, netns in entries:
            if netns is not None:
                os.close(netns)
        return cut

    # --- queries -------------------------------------------------------------------------------

    async def _profile(self, msg: m.Query) -> None:
        from ztunnel.admin.profiling import ProfileBusy, Profiler

        seconds, frequency = msg.args
        try:
            prof = await Profiler().cpu(seconds, frequency)
        except ProfileBusy:
            prof = None
        self._send(m.Reply(msg.request, prof))

    def _query(self, what: str) -> Any:
        if what == "metrics":
            return registry_values(self.registry)
        if what == "live":
            prefix = f"w{self.index}-"
            return {
                key: [_snapshot(rec, prefix) for rec in proxy.ctx.tracker.live]
                for key, (proxy, _) in self.proxies.items()
            }
        if what in ("connections", "recycle"):
            live = sum(p.active_connections for p, _ in self.proxies.values())
            # (recycle: workers/recycle.py also weighs the objects held)
            return live if what == "connections" else (live, sys.getallocatedblocks())
        if what == "stats":
            return self.dataplane.runtime_stats() if self.dataplane is not None else {}
        if what == "sync":  # (answered in order: everything sent before it is applied)
            return True
        return None


def _snapshot(rec: Any, prefix: str) -> m.ConnectionSnapshot:
    sent, recv = rec.live_bytes()
    return m.ConnectionSnapshot(
        row_id=row_id(rec, prefix),
        direction=rec.direction,
        src=rec.src,
        dst=rec.dst,
        orig_dst=rec.orig_dst,
        for_host=rec.for_host,
        hbone_addr=rec.hbone_addr,
        mtls=rec.mtls,
        double_hbone=rec.double_hbone,
        src_identity=rec.src_identity,
        dst_identity=rec.dst_identity,
        src_workload=rec.src_workload,
        dst_workload=rec.dst_workload,
        dst_service=rec.dst_service,
        started=rec.started,
        sent=sent,
        recv=recv,
    )
