"""Forwarding what is not ours to the upstream resolvers of ztunnel's own resolv.conf.

``istio/ztunnel:src/dns/server.rs`` ``SystemForwarder`` and ``src/dns/forwarder.rs``: the
nameservers of ztunnel's ``/etc/resolv.conf`` with the search list removed (the client already
applied its own), sockets from the proxy's marked socket factory (so istio-cni's rules never
capture them again; in shared mode they live in the pod's netns), a response cache of 4096
entries (``dns_resolver_opts.cache_size``). Differences from Rust, on purpose: the upstream
answer is relayed as it came (flags, rcode, authority section with its SOA, EDE options) rather
than rebuilt from hickory's ``Lookup``; only the ID, TTLs (aged in the cache), EDNS (the
client's) and AA change: a forwarded answer is never authoritative (Rust ``Response::from``
a lookup: ``is_authoritative: false``), and like any answer it is cut to the client's UDP size
keeping the records that fit (``wire.fit``).

Bounds: one upstream query per distinct in-flight question (followers wait for it), a fixed
number of questions in flight per forwarder, a deadline per forward after which the client gets
SERVFAIL, a bounded cache. A reply is accepted only from the server asked, with our random ID and
our question; anything else on the socket is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ztunnel.core.addr import IPAddr, SocketAddr, parse_ip
from ztunnel.dns import names, wire
from ztunnel.dns.names import Name
from ztunnel.logs import RateLimitedLog
from ztunnel.proxy.sockets import SocketFactory

# dnspython is imported with the first upstream reply (see wire.py).
if TYPE_CHECKING:
    import dns.message

    Answered = tuple[dns.message.Message, bytes]  # the parsed reply and its bytes

log = logging.getLogger("ztunnel.dns")

RESOLV_CONF = "/etc/resolv.conf"
CACHE_SIZE = 4096  # config.rs: dns_resolver_opts.cache_size
UPSTREAM_PAYLOAD = 1232
FORWARD_DEADLINE = 5.0  # hickory's default per-query timeout; the client gets SERVFAIL after it
MAX_INFLIGHT = 256  # distinct upstream questions in flight per forwarder
MAX_TTL = 86400
_RELOAD_EVERY = 1.0
_EDE = 15


# --- resolv.conf ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResolvConf:
    nameservers: tuple[IPAddr, ...] = ()
    search: tuple[Name, ...] = ()
    timeout: float = 5.0
    attempts: int = 2


def parse_resolv_conf(text: str) -> ResolvConf:
    """The parts of resolv.conf(5) a forwarder needs. Unparsable lines are skipped, as glibc
    does; the last ``search``/``domain`` line wins."""
    servers: list[IPAddr] = []
    search: tuple[Name, ...] = ()
    timeout, attempts = 5.0, 2
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        key, *vals = line.split()
        if key == "nameserver" and vals:
            with contextlib.suppress(ValueError):
                ip = parse_ip(vals[0].split("%", 1)[0])
                if ip not in servers:
                    servers.append(ip)
        elif key == "search":
            search = tuple(n for v in vals if (n := names.from_text(v)))
        elif key == "domain" and vals:
            search = (names.from_text(vals[0]),)
        elif key == "options":
            for opt in vals:
                name, _, value = opt.partition(":")
                with contextlib.suppress(ValueError):
                    if name == "timeout":
                        timeout = float(max(1, min(int(value), 30)))
                    elif name == "attempts":
                        attempts = max(1, min(int(value), 5))
    return ResolvConf(tuple(servers), search, timeout, attempts)


class ResolvConfSource:
    """resolv.conf, re-read when it changes (checked at most once a second)."""

    def __init__(self, path: str = RESOLV_CONF) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._checked = -1e9
        self.conf = ResolvConf()
        self.reload()

    def get(self) -> ResolvConf:
        now = time.monotonic()
        if now - self._checked >= _RELOAD_EVERY:
            self.reload()
        return self.conf

    def reload(self) -> None:
        self._checked = time.monotonic()
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path) as f:
                text = f.read(64 * 1024)
        except OSError as e:
            if self._stamp is not None or not self.conf.nameservers:
                log.warning("cannot read %s: %s; forwarding has no upstream", self.path, e)
            self._stamp = None
            self.conf = ResolvConf()
            return
        self._stamp = stamp
        self.conf = parse_resolv_conf(text)
        log.info(
            "dns: upstream resolvers from %s: %s",
            self.path,
            ", ".join(str(s) for s in self.conf.nameservers) or "none",
        )


# --- cache ---------------------------------------------------------------------------------------

CacheKey = tuple[bytes, int, int, int, bool]  # lower-case question name, type, class, RD|CD, DO


@dataclass(slots=True)
class Rendered:
    """An upstream response ready for clients: rendered once with EDNS (our payload, the DO bit
    of the cache key, EDE options only) and once without, each with the offsets of its TTLs, so
    a cache hit is a copy, a new ID, the client's question bytes and aged TTLs."""

    edns: bytes
    edns_ttls: tuple[int, ...]
    plain: bytes
    plain_ttls: tuple[int, ...]
    failed: bool  # what Rust counts as an upstream failure (see Forwarded)


