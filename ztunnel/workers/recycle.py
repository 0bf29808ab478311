"""When a data-plane worker is replaced by a fresh one: the memory a burst leaves behind.

After a burst of connections a CPython process keeps most of the memory it grew by, though the
connections are gone: a few hundred objects that outlive the burst pin obmalloc's arenas (10k
HBONE connections left 46 arenas against 16 before, 1,554 of their pools empty), and glibc
malloc, jemalloc and mimalloc under ``PYTHONMALLOC=malloc`` keep as much. It is a high-water
mark, not a leak, but the node's footprint would stay at its peak. The only way to give it
back is for the process to exit.

So the supervisor watches each worker's private memory (``Private_Dirty``: what it unshared
from the zygote, which exiting gives back), the objects it holds (``sys.getallocatedblocks``)
and its live connections. Not all growth is waste: a worker that decoded thousands of records
for its caches holds them (50k pods: +8.7 MiB private for +127k blocks, 72 bytes each), and a
fresh worker would grow back to the same size. So growth is counted net of the blocks still
allocated (``BLOCK_BYTES`` each, generously): what a burst leaves is memory grown with its
objects gone. A worker holding ``ZTUNNEL_WORKER_RECYCLE_MIB`` of that and idle at
``IDLE_CHECKS`` checks in a row is replaced: a new worker is forked from the zygote (a clean image) and takes its place,
while the old one stops accepting, lets the connections it still has finish, and exits. The
listening sockets stay open in the supervisor and the other workers meanwhile, so nothing is
refused, and readiness does not change. One worker retires at a time: a long-lived connection
may keep a retiree for as long as it lasts, beside its replacement.

The decision is pure (``Watch.observe``, table-tested); the supervisor reads the figures and acts.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_CONNECTIONS = 16  # at most this many live connections counts as idle: they may finish
IDLE_CHECKS = 2  # idle at this many checks in a row (not a lull between two requests)
MIN_AGE_CHECKS = 4  # a worker serves at least this many checks before it may be replaced
BLOCK_BYTES = 128  # what each allocated block more than at the fresh size is taken to hold


@dataclass(frozen=True, slots=True)
class RecyclePolicy:
    """``growth``: bytes of private memory over a worker's fresh size that make it a candidate
    (0: never replace a worker)."""

    growth: int
    idle_connections: int = IDLE_CONNECTIONS
    idle_checks: int = IDLE_CHECKS
    min_age_checks: int = MIN_AGE_CHECKS


@dataclass(slots=True)
class Watch:
    """What the supervisor remembers of one worker between checks."""

    fresh: int | None = None  # the lowest private size seen (the first check: just started)
    fresh_blocks: int | None = None  # the fewest allocated blocks seen
    checks: int = 0
    idle: int = 0  # idle checks in a row

    def observe(self, policy: RecyclePolicy, private: int, blocks: int, connections: int) -> bool:
        """Record one check of the worker; True: replace it now."""
        self.checks += 1
        self.fresh = private if self.fresh is None else min(self.fresh, private)
        self.fresh_blocks = blocks if self.fresh_blocks is None else min(self.fresh_blocks, blocks)
        self.idle = self.idle + 1 if connections <= policy.idle_connections else 0
        return (
            policy.growth > 0
            and self.checks > policy.min_age_checks
            and self.idle >= policy.idle_checks
            and self.wasted(private, blocks) >= policy.growth
        )

    def grown(self, private: int) -> int:
        """Private bytes over the fresh size."""
        return private - (self.fresh if self.fresh is not None else private)

    def wasted(self, private: int, blocks: int) -> int:
        """What of that growth no object holds (the blocks over the fresh count discounted)."""
        more = blocks - (self.fresh_blocks if self.fresh_blocks is not None else blocks)
        return self.grown(private) - max(0, more) * BLOCK_BYTES
