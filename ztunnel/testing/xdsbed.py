"""A test bed where all configuration comes from a fake istiod: xDS and certificates.

* :class:`IstiodThread` runs a :class:`~ztunnel.testing.fakeistiod.FakeIstiod` on its own event
  loop in a thread, so blocking (sync) tests can drive it while they block on sockets;
  ``call``/``run`` execute on that loop and return the result.
* :func:`xds_mesh` builds two nodes with pods, an external host ``istiod`` whose netns holds the
  fake istiod's listening socket (10.0.0.201:15012, TLS by default), and one shared-mode ztunnel
  per node fed by a :class:`~ztunnel.testing.nodeagent.FakeNodeAgent`. The ztunnels get no local
  config: ``XDS_ADDRESS`` and ``CA_ADDRESS`` point at the fake istiod (``AUTH_TOKEN`` is checked
  by it), which is preloaded with one HBONE workload per pod. With ``serve=False`` the socket
  listens but nothing answers until :meth:`XdsMesh.serve` (connections wait in its backlog), so
  a test can see ztunnel before its first xDS sync.
* :func:`http_get` makes a plain HTTP/1.1 request from inside a namespace (admin 15000, stats
  15020, readiness 15021 listen there); :func:`metric` reads one Prometheus sample.

Product code never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ztunnel.core.addr import parse_ip
from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.testing.apps import connect_from, listen_in
from ztunnel.testing.fakeistiod import ISTIOD_SAN, FakeIstiod, XdsRequestRecord
from ztunnel.testing.netns import External, Host, Node, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import ZtunnelProcess

__all__ = [
    "ISTIOD_PORT",
    "TOKEN",
    "IstiodThread",
    "MeshPod",
    "XdsMesh",
    "http_get",
    "metric",
    "xds_mesh",
]

_T = TypeVar("_T")

ISTIOD_PORT = 15012
TOKEN = "fake-istio-token"
TRUST_DOMAIN = "cluster.local"
READINESS_PORT = 15021


class IstiodThread:
    """A FakeIstiod living on an event loop in a daemon thread. ``istiod`` must only be touched
    through :meth:`call` (plain methods) and :meth:`run` (coroutines)."""

    def __init__(self, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-istiod")
        self._thread.daemon = True
        self._thread.start()
        self._closed = False
        self.istiod: FakeIstiod = self.call(lambda: FakeIstiod(**kwargs))

    def run(self, coro: Callable[[], Awaitable[_T]], timeout: float = 15.0) -> _T:
        """Run ``coro()`` on the istiod loop; wait for its result."""

        async def main() -> _T:
            return await coro()

        return asyncio.run_coroutine_threadsafe(main(), self.loop).result(timeout)

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Call ``fn(*args, **kwargs)`` on the istiod loop; return its result."""

        async def invoke() -> _T:
            return fn(*args, **kwargs)

        return self.run(invoke)

    def start(self, sock: socket.socket) -> None:
        self.run(lambda: self.istiod.start(sock=sock))

    def answers(self, nonces: Sequence[str], timeout: float = 5.0) -> list[XdsRequestRecord]:
        """The clients' ACK or NACK of each response nonce (waiting for them)."""
        wait = self.istiod.wait_response
        return [self.run(functools.partial(wait, n, timeout), timeout + 5) for n in nonces]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.run(self.istiod.stop, timeout=10)

        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_rest, timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


# --------------------------------------------------------------------------------------------
# plain HTTP from inside a namespace


def http_get(
    where: Host,
    port: int,
    target: str,
    *,
    headers: Mapping[str, str] | None = None,
    ip: str = "127.0.0.1",
    timeout: float = 5.0,
) -> tuple[int, str]:
    """``GET target`` on ``ip:port`` from ``where``'s netns; (status, body text)."""
    with connect_from(where, ip, port, timeout=timeout) as s:
        hdrs = {"Host": "localhost", "Connection": "close", **(headers or {})}
        head = f"GET {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
        s.sendall((head + "\r\n").encode())
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    head_bytes, _, body = raw.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, body.decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


# --------------------------------------------------------------------------------------------
# the mesh


@dataclass(frozen=True)
class MeshPod:
    """A pod of :func:`xds_mesh`: ``node`` is ``n1`` or ``n2``; namespace ``default``."""

    name: str
    node: str
    service_account: str


def workload_of(pod: Pod, spec: MeshPod, **extra: Any) -> Workload:
    """The xDS workload istiod would send for ``pod`` (HBONE, both IPs, on its node)."""
    return Workload(
        uid=f"cluster1//v1/Pod/default/{spec.name}",
        name=spec.name,
        namespace="default",
        addresses=(parse_ip(pod.ip4), parse_ip(pod.ip6)),
        protocol=TunnelProtocol.HBONE,
        trust_domain=TRUST_DOMAIN,
        service_account=spec.service_account,
        node=spec.node,
        workload_name=spec.name,
        **extra,
    )


