"""Log lines a peer can trigger, at most one per key per interval, with a count of the rest."""

from __future__ import annotations

import logging
import time
from typing import Any

_MAX_KEYS = 256


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last emitted, suppressed since)

    def log(self, level: int, key: str, msg: str, *args: Any) -> bool:
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is None and len(self._last) >= _MAX_KEYS:
            # Forget the oldest keys rather than grow with whatever a peer makes us log.
            for k in sorted(self._last, key=lambda k: self._last[k][0])[: _MAX_KEYS // 2]:
                del self._last[k]
        suppressed = last[1] if last is not None else 0
        if suppressed:
            msg += f" ({suppressed} more like this in the last {self.interval:.0f}s)"
        self._last[key] = (now, 0)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.INFO, key, msg, *args)

    def debug(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.DEBUG, key, msg, *args)