@dataclass(slots=True)
class _Entry:
    rendered: Rendered
    stored: float
    expires: float


def response_ttl(msg: dns.message.Message) -> int | None:
    """How long a response may be cached: the smallest TTL of its records, or for a negative
    answer the SOA's (RFC 2308); None for what is never cached (errors, truncated, no TTL)."""
    import dns.flags
    import dns.rcode
    import dns.rdatatype

    rcode = msg.rcode()
    if msg.flags & dns.flags.TC or rcode not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
        return None
    if msg.answer and rcode == dns.rcode.NOERROR:
        ttls = [rr.ttl for sec in (msg.answer, msg.authority) for rr in sec]
        return min(min(ttls), MAX_TTL)
    for rr in msg.authority:
        if rr.rdtype == dns.rdatatype.SOA and len(rr):
            return int(min(rr.ttl, getattr(rr[0], "minimum", 0), MAX_TTL))
    return None


class ResponseCache:
    """LRU of rendered upstream responses by question, each valid for its TTL."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._d: OrderedDict[CacheKey, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: CacheKey, now: float) -> tuple[Rendered, int] | None:
        e = self._d.get(key)
        if e is None:
            return None
        if now >= e.expires:
            del self._d[key]
            return None
        self._d.move_to_end(key)
        return e.rendered, int(now - e.stored)

    def put(self, key: CacheKey, rendered: Rendered, ttl: int, now: float) -> None:
        if ttl <= 0 or self.size <= 0:
            return
        self._d[key] = _Entry(rendered, now, now + ttl)
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)


# --- relaying --------------------------------------------------------------------------------------


def render(msg: dns.message.Message, do: bool) -> Rendered:
    """The upstream ``msg`` as we relay it: flags, rcode and sections as they came (TC cleared:
    a TCP answer is complete; AA cleared: not our authority); with EDNS for EDNS clients,
    without for the others (an extended rcode they cannot see becomes SERVFAIL). Rendered once
    by dnspython; the variant without EDNS is the same bytes less the OPT record."""
    import dns.flags
    import dns.message

    rcode = msg.rcode()
    r = dns.message.Message(id=0)
    r.flags = msg.flags & ~(dns.flags.TC | dns.flags.AA)
    r.question = msg.question
    r.answer = msg.answer
    r.authority = msg.authority
    r.additional = msg.additional
    ede = [o for o in msg.options if o.otype == _EDE]
    r.use_edns(0, dns.flags.DO if do else 0, UPSTREAM_PAYLOAD, options=ede)
    r.set_rcode(rcode)
    e: bytes = r.to_wire(max_size=wire.MAX_MESSAGE)
    ttls, opt, _end, _last = _walk(e)
    if opt is None:  # (dnspython always writes the OPT we asked for)
        return Rendered(e, ttls, e, ttls, _failed(msg))
    return _variants(e, ttls, opt, rcode, _failed(msg))


def render_raw(msg: dns.message.Message, raw: bytes, do: bool) -> Rendered:
    """``render`` without re-rendering: the upstream's own bytes (dnspython parsed them, so
    their structure is good) with ID 0, TC and AA cleared and our payload in the OPT, when they
    need nothing else (no option but EDE, the OPT last, no TSIG); otherwise ``render``."""
    if any(o.otype != _EDE for o in msg.options) or msg.had_tsig:
        return render(msg, do)
    ttls, opt, end, last_is_opt = _walk(raw)
    if opt is not None and not last_is_opt:
        return render(msg, do)
    e = bytearray(raw[:end])
    struct.pack_into("!H", e, 0, 0)
    flags = struct.unpack_from("!H", e, 2)[0] & ~(wire.TC | wire.AA)
    struct.pack_into("!H", e, 2, flags)
    rcode = msg.rcode()
    if opt is None:
        # no OPT upstream: ours for EDNS clients (rcode fits the header)
        start = len(e)
        e += b"\x00" + struct.pack(
            "!HHIH", wire.TYPE_OPT, UPSTREAM_PAYLOAD, wire.DO_BIT if do else 0, 0
        )
        (ar,) = struct.unpack_from("!H", e, 10)
        struct.pack_into("!H", e, 10, ar + 1)
        opt = (start, len(e))
    else:
        struct.pack_into("!H", e, opt[0] + 3, UPSTREAM_PAYLOAD)
    return _variants(bytes(e), ttls, opt, rcode, _failed(msg))


def _variants(
    e: bytes, ttls: tuple[int, ...], opt: tuple[int, int], rcode: int, failed: bool
) -> Rendered:
    start, end = opt
    cut = end - start
    plain = bytearray(e[:start] + e[end:])
    (ar,) = struct.unpack_from("!H", plain, 10)
    struct.pack_into("!H", plain, 10, ar - 1)
    flags = struct.unpack_from("!H", plain, 2)[0] & ~0xF
    struct.pack_into("!H", plain, 2, flags | (rcode if rcode <= 15 else wire.SERVFAIL))
    pttls = tuple(o if o < start else o - cut for o in ttls)
    return Rendered(e, ttls, bytes(plain), pttls, failed)


def ttl_offsets(data: bytes) -> tuple[int, ...]:
    """Where the TTL of each record (not OPT) sits in ``data``."""
    return _walk(data)[0]


def _walk(data: bytes) -> tuple[tuple[int, ...], tuple[int, int] | None, int, bool]:
    """TTL offsets of the records of ``data``, where its OPT record starts and ends, where the
    message ends, and whether the OPT is the last record. Only for a message dnspython rendered
    or already parsed (so its structure is known good)."""
    qd, an, ns, ar = struct.unpack_from("!HHHH", data, 4)
    pos = 12
    for _ in range(qd):
        pos = wire.skip_name(data, pos) + 4
    out = []
    opt = None
    last_is_opt = False
    for _ in range(an + ns + ar):
        start = pos
        pos = wire.skip_name(data, pos)
        rtype, _cls, _ttl, rdlen = struct.unpack_from("!HHIH", data, pos)
        if rtype != wire.TYPE_OPT:
            out.append(pos + 4)
        pos += 10 + rdlen
        last_is_opt = rtype == wire.TYPE_OPT
        if last_is_opt:
            opt = (start, pos)
    return tuple(out), opt, pos, last_is_opt


def relay(req: wire.Request, rendered: Rendered, age: int, udp: bool) -> bytes:
    """A rendered response for this client: its ID, its question bytes (the same name, maybe
    in other case), TTLs less ``age``, fitted to its UDP size."""
    if req.edns is not None:
        data, ttls = rendered.edns, rendered.edns_ttls
    else:
        data, ttls = rendered.plain, rendered.plain_ttls
    buf = bytearray(data)
    struct.pack_into("!H", buf, 0, req.id)
    q = req.question
    if len(q) and buf[12 : 12 + len(q)].lower() == q.lower():
        buf[12 : 12 + len(q)] = q
    if age > 0:
        for off in ttls:
            (ttl,) = struct.unpack_from("!I", buf, off)
            struct.pack_into("!I", buf, off, max(0, ttl - age))
    return wire.fit(req, bytes(buf), udp)


def upstream_query(req: wire.Request, qid: int) -> bytes:
    """Our query upstream: the client's question (as sent) with RD/CD copied, our ID, EDNS with
    our payload and the client's DO bit, no other options."""
    flags = req.flags & (wire.RD | wire.CD)
    do = wire.DO_BIT if req.edns is not None and req.edns.do else 0
    opt = b"\x00" + struct.pack("!HHIH", wire.TYPE_OPT, UPSTREAM_PAYLOAD, do, 0)
    return wire.HEADER.pack(qid, flags, 1, 0, 0, 1) + req.question + opt


