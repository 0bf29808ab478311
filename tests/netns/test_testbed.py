"""The netns test bed itself: connectivity, teardown, name isolation, and istio-cni redirection."""

from __future__ import annotations

import gc
import ipaddress
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from ztunnel.net.netns import netns_inode, open_current_netns
from ztunnel.testing import iptables as ipt
from ztunnel.testing import netns as tbmod
from ztunnel.testing.apps import (
    Digest,
    PeerInfo,
    connect_from,
    echo_roundtrip,
    listen_in,
    open_connection_from,
    payload,
    ping,
    recv_all,
    recv_digest,
    recv_line,
    send_payload,
    start_app,
)
from ztunnel.testing.netns import Node, Pod, Testbed, TestbedError, in_netns

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("require_root")]

SO_ORIGINAL_DST = 80


def ip_netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def assert_torn_down(before: set[str], *beds: Testbed) -> None:
    """Compare ``ip netns list`` with ``before``: nothing of ``beds`` is left, and anything new
    belongs to another live bed (another test process running at the same time)."""
    new = ip_netns_list() - before
    for tb in beds:
        assert not set(tb.namespaces) & ip_netns_list()
        assert not [n for n in new if n.startswith(f"ztb{tb.tag}-")]
    live = set(os.listdir(tbmod.STATE_DIR))
    assert not [n for n in new if n[3:9] not in live], new


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """SO_ORIGINAL_DST (SOL_IP, then SOL_IPV6), decoded here independently of product code."""
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, addr = struct.unpack_from("!2xH4s", raw)
        return str(ipaddress.IPv4Address(addr)), port
    except OSError:
        raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        port, addr6 = struct.unpack_from("!2xH4x16s", raw)
        return str(ipaddress.IPv6Address(addr6)), port


def accept(listener: socket.socket, timeout: float = 5.0) -> socket.socket:
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    return conn


class Bed:
    """2 nodes x 2 pods + 1 external host."""

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self.node1: Node = tb.add_node("node1")
        self.node2: Node = tb.add_node("node2")
        self.a: Pod = self.node1.add_pod("a")
        self.b: Pod = self.node1.add_pod("b")
        self.c: Pod = self.node2.add_pod("c")
        self.d: Pod = self.node2.add_pod("d", ambient=False)
        self.ext = tb.add_external("ext")


@pytest.fixture
def bed() -> Iterator[Bed]:
    with Testbed() as tb:
        yield Bed(tb)


# --------------------------------------------------------------------------------------------
# build and connectivity


def test_build_is_fast_and_named_per_bed() -> None:
    start = time.monotonic()
    with Testbed() as tb:
        n1, n2 = tb.add_node("node1"), tb.add_node("node2")
        pods = [n1.add_pod("p1"), n1.add_pod("p2"), n2.add_pod("p3"), n2.add_pod("p4")]
        elapsed = time.monotonic() - start
        assert elapsed < 2.0, f"building a 2-node, 4-pod bed took {elapsed:.2f}s"
        assert set(tb.namespaces) <= ip_netns_list()
        assert all(ns.startswith(f"ztb{tb.tag}-") for ns in tb.namespaces)
        assert [p.ip4 for p in pods] == ["10.1.0.2", "10.1.0.3", "10.2.0.2", "10.2.0.3"]
        assert [p.ip6 for p in pods] == ["fd00:1::2", "fd00:1::3", "fd00:2::2", "fd00:2::3"]
        assert pods[2].node is n2 and pods[2].ambient
        assert tb.host("p3") is pods[2]
        assert n1.sysctl("net.ipv4.ip_forward") == "1"
        assert n1.sysctl("net.ipv6.conf.all.forwarding") == "1"
        assert pods[0].sysctl("net.ipv6.conf.eth0.accept_dad") == "0"
        assert "inet6 ::1/128" in pods[0].run("ip", "addr", "show", "lo").stdout
        with pytest.raises(ValueError):
            n1.add_pod("p1")  # names are unique within a bed


