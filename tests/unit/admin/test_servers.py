"""The three servers over real loopback sockets: stats, readiness, admin."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.unit.admin import request
from ztunnel import logs
from ztunnel.admin import (
    ADMIN_DEFAULT_HOST,
    AdminHandler,
    HttpServer,
    LogControl,
    Readiness,
    ReadinessHandler,
    StatsHandler,
    bind_admin,
)
from ztunnel.admin.http import Handler
from ztunnel.admin.logctl import validate_spec
from ztunnel.admin.stats import RenderMode, choose_encoding, parse_qvalue
from ztunnel.config import Config
from ztunnel.metrics import Metrics, Reporter, encode, traffic_labels
from ztunnel.state.model import Workload
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(30)


async def serve(handler: Handler, host: str = "127.0.0.1") -> HttpServer:
    srv = HttpServer.bind("t", [(host, 0)], handler)
    await srv.start()
    return srv


# --- stats -----------------------------------------------------------------------------------


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    m = Metrics(reg, tag="9.9.9")
    w = Workload(uid="u", name="n", namespace="ns", workload_name="wl")
    m.open_connection(traffic_labels(Reporter.SOURCE, source=w)).close(10, 20)
    return reg


@pytest.mark.both_loops
@pytest.mark.parametrize("mode", ["cooperative", "thread", "inline"])
async def test_metrics_text_and_both_paths(registry: CollectorRegistry, mode: RenderMode) -> None:
    """Rust metrics/server.rs handle_metrics: prometheus-client's OpenMetrics text whatever the
    client accepts, labelled text/plain; charset=utf-8."""
    srv = await serve(StatsHandler(registry, mode=mode))
    try:
        for path in ("/metrics", "/stats/prometheus"):
            r = await request(srv.port, "GET", path)
            assert r.status == 200
            assert r.headers["content-type"] == "text/plain; charset=utf-8"
            assert 'istio_build{component="ztunnel",tag="9.9.9"} 1\n' in r.text
            assert "# TYPE istio_tcp_connections_opened counter\n" in r.text
            assert 'istio_tcp_received_bytes_total{reporter="source",' in r.text
            assert r.text.endswith("# EOF\n")
            assert "content-encoding" not in r.headers
        assert (await request(srv.port, "GET", "/nope")).status == 404
        # Rust handle_metrics: any method gets the body.
        r = await request(srv.port, "POST", "/metrics")
        assert r.status == 200 and r.text.endswith("# EOF\n")
    finally:
        await srv.close()


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (None, False),
        ("application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1", True),
        ("application/json", False),
        ("text/plain,Application/OpenMetrics-Text", True),
        # Rust content_type: members are not trimmed, so one after ", " does not count
        ("text/plain, application/openmetrics-text", False),
        # Prometheus 3's Accept
        (
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
            "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.2,"
            "*/*;q=0.1",
            True,
        ),
    ],
)
async def test_metrics_content_type_as_rust(
    registry: CollectorRegistry, accept: str | None, openmetrics: bool
) -> None:
    srv = await serve(StatsHandler(registry))
    try:
        r = await request(srv.port, "GET", "/metrics", headers={"Accept": accept} if accept else {})
        assert r.headers["content-type"] == (
            "application/openmetrics-text;charset=utf-8;version=1.0.0"
            if openmetrics
            else "text/plain; charset=utf-8"
        )
        assert steady(r.body) == steady(encode(registry))  # the same body either way
    finally:
        await srv.close()


@pytest.mark.parametrize("mode", ["cooperative", "thread", "inline"])
@pytest.mark.parametrize("coding", ["gzip", "deflate", "zstd"])
async def test_metrics_compressed(
    registry: CollectorRegistry, mode: RenderMode, coding: str
) -> None:
    srv = await serve(StatsHandler(registry, mode=mode))
    try:
        plain = await request(srv.port, "GET", "/metrics")
        r = await request(srv.port, "GET", "/metrics", headers={"Accept-Encoding": coding})
        assert (r.status, r.headers["content-encoding"]) == (200, coding)
        assert r.headers["vary"] == "accept-encoding"
        assert steady(decompress(coding, r.body)) == steady(plain.body)
        r = await request(srv.port, "GET", "/metrics", headers={"Accept-Encoding": f"{coding};q=0"})
        assert "content-encoding" not in r.headers and steady(r.body) == steady(plain.body)
    finally:
        await srv.close()


def steady(body: bytes) -> list[bytes]:
    """The exposition but the process figures (fds, CPU and memory move between scrapes)."""
    return [line for line in body.split(b"\n") if not line.startswith(b"process_")]


def decompress(coding: str, body: bytes) -> bytes:
    if coding == "gzip":
        return gzip.decompress(body)
    if coding == "deflate":
        return zlib.decompress(body)  # (the zlib format, as HTTP's deflate)
    from backports import zstd

    return zstd.decompress(body)


async def test_metrics_not_acceptable_and_small_bodies() -> None:
    """tower-http: nothing acceptable left is 406 (the response otherwise as it was); a body
    under 32 bytes is not compressed."""
    empty = CollectorRegistry()  # its exposition is "# EOF\n" alone
    srv = await serve(StatsHandler(empty))
    try:
        r = await request(srv.port, "GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        assert (r.status, r.body) == (200, b"# EOF\n") and "content-encoding" not in r.headers
        for refused in ("identity;q=0", "*;q=0", "br"):  # (br alone: identity is still fine)
            r = await request(srv.port, "GET", "/metrics", headers={"Accept-Encoding": refused})
            assert r.status == (200 if refused == "br" else 406), refused
            assert r.body == b"# EOF\n"
        r = await request(srv.port, "GET", "/nope", headers={"Accept-Encoding": "identity;q=0"})
        assert (r.status, r.headers["vary"]) == (406, "accept-encoding")
    finally:
        await srv.close()


ALL = ("gzip", "deflate", "br", "zstd")


@pytest.mark.parametrize(
    ("headers", "supported", "chosen"),
    [
        # tower-http content_encoding.rs tests
        ([], ALL, "identity"),
        (["gzip"], ALL, "gzip"),
        (["gzip,br"], ALL, "br"),
        (["gzip,deflate,br,zstd"], ALL, "zstd"),
        (["gzip;q=0.5,br"], ALL, "br"),
        (["gzip;q=0.5,br;q=0.2"], ALL, "gzip"),
        (["gzip;q=0.5", "br;q=0.6"], ALL, "br"),  # every Accept-Encoding header counts
        (["gzip;q=1.0,br;q=1"], ALL, "br"),
        (["gzip;q=0.995,br;q=0.999"], ALL, "br"),
        (["gzip;q=0.9999,br"], ALL, "br"),  # a malformed q-value drops its member
        (["gzip;q=1.1,br;q=0.5"], ALL, "br"),
        (["gzip;q=0,br;q=0"], ALL, "identity"),
        (["x-gzip"], ALL, "gzip"),
        (["GZIP;Q=0.5"], ALL, "gzip"),
        (["compress,gzip;q=0.1"], ALL, "gzip"),  # unknown codings are ignored
        # identity and the wildcard (RFC 9110 12.5.3)
        (["identity;q=0"], ALL, None),
        (["identity;q=0,gzip"], ALL, "gzip"),
        (["*"], ALL, "zstd"),
        (["*;q=0"], ALL, None),
        (["gzip;q=0.5,*;q=0.1"], ALL, "gzip"),
        (["*;q=0.5,zstd;q=0"], ALL, "br"),
        (["*;q=0.5,identity;q=1"], ALL, "identity"),
        # what ours supports: no br, so a client asking for br and gzip gets gzip
        (["br,gzip"], ("gzip", "deflate", "zstd"), "gzip"),
        (["br"], ("gzip", "deflate", "zstd"), "identity"),
        (["deflate, gzip, br, zstd"], ("gzip", "deflate", "zstd"), "zstd"),  # curl --compressed
        (["gzip"], (), "identity"),
    ],
)
def test_choose_encoding_as_tower_http(
    headers: list[str], supported: tuple[str, ...], chosen: str | None
) -> None:
    assert choose_encoding(headers, supported) == chosen


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("q=1", 1000),
        ("q=1.", 1000),
        ("q=1.000", 1000),
        ("Q=0.5", 500),
        ("q=0.001", 1),
        ("q=0", 0),
        ("q=1.001", None),
        ("q=0.0001", None),
        ("q=.5", None),
        ("q = 0.5", None),
        ("q=0.5;x=1", None),
        ("r=0.5", None),
        ("q=", None),
    ],
)
def test_qvalue_as_tower_http(text: str, value: int | None) -> None:
    assert parse_qvalue(text) == value


async def test_large_scrape_is_chunked_and_complete() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg, process=False)
    for i in range(2000):
        w = Workload(uid=f"u{i}", name=f"n{i}", namespace="ns", workload_name=f"wl{i}")
        m.open_connection(traffic_labels(Reporter.SOURCE, source=w)).close(i, i)
    handler = StatsHandler(reg)
    srv = await serve(handler)
    try:
        r = await request(srv.port, "GET", "/metrics")
        assert int(r.headers["content-length"]) == len(r.body) > 1_000_000
        assert r.body == encode(reg)
    finally:
        await srv.close()


# --- readiness --------------------------------------------------------------------------------


@pytest.mark.both_loops
async def test_readiness_transitions() -> None:
    ready = Readiness()
    srv = await serve(ReadinessHandler(ready))
    try:
        r = await request(srv.port, "GET", "/healthz/ready")
        assert (r.status, r.text) == (200, "ready\n")  # nothing registered

        xds = ready.register("state manager")
        proxy = ready.register("proxy")
        r = await request(srv.port, "GET", "/healthz/ready")
        assert r.status == 500
        assert r.text == "not ready, pending: proxy, state manager\n"

        xds.done()
        r = await request(srv.port, "GET", "/healthz/ready")
        assert (r.status, r.text) == (500, "not ready, pending: proxy\n")

        proxy.done()
        proxy.done()  # idempotent
        r = await request(srv.port, "GET", "/healthz/ready")
        assert (r.status, r.text) == (200, "ready\n")

        proxy.not_ready_again()  # e.g. the node agent connection dropped
        assert (await request(srv.port, "GET", "/healthz/ready")).status == 500
        proxy.done()
        assert (await request(srv.port, "GET", "/healthz/ready")).status == 200

        for method in ("POST", "PUT", "DELETE", "HEAD"):
            assert (await request(srv.port, method, "/healthz/ready")).status == 405
        assert (await request(srv.port, "GET", "/healthz/live")).status == 404
    finally:
        await srv.close()


def test_readiness_same_name_twice() -> None:
    ready = Readiness()
    a, b = ready.register("inpod"), ready.register("inpod")
    a.done()
    assert ready.pending() == ["inpod"]
    b.done()
    assert ready.ready and ready.pending() == []


# --- admin ------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    manager = logging.root.manager
    saved = {n: lg.level for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    root = logging.getLogger().level
    yield
    logging.getLogger().setLevel(root)
    for n, lg in manager.loggerDict.items():
        if isinstance(lg, logging.Logger):
            lg.setLevel(saved.get(n, logging.NOTSET))


def make_admin(**kw: object) -> AdminHandler:
    state = State()
    state.upsert_workload(Workload(uid="u1", name="w1", namespace="ns"))
    cfg = Config()
    return AdminHandler(state=lambda: state, config=cfg.summary, **kw)  # type: ignore[arg-type]


@pytest.mark.both_loops
async def test_admin_index_and_404() -> None:
    srv = await serve(make_admin())
    try:
        r = await request(srv.port, "GET", "/")
        assert r.status == 200
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        for path in ("config_dump", "quitquitquit", "logging", "debug/pprof/profile"):
            assert f'<a href="{path}">' in r.text
        # Rust handle_dashboard: any method.
        assert (await request(srv.port, "POST", "/")).text == r.text
        assert (await request(srv.port, "GET", "/debug/pprof/nothing")).status == 404
    finally:
        await srv.close()


async def test_admin_config_dump_json() -> None:
    srv = await serve(make_admin())
    try:
        r = await request(srv.port, "GET", "/config_dump")
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        body = json.loads(r.body)
        assert [w["uid"] for w in body["workloads"]] == ["u1"]
        assert body["config"]["proxyMode"] == "shared"
        assert body["staticConfig"] == {"workloads": [], "policies": [], "services": []}
        # Rust handle_config_dump: any method.
        r = await request(srv.port, "POST", "/config_dump")
        assert r.status == 200 and [w["uid"] for w in json.loads(r.body)["workloads"]] == ["u1"]
    finally:
        await srv.close()


async def test_quitquitquit_post_only_and_calls_back_once() -> None:
    calls: list[str] = []

    async def on_quit() -> None:
        calls.append("drain")
        await asyncio.sleep(0.05)
        calls.append("drained")

    srv = await serve(make_admin(on_quit=on_quit, quit_deadline=2.0))
    try:
        for method in ("GET", "PUT", "DELETE"):
            assert (await request(srv.port, method, "/quitquitquit")).status == 405
        assert calls == []
        r = await request(srv.port, "POST", "/quitquitquit")
        assert (r.status, r.text) == (200, "shutdown now\n")
        assert calls == ["drain", "drained"]  # replied after the drain finished
        await request(srv.port, "POST", "/quitquitquit")
        assert calls == ["drain", "drained"]  # not started twice
    finally:
        await srv.close()


async def test_quitquitquit_replies_at_the_deadline() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def on_quit() -> None:
        started.set()
        await release.wait()

    srv = await serve(make_admin(on_quit=on_quit, quit_deadline=0.2))
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await request(srv.port, "POST", "/quitquitquit")
        assert r.status == 200 and started.is_set()
        assert 0.15 <= loop.time() - t0 < 2.0
    finally:
        release.set()
        await asyncio.sleep(0)
        await srv.close()


async def test_logging_get_post_reset(restore_logging: None) -> None:
    logs.apply_directives("info")
    ctl = LogControl("info,access=warn")
    logs.apply_directives(ctl.startup_spec)
    srv = await serve(make_admin(log_control=ctl))
    try:
        # Rust handle_logging: POST only; anything else is 405 with the help text.
        r = await request(srv.port, "GET", "/logging")
        assert r.status == 405 and r.text.startswith("Invalid HTTP method\n \nusage: POST /logging")
        r = await request(srv.port, "POST", "/logging")  # no params: list, as Rust does
        assert r.text == "current log level is access=warn,info\n"

        r = await request(srv.port, "POST", "/logging?level=debug")
        assert (r.status, r.text) == (200, "current log level is access=warn,debug\n")
        assert logging.getLogger().level == logging.DEBUG

        r = await request(srv.port, "POST", "/logging?level=ztunnel::proxy=trace,access=info")
        assert r.text == "current log level is access=info,ztunnel::proxy=trace,debug\n"
        assert logging.getLogger("ztunnel.proxy").level == 5
        assert logging.getLogger("access").level == logging.INFO

        r = await request(srv.port, "POST", "/logging?reset")
        assert r.text == "current log level is access=warn,info\n"
        assert logging.getLogger("ztunnel.proxy").level == logging.NOTSET

        r = await request(srv.port, "POST", "/logging?reset&level=error")
        assert r.text == "current log level is access=warn,error\n"

        for bad in ("nonsense", "access=loud", "ztunnel::proxy"):
            r = await request(srv.port, "POST", f"/logging?level={bad}")
            assert r.status == 400
            assert r.text.startswith(f"Invalid level provided: {bad}\n")
        assert (await request(srv.port, "POST", "/logging")).text.endswith("access=warn,error\n")

        r = await request(srv.port, "PUT", "/logging")
        assert r.status == 405 and "usage:" in r.text
    finally:
        await srv.close()


def test_validate_spec() -> None:
    validate_spec("info,access=debug,ztunnel::proxy=trace")
    validate_spec("off")
    for bad in ("ztunnel::proxy", "loud", "access=loud"):
        with pytest.raises(ValueError):
            validate_spec(bad)


async def test_admin_binds_both_loopbacks_by_default() -> None:
    # Rust: Address::Localhost(ipv6_localhost_enabled, 15000) binds 127.0.0.1 and [::1].
    assert ADMIN_DEFAULT_HOST == "127.0.0.1"
    srv = bind_admin(make_admin(), port=0)
    await srv.start()
    try:
        assert srv.addresses == [("127.0.0.1", srv.port), ("::1", srv.port)]
        assert (await request(srv.port, "GET", "/", host="::1")).status == 200
        assert (await request(srv.port, "GET", "/")).status == 200
        # 127.0.0.2 is also this host (lo holds 127/8) but not the bound address.
        with pytest.raises(OSError):
            await request(srv.port, "GET", "/", host="127.0.0.2")
    finally:
        await srv.close()
