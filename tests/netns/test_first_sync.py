"""No plaintext window before the state is known (Rust ``app.rs``: the dedicated proxy's accept
loop waits for the first xDS sync, and ``proxy.rs`` ``wait_for_workload``).

A dedicated-mode ztunnel in a pod with istio-cni's rules gets everything from a fake istiod. The
destination ``server`` is an HBONE workload: connections to it must go to its 15008, never to its
app port in plaintext. The server pod runs two plain listeners that only count what reaches
them: the app port and 15008 (no HBONE server is needed to see which one a connection went to).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.state.model import TunnelProtocol, Workload
from ztunnel.testing.apps import connect_from, listen_in
from ztunnel.testing.fakeistiod import ISTIOD_SAN
from ztunnel.testing.netns import Pod, Testbed
from ztunnel.testing.proc import ZtunnelProcess
from ztunnel.testing.xdsbed import ISTIOD_PORT, TOKEN, IstiodThread, http_get

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(120),
]

APP_PORT = 8080


class Counter:
    """Accepts on a listening socket in a thread and counts the connections."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def _workload(pod: Pod, name: str, node: str) -> Workload:
    return Workload(
        uid=f"cluster1//v1/Pod/default/{name}",
        name=name,
        namespace="default",
        addresses=(parse_ip(pod.ip4),),
        protocol=TunnelProtocol.HBONE,
        service_account=f"sa-{name}",
        node=node,
    )


def _fillers(n: int) -> list[Workload]:
    """``n`` other pods of the mesh (a snapshot that takes a while to load)."""
    return [
        Workload(
            uid=f"cluster1//v1/Pod/fill/p{i}",
            name=f"p{i}",
            namespace="fill",
            addresses=(parse_ip(f"10.{200 + i // 65536}.{i // 256 % 256}.{i % 256}"),),
            protocol=TunnelProtocol.HBONE,
            service_account=f"sa{i % 50}",
            node=f"node{i % 100}",
            canonical_name=f"app{i % 1000}",
        )
        for i in range(n)
    ]


@dataclass
class Bed:
    tb: Testbed
    client: Pod
    server: Pod
    istiod: IstiodThread
    app: Counter
    hbone: Counter
    zt: ZtunnelProcess


@contextlib.contextmanager
def bed(
    *, fillers: int = 0, response_delay: float = 0.0, workers: str | None = None
) -> Iterator[Bed]:
    with Testbed() as tb:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        client, server = n1.add_pod("client"), n2.add_pod("server")
        client.install_inpod_rules()
        host = tb.add_external("istiod")
        # A dedicated ztunnel runs inside the pod it serves: its own control-plane connections
        # must not be captured to its outbound listener (a sidecar deployment excludes them).
        client.run(
            "iptables", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-d", host.ip4, "-j", "ACCEPT"
        )
        sock = listen_in(host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=True, server_names=(ISTIOD_SAN, host.ip4), accept_tokens=[TOKEN])
        app = Counter(listen_in(server, APP_PORT, backlog=4096))
        hbone = Counter(listen_in(server, 15008, backlog=4096))
        zt: ZtunnelProcess | None = None
        try:
            istiod.call(
                istiod.istiod.set_addresses,
                _workload(client, "client", "n1"),
                _workload(server, "server", "n2"),
                *_fillers(fillers),
            )
            istiod.istiod.response_delay = response_delay
            istiod.start(sock)
            root = istiod.istiod.root_pem
            address = f"https://{host.ip4}:{ISTIOD_PORT}"
            env = {
                "PROXY_MODE": "dedicated",
                "PROXY_WORKLOAD_INFO": "default/client/sa-client",
                "NODE_NAME": "n1",
                "XDS_ADDRESS": address,
                "CA_ADDRESS": address,
                "XDS_ROOT_CA": root,
                "CA_ROOT_CA": root,
                "AUTH_TOKEN": TOKEN,
            }
            if workers is not None:
                env["ZTUNNEL_WORKER_THREADS"] = workers
            zt = ZtunnelProcess(client, env)
            yield Bed(tb, client, server, istiod, app, hbone, zt)
        finally:
            if zt is not None and zt.proc is not None:
                rc = zt.stop()
                assert rc == 0, f"ztunnel exited with {rc}: {zt.internal_errors()}"
            app.close()
            hbone.close()
            istiod.close()


def _ready(b: Bed) -> bool:
    try:
        return http_get(b.client, 15021, "/healthz/ready", timeout=1)[0] == 200
    except OSError:
        return False


def _probe(b: Bed, stop: threading.Event, made: list[int]) -> None:
    """Connect to the server's app port again and again (each is captured to 15001)."""
    while not stop.is_set():
        with contextlib.suppress(OSError):
            s = connect_from(b.client, b.server.ip4, APP_PORT, timeout=2)
            made[0] += 1
            s.close()
        time.sleep(0.01)


def test_a_delayed_first_sync_leaves_no_plaintext_window() -> None:
    """istiod answers 3 s late. A connection made meanwhile waits in the listener's backlog
    (the kernel completed it; ztunnel does not accept yet), then goes over HBONE once the
    state says the server is in the mesh. It is never passed through to the app port."""
    with bed(response_delay=3.0) as b:
        b.zt.start()
        t0 = time.monotonic()
        with connect_from(b.client, b.server.ip4, APP_PORT, timeout=10):
            assert not _ready(b)
            deadline = time.monotonic() + 20
            while b.hbone.count == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            waited = time.monotonic() - t0
        assert b.hbone.count >= 1, "the early connection never went to the server's 15008"
        assert b.app.count == 0, "passed through in plaintext before the first sync"
        assert waited >= 2.5, waited  # it waited for the sync (3 s), not routed at once
        b.zt.wait_for(lambda r: r.get("message") == "xDS: initial sync complete")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_big_snapshot_leaves_no_plaintext_window(workers: str) -> None:
    """A 40,000-pod snapshot (more than LMDB maps for a reader by default): every process must
    hold it before anything is served (with workers, readiness and serving wait for every
    worker to have it). Probes start before ztunnel does and never stop: not one reaches the
    app port in plaintext, and after readiness every one goes over HBONE."""
    with bed(fillers=40_000, workers=workers) as b:
        stop = threading.Event()
        made = [0]
        prober = threading.Thread(target=_probe, args=(b, stop, made), daemon=True)
        prober.start()
        try:
            b.zt.start(timeout=60)
            deadline = time.monotonic() + 90
            while not _ready(b):
                assert time.monotonic() < deadline, "never ready"
                time.sleep(0.1)
            time.sleep(0.5)
            hbone0, made0 = b.hbone.count, made[0]
            time.sleep(1.5)  # probes made after readiness: every one goes to the 15008
            hbone1, made1 = b.hbone.count, made[0]
        finally:
            stop.set()
            prober.join(10)
        assert b.app.count == 0, f"{b.app.count} of {made[0]} probes passed through in plaintext"
        assert made1 - made0 >= 10
        assert hbone1 - hbone0 >= made1 - made0 - 2, (hbone0, hbone1, made0, made1)