def test_ping_v4_v6_across_nodes_and_to_external(bed: Bed) -> None:
    pairs = [
        (bed.a, bed.c),  # cross-node
        (bed.c, bed.a),
        (bed.a, bed.b),  # same node
        (bed.d, bed.b),
        (bed.a, bed.ext),  # pod -> non-mesh host
        (bed.ext, bed.d),  # non-mesh host -> pod
    ]
    for src, dst in pairs:
        for ip in dst.ips:
            assert ping(src, ip), f"{src.name} cannot ping {dst.name} at {ip}"
    assert ping(bed.node1, bed.c.ip4) and ping(bed.node2, bed.a.ip6)


def test_tcp_across_nodes_keeps_source_ip(bed: Bed) -> None:
    app = start_app(bed.c, "echo", "--announce")
    for src_ip, dst_ip in zip(bed.a.ips, bed.c.ips, strict=True):
        with connect_from(bed.a, dst_ip, app.port) as s:
            peer = PeerInfo.parse(recv_line(s))
            assert (peer.peer_ip, peer.local_ip, peer.local_port) == (src_ip, dst_ip, 8080)
            s.sendall(b"ping\n")
            s.shutdown(socket.SHUT_WR)
            assert recv_all(s) == b"ping\n"


def test_external_host_reachable_over_tcp(bed: Bed) -> None:
    app = start_app(bed.ext, "echo", ports=(9000, 0))
    assert app.ports[0] == 9000 and app.ports[1] > 0
    for ip in bed.ext.ips:
        assert echo_roundtrip(bed.a, ip, 9000, b"x" * 100_000) == b"x" * 100_000


def test_sink_and_source_apps_half_close(bed: Bed) -> None:
    sink = start_app(bed.c, "sink")
    with connect_from(bed.a, bed.c.ip6, sink.port) as s:
        sent = send_payload(s, 3_000_000, seed=7)
        s.shutdown(socket.SHUT_WR)
        assert Digest.parse(recv_line(s, timeout=10)) == sent
        assert s.recv(1) == b""

    source = start_app(bed.c, "source", "--bytes", "2000000", "--seed", "3", ports=(8081,))
    with connect_from(bed.a, bed.c.ip4, 8081) as s:
        assert recv_digest(s) == Digest.of_payload(2_000_000, seed=3)  # server FIN first
        s.sendall(payload(12345, seed=9))  # then we still write
        s.shutdown(socket.SHUT_WR)
        line = source.wait_for_line("RECEIVED")
    assert line.split()[1:] == [*str(Digest.of(payload(12345, seed=9))).split(), bed.a.ip4]


async def test_async_client_from_pod(bed: Bed) -> None:
    app = start_app(bed.d, "echo", "--announce")
    reader, writer = await open_connection_from(bed.a, bed.d.ip6, app.port)
    try:
        assert PeerInfo.parse((await reader.readline()).decode()).peer_ip == bed.a.ip6
        writer.write(b"abc")
        writer.write_eof()
        assert await reader.read() == b"abc"
    finally:
        writer.close()
        await writer.wait_closed()


def test_in_netns_switches_only_this_thread_and_back(bed: Bed) -> None:
    def ident() -> tuple[int, int]:
        fd = open_current_netns()
        try:
            return netns_inode(fd)
        finally:
            os.close(fd)

    home = ident()
    pod_fd = bed.a.open_netns()
    try:
        pod_id = netns_inode(pod_fd)
    finally:
        os.close(pod_fd)
    # a thread that already exists stays where it is while this one switches
    inside, checked = threading.Event(), threading.Event()
    other: list[tuple[int, int]] = []

    def observer() -> None:
        inside.wait(5)
        other.append(ident())
        checked.set()

    t = threading.Thread(target=observer)
    t.start()
    with in_netns(bed.a.ns):
        assert ident() == pod_id
        inside.set()
        assert checked.wait(5)
    t.join()
    assert other == [home]
    assert ident() == home
    with pytest.raises(RuntimeError), bed.a.enter():
        raise RuntimeError("boom")
    assert ident() == home


# --------------------------------------------------------------------------------------------
# teardown and isolation


