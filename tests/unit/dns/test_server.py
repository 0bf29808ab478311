"""The DNS server in-process on loopback: UDP and TCP framing, the hot-reply cache and its
invalidation, counters, bounds (the netns tests run it in pods with real clients)."""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import replace

import dns.message
import dns.rcode
from prometheus_client import CollectorRegistry

from ztunnel.config import Config
from ztunnel.core.addr import parse_ip
from ztunnel.dns.forwarder import ResolvConfSource
from ztunnel.dns.server import DnsServer, bind_addresses
from ztunnel.metrics import Metrics
from ztunnel.proxy.sockets import SocketFactory
from ztunnel.state.model import NetworkAddress, Service, Workload
from ztunnel.state.store import State

CLIENT = Workload("c", "c", "ns1", (parse_ip("10.1.0.2"),), canonical_name="app")


def make(tmp: str) -> tuple[DnsServer, State, Metrics]:
    st = State()
    st.upsert_service(
        Service(
            "pp", "ns1", "pp.ns1.svc.cluster.local", (NetworkAddress("", parse_ip("10.96.1.1")),)
        )
    )
    st.upsert_workload(CLIENT)
    m = Metrics(CollectorRegistry(), process=False, dns=True)
    conf = f"{tmp}/resolv.conf"
    with open(conf, "w") as f:
        f.write("# no upstream\n")
    cfg = replace(Config(), dns_proxy_addr="127.0.0.1:0")
    srv = DnsServer(
        config=cfg,
        state=st,
        sockets=SocketFactory(mark=None),
        client=lambda: st.find_workload_by_uid("c"),
        resolv=ResolvConfSource(conf),
        metrics=m.dns,
        client_wait=0.2,
    )
    return srv, st, m


async def udp_query(port: int, data: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
        s.send(data)
        async with asyncio.timeout(3):
            return await loop.sock_recv(s, 65535)
    finally:
        s.close()


def test_bind_addresses() -> None:
    assert bind_addresses("localhost:15053", True) == [("127.0.0.1", 15053), ("::1", 15053)]
    assert bind_addresses("localhost:15053", False) == [("127.0.0.1", 15053)]
    assert bind_addresses("[::1]:53", True) == [("::1", 53)]


async def test_udp_tcp_hot_replies_and_counters(tmp_path: object) -> None:
    srv, st, m = make(str(tmp_path))
    srv.bind()
    srv.start()
    try:
        port = srv.udp[0].getsockname()[1]
        q = dns.message.make_query("pp", "A")
        for i in range(3):  # the second and third come from the hot cache
            q.id = 100 + i
            r = dns.message.from_wire(await udp_query(port, q.to_wire()))
            assert r.id == 100 + i and [str(x) for x in r.answer[0]] == ["10.96.1.1"]
        assert len(srv._hot) == 1
        assert m.dns is not None
        cell = m.dns.requests.labels("a", "udp", "app", "unknown")
        assert cell.value == 3
        # a state change invalidates it at once
        st.upsert_service(
            Service(
                "pp",
                "ns1",
                "pp.ns1.svc.cluster.local",
                (NetworkAddress("", parse_ip("10.96.1.2")),),
            )
        )
        q.id = 7
        r = dns.message.from_wire(await udp_query(port, q.to_wire()))
        assert [str(x) for x in r.answer[0]] == ["10.96.1.2"]
        # TCP: two queries on one connection, then an unknown name -> SERVFAIL (no upstream)
        tport = srv.tcp[0].address[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", tport)
        for name in ("pp.ns1", "nope.example.test"):
            w = dns.message.make_query(name, "A").to_wire()
            writer.write(struct.pack("!H", len(w)) + w)
            await writer.drain()
            (n,) = struct.unpack("!H", await reader.readexactly(2))
            r = dns.message.from_wire(await reader.readexactly(n))
            if name == "pp.ns1":
                assert [str(x) for x in r.answer[0]] == ["10.96.1.2"]
            else:
                assert r.rcode() == dns.rcode.SERVFAIL
        writer.close()
        assert m.dns.upstream_failures.labels("a", "tcp", "app", "unknown").value == 1
    finally:
        await srv.drain(1.0)
    assert not srv.udp and not srv.tcp and not srv._tasks


async def test_unknown_client_gets_servfail_after_the_wait(tmp_path: object) -> None:
    srv, st, m = make(str(tmp_path))
    st.remove_workload("c")
    srv.bind()
    srv.start()
    try:
        port = srv.udp[0].getsockname()[1]
        r = dns.message.from_wire(
            await udp_query(port, dns.message.make_query("pp", "A").to_wire())
        )
        assert r.rcode() == dns.rcode.SERVFAIL
        assert m.dns is not None
        assert m.dns.requests.labels("a", "udp", "unknown", "unknown").value == 1
    finally:
        await srv.drain(1.0)


async def test_padded_queries_are_not_remembered(tmp_path: object) -> None:
    import dns.edns

    srv, _st, _m = make(str(tmp_path))
    srv.bind()
    srv.start()
    try:
        port = srv.udp[0].getsockname()[1]
        pad = dns.edns.GenericOption(12, b"\x00" * 4000)
        q = dns.message.make_query("pp", "A", use_edns=0, payload=8192, options=[pad])
        r = dns.message.from_wire(await udp_query(port, q.to_wire()))
        assert [str(x) for x in r.answer[0]] == ["10.96.1.1"]
        assert not srv._hot
    finally:
        await srv.drain(1.0)
