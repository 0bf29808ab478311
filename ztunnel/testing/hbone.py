"""HBONE test helpers: a mesh of dedicated-mode ztunnels, a raw HBONE client, leak checks.

* ``mesh()`` builds two nodes with pod ``a`` (node n1) and pod ``b`` (node n2), one ztunnel per pod
  in dedicated mode sharing a local CA root through ``ZTUNNEL_LOCAL_CA_DIR``, plus optional extra
  pods (``PodSpec``) and an external host. The CA is created by the test process first, so tests
  can issue their own certificates from the same root (``Mesh.ca``).
* ``HboneClient`` is a blocking HBONE client on the python-hyper ``h2`` library (an HTTP/2
  implementation independent of ztunnel's own ``h2conn``) over ``ssl``: it presents any
  certificate and sends any request (CONNECT or not, any ``:authority``), and can vanish with a
  TCP RST.
* ``no_leaks()`` checks that ztunnel processes return to their fd / task / connection baseline.

Product code never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import LocalCA
from ztunnel.testing.apps import socket_in
from ztunnel.testing.netns import External, Host, Pod, Testbed
from ztunnel.testing.proc import Record, ZtunnelProcess

HBONE_PORT = 15008
TRUST_DOMAIN = "cluster.local"

# --------------------------------------------------------------------------------------------
# the mesh


@dataclass(frozen=True)
class PodSpec:
    """An extra pod for ``mesh()``.

    ``service_account``: the pod is a workload of the local config with this service account
    (``None``: the config does not know it). ``ztunnel``: run a ztunnel in the pod with this
    ``PROXY_WORKLOAD_INFO`` (``namespace/name/service account``; ``None``: no ztunnel).
    """

    name: str
    node: str = "n2"
    service_account: str | None = None
    ztunnel: str | None = None
    inpod_rules: bool = True


def workload_yaml(pod: Pod, service_account: str, **extra: str) -> str:
    """One local-config workload (HBONE protocol) for ``pod`` in namespace ``default``."""
    node = pod.node.name if pod.node is not None else ""
    lines = [
        f"- uid: cluster1//v1/Pod/default/{pod.name}",
        f"  name: {pod.name}",
        "  namespace: default",
        f"  serviceAccount: {service_account}",
        f"  trustDomain: {TRUST_DOMAIN}",
        f'  workloadIps: ["{pod.ip4}", "{pod.ip6}"]',
        "  protocol: HBONE",
        f"  node: {node}",
        *(f"  {k}: {v}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


def mesh_config(a: Pod, b: Pod, extra: Sequence[tuple[Pod, str]] = ()) -> str:
    """Workloads ``a`` (sa-a) and ``b`` (sa-b, behind service b.default:80 -> 8080), plus
    ``extra`` (pod, service account) workloads."""
    b_entry = workload_yaml(b, "sa-b") + (
        '  services:\n    "default/b.default.svc.cluster.local": {80: 8080}\n'
    )
    workloads = [
        workload_yaml(a, "sa-a", canonicalName="a-app", workloadName="a-deploy"),
        b_entry,
        *(workload_yaml(pod, sa) for pod, sa in extra),
    ]
    return (
        "workloads:\n"
        + "".join(workloads)
        + """services:
- name: b
  namespace: default
  hostname: b.default.svc.cluster.local
  vips: ["/10.96.0.20"]
  ports: {80: 8080}
