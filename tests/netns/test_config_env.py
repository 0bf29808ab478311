"""Configuration rules seen from outside a running ztunnel (the table tests are
tests/unit/test_config_rust.py): ``LOG_FORMAT`` other than ``json`` starts and logs plain text;
dedicated mode sets no ``SO_MARK`` and so dials without ``CAP_NET_ADMIN``/``CAP_NET_RAW``;
with no ``AUTH_TOKEN`` and no default token file it talks to istiod without a token; the errors
Rust reports at start, with its wording."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import ClassVar

import pytest

from ztunnel.testing.apps import connect_from, listen_in, recv_line, start_app
from ztunnel.testing.netns import External, Pod, Testbed
from ztunnel.testing.proc import Record, ZtunnelProcess
from ztunnel.testing.xdsbed import ISTIOD_PORT, IstiodThread, http_get

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(120),
]

APP_PORT = 9000
# What CAP_NET_ADMIN and CAP_NET_RAW guard here: SO_MARK (either one), IP_TRANSPARENT.
NO_NET_CAPS = (
    "setpriv",
    "--inh-caps=-net_admin,-net_raw",
    "--bounding-set=-net_admin,-net_raw",
    "--",
)


def local_config(pod: Pod) -> str:
    return f"""workloads:
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: sa-server
  trustDomain: cluster.local
  workloadIps: ["{pod.ip4}"]
  protocol: TCP
