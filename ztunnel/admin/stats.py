"""Stats (15020): ``/metrics`` and ``/stats/prometheus`` from one registry.

Text format 0.0.4 by default; OpenMetrics 1.0.0 when ``Accept`` names
``application/openmetrics-text`` (istio/ztunnel ``src/metrics/server.rs``); gzip when the client
accepts it. One scrape at a time; by default the body is encoded on the loop one 64 KiB chunk per
loop turn, so a large registry never stalls the loop for the whole encode, and it is written
piecewise (see benchmarks/bench_metrics.py for the stall figures of each mode).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from typing import Literal

from prometheus_client import CollectorRegistry

from ztunnel.admin.http import Request, Response
from ztunnel.metrics import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    encode_chunks,
    encode_chunks_async,
    wants_openmetrics,
)

METRICS_PATHS = frozenset({"/metrics", "/stats/prometheus"})
GZIP_MIN_BYTES = 1024


def gzip_accepted(accept_encoding: str | None) -> bool:
    """Whether ``Accept-Encoding`` allows gzip (``q=0`` refuses it)."""
    if not accept_encoding:
        return False
    for member in accept_encoding.split(","):
        coding, _, params = member.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip"):
            continue
        q = params.strip().lower()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0
            except ValueError:
                return False
        return True
    return False


def _gzip(chunks: list[bytes]) -> list[bytes]:
    # Streamed gzip (wbits=31), chunk by chunk: zlib releases the GIL while it compresses.
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = [z.compress(c) for c in chunks]
    out.append(z.flush())
    return [c for c in out if c]


def _wants_gzip(chunks: list[bytes], compress: bool) -> bool:
    return compress and sum(len(c) for c in chunks) >= GZIP_MIN_BYTES


def render_sync(
    registry: CollectorRegistry, openmetrics: bool, compress: bool, *, yield_gil: bool = False
) -> tuple[list[bytes], bool]:
    chunks = encode_chunks(registry, openmetrics=openmetrics, yield_gil=yield_gil)
    if _wants_gzip(chunks, compress):
        return _gzip(chunks), True
    return chunks, False


async def render_cooperative(
    registry: CollectorRegistry, openmetrics: bool, compress: bool
) -> tuple[list[bytes], bool]:
    chunks = await encode_chunks_async(registry, openmetrics=openmetrics)
    if not _wants_gzip(chunks, compress):
        return chunks, False
    # zlib drops the GIL while it compresses, so a worker thread really runs beside the loop.
    return await asyncio.to_thread(_gzip, chunks), True


RenderMode = Literal["cooperative", "thread", "inline"]


class StatsHandler:
    """Serves the registry.

    ``mode`` says where the encoding runs: ``cooperative`` (default) on the loop, one 64 KiB
    chunk per loop turn, with gzip (if asked for) in a worker thread; ``thread`` all in a worker
    thread that yields the GIL after each chunk; ``inline`` on the loop in one go (small
    registries, tests). See benchmarks/bench_metrics.py.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        mode: RenderMode = "cooperative",
        gather: Callable[[], Awaitable[CollectorRegistry]] | None = None,
    ) -> None:
        self.registry = registry
        self.mode = mode
        # With data-plane workers: the registry of one scrape, their series added.
        self.gather = gather
        self._lock = asyncio.Lock()  # one encode at a time

    async def _render(self, om: bool, compress: bool) -> tuple[list[bytes], bool]:
        registry = self.registry if self.gather is None else await self.gather()
        if self.mode == "cooperative":
            return await render_cooperative(registry, om, compress)
        if self.mode == "thread":
            return await asyncio.to_thread(render_sync, registry, om, compress, yield_gil=True)
        return render_sync(registry, om, compress)

    async def __call__(self, req: Request) -> Response:
        if req.path not in METRICS_PATHS:
            return Response.empty(404)
        if req.method not in ("GET", "HEAD"):
            return Response.empty(405)
        om = wants_openmetrics(req.header("accept"))
        compress = gzip_accepted(req.header("accept-encoding"))
        async with self._lock:
            body, gzipped = await self._render(om, compress)
        resp = Response(200, body, OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE)
        if gzipped:
            resp.headers.append(("content-encoding", "gzip"))
        resp.headers.append(("vary", "accept-encoding"))
        return resp
