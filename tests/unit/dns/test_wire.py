"""The message format: the fast path against dnspython (fuzzed), and the exact shape of our
answers and errors (istio/ztunnel src/dns/handler.rs send_lookup/send_error, hickory-server
0.26.1 Server::handle_request)."""

from __future__ import annotations

import struct

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.update
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztunnel.core.addr import IPAddr, parse_ip
from ztunnel.dns import names, wire


def q(name: str, rdtype: str = "A", **kw: object) -> bytes:
    return dns.message.make_query(name, rdtype, **kw).to_wire()  # type: ignore[arg-type]


def test_fast_path_takes_the_hot_case() -> None:
    for data in (
        q("productpage.ns1.svc.cluster.local", "A"),
        q("Productpage", "AAAA", use_edns=0, payload=1232, want_dnssec=True),
        q("x.y", "A", use_edns=0, options=[dns.edns.GenericOption(10, b"12345678")]),
    ):
        fast = wire.parse_fast(data)
        assert fast is not None
        slow = wire._parse_slow(data)
        assert isinstance(slow, wire.Request)
        for attr in ("id", "flags", "opcode", "qcount", "question", "qname", "qtype", "qclass"):
            assert getattr(fast, attr) == getattr(slow, attr), attr
        assert fast.edns == slow.edns


@pytest.mark.parametrize(
    "data",
    [
        q("a.b", "A")[:-1],  # cut short
        q("a.b", "A") + b"\x00",  # trailing byte
        dns.update.UpdateMessage("example.test").to_wire(),  # opcode UPDATE
        q("a.b", "A", use_edns=0, options=[dns.edns.GenericOption(8, b"\x00\x01")]),  # ECS
        q("a\\.b.c", "A"),  # a dot inside a label
    ],
)
def test_fast_path_declines_the_rest(data: bytes) -> None:
    assert wire.parse_fast(data) is None


def _mutations() -> st.SearchStrategy[bytes]:
    base = st.sampled_from(
        [
            q("productpage.ns1.svc.cluster.local"),
            q("a", "AAAA", use_edns=0, payload=4096, want_dnssec=True),
            q("x.y.z", "A", use_edns=0, options=[dns.edns.GenericOption(10, b"1" * 16)]),
            q("svc", "TXT"),
        ]
    )

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(base))
        for _ in range(draw(st.integers(0, 4))):
            op = draw(st.integers(0, 2))
            if op == 0 and data:
                i = draw(st.integers(0, len(data) - 1))
                data[i] = draw(st.integers(0, 255))
            elif op == 1 and data:
                i = draw(st.integers(0, len(data)))
                del data[i:]
            else:
                data += draw(st.binary(max_size=8))
        return bytes(data)

    return mutate()


# Fuzz: wherever the fast path accepts, dnspython accepts too and reads the same query.
@settings(max_examples=3000, deadline=None)
@given(_mutations())
def test_fast_path_never_disagrees_with_dnspython(data: bytes) -> None:
    fast = wire.parse_fast(data)
    if fast is None:
        return
    try:
        msg = dns.message.from_wire(data, ignore_trailing=False)
    except Exception as e:
        raise AssertionError(f"fast path accepted what dnspython rejects: {e!r}") from e
    assert msg.id == fast.id and len(msg.question) == 1 and msg.opcode() == 0
    qs = msg.question[0]
    assert names.from_wire_labels(qs.name.labels) == fast.qname
    assert (int(qs.rdtype), int(qs.rdclass)) == (fast.qtype, fast.qclass)
    assert (msg.edns >= 0) == (fast.edns is not None)
    if fast.edns is not None:
        assert (msg.payload, msg.edns) == (fast.edns.payload, fast.edns.version)
        assert bool(msg.ednsflags & dns.flags.DO) == fast.edns.do


# Fuzz: any input gets a reply dnspython can read, or is dropped; never an exception.
@settings(max_examples=2000, deadline=None)
@given(st.one_of(_mutations(), st.binary(max_size=64)))
def test_any_input_is_answered_or_dropped(data: bytes) -> None:
    got = wire.parse(data)
    if isinstance(got, wire.Drop):
        assert len(data) < 12 or data[2] & 0x80
        return
    if isinstance(got, wire.FormErr):
        reply = dns.message.from_wire(got.reply)
        assert reply.rcode() == dns.rcode.FORMERR and reply.id == struct.unpack("!H", data[:2])[0]
        return
    err = dns.message.from_wire(wire.error(got, wire.SERVFAIL), ignore_trailing=False)
    assert err.rcode() == dns.rcode.SERVFAIL and err.id == got.id


def req(data: bytes) -> wire.Request:
    r = wire.parse(data)
    assert isinstance(r, wire.Request)
    return r


