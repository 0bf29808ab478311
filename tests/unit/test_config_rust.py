"""The environment parsed as Rust's ``src/config.rs`` parses it: ``parse``/``parse_default`` (the
type's ``FromStr``, where a set-but-empty value is an error), ``parse_duration``
(``duration_str``), the variables Rust reads by other rules, and the mode-dependent defaults."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ztunnel.config import (
    DEFAULT_AUTH_TOKEN,
    AuthToken,
    Config,
    ConfigError,
    ProxyMode,
    parse_duration,
    rust_bool,
    rust_f64,
    rust_uint,
)

DEDICATED = {"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/name/sa"}


def cfg(**env: str) -> Config:
    return Config.from_env(env, mesh_config="/nonexistent")


def refused(var: str, **env: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        cfg(**env)
    assert e.value.var == var
    return e.value


# --- FromStr --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("true", True),
        ("false", False),
        ("True", None),
        ("TRUE", None),
        ("1", None),
        ("0", None),
        ("yes", None),
        ("on", None),
        (" true", None),
        ("true ", None),
        ("", None),
    ],
)
def test_bool_is_rusts_from_str(text: str, want: bool | None) -> None:
    # bool::from_str: exactly "true" or "false".
    if want is None:
        with pytest.raises(ValueError, match="provided string was not `true` or `false`"):
            rust_bool(text)
    else:
        assert rust_bool(text) is want


@pytest.mark.parametrize(
    ("text", "bits", "want"),
    [
        ("0", 16, 0),
        ("65535", 16, 65535),
        ("+5", 16, 5),
        ("007", 16, 7),
        ("65536", 16, "number too large to fit in target type"),
        ("4294967295", 32, 4294967295),
        ("4294967296", 32, "number too large to fit in target type"),
        ("18446744073709551615", 64, 18446744073709551615),
        ("", 16, "cannot parse integer from empty string"),
        ("+", 16, "invalid digit found in string"),
        ("-1", 16, "invalid digit found in string"),
        ("0x10", 16, "invalid digit found in string"),
        ("1_000", 16, "invalid digit found in string"),
        (" 5", 16, "invalid digit found in string"),
        ("5 ", 16, "invalid digit found in string"),
        ("1e3", 16, "invalid digit found in string"),
        ("١٢", 16, "invalid digit found in string"),  # Arabic-Indic digits: not ASCII
    ],
)
def test_unsigned_ints_are_rusts_from_str(text: str, bits: int, want: int | str) -> None:
    # u16/u32/u64::from_str (what parse::<u16>() etc. call): decimal, optional "+".
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            rust_uint(text, bits)
    else:
        assert rust_uint(text, bits) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [("2", 2.0), ("1.5", 1.5), (".5", 0.5), ("5.", 5.0), ("1e3", 1000.0), ("+2", 2.0)],
)
def test_floats_are_rusts_from_str(text: str, want: float) -> None:
    assert rust_f64(text) == want


@pytest.mark.parametrize("text", ["", " 2", "2 ", "1_0", "0x1", "e3", "1e", "."])
def test_floats_python_accepts_but_rust_does_not(text: str) -> None:
    with pytest.raises(ValueError):
        rust_f64(text)


# duration_str 0.21 parse (its own tests in src/parser.rs are the reference for these rows)
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0),
        ("     0    ", 0),
        ("1", 1),
        ("0m", 0),
        ("1hr", 3600),
        ("1m31", 91),
        ("1m31s", 91),
        ("1m+31", 91),
        ("1m*60", 3600),
        ("1m*60*20", 72000),
        ("1m+60+24", 144),
        ("      1m      +  60 +             24 ", 144),
        ("3m + 13s + 29ms", 193.029),
        ("1m*10ms", 0.6),
        ("1m * 1m", 3600),
        ("1d", 86400),
        ("1w", 604800),
        ("1mon", 2592000),
        ("1y", 31536000),
        ("2 Minutes", 120),
        ("5SEC", 5),
        ("1500us", 0.0015),
        ("1500µs", 0.0015),
        ("5s3", 8),  # juxtaposed terms add up
    ],
)
def test_durations_are_duration_str(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "text", ["", " ", "s", "-1s", "1.5s", "0.5", "5x", "1 2", "1m+", "1m+2*3", "1m x", "+1s"]
)
def test_durations_duration_str_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_durations_past_u64_nanoseconds_are_refused() -> None:
    assert parse_duration("584y") > timedelta(days=584 * 365 - 1)
    with pytest.raises(ValueError, match="overflow"):
        parse_duration("585y")


# --- every variable Rust parses with FromStr ------------------------------------------------------

BOOLS = [
    "IPV6_ENABLED",
    "FAKE_CA",
    "ENABLE_ORIG_SRC",
    "INPOD_PORT_REUSE",
    "LOCALHOST_APP_TUNNEL",
    "ENABLE_RESPONSE_BAGGAGE",
    "KEEPALIVE_ENABLED",
    "USER_TIMEOUT_ENABLED",
    "ENABLE_PROXY",
]


@pytest.mark.parametrize("var", [*BOOLS, "XDS_ON_DEMAND"])
@pytest.mark.parametrize("bad", ["", "True", "1", "yes", "off"])
def test_every_bool_variable_is_bool_from_str(var: str, bad: str) -> None:
    # construct_config: parse_default(X, default)? / parse(X)? on a bool.
    dns = "false" if var == "XDS_ON_DEMAND" else "true"
    e = refused(var, **{var: bad, "ISTIO_META_DNS_CAPTURE": dns})
    assert e.reason == f"invalid value {bad!r} (provided string was not `true` or `false`)"
    for text in ("true", "false"):
        cfg(**{var: text, "ISTIO_META_DNS_CAPTURE": dns})


@pytest.mark.parametrize(
    ("var", "bits"),
    [
        ("POOL_MAX_STREAMS_PER_CONNECTION", 16),
        ("KEEPALIVE_RETRIES", 32),
        ("PACKET_MARK", 32),
        ("TERMINATION_GRACE_PERIOD_SECONDS", 64),
    ],
)
def test_every_int_variable_is_its_rust_type(var: str, bits: int) -> None:
    # parse_default::<u16/u32/u64>: the full range of the type, and nothing else.
    assert cfg(**{var: str((1 << bits) - 1)})
    for bad in ("", str(1 << bits), "-1", "0x10", "1_0", " 7"):
        refused(var, **{var: bad})
    assert cfg(POOL_MAX_STREAMS_PER_CONNECTION="0").pool_max_streams_per_connection == 0
    assert cfg(KEEPALIVE_RETRIES="+12").keepalive_retries == 12


@pytest.mark.parametrize("var", ["HTTP2_STREAM_WINDOW_SIZE", "HTTP2_CONNECTION_WINDOW_SIZE"])
def test_http2_windows_are_u32_within_http2s_limits(var: str) -> None:
    # u32 in Rust; the HTTP/2 limit (2^31-1, RFC 9113 6.9.1) is a range check of ours (the h2
    # crate asserts it, so Rust panics beyond it).
    assert cfg(**{var: "2147483647"})
    for bad in ("2147483648", "", "4M"):
        refused(var, **{var: bad})


@pytest.mark.parametrize(
    "var",
    [
        "SECRET_TTL",
        "POOL_UNUSED_RELEASE_TIMEOUT",
        "KEEPALIVE_TIME",
        "KEEPALIVE_INTERVAL",
        "CONNECTION_TERMINATION_DEADLINE",
    ],
)
def test_every_duration_variable_is_duration_str(var: str) -> None:
    # parse_duration / parse_duration_default: "" and fractions are errors; juxtaposed terms add.
    for bad in ("", "1.5s", "soon"):
        refused(var, **{var: bad})
    c = cfg(**{var: "1m30s"})
    assert timedelta(seconds=90) in (
        c.secret_ttl,
        c.pool_unused_release_timeout,
        c.keepalive_time,
        c.keepalive_interval,
        c.connection_termination_deadline,
    )


def test_empty_termination_deadline_is_an_error_not_the_grace_period() -> None:
    # self_termination_deadline: parse_duration(CONNECTION_TERMINATION_DEADLINE)? first.
    refused(
        "CONNECTION_TERMINATION_DEADLINE",
        CONNECTION_TERMINATION_DEADLINE="",
        TERMINATION_GRACE_PERIOD_SECONDS="30",
    )


def test_cpu_variables_are_rusts_number_parsers() -> None:
    # parse_cpu_quantity: f64::from_str (with an "m" suffix); ZTUNNEL_CPU_LIMIT: usize;
    # parse_worker_threads: usize or an f64 percentage.
    assert cfg(ZTUNNEL_RESOURCE_CPU_LIMIT="1.5").num_worker_threads == 2
    assert cfg(ZTUNNEL_RESOURCE_CPU_LIMIT="+3").num_worker_threads == 3
    assert cfg(ZTUNNEL_WORKER_THREADS="+3").num_worker_threads == 3
    for env in (
        {"ZTUNNEL_RESOURCE_CPU_LIMIT": " 2"},
        {"ZTUNNEL_RESOURCE_CPU_LIMIT": "1_0"},
        {"ZTUNNEL_RESOURCE_CPU_REQUEST": "inf"},
        {"ZTUNNEL_CPU_LIMIT": "2.0", "ZTUNNEL_WORKER_THREADS": "0"},
        {"ZTUNNEL_WORKER_THREADS": " 2"},
        {"ZTUNNEL_WORKER_THREADS": "1_0"},
        {"ZTUNNEL_WORKER_THREADS": "5 %"},
    ):
        with pytest.raises(ConfigError):
            cfg(**env)
    # NaN passes Rust's range check and its cast to usize gives 0, then the minimum 1.
    assert cfg(ZTUNNEL_WORKER_THREADS="NaN%").num_worker_threads == 1


# --- the variables with rules of their own ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, "plain"),
        ("json", "json"),
        ("JSON", "plain"),
        ("Json", "plain"),
        (" json", "plain"),
        ("text", "plain"),
        ("plain", "plain"),
        ("xml", "plain"),
        ("", "plain"),
    ],
)
def test_log_format_is_json_only_when_exactly_json(value: str | None, want: str) -> None:
    # telemetry.rs fmt_layer: env::var("LOG_FORMAT").unwrap_or("plain") == "json", else plain;
    # never an error.
    env = {} if value is None else {"LOG_FORMAT": value}
    assert cfg(**env).log_format == want


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, ProxyMode.SHARED),
        ("shared", ProxyMode.SHARED),
        ("dedicated", ProxyMode.DEDICATED),
        ("Shared", None),
        ("DEDICATED", None),
        (" shared", None),
        ("", None),
        ("sidecar", None),
    ],
)
def test_proxy_mode_is_exact(value: str | None, want: ProxyMode | None) -> None:
    # construct_config: match proxy_mode.as_str() { "dedicated" | "shared" | _ => EnvVar error }
    env = {"PROXY_WORKLOAD_INFO": "ns/name/sa"}
    if value is not None:
        env["PROXY_MODE"] = value
    if want is None:
        e = refused("PROXY_MODE", **env)
        assert "PROXY_MODE must be one of dedicated, shared" in e.reason
    else:
        assert cfg(**env).proxy_mode is want


def test_packet_mark_defaults_to_1337_in_shared_mode_only() -> None:
    # construct_config packet_mark: parse(PACKET_MARK)?.or_else(|| Shared -> Some(1337), else
    # None); proxyfactory.rs new_proxies_for_dedicated wraps no MarkSocketFactory without one.
    assert cfg().packet_mark == 1337
    assert cfg(**DEDICATED).packet_mark is None
    assert cfg(**DEDICATED, PACKET_MARK="1337").packet_mark == 1337
    assert cfg(PACKET_MARK="7").packet_mark == 7
    assert cfg(PACKET_MARK="4294967295").packet_mark == 2**32 - 1


def test_kubernetes_service_host_counts_when_set_even_empty() -> None:
    # construct_config: env::var(KUBERNETES_SERVICE_HOST).is_ok()
    assert cfg(KUBERNETES_SERVICE_HOST="").xds_address == "https://istiod.istio-system.svc:15012"
    assert cfg().xds_address == "https://localhost:15012"


# --- ENABLE_PROXY -----------------------------------------------------------------------------------


def test_enable_proxy_false_runs_dns_only() -> None:
    # construct_config proxy: parse_default(ENABLE_PROXY, true)
    assert cfg().enable_proxy is True
    c = cfg(ENABLE_PROXY="false")
    assert c.enable_proxy is False and c.dns_proxy is True


def test_no_servers_is_rusts_error() -> None:
    # validate_config: !proxy && !dns_proxy -> ProxyConfig("ztunnel run without any servers
    # enabled"), shown as "error parsing proxy config: ...".
    e = refused("ENABLE_PROXY", ENABLE_PROXY="false", ISTIO_META_DNS_CAPTURE="false")
    assert str(e) == "error parsing proxy config: ztunnel run without any servers enabled"
    # validate_config checks DNS with on-demand first.
    refused("XDS_ON_DEMAND", ENABLE_PROXY="false", XDS_ON_DEMAND="true")


# --- AUTH_TOKEN ------------------------------------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    """Run in an empty directory: Rust's default token path is relative to the working one."""
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def test_auth_token_unset_without_the_default_file_is_no_token(in_tmp: Path) -> None:
    # construct_config auth: None => default path if it exists, else AuthSource::None
    c = cfg()
    assert c.auth_token is None
    assert c.summary()["auth_token"] is None


def test_auth_token_unset_with_the_default_file_reads_it(in_tmp: Path) -> None:
    default = in_tmp / DEFAULT_AUTH_TOKEN
    default.parent.mkdir(parents=True)
    default.write_text("jwt")
    assert cfg().auth_token == AuthToken(path=Path(DEFAULT_AUTH_TOKEN))


def test_auth_token_existing_path_is_a_file_else_the_token(in_tmp: Path) -> None:
    # Some(p) if Path::new(&p).exists() => Token(file); Some(p) => StaticToken(p)
    f = in_tmp / "tok"
    f.write_text("jwt")
    assert cfg(AUTH_TOKEN=str(f)).auth_token == AuthToken(path=f)
    missing = str(in_tmp / "missing")
    assert cfg(AUTH_TOKEN=missing).auth_token == AuthToken(value=missing)
    c = cfg(AUTH_TOKEN="eyJhbGciOi.XYZZY")
    assert c.auth_token == AuthToken(value="eyJhbGciOi.XYZZY")
    assert c.summary()["auth_token"] == "<static token>"  # never the token itself
    assert "XYZZY" not in repr(c.summary())
