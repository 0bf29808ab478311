"""``ztunnel top``: a live view of a running ztunnel's connections, from its admin port.

It polls ``GET /debug/connections`` (see :mod:`ztunnel.admin.live`) every ``--interval`` seconds
and shows one row per live connection: direction, proxy (the pod), source and destination,
identities, protocol, age, bytes each way and the rates since the previous poll, with totals
above. Sorted by ``--sort`` (age, rate, bytes, src, dst; ``s`` cycles, ``r`` reverses) and
filtered by ``--filter`` (a case-insensitive substring of any field; ``/`` edits it, ``q``
quits). ``--once`` prints one table (or ``--json`` the rows) and exits, for scripts.

Rendering is pure (:func:`render`); the terminal loop is a thin shell around it. A client of the
admin port only: it imports nothing of the proxy.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import select
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

Row = dict[str, Any]

SORT_KEYS = ("age", "rate", "bytes", "src", "dst")
COLUMNS = (
    ("DIRECTION", 9),
    ("PROXY", 18),
    ("SOURCE", 22),
    ("DESTINATION", 22),
    ("SRC IDENTITY", 36),
    ("DST IDENTITY", 36),
    ("PROTO", 5),
    ("AGE", 7),
    ("SENT", 8),
    ("RECV", 8),
    ("TX/s", 8),
    ("RX/s", 8),
)


class AdminError(Exception):
    pass


def fetch(admin: str, timeout: float = 5.0) -> list[Row]:
    """The live connections from ``host:port``'s ``/debug/connections``."""
    host, _, port = admin.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/debug/connections")
        resp = conn.getresponse()
        body = resp.read()
    except OSError as e:
        raise AdminError(f"cannot reach the admin port at {admin}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise AdminError(f"{admin}/debug/connections: HTTP {resp.status}: {body[:200]!r}")
    rows: list[Row] = json.loads(body)["connections"]
    return rows


@dataclass
class Rates:
    """Bytes per second of each connection between two polls, by connection id."""

    _last: dict[str, tuple[float, int, int]] = field(default_factory=dict)

    def update(self, rows: Sequence[Row], now: float) -> None:
        seen: dict[str, tuple[float, int, int]] = {}
        for r in rows:
            sent, recv = int(r["bytesSent"]), int(r["bytesRecv"])
            prev = self._last.get(r["id"])
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                r["txRate"] = max(0.0, (sent - prev[1]) / dt)
                r["rxRate"] = max(0.0, (recv - prev[2]) / dt)
            else:
                r["txRate"] = r["rxRate"] = None
            seen[r["id"]] = (now, sent, recv)
        self._last = seen


def matches(row: Row, needle: str) -> bool:
    if not needle:
        return True
    n = needle.lower()
    return any(n in str(v).lower() for v in row.values() if v is not None)


def _sort_key(key: str) -> Callable[[Row], Any]:
    if key == "age":
        return lambda r: -float(r["ageSeconds"])
    if key == "rate":
        return lambda r: -((r.get("txRate") or 0.0) + (r.get("rxRate") or 0.0))
    if key == "bytes":
        return lambda r: -(int(r["bytesSent"]) + int(r["bytesRecv"]))
    if key in ("src", "dst"):
        return lambda r: str(r[key])
    raise ValueError(f"unknown sort key {key!r}; one of {', '.join(SORT_KEYS)}")


def select_rows(
    rows: Sequence[Row], *, needle: str = "", sort: str = "age", reverse: bool = False
) -> list[Row]:
    out = [r for r in rows if matches(r, needle)]
    out.sort(key=_sort_key(sort), reverse=reverse)
    return out


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # pragma: no cover


def human_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _cells(r: Row) -> list[str]:
    dst = r["dst"]
    if r.get("originalDst") and r["originalDst"] != dst:
        dst = f"{r['originalDst']}>{dst}"
    return [
        r["direction"],
        r["proxy"],
        r["src"],
        dst,
        r.get("srcIdentity") or "-",
        r.get("dstIdentity") or "-",
        r["protocol"],
        human_age(float(r["ageSeconds"])),
        human_bytes(int(r["bytesSent"])),
        human_bytes(int(r["bytesRecv"])),
        human_bytes(r.get("txRate")),
        human_bytes(r.get("rxRate")),
    ]


def render(
    rows: Sequence[Row],
    *,
    width: int = 0,
    title: str | None = None,
) -> list[str]:
    """The table: an optional title line, the header, one line per row. Columns are as wide as
    their content (at least the header); ``width`` > 0 truncates each line to it."""
    cells = [_cells(r) for r in rows]
    widths = [len(name) for name, _ in COLUMNS]
    for line in cells:
        for i, c in enumerate(line):
            widths[i] = max(widths[i], len(c))
    lines = []
    if title is not None:
        lines.append(title)
    for line in ([name for name, _ in COLUMNS], *cells):
        text = "  ".join(c.ljust(widths[i]) for i, c in enumerate(line)).rstrip()
        lines.append(text[:width] if width > 0 else text)
    return lines


def summary(rows: Sequence[Row], shown: int, admin: str, sort: str, needle: str) -> str:
    tx = sum(r.get("txRate") or 0.0 for r in rows)
    rx = sum(r.get("rxRate") or 0.0 for r in rows)
    inbound = sum(1 for r in rows if r["direction"] == "inbound")
    parts = [
        f"ztunnel top - {admin}",
        f"{len(rows)} connections ({inbound} in, {len(rows) - inbound} out), {shown} shown",
        f"tx {human_bytes(tx)}/s rx {human_bytes(rx)}/s",
        f"sort={sort}",
    ]
    if needle:
        parts.append(f"filter={needle!r}")
    return "  |  ".join(parts) + "    [q]uit [s]ort [r]everse [/]filter"


# --- the terminal loop ------------------------------------------------------------------------


@contextlib.contextmanager
def _cbreak(stream: TextIO) -> Iterator[bool]:
    """Single-key input while inside; yields whether keys can be read at all (a terminal)."""
    if not stream.isatty():
        yield False
        return
    import termios
    import tty

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _key(timeout: float) -> str | None:
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    if not ready:
        return None
    return os.read(sys.stdin.fileno(), 1).decode(errors="replace")


def _read_line(prompt: str, out: TextIO) -> str:
    out.write(f"\x1b[2K\r{prompt}")
    out.flush()
    buf = ""
    while True:
        ch = os.read(sys.stdin.fileno(), 1).decode(errors="replace")
        if ch in ("\n", "\r"):
            return buf
        if ch in ("\x7f", "\b"):
            buf = buf[:-1]
        elif ch == "\x1b":
            return ""
        else:
            buf += ch
        out.write(f"\x1b[2K\r{prompt}{buf}")
        out.flush()


def run_live(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    rates = Rates()
    sort, reverse, needle = args.sort, args.reverse, args.filter
    with _cbreak(sys.stdin) as interactive:
        out.write("\x1b[?25l")  # hide the cursor
        try:
            while True:
                started = time.monotonic()
                try:
                    rows = fetch(args.admin)
                    rates.update(rows, started)
                    shown = select_rows(rows, needle=needle, sort=sort, reverse=reverse)
                    size = shutil.get_terminal_size()
                    lines = render(shown[: max(0, size.lines - 3)], width=size.columns)
                    head = summary(rows, len(shown), args.admin, sort, needle)[: size.columns]
                except AdminError as e:
                    head, lines = str(e), []
                out.write("\x1b[H\x1b[2J" + head + "\n" + "\n".join(lines) + "\n")
                out.flush()
                deadline = started + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    if not interactive:
                        time.sleep(left)
                        break
                    key = _key(left)
                    if key is None:
                        break
                    if key == "q":
                        return 0
                    if key == "s":
                        sort = SORT_KEYS[(SORT_KEYS.index(sort) + 1) % len(SORT_KEYS)]
                        break
                    if key == "r":
                        reverse = not reverse
                        break
                    if key == "/":
                        needle = _read_line("filter: ", out)
                        break
        except KeyboardInterrupt:
            return 0
        finally:
            out.write("\x1b[?25h")
            out.flush()


def run_once(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        rows = fetch(args.admin)
    except AdminError as e:
        print(f"ztunnel top: {e}", file=sys.stderr)
        return 1
    shown = select_rows(rows, needle=args.filter, sort=args.sort, reverse=args.reverse)
    if args.json:
        out.write(json.dumps(shown, indent=1) + "\n")
    else:
        out.write("\n".join(render(shown)) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin",
        default=os.environ.get("ZTUNNEL_ADMIN", "127.0.0.1:15000"),
        help="the ztunnel admin address, host:port (default 127.0.0.1:15000; env ZTUNNEL_ADMIN)",
    )
    p.add_argument("--once", action="store_true", help="print one table and exit (for scripts)")
    p.add_argument("--json", action="store_true", help="with --once: the rows as JSON")
    p.add_argument("--filter", default="", help="show connections with this text in any field")
    p.add_argument("--sort", choices=SORT_KEYS, default="age", help="sort key (default age)")
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")


def main(args: argparse.Namespace) -> int:
    if args.once or args.json:
        return run_once(args)
    return run_live(args)
