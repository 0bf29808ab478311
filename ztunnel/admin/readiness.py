"""Readiness (15021): ready once every registered start-up task is done.

Each component that must finish before ztunnel takes traffic (local config or xDS sync, the
proxy listeners, the in-pod snapshot, ...) registers a task and marks it done; a task may become
pending again (in-pod: while the node-agent connection is down). ``GET /healthz/ready`` answers
200 ``ready`` when nothing is pending, else 500 naming what is (istio/ztunnel
``src/readiness/server.rs``). Other methods get 405, other paths 404.
"""

from __future__ import annotations

from ztunnel.admin.http import Request, Response

READY_PATH = "/healthz/ready"


class ReadyToken:
    """One registered start-up task. ``done()`` and ``not_ready_again()`` are idempotent."""

    __slots__ = ("_done", "_owner", "name")

    def __init__(self, owner: Readiness, name: str) -> None:
        self._owner = owner
        self.name = name
        self._done = False

    @property
    def is_done(self) -> bool:
        return self._done

    def done(self) -> None:
        self._done = True

    def not_ready_again(self) -> None:
        self._done = False

    def __repr__(self) -> str:
        return f"ReadyToken({self.name!r}, done={self._done})"


class Readiness:
    """The set of start-up tasks. Two tasks may share a name; the name is pending while either
    is."""

    def __init__(self) -> None:
        self._tokens: list[ReadyToken] = []

    def register(self, name: str) -> ReadyToken:
        token = ReadyToken(self, name)
        self._tokens.append(token)
        return token

    def pending(self) -> list[str]:
        """Sorted names of the tasks not done yet."""
        return sorted({t.name for t in self._tokens if not t.is_done})

    @property
    def ready(self) -> bool:
        return all(t.is_done for t in self._tokens)


class ReadinessHandler:
    """The HTTP side of :class:`Readiness`."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness

    async def __call__(self, req: Request) -> Response:
        if req.path != READY_PATH:
            return Response.empty(404)
        if req.method != "GET":
            return Response.empty(405)
        pending = self.readiness.pending()
        if not pending:
            return Response.text(200, "ready\n")
        return Response.text(500, f"not ready, pending: {', '.join(pending)}\n")
