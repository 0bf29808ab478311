"""Log lines in tracing's shape: level names and timestamps."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import threading

import pytest

from ztunnel import logs
from ztunnel.logs import JsonFormatter, PlainFormatter

pytestmark = pytest.mark.timeout(30)


def _record(level: int, created: float = 1700000000.0625) -> logging.LogRecord:
    rec = logging.LogRecord("access", level, __file__, 1, "connection failed", (), None)
    rec.created = created
    rec.fields = {"src.addr": "10.0.0.1:1", "error": "no route"}
    return rec


@pytest.mark.parametrize(
    ("level", "name"),
    [(5, "trace"), (10, "debug"), (20, "info"), (30, "warn"), (40, "error"), (50, "error")],
)
def test_levels_are_spelled_as_tracing_does(level: int, name: str) -> None:
    assert json.loads(JsonFormatter().format(_record(level)))["level"] == name
    assert PlainFormatter().format(_record(level)).split("\t")[1].strip() == name


def test_timestamps_have_microseconds() -> None:
    out = json.loads(JsonFormatter().format(_record(logging.INFO)))
    assert out["time"] == "2023-11-14T22:13:20.062500Z"
    line = PlainFormatter().format(_record(logging.WARNING))
    assert re.fullmatch(
        r"2023-11-14T22:13:20\.062500Z\twarn\taccess\tconnection failed "
        r'src\.addr=10\.0\.0\.1:1 error="no route"',
        line,
    ), line


def test_plain_lines_drop_the_crate_prefix_of_the_target() -> None:
    # Rust IstioFormat::format_event: target.strip_prefix("ztunnel::"), the level unpadded.
    rec = logging.LogRecord("ztunnel.xds.client", logging.INFO, __file__, 1, "connected", (), None)
    rec.created = 1700000000.0625
    assert (
        PlainFormatter().format(rec) == "2023-11-14T22:13:20.062500Z\tinfo\txds::client\tconnected"
    )
    assert json.loads(JsonFormatter().format(rec))["scope"] == "ztunnel::xds::client"


def test_json_lines_are_the_merged_dict_encoded() -> None:
    # Flat fields (an access-log line) take a shortcut that must write exactly what encoding
    # the merged dict writes; other values (containers, objects) take the general path.
    class Obj:
        def __str__(self) -> str:
            return "obj"

    for fields in (
        {"src.addr": "10.0.0.1:1", "bytes_sent": 7, "ratio": 0.5, "ok": True, "none": None},
        {"error": 'quote " and ünïcode\n', "duration": "3ms"},
        {"nested": {"a": [1, 2]}, "x": 1},
        {"who": Obj()},
        {"message": "a field that shadows the message"},
    ):
        rec = _record(logging.INFO)
        rec.fields = fields
        merged = {
            "level": "info",
            "time": "2023-11-14T22:13:20.062500Z",
            "scope": "access",
            "message": "connection failed",
            **fields,
        }
        assert JsonFormatter().format(rec) == json.dumps(merged, default=str)


def test_log_fields_renders_as_logger_extra_fields() -> None:
    import io

    from ztunnel.logs import log_fields

    lg = logging.getLogger("access")
    fields: dict[str, object] = {
        "src.addr": "10.0.0.1:4321",
        "bytes_sent": 1,
        "direction": "outbound",
    }
    for formatter in (JsonFormatter(), PlainFormatter()):
        out = io.StringIO()
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
        lg.addHandler(handler)
        old_level, lg.level = lg.level, logging.INFO
        try:
            lg.info("connection complete", extra={"fields": fields})
            log_fields(lg, logging.INFO, "connection complete", fields)
            log_fields(lg, logging.DEBUG, "not shown", fields)  # below the level: nothing
        finally:
            lg.removeHandler(handler)
            lg.level = old_level
        a, b = out.getvalue().splitlines()
        if isinstance(formatter, JsonFormatter):
            ja, jb = json.loads(a), json.loads(b)
            ja.pop("time"), jb.pop("time")
            assert ja == jb
            assert list(ja) == ["level", "scope", "message", "src.addr", "bytes_sent", "direction"]
        else:
            assert a.split("\t", 1)[1] == b.split("\t", 1)[1]


# --- BatchingHandler -------------------------------------------------------------------------


class _Stream(io.StringIO):
    """Counts write calls: each is one syscall on a real stdout."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def _batching(stream: _Stream, delay: float = 0.0) -> logging.Logger:
    h = logs.BatchingHandler(stream, delay=delay)
    h.setFormatter(logging.Formatter("%(message)s"))
    lg = logging.getLogger(f"test.batching.{id(stream)}")
    lg.handlers[:] = [h]
    lg.propagate = False
    lg.setLevel(logging.INFO)
    return lg


async def test_batching_handler_writes_once_per_delay() -> None:
    """The default: every line logged within 10 ms shares one write (an access-log line per
    connection would otherwise be a write per connection)."""
    stream = _Stream()
    lg = _batching(stream, delay=logs.FLUSH_DELAY)
    for i in range(5):
        lg.info("line %d", i)
        await asyncio.sleep(0)  # other iterations of the loop: still nothing written
    assert stream.getvalue() == "" and stream.writes == 0
    await asyncio.sleep(logs.FLUSH_DELAY * 3)
    assert stream.getvalue() == "".join(f"line {i}\n" for i in range(5))
    assert stream.writes == 1
    lg.info("next")
    await asyncio.sleep(logs.FLUSH_DELAY * 3)
    assert stream.getvalue().endswith("line 4\nnext\n") and stream.writes == 2