# handler.rs send_lookup: AA (from state), RA, RD copied, the question as asked, TTL 30,
# EDNS echoed (payload at least 512, the client's version and DO bit).
def test_answer_shape() -> None:
    data = q("ProductPage.ns1", "A", use_edns=0, payload=300, want_dnssec=True)
    r = req(data)
    out = dns.message.from_wire(
        wire.answer(r, [parse_ip("10.0.0.1"), parse_ip("10.0.0.2")]), ignore_trailing=False
    )
    assert out.id == r.id
    assert out.flags & (dns.flags.QR | dns.flags.AA | dns.flags.RA | dns.flags.RD) == (
        dns.flags.QR | dns.flags.AA | dns.flags.RA | dns.flags.RD
    )
    assert str(out.question[0].name) == "ProductPage.ns1."
    (rrset,) = out.answer
    assert rrset.ttl == 30 and sorted(str(x) for x in rrset) == ["10.0.0.1", "10.0.0.2"]
    assert out.edns == 0 and out.payload == 512 and out.ednsflags & dns.flags.DO


def test_answer_with_cname_and_no_edns() -> None:
    r = req(q("api.external.test.ns1.svc.cluster.local", "AAAA"))
    raw = wire.answer(r, [parse_ip("fd00::1")], cname=names.from_text("api.external.test"))
    out = dns.message.from_wire(raw, ignore_trailing=False)
    assert [(str(x.name), dns.rdatatype.to_text(x.rdtype)) for x in out.answer] == [
        ("api.external.test.ns1.svc.cluster.local.", "CNAME"),
        ("api.external.test.", "AAAA"),
    ]
    assert str(out.answer[0][0]) == "api.external.test." and out.edns == -1


def test_empty_answer_is_noerror() -> None:
    out = dns.message.from_wire(wire.answer(req(q("a.b", "AAAA")), []))
    assert out.rcode() == dns.rcode.NOERROR and not out.answer and out.flags & dns.flags.AA


# handler.rs send_error: the question echoed, RD/CD copied, no RA/AA, no EDNS.
def test_error_shape() -> None:
    data = q("a.b", "A", use_edns=0)
    out = dns.message.from_wire(wire.error(req(data), wire.NOTIMP))
    assert out.rcode() == dns.rcode.NOTIMP and str(out.question[0].name) == "a.b."
    assert not out.flags & (dns.flags.RA | dns.flags.AA) and out.flags & dns.flags.RD
    assert out.edns == -1


def test_update_gets_notimp_shape() -> None:
    u = dns.update.UpdateMessage("example.test")
    u.add("x.example.test", 30, "A", "1.2.3.4")
    r = req(u.to_wire())
    assert r.opcode == 5
    out = dns.message.from_wire(wire.error(r, wire.NOTIMP))
    assert out.rcode() == dns.rcode.NOTIMP and out.opcode() == 5


