"""Forwarding: resolv.conf, the cache, relaying, and the upstream exchange against an
in-process upstream on loopback (the real-upstream test with dnsmasq is tests/netns/test_dns.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rrset

from ztunnel.core.addr import parse_ip
from ztunnel.dns import forwarder as fw
from ztunnel.dns import names, wire
from ztunnel.proxy.sockets import SocketFactory


def test_parse_resolv_conf() -> None:
    conf = fw.parse_resolv_conf(
        "# comment\nnameserver 10.0.0.10\nnameserver fe80::1%eth0\nnameserver bogus\n"
        "nameserver 10.0.0.10\nsearch a.svc.cluster.local svc.cluster.local cluster.local\n"
        "options ndots:5 timeout:2 attempts:3 rotate\n"
    )
    assert conf.nameservers == (parse_ip("10.0.0.10"), parse_ip("fe80::1"))
    assert conf.search == tuple(
        names.from_text(x) for x in ("a.svc.cluster.local", "svc.cluster.local", "cluster.local")
    )
    assert (conf.timeout, conf.attempts) == (2.0, 3)
    assert fw.parse_resolv_conf("domain corp.example\n").search == (("corp", "example"),)
    assert fw.parse_resolv_conf("").nameservers == ()


def test_resolv_conf_is_reread_when_it_changes(tmp_path: Path) -> None:
    p = tmp_path / "resolv.conf"
    p.write_text("nameserver 10.0.0.1\n")
    src = fw.ResolvConfSource(str(p))
    assert src.get().nameservers == (parse_ip("10.0.0.1"),)
    p.write_text("nameserver 10.0.0.2\nnameserver 10.0.0.3\n")
    src._checked = -1e9  # (the next get() would re-check within a second anyway)
    assert src.get().nameservers == (parse_ip("10.0.0.2"), parse_ip("10.0.0.3"))
    os.unlink(p)
    src._checked = -1e9
    assert src.get().nameservers == ()


def response(
    name: str, rdtype: str, *rdata: str, ttl: int = 60, rcode: int = 0
) -> dns.message.Message:
    qm = dns.message.make_query(name, rdtype)
    r = dns.message.make_response(qm)
    if rdata:
        r.answer.append(dns.rrset.from_text(name, ttl, "IN", rdtype, *rdata))
    r.set_rcode(rcode)
    return r


def test_response_ttl() -> None:
    assert fw.response_ttl(response("a.test.", "A", "1.2.3.4", ttl=42)) == 42
    nx = response("a.test.", "A", rcode=dns.rcode.NXDOMAIN)
    nx.authority.append(dns.rrset.from_text("test.", 300, "IN", "SOA", "ns. host. 1 2 3 4 15"))
    assert fw.response_ttl(nx) == 15  # RFC 2308: min(SOA TTL, minimum)
    assert fw.response_ttl(response("a.test.", "A", rcode=dns.rcode.NXDOMAIN)) is None
    assert fw.response_ttl(response("a.test.", "A", rcode=dns.rcode.SERVFAIL)) is None
    tc = response("a.test.", "A", "1.2.3.4")
    tc.flags |= dns.flags.TC
    assert fw.response_ttl(tc) is None


def test_cache_lru_and_expiry() -> None:
    c = fw.ResponseCache(size=2)
    m = fw.render(response("a.test.", "A", "1.2.3.4"), False)
    keys = [(b"a", 1, 1, 0, False), (b"b", 1, 1, 0, False), (b"c", 1, 1, 0, False)]
    c.put(keys[0], m, 10, now=100.0)
    c.put(keys[1], m, 10, now=100.0)
    assert c.get(keys[0], 101.0) == (m, 1)  # a is now the most recent
    c.put(keys[2], m, 10, now=101.0)
    assert len(c) == 2 and c.get(keys[1], 101.0) is None  # b was evicted
    assert c.get(keys[0], 110.5) is None  # expired


def req_of(name: str, rdtype: str = "A", **kw: object) -> wire.Request:
    r = wire.parse(dns.message.make_query(name, rdtype, **kw).to_wire())  # type: ignore[arg-type]
    assert isinstance(r, wire.Request)
    return r


def test_relay_keeps_the_answer_and_ages_ttls() -> None:
    up = response("web.test.", "A", "10.9.9.9", "10.9.9.8", ttl=60)
    up.authority.append(dns.rrset.from_text("test.", 100, "IN", "NS", "ns.test."))
    up.additional.append(dns.rrset.from_text("ns.test.", 200, "IN", "A", "10.0.0.53"))
    up.flags |= dns.flags.RA | dns.flags.AD
    ede = dns.edns.EDEOption(dns.edns.EDECode.OTHER, "x")
    up.use_edns(0, 0, 1232, options=[ede, dns.edns.NSIDOption(b"n")])
    rendered = fw.render(up, False)
    r = req_of("WEB.test", use_edns=0, payload=1232)
    out = dns.message.from_wire(fw.relay(r, rendered, age=15, udp=True))
    assert out.id == r.id and str(out.question[0].name) == "WEB.test."  # the client's case
    assert [x.ttl for sec in (out.answer, out.authority, out.additional) for x in sec] == [
        45,
        85,
        185,
    ]
    assert sorted(str(x) for x in out.answer[0]) == ["10.9.9.8", "10.9.9.9"]
    assert out.flags & dns.flags.AD and out.flags & dns.flags.RA
    assert [o.otype for o in out.options] == [dns.edns.OptionType.EDE]  # only EDE is passed on
    plain = dns.message.from_wire(fw.relay(req_of("web.test"), rendered, age=100, udp=True))
    assert plain.edns == -1 and plain.answer[0].ttl == 0  # no EDNS asked; TTLs never negative


def test_ttl_offsets_agree_with_dnspython() -> None:
    up = response("a.test.", "A", "1.1.1.1", ttl=7)
    up.answer.append(dns.rrset.from_text("a.test.", 9, "IN", "TXT", '"x"'))
    up.use_edns(0, 0, 1232)
    data = up.to_wire()
    offs = fw.ttl_offsets(data)
    assert [struct.unpack_from("!I", data, o)[0] for o in offs] == [7, 9]


def test_extended_rcode_is_servfail_without_edns() -> None:
    up = response("a.test.", "A")
    up.use_edns(0, 0, 1232)
    up.set_rcode(dns.rcode.BADCOOKIE)
    rendered = fw.render(up, False)
    assert dns.message.from_wire(rendered.plain).rcode() == dns.rcode.SERVFAIL
    assert dns.message.from_wire(rendered.edns).rcode() == dns.rcode.BADCOOKIE


def test_upstream_query_shape() -> None:
    r = req_of(
        "Web.Test", use_edns=0, want_dnssec=True, options=[dns.edns.GenericOption(10, b"1" * 8)]
    )
    m = dns.message.from_wire(fw.upstream_query(r, 4242))
    assert m.id == 4242 and str(m.question[0].name) == "Web.Test."
    assert m.ednsflags & dns.flags.DO and m.payload == fw.UPSTREAM_PAYLOAD and not m.options


# --- against an in-process upstream ---------------------------------------------------------------


class Upstream:
    """A tiny DNS server on 127.0.0.1 (UDP and TCP on one port) answering with ``answer``."""

    def __init__(self, answer: Callable[[dns.message.Message, bool], list[bytes]]) -> None:
        self.answer = answer
        for _ in range(50):  # one port for both: the UDP one's number may be taken on TCP
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.port = self.udp.getsockname()[1]
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.tcp.bind(("127.0.0.1", self.port))
                break
            except OSError:
                self.udp.close()
                self.tcp.close()
        self.tcp.listen(8)
        self.udp.setblocking(False)
        self.tcp.setblocking(False)
        self.queries: list[tuple[str, bool]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.udp.fileno(), self._on_udp)
        self._task = loop.create_task(self._serve_tcp())

    def _on_udp(self) -> None:
        data, addr = self.udp.recvfrom(65535)
        m = dns.message.from_wire(data)
        self.queries.append((str(m.question[0].name), False))
        for out in self.answer(m, False):
            self.udp.sendto(out, addr)

    async def _serve_tcp(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.tcp)
            head = await loop.sock_recv(conn, 2)
            (n,) = struct.unpack("!H", head)
            data = b""
            while len(data) < n:
                data += await loop.sock_recv(conn, n - len(data))
            m = dns.message.from_wire(data)
            self.queries.append((str(m.question[0].name), True))
            for out in self.answer(m, True):
                await loop.sock_sendall(conn, struct.pack("!H", len(out)) + out)
            conn.close()

    async def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.udp.fileno())
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.udp.close()
        self.tcp.close()


def forwarder_for(up: Upstream, tmp: Path, **kw: object) -> fw.Forwarder:
    conf = tmp / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    src = fw.ResolvConfSource(str(conf))
    return fw.Forwarder(SocketFactory(mark=None), src, port=up.port, **kw)  # type: ignore[arg-type]


def reply_a(m: dns.message.Message, tcp: bool) -> list[bytes]:
    r = dns.message.make_response(m)
    r.answer.append(dns.rrset.from_text(m.question[0].name, 60, "IN", "A", "10.9.9.9"))
    return [r.to_wire()]


def reply_big_authoritative(m: dns.message.Message, tcp: bool) -> list[bytes]:
    """100 A records with AA set; over UDP only TC (so the forwarder asks again over TCP)."""
    r = dns.message.make_response(m)
    r.flags |= dns.flags.AA
    if not tcp:
        r.flags |= dns.flags.TC
        return [r.to_wire()]
    ips = [f"10.9.{i // 256}.{i % 256}" for i in range(100)]
    r.answer.append(dns.rrset.from_text(m.question[0].name, 60, "IN", "A", *ips))
    return [r.to_wire(max_size=65535)]


async def test_forwarded_answers_are_cut_to_the_client_and_never_authoritative(
    tmp_path: Path,
) -> None:
    # Rust forwarder.rs found(): !response.is_authoritative(); server.rs large_response: a
    # forwarded answer over UDP keeps the records that fit the client's size, with TC; over
    # TCP, all of them.
    up = Upstream(reply_big_authoritative)
    up.start()
    f = forwarder_for(up, tmp_path)

    async def run() -> None:
        for cached in (False, True):
            plain = await f.forward(req_of("big.test"), True)  # no EDNS: 512 bytes
            assert plain.cached is cached
            m = dns.message.from_wire(plain.reply)
            assert m.flags & dns.flags.TC and not m.flags & dns.flags.AA
            assert len(m.answer[0]) == 30 and len(plain.reply) <= 512
            edns = await f.forward(req_of("big.test", use_edns=0, payload=1232), True)
            m = dns.message.from_wire(edns.reply)
            assert m.flags & dns.flags.TC and len(m.answer[0]) == 74 and m.edns == 0
            tcp = await f.forward(req_of("big.test"), False)
            m = dns.message.from_wire(tcp.reply)
            assert not m.flags & (dns.flags.TC | dns.flags.AA) and len(m.answer[0]) == 100
        assert up.queries == [("big.test.", False), ("big.test.", True)]

    try:
        await run()
    finally:
        await up.close()


async def test_forward_caches_and_coalesces(tmp_path: Path) -> None:
    up = Upstream(reply_a)
    up.start()
    f = forwarder_for(up, tmp_path)

    async def run() -> None:
        results = await asyncio.gather(*(f.forward(req_of("web.test"), True) for _ in range(5)))
        assert all(not r.failed for r in results)
        assert len(up.queries) == 1  # one upstream query for five identical questions
        again = await f.forward(req_of("WEB.test"), True)
        assert again.cached and len(up.queries) == 1
        out = dns.message.from_wire(again.reply)
        assert str(out.answer[0][0]) == "10.9.9.9"

    try:
        await run()
    finally:
        await up.close()


async def test_forward_ignores_spoofed_replies_and_retries_truncated_over_tcp(
    tmp_path: Path,
) -> None:
    def answer(m: dns.message.Message, tcp: bool) -> list[bytes]:
        wrong = dns.message.make_response(m)
        wrong.id = (m.id + 1) % 65536
        wrong.answer.append(dns.rrset.from_text(m.question[0].name, 60, "IN", "A", "6.6.6.6"))
        r = dns.message.make_response(m)
        if not tcp:
            r.flags |= dns.flags.TC
            return [wrong.to_wire(), r.to_wire()]
        r.answer.append(dns.rrset.from_text(m.question[0].name, 60, "IN", "A", "10.9.9.9"))
        return [r.to_wire()]

    up = Upstream(answer)
    up.start()
    f = forwarder_for(up, tmp_path)

    async def run() -> None:
        got = await f.forward(req_of("big.test"), True)
        out = dns.message.from_wire(got.reply)
        assert [str(x) for x in out.answer[0]] == ["10.9.9.9"]
        assert up.queries == [("big.test.", False), ("big.test.", True)]

    try:
        await run()
    finally:
        await up.close()


async def test_forward_times_out_to_servfail(tmp_path: Path) -> None:
    up = Upstream(lambda m, tcp: [])  # never answers
    up.start()
    f = forwarder_for(up, tmp_path, deadline=1.0)

    async def run() -> None:
        t0 = time.monotonic()
        got = await f.forward(req_of("slow.test"), True)
        assert got.failed and wire.rcode_of(got.reply) == wire.SERVFAIL
        assert time.monotonic() - t0 < 2.0
        assert f.inflight == 0

    try:
        await run()
    finally:
        await up.close()


async def test_no_upstream_is_servfail(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# nothing\n")
    f = fw.Forwarder(SocketFactory(mark=None), fw.ResolvConfSource(str(conf)))
    got = await f.forward(req_of("x.test"), True)
    assert got.failed and wire.rcode_of(got.reply) == wire.SERVFAIL


def _cases() -> list[dns.message.Message]:
    out = []
    for opt in (
        None,
        [],
        [dns.edns.EDEOption(dns.edns.EDECode.STALE_ANSWER)],
        [dns.edns.NSIDOption(b"x")],
    ):
        m = response("web.test.", "A", "10.9.9.9", ttl=30)
        m.authority.append(dns.rrset.from_text("test.", 100, "IN", "NS", "ns.test."))
        m.additional.append(dns.rrset.from_text("ns.test.", 200, "IN", "A", "10.0.0.53"))
        if opt is not None:
            m.use_edns(0, 0, 4096, options=opt)
        m.flags |= dns.flags.TC  # cleared in what we relay (a TCP answer is complete)
        out.append(m)
    nx = response("nope.test.", "A", rcode=dns.rcode.NXDOMAIN)
    nx.authority.append(dns.rrset.from_text("test.", 300, "IN", "SOA", "ns. host. 1 2 3 4 15"))
    out.append(nx)
    return out


def test_render_raw_relays_what_render_does() -> None:
    # The upstream's bytes relayed (no re-rendering) must read exactly like dnspython's render.
    for m in _cases():
        raw = m.to_wire()
        parsed = dns.message.from_wire(raw)
        for do in (False, True):
            a, b = fw.render_raw(parsed, raw, do), fw.render(parsed, do)
            assert a.failed == b.failed
            for edns in (True, False):
                r = req_of("web.test" if m.answer else "nope.test", use_edns=0 if edns else False)
                x = dns.message.from_wire(fw.relay(r, a, 7, False))
                y = dns.message.from_wire(fw.relay(r, b, 7, False))
                assert x == y  # dnspython: same header, sections (and TTLs)
                assert (x.edns, x.payload, x.options) == (y.edns, y.payload, y.options)
                assert not x.flags & dns.flags.TC
