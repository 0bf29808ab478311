"""Stats (15020): ``/metrics`` and ``/stats/prometheus`` from one registry.

As istio/ztunnel ``src/metrics/server.rs`` serves them: the body is always OpenMetrics text (what
prometheus-client writes, ``# EOF`` last), labelled ``text/plain; charset=utf-8`` unless the
client's ``Accept`` names ``application/openmetrics-text``; compressed as tower-http's
``CompressionLayer`` does (:func:`choose_encoding`: by ``Accept-Encoding`` q-value, bodies of at
least 32 bytes) with gzip, deflate and zstd; not br (Rust's fourth): see ``COMPRESSORS``.

One scrape at a time; by default the body is encoded on the loop one 64 KiB chunk per loop
turn, so a large registry never stalls the loop for the whole encode, and it is written
piecewise (see benchmarks/bench_metrics.py for the stall figures of each mode).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

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
COMPRESS_MIN_BYTES = 32  # tower-http's SizeAbove::DEFAULT_MIN_SIZE (compressed when >= 32 B)

# --- content coding (tower-http content_encoding.rs) -------------------------------------------

IDENTITY = "identity"
# Least to most preferred: a q-value tie goes to the later one (tower-http's Encoding order).
PREFERENCE = ("identity", "deflate", "gzip", "br", "zstd")


def _parse_coding(token: str, supported: frozenset[str]) -> str | None:
    t = token.lower()
    if t in ("gzip", "x-gzip"):
        t = "gzip"
    if t == IDENTITY or t in supported:
        return t
    return None


def parse_qvalue(text: str) -> int | None:
    """An RFC 9110 q-value as thousandths (``q=0.5`` -> 500), or None when malformed: ``q`` or
    ``Q``, ``=``, then 0 or 1 and at most three decimals, at most 1 (tower-http
    ``QValue::parse``)."""
    if len(text) < 3 or text[0] not in "qQ" or text[1] != "=":
        return None
    digits = text[2:]
    if digits[0] not in "01":
        return None
    value = 1000 if digits[0] == "1" else 0
    if len(digits) == 1:
        return value
    if digits[1] != "." or len(digits) > 5 or not all(c in "0123456789" for c in digits[2:]):
        return None
    for i, c in enumerate(digits[2:]):
        value += (100, 10, 1)[i] * (ord(c) - 48)
    return value if value <= 1000 else None


def choose_encoding(accept_encoding: Iterable[str], supported: Iterable[str]) -> str | None:
    """The content coding for a response (tower-http ``Encoding::from_headers``): every
    ``Accept-Encoding`` header's members (unknown codings and malformed q-values ignored) and a
    ``*`` member's q-value for the supported codings not named; the highest q-value above 0
    wins, ties to the most preferred (zstd, br, gzip, deflate, identity). ``identity`` when
    nothing is asked for; None when nothing acceptable remains (RFC 9110: 406)."""
    sup = frozenset(supported)
    explicit: list[tuple[str, int]] = []
    wildcard: int | None = None
    for value in accept_encoding:
        for member in value.split(","):
            coding, sep, params = member.partition(";")
            coding = coding.strip()
            q = parse_qvalue(params.strip()) if sep else 1000
            if q is None:
                continue
            if coding == "*":
                if wildcard is None:
                    wildcard = q
                continue
            enc = _parse_coding(coding, sup)
            if enc is not None:
                explicit.append((enc, q))

    def best(candidates: Iterable[tuple[str, int]]) -> str | None:
        ranked = [(q, PREFERENCE.index(e), e) for e, q in candidates if q > 0]
        return max(ranked)[2] if ranked else None

    if wildcard is None:
        got = best(explicit)
        if got is not None:
            return got
        refused = any(e == IDENTITY and q == 0 for e, q in explicit)
        return None if refused else IDENTITY
    effective = []
    for enc in (IDENTITY, *(e for e in PREFERENCE if e in sup)):
        q = next((q for e, q in explicit if e == enc), wildcard)
        effective.append((enc, q))
    return best(effective)


# CPU per scrape of 40,000 series (a 36.9 MB body; benchmarks/bench_metrics.py, median of 3):
# encoding 55 ms; then gzip level 1 86 ms (1.26 MB), level 6 214 ms (0.87 MB), zstd level 3
# 27 ms (0.28 MB), brotli quality 4 113 ms (0.26 MB).


def _zlib(wbits: int) -> Callable[[], Any]:
    # Level 1, not zlib's default 6 (tower-http's): 2.5x less CPU for a body 45% larger; any
    # level decodes the same.
    return lambda: zlib.compressobj(1, zlib.DEFLATED, wbits)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # (its package is not there)
        return False


# Python 3.14's compression.zstd, else its backport (a dependency below 3.14); imported with the
# first zstd scrape only.
_ZSTD_MODULE = next((m for m in ("compression.zstd", "backports.zstd") if _found(m)), None)


def _zstd() -> Any:
    assert _ZSTD_MODULE is not None
    # Level 3: zstd's default, as tower-http's; a third of gzip's CPU, a quarter of its bytes.
    return importlib.import_module(_ZSTD_MODULE).ZstdCompressor(level=3)


# coding -> a factory of objects with compress(bytes) and flush(): gzip and deflate (the zlib
# format, as tower-http's ZlibEncoder) from the standard library, zstd where its module is.
# No br: brotli at tower-http's quality 4 costs more CPU than gzip, it would be a dependency, and
# the clients that accept br accept gzip or zstd too (Prometheus asks for gzip only).
COMPRESSORS: dict[str, Callable[[], Any]] = {"gzip": _zlib(31), "deflate": _zlib(15)}
if _ZSTD_MODULE is not None:
    COMPRESSORS["zstd"] = _zstd


def compress(chunks: list[bytes], coding: str) -> list[bytes]:
    """``chunks`` compressed as one stream, chunk by chunk (zlib releases the GIL while it
    compresses, so this runs beside the loop in a worker thread)."""
    z = COMPRESSORS[coding]()
    out = [z.compress(c) for c in chunks]
    out.append(z.flush())
    return [c for c in out if c]


def _should_compress(chunks: list[bytes]) -> bool:
    return sum(len(c) for c in chunks) >= COMPRESS_MIN_BYTES


def render_sync(
    registry: CollectorRegistry, coding: str, *, yield_gil: bool = False
) -> tuple[list[bytes], str]:
    """The body and the coding it is in (identity when it is too small to compress)."""
    chunks = encode_chunks(registry, yield_gil=yield_gil)
    if coding == IDENTITY or not _should_compress(chunks):
        return chunks, IDENTITY
    return compress(chunks, coding), coding


async def render_cooperative(registry: CollectorRegistry, coding: str) -> tuple[list[bytes], str]:
    chunks = await encode_chunks_async(registry)
    if coding == IDENTITY or not _should_compress(chunks):
        return chunks, IDENTITY
    return await asyncio.to_thread(compress, chunks, coding), coding


RenderMode = Literal["cooperative", "thread", "inline"]


class StatsHandler:
    """Serves the registry.

    ``mode`` says where the encoding runs: ``cooperative`` (default) on the loop, one 64 KiB
    chunk per loop turn, with compression (if asked for) in a worker thread; ``thread`` all in a
    worker thread that yields the GIL after each chunk; ``inline`` on the loop in one go (small
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

    async def _render(self, coding: str) -> tuple[list[bytes], str]:
        registry = self.registry if self.gather is None else await self.gather()
        if self.mode == "cooperative":
            return await render_cooperative(registry, coding)
        if self.mode == "thread":
            return await asyncio.to_thread(render_sync, registry, coding, yield_gil=True)
        return render_sync(registry, coding)

    async def __call__(self, req: Request) -> Response:
        coding = choose_encoding((v for k, v in req.headers if k == "accept-encoding"), COMPRESSORS)
        if req.path not in METRICS_PATHS:
            resp = Response.empty(404)
        else:  # (any method: Rust's handle_metrics does not look at it)
            async with self._lock:
                body, used = await self._render(coding or IDENTITY)
            om = wants_openmetrics(v for k, v in req.headers if k == "accept")
            resp = Response(200, body, OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE)
            if used != IDENTITY:
                resp.headers.append(("content-encoding", used))
            resp.headers.append(("vary", "accept-encoding"))  # (every body here is >= 32 B)
        if coding is None:
            # tower-http: no acceptable coding is 406, the response otherwise as it was
            resp.status = 406
            if not any(k == "vary" for k, _ in resp.headers):
                resp.headers.append(("vary", "accept-encoding"))
        return resp
