"""``ztunnel top``: rates between polls, filtering, sorting and the table (pure parts), and
``--once`` against a live admin handler."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from typing import Any

import pytest

from tests.unit.admin.test_servers import make_admin, serve
from ztunnel import top
from ztunnel.admin.live import connections as live_rows
from ztunnel.core.addr import SocketAddr
from ztunnel.core.identity import Identity

pytestmark = pytest.mark.timeout(30)


def row(i: str, **kw: Any) -> dict[str, Any]:
    base = {
        "id": i,
        "proxy": "default/c1",
        "direction": "outbound",
        "protocol": "HBONE",
        "src": "10.0.0.1:40000",
        "dst": "10.0.0.2:15008",
        "originalDst": "10.96.0.1:80",
        "hboneAddr": "10.0.0.2:8080",
        "srcIdentity": "spiffe://cluster.local/ns/default/sa/c1",
        "dstIdentity": "spiffe://cluster.local/ns/default/sa/s1",
        "srcWorkload": "default/c1",
        "dstWorkload": "default/s1",
        "dstService": "s1.default.svc.cluster.local",
        "ageSeconds": 1.0,
        "bytesSent": 0,
        "bytesRecv": 0,
    }
    return {**base, **kw}


def test_rates_between_polls() -> None:
    rates = top.Rates()
    first = [row("a", bytesSent=1000, bytesRecv=0)]
    rates.update(first, 10.0)
    assert first[0]["txRate"] is None  # no previous poll
    second = [row("a", bytesSent=3000, bytesRecv=500), row("b")]
    rates.update(second, 12.0)
    assert (second[0]["txRate"], second[0]["rxRate"]) == (1000.0, 250.0)
    assert second[1]["txRate"] is None  # new connection
    third = [row("b", bytesSent=10)]
    rates.update(third, 13.0)
    assert third[0]["txRate"] == 10.0  # "a" is gone and forgotten


def test_filter_and_sort() -> None:
    rows = [
        row("a", ageSeconds=5.0, bytesSent=10, src="10.0.0.9:1"),
        row("b", ageSeconds=9.0, bytesSent=99, src="10.0.0.1:1", direction="inbound"),
        row("c", ageSeconds=1.0, bytesSent=50, src="10.0.0.5:1", srcIdentity=None),
    ]
    assert [r["id"] for r in top.select_rows(rows)] == ["b", "a", "c"]  # oldest first
    assert [r["id"] for r in top.select_rows(rows, sort="bytes")] == ["b", "c", "a"]
    assert [r["id"] for r in top.select_rows(rows, sort="src")] == ["b", "c", "a"]
    assert [r["id"] for r in top.select_rows(rows, sort="age", reverse=True)] == ["c", "a", "b"]
    assert [r["id"] for r in top.select_rows(rows, needle="INBOUND")] == ["b"]
    assert [r["id"] for r in top.select_rows(rows, needle="10.0.0.5")] == ["c"]
    with pytest.raises(ValueError):
        top.select_rows(rows, sort="nope")


def test_render_table() -> None:
    lines = top.render([row("a", ageSeconds=75.0, bytesSent=2048, bytesRecv=3)], title="t")
    assert lines[0] == "t"
    assert lines[1].split()[:4] == ["DIRECTION", "PROXY", "SOURCE", "DESTINATION"]
    cells = lines[2].split()
    assert cells[:4] == ["outbound", "default/c1", "10.0.0.1:40000", "10.96.0.1:80>10.0.0.2:15008"]
    assert cells[6:] == ["HBONE", "1m15s", "2.0K", "3B", "-", "-"]
    assert all(len(ln) <= 40 for ln in top.render([row("a")], width=40))
    assert top.human_bytes(5 * 1024 * 1024) == "5.0M" and top.human_age(7300) == "2h01m"


class Rec:
    """A ConnectionRecord as /debug/connections reads it."""

    direction = "inbound"
    src = SocketAddr.parse("10.0.0.1:5000")
    dst = SocketAddr.parse("10.0.0.2:8080")
    orig_dst = None
    hbone_addr = SocketAddr.parse("10.0.0.2:8080")
    mtls = True
    double_hbone = False
    src_identity = Identity("cluster.local", "default", "c1")
    dst_identity = Identity("cluster.local", "default", "s1")
    src_workload = None
    dst_workload = None
    dst_service = None
    started = 0.0

    def live_bytes(self) -> tuple[int, int]:
        return (7, 11)


def test_debug_connections_rows() -> None:
    got = live_rows([("default/s1", [Rec()])])["connections"]
    assert len(got) == 1
    r = got[0]
    assert {k: r[k] for k in ("proxy", "direction", "protocol", "src", "dst", "srcIdentity")} == {
        "proxy": "default/s1",
        "direction": "inbound",
        "protocol": "HBONE",
        "src": "10.0.0.1:5000",
        "dst": "10.0.0.2:8080",
        "srcIdentity": "spiffe://cluster.local/ns/default/sa/c1",
    }
    assert (r["bytesSent"], r["bytesRecv"]) == (7, 11) and r["ageSeconds"] > 0


async def test_once_against_a_live_admin() -> None:
    srv = await serve(make_admin(live=lambda: [("default/s1", [Rec()])]))
    port = srv.port
    try:
        args = argparse.Namespace(
            admin=f"127.0.0.1:{srv.port}", filter="", sort="age", reverse=False, json=True
        )
        out = io.StringIO()
        rc = await asyncio.get_running_loop().run_in_executor(None, top.run_once, args, out)
        assert rc == 0
        [r] = json.loads(out.getvalue())
        assert r["srcIdentity"] == "spiffe://cluster.local/ns/default/sa/c1"
        args.json, args.filter = False, "nothing-matches"
        out = io.StringIO()
        await asyncio.get_running_loop().run_in_executor(None, top.run_once, args, out)
        assert out.getvalue().splitlines()[0].startswith("DIRECTION")
        assert len(out.getvalue().splitlines()) == 1
    finally:
        await srv.close()
    args.admin = f"127.0.0.1:{port}"  # closed now: a clear error, exit status 1
    assert top.run_once(args, io.StringIO()) == 1
