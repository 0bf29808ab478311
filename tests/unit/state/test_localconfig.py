"""Local config loader: the Rust file shape loads unchanged; each bad file gives one pointed error."""

from __future__ import annotations

import ipaddress
import textwrap
from importlib import resources

import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.state.localconfig import LocalConfig, LocalConfigError, load_local_config
from ztunnel.state.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancerMode,
    LoadBalancerScope,
    LoadBalancing,
    Locality,
    Match,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    PolicyAction,
    PolicyScope,
    ServiceAccountMatch,
    ServicePort,
    StringMatch,
    StringMatchKind,
    TunnelProtocol,
    WorkloadStatus,
)
from ztunnel.state.store import State


def y(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def na(text: str, network: str = "") -> NetworkAddress:
    return NetworkAddress(network, parse_ip(text))


# The shape of istio/ztunnel examples/localhost.yaml (written here, not copied): uid'd pods with
# per-service port maps, a namespace policy with a triple-nested rule, VIPs on two networks.
RUST_SHAPE = y(
    """
    workloads:
    - uid: cluster1//v1/Pod/default/local
      name: local
      namespace: default
      serviceAccount: default
      workloadIps: ["127.0.0.1"]
      protocol: HBONE
      node: local
      network: ""
      services:
        "default/example.com":
          80: 8080
        "default/example2.com":
          80: 8080
    - uid: cluster1//v1/Pod/default/local-tcp
      name: local-tcp
      namespace: default
      serviceAccount: default
      workloadIps: ["127.0.0.2"]
      protocol: TCP
      node: local
      network: ""
      services:
        "default/example.com":
          80: 8080
    policies:
      - action: Allow
        rules:
        - - - notDestinationPorts:
              - 9999
        name: deny-9999
        namespace: default
        scope: Namespace
    services:
    - name: local
      namespace: default
      hostname: example.com
      vips:
        - /127.10.0.1
      ports:
        80: 8080
      subjectAltNames:
       - spiffe://cluster.local/ns/default/sa/local
    - name: remote
      namespace: default
      hostname: example2.com
      vips:
        - remote/127.10.0.2
      ports:
        80: 8080
    """
)


def test_rust_shape_loads_and_applies() -> None:
    cfg = load_local_config(RUST_SHAPE, "localhost.yaml")
    assert [w.uid for w in cfg.workloads] == [
        "cluster1//v1/Pod/default/local",
        "cluster1//v1/Pod/default/local-tcp",
    ]
    local = cfg.workloads[0]
    assert local.protocol is TunnelProtocol.HBONE
    assert cfg.workloads[1].protocol is TunnelProtocol.NONE
    assert local.services == {"default/example.com": {80: 8080}, "default/example2.com": {80: 8080}}
    # Defaults the file leaves out: Rust's serde defaults (src/state/workload.rs Workload), not
    # the xDS conversion's.
    assert local.trust_domain == ""
    assert str(local.identity) == "spiffe:///ns/default/sa/default"
    assert local.cluster_id == ""  # Rust file mode: no clusterId means empty
    assert local.capacity == 1
    assert local.status is WorkloadStatus.HEALTHY
    (p,) = cfg.policies
    assert (p.key, p.scope, p.action, p.dry_run) == (
        "default/deny-9999",
        PolicyScope.NAMESPACE,
        PolicyAction.ALLOW,
        False,
    )
    assert p.rules[0].clauses[0].matches[0] == Match(not_destination_ports=(9999,))
    assert cfg.services[1].vips == (na("127.10.0.2", "remote"),)

    st = State()
    cfg.apply_to(st)
    example = st.find_service_by_vip(na("127.10.0.1"))
    assert example is not None and example.key == "default/example.com"
    assert st.find_address(na("127.10.0.2", "remote")) == cfg.services[1]
    assert {w.name for w in st.endpoints(example)} == {"local", "local-tcp"}
    assert st.find_workload_by_info("local", "default", "default", node="local") == local
    assert st.policies_for(local) == [p]


def test_bundled_example_loads() -> None:
    ref = resources.files("ztunnel") / "examples" / "localhost.yaml"
    cfg = load_local_config(ref.read_text(), "localhost.yaml")
    assert len(cfg.workloads) >= 2 and cfg.services
    st = State()
    cfg.apply_to(st)
    for w in cfg.workloads:
        assert all(ip.is_loopback for ip in w.addresses)
        assert st.find_workload_by_uid(w.uid) == w
    for s in cfg.services:
        assert st.find_service_by_vip(s.vips[0]) == s
        picked = st.load_balance(s, s.ports[0].service_port, None)
        assert picked is not None and picked[0] in cfg.workloads


FULL = y(
    """
    workloads:
    - uid: c1//v1/Pod/ns/full
      name: full
      namespace: ns
      workloadIps: ["10.0.0.1", "fd00::1"]
      protocol: HBONE
      trustDomain: example.org
      serviceAccount: sa
      network: net1
      node: node1
      clusterId: c1
      canonicalName: app
      canonicalRevision: v2
      workloadName: app-v2
      workloadType: pod
      nativeTunnel: true
      applicationTunnel: {protocol: PROXY, port: 15088}
      authorizationPolicies: [ns/sel]
      status: Unhealthy
      locality: {region: r1, zone: z1, subzone: s1}
      networkMode: Standard
      capacity: 5
      waypoint: {destination: "net1/10.0.0.100", hboneMtlsPort: 15009}
      networkGateway: {destination: "ns/eastwest.ns.svc.cluster.local"}
      services:
        ns/svc.ns.svc.cluster.local: {"80": 8080, 443: 8443}
        ns/empty.example.com:
    - name: dns
      namespace: ns
      hostname: dns.example.com
      networkMode: HostNetwork
      waypoint:
        destination: {namespace: ns, hostname: wp.ns.svc.cluster.local}
    services:
    - name: svc
      namespace: ns
      hostname: svc.ns.svc.cluster.local
      vips: ["net1/10.96.0.1", "net1/fd00:96::1"]
      ports: {80: 8080, 443: 0}
      subjectAltNames: ["spiffe://example.org/ns/ns/sa/sa"]
      canonical: true
      ipFamilies: Dual
      waypoint: {destination: {network: net1, address: 10.0.0.100}}
      loadBalancer:
        routingPreferences: [Network, Region, Zone, Subzone, Node, Cluster]
        mode: Failover
        healthPolicy: AllowAll
    - name: headless
      namespace: ns
      hostname: headless.ns.svc.cluster.local
      vips: []
      ports: {}
      loadBalancer: {mode: Strict}
    policies:
    - name: sel
      namespace: ns
      scope: WorkloadSelector
      action: Deny
      dryRun: true
      rules:
      - - - namespaces: [{Exact: ns}, {Prefix: team-}]
            notNamespaces: [{Suffix: -test}]
            principals: [{Presence: []}, !Exact cluster.local/ns/a/sa/b]
            notPrincipals: [!Presence ""]
            serviceAccounts: [{namespace: ns, serviceAccount: sa}]
            notServiceAccounts: [{namespace: bad, serviceAccount: sa}]
            sourceIps: ["10.0.0.0/8", "fd00::/8"]
            notSourceIps: ["10.1.2.3/32"]
            destinationIps: ["192.168.1.7/24"]
            notDestinationIps: ["0.0.0.0/0"]
            destinationPorts: [80, 443]
            notDestinationPorts: [9999]
          - {}
        - []
      - []
    - name: mesh
      namespace: istio-system
      scope: Global
      action: Allow
      rules: []
    """
)


def test_every_field() -> None:
    cfg = load_local_config(FULL, "full.yaml")
    full, dns = cfg.workloads
    assert full.addresses == (parse_ip("10.0.0.1"), parse_ip("fd00::1"))
    assert (full.trust_domain, full.service_account, full.network, full.node, full.cluster_id) == (
        "example.org",
        "sa",
        "net1",
        "node1",
        "c1",
    )
    assert (full.canonical_name, full.canonical_revision, full.workload_name) == (
        "app",
        "v2",
        "app-v2",
    )
    assert full.workload_type == "pod"
    assert full.native_tunnel is True
    assert full.application_tunnel == ApplicationTunnel(AppTunnelProtocol.PROXY, 15088)
    assert full.authorization_policies == ("ns/sel",)
    assert full.status is WorkloadStatus.UNHEALTHY
    assert full.locality == Locality("r1", "z1", "s1")
    assert full.network_mode is NetworkMode.STANDARD
    assert full.capacity == 5
    assert full.waypoint == GatewayAddress(address=na("10.0.0.100", "net1"), hbone_mtls_port=15009)
    assert full.network_gateway == GatewayAddress(
        hostname=NamespacedHostname("ns", "eastwest.ns.svc.cluster.local")
    )
    assert full.services == {
        "ns/svc.ns.svc.cluster.local": {80: 8080, 443: 8443},
        "ns/empty.example.com": {},
    }
    assert full.identity.principal == "example.org/ns/ns/sa/sa"

    assert dns.uid == "Kubernetes//v1/Pod/ns/dns"  # synthesised the way istiod names pods
    assert dns.addresses == () and dns.hostname == "dns.example.com"
    assert dns.network_mode is NetworkMode.HOST_NETWORK
    assert dns.service_account == ""  # Rust: serde default
    assert dns.waypoint == GatewayAddress(
        hostname=NamespacedHostname("ns", "wp.ns.svc.cluster.local")
    )

    svc, headless = cfg.services
    assert svc.vips == (na("10.96.0.1", "net1"), na("fd00:96::1", "net1"))
    assert svc.ports == (ServicePort(80, 8080), ServicePort(443, 0))
    assert svc.canonical and svc.ip_families is IPFamilies.DUAL
    assert svc.waypoint == GatewayAddress(address=na("10.0.0.100", "net1"))
    assert svc.load_balancing == LoadBalancing(
        routing_preference=(
            LoadBalancerScope.NETWORK,
            LoadBalancerScope.REGION,
            LoadBalancerScope.ZONE,
            LoadBalancerScope.SUBZONE,
            LoadBalancerScope.NODE,
            LoadBalancerScope.CLUSTER,
        ),
        mode=LoadBalancerMode.FAILOVER,
        health_policy=HealthPolicy.ALLOW_ALL,
    )
    assert headless.vips == () and headless.ports == ()
    assert headless.load_balancing == LoadBalancing(mode=LoadBalancerMode.STRICT)

    sel, mesh = cfg.policies
    assert (sel.scope, sel.action, sel.dry_run) == (
        PolicyScope.WORKLOAD_SELECTOR,
        PolicyAction.DENY,
        True,
    )
    assert (mesh.scope, mesh.rules) == (PolicyScope.GLOBAL, ())
    assert len(sel.rules) == 2 and sel.rules[1].clauses == ()
    c0, c1 = sel.rules[0].clauses
    assert c1.matches == ()
    m, empty = c0.matches
    assert empty == Match()
    assert m.namespaces == (
        StringMatch(StringMatchKind.EXACT, "ns"),
        StringMatch(StringMatchKind.PREFIX, "team-"),
    )
    assert m.not_namespaces == (StringMatch(StringMatchKind.SUFFIX, "-test"),)
    assert m.principals == (
        StringMatch(StringMatchKind.PRESENCE),
        StringMatch(StringMatchKind.EXACT, "cluster.local/ns/a/sa/b"),
    )
    assert m.not_principals == (StringMatch(StringMatchKind.PRESENCE),)
    assert m.service_accounts == (ServiceAccountMatch("ns", "sa"),)
    assert m.not_service_accounts == (ServiceAccountMatch("bad", "sa"),)
    assert m.source_ips == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))
    assert m.not_source_ips == (ipaddress.ip_network("10.1.2.3/32"),)
    assert m.destination_ips == (ipaddress.ip_network("192.168.1.0/24"),)  # host bits allowed
    assert m.not_destination_ips == (ipaddress.ip_network("0.0.0.0/0"),)
    assert (m.destination_ports, m.not_destination_ports) == ((80, 443), (9999,))

    st = State()
    cfg.apply_to(st)
    assert st.policies_for(full) == [mesh, sel]
    # The host-network workload is not indexed by IP; an unhealthy endpoint is allowed here.
    assert st.load_balance(svc, 80, None) == (full, 8080)


