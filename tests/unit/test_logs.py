"""Log lines in tracing's shape: level names and timestamps."""

from __future__ import annotations

import json
import logging
import re

import pytest

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
        r"2023-11-14T22:13:20\.062500Z\twarn \taccess\tconnection failed "
        r'src\.addr=10\.0\.0\.1:1 error="no route"',
        line,
    ), line


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
