"""``/config_dump``: model -> camelCase JSON, pinned by a golden file.

Regenerate the golden file after an intended shape change with
``UPDATE_GOLDEN=1 python -m pytest tests/unit/admin/test_config_dump.py`` and review the diff.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ztunnel.admin import config_dump as dump
from ztunnel.admin.admin import build_info
from ztunnel.config import Config
from ztunnel.core.identity import Identity
from ztunnel.identity.certs import WorkloadCertificate
from ztunnel.identity.manager import CertificateStatus
from ztunnel.state.localconfig import load_local_config
from ztunnel.state.model import StringMatch, StringMatchKind
from ztunnel.state.store import State

pytestmark = pytest.mark.timeout(30)

GOLDEN = Path(__file__).parent / "golden" / "config_dump.json"

LOCAL_CONFIG = textwrap.dedent(
    """
    workloads:
    - uid: cluster1//v1/Pod/default/client
      name: client
      namespace: default
      serviceAccount: client-sa
      workloadIps: ["127.0.0.1"]
      protocol: HBONE
      node: local
      network: net1
      workloadName: client
      canonicalName: client-app
      canonicalRevision: v1
      clusterId: cluster1
      locality: {region: r1, zone: z1, subzone: s1}
      authorizationPolicies: [default/allow-client]
      waypoint:
        destination: {network: net1, address: 127.0.0.10}
      services:
        "default/echo.default.svc.cluster.local":
          80: 8080
    - uid: cluster1//v1/Pod/default/server
      name: server
      namespace: default
      workloadIps: ["127.0.0.2", "::1"]
      protocol: TCP
      workloadType: pod
      status: Unhealthy
      nativeTunnel: true
      applicationTunnel: {protocol: PROXY, port: 15088}
      networkGateway:
        destination: {namespace: istio-system, hostname: eastwest.istio-system.svc.cluster.local}
        hboneMtlsPort: 15009
      capacity: 3
      services:
        "default/echo.default.svc.cluster.local": {}
    services:
    - name: echo
      namespace: default
      hostname: echo.default.svc.cluster.local
      vips: ["/127.10.0.1", "net1/10.0.0.1"]
      cidrVips: [{network: net1, cidr: 10.20.0.0/16}, {cidr: "fd20::/64"}]
      ports: {80: 8080, 443: 0}
      subjectAltNames: ["spiffe://cluster.local/ns/default/sa/echo"]
      waypoint:
        destination: {network: "", address: 127.0.0.11}
      weightedWaypoints:
      - destination:
          destination: {network: "", address: 127.0.0.11}
        weight: 90
      - destination:
          destination: {namespace: istio-system, hostname: canary.istio-system.svc.cluster.local}
          hboneMtlsPort: 15008
        weight: 10
      visibility: Namespace
      loadBalancer:
        routingPreferences: [Region, Zone]
        mode: Failover
        healthPolicy: AllowAll
      ipFamilies: IPv4
      canonical: true
    - name: plain
      namespace: other
      hostname: plain.other.svc.cluster.local
    policies:
    - name: allow-client
      namespace: default
      scope: WorkloadSelector
      action: Allow
      dryRun: true
      rules:
      - - - namespaces: [{Exact: default}]
            notNamespaces: [{Prefix: kube-}]
            serviceAccounts: [{namespace: default, serviceAccount: client-sa}]
            notServiceAccounts: [{namespace: default, serviceAccount: bad}]
            principals: [{Suffix: /sa/client-sa}]
            notPrincipals: [{Presence: {}}]
            sourceIps: [10.0.0.0/8]
            notSourceIps: [10.1.0.0/16]
            destinationIps: [127.0.0.2/32]
            notDestinationIps: ["::1/128"]
            destinationPorts: [8080]
            notDestinationPorts: [9999]
          - destinationPorts: [80]
    - name: deny-all
      namespace: ""
      scope: Global
      action: Deny
      rules: []
    """
)

T0 = dt.datetime(2023, 3, 11, 5, 57, 26, tzinfo=dt.UTC)


def _cert(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    signer: ec.EllipticCurvePrivateKey,
    serial: int,
    days: int,
    *,
    ca: bool,
    san: str | None = None,
) -> x509.Certificate:
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(T0)
        .not_valid_after(T0 + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san is not None:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(san)]), critical=True
        )
    return b.sign(signer, hashes.SHA256())


def fixed_certificate(identity: Identity) -> WorkloadCertificate:
    """Fixed serials and validity; keys and signatures vary (ECDSA), so the PEM is normalised."""
    root_key = ec.generate_private_key(ec.SECP256R1())
    inter_key = ec.generate_private_key(ec.SECP256R1())
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    root_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster.local")])
    inter_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "intermediate")])
    root = _cert(root_name, root_name, root_key, root_key, 1001, 3650, ca=True)
    inter = _cert(inter_name, root_name, inter_key, root_key, 1002, 365, ca=True)
    leaf = _cert(
        x509.Name([]), inter_name, leaf_key, inter_key, 4242, 1, ca=False, san=str(identity)
    )
    return WorkloadCertificate(leaf_key, leaf, (inter,), (root,))


def statuses() -> list[CertificateStatus]:
    ok = Identity("cluster.local", "default", "client-sa")
    return [
        CertificateStatus(
            Identity("cluster.local", "default", "pending"), "Initializing", None, None
        ),
        CertificateStatus(ok, "Available", fixed_certificate(ok), None),
        CertificateStatus(
            Identity("cluster.local", "default", "broken"), "Unavailable", None, "CA unreachable"
        ),
    ]


def build_dump() -> dict[str, Any]:
    local = load_local_config(LOCAL_CONFIG, "golden.yaml")
    state = State()
    local.apply_to(state)
    return dump.config_dump(
        state=state,
        config=Config().summary(),
        certificates_=statuses(),
        static=local,
        version=build_info("1.26.0"),
        extra={"workloadState": lambda: {"uid-1": {"state": "Up"}}},
    )


def normalise(d: dict[str, Any]) -> dict[str, Any]:
    """Replace what legitimately varies between runs and machines, after checking its shape."""
    out: dict[str, Any] = json.loads(json.dumps(d))
    out["version"]["pythonVersion"] = "<python>"
    # config.py owns the Config fields (checked in test_config_section_is_camel_case_summary);
    # keep the golden file about the dump's own shape.
    assert out["config"] == dump.camel_config(Config().summary())
    out["config"] = "<Config.summary() with camelCase keys>"
    for entry in out["certificates"]:
        for c in entry["certChain"] + entry["rootCerts"]:
            pem = base64.b64decode(c["pem"]).decode()
            assert pem.startswith("-----BEGIN CERTIFICATE-----\n")
            x509.load_pem_x509_certificate(pem.encode())
            c["pem"] = "<base64 pem>"
    return out


def test_matches_golden_file() -> None:
    got = normalise(build_dump())
    text = json.dumps(got, indent=2, sort_keys=False) + "\n"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    want = json.loads(GOLDEN.read_text())
    assert got == want
    # Key order is part of the shape (serde emits struct field order).
    assert list(got) == list(want)
    assert list(got["workloads"][0]) == list(want["workloads"][0])


def test_top_level_keys() -> None:
    assert list(build_dump()) == [
        "workloads",
        "services",
        "policies",
        "stagedServices",
        "staticConfig",
        "version",
        "config",
        "certificates",
        "workloadState",
    ]


def test_workload_shape() -> None:
    d = build_dump()
    client, server = d["workloads"]
    assert client["uid"] == "cluster1//v1/Pod/default/client"
    assert client["protocol"] == "HBONE"
    assert client["waypoint"] == {"destination": "net1/127.0.0.10", "hboneMtlsPort": 15008}
    assert client["services"] == ["default/echo.default.svc.cluster.local"]
    assert client["locality"] == {"region": "r1", "zone": "z1", "subzone": "s1"}
    assert "networkGateway" not in client and "nativeTunnel" not in client
    assert server["workloadIps"] == ["127.0.0.2", "::1"]
    assert server["status"] == "Unhealthy"
    assert server["networkGateway"] == {
        "destination": "istio-system/eastwest.istio-system.svc.cluster.local",
        "hboneMtlsPort": 15009,
    }
    assert server["applicationTunnel"] == {"protocol": "PROXY", "port": 15088}
    assert server["workloadType"] == "pod"
    assert "locality" not in server


def test_service_shape() -> None:
    echo, plain = build_dump()["services"]
    assert echo["vips"] == ["/127.10.0.1", "net1/10.0.0.1"]
    assert echo["ports"] == {"80": 8080, "443": 0}
    assert echo["endpoints"]["cluster1//v1/Pod/default/client"] == {
        "workloadUid": "cluster1//v1/Pod/default/client",
        "port": {"80": 8080},
        "status": "Healthy",
    }
    assert echo["loadBalancer"] == {
        "routingPreferences": ["Region", "Zone"],
        "mode": "Failover",
        "healthPolicy": "AllowAll",
    }
    assert echo["ipFamilies"] == "IPv4"
    assert "ipFamilies" not in plain and "waypoint" not in plain
    assert plain["endpoints"] == {}
    # src/state/service.rs Service: cidrVips is a derived NetworkCidr ({network, cidr}),
    # skipped when empty; weightedWaypoints [{destination: GatewayAddress, weight}], skipped
    # when empty; visibility always serialized (#[serde(default)] only), Public by default.
    assert echo["cidrVips"] == [
        {"network": "net1", "cidr": "10.20.0.0/16"},
        {"network": "", "cidr": "fd20::/64"},
    ]
    assert echo["weightedWaypoints"] == [
        {"destination": {"destination": "/127.0.0.11", "hboneMtlsPort": 15008}, "weight": 90},
        {
            "destination": {
                "destination": "istio-system/canary.istio-system.svc.cluster.local",
                "hboneMtlsPort": 15008,
            },
            "weight": 10,
        },
    ]
    assert echo["visibility"] == "Namespace" and plain["visibility"] == "Public"
    assert "cidrVips" not in plain and "weightedWaypoints" not in plain
    # serde emits struct field order
    assert list(echo) == [
        "name",
        "namespace",
        "hostname",
        "vips",
        "cidrVips",
        "ports",
        "endpoints",
        "subjectAltNames",
        "waypoint",
        "weightedWaypoints",
        "loadBalancer",
        "ipFamilies",
        "canonical",
        "visibility",
    ]


def test_policy_shape() -> None:
    deny, allow = build_dump()["policies"]  # sorted by key: "/deny-all" < "default/..."
    assert (deny["name"], deny["scope"], deny["action"], deny["rules"]) == (
        "deny-all",
        "Global",
        "Deny",
        [],
    )
    m = allow["rules"][0][0][0]
    assert m["namespaces"] == [{"Exact": "default"}]
    assert m["notPrincipals"] == [{"Presence": []}]
    assert m["serviceAccounts"] == [{"namespace": "default", "serviceAccount": "client-sa"}]
    assert m["sourceIps"] == ["10.0.0.0/8"]
    assert allow["rules"][0][0][1] == {"destinationPorts": [80]}  # second match, same clause
    assert allow["dryRun"] is True


def test_string_match_spellings() -> None:
    assert dump.string_match(StringMatch(StringMatchKind.PREFIX, "a")) == {"Prefix": "a"}
    assert dump.string_match(StringMatch(StringMatchKind.SUFFIX, "b")) == {"Suffix": "b"}


def test_certificates() -> None:
    broken, ok, pending = build_dump()["certificates"]  # sorted by identity
    assert pending == {
        "identity": "spiffe://cluster.local/ns/default/sa/pending",
        "state": "Initializing",
        "certChain": [],
        "rootCerts": [],
    }
    assert broken["state"] == "Unavailable: CA unreachable"
    assert ok["state"] == "Available"
    leaf, inter = ok["certChain"]
    assert leaf["serialNumber"] == "4242"
    assert leaf["validFrom"] == "2023-03-11T05:57:26Z"
    assert leaf["expirationTime"] == "2023-03-12T05:57:26Z"
    assert inter["serialNumber"] == "1002"
    assert [r["serialNumber"] for r in ok["rootCerts"]] == ["1001"]


def test_static_config_keeps_file_port_maps() -> None:
    static = build_dump()["staticConfig"]
    assert list(static) == ["workloads", "policies", "services"]
    assert static["workloads"][0]["services"] == {
        "default/echo.default.svc.cluster.local": {"80": 8080}
    }
    assert static["services"][0]["endpoints"] == {}
    assert dump.static_config(None) == {"workloads": [], "policies": [], "services": []}


def test_config_section_is_camel_case_summary() -> None:
    cfg = build_dump()["config"]
    summary = Config().summary()
    assert cfg["proxyMode"] == summary["proxy_mode"]
    assert cfg["connectionTerminationDeadline"] == "5s"
    assert len(cfg) == len(summary)
