"""The DNS proxy end to end: a shared-mode ztunnel fed by a node agent that installs istio-cni's
in-pod rules WITH DNS capture (UDP and TCP 53 -> 15053, reference 1.3; the rule text is
``ztunnel/testing/iptables.py``), all state from a fake istiod over xDS, and a real upstream
(dnsmasq) in another namespace, listed in the resolv.conf ztunnel reads. Clients are real:
``dig`` and the glibc resolver (``getent``) with a pod resolv.conf carrying Kubernetes search
domains (``/etc/netns/<ns>/resolv.conf``, bind-mounted by ``ip netns exec`` for the command
only: the host's resolver is never touched)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import dns.message
import dns.rcode
import dns.update
import pytest

from ztunnel.core.addr import parse_ip
from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.state.model import NetworkAddress, Service, ServicePort, TunnelProtocol, Workload
from ztunnel.testing.apps import listen_in, socket_in, start_dnsmasq
from ztunnel.testing.netns import External, Node, NsProcess, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import ZtunnelProcess
from ztunnel.testing.xdsbed import ISTIOD_PORT, TOKEN, IstiodThread, http_get, metric

pytestmark = [
    pytest.mark.netns,
    pytest.mark.usefixtures("require_root"),
    pytest.mark.timeout(120),
]

KUBE_DNS4 = (
    "10.96.0.10"  # what pods have in resolv.conf (the kube-dns VIP): captured, never reached
)
KUBE_DNS6 = "fd00:96::a"
BIG_TXT = ",".join(f'"{c * 200}"' for c in "abcdefgh")  # ~1.6 kB: TC over UDP at 1232
MANY = 100  # A records of many.example.test upstream, and endpoints of the headless service
MANY_IPS = [f"10.8.0.{i}" for i in range(MANY)]


def pod_resolv(ns: str, server: str = KUBE_DNS4, extra: str = "") -> str:
    return (
        f"search {ns}.svc.cluster.local svc.cluster.local cluster.local\n"
        f"nameserver {server}\noptions ndots:5 timeout:8 attempts:1 {extra}\n"
    )


def svc(name: str, ns: str, *vips: str, hostname: str = "") -> Service:
    return Service(
        name=name,
        namespace=ns,
        hostname=hostname or f"{name}.{ns}.svc.cluster.local",
        vips=tuple(NetworkAddress("", parse_ip(v)) for v in vips),
        ports=(ServicePort(80, 8080),),
    )


def workload(pod: Pod, ns: str, **extra: object) -> Workload:
    return Workload(
        uid=f"cluster1//v1/Pod/{ns}/{pod.name}",
        name=pod.name,
        namespace=ns,
        addresses=(parse_ip(pod.ip4), parse_ip(pod.ip6)),
        protocol=TunnelProtocol.HBONE,
        service_account="default",
        node="n1",
        workload_name=pod.name,
        canonical_name=f"app-{pod.name}",
        canonical_revision="v1",
        **extra,  # type: ignore[arg-type]
    )


@dataclass
class Bed:
    tb: Testbed
    c1: Pod  # namespace ns1
    c2: Pod  # namespace ns2
    upstream: External
    hole: External  # drops everything to port 53: an upstream that never answers
    dnsmasq: NsProcess
    istiod: IstiodThread
    agent: FakeNodeAgent
    zt: ZtunnelProcess
    node_resolv: str
    dnsmasq_log: str

    def dig(self, pod: Pod, *args: str, timeout: float = 20) -> dict[str, object]:
        out = pod.run("dig", "+time=8", "+tries=1", *args, check=False, timeout=timeout).stdout
        return parse_dig(out)

    def push(self, *items: Service | Workload) -> None:
        self.istiod.answers(self.istiod.call(self.istiod.istiod.set_addresses, *items))

    def remove(self, *names: str) -> None:
        self.istiod.answers(self.istiod.call(self.istiod.istiod.remove_addresses, *names))


def parse_dig(out: str) -> dict[str, object]:
    status = re.search(r"status: (\w+)", out)
    flags = re.search(r";; flags: ([a-z ]+);", out)
    size = re.search(r";; MSG SIZE\s+rcvd: (\d+)", out)
    answers = []
    section = False
    for line in out.splitlines():
        if line.startswith(";; ANSWER SECTION"):
            section = True
            continue
        if section:
            if not line.strip():
                break
            answers.append(line.split())
    return {
        "status": status.group(1) if status else None,
        "flags": flags.group(1).split() if flags else [],
        "answers": answers,
        "size": int(size.group(1)) if size else None,
        "raw": out,
    }


def ips_of(res: dict[str, object]) -> list[str]:
    return sorted(a[4] for a in res["answers"] if a[3] in ("A", "AAAA"))  # type: ignore[union-attr]


def start_upstream(host: External, log_path: str) -> NsProcess:
    """The upstream resolver: dnsmasq authoritative for example.test and cluster.local, logging
    every query it gets."""
    return start_dnsmasq(
        host,
        (host.ip4, host.ip6),
        "--log-queries",
        "--local=/example.test/",
        "--local=/cluster.local/",
        "--host-record=web.example.test,10.9.9.9,fd00:9::9",
        f"--txt-record=big.example.test,{BIG_TXT}",
        *(f"--host-record=many.example.test,{ip}" for ip in MANY_IPS),
        log=log_path,
    )


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1 = tb.add_node("n1")
        istiod_host = tb.add_external("istiod")
        upstream = tb.add_external("dns")
        hole = tb.add_external("hole")
        hole.run("iptables", "-A", "INPUT", "-p", "udp", "--dport", "53", "-j", "DROP")
        hole.run("iptables", "-A", "INPUT", "-p", "tcp", "--dport", "53", "-j", "DROP")
        c1, c2 = n1.add_pod("c1"), n1.add_pod("c2")
        c1.set_resolv_conf(pod_resolv("ns1"))
        c2.set_resolv_conf(pod_resolv("ns2"))
        node_resolv = n1.set_resolv_conf(
            f"nameserver {upstream.ip4}\nsearch istio-system.svc.cluster.local\n"
        )
        dnsmasq_log = os.path.join(tmp, "dnsmasq.log")
        dnsmasq = start_upstream(upstream, dnsmasq_log)
        sock = listen_in(istiod_host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=False, accept_tokens=[TOKEN])
        agent = FakeNodeAgent(os.path.join(tmp, "n1.sock"), dns_capture=True).start()
        zt: ZtunnelProcess | None = None
        try:
            istiod.call(
                istiod.istiod.set_addresses,
                workload(c1, "ns1"),
                workload(c2, "ns2"),
                svc("productpage", "ns1", "10.96.1.1", "fd00:96::1:1"),
                svc("productpage", "ns2", "10.96.2.1"),
                svc("api", "ns1", "240.240.0.1", hostname="api.external.test"),
                svc("wild", "ns1", "240.240.0.2", hostname="*.wild.test"),
            )
            istiod.start(sock)
            agent.put_pod("uid-c1", WorkloadInfo("c1", "ns1", "default"), c1)
            agent.put_pod("uid-c2", WorkloadInfo("c2", "ns2", "default"), c2)
            env = {
                "PROXY_MODE": "shared",
                "NODE_NAME": "n1",
                "INPOD_UDS": agent.path,
                "XDS_ADDRESS": f"http://{istiod_host.ip4}:{ISTIOD_PORT}",
                "AUTH_TOKEN": TOKEN,
                "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
                "CONNECTION_TERMINATION_DEADLINE": "2s",
            }
            zt = ZtunnelProcess(n1, env).start()
            agent.wait_for_snapshot()
            b = Bed(
                tb, c1, c2, upstream, hole, dnsmasq, istiod, agent, zt, node_resolv, dnsmasq_log
            )
            wait_answer(b, c1, "productpage.ns1.svc.cluster.local")
            yield b
        finally:
            rc = zt.stop() if zt is not None else 0
            errors = zt.internal_errors() if zt is not None else []
            agent.close()
            istiod.close()
            sock.close()
        assert rc == 0 and not errors, errors


def wait_answer(b: Bed, pod: Pod, name: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        res = b.dig(pod, f"@{KUBE_DNS4}", name, "+time=1")
        if res["status"] == "NOERROR" and res["answers"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no answer for {name}: {res['raw']}")
        time.sleep(0.2)


# --- answers from state ---------------------------------------------------------------------------


def test_short_names_expand_in_the_client_pods_namespace(bed: Bed) -> None:
    # server.rs Store::to_kube_fqdns with the *client's* namespace: the same short name means
    # a different service in ns1 and ns2. Authoritative, RA set, TTL 30 (Store::lookup).
    r1 = bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")
    r2 = bed.dig(bed.c2, f"@{KUBE_DNS4}", "productpage")
    assert ips_of(r1) == ["10.96.1.1"], r1["raw"]
    assert ips_of(r2) == ["10.96.2.1"], r2["raw"]
    assert {"qr", "aa", "rd", "ra"} <= set(r1["flags"])  # type: ignore[arg-type]
    assert r1["answers"][0][1] == "30"  # type: ignore[index]
    # <svc>.<ns>, <svc>.<ns>.svc and the FQDN name the same service from anywhere
    for name in ("productpage.ns1", "productpage.ns1.svc", "productpage.ns1.svc.cluster.local"):
        assert ips_of(bed.dig(bed.c2, f"@{KUBE_DNS4}", name)) == ["10.96.1.1"], name


def test_families_tcp_and_ipv6_transport(bed: Bed) -> None:
    aaaa = bed.dig(bed.c1, f"@{KUBE_DNS4}", "AAAA", "productpage.ns1")
    assert ips_of(aaaa) == ["fd00:96::1:1"], aaaa["raw"]
    # ns2's service has no IPv6 VIP: an empty NOERROR, not NXDOMAIN
    empty = bed.dig(bed.c1, f"@{KUBE_DNS4}", "AAAA", "productpage.ns2")
    assert empty["status"] == "NOERROR" and not empty["answers"] and "aa" in empty["flags"]  # type: ignore[operator]
    tcp = bed.dig(bed.c1, "+tcp", f"@{KUBE_DNS4}", "productpage")
    assert ips_of(tcp) == ["10.96.1.1"], tcp["raw"]
    # IPv6 transport: ip6tables REDIRECTs to [::1]:15053
    v6 = bed.dig(bed.c2, f"@{KUBE_DNS6}", "productpage")
    assert ips_of(v6) == ["10.96.2.1"], v6["raw"]
    v6tcp = bed.dig(bed.c1, "+tcp", f"@{KUBE_DNS6}", "AAAA", "productpage")
    assert ips_of(v6tcp) == ["fd00:96::1:1"], v6tcp["raw"]


def test_search_domain_stripping_and_wildcards(bed: Bed) -> None:
    # A ServiceEntry host with a search domain appended: CNAME to the stripped name, then A
    # (Store::lookup, alias.stripped); a wildcard host answers without a CNAME.
    r = bed.dig(bed.c1, f"@{KUBE_DNS4}", "api.external.test.ns1.svc.cluster.local")
    kinds = [(a[0], a[3], a[4]) for a in r["answers"]]  # type: ignore[union-attr]
    assert kinds == [
        ("api.external.test.ns1.svc.cluster.local.", "CNAME", "api.external.test."),
        ("api.external.test.", "A", "240.240.0.1"),
    ], r["raw"]
    w = bed.dig(bed.c1, f"@{KUBE_DNS4}", "x.y.wild.test")
    assert ips_of(w) == ["240.240.0.2"] and len(w["answers"]) == 1, w["raw"]  # type: ignore[arg-type]


def test_glibc_resolver_with_kubernetes_search_domains(bed: Bed) -> None:
    def getent(pod: Pod, db: str, name: str, **env: str) -> str:
        e = {**os.environ, **env}
        return pod.run("getent", db, name, check=False, env=e, timeout=30).stdout

    # ndots:5: glibc tries <name>.<ns>.svc.cluster.local first, which we answer
    assert getent(bed.c1, "ahostsv4", "productpage").split()[:1] == ["10.96.1.1"]
    assert getent(bed.c2, "ahostsv4", "productpage").split()[:1] == ["10.96.2.1"]
    # ServiceEntry host: the search-domain form comes back as CNAME + A
    assert "240.240.0.1" in getent(bed.c1, "hosts", "api.external.test")
    # not ours: forwarded (the search forms get NXDOMAIN upstream, then the name itself)
    assert getent(bed.c1, "ahostsv4", "web.example.test").split()[:1] == ["10.9.9.9"]
    # over TCP (use-vc) and IPv6 (AAAA through getaddrinfo)
    tcp = getent(bed.c2, "ahostsv4", "productpage.ns1", RES_OPTIONS="use-vc")
    assert tcp.split()[:1] == ["10.96.1.1"]
    assert getent(bed.c1, "ahostsv6", "productpage").split()[:1] == ["fd00:96::1:1"]
    # the resolver itself reached over IPv6
    bed.c1.set_resolv_conf(pod_resolv("ns1", KUBE_DNS6))
    try:
        assert getent(bed.c1, "ahostsv4", "productpage").split()[:1] == ["10.96.1.1"]
        got = getent(bed.c1, "ahostsv4", "web.example.test", RES_OPTIONS="use-vc")
        assert got.split()[:1] == ["10.9.9.9"]
    finally:
        bed.c1.set_resolv_conf(pod_resolv("ns1"))


# --- forwarding -------------------------------------------------------------------------------------


def test_unknown_names_are_forwarded_from_the_pod(bed: Bed) -> None:
    r = bed.dig(bed.c1, f"@{KUBE_DNS4}", "web.example.test")
    assert ips_of(r) == ["10.9.9.9"], r["raw"]
    nx = bed.dig(bed.c1, f"@{KUBE_DNS4}", "nope.example.test")
    assert nx["status"] == "NXDOMAIN", nx["raw"]
    # other types go upstream even for mesh names (is_record_type_supported)
    txt = bed.dig(bed.c1, f"@{KUBE_DNS4}", "TXT", "productpage.ns1.svc.cluster.local")
    assert txt["status"] == "NXDOMAIN" and "aa" not in txt["flags"], txt["raw"]  # type: ignore[operator]
    # the upstream saw the query from the pod's own address (a socket in the pod's netns,
    # marked so the pod's capture rules let it out), with the name as asked (no search list)
    bed.dig(bed.c1, f"@{KUBE_DNS4}", "seen.example.test")
    with open(bed.dnsmasq_log) as f:
        log = f.read()
    assert f"query[A] seen.example.test from {bed.c1.ip4}" in log, log[-2000:]


def test_the_dns_access_log_at_debug(bed: Bed) -> None:
    """RUST_LOG dns=debug turns on Rust's per-query log (server.rs access_log): the client, the
    type and name as asked, the result, and Rust's endpoint count (for an answer from state,
    the CNAME records only: it counts before adding the addresses)."""

    def set_level(level: str) -> None:
        with socket_in(bed.tb.nodes[0], socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(("127.0.0.1", 15000))
            s.sendall(f"POST /logging?level={level} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert b" 200 " in s.recv(4096)

    def lines(since: int) -> list[dict[str, object]]:
        return [r for r in bed.zt.records[since:] if r.get("scope") == "dns"]

    since = len(bed.zt.records)
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")) == ["10.96.1.1"]
    assert not lines(since)  # (off at the default level)
    set_level("dns=debug")
    try:
        since = len(bed.zt.records)
        bed.dig(bed.c1, f"@{KUBE_DNS4}", "Productpage.ns1.svc.cluster.local")
        bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage.ns1.svc.cluster.local.ns1.svc.cluster.local")
        bed.dig(bed.c1, f"@{KUBE_DNS4}", "web.example.test")
        bed.dig(bed.c1, f"@{KUBE_DNS4}", "nope.example.test")
        bed.zt.wait_for(lambda r: r.get("domain") == "nope.example.test.", 10, start=since)
        got = [(r["domain"], r["result"], r["endpoints"]) for r in lines(since)]
        assert got == [
            ("Productpage.ns1.svc.cluster.local.", "success", 0),
            ("productpage.ns1.svc.cluster.local.ns1.svc.cluster.local.", "success", 1),
            ("web.example.test.", "forwarded", 1),
            ("nope.example.test.", "forwarding failed (NXDOMAIN)", 0),
        ], got
        first = lines(since)[0]
        assert first["level"] == "debug" and first["query"] == "A"
        assert (first["src.workload"], first["src.namespace"]) == ("c1", "ns1")
    finally:
        set_level("dns=info")


def test_truncated_upstream_answers_are_retried_over_tcp(bed: Bed) -> None:
    r = bed.dig(bed.c1, f"@{KUBE_DNS4}", "+bufsize=4096", "TXT", "big.example.test")
    assert r["status"] == "NOERROR" and "tc" not in r["flags"], r["raw"]  # type: ignore[operator]
    assert len(r["answers"]) == 1 and r["raw"].count("a" * 200) == 1  # type: ignore[arg-type, union-attr]
    # a client whose UDP limit is 512 gets TC and retries over TCP itself (dig does)
    small = bed.dig(bed.c1, f"@{KUBE_DNS4}", "+bufsize=512", "TXT", "big.example.test")
    assert small["status"] == "NOERROR" and "Truncated, retrying in TCP mode" in small["raw"]  # type: ignore[operator]


def fits(question_name: str, edns: bool, limit: int) -> int:
    """How many A records (16 bytes each, the owner a pointer) fit in ``limit`` bytes after the
    header (12) and the question (the name + 4), and an OPT record (11) for an EDNS client."""
    qlen = len(question_name.strip(".")) + 2 + 4
    return (limit - 12 - qlen - (11 if edns else 0)) // 16


@pytest.mark.parametrize("source", ["forwarded", "state"])
def test_large_udp_answers_keep_the_records_that_fit_with_tc(bed: Bed, source: str) -> None:
    # hickory emit_message_parts (Rust server.rs large_response): as many records as fit the
    # client's payload size (512 without EDNS, else its EDNS size), TC set; TCP gets them all.
    # Forwarded (dnsmasq has MANY records) and from state (a headless service with MANY
    # endpoints).
    if source == "state":
        name = "many.ns1.svc.cluster.local"
        eps = [
            Workload(
                uid=f"cluster1//v1/Pod/ns1/ep{i}",
                name=f"ep{i}",
                namespace="ns1",
                addresses=(parse_ip(ip),),
                services={f"ns1/{name}": {80: 8080}},
            )
            for i, ip in enumerate(MANY_IPS)
        ]
        bed.push(svc("many", "ns1"), *eps)  # no VIP: headless
        wait_answer(bed, bed.c1, name)
    else:
        name = "many.example.test"
    try:
        for args, edns, limit in (
            (("+noedns",), False, 512),
            (("+bufsize=1232",), True, 1232),
            (("+bufsize=700", "+nocookie"), True, 700),
        ):
            r = bed.dig(bed.c1, f"@{KUBE_DNS4}", "+ignore", *args, name)
            assert r["status"] == "NOERROR" and "tc" in r["flags"], r["raw"]  # type: ignore[operator]
            got = ips_of(r)
            assert len(got) == fits(name, edns, limit), r["raw"]
            assert set(got) <= set(MANY_IPS)
            assert r["size"] is not None and r["size"] <= limit  # type: ignore[operator]
            assert ("OPT PSEUDOSECTION" in r["raw"]) is edns  # type: ignore[operator]
        whole = bed.dig(bed.c1, "+tcp", f"@{KUBE_DNS4}", name)
        assert "tc" not in whole["flags"] and ips_of(whole) == sorted(MANY_IPS), whole["raw"]  # type: ignore[operator]
        # and a client that retries does so over TCP and gets them all
        retried = bed.dig(bed.c1, f"@{KUBE_DNS4}", "+noedns", name)
        assert "Truncated, retrying in TCP mode" in retried["raw"]  # type: ignore[operator]
        assert ips_of(retried) == sorted(MANY_IPS)
    finally:
        if source == "state":
            bed.remove(f"ns1/{name}", *(f"cluster1//v1/Pod/ns1/ep{i}" for i in range(MANY)))


def test_forwarded_answers_are_not_authoritative(bed: Bed) -> None:
    # dnsmasq answers its own records authoritatively; through ztunnel AA is cleared, as Rust's
    # forwarder (Response from a lookup: is_authoritative false); answers from state keep it.
    direct = parse_dig(
        bed.upstream.run("dig", f"@{bed.upstream.ip4}", "web.example.test", check=False).stdout
    )
    assert "aa" in direct["flags"], direct["raw"]  # type: ignore[operator]
    for args in ((), ("+tcp",), ("+noedns",)):
        r = bed.dig(bed.c1, f"@{KUBE_DNS4}", *args, "web.example.test")
        assert ips_of(r) == ["10.9.9.9"], r["raw"]
        assert "aa" not in r["flags"] and "ra" in r["flags"], r["raw"]  # type: ignore[operator]
    nx = bed.dig(bed.c1, f"@{KUBE_DNS4}", "nope.example.test")
    assert nx["status"] == "NXDOMAIN" and "aa" not in nx["flags"], nx["raw"]  # type: ignore[operator]
    ours = bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")
    assert "aa" in ours["flags"], ours["raw"]  # type: ignore[operator]


def test_upstream_down_gives_servfail_in_bounded_time(bed: Bed) -> None:
    # resolv.conf is re-read when it changes: point it at a host that drops port 53
    with open(bed.node_resolv, "w") as f:
        f.write(f"nameserver {bed.hole.ip4}\n")
    try:
        time.sleep(1.2)
        t0 = time.monotonic()
        r = bed.dig(bed.c1, f"@{KUBE_DNS4}", "+time=15", "down.example.test")
        took = time.monotonic() - t0
        assert r["status"] == "SERVFAIL", r["raw"]
        assert took < 7.5, took  # the forward deadline (5 s), not a hang
        # mesh names still answer meanwhile
        assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")) == ["10.96.1.1"]
    finally:
        with open(bed.node_resolv, "w") as f:
            f.write(f"nameserver {bed.upstream.ip4}\n")
        time.sleep(1.2)
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "web.example.test")) == ["10.9.9.9"]


# --- state changes and lifecycle -------------------------------------------------------------------


def test_xds_changes_change_answers(bed: Bed) -> None:
    name = "reviews.ns1.svc.cluster.local"
    assert bed.dig(bed.c1, f"@{KUBE_DNS4}", name)["status"] == "NXDOMAIN"  # forwarded
    bed.push(svc("reviews", "ns1", "10.96.3.1"))
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "reviews")) == ["10.96.3.1"]
    bed.push(svc("reviews", "ns1", "10.96.3.2"))
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "reviews")) == ["10.96.3.2"]
    bed.remove(f"ns1/{name}")
    assert bed.dig(bed.c1, f"@{KUBE_DNS4}", name)["status"] == "NXDOMAIN"


def listens_on_15053(pod: Pod) -> bool:
    udp = pod.run("ss", "-Hlnu", "sport = :15053", check=False).stdout
    tcp = pod.run("ss", "-Hlnt", "sport = :15053", check=False).stdout
    return bool(udp.strip() or tcp.strip())


def test_pod_lifecycle_and_unknown_client(bed: Bed) -> None:
    c3 = bed.tb.nodes[0].add_pod("c3")
    c3.set_resolv_conf(pod_resolv("ns3"))
    assert not listens_on_15053(c3)
    ex = bed.agent.add_pod("uid-c3", WorkloadInfo("c3", "ns3", "default"), c3)
    assert ex.acked, ex
    assert listens_on_15053(c3)
    ss = c3.run("ss", "-Hlnu", "sport = :15053").stdout
    assert "127.0.0.1:15053" in ss and "[::1]:15053" in ss, ss
    # c3 has no workload in xDS: a client we do not know gets SERVFAIL (after Rust's 5 s wait)
    t0 = time.monotonic()
    r = bed.dig(c3, f"@{KUBE_DNS4}", "+time=12", "productpage.ns1.svc.cluster.local")
    assert r["status"] == "SERVFAIL" and 4 < time.monotonic() - t0 < 9, r["raw"]
    # once it appears, it is answered (namespace ns3 has no productpage: the FQDN works)
    bed.push(workload(c3, "ns3"))
    assert ips_of(bed.dig(c3, f"@{KUBE_DNS4}", "productpage.ns1")) == ["10.96.1.1"]
    bed.agent.del_pod("uid-c3")
    deadline = time.monotonic() + 5
    while listens_on_15053(c3) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not listens_on_15053(c3)


def test_no_ipv6_on_lo_binds_ipv4_only(bed: Bed) -> None:
    c4 = bed.tb.nodes[0].add_pod("c4")
    c4.sysctl("net.ipv6.conf.lo.disable_ipv6", 1)
    c4.install_inpod_rules(dns_capture=True, ipv6=False)  # as istio-cni does without v6 on lo
    ex = bed.agent.add_pod("uid-c4", WorkloadInfo("c4", "ns1", "default"), c4)
    try:
        assert ex.acked, ex  # a missing ::1 never fails the pod (reference 9, row 7)
        ss = c4.run("ss", "-Hlnu", "sport = :15053").stdout
        assert "127.0.0.1:15053" in ss and "::1" not in ss, ss
    finally:
        bed.agent.del_pod("uid-c4")


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics(bed: Bed) -> None:
    bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")
    bed.dig(bed.c1, "+tcp", f"@{KUBE_DNS4}", "web.example.test")
    status, text = http_get(bed.tb.nodes[0], 15020, "/metrics")
    assert status == 200
    base = {"source_canonical_service": "app-c1", "source_canonical_revision": "v1"}
    assert (
        metric(
            text, "istio_dns_requests_total", request_query_type="a", request_protocol="udp", **base
        )
        >= 1
    )
    assert (
        metric(
            text,
            "istio_dns_upstream_requests_total",
            request_query_type="a",
            request_protocol="tcp",
            **base,
        )
        >= 1
    )
    assert (
        metric(
            text,
            "istio_dns_upstream_request_duration_seconds_count",
            request_query_type="a",
            request_protocol="tcp",
            **base,
        )
        >= 1
    )
    assert "# TYPE istio_dns_upstream_request_duration_seconds histogram" in text
    assert re.search(
        r'istio_dns_requests_total\{request_query_type="a",request_protocol="udp",'
        r'source_canonical_service="app-c1",source_canonical_revision="v1"\} \d+',
        text,
    )


# --- bad input and floods --------------------------------------------------------------------------


def udp_exchange(pod: Pod, data: bytes, timeout: float = 2.0) -> bytes | None:
    s = socket_in(pod, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.settimeout(timeout)
        s.sendto(data, (KUBE_DNS4, 53))
        return s.recv(65535)
    except TimeoutError:
        return None
    finally:
        s.close()


def query(name: str, rdtype: str = "A") -> dns.message.Message:
    return dns.message.make_query(name, rdtype)


def test_bad_input_gets_rusts_answers_and_everyone_keeps_being_served(bed: Bed) -> None:
    good = query("productpage.ns1.svc.cluster.local")
    # shorter than a header, and a response sent as a query: dropped (hickory Server)
    assert udp_exchange(bed.c1, b"\x01\x02\x03", 0.5) is None
    resp = dns.message.make_response(good).to_wire()
    assert udp_exchange(bed.c1, resp, 0.5) is None
    # a header that promises a question it does not carry: FORMERR (header only)
    raw = udp_exchange(bed.c1, good.to_wire()[:20])
    assert raw is not None and dns.message.from_wire(raw).rcode() == dns.rcode.FORMERR
    # garbage after a valid header: FORMERR
    raw = udp_exchange(bed.c1, struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + os.urandom(40))
    assert raw is not None and struct.unpack_from("!H", raw)[0] == 7
    assert raw[3] & 0xF == dns.rcode.FORMERR
    # zero and two questions: SERVFAIL (request_info: BadQueryCount)
    zero = struct.pack("!HHHHHH", 8, 0x0100, 0, 0, 0, 0)
    raw = udp_exchange(bed.c1, zero)
    assert raw is not None and raw[3] & 0xF == dns.rcode.SERVFAIL
    two = query("a.example.test")
    two.question.append(query("b.example.test").question[0])
    raw = udp_exchange(bed.c1, two.to_wire())
    assert raw is not None and dns.message.from_wire(raw).rcode() == dns.rcode.SERVFAIL
    # UPDATE (external-dns): NOTIMP, as Rust (istio/istio#55962)
    upd = dns.update.UpdateMessage("example.test")
    upd.add("x.example.test", 30, "A", "1.2.3.4")
    raw = udp_exchange(bed.c1, upd.to_wire())
    assert raw is not None and dns.message.from_wire(raw).rcode() == dns.rcode.NOTIMP
    # an oversized datagram: FORMERR (trailing junk) and nothing else happens
    raw = udp_exchange(bed.c1, good.to_wire() + b"\x00" * 60000)
    assert raw is not None and raw[3] & 0xF == dns.rcode.FORMERR
    # TCP: a length prefix larger than the data, then silence; and a zero-length message
    s1 = socket_in(bed.c1, socket.AF_INET, socket.SOCK_STREAM)
    s1.settimeout(10)
    s1.connect((KUBE_DNS4, 53))
    s1.sendall(b"\xff\xff" + good.to_wire())
    # ... everyone else is still served meanwhile, over UDP and TCP
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "productpage")) == ["10.96.1.1"]
    assert ips_of(bed.dig(bed.c2, "+tcp", f"@{KUBE_DNS4}", "productpage")) == ["10.96.2.1"]
    # the short TCP message is given up after the read deadline (5 s): the server closes
    t0 = time.monotonic()
    assert s1.recv(10) == b""
    assert time.monotonic() - t0 < 8
    s1.close()
    assert bed.zt.internal_errors() == []


def test_flood_stays_bounded_and_others_are_served(bed: Bed) -> None:
    base = bed.zt.runtime_stats()
    # forwarded queries to an upstream that never answers pile up as tasks: capped
    with open(bed.node_resolv, "w") as f:
        f.write(f"nameserver {bed.hole.ip4}\n")
    socks: list[socket.socket] = []
    try:
        time.sleep(1.2)
        flood = socket_in(bed.c1, socket.AF_INET, socket.SOCK_DGRAM)
        for i in range(3000):
            flood.sendto(query(f"f{i}.example.test").to_wire(), (KUBE_DNS4, 53))
        # and idle TCP connections
        for _ in range(300):
            s = socket_in(bed.c2, socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.connect((KUBE_DNS4, 53))
            socks.append(s)
        during = bed.zt.runtime_stats()
        # another client is served meanwhile (a mesh name)
        assert ips_of(bed.dig(bed.c2, f"@{KUBE_DNS4}", "productpage")) == ["10.96.2.1"]
        # (the caps are per data-plane worker: each runs its own DNS servers)
        bound = (256 + 128) * bed.zt.workers + 50
        assert during["tasks"] - base["tasks"] < bound, during
        assert during["fds"] - base["fds"] < bound, during
        flood.close()
    finally:
        for s in socks:
            s.close()
        with open(bed.node_resolv, "w") as f:
            f.write(f"nameserver {bed.upstream.ip4}\n")
    deadline = time.monotonic() + 15
    while True:
        after = bed.zt.runtime_stats()
        if after["tasks"] <= base["tasks"] + 5 and after["fds"] <= base["fds"] + 5:
            break
        assert time.monotonic() < deadline, (base, after)
        time.sleep(0.2)
    time.sleep(1.2)
    assert ips_of(bed.dig(bed.c1, f"@{KUBE_DNS4}", "web.example.test")) == ["10.9.9.9"]


# --- dedicated mode ---------------------------------------------------------------------------------


def test_dedicated_mode_in_its_own_netns(bed: Bed) -> None:
    # PROXY_MODE=dedicated: ztunnel in the pod's own netns; its resolv.conf is the pod's, so the
    # search list is resolv.conf's (SearchDomains::Static) and the upstream is what it names.
    c5 = bed.tb.nodes[0].add_pod("c5")
    c5.install_inpod_rules(dns_capture=True)
    c5.set_resolv_conf(
        f"search ns1.svc.cluster.local svc.cluster.local cluster.local\n"
        f"nameserver {bed.upstream.ip4}\noptions ndots:5 timeout:8 attempts:1\n"
    )
    local = f"""workloads:
