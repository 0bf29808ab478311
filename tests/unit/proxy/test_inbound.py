"""The inbound HBONE decisions (ztunnel.proxy.inbound), as table tests pinned to Rust."""

from __future__ import annotations

import asyncio

import pytest

from ztunnel.core.addr import SocketAddr, parse_ip
from ztunnel.proxy.inbound import (
    SELF_CALL,
    _FairStarter,
    destination_error,
    self_call,
    upstream_for,
)
from ztunnel.state.model import ApplicationTunnel, AppTunnelProtocol, Workload

POD = Workload(
    uid="cluster1//v1/Pod/default/b",
    name="b",
    namespace="default",
    addresses=(parse_ip("10.2.0.2"), parse_ip("fd00:2::2")),
)


@pytest.mark.parametrize(
    ("arrival", "authority", "error"),
    [
        ("10.2.0.2", "10.2.0.2:8080", None),
        ("fd00:2::2", "[fd00:2::2]:8080", None),
        # issue 17: the same pod's other family on a v4 connection is a mismatch in Rust
        ("10.2.0.2", "[fd00:2::2]:8080", "ip mismatch: 10.2.0.2 != fd00:2::2"),
        ("fd00:2::2", "10.2.0.2:8080", "ip mismatch: fd00:2::2 != 10.2.0.2"),
        ("10.2.0.2", "10.1.0.2:8080", "ip mismatch: 10.2.0.2 != 10.1.0.2"),
        ("10.2.0.2", "127.0.0.1:15000", "ip mismatch: 10.2.0.2 != 127.0.0.1"),
    ],
)
def test_destination_rule(arrival: str, authority: str, error: str | None) -> None:
    # Rust Inbound::validate_destination (Error::IPMismatch "ip mismatch: {dst} != {hbone}")
    assert destination_error(parse_ip(arrival), SocketAddr.parse(authority), POD) == error


def test_application_tunnel_skips_the_ip_check() -> None:
    # Rust validate_destination: local_workload.application_tunnel.is_some() -> Ok
    tunnelled = Workload(
        uid=POD.uid,
        name=POD.name,
        namespace=POD.namespace,
        addresses=POD.addresses,
        application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
    )
    target = SocketAddr.parse("10.9.9.9:80")
    assert destination_error(parse_ip("10.2.0.2"), target, tunnelled) is None


def test_the_dial_goes_to_the_arrival_ip() -> None:
    # Rust find_inbound_upstream: target_ip = conn.dst.ip(), port from the authority
    up = upstream_for(parse_ip("10.2.0.2"), SocketAddr.parse("[fd00:2::2]:9000"))
    assert up == SocketAddr.parse("10.2.0.2:9000")


@pytest.mark.parametrize(
    ("port", "refused"),
    [(15001, True), (15006, True), (15008, True), (15000, False), (15020, False), (80, False)],
)
def test_self_call_ports(port: int, refused: bool) -> None:
    # Rust config illegal_ports = {15001, 15006, 15008}: Error::SelfCall -> 503
    assert self_call(SocketAddr.parse(f"10.2.0.2:{port}")) is refused
    assert SELF_CALL == "attempted recursive call to ourselves"


async def test_fair_starter_runs_a_batch_per_iteration() -> None:
    starter = _FairStarter(batch=3)
    ran: list[int] = []
    for i in range(10):
        starter.submit(lambda i=i: ran.append(i))  # type: ignore[misc]
    assert ran == [0, 1, 2]
    await asyncio.sleep(0)
    assert ran == [0, 1, 2, 3, 4, 5]
    for _ in range(3):
        await asyncio.sleep(0)
    assert ran == list(range(10))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not starter.armed and starter.started == 0
