"""Admin (15000, both loopbacks by default): index, ``/config_dump``, ``/quitquitquit``,
``/logging``, ``/debug/pprof/*`` (istio/ztunnel ``src/admin.rs``; profiles from
:mod:`ztunnel.admin.profiling`), and ours: ``/debug/authz`` (explain the authorization decision
for a connection, see :mod:`ztunnel.admin.explain`) and ``/debug/connections`` (every live
connection with identities, age and bytes, what ``ztunnel top`` shows).

Everything it shows or triggers comes in as a callable, so the composition root wires it:
``state`` and ``config`` for the dump, ``certificates`` (``SecretManager.statuses``), ``static``
(the local config file, if one was used), ``extra`` sections (in-pod: ``workloadState``),
``explain`` (the query of ``/debug/authz`` to an explanation), ``live`` (each proxy's name and
live connection records, for ``/debug/connections``) and ``on_quit`` (the graceful drain).
``on_quit`` must not close this admin server itself: the ``/quitquitquit`` request is still in
flight while it runs.
"""

from __future__ import annotations

import asyncio
import errno
import html
import json
import logging
import os
import platform
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from ztunnel import __version__
from ztunnel.admin import config_dump as dump
from ztunnel.admin import live as live_view
from ztunnel.admin import profiling
from ztunnel.admin.http import HttpServer, Request, Response
from ztunnel.admin.logctl import LogControl
from ztunnel.config import ADMIN_PORT
from ztunnel.identity.manager import CertificateStatus
from ztunnel.net.sockopt import bind_listener

log = logging.getLogger("ztunnel.admin")

ADMIN_DEFAULT_HOST = "127.0.0.1"
ADMIN_IPV6_HOST = "::1"
IPV6_DISABLED_LO = "/proc/sys/net/ipv6/conf/lo/disable_ipv6"

# Rust's HELP_STRING (src/admin.rs), shown after "Invalid HTTP method" and a bad level.
LOGGING_HELP = """
usage: POST /logging\t\t\t\t\t\t(To list current level)
usage: POST /logging?level=<level>\t\t\t\t(To change global levels)
usage: POST /logging?level={mod1}:{level1},{mod2}:{level2}\t(To change specific mods' logging level)

hint: loglevel:\terror|warn|info|debug|trace|off
hint: mod_name:\tthe module name, i.e. ztunnel::proxy
"""

ENDPOINTS: tuple[tuple[str, str], ...] = (
    (
        "debug/pprof/profile",
        "capture a CPU profile (pprof protobuf; format=collapsed for folded stacks); "
        "params: seconds (1-300, default 10), frequency in Hz (1-1000, default 100)",
    ),
    (
        "debug/pprof/heap",
        "tracemalloc top allocations (traces for ?seconds=, default 10, unless tracing is on)",
    ),
    ("debug/pprof/heap/profiling", "query or toggle heap tracing with ?activate=true|false"),
    ("quitquitquit", "shut down the server (POST)"),
    ("config_dump", "dump the current Ztunnel configuration"),
    ("logging", "query/changing logging levels (POST)"),
    ("debug/authz", "explain the authorization decision: ?src=&dst=&port="),
    ("debug/connections", "every live connection: identities, age, bytes (JSON)"),
)


class Explained(Protocol):
    """What ``/debug/authz`` renders (``ztunnel.state.authz.Explanation``)."""

    def to_dict(self) -> dict[str, Any]: ...


# The query parameters (last value of each) -> the explanation. Raises ValueError for bad
# input (400) and LookupError for an unknown workload (404).
ExplainFn = Callable[[Mapping[str, str]], Explained]


def ipv6_localhost_enabled(path: str = IPV6_DISABLED_LO) -> bool:
    """Rust ``proxy::ipv6_enabled_on_localhost``: IPv6 on ``lo`` unless its sysctl says
    disabled; when the sysctl cannot be read, assume enabled (Rust warns and continues)."""
    try:
        with open(path) as f:
            return f.read().strip() != "1"
    except OSError:
        return True


def admin_addresses(port: int, *, ipv6: bool = True) -> list[tuple[str, int]]:
    """Rust's ``Address::Localhost(ipv6_localhost_enabled, port)``: 127.0.0.1, and ::1 when
    IPv6 is enabled and works on ``lo``."""
    out = [(ADMIN_DEFAULT_HOST, port)]
    if ipv6 and socket.has_ipv6 and ipv6_localhost_enabled():
        out.append((ADMIN_IPV6_HOST, port))
    return out


