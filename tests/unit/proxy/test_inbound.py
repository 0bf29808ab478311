"""ztunnel.proxy.inbound: the fair start of stream tasks (the CONNECT decisions themselves are
proxy/inbound_route.py's, tested in test_inbound_route.py)."""

from __future__ import annotations

import asyncio

from ztunnel.proxy.inbound import _FairStarter


async def test_fair_starter_runs_a_batch_per_iteration() -> None:
    starter = _FairStarter(batch=3)
    ran: list[int] = []
    for i in range(10):
        starter.submit(lambda i=i: ran.append(i))  # type: ignore[misc]
    assert ran == [0, 1, 2]
    await asyncio.sleep(0)
    assert ran == [0, 1, 2, 3, 4, 5]
    for _ in range(3):
        await asyncio.sleep(0)
    assert ran == list(range(10))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not starter.armed and starter.started == 0
