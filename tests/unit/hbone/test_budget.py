"""ztunnel.hbone.budget: the process-wide budget for HBONE bytes held in memory (table tests;
the transport's use of it is in test_transport.py, an attack on it in tests/netns/test_hostile.py)."""

from __future__ import annotations

import asyncio

import pytest

from ztunnel.hbone.budget import DEFAULT_BUDGET, BufferBudget, Holder

pytestmark = pytest.mark.timeout(30)


def holders(budget: BufferBudget, n: int) -> tuple[list[Holder], list[int]]:
    resumed: list[int] = []
    return [budget.holder(lambda i=i: resumed.append(i)) for i in range(n)], resumed


def test_holding_and_releasing_is_counted_per_connection_and_in_all() -> None:
    b = BufferBudget(1000)
    (h1, h2), _ = holders(b, 2)
    h1.hold(300)
    h1.hold(100)
    h2.hold(50)
    assert (b.used, b.holders, h1.held, h2.held) == (450, 2, 400, 50)
    h1.release(400)
    assert (b.used, b.holders) == (50, 1)
    h2.release(80)  # more than held: all of it
    h2.release(5)  # nothing held: nothing happens
    h1.hold(0)
    assert (b.used, b.holders, h2.held) == (0, 0, 0)


@pytest.mark.parametrize(
    ("held", "other", "wait"),
    [
        (0, 1000, False),  # holding nothing: always read (its bytes go straight out)
        (400, 500, False),  # under the budget (900 of 1000)
        (500, 500, True),  # at the budget, holding its share (1000 / 2 holders)
        (499, 501, False),  # at the budget, under its share: still read
        (700, 300, True),
        (100, 900, False),
    ],
)
def test_past_the_budget_a_holder_waits_only_with_its_share_or_more(
    held: int, other: int, wait: bool
) -> None:
    b = BufferBudget(1000)
    (h1, h2), _ = holders(b, 2)
    h1.hold(held)
    h2.hold(other)
    assert h1.must_wait() is (wait and held > 0)
    assert b.waiting == (1 if wait and held else 0)


def test_waiting_holders_resume_when_the_budget_drains_to_three_quarters() -> None:
    b = BufferBudget(1000)
    hs, resumed = holders(b, 4)
    for h in hs:
        h.hold(250)
    assert all(h.must_wait() for h in hs)
    assert b.waits == 4 and b.waiting == 4
    hs[0].must_wait()  # (asked again while waiting: counted once)
    assert b.waits == 4
    hs[3].release(249)  # 751 used: not yet; and hs[3] is under its share now (1 * 4 < 1000)
    assert resumed == [3]
    hs[3].release(1)  # 750: three quarters, everyone resumes, in order
    assert resumed == [3, 0, 1, 2] and b.waiting == 0


def test_release_all_forgets_the_holder() -> None:
    b = BufferBudget(100)
    (h1, h2), resumed = holders(b, 2)
    h1.hold(100)
    h2.hold(100)
    assert h1.must_wait() and h2.must_wait()
    h1.release_all()  # (the connection is gone: never resumed)
    assert (b.used, b.holders, b.waiting, h1.held) == (100, 1, 1, 0)
    h2.release(100)
    assert resumed == [1]


def test_tight_from_a_quarter_of_the_budget() -> None:
    b = BufferBudget(1000)
    (h,), _ = holders(b, 1)
    h.hold(249)
    assert not b.tight
    h.hold(1)
    assert b.tight


@pytest.mark.both_loops
async def test_one_budget_per_loop() -> None:
    loop = asyncio.get_running_loop()
    b = BufferBudget.of_loop(loop)
    assert b.limit == DEFAULT_BUDGET
    assert BufferBudget.of_loop(loop, 1 << 20) is b and b.limit == 1 << 20
    with pytest.raises(ValueError, match="positive"):
        BufferBudget(0)