@pytest.mark.parametrize(
    "text", ["", "# nothing\n", "---\n", "{}\n", "workloads:\nservices: ~\npolicies: []\n"]
)
def test_empty_documents(text: str) -> None:
    assert load_local_config(text) == LocalConfig()


def test_workload_defaults() -> None:
    cfg = load_local_config("workloads:\n- namespace: ns\n  name: a\n  trustDomain: ''\n")
    (w,) = cfg.workloads
    # Rust: serde defaults, empty (no clusterId in baggage; identity spiffe:///ns/ns/sa/)
    assert (w.uid, w.trust_domain, w.service_account, w.cluster_id, w.workload_type) == (
        "Kubernetes//v1/Pod/ns/a",
        "",
        "",
        "",
        "",
    )
    assert (w.protocol, w.capacity, w.addresses, w.network, w.services) == (
        TunnelProtocol.NONE,
        1,
        (),
        "",
        {},
    )


def test_plain_scalars_read_as_strings_like_serde_yaml() -> None:
    # YAML 1.1 would turn these into False / 123; serde_yaml keeps the text for String fields.
    cfg = load_local_config("workloads:\n- namespace: no\n  name: 123\n  node: on\n")
    (w,) = cfg.workloads
    assert (w.namespace, w.name, w.node) == ("no", "123", "on")


