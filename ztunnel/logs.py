"""Logging in ztunnel's shape: ``RUST_LOG``-style level directives, plain text or JSON lines,
on stdout as Rust's ``src/telemetry.rs`` writes them.

Records may carry structured fields in ``extra={"fields": {...}}``; they are rendered as
``key=value`` pairs (plain) or JSON members, the way ztunnel's tracing output looks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
logging.addLevelName(5, "TRACE")

# Python logger names for the targets users name in RUST_LOG.
_TARGET_ALIASES = {"ztunnel": "ztunnel", "access": "access"}


def parse_directives(spec: str) -> tuple[int, dict[str, int]]:
    """``"info,access=debug,ztunnel::proxy=trace"`` -> (root level, {logger: level}).

    Raises ValueError on an unknown level."""
    root = logging.INFO
    targets: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        target, sep, level = part.partition("=")
        if not sep:
            target, level = "", target
        lvl = _LEVELS.get(level.strip().lower())
        if lvl is None:
            raise ValueError(f"unknown log level {level!r} in {spec!r}")
        if not target:
            root = lvl
        else:
            name = target.strip().replace("::", ".")
            targets[_TARGET_ALIASES.get(name, name)] = lvl
    return root, targets


def apply_directives(spec: str) -> None:
    root, targets = parse_directives(spec)
    logging.getLogger().setLevel(root)
    for name in list(logging.root.manager.loggerDict):
        lg = logging.getLogger(name)
        if name.startswith(("ztunnel", "access")):
            lg.setLevel(logging.NOTSET)
    for name, lvl in targets.items():
        logging.getLogger(name).setLevel(lvl)


def level_name(level: int) -> str:
    """The RUST_LOG spelling of a Python level (``warn``, not ``warning``); non-standard levels
    round up to the next named one."""
    for name in ("trace", "debug", "info", "warn", "error", "off"):
        if level <= _LEVELS[name]:
            return name
    return "off"


def _target_name(logger_name: str) -> str:
    return logger_name.replace(".", "::")


def format_directives(root: int, targets: dict[str, int]) -> str:
    """The inverse of :func:`parse_directives`, in tracing's display order: targets (sorted),
    then the default level, e.g. ``access=debug,ztunnel::proxy=trace,info``."""
    parts = [f"{_target_name(n)}={level_name(lvl)}" for n, lvl in sorted(targets.items())]
    parts.append(level_name(root))
    return ",".join(parts)


def current_directives(extra_loggers: tuple[str, ...] | frozenset[str] = ()) -> str:
    """The levels in force, as a directive string: the root level, every ``ztunnel``/``access``
    logger with an explicit level, and any of ``extra_loggers`` that has one."""
    targets: dict[str, int] = {}
    wanted = set(extra_loggers)
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if not isinstance(lg, logging.Logger) or lg.level == logging.NOTSET:
            continue
        if name.startswith(("ztunnel", "access")) or name in wanted:
            targets[name] = lg.level
    return format_directives(logging.getLogger().level, targets)


def log_fields(logger: logging.Logger, level: int, msg: str, fields: dict[str, object]) -> None:
    """``logger.log(level, msg, extra={"fields": fields})`` for the per-connection access log,
    without ``Logger._log``'s caller lookup and ``extra`` merging: the record is built by the
    record factory and handed to ``logger.handle`` (level check, filters and handlers as usual).
    The caller shown is ``(unknown file)``, as with :func:`setup`'s ``logging._srcfile = None``;
    neither format prints it."""
    if not logger.isEnabledFor(level):
        return
    record = logging.getLogRecordFactory()(
        logger.name, level, "(unknown file)", 0, msg, (), None, "(unknown function)", None
    )
    record.fields = fields
    logger.handle(record)


_second: tuple[int, str] = (-1, "")  # the last whole second formatted, and its text


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 UTC with microseconds, as tracing prints it (``LogRecord.msecs`` has only
    milliseconds)."""
    global _second
    sec, micros = divmod(int(record.created * 1_000_000), 1_000_000)
    cached = _second  # one tuple, replaced whole: safe if another thread logs too
    if cached[0] != sec:  # (strftime + gmtime for every line was ~10% of formatting one)
        cached = _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{cached[1]}.{micros:06d}Z"


