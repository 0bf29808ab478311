"""Admin (15000, localhost only by default): index, ``/config_dump``, ``/quitquitquit``,
``/logging`` (istio/ztunnel ``src/admin.rs``), and ``/debug/authz`` (ours: explain the
authorization decision for a connection, see :mod:`ztunnel.admin.explain`).

Everything it shows or triggers comes in as a callable, so the composition root wires it:
``state`` and ``config`` for the dump, ``certificates`` (``SecretManager.statuses``), ``static``
(the local config file, if one was used), ``extra`` sections (in-pod: ``workloadState``),
``explain`` (the query of ``/debug/authz`` to an explanation) and ``on_quit`` (the graceful
drain). ``on_quit`` must not close this admin server itself: the ``/quitquitquit`` request is
still in flight while it runs.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import platform
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from ztunnel import __version__
from ztunnel.admin import config_dump as dump
from ztunnel.admin.http import HttpServer, Request, Response
from ztunnel.admin.logctl import LogControl
from ztunnel.config import ADMIN_PORT
from ztunnel.identity.manager import CertificateStatus

log = logging.getLogger("ztunnel.admin")

ADMIN_DEFAULT_HOST = "127.0.0.1"

LOGGING_HELP = """
usage: GET or POST /logging\t\t\t\t\t(To list current level)
usage: POST /logging?level=<level>\t\t\t\t(To change global levels)
usage: POST /logging?level={mod1}={level1},{mod2}={level2}\t(To change specific mods' logging level)
usage: POST /logging?reset\t\t\t\t\t(To restore the start-up levels)

hint: loglevel:\terror|warn|info|debug|trace|off
hint: mod_name:\tthe module name, i.e. ztunnel::proxy or access
"""

ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("quitquitquit", "shut down the server (POST)"),
    ("config_dump", "dump the current Ztunnel configuration"),
    ("logging", "query/changing logging levels"),
    ("debug/authz", "explain the authorization decision: ?src=&dst=&port="),
)


class Explained(Protocol):
    """What ``/debug/authz`` renders (``ztunnel.state.authz.Explanation``)."""

    def to_dict(self) -> dict[str, Any]: ...


# The query parameters (last value of each) -> the explanation. Raises ValueError for bad
# input (400) and LookupError for an unknown workload (404).
ExplainFn = Callable[[Mapping[str, str]], Explained]


def bind_admin(
    handler: AdminHandler, *, port: int = ADMIN_PORT, host: str = ADMIN_DEFAULT_HOST
) -> HttpServer:
    """The admin server, bound now; localhost only unless ``host`` says otherwise."""
    return HttpServer.bind("admin", [(host, port)], handler)


def build_info(istio_version: str = "unknown") -> dict[str, str]:
    """The ``version`` section (Rust ``BuildInfo``, with Python in place of rustc)."""
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
        self._quitting: asyncio.Task[None] | None = None

    async def __call__(self, req: Request) -> Response:
        path = req.path
        if path == "/":
            return self._get_only(req) or Response(
                200, index_page().encode(), "text/html; charset=utf-8"
            )
        if path == "/config_dump":
            return self._get_only(req) or self.config_dump()
        if path == "/quitquitquit":
            if req.method != "POST":
                return Response.empty(405)
            return await self.quit()
        if path == "/logging":
            return self.logging(req)
        if path == "/debug/authz":
            return self._get_only(req) or self.debug_authz(req)
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
        ctl = self.log_control
        if req.method not in ("GET", "POST"):
            return Response.text(405, f"Invalid HTTP method\n{LOGGING_HELP}")
        if ctl is None:
            return Response.text(503, "log control is not wired\n")
        params = req.query_params()
        if req.method == "GET" or ("level" not in params and "reset" not in params):
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


def _log_quit_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("shutdown failed: %s", exc, exc_info=exc)