"""
    )


@dataclass
class Mesh:
    tb: Testbed
    ca_dir: Path
    ca: LocalCA
    config: str
    pods: dict[str, Pod]
    ztunnels: dict[str, ZtunnelProcess]
    ext: External | None = None

    @property
    def a(self) -> Pod:
        return self.pods["a"]

    @property
    def b(self) -> Pod:
        return self.pods["b"]

    @property
    def zta(self) -> ZtunnelProcess:
        return self.ztunnels["a"]

    @property
    def ztb(self) -> ZtunnelProcess:
        return self.ztunnels["b"]


@contextlib.contextmanager
def mesh(
    loop: str = "uvloop",
    extra_env: dict[str, str] | None = None,
    *,
    extra_pods: Sequence[PodSpec] = (),
    start_b: bool = True,
    external: bool = False,
    config: Callable[[dict[str, Pod]], str] | None = None,
) -> Iterator[Mesh]:
    """Pods ``a`` (n1) and ``b`` (n2) with a ztunnel each (``start_b=False``: none in ``b``),
    ``extra_pods``, and with ``external`` an external host ``ext``. ``config`` builds the local
    config from the pods instead of :func:`mesh_config`. Every ztunnel must exit cleanly with no
    internal error at teardown."""
    specs = [
        PodSpec("a", "n1", "sa-a", "default/a/sa-a"),
        PodSpec("b", "n2", "sa-b", "default/b/sa-b" if start_b else None),
        *extra_pods,
    ]
    with Testbed() as tb, tempfile.TemporaryDirectory() as ca_dir:
        ca = LocalCA.load_or_create(Path(ca_dir), trust_domain=TRUST_DOMAIN)
        nodes = {"n1": tb.add_node("n1"), "n2": tb.add_node("n2")}
        pods: dict[str, Pod] = {}
        for spec in specs:
            pod = nodes[spec.node].add_pod(spec.name)
            if spec.inpod_rules:
                pod.install_inpod_rules()
            pods[spec.name] = pod
        ext = tb.add_external("ext") if external else None
        extra = [(pods[s.name], s.service_account) for s in extra_pods if s.service_account]
        cfg = config(pods) if config is not None else mesh_config(pods["a"], pods["b"], extra)
        common = {
            "PROXY_MODE": "dedicated",
            "LOCAL_XDS": cfg,
            "ZTUNNEL_LOCAL_CA_DIR": ca_dir,
            **(extra_env or {}),
        }
        ztunnels = {
            spec.name: ZtunnelProcess(
                pods[spec.name],
                {**common, "PROXY_WORKLOAD_INFO": spec.ztunnel, "NODE_NAME": spec.node},
                loop=loop,
            )
            for spec in specs
            if spec.ztunnel is not None
        }
        try:
            # Start-up is mostly interpreter start and imports: start them all at once.
            with ThreadPoolExecutor(len(ztunnels) or 1) as pool:
                for started in [pool.submit(zt.start) for zt in ztunnels.values()]:
                    started.result()
            yield Mesh(tb, Path(ca_dir), ca, cfg, pods, ztunnels, ext)
        except BaseException:
            for zt in ztunnels.values():
                zt.stop()
            raise
        failures = {
            name: (rc, zt.internal_errors())
            for name, zt in ztunnels.items()
            if (rc := zt.stop()) != 0
        }
        assert not failures, f"ztunnel exit codes / internal errors: {failures}"


# --------------------------------------------------------------------------------------------
# certificates on disk (for ssl contexts and for other implementations such as node)


@dataclass(frozen=True)
class CertFiles:
    cert: Path  # leaf + intermediates
    key: Path
    ca: Path  # the trust roots


def write_cert_files(
    cert: WorkloadCertificate, directory: Path, name: str, *, roots_pem: str | None = None
) -> CertFiles:
    """Write ``cert``'s chain, key (0600) and roots (or ``roots_pem``) as PEM files."""
    files = CertFiles(
        directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.ca"
    )
    files.cert.write_bytes(cert.chain_pem())
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(cert.private_key_pem())
    files.ca.write_text(roots_pem if roots_pem is not None else cert.roots_pem())
    return files