def _ips(n: int) -> list[IPAddr]:
    return [parse_ip(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}") for i in range(n)]


@pytest.mark.parametrize(
    ("edns", "udp", "n", "kept"),
    [
        # no EDNS: 512 bytes; header 12 + question 14 (big.test A) + 16 per A record
        (None, True, 100, 30),
        # EDNS 1232: the OPT's 11 bytes reserved
        (1232, True, 100, 74),
        (4096, True, 100, 100),  # fits: as is
        (100, True, 100, 29),  # a payload under 512 counts as 512 (and the OPT is kept)
        (None, False, 100, 100),  # TCP: one message of at most 65535 bytes
        (None, False, 5000, 4094),
    ],
)
def test_truncation_keeps_the_records_that_fit(
    edns: int | None, udp: bool, n: int, kept: int
) -> None:
    # hickory emit_message_parts: records emitted in order until one does not fit, TC set, the
    # counts those written. Rust's server.rs large_response: 256 A records, EDNS 1232 -> 74.
    kw = {} if edns is None else {"use_edns": 0, "payload": edns}
    r = req(q("big.test", "A", **kw))
    full = wire.answer(r, _ips(n))
    out = wire.fit(r, full, udp)
    m = dns.message.from_wire(out)
    got = [str(x) for rr in m.answer for x in rr]
    assert got == [str(ip) for ip in _ips(n)][:kept]
    assert bool(m.flags & dns.flags.TC) is (kept < n)
    assert m.flags & dns.flags.AA  # (still ours)
    assert len(out) <= (max(512, edns or 512) if udp else 65535)
    assert (m.edns, m.payload) == ((0, max(512, edns)) if edns else (-1, m.payload))
    if kept == n:
        assert out == full


def test_rust_large_response_count() -> None:
    # server.rs large_response: "large.com." A, 256 addresses, hickory's client (EDNS 1232).
    r = req(q("large.com.", "A", use_edns=0, payload=1232))
    m = dns.message.from_wire(wire.fit(r, wire.answer(r, _ips(256)), True))
    assert m.flags & dns.flags.TC and len(m.answer[0]) == 74
    tcp = dns.message.from_wire(wire.fit(r, wire.answer(r, _ips(256)), False))
    assert not tcp.flags & dns.flags.TC and len(tcp.answer[0]) == 256


def test_truncation_keeps_the_cname_first() -> None:
    r = req(q("Web", "A"))
    full = wire.answer(r, _ips(100), cname=("web", "ns1", "svc", "cluster", "local"))
    m = dns.message.from_wire(wire.fit(r, full, True))
    assert m.flags & dns.flags.TC
    assert m.answer[0].rdtype == dns.rdatatype.CNAME
    assert str(m.answer[1].name) == "web.ns1.svc.cluster.local."  # pointer into the CNAME target
    assert 20 < len(m.answer[1]) < 30


def test_truncation_of_a_relayed_message_cuts_across_sections_in_order() -> None:
    # answers first, then authority, then additional; a prefix, so pointers stay valid.
    m = dns.message.make_response(dns.message.make_query("big.test", "A"))
    m.answer.append(dns.rrset.from_text("big.test.", 60, "IN", "A", *map(str, _ips(20))))
    m.authority.append(
        dns.rrset.from_text("test.", 60, "IN", "NS", *(f"ns{i}.test." for i in range(40)))
    )
    m.additional.append(dns.rrset.from_text("ns0.test.", 60, "IN", "A", "10.0.0.53"))
    data = m.to_wire()
    r = req(q("big.test", "A"))
    out = dns.message.from_wire(wire.truncate(r, data, 512))
    assert out.flags & dns.flags.TC
    assert len(out.answer[0]) == 20 and 0 < len(out.authority[0]) < 40 and not out.additional
    for limit in range(30, len(data), 7):
        cut = wire.truncate(r, data, limit)
        assert len(cut) <= max(limit, 26)
        dns.message.from_wire(cut)  # well-formed at every size


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 300),
    v6=st.booleans(),
    cname=st.booleans(),
    payload=st.one_of(st.none(), st.integers(0, 65535)),
    udp=st.booleans(),
)
def test_fitted_answers_parse_and_keep_a_prefix(
    n: int, v6: bool, cname: bool, payload: int | None, udp: bool
) -> None:
    kw = {} if payload is None else {"use_edns": 0, "payload": payload}
    r = req(q("svc.ns1", "AAAA" if v6 else "A", **kw))
    ips = [parse_ip(f"fd00::{i:x}") for i in range(n)] if v6 else _ips(n)
    full = wire.answer(r, ips, cname=("svc", "ns1", "svc", "cluster", "local") if cname else None)
    out = wire.fit(r, full, udp)
    assert len(out) <= (r.udp_limit if udp else 65535)
    m = dns.message.from_wire(out)
    whole = dns.message.from_wire(full)
    got = [(rr.rdtype, str(x)) for rr in m.answer for x in rr]
    want = [(rr.rdtype, str(x)) for rr in whole.answer for x in rr]
    assert got == want[: len(got)]
    assert bool(m.flags & dns.flags.TC) is (len(got) < len(want))
    assert m.edns == whole.edns
    if len(got) < len(want):  # as many as fit: the next one would not have
        start = wire.skip_name(full, 12) + 4
        ends = []
        for _ in want:
            start = wire.skip_name(full, start)
            start += 10 + struct.unpack_from("!H", full, start + 8)[0]
            ends.append(start)
        nxt = ends[len(got)] - (ends[len(got) - 1] if got else wire.skip_name(full, 12) + 4)
        assert len(out) + nxt > (r.udp_limit if udp else 65535)


def test_drops_and_formerr() -> None:
    assert isinstance(wire.parse(b"\x00" * 11), wire.Drop)
    resp = dns.message.make_response(dns.message.make_query("a.b", "A")).to_wire()
    assert isinstance(wire.parse(resp), wire.Drop)
    bad = wire.parse(q("a.b")[:15])
    assert isinstance(bad, wire.FormErr)
    assert dns.message.from_wire(bad.reply).rcode() == dns.rcode.FORMERR


def test_type_text() -> None:
    assert [wire.type_text(t) for t in (1, 28, 16, 65, 65280)] == [
        "a",
        "aaaa",
        "txt",
        "https",
        "type65280",
    ]


def test_type_text_table_is_dnspythons() -> None:
    # the usual types are named without dnspython; the names must be its own
    for qtype, text in wire._TYPE_TEXT.items():
        assert dns.rdatatype.to_text(dns.rdatatype.RdataType.make(qtype)).lower() == text
