"""Test apps to run in a pod netns (echo, sink, source) and client helpers for the test process.

Run an app with ``python -m ztunnel.testing.apps <app> [--port P ...] ...`` (or ``start_app``);
it prints ``READY <port> ...`` once every listener is bound, then serves until SIGTERM.

* ``echo``: echoes bytes back; on client EOF, finishes writing and sends FIN. With
  ``--announce`` it first sends one line ``PEER <peer_ip> <peer_port> <local_ip> <local_port>``
  (IPs canonical: IPv4-mapped IPv6 shown as IPv4), so a test can assert the source IP the app saw.
  With ``--proxy-protocol`` each connection must start with a PROXY protocol v2 header (an
  application tunnel): it is parsed (as the spec's section 2.2 says, not with ztunnel's code) and
  answered with one line ``PROXY <src> <dst> <TLV 0xD0 or ->`` before anything else; a
  connection without a valid header gets ``BADPROXY <why>`` and is closed.
* ``sink``: reads until EOF, then replies ``<count> <sha256>`` and closes (half-close test).
* ``forward``: a plain TCP forwarder to ``--to <ip>:<port>`` with half-close kept (stands in
  for a waypoint proxy in the sandbox: it picks the endpoint and sends the bytes on).
* ``source``: sends ``--bytes`` bytes of ``payload(seed)`` then FIN, keeps reading until the
  client's EOF and prints ``RECEIVED <count> <sha256> <peer_ip>`` on its stdout.

Listeners bind ``[::]`` dual-stack, so one port serves IPv4 and IPv6.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from ztunnel.testing.netns import Host, NsProcess, in_netns

READY: Final = "READY"
CHUNK: Final = 64 * 1024
MODULE: Final = "ztunnel.testing.apps"


# --------------------------------------------------------------------------------------------
# deterministic payloads and digests


def payload_chunks(n: int, seed: int = 0, chunk: int = CHUNK) -> Iterator[bytes]:
    """``n`` deterministic pseudo-random bytes for ``seed``, in chunks of ``chunk`` bytes.

    The bytes depend only on (n, seed), for any ``chunk`` that is a multiple of 4.
    """
    rng = random.Random(seed)
    left = n
    while left > 0:
        size = min(chunk, left)
        yield rng.randbytes(size)
        left -= size


def payload(n: int, seed: int = 0) -> bytes:
    """All of ``payload_chunks(n, seed)`` at once (for small transfers)."""
    return b"".join(payload_chunks(n, seed))


@dataclass(frozen=True, slots=True)
class Digest:
    """Byte count and SHA-256 of a transfer; ``str()`` is the ``"<count> <sha256>"`` wire line."""

    count: int
    sha256: str

    def __str__(self) -> str:
        return f"{self.count} {self.sha256}"

    @classmethod
    def of(cls, data: bytes) -> Digest:
        return cls(len(data), hashlib.sha256(data).hexdigest())

    @classmethod
    def of_payload(cls, n: int, seed: int = 0) -> Digest:
        h = Hasher()
        for c in payload_chunks(n, seed):
            h.update(c)
        return h.digest()

    @classmethod
    def parse(cls, text: str) -> Digest:
        count, sha = text.split()[-2:]
        return cls(int(count), sha)


class Hasher:
    """Running byte count + SHA-256."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.count += len(data)

    def digest(self) -> Digest:
        return Digest(self.count, self._h.hexdigest())


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """The ``PEER`` line an ``echo --announce`` server sends first."""

    peer_ip: str
    peer_port: int
    local_ip: str
    local_port: int

    def line(self) -> str:
        return f"PEER {self.peer_ip} {self.peer_port} {self.local_ip} {self.local_port}"

    @classmethod
    def parse(cls, text: str) -> PeerInfo:
        parts = text.split()
        if len(parts) != 5 or parts[0] != "PEER":
            raise ValueError(f"not a PEER line: {text!r}")
        return cls(parts[1], int(parts[2]), parts[3], int(parts[4]))


