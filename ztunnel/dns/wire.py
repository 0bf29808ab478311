"""The DNS message format: requests in, our own answers and errors out.

Every request is parsed by dnspython except the hot case, which a small fast path handles: one
question, no answer/authority records, at most an OPT record with options known to be valid
(cookie, padding), no compression in the question. Anything else, and anything the fast path is
unsure about, goes to dnspython, so the fast path can only decline, never decide differently
(``tests/unit/dns/test_wire.py`` fuzzes the two against each other). Our own responses are
small and fixed in shape (header, the question as the client sent it, CNAME/A/AAAA records with
compression pointers, an OPT record) and are written directly.

Rust behaviour mirrored (``hickory-server`` 0.26.1 ``Server::handle_request`` and
``istio/ztunnel:src/dns/handler.rs``): fewer than 12 bytes or a response (QR=1) is dropped; a
message that does not parse gets FORMERR (header only); an opcode other than QUERY gets NOTIMP;
error responses echo the question, copy RD and CD, and carry no EDNS; answers set RA, AA when
from state, and echo EDNS (payload at least 512, the client's version and DO bit). A UDP answer
larger than the client's payload size keeps the records that fit, with TC set.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ztunnel.core.addr import IPAddr
from ztunnel.dns import names
from ztunnel.dns.names import Name

# dnspython (about 3.8 MiB of a process's memory, issue 18) is imported only when a message
# needs it: a query off the fast path here, a reply from upstream in the forwarder.
if TYPE_CHECKING:
    import dns.message
    import dns.name

HEADER = struct.Struct("!HHHHHH")
QR = 0x8000
AA = 0x0400
TC = 0x0200
RD = 0x0100
RA = 0x0080
CD = 0x0010
OPCODE_MASK = 0x7800
TYPE_OPT = 41
TYPE_CNAME = 5
CLASS_IN = 1
DO_BIT = 0x8000
UDP_MIN = 512
MAX_MESSAGE = 65535

NOERROR = 0
FORMERR = 1
SERVFAIL = 2
NXDOMAIN = 3
NOTIMP = 4
REFUSED = 5

_OK_OPTIONS = {10, 12}  # COOKIE (length-checked below), PADDING


@dataclass(frozen=True, slots=True)
class Edns:
    payload: int
    version: int
    do: bool


@dataclass(slots=True)
class Request:
    """A parsed query. ``question`` is the question section exactly as the client sent it (or
    as dnspython re-rendered it); ``qname`` is None when a label can never be one of ours."""

    id: int
    flags: int
    opcode: int
    qcount: int
    question: bytes
    qname: Name | None
    qname_wire: dns.name.Name | None
    qtype: int
    qclass: int
    edns: Edns | None
    message: dns.message.Message | None = None  # only when dnspython parsed it
    raw: bytes | None = None  # the request as received (the fast path keeps it)

    @property
    def udp_limit(self) -> int:
        if self.edns is None:
            return UDP_MIN
        return max(UDP_MIN, min(self.edns.payload, MAX_MESSAGE))


class Drop:
    """Send nothing back (too short to have a header, or a response sent to us)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FormErr:
    """Unparsable past the header: FORMERR, header only."""

    reply: bytes
    reason: str


def parse(wire: bytes) -> Request | Drop | FormErr:
    if len(wire) < 12:
        return Drop("shorter than a DNS header")
    flags = struct.unpack_from("!H", wire, 2)[0]
    if flags & QR:
        return Drop("a response sent as a query")
    fast = parse_fast(wire)
    if fast is not None:
        return fast
    return _parse_slow(wire)