"""


def dedicated_env(pod: Pod, **extra: str) -> dict[str, str]:
    return {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "default/server/sa-server",
        "LOCAL_XDS": local_config(pod),
        "CONNECTION_TERMINATION_DEADLINE": "1s",
        # (no istio-cni rules route spoofed replies back to ztunnel here: no original source)
        "ENABLE_ORIG_SRC": "false",
        **extra,
    }


class TextLogZtunnel(ZtunnelProcess):
    """``LOG_FORMAT=text`` (Rust: anything but ``json`` is plain); each line read as
    ``<time>\\t<level>\\t<target>\\t<message>``, a JSON line kept as such."""

    log_env: ClassVar[dict[str, str]] = {"LOG_FORMAT": "text", "RUST_LOG": "info,access=debug"}

    def parse(self, line: str) -> Record:
        if line.startswith("{"):
            return {"message": line, "level": "raw", "json": True}
        parts = line.split("\t", 3)
        if len(parts) != 4:
            return {"message": line, "level": "raw"}
        return {"level": parts[1].strip().lower(), "scope": parts[2], "message": parts[3]}


@pytest.fixture
def bed() -> Iterator[tuple[Testbed, Pod, External]]:
    """A pod whose port 9000 is captured to 15006 (PREROUTING only: ztunnel's own dial to the
    app is not captured, so no mark is needed), an echo app on it, and a client outside."""
    with Testbed() as tb:
        n1 = tb.add_node("n1")
        server = n1.add_pod("server")
        ext = tb.add_external("ext")
        server.run(
            "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", str(APP_PORT),
            "-j", "REDIRECT", "--to-ports", "15006",
        )  # fmt: skip
        start_app(server, "echo", ports=(APP_PORT,))
        yield tb, server, ext


def echo_through(ext: External, server: Pod) -> str | None:
    """One line through 15006 to the app; None if the connection is cut."""
    try:
        with connect_from(ext, server.ip4, APP_PORT, timeout=10) as s:
            s.sendall(b"ping\n")
            return recv_line(s, timeout=10)
    except (OSError, EOFError, TimeoutError):
        return None


def test_log_format_text_starts_and_logs_plain(bed: tuple[Testbed, Pod, External]) -> None:
    # src/telemetry.rs fmt_layer: LOG_FORMAT == "json" gives JSON, anything else the plain
    # format; before, LOG_FORMAT=text refused to start.
    _tb, server, ext = bed
    zt = TextLogZtunnel(server, dedicated_env(server)).start()
    try:
        assert echo_through(ext, server) == "ping"
        done = zt.wait_for(lambda r: str(r.get("message", "")).startswith("connection complete"))
        assert done["scope"] == "access" and done["level"] == "info"
        assert "direction=" in done["message"] and "src.addr=" in done["message"]
        assert not [r for r in zt.records if r.get("json")], "a JSON line with LOG_FORMAT=text"
        assert http_get(server, 15021, "/healthz/ready")[0] == 200
    finally:
        assert zt.stop() == 0, zt.internal_errors()


def test_dedicated_mode_dials_without_net_admin(bed: tuple[Testbed, Pod, External]) -> None:
    # src/config.rs packet_mark: 1337 only in shared mode; src/proxyfactory.rs
    # new_proxies_for_dedicated: no MarkSocketFactory without a mark. So ztunnel dials the app
    # with plain sockets and needs neither CAP_NET_ADMIN nor CAP_NET_RAW.
    _tb, server, ext = bed
    zt = ZtunnelProcess(server, dedicated_env(server), prefix=NO_NET_CAPS).start()
    try:
        with open(f"/proc/{zt.pid}/status") as f:
            eff = int(next(x for x in f if x.startswith("CapEff:")).split()[1], 16)
        assert not eff & (1 << 12 | 1 << 13), hex(eff)  # CAP_NET_ADMIN (12), CAP_NET_RAW (13)
        for _ in range(3):
            assert echo_through(ext, server) == "ping"
        rec = zt.wait_for(
            lambda r: r.get("message") == "connection complete" and r.get("direction") == "inbound"
        )
        assert "error" not in rec, rec
    finally:
        assert zt.stop() == 0, zt.internal_errors()

    # The control: the same with PACKET_MARK set (what dedicated mode did by default before):
    # the dial fails at setsockopt(SO_MARK), as it would in Rust. (The DNS proxy is off: its
    # marked UDP listener could not even be bound, so start-up would fail.)
    env = dedicated_env(server, PACKET_MARK="1337", ISTIO_META_DNS_CAPTURE="false")
    zt = ZtunnelProcess(server, env, prefix=NO_NET_CAPS).start()
    try:
        assert echo_through(ext, server) is None
        rec = zt.wait_for(
            lambda r: r.get("message") == "connection complete" and r.get("direction") == "inbound"
        )
        assert "Operation not permitted" in str(rec.get("error")), rec
    finally:
        zt.stop()


def test_no_auth_token_talks_to_istiod_without_one() -> None:
    # src/config.rs construct_config auth: AUTH_TOKEN unset and no
    # ./var/run/secrets/tokens/istio-token -> AuthSource::None: xDS connects with neither
    # authorization nor clusterid (before: a missing-file error, so it never connected).
    with Testbed() as tb:
        n1 = tb.add_node("n1")
        pod = n1.add_pod("server")
        host = tb.add_external("istiod")
        sock = listen_in(host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=False)  # accepts calls without a token
        zt: ZtunnelProcess | None = None
        try:
            istiod.start(sock)
            env = {
                "PROXY_MODE": "dedicated",
                "PROXY_WORKLOAD_INFO": "default/server/sa-server",
                "XDS_ADDRESS": f"http://{host.ip4}:{ISTIOD_PORT}",
                "CLUSTER_ID": "c9",
            }
            assert not os.path.exists("./var/run/secrets/tokens/istio-token")
            zt = ZtunnelProcess(pod, env).start()
            zt.wait_for(lambda r: r.get("message") == "xDS: initial sync complete", 20)
            streams = istiod.call(lambda: list(istiod.istiod.streams))
            assert streams, "no xDS stream"
            assert streams[0].header("authorization") is None
            assert streams[0].header("clusterid") is None
        finally:
            rc = zt.stop() if zt is not None else 0
            istiod.close()
            sock.close()
        assert rc == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"ENABLE_PROXY": "false", "ISTIO_META_DNS_CAPTURE": "false"},
            "invalid configuration: error parsing proxy config: "
            "ztunnel run without any servers enabled",
        ),
        (
            {"ISTIO_META_DNS_PROXY_ADDR": "localhost"},
            "invalid configuration: failed to parse DNS_PROXY_ADDR: localhost "
            "(invalid socket address syntax)",
        ),
        (
            {"PROXY_MODE": "Shared"},
            "PROXY_MODE must be one of dedicated, shared",
        ),
        ({"IPV6_ENABLED": ""}, "provided string was not `true` or `false`"),
    ],
)
def test_start_up_errors_in_rusts_words(env: dict[str, str], message: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROXY_", "ISTIO_META"))}
    with Testbed() as tb:
        n1 = tb.add_node("n1")
        out = n1.run(
            sys.executable, "-m", "ztunnel", env={**base, "XDS_ADDRESS": "", **env}, check=False
        )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