@dataclass
class XdsMesh:
    tb: Testbed
    nodes: dict[str, Node]
    pods: dict[str, Pod]
    specs: dict[str, MeshPod]
    istiod_host: External
    istiod: IstiodThread
    agents: dict[str, FakeNodeAgent] = field(default_factory=dict)
    ztunnels: dict[str, ZtunnelProcess] = field(default_factory=dict)  # by node name
    _sock: socket.socket | None = None  # the listening socket until served

    @property
    def xds_address(self) -> str:
        scheme = "https" if self.istiod.istiod.tls else "http"
        return f"{scheme}://{self.istiod_host.ip4}:{ISTIOD_PORT}"

    def workload(self, name: str, **extra: Any) -> Workload:
        return workload_of(self.pods[name], self.specs[name], **extra)

    def ztunnel_of(self, pod: str) -> ZtunnelProcess:
        return self.ztunnels[self.specs[pod].node]

    def serve(self) -> None:
        """Start answering on the listening socket (idempotent)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self.istiod.start(sock)

    def wait_pods(self) -> None:
        """Every node agent has handed its pods over (ztunnel connects to it only after its
        first xDS sync, as Rust does)."""
        for agent in self.agents.values():
            agent.wait_for_snapshot()

    def readiness(self, node: str) -> tuple[int, str]:
        return http_get(self.nodes[node], READINESS_PORT, "/healthz/ready")


@contextlib.contextmanager
def xds_mesh(
    pods: Sequence[MeshPod],
    *,
    tls: bool = True,
    serve: bool = True,
    extra_env: Mapping[str, str] | None = None,
    withhold: Sequence[str] = (),
) -> Iterator[XdsMesh]:
    """See the module docstring. Every ztunnel must exit cleanly at teardown. With ``serve``
    False, istiod does not answer until ``mesh.serve()``, and so no ztunnel has its pods yet
    (``mesh.wait_pods()`` after serving). istiod starts without the workloads of the pods in
    ``withhold`` (the node agent still hands those pods over: a pod that comes up before istiod
    pushed its workload)."""
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        nodes = {"n1": tb.add_node("n1"), "n2": tb.add_node("n2")}
        host = tb.add_external("istiod")
        made = {p.name: nodes[p.node].add_pod(p.name) for p in pods}
        sock = listen_in(host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=tls, server_names=(ISTIOD_SAN, host.ip4), accept_tokens=[TOKEN])
        mesh = XdsMesh(tb, nodes, made, {p.name: p for p in pods}, host, istiod, _sock=sock)
        try:
            known = [mesh.workload(p.name) for p in pods if p.name not in withhold]
            istiod.call(istiod.istiod.set_addresses, *known)
            if serve:
                mesh.serve()
            root = istiod.istiod.root_pem
            for name, node in nodes.items():
                agent = FakeNodeAgent(os.path.join(tmp, f"{name}.sock")).start()
                mesh.agents[name] = agent
                for p in pods:
                    if p.node == name:
                        info = WorkloadInfo(
                            name=p.name, namespace="default", service_account=p.service_account
                        )
                        agent.put_pod(f"uid-{p.name}", info, made[p.name])
                env = {
                    "PROXY_MODE": "shared",
                    "NODE_NAME": name,
                    "INPOD_UDS": agent.path,
                    "XDS_ADDRESS": mesh.xds_address,
                    "CA_ADDRESS": mesh.xds_address,
                    "XDS_ROOT_CA": root,
                    "CA_ROOT_CA": root,
                    "AUTH_TOKEN": TOKEN,
                    "CONNECTION_TERMINATION_DEADLINE": "2s",
                    **(extra_env or {}),
                }
                mesh.ztunnels[name] = ZtunnelProcess(node, env)
            with ThreadPoolExecutor(len(mesh.ztunnels)) as pool:
                for started in [pool.submit(zt.start) for zt in mesh.ztunnels.values()]:
                    started.result()
            if serve:
                mesh.wait_pods()
            yield mesh
        finally:
            codes = {name: (zt.stop(), zt.internal_errors()) for name, zt in mesh.ztunnels.items()}
            for agent in mesh.agents.values():
                agent.close()
            istiod.close()
            if mesh._sock is not None:
                mesh._sock.close()
        failures = {name: c for name, c in codes.items() if c[0] != 0}
        assert not failures, f"ztunnel exit codes / internal errors: {failures}"
