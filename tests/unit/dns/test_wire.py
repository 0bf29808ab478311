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

from ztunnel.core.addr import parse_ip
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


def test_truncation_for_udp() -> None:
    r = req(q("big.test", "A"))
    many = [parse_ip(f"10.0.{i // 256}.{i % 256}") for i in range(100)]
    full = wire.answer(r, many)
    assert len(full) > 512
    cut = dns.message.from_wire(wire.fit(r, full, udp=True))
    assert cut.flags & dns.flags.TC and not cut.answer and len(cut.question) == 1
    assert wire.fit(r, full, udp=False) == full
    huge = [parse_ip(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}") for i in range(5000)]
    cut_tcp = dns.message.from_wire(wire.fit(r, wire.answer(r, huge), udp=False))
    assert cut_tcp.flags & dns.flags.TC  # > 65535 bytes cannot be one TCP message
    big = req(q("big.test", "A", use_edns=0, payload=4096))
    assert wire.fit(big, wire.answer(big, many), udp=True) == wire.answer(big, many)


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
