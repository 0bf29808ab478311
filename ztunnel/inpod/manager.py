"""In-pod mode: one ProxyInstance per pod the node agent hands over, inside that pod's netns.

This is the ZDS ``WorkloadHandler``. It keeps each pod's netns fd open for the proxy's lifetime
and identifies the namespace by (inode, dev): an add for the same uid and the same namespace is a
no-op; a different namespace replaces the proxy. A pod whose listeners fail to start is NACKed,
kept pending and retried every 5 s. ``delete`` and reconcile stop proxies at once (Immediate);
``shutdown`` drains the rest gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ztunnel.config import WorkloadInfo as ConfigWorkloadInfo
from ztunnel.inpod.client import PENDING_RETRY_INTERVAL
from ztunnel.inpod.protocol import WorkloadInfo, check_netns_fd, netns_identity
from ztunnel.proxy.instance import ProxyInstance

log = logging.getLogger("ztunnel.inpod")

ProxyBuilder = Callable[[ConfigWorkloadInfo, int | None, str], ProxyInstance]


@dataclass
class _Pod:
    uid: str
    info: WorkloadInfo
    netns_fd: int
    netns_id: tuple[int, int]
    proxy: ProxyInstance | None = None
    retry: asyncio.Task[None] | None = None


class InPodManager:
    def __init__(
        self,
        build: ProxyBuilder,
        *,
        retry_interval: float = PENDING_RETRY_INTERVAL,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._build = build
        self._on_change = on_change
        self._retry_interval = retry_interval
        self.pods: dict[str, _Pod] = {}
        self.started_total = 0
        self.stopped_total = 0

    # --- ZDS WorkloadHandler ----------------------------------------------------------------

    async def add(self, uid: str, info: WorkloadInfo, netns_fd: int) -> str | None:
        try:
            ident = netns_identity(netns_fd)
        except OSError as e:
            os.close(netns_fd)
            return f"cannot stat the netns fd: {e}"
        if (why := check_netns_fd(netns_fd)) is not None:
            log.warning("pod %s: %s (continuing)", uid, why)
        old = self.pods.get(uid)
        if old is not None:
            if old.netns_id == ident:
                os.close(netns_fd)
                return None  # same pod, same namespace: nothing to do
            log.info("pod %s: network namespace changed; replacing its proxy", uid)
            await self._stop(old)
        pod = _Pod(uid, info, netns_fd, ident)
        self.pods[uid] = pod
        error = self._try_start(pod)
        if error is not None:
            pod.retry = asyncio.get_running_loop().create_task(self._retry(pod))
            self._on_change()
        return error

    async def keep(self, uid: str) -> None:
        return None  # the session records the uid as named; nothing to change here

    async def delete(self, uid: str) -> None:
        pod = self.pods.get(uid)
        if pod is not None:
            await self._stop(pod)

    async def reconcile(self, named_uids: Iterable[str]) -> None:
        keep = set(named_uids)
        for pod in [p for uid, p in self.pods.items() if uid not in keep]:
            log.info("pod %s was not in the node agent's snapshot; stopping its proxy", pod.uid)
            await self._stop(pod)

    # --- internals -----------------------------------------------------------------------------

    def _try_start(self, pod: _Pod) -> str | None:
        info = ConfigWorkloadInfo(pod.info.namespace, pod.info.name, pod.info.service_account)
        proxy = self._build(info, pod.netns_fd, f"{pod.info.namespace}/{pod.info.name}")
        try:
            proxy.bind()
        except OSError as e:
            msg = f"failed to start proxy for pod {pod.uid}: {e}"
            log.warning("%s; retrying every %.0fs", msg, self._retry_interval)
            return msg
        proxy.start()
        pod.proxy = proxy
        self.started_total += 1
        self._on_change()
        log.info("pod %s (%s/%s): proxy started", pod.uid, pod.info.namespace, pod.info.name)
        return None

    async def _retry(self, pod: _Pod) -> None:
        while pod.proxy is None and self.pods.get(pod.uid) is pod:
            await asyncio.sleep(self._retry_interval)
            if self.pods.get(pod.uid) is pod and pod.proxy is None:
                self._try_start(pod)

    async def _stop(self, pod: _Pod, *, graceful: float | None = None) -> int:
        """Stop a pod's proxy: at once, or draining for ``graceful`` seconds. Returns cut count."""
        if self.pods.get(pod.uid) is pod:
            del self.pods[pod.uid]
        if pod.retry is not None:
            pod.retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pod.retry
        cut = 0
        try:
            if pod.proxy is not None:
                if graceful is None:
                    await pod.proxy.close()
                else:
                    cut = await pod.proxy.drain(graceful)
                self.stopped_total += 1
                log.info("pod %s: proxy stopped", pod.uid)
        finally:
            os.close(pod.netns_fd)
            self._on_change()
        return cut

    def instances(self) -> list[ProxyInstance]:
        return [p.proxy for p in self.pods.values() if p.proxy is not None]

    @property
    def active(self) -> int:
        return sum(1 for p in self.pods.values() if p.proxy is not None)

    @property
    def pending(self) -> int:
        return sum(1 for p in self.pods.values() if p.proxy is None)

    async def shutdown(self, deadline: float) -> int:
        """Process exit: drain every pod's proxy gracefully, in parallel. Returns connections cut."""
        pods = list(self.pods.values())
        return sum(await asyncio.gather(*(self._stop(p, graceful=deadline) for p in pods)))