def test_same_ip_on_different_networks_is_fine() -> None:
    text = y(
        """
        workloads:
        - {uid: a, namespace: ns, workloadIps: [10.0.0.1], network: n1}
        - {uid: b, namespace: ns, workloadIps: [10.0.0.1], network: n2}
        - {uid: c, namespace: ns, workloadIps: [10.0.0.1], network: n1, networkMode: HostNetwork}
        """
    )
    assert len(load_local_config(text).workloads) == 3


def test_apply_to_replaces_previous_config() -> None:
    st = State()
    load_local_config(RUST_SHAPE).apply_to(st)
    smaller = y(
        """
        workloads:
        - {uid: cluster1//v1/Pod/default/local, namespace: default, name: local, workloadIps: [127.0.0.9]}
        services:
        - {name: local, namespace: default, hostname: example.com, vips: [/127.10.0.1], ports: {80: 80}}
        """
    )
    load_local_config(smaller).apply_to(st)
    assert [w.name for w in st.workloads()] == ["local"]
    assert [s.key for s in st.services()] == ["default/example.com"]
    assert list(st.policies()) == []
    assert st.find_workload_by_addr(na("127.0.0.1")) is None
    assert st.find_workload_by_addr(na("127.0.0.9")) is not None


# --- bad configs ---------------------------------------------------------------------------
# Each case: the YAML, the key path the error must name, the text whose first occurrence marks the
# expected line:column, and a fragment of the reason.

