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
