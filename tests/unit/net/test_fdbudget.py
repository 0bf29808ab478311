"""ztunnel.net.fdbudget: the fd-number test against RLIMIT_NOFILE minus the reserve."""

from __future__ import annotations

import resource

import pytest

from ztunnel.net import fdbudget
from ztunnel.net.fdbudget import FdBudget, default_reserve


def test_default_reserve() -> None:
    assert default_reserve(256) == 32
    assert default_reserve(4096) == 409
    assert default_reserve(1 << 20) == 1024


def test_admit_below_the_threshold_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (1000, 1000))
    b = FdBudget(reserve=100)
    assert b.threshold() == 900
    assert b.admit(899)
    assert not b.under_pressure
    assert not b.admit(900)
    assert b.refused == 1
    assert b.under_pressure


def test_pressure_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (100, 100))
    now = [50.0]
    monkeypatch.setattr(fdbudget.time, "monotonic", lambda: now[0])
    b = FdBudget(reserve=10)
    assert not b.admit(95)
    assert b.under_pressure
    now[0] += fdbudget.PRESSURE_SECONDS + 0.01
    assert not b.under_pressure


def test_the_limit_is_read_again_within_a_refresh_period(monkeypatch: pytest.MonkeyPatch) -> None:
    limit = [1000]
    reads = [0]

    def getrlimit(_r: int) -> tuple[int, int]:
        reads[0] += 1
        return limit[0], limit[0]

    now = [10.0]
    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(fdbudget.time, "monotonic", lambda: now[0])
    b = FdBudget(reserve=10)
    assert b.admit(500) and b.admit(501)
    assert reads == [1]  # (not one getrlimit per connection)
    limit[0] = 400  # lowered with prlimit on the running process
    now[0] += fdbudget.LIMIT_REFRESH_SECONDS / 2
    assert b.admit(500)
    now[0] += fdbudget.LIMIT_REFRESH_SECONDS / 2
    assert not b.admit(500)
    assert reads == [2]