W = "workloads:\n- uid: a\n  namespace: ns\n"  # a valid first workload to prefix cases with

BAD: list[tuple[str, str, str, str, str]] = [
    ("unknown-top", "workload:\n- {}\n", "workload", "workload", "unknown key 'workload'"),
    ("top-list", "- name: a\n", "", "- name", "expected a mapping, got a list"),
    (
        "old-singular-ip",
        W + "  workloadIp: 10.0.0.1\n",
        "workloads[0].workloadIp",
        "workloadIp",
        "unknown key",
    ),
    (
        "missing-namespace",
        W + "- uid: b\n  name: b\n",
        "workloads[1]",
        "uid: b",
        "missing required key 'namespace'",
    ),
    (
        "bad-ip",
        W + "- uid: b\n  namespace: ns\n  workloadIps: [10.0.0.1, 10.0.0.x]\n",
        "workloads[1].workloadIps[1]",
        "10.0.0.x",
        "invalid IP address '10.0.0.x'",
    ),
    (
        "ips-not-list",
        W + "  workloadIps: 10.0.0.1\n",
        "workloads[0].workloadIps",
        "10.0.0.1",
        "expected a list",
    ),
    (
        "bad-protocol",
        W + "  protocol: UDP\n",
        "workloads[0].protocol",
        "UDP",
        "expected one of: TCP, HBONE",
    ),
    (
        "bad-status",
        W + "  status: healthy\n",
        "workloads[0].status",
        "healthy",
        "Healthy, Unhealthy",
    ),
    (
        "bad-network-mode",
        W + "  networkMode: Host\n",
        "workloads[0].networkMode",
        "Host\n",
        "HostNetwork",
    ),
    (
        "bad-bool",
        W + "  nativeTunnel: yes\n",
        "workloads[0].nativeTunnel",
        "yes",
        "expected true or false",
    ),
    (
        "negative-capacity",
        W + "  capacity: -1\n",
        "workloads[0].capacity",
        "-1",
        "-1 out of range 0-4294967295",
    ),
    (
        "name-is-mapping",
        W + "  name: {a: b}\n",
        "workloads[0].name",
        "{a: b}",
        "expected a string, got a mapping",
    ),
    (
        "name-is-null",
        "workloads:\n- uid: a\n  namespace: ~\n",
        "workloads[0].namespace",
        "~",
        "expected a string, got null",
    ),
    (
        "duplicate-uid",
        W + "- uid: a\n  namespace: ns2\n",
        "workloads[1].uid",
        "a\n  namespace: ns2",
        "duplicate uid 'a' (workloads[0])",
    ),
    (
        "ip-claimed-twice",
        W
        + "  workloadIps: [10.0.0.1]\n- uid: b\n  namespace: ns\n  workloadIps: [10.0.0.2, 10.0.0.1]\n",
        "workloads[1].workloadIps[1]",
        "@2:10.0.0.1",
        "already used by workload 'a' (workloads[0].workloadIps[0])",
    ),
    (
        "dup-yaml-key",
        W + "  namespace: other\n",
        "workloads[0].namespace",
        "namespace: other",
        "duplicate key 'namespace'",
    ),
    (
        "svc-key-format",
        W + "  services:\n    example.com: {80: 8080}\n",
        "workloads[0].services['example.com']",
        "example.com",
        "'<namespace>/<hostname>'",
    ),
    (
        "port-range",
        W + "  services:\n    ns/h: {80: 70000}\n",
        "workloads[0].services['ns/h'][80]",
        "70000",
        "70000 out of range 0-65535",
    ),
    (
        "port-not-int",
        W + "  services:\n    ns/h: {http: 8080}\n",
        "workloads[0].services['ns/h']",
        "http",
        "expected an integer",
    ),
    (
        "port-quoted-value",
        W + "  services:\n    ns/h: {80: '8080'}\n",
        "workloads[0].services['ns/h'][80]",
        "'8080'",
        "expected an integer",
    ),
    (
        "gateway-missing-dest",
        W + "  waypoint: {hboneMtlsPort: 15008}\n",
        "workloads[0].waypoint",
        "{hboneMtlsPort",
        "missing required key 'destination'",
    ),
    (
        "gateway-bad-dest",
        W + "  waypoint: {destination: nothing}\n",
        "workloads[0].waypoint.destination",
        "nothing",
        "invalid destination 'nothing'",
    ),
    (
        "gateway-bad-ip",
        W + "  networkGateway: {destination: {address: 1.2.3}}\n",
        "workloads[0].networkGateway.destination.address",
        "1.2.3",
        "invalid IP address",
    ),
    (
        "app-tunnel-protocol",
        W + "  applicationTunnel: {protocol: Proxy}\n",
        "workloads[0].applicationTunnel.protocol",
        "Proxy",
        "NONE, PROXY",
    ),
    (
        "locality-unknown",
        W + "  locality: {country: x}\n",
        "workloads[0].locality.country",
        "country",
        "unknown key",
    ),
    (
        "svc-missing-hostname",
        "services:\n- name: a\n  namespace: ns\n",
        "services[0]",
        "name: a",
        "missing required key 'hostname'",
    ),
    (
        "vip-no-network",
        "services:\n- {name: a, namespace: ns, hostname: h, vips: [10.96.0.1]}\n",
        "services[0].vips[0]",
        "10.96.0.1",
        "expected '<network>/<ip>'",
    ),
    (
        "vip-bad-ip",
        "services:\n- {name: a, namespace: ns, hostname: h, vips: [/10.96.0.300]}\n",
        "services[0].vips[0]",
        "/10.96",
        "invalid IP address",
    ),
    (
        "svc-unsupported",
        "services:\n- {name: a, namespace: ns, hostname: h, endpoints: {}}\n",
        "services[0].endpoints",
        "endpoints",
        "not supported",
    ),
    (
        "lb-bad-scope",
        "services:\n- name: a\n  namespace: ns\n  hostname: h\n  loadBalancer: {routingPreferences: [Region, Rack]}\n",
        "services[0].loadBalancer.routingPreferences[1]",
        "Rack",
        "Region, Zone",
    ),
    (
        "lb-bad-mode",
        "services:\n- {name: a, namespace: ns, hostname: h, loadBalancer: {mode: STRICT}}\n",
        "services[0].loadBalancer.mode",
        "STRICT",
        "Standard, Strict",
    ),
    (
        "ip-families",
        "services:\n- {name: a, namespace: ns, hostname: h, ipFamilies: IPv5}\n",
        "services[0].ipFamilies",
        "IPv5",
        "Dual, IPv4, IPv6",
    ),
    (
        "dup-service",
        "services:\n- {name: a, namespace: ns, hostname: h}\n- {name: b, namespace: ns, hostname: h}\n",
        "services[1]",
        "{name: b",
        "duplicate service 'ns/h' (services[0])",
    ),
]

