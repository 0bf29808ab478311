"""SOCKS5 (``UNSTABLE_ENABLE_SOCKS5=true``, Rust src/proxy/socks5.rs) in shared mode, with curl
from Debian as the client inside a mesh pod: 127.0.0.1:15080 in the pod's netns, a CONNECT by IP
or by hostname goes the way 15001 would send it (HBONE to a mesh destination, with the client's
identity on the server side; passthrough to an outside host), failures get their reply codes, and
hostile clients are bounded without stopping an honest one."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ztunnel.inpod.protocol import WorkloadInfo
from ztunnel.proxy.socks5 import HANDSHAKE_TIMEOUT, MAX_HANDSHAKES
from ztunnel.testing.apps import connect_from, start_dnsmasq
from ztunnel.testing.hbone import workload_yaml
from ztunnel.testing.netns import External, Host, NsProcess, Pod, Testbed
from ztunnel.testing.nodeagent import FakeNodeAgent
from ztunnel.testing.proc import Record, ZtunnelProcess

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root"), pytest.mark.timeout(90)]

SOCKS = "127.0.0.1:15080"
VIP = "10.96.0.20"
SVC = "s1.default.svc.cluster.local"


@dataclass
class Bed:
    tb: Testbed
    c1: Pod  # the SOCKS5 client's pod, on n1 (ztunnel z1 has SOCKS5 on)
    s1: Pod  # a mesh server on n2 (z2: SOCKS5 off)
    ext: External  # outside the mesh: an HTTP server and the DNS upstream
    z1: ZtunnelProcess
    z2: ZtunnelProcess

    def curl(self, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return self.c1.run("curl", "-sS", "--max-time", "10", *args, check=False, timeout=timeout)


def http_server(host: Host, body: str, port: int, tmp: str) -> NsProcess:
    """Python's http.server in ``host``'s netns serving ``/hello`` = ``body``."""
    d = os.path.join(tmp, f"www-{host.name}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "hello"), "w") as f:
        f.write(body)
    return host.exec_python_module(
        "http.server", "--bind", "::", "--directory", d, str(port), ready="Serving HTTP"
    )


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with Testbed() as tb, tempfile.TemporaryDirectory() as tmp:
        n1, n2 = tb.add_node("n1"), tb.add_node("n2")
        c1, s1 = n1.add_pod("c1"), n2.add_pod("s1")
        ext = tb.add_external("ext")
        cfg = (
            "workloads:\n"
            + workload_yaml(c1, "sa-c1")
            + workload_yaml(s1, "sa-s1")
            + f'  services:\n    "default/{SVC}": {{80: 8080}}\n'
            + f"services:\n- name: s1\n  namespace: default\n  hostname: {SVC}\n"
            + f'  vips: ["/{VIP}"]\n  ports: {{80: 8080}}\n'
        )
        resolv = os.path.join(tmp, "resolv.conf")
        with open(resolv, "w") as f:
            f.write(f"nameserver {ext.ip4}\n")
        dnsmasq = start_dnsmasq(
            ext, (ext.ip4,), "--local=/example.test/", f"--host-record=ext.example.test,{ext.ip4}"
        )
        servers = [
            http_server(s1, "hello from s1\n", 8080, tmp),
            http_server(ext, "hello from ext\n", 8080, tmp),
        ]
        agents = {n: FakeNodeAgent(os.path.join(tmp, f"{n}.sock")).start() for n in ("n1", "n2")}
        for agent, pod in ((agents["n1"], c1), (agents["n2"], s1)):
            info = WorkloadInfo(
                name=pod.name, namespace="default", service_account=f"sa-{pod.name}"
            )
            agent.put_pod(f"uid-{pod.name}", info, pod)
        env = {
            "PROXY_MODE": "shared",
            "LOCAL_XDS": cfg,
            "ZTUNNEL_LOCAL_CA_DIR": os.path.join(tmp, "ca"),
            "ZTUNNEL_DNS_RESOLV_CONF": resolv,
            "CONNECTION_TERMINATION_DEADLINE": "2s",
        }
        zts: list[ZtunnelProcess] = []
        try:
            for node, extra in ((n1, {"UNSTABLE_ENABLE_SOCKS5": "true"}), (n2, {})):
                zt = ZtunnelProcess(
                    node,
                    {**env, **extra, "NODE_NAME": node.name, "INPOD_UDS": agents[node.name].path},
                ).start()
                zts.append(zt)
            for agent in agents.values():
                agent.wait_for_snapshot()
            yield Bed(tb, c1, s1, ext, *zts)
        finally:
            codes = [(zt.stop(), zt.internal_errors()) for zt in zts]
            for agent in agents.values():
                agent.close()
            for proc in (*servers, dnsmasq):
                proc.stop()
        for rc, errors in codes:
            assert rc == 0, errors


def access(zt: ZtunnelProcess, start: int, **fields: str) -> Record:
    """The first "connection complete" access line from ``start`` on with these fields."""
    return zt.wait_for(
        lambda r: (
            r.get("scope") == "access"
            and r.get("message") == "connection complete"
            and all(r.get(k) == v for k, v in fields.items())
        ),
        start=start,
    )


def test_listens_on_loopback_only_and_only_where_enabled(bed: Bed) -> None:
    """Rust: socks5_addr is 127.0.0.1:15080, one listener per proxy instance (in the pod's
    netns), and none unless UNSTABLE_ENABLE_SOCKS5=true."""
    listening = bed.c1.run("ss", "-Hltn", "sport = :15080").stdout.split()
    assert "127.0.0.1:15080" in listening, listening
    assert not bed.s1.run("ss", "-Hltn", "sport = :15080").stdout.strip()


def test_mesh_destination_by_ip_goes_over_hbone(bed: Bed) -> None:
    """curl --socks5 to a mesh pod's IP: HBONE to its ztunnel, which sees c1's identity."""
    n1, n2 = len(bed.z1.records), len(bed.z2.records)
    out = bed.curl("--socks5", SOCKS, f"http://{bed.s1.ip4}:8080/hello")
    assert out.returncode == 0 and out.stdout == "hello from s1\n", out.stderr
    inbound = access(bed.z2, n2, direction="inbound")
    assert inbound["src.identity"] == "spiffe://cluster.local/ns/default/sa/sa-c1"
    assert inbound["dst.workload"] == "s1"
    outbound = access(bed.z1, n1, direction="outbound")
    assert outbound["dst.addr"] == f"{bed.s1.ip4}:15008"
    assert outbound["dst.hbone_addr"] == f"{bed.s1.ip4}:8080"
    assert str(outbound["src.addr"]).startswith("127.0.0.1:")  # the SOCKS5 client, as Rust


def test_outside_host_is_passed_through(bed: Bed) -> None:
    n1 = len(bed.z1.records)
    out = bed.curl("--socks5", SOCKS, f"http://{bed.ext.ip4}:8080/hello")
    assert out.returncode == 0 and out.stdout == "hello from ext\n", out.stderr
    rec = access(bed.z1, n1, direction="outbound", **{"dst.addr": f"{bed.ext.ip4}:8080"})
    assert "src.identity" not in rec and "dst.hbone_addr" not in rec  # plain TCP


def test_hostnames_are_resolved_by_the_pods_dns_proxy(bed: Bed) -> None:
    """curl --socks5-hostname: Rust dns_lookup through the DNS proxy's resolver, so a mesh
    service's name gives its VIP from state (then HBONE to its endpoint), and another name is
    forwarded upstream (then passthrough)."""
    n1, n2 = len(bed.z1.records), len(bed.z2.records)
    out = bed.curl("--socks5-hostname", SOCKS, f"http://{SVC}/hello")
    assert out.returncode == 0 and out.stdout == "hello from s1\n", out.stderr
    rec = access(bed.z1, n1, direction="outbound", **{"dst.service": SVC})
    assert rec["dst.addr"] == f"{bed.s1.ip4}:15008"
    assert access(bed.z2, n2, direction="inbound")["src.identity"].endswith("/sa/sa-c1")

    n1 = len(bed.z1.records)
    out = bed.curl("--socks5-hostname", SOCKS, "http://ext.example.test:8080/hello")
    assert out.returncode == 0 and out.stdout == "hello from ext\n", out.stderr
    access(bed.z1, n1, direction="outbound", **{"dst.addr": f"{bed.ext.ip4}:8080"})


def recv_all(sock: socket.socket) -> bytes:
    """Everything until ztunnel closes (a close with our bytes unread is a reset after them)."""
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            got += chunk
    return got


DUMMY = b"\x00\x01\x00\x00\x00\x00\x00\x00"  # a reply's RSV, IPv4 type, 0.0.0.0:0


def socks_request(bed: Bed, request: bytes, greeting: bytes = b"\x05\x01\x00") -> bytes:
    """A raw client in c1: the greeting (expects the method selection), then ``request``; the
    10-byte reply (or what came before the connection closed)."""
    with connect_from(bed.c1, "127.0.0.1", 15080, timeout=15) as s:
        s.sendall(greeting)
        assert s.recv(2) == b"\x05\x00"
        s.sendall(request)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while len(got) < 10 and (chunk := s.recv(10 - len(got))):
                got += chunk
        return got


def connect_request(ip: str, port: int) -> bytes:
    addr = ipaddress.ip_address(ip)
    atyp = b"\x01" if addr.version == 4 else b"\x04"
    return b"\x05\x01\x00" + atyp + addr.packed + port.to_bytes(2, "big")


def test_error_replies(bed: Bed) -> None:
    """Rust send_response codes: an unknown command and an unsupported address type are 7
    (invalid_protocol), a name that does not resolve 4 (HostUnreachable). Beyond Rust (it
    replies success before dialling): a refused connect is 5 and a call to one of ztunnel's own
    ports 2, the RFC's codes."""
    assert socks_request(bed, b"\x05\x02\x00\x01" + bytes(6)) == b"\x05\x07" + DUMMY  # BIND
    assert socks_request(bed, b"\x05\x01\x00\x02" + bytes(6)) == b"\x05\x07" + DUMMY
    nowhere = b"\x05\x01\x00\x03\x13nowhere.example.test\x00\x50"
    assert socks_request(bed, nowhere) == b"\x05\x04" + DUMMY
    refused = connect_request(bed.ext.ip4, 9)  # nothing listens on ext:9
    assert socks_request(bed, refused) == b"\x05\x05" + DUMMY
    assert socks_request(bed, connect_request("127.0.0.1", 15001)) == b"\x05\x02" + DUMMY
    # curl reports the code the same way for each
    out = bed.curl("--socks5", SOCKS, f"http://{bed.ext.ip4}:9/")
    assert out.returncode == 97 and "(5)" in out.stderr, out.stderr
    # Rust's messages, rate limited
    bed.z1.wait_for(
        lambda r: (
            "failed to negotiate socks connection: CommandNotSupported: unsupported command 2"
            in str(r.get("message"))
        )
    )


