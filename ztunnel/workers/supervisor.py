"""The supervisor's side of the workers: spawn them, keep them fed, restart the ones that die.

The supervisor keeps the control plane (ZDS, xDS, the CA, admin, metrics) and binds every
listening socket itself, inside the pod's netns as today: ``RemoteInstance`` is a ProxyInstance
that binds but never accepts; its ``start`` hands the sockets (and the netns) to every worker,
which all accept from the same kernel queues. A pod's bind failure is therefore still the
supervisor's to report to the node agent, and a worker that dies loses only the connections it
had accepted: the listeners stay open in the supervisor and the other workers.

Each worker gets: the config; the path of the shared state store, which it maps read-only (the
node's one copy of the state: ``ztunnel/state/shared.py``), then what every commit changed;
certificates on request, and every renewal pushed; every pod's sockets. On-demand xDS lookups
are forwarded here and answered once the state they brought was committed.

A worker that a burst left well above its fresh size is replaced once idle
(``workers/recycle.py``): a fresh one takes its slot and the old one retires, serving the
connections it has until they finish. Everything sent to the workers reaches the retiring ones
too, but new pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry

from ztunnel import proctree
from ztunnel.admin.profiling import CpuProfile
from ztunnel.admin.readiness import Readiness
from ztunnel.config import Config
from ztunnel.core.identity import Identity
from ztunnel.dataplane import DataPlane
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.manager import SecretManager
from ztunnel.metrics import RegistryValues, add_values, cumulative_families, merged_registry
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.state.store import State, StateChange, summarize
from ztunnel.workers import messages as m
from ztunnel.workers.ipc import Channel, ChannelClosed, encode
from ztunnel.workers.recycle import RecyclePolicy, Watch
from ztunnel.workers.zygote import Zygote

log = logging.getLogger("ztunnel.workers")

START_TIMEOUT = 30.0
QUERY_TIMEOUT = 5.0
BARRIER_TIMEOUT = 60.0
RESTART_DELAY = 1.0
RETIRE_REPORT = 20  # recycling checks between the log lines of a worker still retiring
MAX_BACKLOG = 64 * 1024 * 1024  # bytes queued to one worker (a stuck one is killed past it)


class WorkerStartError(Exception):
    """The workers did not come up."""


def cert_bundle(cert: WorkloadCertificate) -> m.CertBundle:
    def build() -> m.CertBundle:
        der = serialization.Encoding.DER
        key = cert.private_key.private_bytes(
            der, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return (
            key,
            cert.leaf.public_bytes(der),
            tuple(c.public_bytes(der) for c in cert.intermediates),
            tuple(c.public_bytes(der) for c in cert.roots),
        )

    bundle: m.CertBundle = cert.memo("worker_bundle", build)
    return bundle


@dataclass(eq=False)
class _Worker:
    index: int
    channel: Channel | None = None
    pid: int = 0
    ready: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    requests: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    certs: set[Identity] = field(default_factory=set)
    last_metrics: RegistryValues | None = None  # its series at the last scrape
    watch: Watch = field(default_factory=Watch)  # its memory, for recycling
    retired: bool = False  # it answered Retire: every connection it had has finished

    def send(self, msg: Any, fds: Iterable[int] = (), *, encoded: bytes | None = None) -> bool:
        if self.channel is None or self.channel.closed:
            return False
        try:
            self.channel.send_encoded(encode(msg) if encoded is None else encoded, list(fds))
        except ChannelClosed:
            return False
        if self.channel.pending_bytes > MAX_BACKLOG and self.pid:
            # A worker that stopped reading (stuck) would make us queue without bound: it is
            # killed, and restarted like one that died.
            log.error(
                "worker %d (pid %d) is not reading its channel; killing it", self.index, self.pid
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.channel.close()
            return False
        return True


class RemoteInstance(ProxyInstance):
    """A pod's listeners, bound here and served by the workers."""

    def __init__(self, pool: WorkerPool, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool = pool
        self.key = pool.new_key()
        self.live: list[m.ConnectionSnapshot] = []  # as of the last refresh

    def start(self) -> None:
        for lst in self.listeners:
            log.info("%s listening on %s:%d", lst.name, *lst.address)
        self.pool.add(self)

    async def drain(self, deadline: float | None) -> int:
        # Our copies go first: the kernel queues stay only while some worker still listens
        # (each closes its own as its drain starts), so no connection waits in a queue that
        # nobody accepts from (another ztunnel bound beside us gets it instead).
        for comp in self.companions:
            comp.abort()
        for sock in self.sockets.bound.values():
            sock.close()
        return await self.pool.remove(self, deadline)

    def recheck_policies(self) -> int:
        return 0  # (each worker re-checks its own connections)

    def live_connections(self) -> Iterable[Any]:
        return self.live

    @property
    def active_connections(self) -> int:
        return len(self.live)


class WorkerPool:
    def __init__(
        self,
        config: Config,
        state: State,
        secrets: SecretManager,
        zygote: Zygote,
        readiness: Readiness,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.n = config.num_worker_threads
        self.state = state
        self.secrets = secrets
        self.zygote = zygote
        self.registry = registry
        self.log_spec = config.rust_log
        self.token = readiness.register("workers")
        self.workers: dict[int, _Worker] = {}  # slot index -> the worker serving it
        self.retiring: dict[int, _Worker] = {}  # slot index -> the one it replaced, finishing
        self.recycle = RecyclePolicy(config.worker_recycle_growth)
        self.recycles = 0
        self.pods: dict[int, RemoteInstance] = {}
        self.restarts = 0
        self._keys = 0
        self._requests = 0
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._metrics_memo: dict[str, dict[tuple[str, ...], Any]] = {}
        self._retired: RegistryValues = {}  # dead workers' counters, as last scraped
        self._cumulative: frozenset[str] | None = None
        state.on_commit(self._on_commit)
        secrets.on_certificate = self._on_certificate
        secrets.on_forget = self._on_forget

    def attach(self, dataplane: DataPlane) -> None:
        """Make ``dataplane.build`` construct RemoteInstances; its ``process_*`` metrics count
        the zygote and the workers too."""
        dataplane.instance_class = functools.partial(RemoteInstance, self)
        if dataplane.metrics.process is not None:
            dataplane.metrics.process.pids = self.pids

    def pids(self) -> list[int]:
        """The other processes of this ztunnel: the zygote and the running workers."""
        return [self.zygote.pid, *(w.pid for w in self._all() if w.pid)]

    def _all(self) -> list[_Worker]:
        """Every worker process: those serving a slot, then those retiring."""
        return [*self.workers.values(), *self.retiring.values()]

    def new_key(self) -> int:
        self._keys += 1
        return self._keys

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        for i in range(self.n):
            self._spawn(i)
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await asyncio.gather(*(w.ready for w in self.workers.values()))
        except (TimeoutError, ConnectionError) as e:
            raise WorkerStartError(f"data-plane workers did not start: {e!r}") from None
        log.info("%d data-plane workers running", self.n)
        if self.recycle.growth > 0:
            self._task(self._watch(self.config.worker_recycle_interval.total_seconds()))

    def _spawn(self, index: int) -> None:
        if self._closing:
            return
        w = _Worker(index)
        self.workers[index] = w
        try:
            sock = self.zygote.spawn(index)
        except OSError as e:
            log.error("cannot start worker %d: the zygote is gone (%s)", index, e)
            w.ready.set_exception(ConnectionError(f"worker {index}: {e}"))
            w.ready.exception()
            return
        w.channel = Channel(
            sock, functools.partial(self._on_message, w), functools.partial(self._on_close, w)
        )
        # (It sees every commit made before it maps the store; the later ones are sent.)
        w.send(m.Hello(self.config, self.log_spec, self.state.store.path))
        for inst in self.pods.values():
            self._send_pod(w, inst)
        # Ready (and readiness) only once the worker maps the state and serves the pods.
        w.send(m.Sync())

    def _on_close(self, w: _Worker) -> None:
        if self.retiring.get(w.index) is w:
            del self.retiring[w.index]
            if w.retired:
                log.info("worker %d (pid %d) retired", w.index, w.pid)
            else:  # (its replacement holds the slot already: nothing to restart)
                log.error(
                    "worker %d (pid %d) exited while retiring, before its connections finished",
                    w.index,
                    w.pid,
                )
        if w.last_metrics is not None:  # (what it counted up to its last scrape, kept)
            if self._cumulative is None:
                self._cumulative = cumulative_families(self.registry)
            add_values(self._retired, w.last_metrics, self._cumulative)
            w.last_metrics = None
        self.state.store.reader_check()  # (its snapshot would keep old pages from reuse)
        for fut in w.requests.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"worker {w.index} exited"))
        w.requests.clear()
        if not w.ready.done():
            w.ready.set_exception(ConnectionError(f"worker {w.index} exited during start-up"))
            w.ready.exception()  # (retrieved: a restart may never await it)
        if self._closing or self.workers.get(w.index) is not w:
            return
        self.restarts += 1
        log.error("worker %d (pid %d) exited; restarting it", w.index, w.pid)
        self.token.not_ready_again()
        asyncio.get_running_loop().call_later(RESTART_DELAY, self._spawn, w.index)

    async def close(self) -> None:
        """Stop every worker (their proxies were drained before) and the zygote."""
        self._closing = True
        everyone = self._all()
        pids = [w.pid for w in everyone if w.pid]
        for w in everyone:
            if w.channel is not None:
                w.channel.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        deadline = time.monotonic() + 2.0
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                await asyncio.sleep(0.02)
        self.zygote.close()

    # --- recycling (workers/recycle.py) --------------------------------------------------------

    async def _watch(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            # One worker retires at a time: a retiree that a long-lived connection holds costs
            # a worker's memory until it ends, so N + 1 processes at most, never 2N.
            for w in list(self.workers.values()):
                if self.retiring:
                    break
                if w.pid and w.ready.done():
                    await self._check(w)

    async def _check(self, w: _Worker) -> None:
        if w.channel is None or w.channel.closed:  # (dead: its restart is on the way)
            return
        got = await self._ask_one(w, lambda rid: m.Query("recycle", rid))
        private = proctree.private_dirty(w.pid)
        if not isinstance(got, tuple) or private is None:
            return
        connections, blocks = got
        if self.workers.get(w.index) is w and w.watch.observe(
            self.recycle, private, blocks, connections
        ):
            self._replace(w, private, blocks, connections)

    def _replace(self, w: _Worker, private: int, blocks: int, connections: int) -> None:
        if self._closing:
            return
        self.recycles += 1
        log.info(
            "worker %d (pid %d) holds %.1f MiB more than when it started, %.1f MiB of it "
            "no longer in use (%.1f MiB private), with %d connection(s): a fresh worker takes "
            "its place",
            w.index,
            w.pid,
            w.watch.grown(private) / (1 << 20),
            w.watch.wasted(private, blocks) / (1 << 20),
            private / (1 << 20),
            connections,
        )
        self.retiring[w.index] = w  # (before the new one takes the slot: not a death)
        self._spawn(w.index)
        self._task(self._retire(w))

    async def _retire(self, w: _Worker) -> None:
        """Once the retiring worker has no connections left: its final counts, then it goes."""
        every = RETIRE_REPORT * self.config.worker_recycle_interval.total_seconds()
        done = asyncio.get_running_loop().create_task(
            self._ask_one(w, lambda rid: m.Retire(rid), timeout=None)
        )
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=every)
                if not done.done():  # (what keeps it: no worker is recycled meanwhile)
                    left = await self._ask_one(w, lambda rid: m.Query("connections", rid))
                    log.info(
                        "worker %d (pid %d) still retiring: %s connection(s) open",
                        w.index,
                        w.pid,
                        left,
                    )
        finally:
            done.cancel()
        w.retired = done.result() is not None  # (None: it was gone before it answered)
        final = await self._ask_one(w, lambda rid: m.Query("metrics", rid))
        if final is not None:
            w.last_metrics = final
        if w.channel is not None:
            w.channel.close()  # (it exits; _on_close keeps its counts)

    # --- messages from workers -----------------------------------------------------------------

    def _on_message(self, w: _Worker, msg: Any, fds: list[int]) -> None:
        for fd in fds:  # (workers send none)
            os.close(fd)
        if isinstance(msg, m.Reply):
            fut = w.requests.pop(msg.request, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.value)
        elif isinstance(msg, m.CertRequest):
            w.certs.add(msg.identity)
            self._task(self._serve_cert(w, msg.identity))
        elif isinstance(msg, m.Demand):
            self._task(self._serve_demand(w, msg))
        elif isinstance(msg, m.Ready):
            w.pid = msg.pid
            if not w.ready.done():
                w.ready.set_result(None)
            log.info("worker %d ready (pid %d)", w.index, w.pid)
            if all(x.ready.done() and x.pid for x in self.workers.values()):
                self.token.done()

    def _task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_cert(self, w: _Worker, identity: Identity) -> None:
        try:
            cert = await self.secrets.fetch_certificate(identity)
        except Exception as e:  # (CertificateError, or anything: the worker must get an answer)
            w.send(m.Cert(identity, None, str(e) or type(e).__name__))
        else:
            w.send(m.Cert(identity, cert_bundle(cert)))

    async def _serve_demand(self, w: _Worker, msg: m.Demand) -> None:
        demander = self.state.demander
        try:
            if demander is not None:
                await demander(msg.name)
        finally:  # (after the commit it brought: its StateChanged went first)
            w.send(m.Demanded(msg.request))

    # --- certificates --------------------------------------------------------------------------

    def _on_certificate(self, identity: Identity, cert: WorkloadCertificate) -> None:
        for w in self._all():
            if identity in w.certs:
                w.send(m.Cert(identity, cert_bundle(cert)))

    def _on_forget(self, identity: Identity) -> None:
        for w in self._all():
            if identity in w.certs:
                w.certs.discard(identity)
                w.send(m.CertGone(identity))

    # --- state ---------------------------------------------------------------------------------

    def _on_commit(self, changes: list[StateChange]) -> None:
        """Tell every worker what a commit changed (sent at once: a pod added, or an on-demand
        answer, after it must reach the workers after it); a big one summarized (a snapshot:
        the workers forget what they decoded instead of reading a list of every pod)."""
        told = summarize(changes)
        msg = m.StateChanged([(c.kind.value, c.key, c.removed, c.ref) for c in told])
        payload = encode(msg)  # (once for every worker)
        for w in self._all():
            w.send(msg, encoded=payload)

    # --- pods ----------------------------------------------------------------------------------

    def add(self, inst: RemoteInstance) -> None:
        self.pods[inst.key] = inst
        for w in self.workers.values():
            self._send_pod(w, inst)

    def _send_pod(self, w: _Worker, inst: RemoteInstance) -> None:
        keys = tuple(inst.sockets.bound)
        fds = [s.fileno() for s in inst.sockets.bound.values()]
        netns = inst.sockets.netns_fd
        if netns is not None:
            fds.insert(0, netns)
        w.send(m.AddPod(inst.key, inst.name, inst.info, keys, netns is not None), fds)

    async def remove(self, inst: RemoteInstance, deadline: float | None) -> int:
        """Every worker drains the pod (for ``deadline`` seconds); returns connections cut."""
        if self.pods.pop(inst.key, None) is None:
            return 0
        replies = await self._ask(
            lambda rid: m.RemovePod(inst.key, deadline, rid),
            timeout=None if deadline is None else deadline + QUERY_TIMEOUT,
        )
        return sum(r for r in replies if isinstance(r, int))

    # --- requests ------------------------------------------------------------------------------

    def _up(self) -> list[_Worker]:
        return [w for w in self._all() if w.ready.done() and not w.ready.exception()]

    async def _ask(self, make: Any, timeout: float | None = QUERY_TIMEOUT) -> list[Any]:
        """Every running worker's answer (those that answered in time)."""
        got = await asyncio.gather(*(self._ask_one(w, make, timeout) for w in self._up()))
        return [g for g in got if g is not None]

    async def _ask_one(self, w: _Worker, make: Any, timeout: float | None = QUERY_TIMEOUT) -> Any:
        """One worker's answer, or None (gone, or no answer in time)."""
        self._requests += 1
        rid = self._requests
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        w.requests[rid] = fut
        if not w.send(make(rid)):
            w.requests.pop(rid, None)
            return None
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except (TimeoutError, ConnectionError):
            return None
        finally:
            w.requests.pop(rid, None)

    async def barrier(self) -> None:
        """Return once every running worker has applied every state change made so far (the
        first xDS sync: readiness waits for the workers to hold it, not only the supervisor).
        A worker restarting meanwhile is not waited for: it is not ready until it maps the
        store anyway."""
        await self.query("sync", timeout=BARRIER_TIMEOUT)

    async def query(self, what: str, *args: Any, timeout: float = QUERY_TIMEOUT) -> list[Any]:
        return await self._ask(lambda rid: m.Query(what, rid, args), timeout=timeout)

    async def profiles(self, seconds: float, frequency: int) -> list[CpuProfile]:
        """Every worker's CPU profile of the next ``seconds``."""
        got = await self.query("profile", seconds, frequency, timeout=seconds + QUERY_TIMEOUT)
        return [p for p in got if p is not None]

    async def stats(self) -> dict[str, int]:
        """The workers' runtime stats, summed."""
        out: dict[str, int] = {}
        for stats in await self.query("stats"):
            for k, v in stats.items():
                out[k] = out.get(k, 0) + v
        return out

    async def scrape_registry(self) -> CollectorRegistry:
        """The supervisor's registry with every worker's series added (one scrape), and the
        counters of workers that died: a restart must not look like a counter reset (which
        Prometheus' rate() would read as a burst of everything the others counted)."""
        live = self._up()
        replies = await asyncio.gather(
            *(self._ask_one(w, lambda rid: m.Query("metrics", rid)) for w in live)
        )
        values: list[RegistryValues] = []
        for w, got in zip(live, replies, strict=True):
            # (one that exited since it answered is in _retired already: not twice)
            if got is not None and w.channel is not None and not w.channel.closed:
                w.last_metrics = got
                values.append(got)
        return merged_registry(self.registry, [*values, self._retired], self._metrics_memo)

    async def refresh_live(self) -> None:
        """Every pod's live connections, as the workers report them now."""
        replies = await self.query("live")
        for inst in self.pods.values():
            inst.live = [c for r in replies for c in r.get(inst.key, ())]

    def set_log_spec(self, spec: str) -> None:
        self.log_spec = spec
        for w in self._all():
            w.send(m.SetLogLevel(spec))

    def runtime_stats(self) -> dict[str, int]:
        return {
            "workers": sum(1 for w in self.workers.values() if w.pid),
            "worker_restarts": self.restarts,
            "worker_recycles": self.recycles,
            "workers_retiring": len(self.retiring),
        }


def _alive(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, 0)
        return True
    return False
