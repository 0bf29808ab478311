"""Run a real ztunnel process inside a test-bed namespace and read its JSON log records."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ztunnel.testing.netns import Host, NsProcess

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Record = dict[str, Any]


class ZtunnelProcess:
    """``python -m ztunnel proxy ztunnel`` in ``host``'s netns with ``LOG_FORMAT=json``.

    Every output line is kept; JSON lines are parsed into ``records``. ztunnel logs to stdout
    (as Rust does); what it writes to stderr (an interpreter's last words, a stray warning) is
    kept too, each record marked ``"stream": "stderr"``. ``prefix`` runs the process under a
    wrapper (e.g. ``setpriv`` with capabilities dropped).

    istio-cni's in-pod rules let only packets marked 1337 through uncaptured. Rust marks nothing
    in dedicated mode unless ``PACKET_MARK`` is set (``src/config.rs``), so a dedicated ztunnel
    under those rules is deployed with ``PACKET_MARK=1337``: on a pod with the rules installed,
    the harness sets it unless the test's env does."""

    def __init__(
        self,
        host: Host,
        env: Mapping[str, str],
        *,
        loop: str = "uvloop",
        prefix: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.env = dict(env)
        self.loop = loop
        self.prefix = tuple(prefix)
        self.records: list[Record] = []
        self.expected_errors: list[str] = []
        self.proc: NsProcess | None = None
        self._cond = threading.Condition()
        self._eof = False
        self._reader: threading.Thread | None = None
        self._err_reader: threading.Thread | None = None

    #: Logging settings the harness passes unless the test's own env overrides them; subclasses
    #: that read another log format change this and :meth:`parse`.
    log_env: ClassVar[dict[str, str]] = {"LOG_FORMAT": "json", "RUST_LOG": "info,access=debug"}

    def parse(self, line: str) -> Record:
        """One output line as a record (JSON log lines; anything else is kept as ``raw``)."""
        try:
            rec = json.loads(line)
        except ValueError:
            return {"message": line, "level": "raw"}
        return rec if isinstance(rec, dict) else {"message": line}

    def start(self, timeout: float = 15.0) -> ZtunnelProcess:
        inherited = ("PROXY_", "LOCAL_XDS", "LOG_FORMAT", "RUST_LOG")
        env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
        env.update(self.log_env)
        env.update({"PYTHONPATH": _PROJECT_ROOT, "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        if env.get("PROXY_MODE") == "dedicated" and getattr(self.host, "inpod_rules", None):
            env.setdefault("PACKET_MARK", "1337")
        self.proc = self.host.popen(
            *self.prefix,
            sys.executable,
            "-m",
            "ztunnel",
            "proxy",
            "ztunnel",
            "--loop",
            self.loop,
            env=env,
            stderr=subprocess.PIPE,
        )
        self._reader = threading.Thread(target=self._pump, name="ztunnel-log", daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(
            target=self._pump_stderr, name="ztunnel-stderr", daemon=True
        )
        self._err_reader.start()
        self.wait_for(lambda r: r.get("message") == "ztunnel ready", timeout)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _pump(self) -> None:
        """Drain the log pipe continuously: a full pipe would block ztunnel's event loop."""
        assert self.proc is not None
        while True:
            try:
                line = self.proc.wait_for_line("", timeout=3600)
            except Exception:
                break
            rec = self.parse(line)
            with self._cond:
                self.records.append(rec)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _pump_stderr(self) -> None:
        assert self.proc is not None and self.proc.popen.stderr is not None
        for raw in self.proc.popen.stderr:
            rec = {**self.parse(raw.decode(errors="replace").rstrip("\r\n")), "stream": "stderr"}
            with self._cond:
                self.records.append(rec)
                self._cond.notify_all()

    def stderr_records(self) -> list[Record]:
        """What ztunnel wrote to stderr (its logs go to stdout)."""
        with self._cond:
            return [r for r in self.records if r.get("stream") == "stderr"]

    def wait_for(
        self, pred: Callable[[Record], bool], timeout: float = 10.0, start: int = 0
    ) -> Record:
        """Return the first record from index ``start`` on (already seen or new) matching ``pred``."""
        deadline = time.monotonic() + timeout
        i = max(0, start)
        with self._cond:
            while True:
                while i < len(self.records):
                    if pred(self.records[i]):
                        return self.records[i]
                    i += 1
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    tail = [r.get("message") for r in self.records[-8:]]
                    why = "ztunnel exited" if self._eof else f"not seen within {timeout}s"
                    raise TimeoutError(f"ztunnel log record {why}; last: {tail}")
                self._cond.wait(remaining)

    def access(self, message: str = "connection complete") -> list[Record]:
        with self._cond:
            return [
                r
                for r in self.records
                if r.get("scope") == "access" and r.get("message") == message
            ]

    def internal_errors(self) -> list[Record]:
        """Error records that are not access-log lines: unhandled exceptions, internal failures
        (but those a test caused on purpose: messages containing one of ``expected_errors``)."""
        with self._cond:
            return [
                r
                for r in self.records
                if (
                    (r.get("level") == "error" and r.get("scope") != "access")
                    or "exception" in r
                    or "Traceback" in str(r.get("message", ""))
                )
                and not any(e in str(r.get("message", "")) for e in self.expected_errors)
            ]

    def runtime_stats(self, timeout: float = 5.0) -> Record:
        """Ask the process (SIGUSR1) for its task and fd counts."""
        with self._cond:
            seen = len(self.records)
        os.kill(self.pid, signal.SIGUSR1)
        return self.wait_for(lambda r: r.get("message") == "runtime stats", timeout, start=seen)

    def fd_count(self, pid: int | None = None) -> int:
        return len(os.listdir(f"/proc/{pid or self.pid}/fd"))

    @property
    def workers(self) -> int:
        """The data-plane worker count this ztunnel runs with (Rust's rules, our env)."""
        from ztunnel.config import worker_threads

        return worker_threads({**os.environ, **self.env}, None)

    def data_plane_pids(self) -> list[int]:
        """The processes that serve connections: the workers (from their "ready" lines, the
        latest per index), or ztunnel itself when it runs one."""
        import re

        pids: dict[int, int] = {}
        with self._cond:
            for r in self.records:
                if m := re.fullmatch(r"worker (\d+) ready \(pid (\d+)\)", r.get("message", "")):
                    pids[int(m[1])] = int(m[2])
        return list(pids.values()) or [self.pid]

    def tree_rss_kib(self) -> int:
        """VmRSS summed over ztunnel and its workers (pages they share count once each)."""
        total = 0
        for pid in {self.pid, *self.data_plane_pids()}:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                total += next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
        return total

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait for a graceful exit; returns the exit code (-1 if ztunnel logged an
        internal error, so tests that assert a clean exit also catch those)."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            os.kill(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.popen.wait(timeout)
        rc = self.proc.stop()
        for reader in (self._reader, self._err_reader):
            if reader is not None:
                reader.join(5)
        if rc == 0 and self.internal_errors():
            return -1
        return rc