GARBAGE = (
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    b"\x05\x00",  # no methods
    b"\x05\x01\x02",  # username/password only
    b"\x05\x01\x00\x05\x09\x00\x01",  # unknown command
)


def test_hostile_clients_do_not_stop_an_honest_one(bed: Bed) -> None:
    """Slow handshakes are closed at the handshake deadline, garbage is answered and closed,
    no more than MAX_HANDSHAKES wait at once, and an honest curl is served meanwhile; the log
    stays bounded."""
    n1 = len(bed.z1.records)
    with contextlib.ExitStack() as stack:
        slow = []
        for _ in range(20):  # stall mid-greeting
            s = stack.enter_context(connect_from(bed.c1, "127.0.0.1", 15080, timeout=30))
            s.sendall(b"\x05")
            slow.append(s)
        for i in range(50):  # garbage: answered 7 and closed at once
            with connect_from(bed.c1, "127.0.0.1", 15080, timeout=5) as g:
                g.sendall(GARBAGE[i % len(GARBAGE)])
                assert recv_all(g).endswith(b"\x05\x07" + DUMMY)
        started = time.monotonic()
        out = bed.curl("--socks5", SOCKS, f"http://{bed.s1.ip4}:8080/hello")
        assert out.returncode == 0 and out.stdout == "hello from s1\n", out.stderr
        assert time.monotonic() - started < 5
        for s in slow:  # closed by ztunnel at the deadline, without a reply
            s.settimeout(HANDSHAKE_TIMEOUT + 10)
            assert s.recv(10) == b""
    # (A worker's log lines reach the harness a little after the fact: wait for the first.)
    bed.z1.wait_for(
        lambda r: "failed to negotiate socks connection" in str(r.get("message")), start=n1
    )
    time.sleep(0.5)
    lines = [
        r
        for r in bed.z1.records[n1:]
        if "failed to negotiate socks connection" in str(r.get("message"))
    ]
    assert 1 <= len(lines) <= 6, [r.get("message") for r in lines]  # 70 failures, rate limited


def test_handshakes_in_progress_are_capped(bed: Bed) -> None:
    """At most MAX_HANDSHAKES per data-plane process wait for their request; more are closed at
    once. (Per worker, like the DNS proxy's caps: each worker has its own listener task set.)"""
    cap = MAX_HANDSHAKES * bed.z1.workers
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(cap + 20):
            s = stack.enter_context(connect_from(bed.c1, "127.0.0.1", 15080, timeout=30))
            s.sendall(b"\x05\x01")  # the greeting half sent: its handshake waits
            socks.append(s)
        time.sleep(1.0)  # (every connection accepted and either waiting or closed)
        open_ = 0
        for s in socks:
            s.setblocking(False)
            try:
                gone = s.recv(1) == b""
            except BlockingIOError:
                gone = False
            except ConnectionResetError:
                gone = True
            open_ += not gone
        assert MAX_HANDSHAKES <= open_ <= cap, (open_, cap)
    # once they are gone, an honest client is served again
    out = bed.curl("--socks5", SOCKS, f"http://{bed.s1.ip4}:8080/hello")
    assert out.returncode == 0 and out.stdout == "hello from s1\n", out.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