def canonical_ip(text: str) -> str:
    """``::ffff:1.2.3.4`` -> ``1.2.3.4``; other addresses unchanged (scope ids dropped)."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


# --------------------------------------------------------------------------------------------
# servers (run inside the pod netns)


def _peer_info(writer: asyncio.StreamWriter) -> PeerInfo:
    peer = writer.get_extra_info("peername")
    local = writer.get_extra_info("sockname")
    return PeerInfo(canonical_ip(peer[0]), peer[1], canonical_ip(local[0]), local[1])


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


async def read_proxy_v2(reader: asyncio.StreamReader) -> str:
    """Read a PROXY protocol v2 header; the ``PROXY <src> <dst> <authority TLV>`` line for it.
    Raises ValueError when the stream does not start with a valid one."""
    head = await reader.readexactly(16)
    if head[:12] != PROXY_V2_SIGNATURE:
        raise ValueError("no PROXY v2 signature")
    ver_cmd, fam, length = struct.unpack("!BBH", head[12:])
    if ver_cmd != 0x21:
        raise ValueError(f"version/command {ver_cmd:#x}, want 0x21 (v2, PROXY)")
    body = await reader.readexactly(length)
    if fam == 0x11:
        src_raw, dst_raw, sport, dport = struct.unpack("!4s4sHH", body[:12])
        rest = body[12:]
    elif fam == 0x21:
        src_raw, dst_raw, sport, dport = struct.unpack("!16s16sHH", body[:36])
        rest = body[36:]
    else:
        raise ValueError(f"family/protocol {fam:#x}, want TCP over IPv4 or IPv6")
    authority = "-"
    while rest:
        if len(rest) < 3:
            raise ValueError("truncated TLV")
        kind, n = struct.unpack("!BH", rest[:3])
        value, rest = rest[3 : 3 + n], rest[3 + n :]
        if len(value) != n:
            raise ValueError("truncated TLV value")
        if kind == 0xD0:
            authority = value.decode()
    src = canonical_ip(str(ipaddress.ip_address(src_raw)))
    dst = canonical_ip(str(ipaddress.ip_address(dst_raw)))
    return f"PROXY {src}:{sport} {dst}:{dport} {authority}"


async def _echo(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    announce: bool,
    proxy_protocol: bool = False,
) -> None:
    if proxy_protocol:
        try:
            line = await read_proxy_v2(reader)
        except (ValueError, asyncio.IncompleteReadError) as e:
            writer.write(f"BADPROXY {e}\n".encode())
            await _close(writer)
            return
        writer.write(line.encode() + b"\n")
    try:
        if announce:
            writer.write(_peer_info(writer).line().encode() + b"\n")
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()
    except OSError:
        pass
    finally:
        await _close(writer)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass


async def _forward(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(host, port, limit=CHUNK)
    except OSError:
        await _close(writer)
        return
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        await _close(up_writer)
        await _close(writer)


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    h = Hasher()
    try:
        while data := await reader.read(CHUNK):
            h.update(data)
        writer.write(f"{h.digest()}\n".encode())
        await writer.drain()
    except OSError:
        pass
    finally:
        await _close(writer)


async def _source(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nbytes: int, seed: int
) -> None:
    peer = _peer_info(writer)
    h = Hasher()
    try:
        for c in payload_chunks(nbytes, seed):
            writer.write(c)
            await writer.drain()
        writer.write_eof()
        while data := await reader.read(CHUNK):
            h.update(data)
        print(f"RECEIVED {h.digest()} {peer.peer_ip}", flush=True)
    except OSError as e:
        print(f"ERROR {e!r} {peer.peer_ip}", flush=True)
    finally:
        await _close(writer)


def dual_stack_listener(port: int, host: str = "::", backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``[host]:port`` (``::`` also accepts IPv4), SO_REUSEADDR set."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


async def _serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.app == "echo":
        announce: bool = args.announce
        proxy_protocol: bool = args.proxy_protocol

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await _echo(r, w, announce, proxy_protocol)

    elif args.app == "sink":

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await _sink(r, w)

    elif args.app == "forward":
        to_host, _, to_port = str(args.to).rpartition(":")
        to_host = to_host.strip("[]")

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await _forward(r, w, to_host, int(to_port))

    else:
        nbytes: int = args.bytes
        seed: int = args.seed

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await _source(r, w, nbytes, seed)

    servers = []
    ports: list[int] = []
    for port in args.port or [8080]:
        sock = dual_stack_listener(port, args.host)
        ports.append(sock.getsockname()[1])
        servers.append(await asyncio.start_server(handler, sock=sock, limit=CHUNK))
    print(f"{READY} {' '.join(map(str, ports))}", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    sub = parser.add_subparsers(dest="app", required=True)
    for name in ("echo", "sink", "source", "forward"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, action="append", help="repeatable; 0 = ephemeral")
        p.add_argument("--host", default="::", help="bind address (default: [::] dual-stack)")
        if name == "echo":
            p.add_argument("--announce", action="store_true", help="send a PEER line first")
            p.add_argument(
                "--proxy-protocol",
                action="store_true",
                help="expect a PROXY v2 header and answer a PROXY line first",
            )
        if name == "forward":
            p.add_argument("--to", required=True, help="<ip>:<port> to forward to")
        if name == "source":
            p.add_argument("--bytes", type=int, default=1 << 20)
            p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


# --------------------------------------------------------------------------------------------
# harness side (the test process)


class App:
    """A running test app: its process and the ports it reported ready on."""

    def __init__(self, host: Host, proc: NsProcess) -> None:
        self.host = host
        self.proc = proc
        line = proc.ready_line or ""
        self.ports = [int(p) for p in line.split()[1:]]

    @property
    def port(self) -> int:
        return self.ports[0]

    def wait_for_line(self, prefix: str, timeout: float = 10.0) -> str:
        return self.proc.wait_for_line(prefix, timeout)

    def stop(self) -> int | None:
        return self.proc.stop()


def start_app(host: Host, app: str, *args: str, ports: Sequence[int] = (8080,)) -> App:
    """Start ``app`` (echo/sink/source) in ``host``'s netns and wait until it listens."""
    port_args = [a for p in ports for a in ("--port", str(p))]
    return App(host, host.exec_python_module(MODULE, app, *port_args, *args))