def parse_fast(wire: bytes) -> Request | None:
    """The hot case, or None to let dnspython decide."""
    n = len(wire)
    if n < 17 or n > MAX_MESSAGE:
        return None
    qid, flags, qd, an, ns, ar = HEADER.unpack_from(wire)
    if qd != 1 or an or ns or ar > 1 or flags & (QR | OPCODE_MASK):
        return None
    pos = 12
    labels: list[bytes] = []
    total = 1
    while True:
        if pos >= n:
            return None
        ln = wire[pos]
        if ln == 0:
            pos += 1
            break
        if ln > 63:
            return None  # compression or an extended label type: not in a plain query
        total += ln + 1
        if total > 255 or pos + 1 + ln > n:
            return None
        labels.append(wire[pos + 1 : pos + 1 + ln])
        pos += 1 + ln
    if pos + 4 > n:
        return None
    qtype, qclass = struct.unpack_from("!HH", wire, pos)
    pos += 4
    qend = pos
    edns: Edns | None = None
    if ar:
        if pos + 11 > n or wire[pos] != 0:
            return None
        rtype, payload, ttl, rdlen = struct.unpack_from("!HHIH", wire, pos + 1)
        pos += 11
        if rtype != TYPE_OPT or pos + rdlen != n:
            return None
        end = n
        while pos < end:
            if pos + 4 > end:
                return None
            code, olen = struct.unpack_from("!HH", wire, pos)
            pos += 4 + olen
            if pos > end or code not in _OK_OPTIONS:
                return None
            if code == 10 and not (olen == 8 or 16 <= olen <= 40):
                return None
        edns = Edns(payload, (ttl >> 16) & 0xFF, bool(ttl & DO_BIT))
    elif pos != n:
        return None
    for label in labels:
        for b in label:
            # Only plain hostname bytes: dnspython and we then agree on the name trivially.
            if not (0x61 <= b <= 0x7A or 0x41 <= b <= 0x5A or 0x30 <= b <= 0x39 or b in b"-_*"):
                return None
    qname = tuple(label.decode("ascii").lower() for label in labels)
    return Request(qid, flags, 0, 1, wire[12:qend], qname, None, qtype, qclass, edns, raw=wire)


def _parse_slow(wire: bytes) -> Request | FormErr:
    import dns.flags
    import dns.message

    qid, flags = struct.unpack_from("!HH", wire)
    try:
        msg = dns.message.from_wire(wire, ignore_trailing=False)
    except Exception as e:  # dnspython raises many kinds for bad input; all mean FORMERR
        reason = f"{type(e).__name__}: {e}"[:200]
        return FormErr(header_only(qid, flags, FORMERR), reason)
    opcode = msg.opcode()
    question = b""
    questions = list(msg.sections[0])
    for rrset in questions:
        question += (rrset.name.to_wire() or b"") + struct.pack("!HH", rrset.rdtype, rrset.rdclass)
    qname: Name | None = None
    qname_wire: dns.name.Name | None = None
    qtype = qclass = 0
    if len(questions) == 1:
        q = questions[0]
        qname_wire = q.name
        qname = names.from_wire_labels(q.name.labels)
        qtype, qclass = int(q.rdtype), int(q.rdclass)
    edns = None
    if msg.edns >= 0:
        edns = Edns(msg.payload, msg.edns, bool(msg.ednsflags & dns.flags.DO))
    return Request(
        qid,
        flags,
        int(opcode),
        len(questions),
        question,
        qname,
        qname_wire,
        qtype,
        qclass,
        edns,
        msg,
    )


def header_only(qid: int, flags: int, rcode: int) -> bytes:
    return HEADER.pack(qid, QR | (flags & (OPCODE_MASK | RD | CD)) | rcode, 0, 0, 0, 0)


def error(req: Request, rcode: int) -> bytes:
    """``send_error``: the question echoed, RD/CD copied, no RA, no EDNS."""
    flags = QR | (req.flags & (OPCODE_MASK | RD | CD)) | (rcode & 0xF)
    return HEADER.pack(req.id, flags, req.qcount, 0, 0, 0) + req.question


def _opt(edns: Edns | None) -> bytes:
    if edns is None:
        return b""
    ttl = (edns.version << 16) | (DO_BIT if edns.do else 0)
    return b"\x00" + struct.pack("!HHIH", TYPE_OPT, max(edns.payload, UDP_MIN), ttl, 0)


def answer(
    req: Request,
    addresses: tuple[IPAddr, ...] | list[IPAddr],
    *,
    cname: Name | None = None,
    ttl: int = 30,
    authoritative: bool = True,
) -> bytes:
    """``send_lookup``: our answer (CNAME first if any, then A/AAAA), RA set, EDNS echoed.
    Requires a single question (the owner names point at it)."""
    flags = QR | RA | (req.flags & (OPCODE_MASK | RD | CD)) | (AA if authoritative else 0)
    body = bytearray(req.question)
    count = 0
    owner = b"\xc0\x0c"
    if cname is not None:
        target_off = 12 + len(body) + 12  # after this record's owner, type/class/ttl/rdlen
        target = b"".join(bytes([len(lb)]) + lb.encode("ascii") for lb in cname) + b"\x00"
        body += owner + struct.pack("!HHIH", TYPE_CNAME, CLASS_IN, ttl, len(target)) + target
        count += 1
        owner = struct.pack("!H", 0xC000 | target_off) if target_off < 0x3FFF else target
    for ip in addresses:
        raw = ip.packed
        rtype = 1 if len(raw) == 4 else 28
        body += owner + struct.pack("!HHIH", rtype, CLASS_IN, ttl, len(raw)) + raw
        count += 1
    opt = _opt(req.edns)
    return HEADER.pack(req.id, flags, 1, count, 0, 1 if opt else 0) + bytes(body) + opt


