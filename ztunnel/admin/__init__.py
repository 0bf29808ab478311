"""Admin (15000), stats (15020) and readiness (15021) servers over a small strict HTTP/1.1 core.

Wiring (in ``app.py``)::

    stats = HttpServer.bind("stats", [("::", STATS_PORT)], StatsHandler(registry))
    ready = HttpServer.bind("readiness", [("::", READINESS_PORT)], ReadinessHandler(readiness))
    admin = bind_admin(AdminHandler(...))  # 127.0.0.1:15000
    for s in (stats, ready, admin):
        await s.start()
"""

from ztunnel.admin.admin import ADMIN_DEFAULT_HOST, AdminHandler, bind_admin, build_info
from ztunnel.admin.http import HttpError, HttpServer, Request, RequestParser, Response
from ztunnel.admin.logctl import LogControl
from ztunnel.admin.readiness import Readiness, ReadinessHandler, ReadyToken
from ztunnel.admin.stats import StatsHandler

__all__ = [
    "ADMIN_DEFAULT_HOST",
    "AdminHandler",
    "HttpError",
    "HttpServer",
    "LogControl",
    "Readiness",
    "ReadinessHandler",
    "ReadyToken",
    "Request",
    "RequestParser",
    "Response",
    "StatsHandler",
    "bind_admin",
    "build_info",
]