def bind_admin(
    handler: AdminHandler,
    *,
    port: int = ADMIN_PORT,
    host: str | None = None,
    ipv6: bool = True,
) -> HttpServer:
    """The admin server, bound now: both loopbacks (as Rust), or ``host`` alone if given. With
    ``port=0`` both get the port the first was given. A ``::1`` the kernel refuses (no IPv6 on
    this host) is skipped with a warning, not fatal."""
    if host is not None:
        return HttpServer.bind("admin", [(host, port)], handler)
    addrs = admin_addresses(port, ipv6=ipv6)
    server = HttpServer.bind("admin", addrs[:1], handler)
    if len(addrs) > 1:
        try:
            server.socks.append(bind_listener((ADMIN_IPV6_HOST, server.port)))
        except OSError as e:
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                for sock in server.socks:
                    sock.close()
                raise
            log.warning("admin: cannot bind [::1]:%d (%s); IPv4 loopback only", port, e.strerror)
    return server


def istio_version_from_env(env: Mapping[str, str] = os.environ) -> str:
    """``ISTIO_META_ISTIO_VERSION`` (set by Istio's ztunnel image), else ``unknown``: the
    ``istioVersion`` of the dump and the ``tag`` of ``istio_build`` (Rust ``BuildInfo``)."""
    return env.get("ISTIO_META_ISTIO_VERSION", "unknown")


def build_info(istio_version: str | None = None) -> dict[str, str]:
    """The ``version`` section (Rust ``BuildInfo``, with Python in place of rustc)."""
    if istio_version is None:
        istio_version = istio_version_from_env()
    return {
        "version": __version__,
        "gitRevision": "unknown",
        "pythonVersion": platform.python_version(),
        "buildProfile": "release",
        "buildStatus": "unknown",
        "gitTag": __version__,
        "istioVersion": istio_version,
    }


def index_page(endpoints: Iterable[tuple[str, str]] = ENDPOINTS) -> str:
    rows = "\n".join(
        f'<tr class="{"gray" if i % 2 else "vert-space"}"><td class="home-data">'
        f'<a href="{html.escape(path)}">{html.escape(path)}</a></td>'
        f'<td class="home-data">{html.escape(desc)}</td></tr>'
        for i, (path, desc) in enumerate(endpoints)
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>ztunnel admin</title>'
        "<style>body{font-family:sans-serif}td{padding:4px 12px}.gray{background:#eee}</style>"
        "</head><body>\n<h1>ztunnel admin</h1>\n<table>\n<thead><tr><th>Command</th>"
        f"<th>Description</th></tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>\n"
        "</body></html>\n"
    )


