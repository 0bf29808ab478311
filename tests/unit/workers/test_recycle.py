"""When the supervisor replaces a worker (``workers/recycle.py``; Python-only: Rust's threads give
memory back to jemalloc, so it has no counterpart). One row per check: (private MiB, live
connections) -> replace?"""

from __future__ import annotations

import pytest

from ztunnel.workers.recycle import RecyclePolicy, Watch

pytestmark = pytest.mark.timeout(10)

MiB = 1 << 20
POLICY = RecyclePolicy(growth=16 * MiB, idle_connections=2, idle_checks=2, min_age_checks=3)


def run(checks: list[tuple[int, int]], policy: RecyclePolicy = POLICY) -> list[bool]:
    watch = Watch()
    return [watch.observe(policy, mib * MiB, conns) for mib, conns in checks]


@pytest.mark.parametrize(
    ("checks", "want"),
    [
        # fresh at 8, a burst to 40 with many connections, then idle twice: replaced
        ([(8, 0), (9, 0), (40, 900), (30, 0), (30, 0)], [False, False, False, False, True]),
        # grown, idle, but too young: only once it has served min_age_checks checks
        ([(8, 0), (30, 0), (30, 0), (30, 0)], [False, False, False, True]),
        # idle for one check only (a lull between requests): not yet
        ([(8, 50), (8, 50), (8, 50), (30, 0), (30, 50), (30, 0)], [False] * 6),
        # a few connections still count as idle (they may finish on the old worker)
        ([(8, 50), (8, 50), (8, 50), (30, 2), (30, 1)], [False, False, False, False, True]),
        # grown by less than the threshold: kept
        ([(8, 0), (8, 0), (8, 0), (23, 0), (23, 0)], [False] * 5),
        # exactly the threshold over the fresh size: replaced
        ([(8, 50), (8, 50), (8, 50), (24, 0), (24, 0)], [False, False, False, False, True]),
        # the fresh size is the lowest seen (a first check taken while it was still warming up)
        ([(20, 50), (8, 50), (8, 50), (24, 0), (24, 0)], [False, False, False, False, True]),
    ],
)
def test_observe(checks: list[tuple[int, int]], want: list[bool]) -> None:
    assert run(checks) == want


def test_growth_zero_never_replaces() -> None:
    never = RecyclePolicy(growth=0, idle_checks=1, min_age_checks=0)
    assert run([(8, 0), (800, 0), (800, 0)], never) == [False, False, False]


def test_grown() -> None:
    watch = Watch()
    assert watch.grown(5 * MiB) == 0  # (nothing seen yet)
    watch.observe(POLICY, 8 * MiB, 0)
    assert watch.grown(30 * MiB) == 22 * MiB