def test_a_loop_closed_before_its_flush_does_not_hold_the_next_loops_lines() -> None:
    stream = _Stream()
    lg = _batching(stream, delay=logs.FLUSH_DELAY)

    async def log_and_leave() -> None:
        lg.info("first")  # its flush is scheduled on this loop, which closes before it runs

    async def log_and_wait() -> None:
        lg.info("second")
        await asyncio.sleep(logs.FLUSH_DELAY * 3)

    asyncio.run(log_and_leave())
    assert stream.getvalue() == ""
    asyncio.run(log_and_wait())
    assert stream.getvalue() == "first\nsecond\n" and stream.writes == 1


def test_the_default_handler_batches_by_delay() -> None:
    assert logs.BatchingHandler(io.StringIO()).delay == logs.FLUSH_DELAY > 0


async def test_batching_handler_writes_once_per_loop_iteration() -> None:
    """delay=0: the write comes at the next iteration of the loop."""
    stream = _Stream()
    lg = _batching(stream)
    for i in range(5):
        lg.info("line %d", i)
    assert stream.getvalue() == ""  # nothing yet: the write comes at the next iteration
    await asyncio.sleep(0)
    assert stream.getvalue() == "".join(f"line {i}\n" for i in range(5))
    assert stream.writes == 1
    lg.info("next")
    await asyncio.sleep(0)
    assert stream.getvalue().endswith("line 4\nnext\n") and stream.writes == 2


def test_batching_handler_writes_at_once_without_a_loop() -> None:
    stream = _Stream()
    lg = _batching(stream)
    lg.info("no loop")
    assert stream.getvalue() == "no loop\n"


async def test_batching_handler_bounds_its_buffer() -> None:
    stream = _Stream()
    lg = _batching(stream)
    lg.handlers[0].max_buffer = 100  # type: ignore[attr-defined]
    for _ in range(30):
        lg.info("x" * 9)  # 10 characters a line with its newline
    assert stream.writes == 3  # every 10 lines (100 characters), not once per line
    assert stream.getvalue() == ("x" * 9 + "\n") * 30
    await asyncio.sleep(0)
    assert stream.writes == 3  # nothing left over


async def test_batching_handler_flushes_on_shutdown_and_from_threads() -> None:
    stream = _Stream()
    lg = _batching(stream)
    lg.info("pending")
    t = threading.Thread(target=lg.info, args=("from a thread",))
    t.start()
    t.join()
    # the thread has no loop: its line is written at once, after what was pending
    assert stream.getvalue() == "pending\nfrom a thread\n"
    lg.info("last")
    lg.handlers[0].close()  # what logging.shutdown does at exit
    assert stream.getvalue() == "pending\nfrom a thread\nlast\n"


async def test_batching_handler_writes_are_pipe_atomic() -> None:
    """Whole lines, at most PIPE_BUF bytes per write: several processes can share one stdout
    pipe without tearing each other's lines."""
    stream = _Stream()
    lg = _batching(stream)
    lg.handlers[0].max_buffer = 1 << 20  # type: ignore[attr-defined]
    sizes: list[int] = []
    original = stream.write

    def write(s: str) -> int:
        sizes.append(len(s))
        assert s.endswith("\n")
        return original(s)

    stream.write = write  # type: ignore[method-assign]
    for i in range(1000):
        lg.info("%04d %s", i, "y" * 95)  # 100 characters a line
    await asyncio.sleep(0)
    assert max(sizes) <= logs.PIPE_BUF and sum(sizes) == 101 * 1000
    assert stream.getvalue().splitlines()[999] == "0999 " + "y" * 95


async def test_batching_handler_counts_bytes_not_characters() -> None:
    """A line that is not ASCII takes more bytes than characters on the pipe: the PIPE_BUF
    bound is in bytes (a write of 4096 characters of 2-byte text would be 8 KiB, not atomic)."""
    stream = _Stream()
    lg = _batching(stream)
    lg.handlers[0].max_buffer = 1 << 20  # type: ignore[attr-defined]
    sizes: list[int] = []
    original = stream.write

    def write(s: str) -> int:
        sizes.append(len(s.encode()))
        return original(s)

    stream.write = write  # type: ignore[method-assign]
    for i in range(200):
        lg.info("%04d %s", i, "é" * 95)  # 195 bytes a line with its newline
    await asyncio.sleep(0)
    assert max(sizes) <= logs.PIPE_BUF and sum(sizes) == 196 * 200
    assert len(sizes) == -(-200 // (logs.PIPE_BUF // 196))


def test_setup_logs_to_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rust's tracing writer is stdout (``src/telemetry.rs`` ``setup_logging``), and so is ours:
    nothing goes to stderr."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("json", "info")
        logging.getLogger("access").info("connection complete")
        logging.getLogger("ztunnel.test").warning("something")
        for h in root.handlers:
            h.flush()  # (what logging.shutdown does at exit)
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [(r["scope"], r["message"]) for r in lines] == [
            ("access", "connection complete"),
            ("ztunnel::test", "something"),
        ]
        assert err.getvalue() == ""
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_rate_limited_log_says_how_many_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    from ztunnel.logs import RateLimitedLog

    clock = [100.0]
    limited = RateLimitedLog(
        logging.getLogger("ztunnel.test.ratelimit"), interval=10.0, clock=lambda: clock[0]
    )
    with caplog.at_level(logging.WARNING, logger="ztunnel.test.ratelimit"):
        assert limited.warning("k", "bad input from %s", "a")
        assert not limited.warning("k", "bad input from %s", "b")
        assert not limited.warning("k", "bad input from %s", "c")
        assert limited.warning("other", "another kind")
        clock[0] += 11
        assert limited.warning("k", "bad input from %s", "d")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad input from a",
        "another kind",
        "bad input from d (2 more like this in the last 10s)",
    ]
