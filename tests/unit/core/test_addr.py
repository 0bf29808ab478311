import asyncio
import ipaddress

import pytest

from ztunnel.core.addr import SocketAddr, canonical_ip, ip_from_bytes, parse_ip
from ztunnel.core.identity import Identity


def test_canonical_maps_v4_in_v6() -> None:
    assert canonical_ip(ipaddress.ip_address("::ffff:10.0.0.1")) == ipaddress.ip_address("10.0.0.1")
    assert parse_ip("::1").version == 6


@pytest.mark.parametrize(
    ("text", "out"),
    [
        ("1.2.3.4:80", "1.2.3.4:80"),
        ("[::1]:15008", "[::1]:15008"),
        ("[::ffff:1.2.3.4]:1", "1.2.3.4:1"),
    ],
)
def test_socket_addr_roundtrip(text: str, out: str) -> None:
    assert str(SocketAddr.parse(text)) == out


@pytest.mark.parametrize(
    "bad", ["1.2.3.4", "::1:80", "[1.2.3.4]:80", "host:80", "1.2.3.4:x", "1.2.3.4:70000", "[::1]80"]
)
def test_socket_addr_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        SocketAddr.parse(bad)


def test_ip_from_bytes() -> None:
    assert str(ip_from_bytes(bytes([10, 0, 0, 1]))) == "10.0.0.1"
    with pytest.raises(ValueError):
        ip_from_bytes(b"\x01\x02\x03")


def test_identity() -> None:
    i = Identity.parse("spiffe://cluster.local/ns/default/sa/sleep")
    assert i == Identity("cluster.local", "default", "sleep")
    assert i.principal == "cluster.local/ns/default/sa/sleep"
    for bad in [
        "cluster.local/ns/a/sa/b",
        "spiffe://td/ns/a/sa",
        "spiffe://td/ns/a/xx/b",
        "spiffe://td/ns/a/sa/b/c",
    ]:
        with pytest.raises(ValueError):
            Identity.parse(bad)
    # Rust Identity::from_str: empty parts are allowed.
    assert Identity.parse("spiffe:///ns//sa/") == Identity("", "", "")


@pytest.mark.both_loops
async def test_async_harness_runs() -> None:
    await asyncio.sleep(0)
