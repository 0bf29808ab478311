"""Network-namespace test bed: nodes, pods and external hosts on a shared underlay, always torn down.

Topology (every address below exists only inside namespaces the bed creates; the host's own
network namespace is never touched)::

    fabric netns: bridge br0 (underlay 10.0.0.0/24, fd00::/64)
      +-- node N netns: eth0 10.0.0.N / fd00::N, ip_forward on, routes to the other nodes' pod CIDRs
      |     +-- pod netns: eth0 10.N.0.k/32 + fd00:N::k/128, default via the node (10.N.0.1 / fd00:N::1)
      +-- external netns: eth0 10.0.0.(200+i) / fd00::(200+i), routes to every pod CIDR

Namespace names are ``ztb<tag>-<kind>-<name>`` with a random per-bed tag, so beds can run back
to back and concurrently. Interface names are per-namespace (``eth0``, ``vethK``, ``nN``), so the
15-character limit never bites. Teardown kills every process the bed started (and anything else
still running inside its namespaces), then deletes the namespaces, which takes all veths and the
bridge with them. A bed whose process died without teardown is swept by the next bed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final

import ztunnel
from ztunnel.net.netns import enter_netns, netns_path, open_netns
from ztunnel.testing import iptables as ipt

NS_PREFIX: Final = "ztb"
STATE_DIR: Final = "/run/ztunnel-testbed"
# ``ip netns exec NS`` bind-mounts /etc/netns/NS/<file> over /etc/<file> in a private mount
# namespace for the command it runs: a per-namespace resolv.conf without touching the host's.
ETC_NETNS: Final = "/etc/netns"
UNDERLAY4: Final = "10.0.0.0/24"
UNDERLAY6: Final = "fd00::/64"
MAX_NODES: Final = 99
MAX_PODS_PER_NODE: Final = 250
MAX_EXTERNALS: Final = 50

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
_PROJECT_ROOT: Final = str(Path(ztunnel.__file__).resolve().parent.parent)


class TestbedError(RuntimeError):
    """A command that builds or changes the bed failed; the message carries its stderr."""

    __test__ = False  # not a pytest test class


# --------------------------------------------------------------------------------------------
# thread-level namespace switching and sysctls


@contextlib.contextmanager
def in_netns(ns_name: str) -> Iterator[None]:
    """Switch the current thread into netns ``ns_name`` (``ip netns`` name or path) and back.

    Make sockets inside the block and use them after it; never ``await`` inside it.
    """
    fd = open_netns(ns_name)
    try:
        with enter_netns(fd):
            yield
    finally:
        os.close(fd)


def _write_sysctls(ns_name: str, values: Mapping[str, str]) -> None:
    # /proc/sys/net resolves against the *thread's* netns, so this needs no subprocess.
    with in_netns(ns_name):
        for key, value in values.items():
            with open(f"/proc/sys/{key.replace('.', '/')}", "w") as f:
                f.write(value)


def _read_sysctl(ns_name: str, key: str) -> str:
    with in_netns(ns_name), open(f"/proc/sys/{key.replace('.', '/')}") as f:
        return f.read().strip()


# --------------------------------------------------------------------------------------------
# running commands


def _check(argv: Sequence[str], proc: subprocess.CompletedProcess[str]) -> None:
    if proc.returncode != 0:
        raise TestbedError(
            f"command failed (rc={proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}"
        )


def _run(argv: Sequence[str], stdin: str | None = None, timeout: float = 30.0) -> None:
    proc = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        detail = f"\n--- input ---\n{stdin}" if stdin else ""
        raise TestbedError(
            f"command failed (rc={proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}"
            + detail
        )


def _run_parallel(jobs: Sequence[tuple[Sequence[str], str | None]], timeout: float = 30.0) -> None:
    """Run independent commands at once; after all have finished, raise one error naming every
    failure. Commands still running at ``timeout`` are killed."""
    procs = [
        (
            argv,
            stdin,
            subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for argv, stdin in jobs
    ]
    failures: list[str] = []
    try:
        results = [
            (argv, stdin, p, p.communicate(stdin, timeout=timeout)[1]) for argv, stdin, p in procs
        ]
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for argv, stdin, p, err in results:
        if p.returncode != 0:
            detail = f"\n--- input ---\n{stdin}" if stdin else ""
            failures.append(
                f"command failed (rc={p.returncode}): {' '.join(argv)}\n{err.strip()}{detail}"
            )
    if failures:
        raise TestbedError("\n".join(failures))


def _ip_batch(ns: str | None, *, family: str | None = None) -> list[str]:
    """``ip [-6] [-n NS] -batch -``: many ip commands in one process (stdin holds them)."""
    argv = ["ip"]
    if family:
        argv.append(family)
    if ns:
        argv += ["-n", ns]
    return [*argv, "-batch", "-"]


class NsProcess:
    """A process started inside a namespace: line-oriented stdout reading, and a forceful stop.

    It leads its own session (process group), so ``stop`` also ends anything it spawned.
    """

    def __init__(self, argv: Sequence[str], popen: subprocess.Popen[bytes]) -> None:
        self.argv = list(argv)
        self.popen = popen
        self.lines: list[str] = []  # every stdout line consumed so far
        self.ready_line: str | None = None
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait_for_line(self, prefix: str = "", timeout: float = 10.0) -> str:
        """Read stdout until a line starting with ``prefix`` arrives; return it (without newline)."""
        out = self.popen.stdout
        if out is None:
            raise TestbedError(f"{self.argv[0]}: stdout is not a pipe")
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                line = raw.decode(errors="replace").rstrip("\r")
                self.lines.append(line)
                if line.startswith(prefix):
                    return line
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no stdout line starting with {prefix!r} within {timeout}s from "
                    f"{' '.join(self.argv)}; got {self.lines[-5:]!r}"
                )
            ready, _, _ = select.select([out], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                rc = self.popen.wait(timeout=max(remaining, 0.1))
                raise TestbedError(
                    f"process exited (rc={rc}) before printing {prefix!r}: {' '.join(self.argv)}; "
                    f"stdout tail {self.lines[-5:]!r}"
                )
            self._buf += chunk

    def stop(self, timeout: float = 2.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; return the exit code."""
        if self.popen.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, sig)
                try:
                    self.popen.wait(timeout=timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            # the leader is gone; children it left in its group still get killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return self.popen.returncode


# --------------------------------------------------------------------------------------------
# resources and teardown


def _ns_identity(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(netns_path(name))
    except OSError:
        return None
    return st.st_ino, st.st_dev


def _kill_processes_in(ns_names: Iterable[str]) -> None:
    """SIGKILL every process whose netns is one of ``ns_names`` (all were started by a bed)."""
    ids = {i for i in (_ns_identity(n) for n in ns_names) if i is not None}
    if not ids:
        return
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) in ids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)


