"""Runtime log-level control behind ``/logging``: RUST_LOG-style specs applied to ``logging``.

Semantics follow istio/ztunnel ``telemetry::set_level``: a new spec is *added* to the current
one (later directives win), ``reset`` starts again from the start-up spec (plus the new spec, if
any). Loggers a previous spec named but the new one does not are reset to inherit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ztunnel import logs

_LEVEL_WORDS = frozenset({"off", "error", "warn", "info", "debug", "trace"})


def validate_spec(spec: str) -> None:
    """Raise ValueError unless every clause is ``<level>`` or ``<target>=<level>`` (a bare
    target, which tracing reads as ``target=trace``, is refused as in Rust)."""
    for clause in (c.strip() for c in spec.split(",")):
        if not clause:
            continue
        if "=" not in clause and clause.lower() not in _LEVEL_WORDS:
            raise ValueError(f"level {clause} is invalid")
    logs.parse_directives(spec)


class LogControl:
    """Owns the run-time changes to log levels. Build it after ``logs.setup``."""

    def __init__(
        self,
        startup_spec: str,
        *,
        apply: Callable[[str], None] = logs.apply_directives,
    ) -> None:
        validate_spec(startup_spec)
        self.startup_spec = startup_spec
        self._apply = apply
        self._named: set[str] = set(logs.parse_directives(startup_spec)[1])

    def current(self) -> str:
        """The levels in force, e.g. ``access=debug,info``."""
        return logs.current_directives(frozenset(self._named))

    def change(self, level: str, *, reset: bool) -> str:
        """Apply ``level`` on top of the current spec (or of the start-up spec when ``reset``);
        returns the new current spec. Raises ValueError for an invalid spec, changing nothing."""
        if level:
            validate_spec(level)
        base = self.startup_spec if reset else self.current()
        spec = f"{base},{level}" if level else base
        _, targets = logs.parse_directives(spec)
        for name in self._named - set(targets):
            logging.getLogger(name).setLevel(logging.NOTSET)
        self._apply(spec)
        self._named = set(targets)
        return self.current()
