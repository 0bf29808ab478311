"""One budget for the HBONE bytes a process holds in memory, shared by all its connections.

Flow control bounds what one connection can make us buffer (its windows: 16 MiB a connection by
default), not what many connections can: bytes that arrive for a stream not yet bridged (its
upstream connect still pending) or that the app's socket does not take yet are copied and held
until they are written out. Sixteen connections with valid certificates each sending 16 MiB to
pending connects grew a ztunnel by 261 MiB, all of it legal.

Every HBONE connection of a process (one event loop: one data-plane worker) charges what it holds
to the process's :class:`BufferBudget` through its :class:`Holder`. Past the budget, a connection
holding at least its fair share of it (the budget over the number of connections holding
anything) waits: the transport stops reading it until the budget has drained to three quarters,
or its own holdings fell under its share. That is TCP back-pressure: its peer's window in effect
shrinks to what it already sent, and its new streams wait with the rest of its input. A
connection holding nothing is always read (its bytes go straight out, which is what keeps honest
streams flowing), and from a quarter of the budget on the transport reads every connection in
small pieces, one a turn, so what reading adds past the budget is a small read per connection. Held bytes leave as
their upstream connects end or their apps read, never because the waiting connection is read, so
a wait ends by itself; a connection whose holdings never leave (its app stopped reading) stays
unread, and its keepalive PING, unanswered meanwhile, closes it (transport.KEEPALIVE_TIMEOUT).

Sans-IO: no loop, no sockets. The transport calls :meth:`Holder.hold` and :meth:`Holder.release`
and asks :meth:`Holder.must_wait` before each read; a waiting holder's ``resume`` callback is
called (synchronously, from a release) when it may read again.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Final

DEFAULT_BUDGET: Final = 32 << 20  # bytes, node-wide (ZTUNNEL_H2_BUFFER_BUDGET)

_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BufferBudget] = (
    weakref.WeakKeyDictionary()
)


class BufferBudget:
    """Bytes held by the HBONE connections of one process, against ``limit``."""

    __slots__ = ("_waiting", "holders", "limit", "used", "waits")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"buffer budget must be positive: {limit}")
        self.limit = limit
        self.used = 0
        self.holders = 0  # Holders with anything held
        self.waits = 0  # times a holder was made to wait (for logs and tests)
        self._waiting: dict[Holder, None] = {}  # (an ordered set: resumed in order)

    @classmethod
    def of_loop(cls, loop: asyncio.AbstractEventLoop, limit: int = DEFAULT_BUDGET) -> BufferBudget:
        """The budget shared by every connection on ``loop`` (one per process in ztunnel: each
        data-plane worker runs one loop, so a node-wide budget split by the worker count is what
        each worker passes); ``limit`` updates it."""
        budget = _budgets.get(loop)
        if budget is None:
            budget = _budgets[loop] = cls(limit)
        else:
            budget.limit = limit
        return budget

    @property
    def tight(self) -> bool:
        """A quarter of the budget is used: read every connection in small pieces, one a turn,
        so that no read adds much past it and no turn copies much."""
        return self.used * 4 >= self.limit

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def holder(self, resume: Callable[[], None]) -> Holder:
        """An account for one connection; ``resume`` is called when it may read again."""
        return Holder(self, resume)

    def _wake(self, holders: list[Holder]) -> None:
        for h in holders:
            if h in self._waiting:
                del self._waiting[h]
                h.resume()


class Holder:
    """What one connection holds of a :class:`BufferBudget`."""

    __slots__ = ("budget", "held", "resume")

    def __init__(self, budget: BufferBudget, resume: Callable[[], None]) -> None:
        self.budget = budget
        self.held = 0
        self.resume = resume

    def hold(self, n: int) -> None:
        if n > 0:
            b = self.budget
            if not self.held:
                b.holders += 1
            self.held += n
            b.used += n

    def release(self, n: int) -> None:
        """``n`` held bytes left memory (written out, or dropped); more than is held counts as
        all of it."""
        if n <= 0 or not self.held:
            return
        b = self.budget
        if n > self.held:
            n = self.held
        self.held -= n
        b.used -= n
        if not self.held:
            b.holders -= 1
        if b._waiting:
            if b.used * 4 <= b.limit * 3:  # drained to three quarters: everyone reads again
                b._wake(list(b._waiting))
            elif self in b._waiting and self.held * b.holders < b.limit:  # under its share
                b._wake([self])

    def release_all(self) -> None:
        """The connection is gone: nothing of it is held, and it waits for nothing."""
        self.budget._waiting.pop(self, None)
        self.release(self.held)

    def must_wait(self) -> bool:
        """Whether the connection must not be read now (past the budget, holding at least its
        share); if so it is resumed later."""
        b = self.budget
        if b.used < b.limit or self.held * b.holders < b.limit:
            return False
        if self not in b._waiting:
            b._waiting[self] = None
            b.waits += 1
        return True