_LEVEL_TEXT: dict[int, str] = {}


def _rust_level(record: logging.LogRecord) -> str:
    """The level as tracing spells it: ``warn``, not ``warning``."""
    text = _LEVEL_TEXT.get(record.levelno)
    if text is None:
        n = record.levelno
        text = level_name(n) if n < logging.CRITICAL else "error"
        if len(_LEVEL_TEXT) < 64:
            _LEVEL_TEXT[n] = text
    return text


def _fmt_value(v: object) -> str:
    s = str(v)
    if not s or any(c in s for c in ' ="'):
        return json.dumps(s)
    return s


class PlainFormatter(logging.Formatter):
    """Rust's plain lines (``IstioFormat::format_event``): time, level, target without the
    ``ztunnel::`` prefix (JSON's ``scope`` keeps it), message and fields, tab-separated."""

    def format(self, record: logging.LogRecord) -> str:
        ts = _timestamp(record)
        name = record.name
        target = name[8:] if name.startswith("ztunnel.") else name
        line = f"{ts}\t{_rust_level(record)}\t{target.replace('.', '::')}\t{record.getMessage()}"
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_fmt_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        scope = "access" if record.name == "access" else record.name.replace(".", "::")
        fields = getattr(record, "fields", None)
        if (
            type(fields) is dict
            and fields
            and not record.exc_info
            and _RESERVED.isdisjoint(fields)
            and _ATOMS.issuperset(map(type, fields.values()))
        ):
            # The common case (every access-log line): the fixed members as text, then the
            # fields encoded on their own, spliced in (the same text as encoding the merged
            # dict: same members, same order, same separators).
            head = (
                f'{{"level": "{_rust_level(record)}", "time": "{_timestamp(record)}", '
                f'"scope": {_str(scope)}, "message": {_str(record.getMessage())}, '
            )
            return head + "".join(_encode_flat(fields, 0))[1:]
        out: dict[str, Any] = {
            "level": _rust_level(record),
            "time": _timestamp(record),
            "scope": scope,
            "message": record.getMessage(),
        }
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return _JSON.encode(out)


# json.dumps(out, default=str) with the encoder built once (dumps builds one per call when
# given any option).
_JSON = json.JSONEncoder(default=str)
_str = json.encoder.encode_basestring_ascii  # (what _JSON uses for strings: ensure_ascii)
# Fields whose values are all strings and numbers (an access-log line) go through the C
# encoder made once (JSONEncoder.encode makes a new one per call): no containers, so no
# circular-reference markers are needed; anything else takes the _JSON path.
_RESERVED = frozenset(("level", "time", "scope", "message", "exception"))
_ATOMS = frozenset((str, int, float, bool, type(None)))
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_encode_flat: Callable[[dict[str, Any], int], Iterable[str]] = (
    _c_make_encoder(None, str, _str, None, ": ", ", ", False, False, True)
    if _c_make_encoder is not None
    else lambda o, _level: _JSON.iterencode(o)
)


PIPE_BUF = 4096  # POSIX: writes up to this size to a pipe are atomic (Linux: 4096 bytes)
FLUSH_DELAY = 0.01  # how long a log line may wait for others to share its write


def _size(line: str) -> int:
    """The bytes ``line`` takes on the stream (UTF-8): its length when ASCII (every JSON line,
    nearly every plain one), else its encoded length."""
    return len(line) if line.isascii() else len(line.encode("utf-8", "backslashreplace"))


