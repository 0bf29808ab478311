"""``/config_dump`` as istioctl decodes it: the connections of each proxied workload in Rust's shape
(istio/ztunnel ``src/proxy/connection_manager.rs`` ``ConnectionManager``'s ``Serialize``,
``src/inpod/admin.rs`` ``ProxyState``), checked against a hand-written schema of istioctl's Go
structs and a Go program built from hand-written structs of the same names and types, for every
``istioctl ztunnel-config`` subcommand. The live version is tests/netns/test_operators.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from tests.golden import SUBCOMMANDS, istioctl, table
from tests.golden.istioctl_schema import DecodeError, decode
from tests.unit.admin.test_config_dump import build_dump
from ztunnel.admin import config_dump as dump
from ztunnel.core.addr import SocketAddr
from ztunnel.core.identity import Identity

pytestmark = pytest.mark.timeout(120)


@dataclass
class Rec:
    """A connection record as the dump reads it (ConnectionView)."""

    direction: str
    src: SocketAddr
    dst: SocketAddr
    orig_dst: SocketAddr | None = None
    for_host: str | None = None
    mtls: bool = False
    src_identity: Identity | None = None
    double_hbone: bool = False


A = SocketAddr.parse
PEER = Identity("cluster.local", "default", "client-sa")
LIVE = [
    # outbound HBONE through the service VIP: captured 10.0.0.1:80, next hop 127.0.0.2:15008
    Rec("outbound", A("127.0.0.1:40000"), A("127.0.0.2:15008"), A("10.0.0.1:80"), mtls=True),
    # outbound plaintext passthrough: no orig_dst kept when it equals the dialled address
    Rec("outbound", A("127.0.0.1:40001"), A("192.0.2.9:443")),
    # inbound HBONE, and one naming a host in Forwarded
    Rec("inbound", A("127.0.0.1:40002"), A("127.0.0.2:8080"), mtls=True, src_identity=PEER),
    Rec(
        "inbound",
        A("[::1]:40003"),
        A("[::1]:8080"),
        for_host="echo.default.svc.cluster.local",
        mtls=True,
        src_identity=PEER,
    ),
    # inbound plaintext (15006)
    Rec("inbound", A("192.0.2.7:5555"), A("127.0.0.2:8080")),
]


def test_connections_in_rusts_shape() -> None:
    # Rust ConnectionManager::serialize: {inbound: [InboundConnectionDump], outbound:
    # [OutboundConnection]}, camelCase, SocketAddr as text, originalDst Option<String> inbound.
    got = dump.connections(LIVE)
    assert got == {
        "inbound": [
            {
                "src": "127.0.0.1:40002",
                "originalDst": None,
                "actualDst": "127.0.0.2:8080",
                "protocol": "HBONE",
            },
            {
                "src": "192.0.2.7:5555",
                "originalDst": None,
                "actualDst": "127.0.0.2:8080",
                "protocol": "TCP",
            },
            {
                "src": "[::1]:40003",
                "originalDst": "echo.default.svc.cluster.local",
                "actualDst": "[::1]:8080",
                "protocol": "HBONE",
            },
        ],
        "outbound": [
            {
                "src": "127.0.0.1:40000",
                "originalDst": "10.0.0.1:80",
                "actualDst": "127.0.0.2:15008",
                "protocol": "HBONE",
            },
            {
                "src": "127.0.0.1:40001",
                "originalDst": "192.0.2.9:443",
                "actualDst": "192.0.2.9:443",
                "protocol": "TCP",
            },
        ],
    }
    assert dump.connections([]) == {"inbound": [], "outbound": []}
    # Through a network gateway: Rust's OutboundProtocol::DOUBLEHBONE.
    gw = Rec("outbound", A("127.0.0.1:40009"), A("192.0.2.1:15008"), A("10.0.0.1:80"), mtls=True)
    gw.double_hbone = True
    assert dump.connections([gw])["outbound"][0]["protocol"] == "DOUBLEHBONE"


def test_workload_state_up_and_pending() -> None:
    # Rust ProxyState: state, connections (skipped when None: a pending proxy), info.
    got = dump.workload_state(
        [
            dump.ProxyView("uid-b", "b", "ns", "sa-b", "Pending"),
            dump.ProxyView("uid-a", "a", "ns", "sa-a", "Up", LIVE[:1]),
        ]
    )
    assert list(got) == ["uid-a", "uid-b"]
    assert got["uid-b"] == {
        "state": "Pending",
        "info": {"name": "b", "namespace": "ns", "serviceAccount": "sa-b"},
    }
    assert got["uid-a"]["state"] == "Up"
    assert got["uid-a"]["connections"]["outbound"][0]["originalDst"] == "10.0.0.1:80"


def full_dump() -> dict[str, Any]:
    d = build_dump()
    d["workloadState"] = dump.workload_state(
        [
            dump.ProxyView("uid-1", "client", "default", "client-sa", "Up", LIVE),
            dump.ProxyView("uid-2", "server", "default", "server-sa", "Pending"),
        ]
    )
    return d


def test_schema_decodes_every_section() -> None:
    d = decode(json.loads(json.dumps(full_dump())))
    assert sorted(w["name"] for w in d["workloads"]) == ["client", "server"]
    assert sorted(s["name"] for s in d["services"]) == ["echo", "plain"]
    assert sorted(p["name"] for p in d["policies"]) == ["allow-client", "deny-all"]
    assert [c["identity"] for c in d["certificates"]][1] == str(PEER)
    state = d["workloadState"]["uid-1"]
    assert state["info"]["name"] == "client"
    assert len(state["connections"]["inbound"]) == 3
    assert len(state["connections"]["outbound"]) == 2
    assert d["workloadState"]["uid-2"]["connections"] == {"inbound": None, "outbound": None}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        # What ztunnel-py emitted before (the error, word for word).
        (
            lambda d: d["workloadState"]["uid-1"].__setitem__("connections", 0),
            "json: cannot unmarshal number into Go struct field "
            "WorkloadState.workloadstate.connections of type configdump.WorkloadConnections",
        ),
        (
            lambda d: d["workloads"][0].__setitem__("capacity", -1),
            "json: cannot unmarshal number -1 into Go struct field ZtunnelWorkload.capacity "
            "of type uint32",
        ),
        (
            lambda d: d["services"][0].__setitem__("ports", {"80": "8080"}),
            "json: cannot unmarshal string into Go struct field ZtunnelService.ports of type int",
        ),
        (
            lambda d: d["certificates"][0].__setitem__("certChain", {}),
            "json: cannot unmarshal object into Go struct field CertsDump.certChain "
            "of type []*configdump.Cert",
        ),
    ],
)
def test_schema_rejects_what_istioctl_rejects(mutate: Any, message: str) -> None:
    d = json.loads(json.dumps(full_dump()))
    mutate(d)
    with pytest.raises(DecodeError, match=re.escape(message)):
        decode(d)
    # The Go stand-in fails with the same message, for every subcommand (Prime decodes all).
    r = istioctl("all", json.dumps(d).encode())
    assert r.returncode == 1 and message in r.stderr, r.stderr


def test_go_decoder_prints_every_subcommand() -> None:
    body = json.dumps(full_dump(), indent=2).encode()
    out = {}
    for sub in SUBCOMMANDS:
        r = istioctl(sub, body)
        assert r.returncode == 0, (sub, r.stderr)
        out[sub] = table(r.stdout)
    assert out["workload"][1:] == [
        ["default", "client", "127.0.0.1", "local", "NA", "HBONE"],
        ["default", "server", "127.0.0.2,::1", "None", "TCP"],
    ]
    assert [r[:2] for r in out["service"][1:]] == [["default", "echo"], ["other", "plain"]]
    assert [r[-3:] for r in out["policy"][1:]] == [
        ["deny-all", "Deny", "Global"],
        ["allow-client", "Allow", "WorkloadSelector"],
    ]
    assert {r[0] for r in out["certificate"][1:]} == {
        "spiffe://cluster.local/ns/default/sa/broken",
        str(PEER),
        "spiffe://cluster.local/ns/default/sa/pending",
    }
    # Names instead of addresses where the dump knows them (workload IPs, service VIPs).
    assert out["connections"] == [
        ["WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE", "TARGET", "PROTOCOL"],
        ["client.default", "Inbound", "server.default:8080", "client.default:40002", "HBONE"],
        ["client.default", "Inbound", "server.default:8080", "192.0.2.7:5555", "TCP"],
        [
            "client.default",
            "Inbound",
            "[::1]:8080",
            "[::1]:40003",
            "echo.default.svc.cluster.local",
            "HBONE",
        ],
        [
            "client.default",
            "Outbound",
            "client.default:40000",
            "server.default:15008",
            "10.0.0.1:80",  # not the first VIP: istioctl maps only that one
            "HBONE",
        ],
        [
            "client.default",
            "Outbound",
            "client.default:40001",
            "192.0.2.9:443",
            "192.0.2.9:443",
            "TCP",
        ],
    ]
    # `all` prints the five summaries in order.
    assert out["all"] == [
        *out["workload"],
        *out["service"],
        *out["policy"],
        *out["certificate"],
        *out["connections"],
    ]


def test_istioctl_reads_cidr_vips_and_visibility() -> None:
    # istioctl api.go ZtunnelService: cidrVips []CIDRVIP (an object or a "network/cidr" string,
    # written back as the string) and visibility string; weightedWaypoints is not a field of its
    # and is ignored. Rust (src/state/service.rs) emits cidrVips as {network, cidr} objects.
    d = decode(json.loads(json.dumps(full_dump())))
    echo, plain = sorted(d["services"], key=lambda s: s["name"])
    assert echo["cidrVips"] == [
        {"cidr": "10.20.0.0/16", "network": "net1"},
        {"cidr": "fd20::/64", "network": ""},
    ]
    assert (echo["visibility"], plain["visibility"]) == ("Namespace", "Public")
    assert plain["cidrVips"] is None
    # `istioctl ztunnel-config service -o json` (PrintServiceDump) through the Go stand-in
    r = istioctl("service-json", json.dumps(full_dump()).encode())
    assert r.returncode == 0, r.stderr
    by_name = {s["name"]: s for s in json.loads(r.stdout)}
    assert by_name["echo"]["cidrVips"] == ["net1/10.20.0.0/16", "/fd20::/64"]
    assert by_name["echo"]["visibility"] == "Namespace"
    assert by_name["plain"]["visibility"] == "Public" and "cidrVips" not in by_name["plain"]
    assert "weightedWaypoints" not in by_name["echo"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["net1-no-slash"], 'invalid cidrVip "net1-no-slash"'),
        (
            [7],
            "json: cannot unmarshal number into Go struct field ZtunnelService.cidrVips "
            "of type string",
        ),
    ],
)
def test_cidr_vips_istioctl_cannot_read(value: Any, message: str) -> None:
    # The shapes istioctl refuses (its CIDRVIP.UnmarshalJSON), so a wrong one would show here:
    # in the schema and in the Go stand-in alike.
    d = json.loads(json.dumps(full_dump()))
    d["services"][0]["cidrVips"] = value
    with pytest.raises(DecodeError, match=re.escape(message)):
        decode(d)
    r = istioctl("service", json.dumps(d).encode())
    assert r.returncode == 1 and message in r.stderr, r.stderr
