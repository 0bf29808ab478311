"""How many file descriptors this process has open, for tests that check nothing leaks."""

from __future__ import annotations

import gc
import os


def open_fds() -> int:
    """The open fds of this process, once earlier garbage is collected: an object left in a
    reference cycle (a State holding its store's fds, say) closes its fds whenever the collector
    runs, which could otherwise happen between two counts."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))