def start_dnsmasq(
    host: Host, listen: Sequence[str], *args: str, port: int = 53, log: str = "/dev/null"
) -> NsProcess:
    """dnsmasq as a plain foreground process in ``host``'s netns: no config file, no hosts file,
    no upstream of its own, no pid file, listening on ``listen``:``port`` (``args`` add its
    records, cache, query log). Returns once it listens on the first address over UDP."""
    proc = host.popen(
        "dnsmasq",
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-resolv",
        "--no-hosts",
        "--no-poll",
        "--pid-file=",
        "--user=root",
        f"--log-facility={log}",
        "--bind-interfaces",
        *(f"--listen-address={a}" for a in listen),
        f"--port={port}",
        *args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if f"{listen[0]}:{port} " in host.run("ss", "-Hlnu", check=False).stdout:
            return proc
        time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"dnsmasq did not start on {listen[0]}:{port}")


def _ns_of(where: Host | str) -> str:
    return where if isinstance(where, str) else where.ns


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def socket_in(
    where: Host | str,
    family: socket.AddressFamily = socket.AF_INET,
    kind: socket.SocketKind = socket.SOCK_STREAM,
    proto: int = 0,
) -> socket.socket:
    """A new socket that lives in ``where``'s netns (made there; usable from any thread)."""
    with in_netns(_ns_of(where)):
        return socket.socket(family, kind, proto)


def listen_in(where: Host | str, port: int, host: str = "::", backlog: int = 128) -> socket.socket:
    """A blocking listener bound inside ``where``'s netns (``::`` = dual-stack)."""
    with in_netns(_ns_of(where)):
        return dual_stack_listener(port, host, backlog)


