"""SecretManager: single-flight, concurrency limit, half-life renewal, backoff, forget, close."""

from __future__ import annotations

import asyncio
import datetime as dt
import heapq
import itertools
import time

import pytest

from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.localca import LocalCA
from ztunnel.identity.manager import (
    CertificateForgotten,
    CertificateMismatch,
    CertificateProvider,
    CertificateUnavailable,
    SecretManager,
    SecretManagerClosed,
)
from ztunnel.testing.certs import ScriptedProvider

pytestmark = pytest.mark.timeout(30)

ALICE = Identity("cluster.local", "default", "alice")
BOB = Identity("cluster.local", "default", "bob")
TTL = dt.timedelta(seconds=100)  # half-life 50 s of fake time


class FakeClock:
    """Wall clock + sleep that only move when the test calls ``advance``."""

    def __init__(self, start: float) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (self.now + delay, next(self._seq), fut))
        await fut

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline passes, in order."""
        target = self.now + seconds
        await self.settle()
        while self._waiters and self._waiters[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._waiters)
            self.now = max(self.now, deadline)
            if not fut.done():
                fut.set_result(None)
            await self.settle()
        self.now = target
        await self.settle()


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.ephemeral()


def _setup(ca: LocalCA, **kw: object) -> tuple[FakeClock, ScriptedProvider, SecretManager]:
    clock = FakeClock(float(int(time.time())))
    provider = ScriptedProvider(ca, ttl=TTL, not_before_clock=clock.time)
    mgr = SecretManager(provider, clock=clock.time, sleep=clock.sleep, **kw)  # type: ignore[arg-type]
    return clock, provider, mgr


def test_local_ca_satisfies_the_protocol(ca: LocalCA) -> None:
    provider: CertificateProvider = ca
    assert provider is ca


async def test_single_flight(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.gate = asyncio.Event()
    tasks = [asyncio.create_task(mgr.fetch_certificate(ALICE)) for _ in range(50)]
    await clock.settle()
    assert provider.calls == [ALICE]
    provider.gate.set()
    certs = await asyncio.gather(*tasks)
    assert all(c is certs[0] for c in certs)
    assert certs[0].identity == ALICE
    assert provider.calls == [ALICE]
    # Cached afterwards, and visible to the sync lookup.
    assert await mgr.fetch_certificate(ALICE) is certs[0]
    assert mgr.find_certificate(ALICE) is certs[0]
    assert mgr.find_certificate(BOB) is None
    assert provider.calls == [ALICE]
    await mgr.close()


async def test_at_most_eight_concurrent_ca_requests(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.gate = asyncio.Event()
    ids = [Identity("cluster.local", "ns", f"sa{i}") for i in range(20)]
    tasks = [asyncio.create_task(mgr.fetch_certificate(i)) for i in ids]
    await clock.settle()
    assert provider.in_flight == 8
    provider.gate.set()
    certs = await asyncio.gather(*tasks)
    assert [c.identity for c in certs] == ids
    assert provider.max_in_flight == 8
    assert sorted(provider.calls) == sorted(ids)
    await mgr.close()


async def test_renews_at_half_life(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    first = await mgr.fetch_certificate(ALICE)
    assert clock.sleeps == [50.0]
    await clock.advance(49.9)
    assert len(provider.calls) == 1
    assert await mgr.fetch_certificate(ALICE) is first
    await clock.advance(0.1)
    assert len(provider.calls) == 2
    second = await mgr.fetch_certificate(ALICE)
    assert second is not first and second.serial != first.serial
    assert second.not_before.timestamp() == clock.now
    await clock.advance(50)
    assert len(provider.calls) == 3
    assert clock.sleeps == [50.0, 50.0, 50.0]
    await mgr.close()


async def test_renews_at_half_life_in_real_time() -> None:
    """A 2 s certificate is renewed ~1 s after issue, on the real clock."""
    ca = LocalCA.ephemeral(ttl=dt.timedelta(seconds=2))
    provider = ScriptedProvider(ca)
    mgr = SecretManager(provider)
    # Start just after a second boundary so the whole-second not_before is ~now.
    await asyncio.sleep(1.02 - time.time() % 1)
    start = time.monotonic()
    first = await mgr.fetch_certificate(ALICE)
    while len(provider.calls) < 2:
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - start
    assert 0.8 <= elapsed <= 1.5, elapsed
    await asyncio.sleep(0.01)
    assert mgr.find_certificate(ALICE) is not first
    await mgr.close()


async def test_renewal_failure_keeps_valid_cert_and_backs_off(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    first = await mgr.fetch_certificate(ALICE)
    provider.failures = 3
    await clock.advance(50)  # renewal 1 fails
    assert len(provider.calls) == 2
    assert await mgr.fetch_certificate(ALICE) is first  # still valid: keep serving it
    assert mgr.statuses()[0].state == "Available"
    assert mgr.statuses()[0].error == "CA unreachable"
    await clock.advance(0.49)
    assert len(provider.calls) == 2
    await clock.advance(0.01)  # retry after 0.5 s fails
    await clock.advance(1.0)  # retry after 1 s fails
    assert len(provider.calls) == 4
    await clock.advance(2.0)  # retry after 2 s succeeds
    assert len(provider.calls) == 5
    renewed = await mgr.fetch_certificate(ALICE)
    assert renewed is not first
    assert clock.sleeps[:4] == [50.0, 0.5, 1.0, 2.0]
    # Next renewal at the new certificate's half-life (its not_before is whole seconds).
    assert clock.sleeps[4] == renewed.refresh_at.timestamp() - clock.now
    # Backoff was reset by the success.
    provider.failures = 1
    await clock.advance(clock.sleeps[4])
    assert clock.sleeps[-1] == 0.5
    await clock.advance(0.5)
    assert len(provider.calls) == 7
    await mgr.close()


async def test_backoff_is_capped_at_150s(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.failures = 1000
    with pytest.raises(CertificateUnavailable) as err:
        await mgr.fetch_certificate(ALICE)
    assert isinstance(err.value.__cause__, ConnectionError)
    # While backing off, callers get the last error at once instead of waiting.
    with pytest.raises(CertificateUnavailable):
        await mgr.fetch_certificate(ALICE)
    assert mgr.statuses()[0].state == "Unavailable"
    for _ in range(12):
        await clock.advance(clock.sleeps[-1])
    assert clock.sleeps[:12] == [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 150, 150, 150]
    provider.failures = 0
    await clock.advance(150)
    assert (await mgr.fetch_certificate(ALICE)).identity == ALICE
    await mgr.close()


async def test_initial_failure_then_success(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.failures = 1
    with pytest.raises(CertificateUnavailable):
        await mgr.fetch_certificate(ALICE)
    await clock.advance(0.5)
    cert = await mgr.fetch_certificate(ALICE)
    assert cert.identity == ALICE and len(provider.calls) == 2
    await mgr.close()


async def test_expired_cert_is_not_served_while_renewal_fails(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    await mgr.fetch_certificate(ALICE)
    provider.failures = 10_000
    await clock.advance(50)
    for _ in range(10):
        await clock.advance(clock.sleeps[-1])
    assert clock.now - clock.sleeps[0] > 100  # past not_after
    assert mgr.find_certificate(ALICE) is None
    with pytest.raises(CertificateUnavailable):
        await mgr.fetch_certificate(ALICE)
    await mgr.close()


async def test_late_timer_renews_on_demand(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    first = await mgr.fetch_certificate(ALICE)
    clock.now += 200  # wall clock jumps (suspend); the renewal sleeper is not woken
    second = await mgr.fetch_certificate(ALICE)
    assert second is not first and len(provider.calls) == 2
    await mgr.close()


async def test_wrong_identity_from_ca_is_an_error(ca: LocalCA) -> None:
    class Liar:
        async def sign(self, identity: Identity) -> WorkloadCertificate:
            return ca.issue(BOB)

    mgr = SecretManager(Liar())
    with pytest.raises(CertificateUnavailable) as err:
        await mgr.fetch_certificate(ALICE)
    assert isinstance(err.value.__cause__, CertificateMismatch)
    await mgr.close()


async def test_forget_cancels_renewal_and_waiters(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    await mgr.fetch_certificate(ALICE)
    task = mgr._entries[ALICE].task
    assert task is not None and not task.done()
    mgr.forget(ALICE)
    await clock.settle()
    assert task.cancelled()
    assert mgr.identities() == [] and mgr.find_certificate(ALICE) is None
    await clock.advance(100)
    assert len(provider.calls) == 1  # no renewal after forget
    mgr.forget(ALICE)  # idempotent

    # Forgetting while callers wait on the first fetch fails them.
    provider.gate = asyncio.Event()
    waiters = [asyncio.create_task(mgr.fetch_certificate(BOB)) for _ in range(3)]
    await clock.settle()
    mgr.forget(BOB)
    for w in waiters:
        with pytest.raises(CertificateForgotten):
            await w
    assert provider.in_flight == 0  # the CA request was cancelled

    # Coming back later starts afresh.
    provider.gate = None
    assert (await mgr.fetch_certificate(ALICE)).identity == ALICE
    assert provider.calls.count(ALICE) == 2
    await mgr.close()


async def test_forget_before_task_ran(ca: LocalCA) -> None:
    _, provider, mgr = _setup(ca)
    mgr.prefetch(ALICE)
    mgr.forget(ALICE)
    await asyncio.sleep(0)
    assert provider.calls == []
    await mgr.close()


async def test_prefetch_and_statuses(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.gate = asyncio.Event()
    mgr.prefetch(BOB)
    mgr.prefetch(ALICE)
    mgr.prefetch(ALICE)
    await clock.settle()
    assert [s.state for s in mgr.statuses()] == ["Initializing", "Initializing"]
    assert [s.identity for s in mgr.statuses()] == [ALICE, BOB]
    provider.gate.set()
    await clock.settle()
    assert [s.state for s in mgr.statuses()] == ["Available", "Available"]
    assert sorted(provider.calls) == [ALICE, BOB]
    await mgr.close()


async def test_close_leaves_no_tasks(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    await mgr.fetch_certificate(ALICE)  # renewal task sleeping
    provider.gate = asyncio.Event()
    waiter = asyncio.create_task(mgr.fetch_certificate(BOB))  # CA request in flight
    await clock.settle()
    await mgr.close()
    with pytest.raises(SecretManagerClosed):
        await waiter
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert mgr._tasks == set()
    with pytest.raises(SecretManagerClosed):
        await mgr.fetch_certificate(ALICE)
    with pytest.raises(SecretManagerClosed):
        mgr.prefetch(ALICE)
    await mgr.close()  # idempotent


async def test_waiter_cancellation_does_not_cancel_the_fetch(ca: LocalCA) -> None:
    clock, provider, mgr = _setup(ca)
    provider.gate = asyncio.Event()
    a = asyncio.create_task(mgr.fetch_certificate(ALICE))
    b = asyncio.create_task(mgr.fetch_certificate(ALICE))
    await clock.settle()
    a.cancel()
    await clock.settle()
    provider.gate.set()
    assert (await b).identity == ALICE
    assert a.cancelled() and provider.calls == [ALICE]
    await mgr.close()


@pytest.mark.both_loops
async def test_works_on_both_loops(ca: LocalCA) -> None:
    mgr = SecretManager(ca)
    certs = await asyncio.gather(*(mgr.fetch_certificate(ALICE) for _ in range(10)))
    assert len({id(c) for c in certs}) == 1
    await mgr.close()


def test_argument_checks(ca: LocalCA) -> None:
    with pytest.raises(ValueError):
        SecretManager(ca, concurrency=0)
    with pytest.raises(ValueError):
        SecretManager(ca, initial_backoff=200, max_backoff=150)