def fit(req: Request, wire: bytes, udp: bool) -> bytes:
    """A response that fits the client's UDP size (512 bytes without EDNS, else its EDNS
    payload) or one TCP message: as is, or :func:`truncate`d to it."""
    limit = req.udp_limit if udp else MAX_MESSAGE
    if len(wire) <= limit:
        return wire
    return truncate(req, wire, limit)


def truncate(req: Request, wire: bytes, limit: int) -> bytes:
    """As many whole records as fit in ``limit`` bytes, with TC set and the counts of what was
    kept (hickory ``emit_message_parts``: records in order, the header counts what was
    written), so a client can use them or retry over TCP. The OPT record is kept (RFC 6891 7:
    a truncated response still carries it), space for it reserved. Records are kept as a
    prefix, in order, answers then authority then additional: compression pointers only point
    backwards, so what is kept stays valid. ``wire`` must be a well-formed message (ours, or
    an upstream reply dnspython parsed)."""
    qid, flags, qd, an, ns, ar = HEADER.unpack_from(wire)
    pos = 12
    for _ in range(qd):
        pos = skip_name(wire, pos) + 4
    question_end = pos
    records: list[tuple[int, int]] = []  # (end offset, section) of each record before the OPT
    opt = b""
    for i in range(an + ns + ar):
        start = pos
        pos = skip_name(wire, pos)
        rtype, _cls, _ttl, rdlen = struct.unpack_from("!HHIH", wire, pos)
        pos += 10 + rdlen
        if rtype == TYPE_OPT:
            opt = wire[start:pos]
            break  # (always the last record here; anything after it is not kept)
        records.append((pos, 0 if i < an else 1 if i < an + ns else 2))
    if req.edns is None:
        opt = b""
    elif not opt or question_end + len(opt) > limit:
        opt = _opt(req.edns)  # (an upstream OPT too big even alone: a bare one)
    end, counts = question_end, [0, 0, 0]
    for stop, section in records:
        if stop + len(opt) > limit:
            break
        end = stop
        counts[section] += 1
    head = HEADER.pack(qid, flags | TC, qd, counts[0], counts[1], counts[2] + (1 if opt else 0))
    return head + wire[12:end] + opt


def skip_name(data: bytes, pos: int) -> int:
    """Past the name at ``pos`` of a well-formed message (labels, then a zero or a pointer)."""
    while True:
        b = data[pos]
        if b == 0:
            return pos + 1
        if b & 0xC0:
            return pos + 2
        pos += b + 1


def rcode_of(wire: bytes) -> int:
    return int(struct.unpack_from("!H", wire, 2)[0]) & 0xF


# dnspython's names of the usual query types (tests/unit/dns/test_wire.py checks them against
# it), so that answering these needs no dnspython.
_TYPE_TEXT = {
    1: "a", 2: "ns", 5: "cname", 6: "soa", 12: "ptr", 15: "mx", 16: "txt", 28: "aaaa",
    33: "srv", 35: "naptr", 43: "ds", 48: "dnskey", 64: "svcb", 65: "https", 255: "any",
    257: "caa",
}  # fmt: skip


@functools.lru_cache(maxsize=256)
def type_text(qtype: int) -> str:
    """The metric label: the record type name in lower case (``a``, ``aaaa``, ``type65535``)."""
    known = _TYPE_TEXT.get(qtype)
    if known is not None:
        return known
    import dns.exception
    import dns.rdatatype

    try:
        return dns.rdatatype.to_text(dns.rdatatype.RdataType.make(qtype)).lower()
    except (ValueError, dns.exception.DNSException):
        return "unknown"


def opcode_text(opcode: int) -> str:
    import dns.exception
    import dns.opcode

    try:
        return dns.opcode.to_text(dns.opcode.Opcode.make(opcode))
    except (ValueError, dns.exception.DNSException):
        return str(opcode)


def question_name(req: Request) -> str | None:
    """The question's name as the client wrote it (its case), dot-terminated as hickory prints
    a name: ``Productpage.default.``."""
    if req.qcount != 1:
        return None
    if req.qname_wire is not None:
        return str(req.qname_wire.to_text())
    q, labels, i = req.question, [], 0
    while i < len(q) and q[i] != 0:
        n = q[i]
        labels.append(q[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return ".".join(labels) + "."


def rcode_text(rcode: int) -> str:
    import dns.rcode

    return dns.rcode.to_text(dns.rcode.Rcode.make(rcode))
