"""Benchmark HTTP/2 framing for HBONE in memory: ztunnel.hbone.h2conn against the ``h2`` library.

Usage: ``python benchmarks/bench_h2conn.py [--mib 256] [--runs 3] [--frames 16,64,256]
[--feed joined,16k] [--impls ours,h2,h2patched]``

One CONNECT stream; the client pushes ``--mib`` MiB to the server in 256 KiB application writes
(the size of a socket read); no sockets, no TLS, both ends on one core. The server acknowledges
every DataReceived at once, and its WINDOW_UPDATEs go back to the client. Windows are ztunnel's:
4 MiB per stream, 16 MiB per connection. ``--frames`` is the DATA frame size the sender uses (KiB).

Feeds: ``joined``: each batch of client output is joined into one ``bytes`` (the copy a TLS
encrypt would make anyway) and fed to the server whole. ``16k``: the same bytes fed in 16 KiB
memoryview slices (no copy), the way ``SSLObject.read`` returns at most one TLS record per call.

``h2patched`` is the h2 library with ``hyperframe.frame._raw_data_repr`` replaced by a constant
(h2 evaluates repr(frame) on every received frame, which hex-encodes the whole DATA payload).
Integrity is checked first for every configuration (16 MiB, adler32 of what the server received);
the timed runs then skip the checksum. Time is CPU time (``time.process_time``) of the process,
so other load on the machine inflates it less than wall time would. Each configuration runs
``--runs`` times, interleaved; the table gives the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ztunnel.hbone import h2conn  # noqa: E402

KiB = 1024
MiB = 1024 * 1024
WRITE = 256 * KiB
STREAM_WINDOW = 4 * MiB
CONN_WINDOW = 16 * MiB


def _payload() -> bytes:
    # Not all zeros, so a mis-sliced payload changes the checksum.
    return bytes(range(256)) * (WRITE // 256)


def _feeder(mode: str) -> Callable[[bytes], list[memoryview | bytes]]:
    if mode == "joined":
        return lambda b: [b]

    def split(b: bytes) -> list[memoryview | bytes]:
        mv = memoryview(b)
        return [mv[i : i + 16 * KiB] for i in range(0, len(b), 16 * KiB)]

    return split


def run_ours(total: int, frame: int, feed: str, verify: bool) -> tuple[float, int]:
    """CPU seconds to move ``total`` bytes, and the adler32 the server computed (if verify)."""
    C = h2conn
    c = C.H2Connection(True, send_frame_size=frame)
    s = C.H2Connection(False, send_frame_size=frame)
    split = _feeder(feed)
    s.receive_data(c.data_to_send_bytes())
    c.receive_data(s.data_to_send_bytes())
    s.receive_data(c.data_to_send_bytes())
    sid = c.open_stream(
        "10.0.0.1:8080", [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-00")]
    )
    s.receive_data(c.data_to_send_bytes())
    s.send_response(sid, 200)
    c.receive_data(s.data_to_send_bytes())

    chunk = _payload()
    received = 0
    checksum = 1
    sent = 0
    pending: memoryview | bytes = b""
    DataReceived = C.DataReceived
    ack = s.acknowledge_received_data
    t0 = time.process_time()
    while received < total:
        if not pending and sent < total:
            pending = chunk
        if pending:
            n = c.send_data(sid, pending)
            sent += n
            pending = memoryview(pending)[n:] if n < len(pending) else b""
        wire = b"".join(c.data_to_send())
        if wire:
            for piece in split(wire):
                for ev in s.receive_data(piece):
                    if type(ev) is DataReceived:
                        if verify:
                            checksum = zlib.adler32(ev.data, checksum)
                        received += ev.flow_controlled_length
                        ack(ev.stream_id, ev.flow_controlled_length)
        back = s.data_to_send()
        if back:
            c.receive_data(b"".join(back))
    return time.process_time() - t0, checksum


def run_h2(total: int, frame: int, feed: str, verify: bool, patched: bool) -> tuple[float, int]:
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings
    import hyperframe.frame as hf

    def quiet_repr(data: bytes | None) -> str:
        return "<data>"

    original = hf._raw_data_repr
    if patched:
        hf._raw_data_repr = quiet_repr
    try:
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        s = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        for conn in (c, s):
            conn.initiate_connection()
            conn.update_settings(
                {
                    h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                    h2.settings.SettingCodes.MAX_FRAME_SIZE: max(frame, 16 * KiB),
                }
            )
            conn.increment_flow_control_window(CONN_WINDOW - 65535)
        split = _feeder(feed)
        s.receive_data(c.data_to_send())
        c.receive_data(s.data_to_send())
        s.receive_data(c.data_to_send())
        c.receive_data(s.data_to_send())
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, [(":method", "CONNECT"), (":authority", "10.0.0.1:8080")])
        s.receive_data(c.data_to_send())
        s.send_headers(sid, [(":status", "200")])
        c.receive_data(s.data_to_send())

        chunk = _payload()
        received = 0
        checksum = 1
        sent = 0
        pending: memoryview | bytes = b""
        t0 = time.process_time()
        while received < total:
            if not pending and sent < total:
                pending = memoryview(chunk)
            while pending:
                window = min(c.local_flow_control_window(sid), c.max_outbound_frame_size, frame)
                if window <= 0:
                    break
                piece = pending[:window]
                c.send_data(sid, piece)
                sent += len(piece)
                pending = pending[len(piece) :]
            wire = c.data_to_send()
            if wire:
                for part in split(wire):
                    for ev in s.receive_data(part):
                        if isinstance(ev, h2.events.DataReceived):
                            if verify:
                                checksum = zlib.adler32(ev.data, checksum)
                            received += ev.flow_controlled_length
                            s.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            back = s.data_to_send()
            if back:
                c.receive_data(back)
        return time.process_time() - t0, checksum
    finally:
        hf._raw_data_repr = original


def expected_checksum(total: int) -> int:
    chunk = _payload()
    checksum = 1
    for _ in range(total // len(chunk)):
        checksum = zlib.adler32(chunk, checksum)
    return checksum


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--frames", default="16,64,256", help="DATA frame sizes in KiB")
    ap.add_argument("--feed", default="joined,16k")
    ap.add_argument("--impls", default="ours,h2,h2patched")
    args = ap.parse_args(argv)
    total = args.mib * MiB
    if total % WRITE:
        ap.error("--mib must be a multiple of 0.25")
    impls: dict[str, Callable[[int, int, str, bool], tuple[float, int]]] = {
        "ours": run_ours,
        "h2": lambda t, f, m, v: run_h2(t, f, m, v, False),
        "h2patched": lambda t, f, m, v: run_h2(t, f, m, v, True),
    }
    names = args.impls.split(",")
    frames = [int(x) * KiB for x in args.frames.split(",")]
    feeds = args.feed.split(",")
    # Integrity first (checksummed, not timed), then the timed runs (no checksum in the loop).
    check_total = 16 * MiB
    want = expected_checksum(check_total)
    for feed in feeds:
        for frame in frames:
            for name in names:
                if impls[name](check_total, frame, feed, True)[1] != want:
                    raise SystemExit(f"checksum mismatch: {name} feed={feed} frame={frame}")
    results: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.runs):
        for feed in feeds:
            for frame in frames:
                for name in names:
                    secs, _ = impls[name](total, frame, feed, False)
                    gbit = total * 8 / secs / 1e9
                    results.setdefault((name, feed, frame), []).append(gbit)
                    print(
                        f"  {name:10} feed={feed:6} frame={frame // KiB:4}K {gbit:6.2f} Gbit/s",
                        file=sys.stderr,
                        flush=True,
                    )
    print(
        f"\n{args.mib} MiB per run, median of {args.runs}; Gbit/s per CPU-second of the one"
        " process doing both ends (all runs in brackets)\n"
    )
    header = "| feed | frame | " + " | ".join(names) + " |"
    print(header)
    print("|" + "---|" * (len(names) + 2))
    for feed in feeds:
        for frame in frames:
            cells: list[Any] = []
            for name in names:
                runs = results[(name, feed, frame)]
                cells.append(
                    f"**{statistics.median(runs):.2f}** ({', '.join(f'{r:.2f}' for r in runs)})"
                )
            print(f"| {feed} | {frame // KiB} KiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