def connect_from(
    where: Host | str, ip: str, port: int, timeout: float = 5.0, mark: int | None = None
) -> socket.socket:
    """A blocking TCP socket made in ``where``'s netns and connected to ``ip:port``.

    Only creation happens inside the netns; connect runs on this thread back in its own
    namespace (the socket keeps its namespace). ``mark`` sets SO_MARK first (e.g. 0x539 to
    look like ztunnel's own traffic).
    """
    sock = socket_in(where, _family(ip))
    try:
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.settimeout(timeout)
        sock.connect((ip, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def open_connection_from(
    where: Host | str, ip: str, port: int, timeout: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio streams over a TCP connection from ``where``'s netns to ``ip:port``."""
    sock = socket_in(where, _family(ip))
    try:
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (ip, port)), timeout)
        return await asyncio.open_connection(sock=sock, limit=CHUNK)
    except BaseException:
        sock.close()
        raise


def recv_line(sock: socket.socket, timeout: float = 5.0, limit: int = 4096) -> str:
    """Read one ``\\n``-terminated line byte by byte (nothing past it is consumed)."""
    sock.settimeout(timeout)
    buf = bytearray()
    while not buf.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            raise EOFError(f"EOF after {bytes(buf)!r}")
        buf += b
        if len(buf) > limit:
            raise ValueError("line too long")
    return buf[:-1].decode()


def recv_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Read until EOF."""
    sock.settimeout(timeout)
    chunks: list[bytes] = []
    while data := sock.recv(CHUNK):
        chunks.append(data)
    return b"".join(chunks)


def recv_digest(sock: socket.socket, timeout: float = 10.0) -> Digest:
    """Read until EOF, hashing as it goes (for large transfers)."""
    sock.settimeout(timeout)
    h = Hasher()
    while data := sock.recv(CHUNK):
        h.update(data)
    return h.digest()


def send_payload(sock: socket.socket, n: int, seed: int = 0) -> Digest:
    """Send ``payload(n, seed)``; return its digest."""
    h = Hasher()
    for c in payload_chunks(n, seed):
        sock.sendall(c)
        h.update(c)
    return h.digest()


def echo_roundtrip(where: Host | str, ip: str, port: int, data: bytes = b"hello\n") -> bytes:
    """Connect, send ``data``, half-close, return everything the echo server sent back."""
    with connect_from(where, ip, port) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return recv_all(s)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ping(where: Host | str, ip: str, timeout: float = 2.0, count: int = 1) -> bool:
    """ICMP echo from ``where``'s netns to ``ip`` (raw socket, needs root; no ping binary).

    True once ``count`` replies arrive from ``ip`` within ``timeout`` seconds in total.
    """
    v6 = ":" in ip
    family = socket.AF_INET6 if v6 else socket.AF_INET
    proto = socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP
    req_type, rep_type = (128, 129) if v6 else (8, 0)
    ident = (os.getpid() ^ id(object())) & 0xFFFF
    want = canonical_ip(ip)
    deadline = time.monotonic() + timeout
    with socket_in(where, family, socket.SOCK_RAW, proto) as sock:
        for seq in range(1, count + 1):
            body = struct.pack("!HH", ident, seq) + b"ztunnel-testbed"
            header = struct.pack("!BBH", req_type, 0, 0)
            if not v6:  # the kernel fills the ICMPv6 checksum itself
                header = struct.pack("!BBH", req_type, 0, _checksum(header + body))
            sock.sendto(header + body, (ip, 0))
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                ready, _, _ = select.select([sock], [], [], remaining)
                if not ready:
                    return False
                data, addr = sock.recvfrom(2048)
                if not v6:
                    data = data[(data[0] & 0x0F) * 4 :]  # strip the IPv4 header
                if len(data) < 8 or canonical_ip(addr[0]) != want:
                    continue
                typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[:8])
                if typ == rep_type and rid == ident and rseq == seq:
                    break
    return True


if __name__ == "__main__":
    sys.exit(main())