def _delete_namespaces(names: Sequence[str]) -> None:
    if not names:
        return
    for n in names:
        if n.startswith(NS_PREFIX):  # only ever our own per-namespace /etc files
            shutil.rmtree(os.path.join(ETC_NETNS, n), ignore_errors=True)
    subprocess.run(
        ["ip", "-force", "-batch", "-"],
        input="".join(f"netns del {n}\n" for n in names),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


class _Resources:
    """What one bed created; closed in order: processes, stray pids, namespaces, state file."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.namespaces: list[str] = []
        self.processes: list[NsProcess] = []
        self.state_file: str | None = None
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in reversed(self.processes):
            with contextlib.suppress(Exception):
                p.stop(timeout=1.0)
        _kill_processes_in(self.namespaces)
        _delete_namespaces(self.namespaces)
        if self.state_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.state_file)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_testbeds() -> list[str]:
    """Delete namespaces of beds whose creating process is gone; return the names deleted."""
    try:
        entries = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return []
    try:
        existing = os.listdir("/run/netns")
    except FileNotFoundError:
        existing = []
    removed: list[str] = []
    for tag in entries:
        path = os.path.join(STATE_DIR, tag)
        try:
            pid = int(Path(path).read_text().strip() or "0")
        except (OSError, ValueError):
            continue
        if pid and _pid_alive(pid):
            continue
        names = [n for n in existing if n.startswith(f"{NS_PREFIX}{tag}-")]
        _kill_processes_in(names)
        _delete_namespaces(names)
        removed += names
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return removed


# --------------------------------------------------------------------------------------------
# hosts


class Host:
    """A network namespace of the bed: run processes in it, switch threads into it."""

    kind: str = "host"

    def __init__(self, bed: Testbed, name: str, ns: str, ip4: str, ip6: str) -> None:
        self.bed = bed
        self.name = name
        self.ns = ns
        self.ip4 = ip4
        self.ip6 = ip6

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ns={self.ns} {self.ip4} {self.ip6}>"

    @property
    def ips(self) -> tuple[str, str]:
        return self.ip4, self.ip6

    @property
    def netns_path(self) -> str:
        return netns_path(self.ns)

    def open_netns(self) -> int:
        """A new fd for this namespace (e.g. to pass over ZDS); the caller closes it."""
        return open_netns(self.ns)

    def enter(self) -> contextlib.AbstractContextManager[None]:
        """``in_netns(self.ns)``: switch the current thread in and back; never await inside."""
        return in_netns(self.ns)

    def run(
        self,
        *cmd: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the namespace to completion; output captured as text."""
        argv = ["ip", "netns", "exec", self.ns, *cmd]
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        if check:
            _check(argv, proc)
        return proc

    def popen(
        self,
        *cmd: str,
        stdin: int | IO[bytes] | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = subprocess.PIPE,
        stderr: int | IO[bytes] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> NsProcess:
        """Start ``cmd`` inside the namespace; the bed stops it at teardown at the latest."""
        self.bed._check_open()
        argv = ["ip", "netns", "exec", self.ns, *cmd]
        popen = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        proc = NsProcess(argv, popen)
        self.bed._resources.processes.append(proc)
        return proc

    def exec_python_module(
        self,
        module: str,
        *args: str,
        ready: str | None = "READY",
        timeout: float = 15.0,
        env: Mapping[str, str] | None = None,
    ) -> NsProcess:
        """Run ``python -m module args`` (this interpreter, this source tree) in the namespace.

        With ``ready`` set, wait for a stdout line starting with it (kept as ``ready_line``).
        """
        full_env = dict(os.environ if env is None else env)
        path = full_env.get("PYTHONPATH")
        full_env["PYTHONPATH"] = _PROJECT_ROOT + (os.pathsep + path if path else "")
        full_env["PYTHONUNBUFFERED"] = "1"
        proc = self.popen(sys.executable, "-m", module, *args, env=full_env)
        if ready is not None:
            try:
                proc.ready_line = proc.wait_for_line(ready, timeout=timeout)
            except BaseException:
                proc.stop(timeout=1.0)
                raise
        return proc

    def set_resolv_conf(self, text: str) -> str:
        """Give processes started in this namespace (``run``, ``popen``: ``ip netns exec``) their
        own /etc/resolv.conf; returns its path. Rewritten in place on later calls, so a process
        that already has it bind-mounted sees the change. Removed at teardown."""
        d = os.path.join(ETC_NETNS, self.ns)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "resolv.conf")
        with open(path, "a+") as f:
            f.seek(0)
            f.truncate()
            f.write(text)
        return path

    def sysctl(self, key: str, value: str | int | None = None) -> str:
        """Read (or with ``value``, write then read) a ``net.*`` sysctl of this namespace."""
        if value is not None:
            _write_sysctls(self.ns, {key: str(value)})
        return _read_sysctl(self.ns, key)

    def iptables_save(self, *, ipv6: bool = False) -> str:
        return self.run("ip6tables-save" if ipv6 else "iptables-save").stdout


class Node(Host):
    """A node: routes for its pods, underlay address on eth0, ip_forward on (v4 and v6)."""

    kind = "node"

    def __init__(self, bed: Testbed, name: str, ns: str, index: int) -> None:
        super().__init__(bed, name, ns, f"10.0.0.{index}", f"fd00::{index:x}")
        self.index = index
        self.pod_cidr4 = f"10.{index}.0.0/24"
        self.pod_cidr6 = f"fd00:{index:x}::/64"
        self.gateway4 = f"10.{index}.0.1"
        self.gateway6 = f"fd00:{index:x}::1"
        self.pods: list[Pod] = []
        self._probe_chain = {4: False, 6: False}
        self._next_pod = 2

    def add_pod(self, name: str, ambient: bool = True) -> Pod:
        """Create a pod netns with eth0 (one v4 + one v6 address) routed via this node.

        ``ambient`` is a label for harnesses (e.g. a fake CNI enrolling pods); it installs
        nothing: call ``install_inpod_rules`` for that.
        """
        bed = self.bed
        bed._check_open()
        bed._claim_name(name)
        if self._next_pod > MAX_PODS_PER_NODE + 1:
            raise TestbedError(f"node {self.name}: too many pods")
        k = self._next_pod
        self._next_pod += 1
        ns = bed._create_ns("p", name, _POD_SYSCTLS)
        pod = Pod(
            bed, name, ns, f"10.{self.index}.0.{k}", f"fd00:{self.index:x}::{k:x}", self, ambient
        )
        veth = f"veth{k}"
        _run(
            _ip_batch(self.ns),
            (
                f"link add {veth} type veth peer name eth0 netns {ns}\n"
                f"link set {veth} up\n"
                f"addr add {self.gateway4}/32 dev {veth}\n"
                f"addr add {self.gateway6}/128 dev {veth} nodad\n"
                f"route add {pod.ip4}/32 dev {veth}\n"
                f"route add {pod.ip6}/128 dev {veth}\n"
            ),
        )
        _run(
            _ip_batch(ns),
            (
                "link set lo up\n"
                "link set eth0 up\n"
                f"addr add {pod.ip4}/32 dev eth0\n"
                f"addr add {pod.ip6}/128 dev eth0 nodad\n"
                f"route add {self.gateway4}/32 dev eth0\n"
                f"route add 0.0.0.0/0 via {self.gateway4} dev eth0\n"
                f"route add {self.gateway6}/128 dev eth0\n"
                f"route add ::/0 via {self.gateway6} dev eth0\n"
            ),
        )
        self.pods.append(pod)
        return pod

    def install_probe_snat(self, pod_ips: Iterable[str] | None = None) -> None:
        """Host-side probe SNAT (istio-cni ``hostprobe*.golden``): nat POSTROUTING -> ISTIO_POSTRT,
        TCP from a local socket to one of ``pod_ips`` (default: all pods of this node) is SNATed
        to 169.254.7.127 / fd16:9254:7127:1337:ffff:ffff:ffff:ffff.

        istio-cni matches the ipset ``istio-inpod-probes-v4/v6``; the ``ipset`` tool is not
        assumed here, so each IP gets its own ``-d IP`` rule. Callable again to add IPs.
        """
        self.bed._check_open()
        ips = list(pod_ips) if pod_ips is not None else [ip for p in self.pods for ip in p.ips]
        jobs: list[tuple[Sequence[str], str | None]] = []
        for fam in (4, 6):
            fam_ips = [ip for ip in ips if (":" in ip) == (fam == 6)]
            if not fam_ips and self._probe_chain[fam]:
                continue
            text = ipt.host_probe_restore(
                ipv6=fam == 6, dst_ips=fam_ips, create_chain=not self._probe_chain[fam]
            )
            tool = "ip6tables-restore" if fam == 6 else "iptables-restore"
            jobs.append((["ip", "netns", "exec", self.ns, tool, "--noflush"], text))
        _run_parallel(jobs)
        self._probe_chain = {4: True, 6: True}


class Pod(Host):
    """A pod: eth0 to its node, v4 + v6 address, ``lo`` up with 127.0.0.1 and ::1."""

    kind = "pod"

    def __init__(
        self, bed: Testbed, name: str, ns: str, ip4: str, ip6: str, node: Node, ambient: bool
    ) -> None:
        super().__init__(bed, name, ns, ip4, ip6)
        self.node = node
        self.ambient = ambient
        self.inpod_rules: tuple[bool, bool] | None = None  # (dns_capture, ipv6) once installed

    def install_inpod_rules(self, dns_capture: bool = False, ipv6: bool = True) -> None:
        """Install istio-cni's in-pod redirection (reference 1.3): mangle/nat (and, with DNS
        capture, raw) ISTIO_PRERT/ISTIO_OUTPUT chains, plus ``ip rule fwmark 0x111/0xfff
        pref 32764 lookup 100`` and ``local 0.0.0.0/0 dev lo table 100`` (v6 too when ``ipv6``)."""
        self.bed._check_open()
        if self.inpod_rules is not None:
            raise TestbedError(f"pod {self.name}: in-pod rules already installed")
        exec_ns = ["ip", "netns", "exec", self.ns]
        jobs: list[tuple[Sequence[str], str | None]] = [
            (
                [*exec_ns, "iptables-restore", "--noflush"],
                ipt.inpod_restore(ipv6=False, dns_capture=dns_capture),
            ),
            (_ip_batch(self.ns), ipt.inpod_ip_batch(ipv6=False)),
        ]
        if ipv6:
            jobs += [
                (
                    [*exec_ns, "ip6tables-restore", "--noflush"],
                    ipt.inpod_restore(ipv6=True, dns_capture=dns_capture),
                ),
                (_ip_batch(self.ns, family="-6"), ipt.inpod_ip_batch(ipv6=True)),
            ]
        self.inpod_rules = (dns_capture, ipv6)
        _run_parallel(jobs)

    def remove_inpod_rules(self) -> None:
        """Undo ``install_inpod_rules`` (what istio-cni does when a pod leaves the mesh)."""
        self.bed._check_open()
        if self.inpod_rules is None:
            return
        dns_capture, ipv6 = self.inpod_rules
        exec_ns = ["ip", "netns", "exec", self.ns]
        jobs: list[tuple[Sequence[str], str | None]] = [
            (
                [*exec_ns, "iptables-restore", "--noflush"],
                ipt.inpod_delete_restore(dns_capture=dns_capture),
            ),
            (_ip_batch(self.ns), ipt.inpod_ip_batch(ipv6=False, add=False)),
        ]
        if ipv6:
            jobs += [
                (
                    [*exec_ns, "ip6tables-restore", "--noflush"],
                    ipt.inpod_delete_restore(dns_capture=dns_capture),
                ),
                (_ip_batch(self.ns, family="-6"), ipt.inpod_ip_batch(ipv6=True, add=False)),
            ]
        self.inpod_rules = None
        _run_parallel(jobs)


class External(Host):
    """A host outside the mesh, on the underlay bridge, with routes to every pod CIDR."""

    kind = "external"
    node: None = None


# --------------------------------------------------------------------------------------------
# the bed

_COMMON_SYSCTLS: Final = {
    "net.ipv6.conf.all.accept_dad": "0",
    "net.ipv6.conf.default.accept_dad": "0",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
}
_POD_SYSCTLS: Final = _COMMON_SYSCTLS
_NODE_SYSCTLS: Final = {
    **_COMMON_SYSCTLS,
    "net.ipv4.ip_forward": "1",
    "net.ipv6.conf.all.forwarding": "1",
    "net.ipv6.conf.default.forwarding": "1",
}


class Testbed:
    """A small cluster of network namespaces; a context manager that always tears down.

    Use ``with Testbed() as tb:`` (from sync or async tests alike: building is quick and
    blocking). Anything created before an exception — even one raised half-way through a
    build step — is removed by ``close()``, which ``__exit__`` and a finalizer both call.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, *, sweep_stale: bool = True) -> None:
        if sweep_stale:
            sweep_stale_testbeds()
        os.makedirs(STATE_DIR, exist_ok=True)
        while True:
            tag = secrets.token_hex(3)
            path = os.path.join(STATE_DIR, tag)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            break
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        self.tag = tag
        self._resources = _Resources(tag)
        self._resources.state_file = path
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._names: set[str] = set()
        self.nodes: list[Node] = []
        self.externals: list[External] = []
        self.fabric_ns = ""
        try:
            self.fabric_ns = self._create_ns("fabric", None, _COMMON_SYSCTLS)
            _run(
                _ip_batch(self.fabric_ns),
                ("link set lo up\nlink add br0 type bridge mcast_snooping 0\nlink set br0 up\n"),
            )
        except BaseException:
            self.close()
            raise

    # --- lifecycle

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop all processes and delete every namespace of the bed (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._resources.closed

    @property
    def namespaces(self) -> list[str]:
        """Every namespace name this bed created (the fabric first)."""
        return list(self._resources.namespaces)

    @property
    def pods(self) -> list[Pod]:
        return [p for n in self.nodes for p in n.pods]

    def host(self, name: str) -> Host:
        """Find a node, pod or external host by its name."""
        for h in (*self.nodes, *self.pods, *self.externals):
            if h.name == name:
                return h
        raise KeyError(name)

    # --- building

    def add_node(self, name: str) -> Node:
        """Create a node netns on the underlay with its own pod CIDRs; routes to and from the
        other nodes (and externals) are added so pods on different nodes reach each other."""
        self._check_open()
        self._claim_name(name)
        index = len(self.nodes) + 1
        if index > MAX_NODES:
            raise TestbedError("too many nodes")
        ns = self._create_ns("n", name, _NODE_SYSCTLS)
        node = Node(self, name, ns, index)
        lines = self._plug_into_fabric(node, f"n{index}")
        jobs: list[tuple[Sequence[str], str | None]] = [(_ip_batch(ns), "\n".join(lines) + "\n")]
        jobs += [
            (_ip_batch(h.ns), "\n".join(_routes_to(node)) + "\n")
            for h in (*self.nodes, *self.externals)
        ]
        _run_parallel(jobs)
        self.nodes.append(node)
        return node

    def add_external(self, name: str) -> External:
        """Create a non-mesh host on the underlay (10.0.0.(200+i), fd00::(200+i)) that pods can
        reach through their nodes."""
        self._check_open()
        self._claim_name(name)
        i = len(self.externals) + 1
        if i > MAX_EXTERNALS:
            raise TestbedError("too many external hosts")
        ns = self._create_ns("x", name, _COMMON_SYSCTLS)
        ext = External(self, name, ns, f"10.0.0.{200 + i}", f"fd00::{200 + i:x}")
        _run(_ip_batch(ns), "\n".join(self._plug_into_fabric(ext, f"x{i}")) + "\n")
        self.externals.append(ext)
        return ext

    # --- internals

    def _plug_into_fabric(self, host: Host, port: str) -> list[str]:
        """Join ``host`` to the underlay bridge through veth ``port``; returns the ``ip -batch``
        lines that configure its eth0 and route to the pods of every node added so far."""
        _run(
            _ip_batch(self.fabric_ns),
            (
                f"link add {port} type veth peer name eth0 netns {host.ns}\n"
                f"link set {port} master br0\n"
                f"link set {port} up\n"
            ),
        )
        lines = [
            "link set lo up",
            "link set eth0 up",
            f"addr add {host.ip4}/24 dev eth0",
            f"addr add {host.ip6}/64 dev eth0 nodad",
        ]
        for node in self.nodes:
            lines += _routes_to(node)
        return lines

    def _check_open(self) -> None:
        if self._resources.closed:
            raise TestbedError(f"testbed {self.tag} is closed")

    def _claim_name(self, name: str) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"bad host name {name!r}: want [A-Za-z0-9][A-Za-z0-9_.-]{{0,39}}")
        if name in self._names:
            raise ValueError(f"host name {name!r} already used in this testbed")
        self._names.add(name)

    def _create_ns(self, kind: str, name: str | None, sysctls: Mapping[str, str]) -> str:
        ns = f"{NS_PREFIX}{self.tag}-{kind}" + (f"-{name}" if name else "")
        # recorded first, so a failure anywhere below still gets it deleted
        self._resources.namespaces.append(ns)
        _run(["ip", "netns", "add", ns])
        _write_sysctls(ns, sysctls)
        return ns


def _routes_to(node: Node) -> list[str]:
    return [
        f"route add {node.pod_cidr4} via {node.ip4}",
        f"route add {node.pod_cidr6} via {node.ip6}",
    ]


def list_netns() -> list[str]:
    """Names in ``ip netns list`` (``/run/netns``), sorted."""
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []
