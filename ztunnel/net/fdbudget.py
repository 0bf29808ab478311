"""The process's file-descriptor budget: refuse new work before ``RLIMIT_NOFILE`` is reached.

Running out of fds mid-connection fails in the worst places (an upstream socket that cannot be
created, a TLS handshake that cannot finish, the xDS or CA client that cannot reconnect), so the
proxy stops taking new connections and streams a ``reserve`` of fds before the limit, and keeps
those for the connections it already has and for its control plane.

The check is O(1) and needs no bookkeeping: the kernel hands out the lowest free fd number, so a
new fd numbered ``k`` means fds ``0..k-1`` are all open. An fd at or above ``limit - reserve``
therefore proves the table is full up to there; it is closed at once and the caller refuses the
work. The limit is read again at most once every ``LIMIT_REFRESH_SECONDS`` (a ``getrlimit`` per
check was two syscalls per proxied connection), so lowering it with ``prlimit`` on a running
process takes effect within that. After a refusal, :attr:`FdBudget.under_pressure` stays true
for a short while, so work that has no fd to check yet (a new HBONE stream) is refused too.
"""

from __future__ import annotations

import resource
import time

DEFAULT_RESERVE_MIN = 32
DEFAULT_RESERVE_MAX = 1024
PRESSURE_SECONDS = 0.2
LIMIT_REFRESH_SECONDS = 1.0


def default_reserve(soft_limit: int) -> int:
    """A tenth of the limit, within [32, 1024]."""
    return max(DEFAULT_RESERVE_MIN, min(DEFAULT_RESERVE_MAX, soft_limit // 10))


class FdBudget:
    """``reserve``: fds kept free (None: :func:`default_reserve` of the current limit)."""

    __slots__ = ("_pressure_until", "_refresh_at", "_threshold", "refused", "reserve")

    def __init__(self, reserve: int | None = None) -> None:
        self.reserve = reserve
        self.refused = 0
        self._pressure_until = 0.0
        self._threshold = 0
        self._refresh_at = float("-inf")

    def threshold(self) -> int:
        """The first fd number that is refused (the limit read at most once a refresh period)."""
        now = time.monotonic()
        if now >= self._refresh_at:
            self._threshold = self._read_threshold()
            self._refresh_at = now + LIMIT_REFRESH_SECONDS
        return self._threshold

    def _read_threshold(self) -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft < 0:  # RLIM_INFINITY (not on Linux, where NOFILE is always finite)
            return 1 << 62
        reserve = default_reserve(soft) if self.reserve is None else self.reserve
        return max(soft - reserve, 1)

    def admit(self, fd: int) -> bool:
        """Whether a newly created ``fd`` may be kept (False: close it and refuse the work)."""
        if fd < self.threshold():
            return True
        self.refused += 1
        self._pressure_until = time.monotonic() + PRESSURE_SECONDS
        return False

    @property
    def under_pressure(self) -> bool:
        """A refusal happened within the last ``PRESSURE_SECONDS``."""
        return self._pressure_until > 0 and time.monotonic() < self._pressure_until