P = "policies:\n- name: p\n  namespace: ns\n  scope: Namespace\n  action: Allow\n"
BAD += [
    ("policy-missing-rules", P, "policies[0]", "name: p", "missing required key 'rules'"),
    (
        "policy-bad-action",
        P.replace("Allow", "allow") + "  rules: []\n",
        "policies[0].action",
        "allow",
        "Allow, Deny",
    ),
    (
        "policy-bad-scope",
        P.replace("Namespace", "Mesh") + "  rules: []\n",
        "policies[0].scope",
        "Mesh",
        "Global, Namespace, WorkloadSelector",
    ),
    (
        "rules-too-shallow",
        P + "  rules:\n  - - namespaces: []\n",
        "policies[0].rules[0][0]",
        "namespaces",
        "expected a list, got a mapping",
    ),
    (
        "bad-cidr",
        P + "  rules: [[[{sourceIps: [10.0.0.0/33]}]]]\n",
        "policies[0].rules[0][0][0].sourceIps[0]",
        "10.0.0.0/33",
        "invalid CIDR",
    ),
    (
        "bare-ip-cidr",
        P + "  rules: [[[{destinationIps: [10.0.0.1]}]]]\n",
        "policies[0].rules[0][0][0].destinationIps[0]",
        "10.0.0.1",
        "<prefix length>",
    ),
    (
        "bad-string-match",
        P + "  rules: [[[{principals: [{Regex: x}]}]]]\n",
        "policies[0].rules[0][0][0].principals[0].Regex",
        "Regex",
        "invalid string match 'Regex'",
    ),
    (
        "string-match-bare",
        P + "  rules: [[[{namespaces: [ns]}]]]\n",
        "policies[0].rules[0][0][0].namespaces[0]",
        "ns]",
        "expected {Exact|Prefix|Suffix",
    ),
    (
        "presence-value",
        P + "  rules: [[[{principals: [{Presence: x}]}]]]\n",
        "policies[0].rules[0][0][0].principals[0].Presence",
        "x}",
        "Presence takes no value",
    ),
    (
        "sa-match-missing",
        P + "  rules: [[[{serviceAccounts: [{namespace: ns}]}]]]\n",
        "policies[0].rules[0][0][0].serviceAccounts[0]",
        "{namespace: ns}",
        "missing required key 'serviceAccount'",
    ),
    (
        "match-unknown-key",
        P + "  rules: [[[{ports: [80]}]]]\n",
        "policies[0].rules[0][0][0].ports",
        "ports",
        "unknown key 'ports'",
    ),
    (
        "dry-run-string",
        P + "  rules: []\n  dryRun: 'true'\n",
        "policies[0].dryRun",
        "'true'",
        "expected true or false",
    ),
    (
        "dup-policy",
        P + "  rules: []\n" + P[len("policies:\n") :] + "  rules: []\n",
        "policies[1]",
        "@2:name: p",
        "duplicate policy 'ns/p' (policies[0])",
    ),
]


