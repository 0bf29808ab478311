from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel.config import (
    Config,
    ConfigError,
    CopyMode,
    ProxyMode,
    WorkloadInfo,
    format_duration,
    parse_duration,
)


def test_defaults_match_rust_ztunnel() -> None:
    c = Config.from_env({})
    assert c.proxy_mode is ProxyMode.SHARED
    assert c.packet_mark == 1337
    assert c.inpod_uds == Path("/var/run/ztunnel/ztunnel.sock")
    assert c.pool_max_streams_per_connection == 100
    assert c.pool_unused_release_timeout == timedelta(minutes=5)
    assert (c.http2_stream_window_size, c.http2_connection_window_size) == (4 << 20, 16 << 20)
    assert c.http2_frame_size == 1 << 20
    assert c.secret_ttl == timedelta(hours=24)
    assert c.connection_termination_deadline == timedelta(seconds=5)
    assert c.trust_domain == "cluster.local" and c.cluster_id == "Kubernetes"
    assert c.xds_address == "https://localhost:15012"
    assert c.ca_address is None  # the local CA is the embedded default
    assert c.copy_mode is CopyMode.SPLICE


def test_in_cluster_xds_default() -> None:
    c = Config.from_env({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert c.xds_address == "https://istiod.istio-system.svc:15012"


def test_local_config_alone_disables_xds(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("workloads: []\n")
    c = Config.from_env({"LOCAL_XDS_PATH": str(f)})
    assert c.xds_address is None and c.local_xds_path == f
    assert Config.from_env({"XDS_ADDRESS": ""}).xds_address is None
    assert Config.from_env({"XDS_ADDRESS": "istiod:15012"}).xds_address == "https://istiod:15012"


def test_dedicated_mode() -> None:
    c = Config.from_env({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/name/sa"})
    assert c.proxy_mode is ProxyMode.DEDICATED
    assert c.proxy_workload_info == WorkloadInfo("ns", "name", "sa")


def test_cluster_id_fallback() -> None:
    assert Config.from_env({"ISTIO_META_CLUSTER_ID": "c2"}).cluster_id == "c2"
    # Rust construct_config: ISTIO_META_CLUSTER_ID wins over CLUSTER_ID.
    assert Config.from_env({"CLUSTER_ID": "c1", "ISTIO_META_CLUSTER_ID": "c2"}).cluster_id == "c2"
    assert Config.from_env({"CLUSTER_ID": "c1"}).cluster_id == "c1"


@pytest.mark.parametrize(
    ("grace", "deadline"), [("30", 25), ("10", 9), ("2", 1), ("1", 1), ("0", 1)]
)
def test_termination_deadline_from_grace_period(grace: str, deadline: int) -> None:
    c = Config.from_env({"TERMINATION_GRACE_PERIOD_SECONDS": grace})
    assert c.connection_termination_deadline == timedelta(seconds=deadline)
    c = Config.from_env(
        {"TERMINATION_GRACE_PERIOD_SECONDS": grace, "CONNECTION_TERMINATION_DEADLINE": "7s"}
    )
    assert c.connection_termination_deadline == timedelta(seconds=7)


@pytest.mark.parametrize(
    ("value", "on"), [(None, False), ("true", True), ("True", False), ("1", False), ("", False)]
)
def test_authz_policy_info_logging_is_exactly_true(value: str | None, on: bool) -> None:
    # Rust config.rs AUTHZ_POLICY_INFO_LOGGING: env::var(...) == "true", nothing else.
    env = {} if value is None else {"AUTHZ_POLICY_INFO_LOGGING": value}
    assert Config.from_env(env).authz_policy_info_logging is on


def test_headers_and_flags() -> None:
    c = Config.from_env(
        {"XDS_HEADER_X-Foo": "a", "CA_HEADER_bar": "b", "FAKE_CA": "true", "CA_ADDRESS": "x:1"}
    )
    assert c.xds_headers == (("x-foo", "a"),) and c.ca_headers == (("bar", "b"),)
    assert c.ca_address is None  # FAKE_CA wins


@pytest.mark.parametrize(
    ("env", "var"),
    [
        ({"PROXY_MODE": "sidecar"}, "PROXY_MODE"),
        ({"PROXY_MODE": "dedicated"}, "PROXY_WORKLOAD_INFO"),
        ({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "a/b"}, "PROXY_WORKLOAD_INFO"),
        ({"PACKET_MARK": "lots"}, "PACKET_MARK"),
        ({"PACKET_MARK": "-1"}, "PACKET_MARK"),
        ({"IPV6_ENABLED": "maybe"}, "IPV6_ENABLED"),
        ({"POOL_MAX_STREAMS_PER_CONNECTION": "65536"}, "POOL_MAX_STREAMS_PER_CONNECTION"),
        ({"POOL_UNUSED_RELEASE_TIMEOUT": "5 parsecs"}, "POOL_UNUSED_RELEASE_TIMEOUT"),
        ({"HTTP2_FRAME_SIZE": "100"}, "HTTP2_FRAME_SIZE"),
        ({"CONNECTION_TERMINATION_DEADLINE": "soon"}, "CONNECTION_TERMINATION_DEADLINE"),
        ({"LOCAL_XDS_PATH": "/nonexistent.yaml"}, "LOCAL_XDS_PATH"),
        ({"LOCAL_XDS_PATH": "/etc/hostname", "LOCAL_XDS": "x: 1"}, "LOCAL_XDS_PATH"),
        ({"XDS_ADDRESS": "https://bad host:1"}, "XDS_ADDRESS"),
        ({"CA_ADDRESS": "https://h:99999"}, "CA_ADDRESS"),
        ({"SECRET_TTL": "0s"}, "SECRET_TTL"),
        ({"ZTUNNEL_COPY_MODE": "magic"}, "ZTUNNEL_COPY_MODE"),
        ({"ENABLE_ORIG_SRC": "perhaps"}, "ENABLE_ORIG_SRC"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], var: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert info.value.var == var
    assert str(info.value).startswith(f"{var}: ")


@pytest.mark.parametrize(
    ("text", "secs"),
    [
        ("5s", 5),
        ("500ms", 0.5),
        ("1h30m", 5400),
        ("24h", 86400),
        ("10", 10),
        ("1d", 86400),
        ("2m", 120),
    ],
)
def test_parse_duration(text: str, secs: float) -> None:
    assert parse_duration(text).total_seconds() == secs


@pytest.mark.parametrize("bad", ["", "5x", "s", "-1s", "1.5s"])
def test_parse_duration_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_summary_is_jsonable() -> None:
    import json

    c = Config.from_env({"LOCAL_XDS": "workloads: []", "XDS_ADDRESS": ""})
    s = c.summary()
    json.dumps(s)
    assert s["local_xds"] == "<13 bytes inline>"
    assert s["secret_ttl"] == "86400s"
    assert format_duration(timedelta(milliseconds=250)) == "250ms"


def test_metrics_flush_interval() -> None:
    assert Config.from_env({}).metrics_flush_interval == timedelta(seconds=5)
    c = Config.from_env({"ZTUNNEL_METRICS_FLUSH_INTERVAL": "250ms"})
    assert c.metrics_flush_interval == timedelta(milliseconds=250)
    for bad in ("0s", "soon"):
        with pytest.raises(ConfigError) as info:
            Config.from_env({"ZTUNNEL_METRICS_FLUSH_INTERVAL": bad})
        assert info.value.var == "ZTUNNEL_METRICS_FLUSH_INTERVAL"


def test_hostile_peer_limits() -> None:
    """Issue 13 (Python-only knobs, README "Security")."""
    c = Config.from_env({})
    assert (c.h2_max_control_frames, c.h2_max_window_updates, c.h2_max_empty_frames) == (
        1000,
        10_000,
        100,
    )
    assert (c.h2_max_early_resets, c.h2_max_continuations, c.fd_reserve) == (200, 32, None)
    c = Config.from_env(
        {
            "ZTUNNEL_H2_MAX_CONTROL_FRAMES": "50",
            "ZTUNNEL_H2_MAX_EARLY_RESETS": "7",
            "ZTUNNEL_H2_MAX_CONTINUATIONS": "4",
            "ZTUNNEL_FD_RESERVE": "100",
        }
    )
    assert (c.h2_max_control_frames, c.h2_max_early_resets, c.h2_max_continuations) == (50, 7, 4)
    assert c.fd_reserve == 100
    with pytest.raises(ConfigError, match="ZTUNNEL_H2_MAX_EMPTY_FRAMES"):
        Config.from_env({"ZTUNNEL_H2_MAX_EMPTY_FRAMES": "0"})


def test_socks5_is_off_by_default_and_adds_its_port_to_the_illegal_ones() -> None:
    """Rust construct_config: UNSTABLE_ENABLE_SOCKS5=true sets socks5_addr 127.0.0.1:15080 and
    inserts 15080 into illegal_ports (beside 15008, 15006, 15001)."""
    off = Config.from_env({})
    assert off.socks5 is False and off.illegal_ports == {15001, 15006, 15008}
    on = Config.from_env({"UNSTABLE_ENABLE_SOCKS5": "true"})
    assert on.socks5 is True and on.illegal_ports == {15001, 15006, 15008, 15080}
    with pytest.raises(ConfigError, match="UNSTABLE_ENABLE_SOCKS5"):
        Config.from_env({"UNSTABLE_ENABLE_SOCKS5": "maybe"})


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (
            {"POD_NAMESPACE": "istio-system", "POD_NAME": "ztunnel-x", "SERVICE_ACCOUNT": "zt"},
            WorkloadInfo("istio-system", "ztunnel-x", "zt"),
        ),
        ({"POD_NAMESPACE": "istio-system", "POD_NAME": "ztunnel-x"}, None),
        ({"POD_NAME": "ztunnel-x", "SERVICE_ACCOUNT": "zt"}, None),
        ({}, None),
        # Rust parse::<String> takes a set, empty variable as set
        ({"POD_NAMESPACE": "", "POD_NAME": "", "SERVICE_ACCOUNT": ""}, WorkloadInfo("", "", "")),
    ],
)
def test_ztunnel_workload_needs_all_three_downward_api_variables(
    env: dict[str, str], want: WorkloadInfo | None
) -> None:
    """Rust construct_config: ztunnel_identity/ztunnel_workload only when POD_NAMESPACE,
    SERVICE_ACCOUNT and POD_NAME are all set."""
    assert Config.from_env(env).ztunnel_workload == want