def test_teardown_leaves_nothing() -> None:
    before = ip_netns_list()
    with Testbed() as tb:
        bed = Bed(tb)
        app = start_app(bed.c, "echo")
        assert set(tb.namespaces) <= ip_netns_list()
        state_file = os.path.join(tbmod.STATE_DIR, tb.tag)
        assert os.path.exists(state_file)
    assert_torn_down(before, tb)
    assert app.proc.returncode is not None
    assert not os.path.exists(state_file)
    with pytest.raises(TestbedError):
        tb.add_node("late")


def test_teardown_after_exception_mid_build(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ip_netns_list()
    real = tbmod._write_sysctls

    def failing(ns: str, values: dict[str, str]) -> None:
        if "-p-" in ns:
            raise OSError("injected failure after the pod netns was created")
        real(ns, values)

    monkeypatch.setattr(tbmod, "_write_sysctls", failing)
    with pytest.raises(OSError, match="injected"), Testbed() as tb:
        node = tb.add_node("node1")
        start_app(node, "echo")
        node.add_pod("a")
    assert any("-p-a" in ns for ns in tb.namespaces)
    assert_torn_down(before, tb)

    with pytest.raises(KeyError), Testbed() as tb2:
        tb2.add_node("n")
        raise KeyError("test failure")
    assert_torn_down(before, tb2)


def test_unreferenced_bed_is_finalized() -> None:
    before = ip_netns_list()
    tb = Testbed()
    tb.add_node("n").add_pod("p")
    names = tb.namespaces
    assert set(names) <= ip_netns_list()
    del tb
    gc.collect()
    assert not set(names) & ip_netns_list()
    assert_torn_down(before)


def test_stale_bed_of_dead_process_is_swept() -> None:
    before = ip_netns_list()
    tb = Testbed()
    tb.add_node("n")
    with open(os.path.join(tbmod.STATE_DIR, tb.tag), "w") as f:
        f.write("2147483646\n")  # above pid_max: certainly not alive
    tbmod.sweep_stale_testbeds()  # (a concurrent test process may have swept it already)
    assert not os.path.exists(os.path.join(tbmod.STATE_DIR, tb.tag))
    assert_torn_down(before, tb)
    tb.close()  # idempotent with the sweep


def test_two_beds_at_once_do_not_collide() -> None:
    with Testbed() as t1, Testbed() as t2:
        b1, b2 = Bed(t1), Bed(t2)
        assert t1.tag != t2.tag
        assert not set(t1.namespaces) & set(t2.namespaces)
        # same addresses, separate worlds
        assert b1.a.ip4 == b2.a.ip4
        app1 = start_app(b1.c, "echo", "--announce")
        with connect_from(b1.a, b1.c.ip4, app1.port) as s:
            assert PeerInfo.parse(recv_line(s)).peer_ip == b1.a.ip4
        with pytest.raises(ConnectionRefusedError):  # bed 2 has no app on its pod c
            connect_from(b2.a, b2.c.ip4, app1.port, timeout=2.0).close()


# --------------------------------------------------------------------------------------------
# istio-cni in-pod rules


def _rules(save: str) -> list[str]:
    return [line for line in save.splitlines() if line.startswith("-A ")]


def test_inpod_rules_installed_as_istio_cni_does(bed: Bed) -> None:
    bed.a.install_inpod_rules()
    v4 = _rules(bed.a.iptables_save())
    assert v4 == [
        # mangle
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark"
        " --nfmask 0xffffffff --ctmask 0xffffffff",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
        # nat
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff"
        " -j REDIRECT --to-ports 15001",
        "-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008"
        " -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
    ]
    v6 = "\n".join(_rules(bed.a.iptables_save(ipv6=True)))
    assert "-A ISTIO_PRERT -s fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 -p tcp" in v6
    assert "-A ISTIO_OUTPUT ! -d ::1/128 -p tcp -m mark ! --mark 0x539/0xfff" in v6
    assert "15053" not in v6 and "*raw" not in bed.a.iptables_save()
    for fam in ("-4", "-6"):
        assert (
            "32764:\tfrom all fwmark 0x111/0xfff lookup 100" in bed.a.run("ip", fam, "rule").stdout
        )
        table = bed.a.run("ip", fam, "route", "show", "table", "100").stdout
        assert table.startswith("local default dev lo")

    # DNS capture adds the 15053 redirects and the raw-table conntrack zones
    bed.b.install_inpod_rules(dns_capture=True, ipv6=False)
    save = bed.b.iptables_save()
    assert "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53" in save
    assert (
        "-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1" in save
    )
    assert "ISTIO" not in bed.b.iptables_save(ipv6=True)
    assert "32764" not in bed.b.run("ip", "-6", "rule").stdout

    # and removal takes everything away again
    bed.b.remove_inpod_rules()
    bed.a.remove_inpod_rules()
    for pod in (bed.a, bed.b):
        assert "ISTIO" not in pod.iptables_save() + pod.iptables_save(ipv6=True)
        assert "32764" not in pod.run("ip", "rule").stdout + pod.run("ip", "-6", "rule").stdout


def test_rule_text_matches_golden_form() -> None:
    text = ipt.inpod_restore(ipv6=True, dns_capture=True)
    assert "-A ISTIO_PRERT ! -d ::1/128 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff" in text
    assert text.count("COMMIT") == 3
    assert "*raw" not in ipt.inpod_restore(ipv6=False, dns_capture=False)


def test_outbound_is_redirected_to_15001(bed: Bed) -> None:
    echo = start_app(bed.c, "echo", "--announce")
    bed.a.install_inpod_rules()
    with listen_in(bed.a, 15001) as outbound:
        for dst_ip in bed.c.ips:
            with connect_from(bed.a, dst_ip, 8080) as client, accept(outbound) as conn:
                assert original_dst(conn) == (dst_ip, 8080)
                client.sendall(b"via 15001")
                assert conn.recv(100) == b"via 15001"
        # ztunnel's own (marked) sockets are not captured: they reach the app directly
        with connect_from(bed.a, bed.c.ip4, echo.port, mark=ipt.INPOD_MARK) as s:
            assert PeerInfo.parse(recv_line(s)).peer_ip == bed.a.ip4
        # loopback is left alone
        with pytest.raises(ConnectionRefusedError):
            connect_from(bed.a, "127.0.0.1", 8080).close()


def test_inbound_is_redirected_to_15006_except_hbone(bed: Bed) -> None:
    bed.c.install_inpod_rules()
    with listen_in(bed.c, 15006) as inbound, listen_in(bed.c, 15008) as hbone:
        for src, dst_ip in ((bed.b, bed.c.ip4), (bed.b, bed.c.ip6), (bed.ext, bed.c.ip4)):
            with connect_from(src, dst_ip, 8080) as client, accept(inbound) as conn:
                assert original_dst(conn) == (dst_ip, 8080)
                peer = conn.getpeername()[0]
                assert peer.removeprefix("::ffff:") in src.ips
                client.sendall(b"in")
                assert conn.recv(10) == b"in"
        with connect_from(bed.b, bed.c.ip6, 15008) as client, accept(hbone) as conn:
            assert conn.getsockname()[1] == 15008  # reached directly, not via 15006
            assert original_dst(conn) == (bed.c.ip6, 15008)


def test_probe_snat_bypasses_inbound_capture(bed: Bed) -> None:
    app = start_app(bed.c, "echo", "--announce")
    bed.c.install_inpod_rules()
    bed.node2.install_probe_snat()
    for ip, snat in ((bed.c.ip4, ipt.PROBE_SNAT_V4), (bed.c.ip6, ipt.PROBE_SNAT_V6)):
        with connect_from(bed.node2, ip, app.port) as s:
            assert PeerInfo.parse(recv_line(s)).peer_ip == snat
    # a pod's traffic is not SNATed: it is captured (nothing on 15006, so refused)
    with pytest.raises(ConnectionRefusedError):
        connect_from(bed.d, bed.c.ip4, app.port).close()
