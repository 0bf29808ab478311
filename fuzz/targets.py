"""Fuzz targets: every parser a peer can reach, each a ``fn(data: bytes) -> None`` that raises
only for a bug. A target names the errors its parser may raise for bad input (the documented
outcome for a hostile peer); anything else, or a broken invariant, is a crash.

The peers: an HBONE client or server (HTTP/2 frames and HPACK, the TLS ClientHello peek),
the istio-cni node agent (ZDS records), istiod (xDS Address and Authorization resources), a
scraper or local user (the admin/stats/readiness HTTP parser), and a local config file.

Run with atheris (``fuzz/run.py``, ``make fuzz``) or over the corpora in the unit tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from ztunnel.admin.http import HttpError, RequestParser
from ztunnel.hbone import h2conn as h2
from ztunnel.hbone.clienthello import NotClientHello, parse_client_hello
from ztunnel.inpod.protocol import ZdsProtocolError, ZdsSession, decode_request
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
        slow = h2.Decoder(max_header_list_size=1 << 20).decode(data, raw=True)
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


def local_config(data: bytes) -> None:
    with contextlib.suppress(LocalConfigError):
        load_local_config(data.decode("utf-8", "replace"), "<fuzz>")


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
}