class BatchingHandler(logging.Handler):
    """Writes log lines to ``stream`` in batches, at most ``delay`` seconds after the first one.

    A line logged from the event loop's thread is buffered, and the buffer is written (one
    ``write`` + ``flush``, so one syscall) ``delay`` seconds later (10 ms by default; 0 means at
    the next iteration of the loop), as Rust's non-blocking writer batches what arrives while it
    writes. An access-log line per connection made a write per connection at a few thousand
    connections a second; now a write carries every line of 10 ms, up to ``max_buffer``. Lines
    logged with no running loop, from another thread, or once ``max_buffer`` characters are
    pending are written at once (with what is pending before them, in order). Nothing is lost on
    a clean exit or an unhandled exception: ``logging.shutdown`` (run at interpreter exit, and
    by the workers before they exit) flushes every handler; only a process killed outright loses
    the last ``delay`` of lines.

    Each write holds whole lines and at most ``PIPE_BUF`` bytes (unless one line alone is
    longer; a line that is not ASCII counts its UTF-8 bytes): writes that small to a pipe are
    atomic, so several processes sharing one stdout (the data-plane workers) never tear each
    other's lines."""

    def __init__(
        self, stream: TextIO, max_buffer: int = PIPE_BUF, delay: float = FLUSH_DELAY
    ) -> None:
        super().__init__()
        self.stream = stream
        self.max_buffer = max_buffer
        self.delay = delay
        self._lines: list[str] = []
        self._size = 0
        # The loop a flush is scheduled on (None: none is). A loop closed before its flush ran
        # (a short-lived one) must not keep the lines of the next loop waiting.
        self._scheduled: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += _size(line) + 1
        if self._size >= self.max_buffer:
            self._write()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing would flush it later
            self._write()
            return
        if self._scheduled is not loop:
            self._scheduled = loop
            if self.delay > 0:
                loop.call_later(self.delay, self.flush)
            else:
                loop.call_soon(self.flush)

    def flush(self) -> None:
        self.acquire()  # (an RLock: logging.shutdown holds it around flush and close)
        try:
            self._scheduled = None
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        if not self._lines:
            return
        lines, self._lines, self._size = self._lines, [], 0
        try:
            chunk: list[str] = []
            size = 0
            for line in lines:
                n = _size(line) + 1
                if chunk and size + n > PIPE_BUF:
                    self._put(chunk)
                    chunk, size = [], 0
                chunk.append(line)
                size += n
            self._put(chunk)
        except (OSError, ValueError):  # stdout closed or gone: nowhere left to say it
            pass

    def _put(self, lines: list[str]) -> None:
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.flush()
        super().close()


def setup(log_format: str, spec: str) -> None:
    # Neither format shows the caller, thread or process, so records need not look them up
    # (the logging HOWTO's "Optimization" switches): with an access-log line or two per
    # connection, the frame walk behind the caller alone was a few microseconds per line.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # stdout, as Rust's tracing writer (telemetry.rs): collectors that grade stderr lines as
    # errors would otherwise mark every access-log line as one.
    handler = BatchingHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if log_format == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    apply_directives(spec)


# --- log lines a peer can trigger --------------------------------------------------------------

_MAX_RATE_KEYS = 256


class RateLimitedLog:
    """Log lines a peer can trigger: at most one per key per interval, with a count of the
    rest in the next one."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last emitted, suppressed since)

    def log(self, level: int, key: str, msg: str, *args: Any) -> bool:
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is None and len(self._last) >= _MAX_RATE_KEYS:
            # Forget the oldest keys rather than grow with whatever a peer makes us log.
            for k in sorted(self._last, key=lambda k: self._last[k][0])[: _MAX_RATE_KEYS // 2]:
                del self._last[k]
        suppressed = last[1] if last is not None else 0
        if suppressed:
            msg += f" ({suppressed} more like this in the last {self.interval:.0f}s)"
        self._last[key] = (now, 0)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.INFO, key, msg, *args)

    def debug(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.DEBUG, key, msg, *args)