- uid: Kubernetes//v1/Pod/ns1/c5
  name: c5
  namespace: ns1
  serviceAccount: default
  trustDomain: cluster.local
  workloadIps: ["{c5.ip4}"]
  protocol: TCP
services:
- name: productpage
  namespace: ns1
  hostname: productpage.ns1.svc.cluster.local
  vips: ["/10.96.1.5"]
  ports:
    80: 8080
- name: api
  namespace: ns1
  hostname: api.external.test
  vips: ["/240.240.0.5"]
  ports:
    80: 8080
"""
    zt = ZtunnelProcess(
        c5,
        {
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "ns1/c5/default",
            "LOCAL_XDS": local,
            "CONNECTION_TERMINATION_DEADLINE": "1s",
        },
    ).start()
    try:
        # the app's queries to the nameserver in its resolv.conf are captured to 15053
        assert ips_of(bed.dig(c5, f"@{bed.upstream.ip4}", "productpage")) == ["10.96.1.5"]
        assert ips_of(bed.dig(c5, "+tcp", f"@{bed.upstream.ip4}", "productpage")) == ["10.96.1.5"]
        r = bed.dig(c5, f"@{bed.upstream.ip4}", "api.external.test.svc.cluster.local")
        assert [a[3] for a in r["answers"]] == ["CNAME", "A"], r["raw"]  # type: ignore[union-attr]
        # forwarded from ztunnel's own (marked, so not captured again) socket to that server
        assert ips_of(bed.dig(c5, f"@{bed.upstream.ip4}", "web.example.test")) == ["10.9.9.9"]
        got = c5.run("getent", "ahostsv4", "productpage", check=False).stdout
        assert got.split()[:1] == ["10.96.1.5"]
    finally:
        assert zt.stop() == 0
        assert zt.internal_errors() == []


def test_dns_bind_failure_keeps_the_pod_pending_and_not_ready(bed: Bed) -> None:
    # The DNS listeners are bound with the pod's others: if 15053 is taken (no SO_REUSEPORT),
    # the pod is NACKed, stays pending (readiness 500) and is retried until it binds.
    c6 = bed.tb.nodes[0].add_pod("c6")
    squatter = socket_in(c6, socket.AF_INET, socket.SOCK_DGRAM)
    squatter.bind(("127.0.0.1", 15053))
    try:
        ex = bed.agent.add_pod("uid-c6", WorkloadInfo("c6", "ns1", "default"), c6)
        assert ex.nacked and ex.ack is not None and "15053" in ex.ack.error, ex
        assert http_get(bed.tb.nodes[0], 15021, "/healthz/ready")[0] == 500  # Rust: 500
        assert not c6.run("ss", "-Hlnt", "sport = :15001").stdout.strip()  # none stay bound
    finally:
        squatter.close()
    deadline = time.monotonic() + 12  # retried every 5 s
    while not listens_on_15053(c6):
        assert time.monotonic() < deadline, "pod never started after the port was freed"
        time.sleep(0.1)
    while http_get(bed.tb.nodes[0], 15021, "/healthz/ready")[0] != 200:
        assert time.monotonic() < deadline + 5
        time.sleep(0.1)
    bed.agent.del_pod("uid-c6")


def test_ipv6_upstream(bed: Bed) -> None:
    # An IPv6 nameserver in ztunnel's resolv.conf: the pod's marked IPv6 socket reaches it.
    with open(bed.node_resolv, "w") as f:
        f.write(f"nameserver {bed.upstream.ip6}\n")
    try:
        time.sleep(1.2)
        r = bed.dig(bed.c2, f"@{KUBE_DNS4}", "AAAA", "web.example.test")
        assert ips_of(r) == ["fd00:9::9"], r["raw"]
        with open(bed.dnsmasq_log) as f:
            assert f"query[AAAA] web.example.test from {bed.c2.ip6}" in f.read()
    finally:
        with open(bed.node_resolv, "w") as f:
            f.write(f"nameserver {bed.upstream.ip4}\n")
        time.sleep(1.2)


# --- ENABLE_PROXY=false: the DNS proxy alone -------------------------------------------------------


def listens_on(pod: Pod, port: int) -> bool:
    return bool(pod.run("ss", "-Hlnt", f"sport = :{port}", check=False).stdout.strip())


@pytest.mark.parametrize("mode", ["shared", "dedicated"])
def test_dns_only_mode_answers_from_state_after_the_first_sync(mode: str) -> None:
    """Rust app.rs / proxyfactory.rs with ``proxy: false``: each pod (shared) or the workload
    (dedicated) gets its DNS server and no Proxy, so nothing listens on 15001/15006/15008. It
    serves only once xDS has synced: istiod answers 3 s late; a query sent meanwhile is answered
    from state afterwards (dedicated: it waits in the bound socket) or finds no server yet
    (shared: the node agent's pods are taken after the sync)."""
    delay = 3.0
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1 = tb.add_node("n1")
        istiod_host = tb.add_external("istiod")
        c1 = n1.add_pod("c1")
        sock = listen_in(istiod_host, ISTIOD_PORT, host="0.0.0.0")
        istiod = IstiodThread(tls=False, accept_tokens=[TOKEN])
        agent: FakeNodeAgent | None = None
        env = {
            "PROXY_MODE": mode,
            "ENABLE_PROXY": "false",
            "NODE_NAME": "n1",
            "XDS_ADDRESS": f"http://{istiod_host.ip4}:{ISTIOD_PORT}",
            "AUTH_TOKEN": TOKEN,
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
            "CONNECTION_TERMINATION_DEADLINE": "1s",
        }
        if mode == "shared":
            agent = FakeNodeAgent(os.path.join(tmp, "n1.sock"), dns_capture=True).start()
            agent.put_pod("uid-c1", WorkloadInfo("c1", "ns1", "default"), c1)
            env["INPOD_UDS"] = agent.path
            where: Pod | Node = n1
        else:
            c1.install_inpod_rules(dns_capture=True)
            # (its xDS connection is ztunnel's own: not captured, as a deployment excludes it)
            c1.run(
                "iptables", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-d", istiod_host.ip4,
                "-j", "ACCEPT",
            )  # fmt: skip
            env["PROXY_WORKLOAD_INFO"] = "ns1/c1/default"
            where = c1
        zt: ZtunnelProcess | None = None
        try:
            istiod.call(
                istiod.istiod.set_addresses,
                workload(c1, "ns1"),
                svc("productpage", "ns1", "10.96.1.1"),
            )
            istiod.istiod.response_delay = delay
            istiod.start(sock)
            zt = ZtunnelProcess(where, env).start()
            t0 = time.monotonic()
            early = c1.run(
                "dig", "+time=10", "+tries=1", f"@{KUBE_DNS4}", "productpage", check=False,
                timeout=20,
            )  # fmt: skip
            took = time.monotonic() - t0
            got = parse_dig(early.stdout)
            if mode == "dedicated":
                # bound at start, read only once synced: answered from state, after the sync
                assert ips_of(got) == ["10.96.1.1"], got["raw"]
                assert took >= delay - 1, took
            else:
                # no pod taken from the node agent before the sync: nothing on 15053 yet
                assert not got["answers"], got["raw"]
                assert agent is not None
                agent.wait_for_snapshot(timeout=20)
            zt.wait_for(lambda r: r.get("message") == "xDS: initial sync complete", 20)
            deadline = time.monotonic() + 10
            while True:
                r = parse_dig(
                    c1.run("dig", "+time=2", f"@{KUBE_DNS4}", "productpage", check=False).stdout
                )
                if r["answers"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert ips_of(r) == ["10.96.1.1"] and "aa" in r["flags"], r["raw"]  # type: ignore[operator]
            tcp = parse_dig(c1.run("dig", "+tcp", f"@{KUBE_DNS4}", "productpage").stdout)
            assert ips_of(tcp) == ["10.96.1.1"], tcp["raw"]
            assert listens_on_15053(c1)
            for port in (15001, 15006, 15008):
                assert not listens_on(c1, port), port
            assert http_get(n1 if mode == "shared" else c1, 15021, "/healthz/ready")[0] == 200
        finally:
            rc = zt.stop() if zt is not None else 0
            errors = zt.internal_errors() if zt is not None else []
            if agent is not None:
                agent.close()
            istiod.close()
            sock.close()
        assert rc == 0 and not errors, errors