# --- the forwarder ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Forwarded:
    """What the client gets, and whether Rust would count an upstream failure (a hickory
    ``lookup`` error: no answer, an error rcode, or NOERROR without records)."""

    reply: bytes
    failed: bool
    cached: bool = False


@dataclass(slots=True)
class _Flight:
    future: asyncio.Future[Rendered | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Forwarder:
    """One pod's forwarder: its socket factory (its netns, ztunnel's mark) and its cache."""

    def __init__(
        self,
        sockets: SocketFactory,
        source: ResolvConfSource,
        *,
        cache_size: int = CACHE_SIZE,
        deadline: float = FORWARD_DEADLINE,
        max_inflight: int = MAX_INFLIGHT,
        name: str = "",
        port: int = 53,
    ) -> None:
        self.sockets = sockets
        self.source = source
        self.cache = ResponseCache(cache_size)
        self.deadline = deadline
        self.max_inflight = max_inflight
        self.name = name
        self.port = port  # resolv.conf has no ports; other than 53 only in tests
        self._flights: dict[CacheKey, _Flight] = {}
        self._log = RateLimitedLog(log)

    @property
    def inflight(self) -> int:
        return len(self._flights)

    def search_domains(self) -> list[Name]:
        return list(self.source.get().search)

    def cached(self, req: wire.Request, udp: bool) -> Forwarded | None:
        """The answer from the cache, without waiting; None if it is not there."""
        hit = self.cache.get(_key(req), time.monotonic())
        if hit is None:
            return None
        rendered, age = hit
        return Forwarded(relay(req, rendered, age, udp), rendered.failed, cached=True)

    async def forward(self, req: wire.Request, udp: bool) -> Forwarded:
        got = self.cached(req, udp)
        if got is not None:
            return got
        key = _key(req)
        flight = self._flights.get(key)
        rendered: Rendered | None
        if flight is None:
            if len(self._flights) >= self.max_inflight:
                self._log.warning("busy", "dns %s: too many upstream queries in flight", self.name)
                return Forwarded(wire.error(req, wire.SERVFAIL), True)
            flight = self._flights[key] = _Flight()
            try:
                answered = await self._resolve(req)
                msg = None if answered is None else answered[0]
                rendered = None if answered is None else render_raw(*answered, key[4])
            except asyncio.CancelledError:
                flight.future.cancel()
                raise
            except Exception:
                flight.future.set_result(None)
                raise
            finally:
                del self._flights[key]
            flight.future.set_result(rendered)
            if msg is not None and rendered is not None:
                ttl = response_ttl(msg)
                if ttl is not None:
                    self.cache.put(key, rendered, ttl, time.monotonic())
        else:
            rendered = await asyncio.shield(flight.future)
        if rendered is None:
            return Forwarded(wire.error(req, wire.SERVFAIL), True)
        return Forwarded(relay(req, rendered, 0, udp), rendered.failed)

    async def _resolve(self, req: wire.Request) -> Answered | None:
        conf = self.source.get()
        if not conf.nameservers:
            self._log.warning("noupstream", "dns %s: no upstream nameserver configured", self.name)
            return None
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadline
        tries = [s for _ in range(conf.attempts) for s in conf.nameservers]
        per_try = max(0.5, min(conf.timeout, self.deadline / len(tries)))
        for server in tries:
            left = end - loop.time()
            if left <= 0.01:
                break
            qid = secrets.randbelow(65536)
            query = upstream_query(req, qid)
            target = SocketAddr(server, self.port)
            try:
                msg = await self._udp(target, query, qid, req, min(per_try, left))
                if msg is not None and msg[0].flags & wire.TC:
                    left = end - loop.time()
                    if left <= 0.01:
                        break
                    msg = await self._tcp(target, query, qid, req, left)
            except OSError as e:
                self._log.info(
                    f"up:{server}", "dns %s: upstream %s failed: %s", self.name, target, e
                )
                continue
            if msg is not None:
                return msg
        self._log.info("timeout", "dns %s: no upstream answered in time", self.name)
        return None

    async def _udp(
        self, target: SocketAddr, query: bytes, qid: int, req: wire.Request, timeout: float
    ) -> Answered | None:
        loop = asyncio.get_running_loop()
        sock = self.sockets.datagram(target.family)
        try:
            sock.connect(target.sockaddr())
            sock.send(query)
            deadline = loop.time() + timeout
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    async with asyncio.timeout(left):  # (no extra task, unlike wait_for)
                        data = await loop.sock_recv(sock, 65535)
                except TimeoutError:
                    return None
                msg = _accept(data, qid, req)
                if msg is not None:
                    return msg
        finally:
            sock.close()

    async def _tcp(
        self, target: SocketAddr, query: bytes, qid: int, req: wire.Request, timeout: float
    ) -> Answered | None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                sock = await self.sockets.connect(target, timeout=timeout)
                try:
                    await loop.sock_sendall(sock, struct.pack("!H", len(query)) + query)
                    head = await _recv_exactly(loop, sock, 2)
                    (n,) = struct.unpack("!H", head)
                    data = await _recv_exactly(loop, sock, n)
                finally:
                    sock.close()
        except TimeoutError:
            return None
        except Exception as e:  # UpstreamConnectError and friends
            raise OSError(errno.ECONNREFUSED, str(e)) from None
        return _accept(data, qid, req)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise OSError(errno.ECONNRESET, "upstream closed the connection")
        buf += chunk
    return bytes(buf)


def _accept(data: bytes, qid: int, req: wire.Request) -> Answered | None:
    """The upstream reply if it answers our query (ID, QR, one question: ours), else None."""
    q = req.question
    if len(data) < 12 + len(q):
        return None
    rid, flags, qd = struct.unpack_from("!HHH", data)
    # A reply may omit the question only when it carries an error (e.g. FORMERR); we ask
    # nothing that should get one, so treat it as no answer. Our question is the first name in
    # the message, so never compressed: compare its bytes (case-insensitively).
    if rid != qid or not flags & wire.QR or qd != 1 or data[12 : 12 + len(q)].lower() != q.lower():
        return None
    import dns.message

    try:
        msg = dns.message.from_wire(data, ignore_trailing=True)
    except Exception:  # dnspython raises many kinds on bad input; all mean "not an answer"
        return None
    return msg, data


def _key(req: wire.Request) -> CacheKey:
    return (
        req.question[: len(req.question) - 4].lower(),
        req.qtype,
        req.qclass,
        req.flags & (wire.RD | wire.CD),
        bool(req.edns is not None and req.edns.do),
    )


def _failed(msg: dns.message.Message) -> bool:
    import dns.rcode

    return msg.rcode() != dns.rcode.NOERROR or not msg.answer
