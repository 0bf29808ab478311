"""When the supervisor replaces a worker (``workers/recycle.py``; Python-only: Rust's threads give
memory back to jemalloc, so it has no counterpart). One row per check: (private MiB, live
connections[, allocated blocks]) -> replace?"""

from __future__ import annotations

import pytest

from ztunnel.workers.recycle import BLOCK_BYTES, RecyclePolicy, Watch

pytestmark = pytest.mark.timeout(10)

MiB = 1 << 20
POLICY = RecyclePolicy(growth=16 * MiB, idle_connections=2, idle_checks=2, min_age_checks=3)


BLOCKS = 200_000  # (what a worker holds when nothing else grows)


def run(checks: list[tuple[int, ...]], policy: RecyclePolicy = POLICY) -> list[bool]:
    watch = Watch()
    out = []
    for mib, conns, *blocks in checks:
        out.append(watch.observe(policy, mib * MiB, blocks[0] if blocks else BLOCKS, conns))
    return out


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
        # grown as much, but with as many more objects held (caches filled with records: a
        # fresh worker would grow back): not waste, kept
        (
            [
                (8, 0),
                (8, 0),
                (8, 0),
                (24, 0, BLOCKS + 16 * MiB // BLOCK_BYTES),
                (24, 0, BLOCKS * 2),
            ],
            [False] * 5,
        ),
        # grown with objects that were then freed (a burst): the blocks came back down
        (
            [(8, 0), (8, 0), (40, 900, BLOCKS * 3), (40, 0, BLOCKS + 500), (40, 0, BLOCKS + 500)],
            [False, False, False, False, True],
        ),
        # half of it still held: what is left over is below the threshold
        (
            [(8, 0), (8, 0), (8, 0), (30, 0, BLOCKS + 8 * MiB // BLOCK_BYTES)] * 2,
            [False] * 8,
        ),
        # the fresh count is the fewest blocks seen: twice as many objects held since
        (
            [(8, 0, BLOCKS), (8, 0, BLOCKS * 2), (8, 0, BLOCKS * 2)] + [(24, 0, BLOCKS * 2)] * 2,
            [False] * 5,
        ),
    ],
)
def test_observe(checks: list[tuple[int, ...]], want: list[bool]) -> None:
    assert run(checks) == want


def test_growth_zero_never_replaces() -> None:
    never = RecyclePolicy(growth=0, idle_checks=1, min_age_checks=0)
    assert run([(8, 0), (800, 0), (800, 0)], never) == [False, False, False]


def test_grown_and_wasted() -> None:
    watch = Watch()
    assert watch.grown(5 * MiB) == 0  # (nothing seen yet)
    assert watch.wasted(5 * MiB, BLOCKS) == 0
    watch.observe(POLICY, 8 * MiB, BLOCKS, 0)
    assert watch.grown(30 * MiB) == 22 * MiB
    assert watch.wasted(30 * MiB, BLOCKS + 1000) == 22 * MiB - 1000 * BLOCK_BYTES
    assert watch.wasted(30 * MiB, BLOCKS - 1000) == 22 * MiB  # (fewer objects: no credit)