class AdminHandler:
    """The 15000 routes. ``quit_deadline``: how long ``/quitquitquit`` waits for ``on_quit``."""

    def __init__(
        self,
        *,
        state: Callable[[], dump.StateView],
        config: Callable[[], Mapping[str, Any]],
        certificates: Callable[[], Iterable[CertificateStatus]] = lambda: (),
        static: Callable[[], dump.LocalConfigView | None] = lambda: None,
        version: Callable[[], Mapping[str, Any]] = build_info,
        extra: Mapping[str, Callable[[], Any]] | None = None,
        on_quit: Callable[[], Awaitable[None]] | None = None,
        quit_deadline: float = 5.0,
        log_control: LogControl | None = None,
        explain: ExplainFn | None = None,
        live: Callable[[], Iterable[tuple[str, Iterable[live_view.LiveConnection]]]] = lambda: (),
        refresh: Callable[[], Awaitable[None]] | None = None,
        profiler: profiling.Profiler | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self.certificates = certificates
        self.static = static
        self.version = version
        self.extra = dict(extra or {})
        self.on_quit = on_quit
        self.quit_deadline = quit_deadline
        self.log_control = log_control
        self.explain = explain
        self.live = live
        # Awaited before the views of live connections are read (data-plane workers report
        # theirs on request).
        self.refresh = refresh
        self.profiler = profiler or profiling.Profiler()
        self._quitting: asyncio.Task[None] | None = None

    async def __call__(self, req: Request) -> Response:
        # Rust's admin server (``Service::spawn``): /, /config_dump and the pprof endpoints
        # answer any method; /quitquitquit and /logging take POST; our two extras, GET/HEAD.
        path = req.path
        if path == "/":
            return Response(200, index_page().encode(), "text/html; charset=utf-8")
        if path in ("/config_dump", "/debug/connections") and self.refresh is not None:
            await self.refresh()
        if path == "/config_dump":
            return self.config_dump()
        if path == "/quitquitquit":
            if req.method != "POST":
                return Response.empty(405)
            return await self.quit()
        if path == "/logging":
            return self.logging(req)
        if path == "/debug/authz":
            return self._get_only(req) or self.debug_authz(req)
        if path == "/debug/connections":
            return self._get_only(req) or self.debug_connections()
        if path == "/debug/pprof/profile":
            return await self.cpu_profile(req)
        if path == "/debug/pprof/heap":
            return await self.heap_profile(req)
        if path == "/debug/pprof/heap/profiling":
            return self.heap_toggle(req)
        return Response.empty(404)

    @staticmethod
    def _get_only(req: Request) -> Response | None:
        return None if req.method in ("GET", "HEAD") else Response.empty(405)

    def config_dump(self) -> Response:
        body = dump.config_dump(
            state=self.state(),
            config=self.config(),
            certificates_=self.certificates(),
            static=self.static(),
            version=self.version(),
            extra=self.extra,
        )
        return Response(200, json.dumps(body, indent=2).encode(), "application/json")

    async def quit(self) -> Response:
        """Start the drain (once, even if asked twice) and wait for it up to the deadline."""
        if self.on_quit is None:
            return Response.text(503, "shutdown is not wired\n")
        if self._quitting is None:
            log.info("shutdown requested via /quitquitquit")
            self._quitting = asyncio.ensure_future(self.on_quit())
            self._quitting.add_done_callback(_log_quit_result)
        try:
            await asyncio.wait_for(asyncio.shield(self._quitting), self.quit_deadline)
            log.info("shutdown completed gracefully")
        except TimeoutError:
            log.warning(
                "graceful shutdown did not complete in %.1fs, terminating now", self.quit_deadline
            )
        except Exception:
            pass  # logged by _log_quit_result
        return Response.text(200, "shutdown now\n")

    def logging(self, req: Request) -> Response:
        """POST only, as Rust's ``handle_logging`` (any other method: 405 and the help)."""
        ctl = self.log_control
        if req.method != "POST":
            return Response.text(405, f"Invalid HTTP method\n {LOGGING_HELP}")
        if ctl is None:
            return Response.text(503, "log control is not wired\n")
        params = req.query_params()
        if "level" not in params and "reset" not in params:
            return Response.text(200, f"current log level is {ctl.current()}\n")
        level = params.get("level", [""])[-1]
        try:
            current = ctl.change(level, reset="reset" in params)
        except ValueError:
            return Response.text(400, f"Invalid level provided: {level}\n{LOGGING_HELP}")
        log.info("log level changed to %s", current)
        return Response.text(200, f"current log level is {current}\n")

    def debug_authz(self, req: Request) -> Response:
        """``GET /debug/authz?src=&dst=&port=``: JSON, or text with ``Accept: text/plain``."""
        if self.explain is None:
            return Response.text(503, "authorization explain is not wired\n")
        params = {k: v[-1] for k, v in req.query_params().items()}
        try:
            explanation = self.explain(params)
        except LookupError as e:
            return Response.text(404, f"{e}\n")
        except ValueError as e:
            return Response.text(400, f"{e}\n")
        if "text/plain" in (req.header("accept") or ""):
            return Response.text(200, f"{explanation}\n")
        body = json.dumps(explanation.to_dict(), indent=2)
        return Response(200, body.encode(), "application/json")

    def debug_connections(self) -> Response:
        body = json.dumps(live_view.connections(self.live()), indent=1)
        return Response(200, body.encode(), "application/json")

    async def cpu_profile(self, req: Request) -> Response:
        """``?seconds=1-300`` (10) ``&frequency=1-1000`` (100) ``&format=pprof|collapsed``."""
        params = req.query_params()
        try:
            seconds = profiling.parse_int(
                params, "seconds", profiling.DEFAULT_SECONDS, 1, profiling.MAX_SECONDS
            )
            frequency = profiling.parse_int(
                params, "frequency", profiling.DEFAULT_FREQUENCY, 1, profiling.MAX_FREQUENCY
            )
        except ValueError as e:
            return Response.text(400, str(e))
        fmt = params.get("format", ["pprof"])[-1]
        if fmt not in ("pprof", "collapsed"):
            return Response.text(400, "invalid format; expected pprof or collapsed\n")
        try:
            prof = await self.profiler.cpu(seconds, frequency)
        except profiling.ProfileBusy as e:
            return Response.text(409, f"{e}\n")
        log.info("CPU profile taken: %ds at %d Hz, %d stacks", seconds, frequency, len(prof.cpu_ns))
        if fmt == "collapsed":
            return Response.text(200, profiling.collapsed(prof))
        return Response(200, profiling.pprof(prof), "application/octet-stream")

    async def heap_profile(self, req: Request) -> Response:
        params = req.query_params()
        try:
            seconds = profiling.parse_int(
                params, "seconds", profiling.DEFAULT_SECONDS, 1, profiling.MAX_SECONDS
            )
            top = profiling.parse_int(params, "top", profiling.HEAP_TOP, 1, 10_000)
        except ValueError as e:
            return Response.text(400, str(e))
        try:
            return Response.text(200, await self.profiler.heap(seconds, top))
        except profiling.ProfileBusy as e:
            return Response.text(409, f"{e}\n")

    def heap_toggle(self, req: Request) -> Response:
        """``?activate=true|false`` (Rust's answer text), or no parameter to query."""
        values = req.query_params().get("activate")
        if values:
            v = values[-1]
            if v not in ("true", "false"):
                return Response.text(400, f"invalid activate value {v!r}; expected true or false\n")
            self.profiler.set_heap(v == "true")
        return Response.text(
            200, f"heap profiling active: {str(self.profiler.heap_active()).lower()}\n"
        )


def _log_quit_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("shutdown failed: %s", exc, exc_info=exc)
