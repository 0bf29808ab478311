"""The bundled example configs load, and services.yaml routes as its comments say (the Rust
decisions: ServiceStore::get_best_by_vip, Service::visible_to, get_best_by_cidr_vip)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from ztunnel.core.addr import SocketAddr
from ztunnel.proxy.route import RouteKind, decide_outbound
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import NetworkAddress
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(10)

EXAMPLES = Path(__file__).resolve().parents[2] / "ztunnel" / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_loads(name: str) -> None:
    path = EXAMPLES / name
    cfg = load_local_config(path.read_text(), str(path))
    assert cfg.workloads


@pytest.fixture
def state() -> State:
    path = EXAMPLES / "services.yaml"
    st = State()
    load_local_config(path.read_text(), str(path)).apply_to(st)
    return st


def route_from(st: State, src_ip: str, dst: str, port: int = 80) -> tuple[RouteKind, str]:
    src = st.find_workload_by_addr(NetworkAddress("", ipaddress.ip_address(src_ip)))
    assert src is not None
    r = decide_outbound(st, src, SocketAddr(ipaddress.ip_address(dst), port))
    return r.kind, str(r.authority or r.target)


@pytest.mark.parametrize(
    ("client", "dst", "want"),
    [
        ("127.0.0.10", "127.10.0.50", (RouteKind.HBONE, "127.0.0.20:8080")),  # frontend's api
        ("127.0.0.11", "127.10.0.50", (RouteKind.HBONE, "127.0.0.21:8081")),  # backend's api
        ("127.0.0.12", "127.10.0.50", (RouteKind.HBONE, "127.0.0.21:8081")),  # the canonical one
        ("127.0.0.11", "127.10.0.60", (RouteKind.HBONE, "127.0.0.30:8082")),  # visible in backend
        ("127.0.0.10", "127.10.0.60", (RouteKind.PASSTHROUGH, "127.10.0.60:80")),  # hidden
        ("127.0.0.12", "127.20.3.4", (RouteKind.HBONE, "127.0.0.40:8083")),  # CIDR VIP
    ],
)
def test_services_example_routes(
    state: State, client: str, dst: str, want: tuple[RouteKind, str]
) -> None:
    assert route_from(state, client, dst) == want
