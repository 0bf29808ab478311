"""Fuzz targets: every parser a peer can reach, each a ``fn(data: bytes) -> None`` that raises
only for a bug. A target names the errors its parser may raise for bad input (the documented
outcome for a hostile peer); anything else, or a broken invariant, is a crash.

The peers: an HBONE client or server (HTTP/2 frames and HPACK, the TLS ClientHello peek),
the istio-cni node agent (ZDS records), istiod (xDS Address and Authorization resources), a
scraper or local user (the admin/stats/readiness HTTP parser), a SOCKS5 client in the pod (the
handshake, and the DNS answer its hostname gets), and a local config file.

Run with atheris (``fuzz/run.py``, ``make fuzz``) or over the corpora in the unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import Callable

from hpack import Decoder

from ztunnel.admin.http import HttpError, RequestParser
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.clienthello import NotClientHello, parse_client_hello
from ztunnel.inpod.protocol import ZdsProtocolError, ZdsSession, decode_request
from ztunnel.proxy.socks5_proto import Handshake, Reply, Request, SocksError, first_address
from ztunnel.state.localconfig import LocalConfigError, load_local_config
from ztunnel.xds.convert import ConversionError, decode_address, decode_authorization

_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame


def _chunks(data: bytes) -> list[bytes]:
    """The input split where its first byte says (a peer's bytes arrive in any pieces)."""
    if not data:
        return []
    step = (data[0] % 61) + 1
    body = data[1:]
    return [body[i : i + step] for i in range(0, len(body), step)] or [b""]


def _drive(conn: h2.H2Connection, pieces: list[bytes], server: bool) -> None:
    for piece in pieces:
        try:
            events = conn.receive_data(piece)
        except h2.RemoteProtocolError as e:
            assert conn.closed
            assert isinstance(e.events[-1], h2.ConnectionTerminated)
            assert conn.data_to_send_bytes() != b""  # the GOAWAY
            return
        for ev in events:
            if isinstance(ev, h2.DataReceived):
                conn.acknowledge_received_data(ev.stream_id, ev.flow_controlled_length)
            elif server and isinstance(ev, h2.RequestReceived):
                # A later event of the same batch may have reset the stream: StreamClosedError
                # is the documented outcome of that race (the transport suppresses it too).
                with contextlib.suppress(h2.StreamClosedError):
                    if ev.stream_id % 4 == 1:
                        conn.send_response(ev.stream_id, 200)
                        conn.send_data(ev.stream_id, b"reply")
                    else:
                        conn.send_response(ev.stream_id, 400, end_stream=True)
                conn.release_stream(ev.stream_id)
        conn.data_to_send()
    assert conn.open_streams >= 0


def h2_server(data: bytes) -> None:
    """The HBONE server (inbound 15008) fed what a client sends after the preface."""
    conn = h2.H2Connection(client=False, hold_streams=True)
    conn.data_to_send()
    _drive(conn, [h2.PREFACE + _SETTINGS, *_chunks(data)], server=True)


def h2_client(data: bytes) -> None:
    """The HBONE client (outbound) fed what a server answers to one CONNECT."""
    conn = h2.H2Connection(client=True)
    conn.open_stream("10.0.0.1:8080", [("baggage", "k8s.namespace.name=default")])
    conn.data_to_send()
    _drive(conn, [_SETTINGS, *_chunks(data)], server=False)


def hpack_block(data: bytes) -> None:
    """Differential: where the literal fast path decodes a block, the hpack library must agree."""
    fast = h2._decode_literal_block(data, 65_536)
    if fast is None:
        return
    try:
        slow = Decoder(max_header_list_size=1 << 20).decode(data, raw=True)
    except Exception:
        raise AssertionError("the fast path decoded a block the hpack library refuses") from None
    assert [(bytes(n), bytes(v)) for n, v in slow] == fast


def client_hello(data: bytes) -> None:
    try:
        hello = parse_client_hello(data)
    except NotClientHello:
        return
    if hello is not None and hello.alpn is not None:
        assert all(hello.alpn)


def zds(data: bytes) -> None:
    """ZDS records from the node agent: decoded one by one through a session (the first byte
    of each record says whether an fd came with it)."""
    session = ZdsSession()
    pos = 0
    while pos < len(data):
        n = data[pos] % 64
        flag = data[pos]
        record = data[pos + 1 : pos + 1 + n]
        pos += 1 + n
        fds = [os.open(os.devnull, os.O_RDONLY)] if flag & 0x80 else []
        try:
            msg = decode_request(record, fds)
        except ZdsProtocolError:
            continue  # (decode_request closed the fd)
        fd = getattr(msg, "netns_fd", None)
        if fd is not None:
            os.close(fd)
        try:
            session.handle(msg)
        except ZdsProtocolError:
            return


def xds_address(data: bytes) -> None:
    with contextlib.suppress(ConversionError):
        decode_address(data)


def xds_authorization(data: bytes) -> None:
    with contextlib.suppress(ConversionError):
        decode_authorization(data)


def admin_http(data: bytes) -> None:
    parser = RequestParser()
    for piece in _chunks(data):
        parser.feed(piece)
        try:
            while parser.next_request() is not None:
                pass
        except HttpError as e:
            assert 400 <= e.status < 600
            return
    parser.feed_eof()
    try:
        while parser.next_request() is not None:
            pass
    except HttpError:
        pass


def socks5(data: bytes) -> None:
    """The SOCKS5 handshake fed as its I/O loop feeds it (exactly the bytes it asks for): it
    ends in a request, having read no more than the protocol allows, or in a protocol error
    (7) or, for a hostname, not before its lookup. The same bytes as the DNS response to a
    hostname lookup: an address, or host unreachable (4)."""
    hs = Handshake()
    pos = 0
    with contextlib.suppress(SocksError):
        while pos + hs.need <= len(data):
            n = hs.need
            out = hs.feed(data[pos : pos + n])
            pos += n
            if isinstance(out, Request):
                assert pos <= 2 + 255 + 2 + 2 + 1 + 255 + 2, pos
                assert isinstance(out.host, str) or out.target().port == out.port
                break
            assert out is None or out == b"\x05\x00"
    try:
        first_address(data)
    except SocksError as e:
        assert e.reply is Reply.HOST_UNREACHABLE


def local_config(data: bytes) -> None:
    with contextlib.suppress(LocalConfigError):
        load_local_config(data.decode("utf-8", "replace"), "<fuzz>")


# --- the TLS-to-h2 driver (hbone/transport.py) ----------------------------------------------

_DRIVER: dict[str, object] = {}


def _driver_setup() -> tuple[asyncio.AbstractEventLoop, ssl.SSLContext, ssl.SSLContext]:
    if not _DRIVER:
        from ztunnel.core.identity import Identity
        from ztunnel.identity.localca import LocalCA
        from ztunnel.identity.tls import client_context, server_context

        ca = LocalCA.ephemeral()
        _DRIVER["contexts"] = (
            client_context(ca.issue(Identity("cluster.local", "default", "client"))),
            server_context(ca.issue(Identity("cluster.local", "default", "server"))),
        )
        loop = asyncio.new_event_loop()
        errors: list[object] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        _DRIVER["loop"] = loop
        _DRIVER["errors"] = errors
    contexts, driver_loop = _DRIVER["contexts"], _DRIVER["loop"]
    assert isinstance(contexts, tuple) and isinstance(driver_loop, asyncio.AbstractEventLoop)
    cctx, sctx = contexts
    return driver_loop, cctx, sctx


def _memory_handshake(
    cctx: ssl.SSLContext, sctx: ssl.SSLContext
) -> tuple[ssl.SSLObject, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO, ssl.MemoryBIO]:
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = cctx.wrap_bio(c_in, c_out, server_side=False, server_hostname=None)
    server = sctx.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, (obj, out, peer_in) in enumerate(((client, c_out, s_in), (server, s_out, c_in))):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            if out.pending:
                peer_in.write(out.read())
        if all(done):
            break
    assert all(done), "in-memory handshake did not complete"
    return client, server, c_out, s_in, s_out


def hbone_server(data: bytes) -> None:
    """The server-side TLS + HTTP/2 driver (HboneConnection) on a socketpair, fed what a
    client sends over TLS; requests answered 200 (bridged to a socketpair) or 400. No callback
    may fail (the loop's exception handler counts as a crash) and no stream may be left."""
    from ztunnel.hbone.transport import HboneConnection

    loop, cctx, sctx = _driver_setup()
    errors: list[object] = _DRIVER["errors"]  # type: ignore[assignment]
    client, server, c_out, s_in, s_out = _memory_handshake(cctx, sctx)

    async def run() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        apps: list[socket.socket] = []
        tasks: list[asyncio.Task[object]] = []

        def on_request(conn: HboneConnection, ev: h2.RequestReceived) -> None:
            if ev.stream_id % 4 == 1:
                conn.respond(ev.stream_id, 200, [], end_stream=False)
                up, app = socket.socketpair()
                up.setblocking(False)
                apps.append(app)
                tasks.append(asyncio.ensure_future(conn.bridge(ev.stream_id, up)))
            else:
                conn.respond(ev.stream_id, 400, [], end_stream=True)
                conn.charge()
            conn.release_stream(ev.stream_id)

        conn = HboneConnection(
            b,
            server,
            s_in,
            s_out,
            h2.H2Connection(False, hold_streams=True),
            on_request=on_request,
            keepalive=False,
        )
        try:
            for piece in [h2.PREFACE + _SETTINGS, *_chunks(data)]:
                client.write(piece)
                with contextlib.suppress(OSError):
                    a.send(c_out.read())
                await asyncio.sleep(0)
            for _ in range(3):
                await asyncio.sleep(0)
        finally:
            conn.close()
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            a.close()
            for app in apps:
                app.close()
        assert conn.closed.done()

    loop.run_until_complete(run())
    if errors:
        raise AssertionError(f"unhandled error in a loop callback: {errors[0]}")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "h2_server": h2_server,
    "h2_client": h2_client,
    "hpack_block": hpack_block,
    "client_hello": client_hello,
    "zds": zds,
    "xds_address": xds_address,
    "xds_authorization": xds_authorization,
    "admin_http": admin_http,
    "local_config": local_config,
    "hbone_server": hbone_server,
    "socks5": socks5,
}
