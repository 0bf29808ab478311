"""Test runner glue: async tests, both event loops, and a loop-error tripwire.

* ``async def test_*`` functions run on a fresh event loop (stdlib asyncio by default).
* ``@pytest.mark.both_loops`` runs the test once on stdlib asyncio and once on uvloop.
* A test fails if the loop's exception handler was ever called (an unhandled error in a callback
  or a task nobody awaited), the way uvloop's own suite does.
* ``netns`` tests need root; they fail (never skip) when root is missing.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_loops: run an async test on asyncio and on uvloop")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if inspect.iscoroutinefunction(metafunc.function):
        kinds = (
            ["asyncio", "uvloop"]
            if metafunc.definition.get_closest_marker("both_loops")
            else ["asyncio"]
        )
        metafunc.fixturenames.append("_loop_kind")
        metafunc.parametrize("_loop_kind", kinds, ids=kinds if len(kinds) > 1 else None)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    kind = pyfuncitem.funcargs.get("_loop_kind", "asyncio")
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {k: pyfuncitem.funcargs[k] for k in names if k in pyfuncitem.funcargs}
    errors: list[dict[str, Any]] = []

    def handler(loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        errors.append(ctx)
        loop.default_exception_handler(ctx)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(handler)
        await fn(**kwargs)

    with asyncio.Runner(loop_factory=_loop_factory(kind)) as runner:
        runner.run(main())
    if errors:
        pytest.fail(
            f"event loop exception handler was called: {errors[0].get('message')!r} "
            f"{errors[0].get('exception')!r}"
        )
    return True


@pytest.fixture
def require_root() -> None:
    """netns tests depend on this: they must fail loudly, not skip, without root."""
    if os.geteuid() != 0:
        pytest.fail("this test needs root (network namespaces, iptables)")