def position(text: str, needle: str) -> tuple[int, int]:
    """1-based line and column where ``needle`` first occurs; ``@N:needle`` picks the Nth hit."""
    nth = 1
    if needle.startswith("@"):
        nth, needle = int(needle[1]), needle[3:]
    at = -1
    for _ in range(nth):
        at = text.index(needle, at + 1)
    line = text.count("\n", 0, at) + 1
    col = at - (text.rfind("\n", 0, at) + 1) + 1
    return line, col


@pytest.mark.parametrize(
    ("text", "path", "at", "reason"),
    [pytest.param(t, p, a, r, id=i) for i, t, p, a, r in BAD],
)
def test_bad_config(text: str, path: str, at: str, reason: str) -> None:
    with pytest.raises(LocalConfigError) as ei:
        load_local_config(text, "cfg.yaml")
    e = ei.value
    line, col = position(text, at)
    prefix = f"cfg.yaml:{line}:{col}: {path}: " if path else f"cfg.yaml:{line}:{col}: "
    assert str(e).startswith(prefix), f"{e} does not start with {prefix!r}"
    assert reason in e.reason
    assert (e.source, e.path, e.line, e.column) == ("cfg.yaml", path, line, col)


@pytest.mark.parametrize(
    ("text", "line", "col"),
    [
        ("workloads:\n- uid: a\n  namespace: [unclosed\n", 4, 1),
        ("workloads:\n  - a\n - b\n", 3, 2),
        ("a: 1\n---\nb: 2\n", 2, 1),
    ],
)
def test_yaml_syntax_error_has_position(text: str, line: int, col: int) -> None:
    with pytest.raises(LocalConfigError) as ei:
        load_local_config(text, "cfg.yaml")
    assert (ei.value.line, ei.value.column) == (line, col)
    assert str(ei.value).startswith(f"cfg.yaml:{line}:{col}: ")