def client_ssl_context(cert: WorkloadCertificate | None, roots_pem: str | None) -> ssl.SSLContext:
    """TLS 1.3, ALPN h2, no hostname check; presents ``cert`` (if any) and verifies the server
    against ``roots_pem`` (``None``: no server verification)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])
    ctx.check_hostname = False
    if roots_pem is None:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=roots_pem)
    if cert is not None:
        with tempfile.TemporaryDirectory() as d:
            files = write_cert_files(cert, Path(d), "client")
            ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx


# --------------------------------------------------------------------------------------------
# a raw HBONE client


class HboneClosed(ConnectionError):
    """The server ended the connection (EOF, reset, TLS alert, GOAWAY); ``str()`` says how."""


@dataclass
class StreamState:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None


class HboneClient:
    """A blocking HTTP/2-over-TLS client (python-hyper ``h2``) for poking at an HBONE server."""

    def __init__(self, tls: ssl.SSLSocket, timeout: float) -> None:
        self.tls = tls
        self.timeout = timeout
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding="utf-8",
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.h2.initiate_connection()
        self.streams: dict[int, StreamState] = {}
        self.closed: str | None = None  # why the connection ended, once it has
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.settings_received = False
        self._flush()

    # --- connection ------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        where: Host,
        ip: str,
        port: int = HBONE_PORT,
        *,
        cert: WorkloadCertificate | None,
        roots_pem: str | None,
        timeout: float = 5.0,
    ) -> HboneClient:
        """TCP from ``where``'s netns to ``ip:port``, then the TLS handshake (no SNI).

        With TLS 1.3 a server's rejection of the client certificate only arrives after the
        client's side of the handshake is done: it surfaces as ``HboneClosed`` on first read."""
        sock = socket_in(where, socket.AF_INET6 if ":" in ip else socket.AF_INET)
        try:
            sock.settimeout(timeout)
            sock.connect((ip, port))
            tls = client_ssl_context(cert, roots_pem).wrap_socket(sock, server_hostname=None)
        except BaseException:
            sock.close()
            raise
        try:
            return cls(tls, timeout)
        except BaseException:
            tls.close()
            raise

    @property
    def peer_der(self) -> bytes:
        return self.tls.getpeercert(binary_form=True) or b""

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            try:
                self.tls.sendall(data)
            except (OSError, ssl.SSLError) as e:
                self._lost(f"send failed: {e!r}")

    def _lost(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
        raise HboneClosed(self.closed)

    def _pump(self, deadline: float) -> None:
        """Read once (until ``deadline``) and process the events."""
        if self.closed is not None:
            raise HboneClosed(self.closed)
        self.tls.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = self.tls.recv(65536)
        except TimeoutError:
            raise
        except (OSError, ssl.SSLError) as e:
            self._lost(f"{type(e).__name__}: {e}")
        if not data:
            self._lost("EOF")
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self._flush()
            self._lost(f"HTTP/2 protocol error: {e!r}")
        for ev in events:
            self._on_event(ev)
        self._flush()

    def _on_event(self, ev: object) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            st = self.streams[ev.stream_id]
            for k, v in ev.headers:
                st.headers[str(k)] = str(v)
            st.status = int(st.headers.get(":status", "0"))
        elif isinstance(ev, h2.events.DataReceived):
            self.streams[ev.stream_id].data += ev.data
            if ev.flow_controlled_length:
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded):
            self.streams[ev.stream_id].ended = True
        elif isinstance(ev, h2.events.StreamReset):
            if ev.stream_id in self.streams:
                self.streams[ev.stream_id].reset = int(ev.error_code)
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            self.settings_received = True
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway = ev

    def wait(self, cond: object, timeout: float | None = None) -> None:
        """Pump until ``cond()`` is true; TimeoutError otherwise."""
        assert callable(cond)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not cond():
            if time.monotonic() >= deadline:
                raise TimeoutError("HBONE client: condition not met in time")
            self._pump(deadline)

    def wait_settings(self, timeout: float | None = None) -> None:
        """Wait for the server's SETTINGS: the server accepted us and speaks HTTP/2."""
        self.wait(lambda: self.settings_received, timeout)

    def wait_closed(self, timeout: float | None = None) -> str:
        """Read until the server ends the connection; return how it ended."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with contextlib.suppress(HboneClosed):
            while True:
                if time.monotonic() >= deadline:
                    raise TimeoutError("HBONE client: the server kept the connection open")
                self._pump(deadline)
        assert self.closed is not None
        return self.closed

    # --- streams ---------------------------------------------------------------------------

    def request(
        self,
        authority: str | None,
        *,
        method: str = "CONNECT",
        path: str | None = None,
        scheme: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
        end_stream: bool = False,
    ) -> int:
        """Send a request header block exactly as given (no validation); return the stream id."""
        fields = [(":method", method)]
        if scheme is not None:
            fields.append((":scheme", scheme))
        if authority is not None:
            fields.append((":authority", authority))
        if path is not None:
            fields.append((":path", path))
        fields += headers
        sid: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, fields, end_stream=end_stream)
        self.streams[sid] = StreamState()
        self._flush()
        return sid

    def response(self, sid: int, timeout: float | None = None) -> int:
        """Wait for the response status of stream ``sid``."""
        st = self.streams[sid]
        self.wait(lambda: st.status is not None or st.reset is not None, timeout)
        if st.status is None:
            raise HboneClosed(f"stream {sid} reset with code {st.reset}")
        return st.status

    def connect_stream(self, authority: str, timeout: float | None = None) -> int:
        """CONNECT to ``authority`` and require 200; return the stream id."""
        sid = self.request(authority)
        status = self.response(sid, timeout)
        if status != 200:
            raise AssertionError(f"CONNECT {authority} answered {status}")
        return sid

    def send(self, sid: int, data: bytes, *, end_stream: bool = False) -> None:
        """Send ``data`` on ``sid`` within the flow-control windows (waiting for them)."""
        view = memoryview(data)
        while view:
            window = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if window <= 0:
                self._pump(time.monotonic() + self.timeout)
                continue
            chunk, view = view[:window], view[window:]
            self.h2.send_data(sid, bytes(chunk))
            self._flush()
        if end_stream:
            self.end(sid)

    def end(self, sid: int) -> None:
        """Half-close: END_STREAM on ``sid``."""
        self.h2.end_stream(sid)
        self._flush()

    def reset(self, sid: int, code: int = 0x8) -> None:
        self.h2.reset_stream(sid, code)
        self._flush()

    def read(self, sid: int, n: int, timeout: float | None = None) -> bytes:
        """Wait for ``n`` bytes on ``sid`` (fewer if the stream ends) and take them."""
        st = self.streams[sid]
        self.wait(lambda: len(st.data) >= n or st.ended or st.reset is not None, timeout)
        out = bytes(st.data[:n])
        del st.data[:n]
        return out

    def read_to_end(self, sid: int, timeout: float | None = None) -> bytes:
        """Wait for END_STREAM (or a reset) on ``sid``; return everything received."""
        st = self.streams[sid]
        self.wait(lambda: st.ended or st.reset is not None, timeout)
        out = bytes(st.data)
        st.data.clear()
        return out

    # --- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """GOAWAY (best effort), then close the socket."""
        if self.closed is None:
            with contextlib.suppress(Exception):
                self.h2.close_connection()
                self._flush()
            self.closed = "closed by client"
        self.tls.close()

    def abort(self) -> None:
        """Vanish: close the TCP socket with SO_LINGER 0, so the server gets a RST."""
        self.closed = "aborted by client"
        with contextlib.suppress(OSError):
            self.tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        self.tls.close()

    def __enter__(self) -> HboneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# leak checks


@dataclass(frozen=True)
class Baseline:
    fds: int  # /proc/PID/fd, idle splice pipes excluded
    tasks: int
    stats: Record
    targets: tuple[str, ...]  # (what the fds are, for the message when they differ)


def _adjusted_fds(zt: ZtunnelProcess, stats: Record) -> int:
    # (both summed over the supervisor and its workers, which hold the idle pipes)
    return int(stats.get("fds", zt.fd_count())) - 2 * int(stats.get("pipes_idle", 0))


def settled(zt: ZtunnelProcess, base: Baseline | None = None, timeout: float = 10.0) -> Baseline:
    """Wait until ``zt`` has no connection (and, with ``base``, its fds and tasks are back at
    the baseline); return the state then. Raises AssertionError if it does not settle."""
    deadline = time.monotonic() + timeout
    prev: Baseline | None = None
    while True:
        stats = zt.runtime_stats()
        now = Baseline(_adjusted_fds(zt, stats), int(stats["tasks"]), stats, _fd_targets(zt))
        idle = int(stats["connections"]) == 0
        if base is not None:
            ok = idle and now.fds == base.fds and now.tasks == base.tasks
        else:  # a baseline: the same in two samples in a row
            ok = idle and prev is not None and (prev.fds, prev.tasks) == (now.fds, now.tasks)
        if ok:
            return now
        prev = now if idle else None
        if time.monotonic() >= deadline:
            gone = sorted(set(base.targets) - set(now.targets)) if base else []
            new = sorted(set(now.targets) - set(base.targets)) if base else list(now.targets)
            raise AssertionError(
                f"ztunnel in {zt.host.name} did not return to its baseline: now "
                f"fds={now.fds} {stats}, baseline {base and (base.fds, base.tasks, base.stats)}; "
                f"fds opened since: {new}, closed since: {gone}"
            )
        time.sleep(0.05)


def _fd_targets(zt: ZtunnelProcess) -> tuple[str, ...]:
    """``pid:fd->target`` of every fd of ztunnel and its workers."""
    out = []
    for pid in sorted({zt.pid, *zt.data_plane_pids()}):
        with contextlib.suppress(OSError):
            for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
                with contextlib.suppress(OSError):
                    out.append(f"{pid}:{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
    return tuple(out)


@contextlib.contextmanager
def no_leaks(*zts: ZtunnelProcess) -> Iterator[None]:
    """Around a test step: each ztunnel starts with 0 connections, and afterwards gets back to
    0 connections and to the same number of fds and tasks. No new internal error is logged."""
    bases = [(zt, settled(zt)) for zt in zts]
    yield
    for zt, base in bases:
        settled(zt, base)
        assert not zt.internal_errors(), zt.internal_errors()
