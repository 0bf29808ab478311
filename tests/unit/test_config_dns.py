"""The DNS proxy's environment (istio/ztunnel src/config.rs construct_config, validate_config)."""

from __future__ import annotations

import pytest

from ztunnel.config import Config, ConfigError


def test_on_by_default_at_localhost_15053() -> None:
    c = Config.from_env({})
    assert c.dns_proxy and c.dns_proxy_addr == "localhost:15053"


@pytest.mark.parametrize(
    ("value", "on"),
    [("true", True), ("TRUE", True), ("True", True), ("false", False), ("1", False), ("", False)],
)
def test_capture_flag_is_true_in_any_case_else_off(value: str, on: bool) -> None:
    # config.rs: proxy_metadata DNS_CAPTURE is_none_or(to_lowercase() == "true")
    assert Config.from_env({"ISTIO_META_DNS_CAPTURE": value}).dns_proxy is on


@pytest.mark.parametrize("addr", ["localhost:5353", "127.0.0.1:5353", "[::1]:53"])
def test_proxy_addr(addr: str) -> None:
    assert Config.from_env({"ISTIO_META_DNS_PROXY_ADDR": addr}).dns_proxy_addr == addr


@pytest.mark.parametrize(
    ("addr", "why"),
    [
        ("localhost", "invalid socket address syntax"),
        ("localhost:x", "invalid digit found in string"),
        ("localhost:", "cannot parse integer from empty string"),
        ("localhost:65536", "number too large to fit in target type"),
        ("foo:53", "invalid socket address syntax"),
        ("1.2.3.4", "invalid socket address syntax"),
        ("[::1]", "invalid socket address syntax"),
        ("::1:53", "invalid socket address syntax"),
        (" 127.0.0.1:53", "invalid socket address syntax"),
    ],
)
def test_bad_proxy_addr_names_the_key_as_rust(addr: str, why: str) -> None:
    # config.rs construct_config: Error::InvalidState(format!("failed to parse
    # {DNS_PROXY_ADDR_METADATA}: {dns_addr} ({e})")), shown as "invalid configuration: ..."
    with pytest.raises(ConfigError) as e:
        Config.from_env({"ISTIO_META_DNS_PROXY_ADDR": addr})
    assert e.value.var == "DNS_PROXY_ADDR"
    assert str(e.value) == f"failed to parse DNS_PROXY_ADDR: {addr} ({why})"


def test_proxy_addr_port_is_a_rust_u16() -> None:
    # Address::new: "localhost:" then u16::from_str, which takes a leading "+".
    assert Config.from_env({"ISTIO_META_DNS_PROXY_ADDR": "localhost:+53"}).dns_proxy_addr == (
        "localhost:53"
    )


def test_dns_with_xds_on_demand_is_an_error() -> None:
    # config.rs validate_config: "DNS proxy does not currently support on-demand mode"
    with pytest.raises(ConfigError) as e:
        Config.from_env({"XDS_ON_DEMAND": "true"})
    assert e.value.var == "XDS_ON_DEMAND" and "on-demand" in e.value.reason
    c = Config.from_env({"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"})
    assert c.xds_on_demand and not c.dns_proxy


def test_capture_and_addr_from_proxy_config_metadata() -> None:
    # config.rs: proxy_metadata from PROXY_CONFIG proxyMetadata (ISTIO_META_ prefix stripped),
    # extended by the ISTIO_META_* variables, which win.
    pc = 'proxyMetadata: {ISTIO_META_DNS_CAPTURE: "false", DNS_PROXY_ADDR: "127.0.0.1:5353"}'
    c = Config.from_env({"PROXY_CONFIG": pc}, mesh_config="/nonexistent")
    assert not c.dns_proxy and c.dns_proxy_addr == "127.0.0.1:5353"
    c = Config.from_env({"PROXY_CONFIG": pc, "ISTIO_META_DNS_CAPTURE": "true"}, mesh_config="/x")
    assert c.dns_proxy


def test_preferred_namespace_reaches_the_dns_resolver() -> None:
    from ztunnel.dns.forwarder import ResolvConfSource
    from ztunnel.dns.server import DnsServer
    from ztunnel.proxy.sockets import SocketFactory
    from ztunnel.state.store import State

    c = Config.from_env({"PREFERED_SERVICE_NAMESPACE": "pref"}, mesh_config="/nonexistent")
    srv = DnsServer(
        config=c,
        state=State(),
        sockets=SocketFactory(mark=None),
        client=lambda: None,
        resolv=ResolvConfSource("/nonexistent"),
    )
    assert srv.resolver.preferred_namespace == "pref"
