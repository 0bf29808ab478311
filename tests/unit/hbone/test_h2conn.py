"""Tests for ztunnel.hbone.h2conn: in-memory client/server pairs, h2-library interop, bad input."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ztunnel.hbone import h2conn as h2mod
from ztunnel.hbone.h2conn import (
    CONTINUATION,
    DATA,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ConnectionTerminated,
    DataReceived,
    ErrorCode,
    Event,
    GoAwayReceived,
    H2Connection,
    LocalProtocolError,
    PingAcked,
    PingReceived,
    RemoteProtocolError,
    RemoteSettingsChanged,
    RequestReceived,
    ResponseReceived,
    SettingCode,
    SettingsAcked,
    StreamClosedError,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
    connect_request_error,
    is_clean_reset,
)

MiB = 1024 * 1024
E = TypeVar("E", bound=Event)
Frame = tuple[int, int, int, bytes]


# ---------------------------------------------------------------------------------------------
# helpers


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, sid) + payload


def parse_frames(data: bytes) -> list[Frame]:
    out: list[Frame] = []
    pos = len(PREFACE) if data.startswith(PREFACE) else 0
    while pos < len(data):
        lt, flags, sid = struct.unpack_from(">IBI", data, pos)
        length = lt >> 8
        out.append((lt & 0xFF, flags, sid & 0x7FFFFFFF, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(data)
    return out


def settings_payload(**values: int) -> bytes:
    return b"".join(struct.pack(">HI", SettingCode[k.upper()], v) for k, v in values.items())


def of(events: Iterable[Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


def pump(a: H2Connection, b: H2Connection) -> list[Event]:
    wire = a.data_to_send_bytes()
    return b.receive_data(wire) if wire else []


def connected_pair(**server_kw: Any) -> tuple[H2Connection, H2Connection]:
    c = H2Connection(client=True)
    s = H2Connection(client=False, **server_kw)
    pump(c, s)
    pump(s, c)
    pump(c, s)
    return c, s


def open_tunnel(c: H2Connection, s: H2Connection, authority: str = "10.0.0.2:8080") -> int:
    sid = c.open_stream(authority, [("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-00")])
    (req,) = of(pump(c, s), RequestReceived)
    assert req.stream_id == sid
    s.send_response(sid, 200)
    assert of(pump(s, c), ResponseReceived)[0].status == 200
    return sid


def raw_server(**kw: Any) -> tuple[H2Connection, hpack.Encoder]:
    """A server that has seen a valid preface + SETTINGS from a hand-written client."""
    s = H2Connection(client=False, **kw)
    s.data_to_send()
    s.receive_data(PREFACE + frame(SETTINGS, 0, 0))
    s.data_to_send()
    return s, hpack.Encoder()


def connect_block(enc: hpack.Encoder, extra: list[tuple[str, str]] | None = None) -> bytes:
    block: bytes = enc.encode(
        [(":method", "CONNECT"), (":authority", "1.2.3.4:80"), *(extra or [])]
    )
    return block


def expect_conn_error(conn: H2Connection, data: bytes, code: ErrorCode) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        conn.receive_data(data)
    exc = info.value
    assert exc.error_code == code, exc
    assert isinstance(exc.events[-1], ConnectionTerminated)
    assert exc.events[-1].error_code == code
    goaways = [f for f in parse_frames(conn.data_to_send_bytes()) if f[0] == GOAWAY]
    assert goaways and struct.unpack(">II", goaways[-1][3][:8])[1] == code
    assert conn.closed
    assert conn.receive_data(b"more input is ignored") == []
    return exc


def rst_codes(conn: H2Connection) -> dict[int, int]:
    return {
        f[2]: struct.unpack(">I", f[3])[0]
        for f in parse_frames(conn.data_to_send_bytes())
        if f[0] == RST_STREAM
    }


# ---------------------------------------------------------------------------------------------
# handshake and settings


def test_handshake_sends_ztunnel_settings() -> None:
    c = H2Connection(client=True)
    wire = c.data_to_send_bytes()
    assert wire.startswith(PREFACE)
    frames = parse_frames(wire)
    assert [f[0] for f in frames] == [SETTINGS, WINDOW_UPDATE]
    sent = dict(struct.iter_unpack(">HI", frames[0][3]))
    assert sent == {
        SettingCode.ENABLE_PUSH: 0,
        SettingCode.INITIAL_WINDOW_SIZE: 4 * MiB,
        SettingCode.MAX_FRAME_SIZE: MiB,
        SettingCode.MAX_HEADER_LIST_SIZE: 16 * 1024,
    }
    assert struct.unpack(">I", frames[1][3])[0] == 16 * MiB - 65535

    s = H2Connection(client=False)
    frames = parse_frames(s.data_to_send_bytes())
    sent = dict(struct.iter_unpack(">HI", frames[0][3]))
    assert sent[SettingCode.MAX_CONCURRENT_STREAMS] == 200
    assert sent[SettingCode.MAX_HEADER_LIST_SIZE] == 64 * 1024
    assert SettingCode.ENABLE_PUSH not in sent


def test_settings_exchange_and_ack() -> None:
    c = H2Connection(client=True)
    s = H2Connection(client=False)
    ev = pump(c, s)
    changed = of(ev, RemoteSettingsChanged)[0]
    assert changed.initial_window_size == 4 * MiB and changed.max_frame_size == MiB
    assert of(ev, WindowUpdated) == [WindowUpdated(0, 16 * MiB - 65535)]
    ev = pump(s, c)
    assert of(ev, RemoteSettingsChanged)[0].max_concurrent_streams == 200
    assert of(ev, SettingsAcked)
    assert of(pump(c, s), SettingsAcked)
    assert c.connection_send_window == 16 * MiB
    assert c.available_streams == 200
    assert s.available_streams == 0
    assert c.remote_settings.max_frame_size == MiB
    assert c.remote_max_concurrent_streams == c.remote_settings.max_concurrent_streams == 200
    assert c.local_settings.enable_push == 0


# ---------------------------------------------------------------------------------------------
# CONNECT, data, half-close


def test_connect_request_and_response_headers() -> None:
    c, s = connected_pair()
    sid = c.open_stream(
        "[fd00::1]:15008",
        [("baggage", "k8s.namespace.name=default"), ("forwarded", 'for="10.0.0.1:4000"')],
    )
    assert sid == 1
    wire = c.data_to_send_bytes()
    (hdr,) = parse_frames(wire)
    assert hdr[0] == HEADERS and hdr[1] & FLAG_END_HEADERS and not hdr[1] & FLAG_END_STREAM
    (req,) = s.receive_data(wire)
    assert isinstance(req, RequestReceived)
    assert (req.method, req.authority, req.scheme, req.path) == (
        "CONNECT",
        "[fd00::1]:15008",
        None,
        None,
    )
    assert req.headers == [
        ("baggage", "k8s.namespace.name=default"),
        ("forwarded", 'for="10.0.0.1:4000"'),
    ]
    assert connect_request_error(req) is None
    s.send_response(sid, 200, [("baggage", "k8s.cluster.name=c1")])
    (resp,) = pump(s, c)
    assert resp == ResponseReceived(sid, 200, [("baggage", "k8s.cluster.name=c1")])
    assert c.open_streams == 1 and s.open_streams == 1


def test_error_response_is_headers_only_with_end_stream() -> None:
    c, s = connected_pair()
    sid = c.open_stream("10.0.0.9:80")
    pump(c, s)
    s.send_response(sid, 401, end_stream=True)
    ev = pump(s, c)
    assert ev == [ResponseReceived(sid, 401, []), StreamEnded(sid)]
    with pytest.raises(StreamClosedError):
        s.send_data(sid, b"x")
    c.reset_stream(sid, ErrorCode.CANCEL)
    assert c.open_streams == 0


def test_bidirectional_data_and_half_close() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    assert c.send_data(sid, b"ping from client") == 16
    ev = pump(c, s)
    assert [bytes(e.data) for e in of(ev, DataReceived)] == [b"ping from client"]
    # client half-closes (TCP FIN); the server can still send
    c.end_stream(sid)
    assert pump(c, s) == [StreamEnded(sid)]
    with pytest.raises(StreamClosedError):
        c.send_data(sid, b"after FIN")
    assert s.send_data(sid, b"pong") == 4
    s.end_stream(sid)
    ev = pump(s, c)
    assert [type(e) for e in ev] == [DataReceived, StreamEnded]
    assert bytes(of(ev, DataReceived)[0].data) == b"pong"
    assert c.open_streams == 0 and s.open_streams == 0
    # acknowledging data of a closed stream is harmless
    c.acknowledge_received_data(sid, 4)


def test_send_data_with_end_stream_in_one_frame() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.send_data(sid, b"last bytes", end_stream=True)
    frames = parse_frames(c.data_to_send_bytes())
    assert frames == [(DATA, FLAG_END_STREAM, sid, b"last bytes")]


def test_send_data_does_not_copy_payloads() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    payload = os.urandom(200_000)
    assert c.send_data(sid, payload) == len(payload)
    out = c.data_to_send()
    bodies = out[1::2]
    assert all(isinstance(b, memoryview) and b.obj is payload for b in bodies)
    assert [len(b) for b in bodies] == [65536, 65536, 65536, 200_000 - 3 * 65536]
    assert c.max_outbound_frame_size == 64 * 1024
    small = b"x" * 100
    c.send_data(sid, small)
    assert c.data_to_send()[1] is small
    # frames never exceed the peer's MAX_FRAME_SIZE
    c2 = H2Connection(client=True, send_frame_size=1 << 20)
    s2 = H2Connection(client=False, max_frame_size=32768)
    pump(c2, s2)
    pump(s2, c2)
    sid2 = c2.open_stream("1.1.1.1:1")
    pump(c2, s2)
    s2.send_response(sid2, 200)
    pump(s2, c2)
    c2.send_data(sid2, payload)
    frames = parse_frames(c2.data_to_send_bytes())
    assert max(len(f[3]) for f in frames) == 32768


def test_frame_data_in_place() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    frame = c.max_outbound_frame_size
    payload = os.urandom(2 * frame + 1000)
    buf = bytearray(len(payload) + 3 * 9)
    for k in range(3):  # the payload slots: a 9-byte gap before each frame's worth
        chunk = payload[k * frame : (k + 1) * frame]
        pos = 9 + k * (frame + 9)
        buf[pos : pos + len(chunk)] = chunk
    queued = c.data_to_send()  # nothing is queued by frame_data_in_place
    size = c.frame_data_in_place(sid, buf, len(payload))
    assert size == len(buf) and c.data_to_send() == [] and not queued
    assert c.stream_send_window(sid) == 4 * MiB - len(payload)
    assert c.connection_send_window == 16 * MiB - len(payload)
    assert [(f[0], f[1], f[2], len(f[3])) for f in parse_frames(bytes(buf))] == [
        (DATA, 0, sid, frame),
        (DATA, 0, sid, frame),
        (DATA, 0, sid, 1000),
    ]
    ev = s.receive_data(bytes(buf[:size]))
    assert b"".join(bytes(e.data) for e in of(ev, DataReceived)) == payload
    # one frame, smaller than a slot
    assert c.frame_data_in_place(sid, buf, 5) == 14
    assert parse_frames(bytes(buf[:14]))[0][:3] == (DATA, 0, sid)
    # never beyond the windows, never on a closed or unknown stream
    with pytest.raises(LocalProtocolError):
        c.frame_data_in_place(sid, bytearray(8 * MiB), c.stream_send_window(sid) + 1)
    with pytest.raises(LocalProtocolError):
        c.frame_data_in_place(sid, buf, 0)
    c.end_stream(sid)
    with pytest.raises(StreamClosedError):
        c.frame_data_in_place(sid, buf, 5)
    with pytest.raises(StreamClosedError):
        c.frame_data_in_place(99, buf, 5)


def test_received_data_is_a_view_of_the_input() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.send_data(sid, b"a" * 1000)
    wire = c.data_to_send_bytes()
    (ev,) = s.receive_data(wire)
    assert isinstance(ev, DataReceived)
    assert isinstance(ev.data, memoryview) and ev.data.obj is wire
    # a DATA frame split over several inputs streams out as several events, no reassembly
    c.send_data(sid, b"b" * 1000)
    wire = c.data_to_send_bytes()
    got = []
    for i in range(0, len(wire), 300):
        got += of(s.receive_data(wire[i : i + 300]), DataReceived)
    assert b"".join(bytes(e.data) for e in got) == b"b" * 1000
    assert len(got) == 4
    assert sum(e.flow_controlled_length for e in got) == 1000


def test_small_data_frames_of_a_stream_are_joined_within_one_input() -> None:
    # A peer sending tiny DATA frames (1-byte frames at line rate are legal) costs one event per
    # stream and input, not one event, slice and iovec per frame; frames are still counted.
    s, enc = raw_server()
    for sid in (1, 3):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.send_response(sid, 200)
    before = s.frames_received
    wire = b"".join(frame(DATA, 0, 1 + 2 * (i % 2), b"%d" % (i % 10)) for i in range(1000))
    ev = s.receive_data(wire + frame(DATA, FLAG_END_STREAM, 3, b"!"))
    assert s.frames_received - before == 1001
    assert [(type(e), getattr(e, "stream_id", None)) for e in ev] == [
        (DataReceived, 1),
        (DataReceived, 3),
        (StreamEnded, 3),
    ]
    one, three = of(ev, DataReceived)
    assert bytes(one.data) == b"02468" * 100 and one.flow_controlled_length == 500
    assert bytes(three.data) == b"13579" * 100 + b"!" and three.flow_controlled_length == 501
    s.acknowledge_received_data(1, 500)  # (the whole joined event is one acknowledgement)
    # A lone small frame is still a slice of the input (no copy).
    wire = frame(DATA, 0, 1, b"x")
    (ev1,) = s.receive_data(wire)
    assert isinstance(ev1, DataReceived) and isinstance(ev1.data, memoryview)
    assert ev1.data.obj is wire


def test_joined_data_keeps_the_order_of_a_stream() -> None:
    # A large (not joined) payload between small ones: the later small ones start a new event,
    # so the stream's bytes come out in order; padded frames join like the others.
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    big = b"B" * (h2mod.COALESCE_MAX + 1)
    padded = frame(DATA, FLAG_PADDED, 1, b"\x03p" + b"\0" * 3)
    wire = frame(DATA, 0, 1, b"a") + padded + frame(DATA, 0, 1, big) + frame(DATA, 0, 1, b"c")
    ev = of(s.receive_data(wire + padded + frame(DATA, 0, 1, b"d")), DataReceived)
    assert [bytes(e.data) for e in ev] == [b"ap", big, b"cpd"]
    assert [e.flow_controlled_length for e in ev] == [2, len(big), 3]


def test_byte_by_byte_feed() -> None:
    c, s = connected_pair()
    sid = c.open_stream("10.0.0.2:80", [("x-big", "v" * 3000)])
    c.send_data(sid, b"hello world", end_stream=True)
    events: list[Event] = []
    for b in c.data_to_send_bytes():
        events += s.receive_data(bytes([b]))
    assert of(events, RequestReceived)[0].headers == [("x-big", "v" * 3000)]
    assert b"".join(bytes(e.data) for e in of(events, DataReceived)) == b"hello world"
    assert isinstance(events[-1], StreamEnded)


# ---------------------------------------------------------------------------------------------
# flow control


def test_flow_control_blocks_and_resumes() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    payload = os.urandom(6 * MiB)
    sent = c.send_data(sid, payload)
    assert sent == 4 * MiB  # the stream window
    assert c.stream_send_window(sid) == 0
    assert c.send_data(sid, memoryview(payload)[sent:]) == 0
    received = bytearray()
    for e in of(pump(c, s), DataReceived):
        received += e.data
    assert len(received) == 4 * MiB
    assert s.data_to_send() == []  # nothing released yet: no WINDOW_UPDATE
    s.acknowledge_received_data(sid, 4 * MiB)
    updates = of(pump(s, c), WindowUpdated)
    assert updates == [WindowUpdated(sid, 4 * MiB)]
    rest = memoryview(payload)[sent:]
    assert c.send_data(sid, rest, end_stream=True) == len(rest)
    ev = pump(c, s)
    for e in of(ev, DataReceived):
        received += e.data
    assert isinstance(ev[-1], StreamEnded)
    assert bytes(received) == payload


def test_connection_window_limits_all_streams() -> None:
    c, s = connected_pair()
    sids = [open_tunnel(c, s) for _ in range(5)]
    chunk = bytes(4 * MiB)
    sent = [c.send_data(sid, chunk) for sid in sids]
    assert sent == [4 * MiB] * 4 + [0]  # 16 MiB connection window
    assert c.connection_send_window == 0
    ev = pump(c, s)
    # release 8 MiB: the connection WINDOW_UPDATE goes out once half the window is back
    s.acknowledge_received_data(sids[0], 4 * MiB)
    assert s.data_to_send_bytes().count(bytes([WINDOW_UPDATE])) >= 1
    s.acknowledge_received_data(sids[1], 4 * MiB)
    ev = pump(s, c)
    assert WindowUpdated(0, 8 * MiB) in ev
    assert c.send_data(sids[4], chunk) == 4 * MiB


def test_window_updates_are_batched() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    total = 0
    n_updates = 0
    for _ in range(400):
        c.send_data(sid, bytes(16384))
        for e in of(pump(c, s), DataReceived):
            s.acknowledge_received_data(sid, e.flow_controlled_length)
            total += e.flow_controlled_length
        wire = s.data_to_send_bytes()
        n_updates += sum(1 for f in parse_frames(wire) if f[0] == WINDOW_UPDATE)
        c.receive_data(wire)
    assert total == 400 * 16384
    # 6.25 MiB through a 4 MiB stream window: stream updates every 2 MiB, no connection one yet
    assert n_updates == 3


def test_settings_initial_window_change_adjusts_open_streams() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    assert c.stream_send_window(sid) == 4 * MiB
    s2_settings = frame(SETTINGS, 0, 0, settings_payload(initial_window_size=5 * MiB))
    ev = c.receive_data(s2_settings)
    assert WindowUpdated(sid, MiB) in ev
    assert c.stream_send_window(sid) == 5 * MiB
    c.receive_data(frame(SETTINGS, 0, 0, settings_payload(initial_window_size=1000)))
    assert c.stream_send_window(sid) == 1000


def test_ack_more_than_received_is_a_local_error() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.send_data(sid, b"abc")
    pump(c, s)
    with pytest.raises(LocalProtocolError):
        s.acknowledge_received_data(sid, 4)


# ---------------------------------------------------------------------------------------------
# resets, goaway, ping, stream limits


def test_reset_stream_both_ways() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.reset_stream(sid, ErrorCode.CANCEL)
    (ev,) = pump(c, s)
    assert ev == StreamReset(sid, ErrorCode.CANCEL, True)
    assert is_clean_reset(ev.error_code)
    c.reset_stream(sid)  # idempotent
    sid2 = open_tunnel(c, s)
    s.reset_stream(sid2, ErrorCode.CONNECT_ERROR)
    (ev,) = pump(s, c)
    assert ev == StreamReset(sid2, ErrorCode.CONNECT_ERROR, True)
    assert not is_clean_reset(ev.error_code)
    assert is_clean_reset(ErrorCode.NO_ERROR)
    with pytest.raises(StreamClosedError):
        c.send_data(sid2, b"x")


def test_data_in_flight_after_local_reset_is_ignored_and_credit_returned() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    s.send_data(sid, bytes(3 * MiB))
    in_flight = s.data_to_send_bytes()
    c.reset_stream(sid)
    assert c.receive_data(in_flight) == []
    # delivered-but-unacked bytes of closed streams go back to the connection window
    updates: list[Event] = []
    for _ in range(2):
        sid2 = open_tunnel(c, s)
        s.send_data(sid2, bytes(3 * MiB))
        ev = pump(s, c)
        assert sum(e.flow_controlled_length for e in of(ev, DataReceived)) == 3 * MiB
        c.reset_stream(sid2)  # never acknowledged: released on close
        updates += of(pump(c, s), WindowUpdated)
    # 9 MiB released in all (the in-flight DATA too), in one batched update past 8 MiB
    assert updates == [WindowUpdated(0, 9 * MiB)]


def test_goaway_stops_new_streams_and_refuses_later_ones() -> None:
    c, s = connected_pair()
    sid1 = open_tunnel(c, s)
    sid3 = c.open_stream("10.0.0.3:80")  # not yet seen by the server
    s.goaway()
    ev = pump(s, c)
    assert ev[0] == GoAwayReceived(sid1, ErrorCode.NO_ERROR, b"")
    assert ev[1] == StreamReset(sid3, ErrorCode.REFUSED_STREAM, True)
    assert c.goaway_received and c.available_streams == 0
    with pytest.raises(LocalProtocolError):
        c.open_stream("10.0.0.4:80")
    # the late stream reaches the server after its GOAWAY: refused, not surfaced
    ev = pump(c, s)
    assert not of(ev, RequestReceived)
    assert rst_codes(s) == {sid3: ErrorCode.REFUSED_STREAM}
    # the existing stream still works
    c.send_data(sid1, b"still here", end_stream=True)
    ev = pump(c, s)
    assert bytes(of(ev, DataReceived)[0].data) == b"still here"


def test_close_sends_final_goaway() -> None:
    c, s = connected_pair()
    open_tunnel(c, s)
    c.close(ErrorCode.NO_ERROR)
    assert c.closed
    (ev,) = pump(c, s)
    assert ev == GoAwayReceived(0, ErrorCode.NO_ERROR, b"")
    with pytest.raises(LocalProtocolError):
        c.ping()
    assert c.receive_data(frame(PING, 0, 0, b"12345678")) == []


def test_ping_is_acked_automatically() -> None:
    c, s = connected_pair()
    opaque = c.ping()
    ev = pump(c, s)
    assert ev == [PingReceived(opaque)]
    ev = pump(s, c)
    assert ev == [PingAcked(opaque)]
    assert c.ping(b"abcdefgh") == b"abcdefgh"


def test_server_refuses_streams_beyond_max_concurrent() -> None:
    c = H2Connection(client=True)
    s = H2Connection(client=False, max_concurrent_streams=2)
    # the client opens 3 streams before it has seen the server's limit
    sids = [c.open_stream(f"10.0.0.{i}:80") for i in range(3)]
    ev = pump(c, s)
    assert [e.stream_id for e in of(ev, RequestReceived)] == sids[:2]
    ev = pump(s, c)
    assert StreamReset(sids[2], ErrorCode.REFUSED_STREAM, True) in ev
    assert c.available_streams == 0
    s.send_response(sids[0], 503, end_stream=True)
    pump(s, c)
    c.reset_stream(sids[0])
    pump(c, s)
    assert c.available_streams == 1
    sid = c.open_stream("10.0.0.9:80")
    assert of(pump(c, s), RequestReceived)[0].stream_id == sid


def test_client_respects_peer_stream_limit() -> None:
    c, _ = connected_pair(max_concurrent_streams=3)
    for _ in range(3):
        c.open_stream("10.0.0.1:80")
    assert c.available_streams == 0
    with pytest.raises(LocalProtocolError) as info:
        c.open_stream("10.0.0.1:80")
    assert info.value.error_code == ErrorCode.REFUSED_STREAM


def test_large_header_block_uses_continuation() -> None:
    c = H2Connection(client=True)
    s = H2Connection(client=False)
    # before the server's SETTINGS arrive the client must use 16 KiB frames
    sid = c.open_stream("10.0.0.1:80", [("x-large", os.urandom(15000).hex())])
    wire = c.data_to_send_bytes()
    kinds = [f[0] for f in parse_frames(wire)]
    assert kinds[2:] == [HEADERS, CONTINUATION]
    (req,) = of(s.receive_data(wire), RequestReceived)
    assert req.stream_id == sid and len(req.headers[0][1]) == 30000


def test_trailers_and_informational_responses() -> None:
    c, s = connected_pair()
    sid = c.open_stream("10.0.0.1:80")
    pump(c, s)
    enc = hpack.Encoder()  # our server never indexes: the client's HPACK table is empty
    block = enc.encode([(":status", "100")])
    final = enc.encode([(":status", "200")])
    trailers = enc.encode([("grpc-status", "0")])
    ev = c.receive_data(
        frame(HEADERS, FLAG_END_HEADERS, sid, block)
        + frame(HEADERS, FLAG_END_HEADERS, sid, final)
        + frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sid, trailers)
    )
    assert ev == [
        ResponseReceived(sid, 200, []),
        TrailersReceived(sid, [("grpc-status", "0")]),
        StreamEnded(sid),
    ]


def test_padded_priority_and_unknown_frames_are_handled() -> None:
    s, enc = raw_server()
    block = connect_block(enc)
    headers = frame(
        HEADERS,
        FLAG_END_HEADERS | FLAG_PADDED | FLAG_PRIORITY,
        1,
        bytes([3]) + struct.pack(">IB", 0, 15) + block + b"\0\0\0",
    )
    data = frame(DATA, FLAG_PADDED, 1, bytes([4]) + b"payload" + b"\0" * 4)
    noise = frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 1)) + frame(0xFA, 0xFF, 7, b"unknown")
    ev = s.receive_data(headers + noise + data)
    assert [type(e) for e in ev] == [RequestReceived, DataReceived]
    assert ev[1] == DataReceived(1, b"payload", 7)
    # padding was released by the connection itself; only the 7 payload bytes are owed
    s.acknowledge_received_data(1, 7)


# ---------------------------------------------------------------------------------------------
# local misuse


def test_local_misuse_raises_local_errors() -> None:
    c, s = connected_pair()
    with pytest.raises(LocalProtocolError):
        s.open_stream("1.2.3.4:5")
    with pytest.raises(LocalProtocolError):
        c.send_response(1, 200)
    with pytest.raises(LocalProtocolError):
        c.open_stream("1.2.3.4:5", [("Upper-Case", "x")])
    with pytest.raises(LocalProtocolError):
        c.open_stream("1.2.3.4:5", [("connection", "close")])
    with pytest.raises(LocalProtocolError):
        c.open_stream("bad\r\nauthority")
    with pytest.raises(StreamClosedError):
        c.send_data(99, b"x")
    with pytest.raises(LocalProtocolError):
        c.reset_stream(101)  # idle
    sid = c.open_stream("1.2.3.4:5")
    pump(c, s)
    with pytest.raises(LocalProtocolError):
        s.send_data(sid, b"before response")
    s.send_response(sid, 200)
    with pytest.raises(LocalProtocolError):
        s.send_response(sid, 200)
    with pytest.raises(ValueError):
        c.ping(b"short")
    with pytest.raises(ValueError):
        H2Connection(client=True, max_frame_size=1000)


# ---------------------------------------------------------------------------------------------
# bad input from the peer


def test_bad_preface() -> None:
    s = H2Connection(client=False)
    s.data_to_send()
    expect_conn_error(s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ErrorCode.PROTOCOL_ERROR)


def test_first_frame_must_be_settings() -> None:
    s = H2Connection(client=False)
    expect_conn_error(s, PREFACE + frame(PING, 0, 0, b"12345678"), ErrorCode.PROTOCOL_ERROR)
    c = H2Connection(client=True)
    expect_conn_error(c, frame(SETTINGS, FLAG_ACK, 0), ErrorCode.PROTOCOL_ERROR)


def test_random_garbage_after_preface() -> None:
    s = H2Connection(client=False)
    expect_conn_error(s, PREFACE + b"\xff" * 64, ErrorCode.FRAME_SIZE_ERROR)


def test_oversized_frame() -> None:
    s, _ = raw_server()
    header = struct.pack(">IBI", (MiB + 1) << 8 | DATA, 0, 1)
    exc = expect_conn_error(s, header, ErrorCode.FRAME_SIZE_ERROR)
    assert "MAX_FRAME_SIZE" in exc.message


def test_bad_hpack_is_compression_error() -> None:
    s, _ = raw_server()
    bad = frame(HEADERS, FLAG_END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff\xff\xff")
    expect_conn_error(s, bad, ErrorCode.COMPRESSION_ERROR)


def test_data_on_stream_zero() -> None:
    s, _ = raw_server()
    expect_conn_error(s, frame(DATA, 0, 0, b"abc"), ErrorCode.PROTOCOL_ERROR)


def test_data_on_idle_stream() -> None:
    s, _ = raw_server()
    expect_conn_error(s, frame(DATA, 0, 5, b"abc"), ErrorCode.PROTOCOL_ERROR)


def test_window_update_zero_and_overflow() -> None:
    s, _ = raw_server()
    expect_conn_error(s, frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR)
    s, _ = raw_server()
    big = struct.pack(">I", 2**31 - 1)
    expect_conn_error(s, frame(WINDOW_UPDATE, 0, 0, big), ErrorCode.FLOW_CONTROL_ERROR)
    # on a stream these are stream errors
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    s.send_response(1, 200)
    s.data_to_send()
    ev = s.receive_data(frame(WINDOW_UPDATE, 0, 1, b"\0\0\0\0"))
    assert ev == [StreamReset(1, ErrorCode.PROTOCOL_ERROR, False)]
    assert rst_codes(s) == {1: ErrorCode.PROTOCOL_ERROR}
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc)))
    ev = s.receive_data(frame(WINDOW_UPDATE, 0, 3, big))
    assert ev == [StreamReset(3, ErrorCode.FLOW_CONTROL_ERROR, False)]


def test_connect_with_path_is_reported_for_a_400() -> None:
    s, enc = raw_server()
    block = enc.encode(
        [(":method", "CONNECT"), (":scheme", "https"), (":authority", "1.2.3.4:80"), (":path", "/")]
    )
    (req,) = s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, block))
    assert isinstance(req, RequestReceived)
    assert req.path == "/" and req.scheme == "https"
    assert connect_request_error(req) is not None
    s.send_response(1, 400, end_stream=True)
    frames = parse_frames(s.data_to_send_bytes())
    assert frames[0][0] == HEADERS and frames[0][1] & FLAG_END_STREAM
    get = enc.encode([(":method", "GET"), (":scheme", "https"), (":path", "/")])
    (req,) = s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, get))
    assert isinstance(req, RequestReceived)
    assert "not CONNECT" in (connect_request_error(req) or "")
    bare = enc.encode([(":method", "CONNECT")])
    (req,) = s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 5, bare))
    assert isinstance(req, RequestReceived)
    assert "authority" in (connect_request_error(req) or "")


@pytest.mark.parametrize(
    "fields",
    [
        [(":method", "CONNECT"), (":authority", "a:1"), ("Upper", "x")],
        [(":method", "CONNECT"), (":authority", "a:1"), ("connection", "keep-alive")],
        [(":method", "CONNECT"), (":authority", "a:1"), ("te", "gzip")],
        [(":method", "CONNECT"), ("x", "1"), (":authority", "a:1")],
        [(":method", "CONNECT"), (":authority", "a:1"), (":authority", "b:1")],
        [(":method", "CONNECT"), (":authority", "a:1"), (":status", "200")],
        [(":method", "CONNECT"), (":authority", "a:1"), ("x", "bad\nvalue")],
        [(":method", "CONNECT"), (":authority", "a:1"), ("x", " padded")],
        [(":authority", "a:1")],
    ],
)
def test_malformed_requests_are_reset(fields: list[tuple[str, str]]) -> None:
    s, enc = raw_server()
    ev = s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, enc.encode(fields)))
    assert ev == []  # never surfaced
    assert rst_codes(s) == {1: ErrorCode.PROTOCOL_ERROR}
    # the connection is still fine
    (req,) = s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc)))
    assert isinstance(req, RequestReceived)


def test_malformed_response_is_reset() -> None:
    c, s = connected_pair()
    sid = c.open_stream("10.0.0.1:80")
    pump(c, s)
    block = hpack.Encoder().encode([("no-status", "x")])
    ev = c.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, block))
    assert ev == [StreamReset(sid, ErrorCode.PROTOCOL_ERROR, False)]


def test_data_before_response_is_a_stream_error() -> None:
    c, s = connected_pair()
    sid = c.open_stream("10.0.0.1:80")
    pump(c, s)
    ev = c.receive_data(frame(DATA, 0, sid, b"early"))
    assert ev == [StreamReset(sid, ErrorCode.PROTOCOL_ERROR, False)]


def test_data_on_closed_streams() -> None:
    s, enc = raw_server()
    # stream 1 ended both ways: more DATA is a connection error STREAM_CLOSED
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, connect_block(enc)))
    s.send_response(1, 200, end_stream=True)
    expect_conn_error(s, frame(DATA, 0, 1, b"late"), ErrorCode.STREAM_CLOSED)
    # after END_STREAM from the peer (half-closed remote): stream error STREAM_CLOSED
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, connect_block(enc)))
    ev = s.receive_data(frame(DATA, 0, 1, b"late"))
    assert ev == [StreamReset(1, ErrorCode.STREAM_CLOSED, False)]
    # after the peer's RST_STREAM: stream error STREAM_CLOSED
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc)))
    ev = s.receive_data(frame(RST_STREAM, 0, 3, struct.pack(">I", ErrorCode.CANCEL)))
    assert ev == [StreamReset(3, ErrorCode.CANCEL, True)]
    s.data_to_send()
    assert s.receive_data(frame(DATA, 0, 3, b"late")) == []
    assert rst_codes(s) == {3: ErrorCode.STREAM_CLOSED}


def test_stream_id_rules() -> None:
    s, enc = raw_server()
    # a client may not open even-numbered streams
    expect_conn_error(
        s, frame(HEADERS, FLAG_END_HEADERS, 2, connect_block(enc)), ErrorCode.PROTOCOL_ERROR
    )
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 5, connect_block(enc)))
    # new stream ids must increase
    expect_conn_error(
        s, frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc)), ErrorCode.PROTOCOL_ERROR
    )
    # a server may not open streams at all
    c, _ = connected_pair()
    block = hpack.Encoder().encode([(":status", "200")])
    expect_conn_error(c, frame(HEADERS, FLAG_END_HEADERS, 2, block), ErrorCode.PROTOCOL_ERROR)


def test_continuation_rules() -> None:
    s, enc = raw_server()
    block = connect_block(enc)
    start = frame(HEADERS, 0, 1, block[:3])
    expect_conn_error(s, start + frame(PING, 0, 0, b"12345678"), ErrorCode.PROTOCOL_ERROR)
    s, enc = raw_server()
    expect_conn_error(s, frame(CONTINUATION, FLAG_END_HEADERS, 1, b""), ErrorCode.PROTOCOL_ERROR)
    s, enc = raw_server()
    block = connect_block(enc)
    ev = s.receive_data(
        frame(HEADERS, 0, 1, block[:2])
        + frame(CONTINUATION, 0, 1, block[2:4])
        + frame(CONTINUATION, FLAG_END_HEADERS, 1, block[4:])
    )
    assert of(ev, RequestReceived)[0].authority == "1.2.3.4:80"


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (settings_payload(enable_push=2), ErrorCode.PROTOCOL_ERROR),
        (settings_payload(max_frame_size=100), ErrorCode.PROTOCOL_ERROR),
        (settings_payload(max_frame_size=2**24), ErrorCode.PROTOCOL_ERROR),
        (settings_payload(initial_window_size=2**31), ErrorCode.FLOW_CONTROL_ERROR),
        (b"\0\x01\0\0", ErrorCode.FRAME_SIZE_ERROR),
    ],
)
def test_bad_settings(payload: bytes, code: ErrorCode) -> None:
    s, _ = raw_server()
    expect_conn_error(s, frame(SETTINGS, 0, 0, payload), code)


def test_client_rejects_enable_push_from_server() -> None:
    c = H2Connection(client=True)
    expect_conn_error(
        c, frame(SETTINGS, 0, 0, settings_payload(enable_push=1)), ErrorCode.PROTOCOL_ERROR
    )


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (frame(PING, 0, 0, b"1234"), ErrorCode.FRAME_SIZE_ERROR),
        (frame(PING, 0, 1, b"12345678"), ErrorCode.PROTOCOL_ERROR),
        (frame(SETTINGS, FLAG_ACK, 0, b"\0" * 6), ErrorCode.FRAME_SIZE_ERROR),
        (frame(SETTINGS, 0, 1), ErrorCode.PROTOCOL_ERROR),
        (frame(RST_STREAM, 0, 1, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR),  # idle
        (frame(RST_STREAM, 0, 0, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR),
        (frame(RST_STREAM, 0, 1, b"\0\0"), ErrorCode.FRAME_SIZE_ERROR),
        (frame(WINDOW_UPDATE, 0, 0, b"\0"), ErrorCode.FRAME_SIZE_ERROR),
        (frame(WINDOW_UPDATE, 0, 9, b"\0\0\0\x01"), ErrorCode.PROTOCOL_ERROR),  # idle
        (frame(GOAWAY, 0, 0, b"\0"), ErrorCode.FRAME_SIZE_ERROR),
        (frame(GOAWAY, 0, 1, b"\0" * 8), ErrorCode.PROTOCOL_ERROR),
        (frame(PUSH_PROMISE, FLAG_END_HEADERS, 1, b"\0\0\0\x02"), ErrorCode.PROTOCOL_ERROR),
        (frame(PRIORITY, 0, 0, b"\0" * 5), ErrorCode.PROTOCOL_ERROR),
        (frame(PRIORITY, 0, 3, b"\0\0\0\x03\0"), ErrorCode.PROTOCOL_ERROR),  # self-dependency
        (frame(HEADERS, 0, 0, b""), ErrorCode.PROTOCOL_ERROR),
        (frame(HEADERS, FLAG_PADDED | FLAG_END_HEADERS, 1, b"\x05ab"), ErrorCode.PROTOCOL_ERROR),
        (frame(DATA, FLAG_PADDED, 1, b"\x09abc"), ErrorCode.PROTOCOL_ERROR),
    ],
)
def test_bad_frames(data: bytes, code: ErrorCode) -> None:
    s, _ = raw_server()
    expect_conn_error(s, data, code)


def test_flow_control_violations() -> None:
    s, enc = raw_server(initial_window_size=100, connection_window_size=65535)
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    ev = s.receive_data(frame(DATA, 0, 1, b"x" * 101))
    assert ev == [StreamReset(1, ErrorCode.FLOW_CONTROL_ERROR, False)]
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc)))
    s.receive_data(frame(DATA, 0, 3, b"x" * 100))  # exactly the window: fine
    expect_conn_error(s, frame(DATA, 0, 3, b"x" * 65535), ErrorCode.FLOW_CONTROL_ERROR)


def test_remote_error_keeps_earlier_events() -> None:
    s, enc = raw_server()
    good = frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)) + frame(DATA, 0, 1, b"ok")
    exc = expect_conn_error(s, good + frame(DATA, 0, 0, b"bad"), ErrorCode.PROTOCOL_ERROR)
    assert [type(e) for e in exc.events] == [RequestReceived, DataReceived, ConnectionTerminated]


def test_app_reset_in_the_middle_of_a_data_frame() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    s.send_data(sid, bytes(60_000))
    wire = s.data_to_send_bytes()
    ev = c.receive_data(wire[:20_000])
    assert sum(e.flow_controlled_length for e in of(ev, DataReceived)) == 20_000 - 9
    c.reset_stream(sid)
    assert c.receive_data(wire[20_000:]) == []  # the rest of the frame is dropped


def test_empty_end_stream_frame_split_across_inputs() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.end_stream(sid)
    wire = c.data_to_send_bytes()
    assert s.receive_data(wire[:4]) == []
    assert s.receive_data(wire[4:]) == [StreamEnded(sid)]


def test_padded_data_edge_cases() -> None:
    s, enc = raw_server(initial_window_size=65_536)
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    s.send_response(1, 200)
    # padding alone is released by the connection: a stream WINDOW_UPDATE once half is used
    ev = s.receive_data(frame(DATA, FLAG_PADDED, 1, bytes([255]) + b"\0" * 255) * 130)
    assert ev == []
    frames = parse_frames(s.data_to_send_bytes())
    assert (WINDOW_UPDATE, 0, 1, struct.pack(">I", 256 * 128)) in frames
    ev = s.receive_data(frame(DATA, FLAG_PADDED | FLAG_END_STREAM, 1, b"\x01xy\0"))
    assert ev == [DataReceived(1, b"xy", 2), StreamEnded(1)]
    # padded DATA for a stream we reset is dropped
    s.reset_stream(1)
    assert s.receive_data(frame(DATA, FLAG_PADDED, 1, b"\x01xy\0")) == []


def test_settings_window_overflow_is_a_connection_error() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.receive_data(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", 2**31 - 1 - 4 * MiB)))
    expect_conn_error(
        c,
        frame(SETTINGS, 0, 0, settings_payload(initial_window_size=4 * MiB + 1)),
        ErrorCode.FLOW_CONTROL_ERROR,
    )


def test_late_frames_on_closed_streams_are_tolerated() -> None:
    c, s = connected_pair()
    sid = open_tunnel(c, s)
    c.reset_stream(sid)
    pump(c, s)
    # WINDOW_UPDATE / RST_STREAM / PRIORITY / trailers racing our reset are ignored
    late = (
        frame(WINDOW_UPDATE, 0, sid, b"\0\0\0\x10")
        + frame(RST_STREAM, 0, sid, b"\0\0\0\x08")
        + frame(PRIORITY, 0, sid, b"\0\0\0\0\x10")
        + frame(
            HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sid, hpack.Encoder().encode([("a", "b")])
        )
    )
    assert c.receive_data(late) == []


@pytest.mark.parametrize(
    ("build", "code"),
    [
        # PRIORITY problems on an open stream are stream errors
        (lambda enc: frame(PRIORITY, 0, 1, b"\0\0\0\x01\x10"), ErrorCode.PROTOCOL_ERROR),
        (lambda enc: frame(PRIORITY, 0, 1, b"\0\0\0"), ErrorCode.FRAME_SIZE_ERROR),
        # HEADERS depending on its own stream
        (
            lambda enc: frame(
                HEADERS,
                FLAG_END_HEADERS | FLAG_PRIORITY | FLAG_END_STREAM,
                1,
                struct.pack(">IB", 1, 0) + enc.encode([("t", "1")]),
            ),
            ErrorCode.PROTOCOL_ERROR,
        ),
        # trailers must end the stream
        (
            lambda enc: frame(HEADERS, FLAG_END_HEADERS, 1, enc.encode([("t", "1")])),
            ErrorCode.PROTOCOL_ERROR,
        ),
        # trailers must not carry pseudo-headers
        (
            lambda enc: frame(
                HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, enc.encode([(":path", "/")])
            ),
            ErrorCode.PROTOCOL_ERROR,
        ),
        # trailers over the advertised header list size
        (
            lambda enc: frame(
                HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, enc.encode([("t", "x" * 70000)])
            ),
            ErrorCode.PROTOCOL_ERROR,
        ),
    ],
)
def test_stream_errors_on_open_stream(
    build: Callable[[hpack.Encoder], bytes], code: ErrorCode
) -> None:
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    s.data_to_send()
    ev = s.receive_data(build(enc))
    assert ev == [StreamReset(1, code, False)]
    assert rst_codes(s) == {1: code}
    # still usable
    assert of(
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, connect_block(enc))), RequestReceived
    )


def test_headers_after_peer_end_stream_is_stream_closed() -> None:
    s, enc = raw_server()
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, connect_block(enc)))
    ev = s.receive_data(
        frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, enc.encode([("t", "1")]))
    )
    assert ev == [StreamReset(1, ErrorCode.STREAM_CLOSED, False)]


def test_new_stream_self_dependency_and_oversized_request() -> None:
    s, enc = raw_server()
    block = struct.pack(">IB", 1, 0) + connect_block(enc)
    assert s.receive_data(frame(HEADERS, FLAG_END_HEADERS | FLAG_PRIORITY, 1, block)) == []
    big = connect_block(enc, [("x", "y" * 70_000)])
    assert s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 3, big)) == []
    assert rst_codes(s) == {1: ErrorCode.PROTOCOL_ERROR, 3: ErrorCode.PROTOCOL_ERROR}


def test_response_status_rules() -> None:
    c, s = connected_pair()
    enc = hpack.Encoder()
    sids = [c.open_stream("10.0.0.1:80") for _ in range(3)]
    pump(c, s)
    ev = c.receive_data(
        frame(HEADERS, FLAG_END_HEADERS, sids[0], enc.encode([(":status", "101")]))
        + frame(
            HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sids[1], enc.encode([(":status", "103")])
        )
        + frame(HEADERS, FLAG_END_HEADERS, sids[2], enc.encode([(":status", "2000")]))
    )
    assert ev == [StreamReset(sid, ErrorCode.PROTOCOL_ERROR, False) for sid in sids]


def test_header_block_size_limit() -> None:
    s, enc = raw_server()
    start = frame(HEADERS, 0, 1, connect_block(enc))
    filler = frame(CONTINUATION, 0, 1, b"\0" * 60_000)
    expect_conn_error(s, start + filler * 3, ErrorCode.ENHANCE_YOUR_CALM)
    s, enc = raw_server()
    expect_conn_error(s, frame(HEADERS, FLAG_PADDED, 1, b""), ErrorCode.FRAME_SIZE_ERROR)


def test_closed_stream_memory_is_bounded() -> None:
    c, s = connected_pair(
        max_concurrent_streams=5000,
        limits=h2mod.FloodLimits(early_resets=5000, control_frames=5000),
    )
    for _ in range(1100):
        sid = c.open_stream("10.0.0.1:80")
        c.reset_stream(sid)
    ev = pump(c, s)
    assert len(of(ev, StreamReset)) == 1100
    assert len(s._recent_closed) == 1024
    assert s.open_streams == 0


# ---------------------------------------------------------------------------------------------
# HPACK: literal blocks out, a fast path for them in, the hpack library for the rest

_field_name = st.one_of(
    st.sampled_from([b":authority", b":method", b":status", b"baggage", b"forwarded", b"age"]),
    st.binary(min_size=1, max_size=200).map(lambda b: bytes(c % 26 + 97 for c in b)),
)
_field = st.tuples(_field_name, st.binary(max_size=300))


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(_field, max_size=8), updates=st.lists(st.integers(0, 4096), max_size=2))
def test_encoded_blocks_decode_the_same_with_hpack_and_the_fast_path(
    fields: list[tuple[bytes, bytes]], updates: list[int]
) -> None:
    block = h2mod._encode_block(fields, updates)
    assert hpack.Decoder().decode(block, raw=True) == fields
    fast = h2mod._decode_literal_block(block, 1 << 20)
    if updates:
        assert fast is None  # a table size update changes decoder state: hpack's job
    else:
        assert fast == fields


def test_encoded_block_form() -> None:
    # :status 200 is one byte (static index 8); other fields are literals without indexing
    assert h2mod._encode_block([(b":status", b"200")], []) == b"\x88"
    assert h2mod._encode_block([(b":method", b"CONNECT")], []) == b"\x02\x07CONNECT"
    assert h2mod._encode_block([(b"x-a", b"1")], [0]) == b"\x20\x00\x03x-a\x011"
    long = b"v" * 300
    assert h2mod._encode_block([(b"k", long)], []) == b"\x00\x01k\x7f\xad\x01" + long


@pytest.mark.parametrize(
    "build",
    [
        lambda: hpack.Encoder().encode([(":method", "CONNECT"), ("x", "y")]),  # Huffman, indexing
        lambda: hpack.Encoder().encode([("x", "y")], huffman=False),  # incremental indexing
        lambda: b"\x20" + h2mod._encode_block([(b"x", b"y")], []),  # table size update
        lambda: b"\xbe",  # dynamic table index 62
        lambda: b"\x80",  # index 0
        lambda: b"\x00\x05ab",  # truncated
        lambda: b"\x00\x01k\x7f\xff\xff\xff\xff\x7f",  # absurd length
        lambda: b"\x0f\x30\x01v",  # name index 63 (multi-byte): the dynamic table
    ],
)
def test_fast_path_declines_what_it_does_not_handle(build: Callable[[], bytes]) -> None:
    assert h2mod._decode_literal_block(build(), 1 << 20) is None


def test_fast_path_static_name_with_a_multibyte_index() -> None:
    assert h2mod._decode_literal_block(b"\x0f\x2e\x01v", 1 << 20) == [(b"www-authenticate", b"v")]
    assert h2mod._decode_literal_block(b"\x0f\x06\x01v", 1 << 20) == [(b"age", b"v")]


def test_fast_path_leaves_oversized_lists_to_hpack() -> None:
    block = h2mod._encode_block([(b"k", b"v" * 100)], [])
    assert h2mod._decode_literal_block(block, 132) is None  # 32 + 1 + 100, as hpack counts
    assert h2mod._decode_literal_block(block, 133) == [(b"k", b"v" * 100)]


def test_peer_blocks_with_huffman_and_dynamic_table_still_decode() -> None:
    s, enc = raw_server()
    for sid in (1, 3, 5):  # the second and later blocks reference hpack's dynamic table
        (req,) = s.receive_data(
            frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc, [("baggage", "a=b")]))
        )
        assert isinstance(req, RequestReceived)
        assert req.authority == "1.2.3.4:80" and req.headers == [("baggage", "a=b")]


def test_header_table_size_change_is_signalled_once() -> None:
    c, s = connected_pair()
    s.receive_data(frame(SETTINGS, 0, 0, settings_payload(header_table_size=0)))
    s.data_to_send()
    sids = [c.open_stream("10.0.0.1:80") for _ in range(2)]
    pump(c, s)
    s.send_response(sids[0], 200)
    s.send_response(sids[1], 200)
    blocks = [f[3] for f in parse_frames(s.data_to_send_bytes()) if f[0] == HEADERS]
    assert blocks == [b"\x20\x88", b"\x88"]
    # an h2-library client would fail the connection without the update; hpack accepts it
    dec = hpack.Decoder()
    dec.max_allowed_table_size = 0
    assert dec.decode(blocks[0], raw=True) == [(b":status", b"200")]
    # back to the default: signalled again
    s.receive_data(frame(SETTINGS, 0, 0, settings_payload(header_table_size=65536)))
    s.data_to_send()
    sid = c.open_stream("10.0.0.1:80")
    pump(c, s)
    s.send_response(sid, 200)
    (block,) = [f[3] for f in parse_frames(s.data_to_send_bytes()) if f[0] == HEADERS]
    assert block == b"\x3f\xe1\x1f\x88"  # size update to 4096, then :status 200


# ---------------------------------------------------------------------------------------------
# fuzzing: arbitrary input only ever yields events or RemoteProtocolError


def _feed_all(conn: H2Connection, chunks: list[bytes]) -> None:
    try:
        for chunk in chunks:
            for ev in conn.receive_data(chunk):
                if isinstance(ev, DataReceived):
                    conn.acknowledge_received_data(ev.stream_id, ev.flow_controlled_length)
                elif isinstance(ev, RequestReceived) and ev.stream_id in (1, 3):
                    conn.send_response(ev.stream_id, 200)
            conn.data_to_send()
    except RemoteProtocolError as exc:
        assert exc.error_code != ErrorCode.INTERNAL_ERROR, exc.__cause__
        assert isinstance(exc.events[-1], ConnectionTerminated)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(client=st.booleans(), preface=st.booleans(), chunks=st.lists(st.binary(max_size=200)))
def test_fuzz_arbitrary_bytes(client: bool, preface: bool, chunks: list[bytes]) -> None:
    conn = H2Connection(client=client)
    if preface:
        chunks = [(b"" if client else PREFACE) + frame(SETTINGS, 0, 0), *chunks]
    _feed_all(conn, chunks)


_frame_strategy = st.builds(
    lambda t, f, sid, payload: frame(t, f, sid, payload),
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
    st.one_of(
        st.binary(max_size=40),
        st.builds(
            lambda block, pad: bytes([pad]) + block + b"\0" * pad,
            st.sampled_from(
                [
                    hpack.Encoder().encode([(":method", "CONNECT"), (":authority", "a:1")]),
                    hpack.Encoder().encode([(":status", "200")]),
                ]
            ),
            st.integers(0, 5),
        ),
        st.sampled_from(
            [
                struct.pack(">I", 1),
                struct.pack(">I", 2**31 - 1),
                settings_payload(initial_window_size=1),
                settings_payload(max_frame_size=16384, header_table_size=0),
            ]
        ),
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    client=st.booleans(),
    frames=st.lists(_frame_strategy, max_size=12),
    cut=st.integers(1, 64),
)
def test_fuzz_frame_sequences(client: bool, frames: list[bytes], cut: int) -> None:
    conn = H2Connection(client=client)
    if client:
        conn.open_stream("1.2.3.4:80")
        conn.open_stream("1.2.3.4:81")
    wire = (b"" if client else PREFACE) + frame(SETTINGS, 0, 0) + b"".join(frames)
    _feed_all(conn, [wire[i : i + cut] for i in range(0, len(wire), cut)])


# ---------------------------------------------------------------------------------------------
# interop with the independent h2 library


def _chunks(data: bytes, rng: random.Random) -> list[bytes]:
    """Cut a byte string at random points, to exercise partial-frame handling."""
    out = []
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 7, 9, 100, 4096, 16384, 70000, 1 << 20])
        out.append(data[pos : pos + n])
        pos += n
    return out


class _Transfer:
    """Bytes one side still has to send on a stream, and what the other side got."""

    def __init__(self, size: int, seed: int) -> None:
        self.payload = random.Random(seed).randbytes(size)
        self.offset = 0
        self.ended = False
        self.received = bytearray()
        self.peer_ended = False

    def check(self) -> None:
        assert self.peer_ended
        assert hashlib.sha256(self.received).digest() == hashlib.sha256(self.payload).digest()


def _ours_send(conn: H2Connection, sid: int, t: _Transfer) -> None:
    if t.ended:
        return
    rest = memoryview(t.payload)[t.offset :]
    t.offset += conn.send_data(sid, rest, end_stream=True)
    if t.offset == len(t.payload):
        t.ended = True


def _h2_send(conn: h2.connection.H2Connection, sid: int, t: _Transfer, pad: int = 0) -> None:
    while not t.ended:
        room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size) - pad
        if room <= 0:
            return
        piece = t.payload[t.offset : t.offset + min(room, 50_000)]
        conn.send_data(sid, piece, pad_length=pad or None)
        t.offset += len(piece)
        if t.offset == len(t.payload):
            conn.end_stream(sid)
            t.ended = True


def _run(step: Callable[[], bool], limit: int = 10_000) -> None:
    """Call ``step`` until it reports that everything was transferred."""
    for _ in range(limit):
        if step():
            return
    raise AssertionError("transfer did not finish")


def test_interop_our_client_with_h2_server() -> None:
    rng = random.Random(1)
    ours = H2Connection(client=True)
    theirs = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
    )
    theirs.initiate_connection()
    sids = [ours.open_stream(f"10.0.0.{i}:8080", [("baggage", f"n={i}")]) for i in range(3)]
    up = {sid: _Transfer(3 * MiB + sid, seed=sid) for sid in sids}  # client -> server
    down = {sid: _Transfer(2 * MiB + 7 * sid, seed=100 + sid) for sid in sids}
    responded: set[int] = set()
    got_response: set[int] = set()

    def step() -> bool:
        for sid in got_response:
            _ours_send(ours, sid, up[sid])
        for chunk in _chunks(ours.data_to_send_bytes(), rng):
            for ev in theirs.receive_data(chunk):
                if isinstance(ev, h2.events.RequestReceived):
                    hdrs: dict[Any, Any] = dict(ev.headers)  # str: header_encoding is set
                    assert hdrs[":method"] == "CONNECT"
                    assert ":path" not in hdrs and ":scheme" not in hdrs
                    assert hdrs["baggage"].startswith("n=")
                    theirs.send_headers(ev.stream_id, [(":status", "200"), ("baggage", "x=y")])
                    responded.add(ev.stream_id)
                elif isinstance(ev, h2.events.DataReceived):
                    up[ev.stream_id].received += ev.data
                    theirs.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    up[ev.stream_id].peer_ended = True
        for sid in responded:
            _h2_send(theirs, sid, down[sid], pad=8 if sid == 3 else 0)
        for chunk in _chunks(theirs.data_to_send(), rng):
            for oe in ours.receive_data(chunk):
                if isinstance(oe, ResponseReceived):
                    assert oe.status == 200 and oe.headers == [("baggage", "x=y")]
                    got_response.add(oe.stream_id)
                elif isinstance(oe, DataReceived):
                    down[oe.stream_id].received += oe.data
                    ours.acknowledge_received_data(oe.stream_id, oe.flow_controlled_length)
                elif isinstance(oe, StreamEnded):
                    down[oe.stream_id].peer_ended = True
                else:
                    assert not isinstance(oe, StreamReset), oe
        return all(t.peer_ended for t in (*up.values(), *down.values()))

    _run(step)
    for t in (*up.values(), *down.values()):
        t.check()
    assert ours.open_streams == 0


def test_interop_h2_client_with_our_server() -> None:
    rng = random.Random(2)
    ours = H2Connection(client=False)
    theirs = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    theirs.initiate_connection()
    theirs.increment_flow_control_window(8 * MiB)
    sids = [1, 3, 5]
    for sid in sids:
        theirs.send_headers(
            sid, [(":method", "CONNECT"), (":authority", f"10.1.1.{sid}:80"), ("x-id", str(sid))]
        )
    theirs.prioritize(3, weight=200)  # PRIORITY frames must be ignored
    up = {sid: _Transfer(3 * MiB - sid, seed=sid) for sid in sids}
    down = {sid: _Transfer(2 * MiB + sid, seed=50 + sid) for sid in sids}
    got_response: set[int] = set()
    responded: set[int] = set()
    pings: list[bytes] = []
    theirs.ping(b"hbone!!!")

    def step() -> bool:
        for sid in got_response:
            _h2_send(theirs, sid, up[sid], pad=3 if sid == 5 else 0)
        for chunk in _chunks(theirs.data_to_send(), rng):
            for oe in ours.receive_data(chunk):
                if isinstance(oe, RequestReceived):
                    assert connect_request_error(oe) is None
                    assert oe.headers == [("x-id", str(oe.stream_id))]
                    ours.send_response(oe.stream_id, 200)
                    responded.add(oe.stream_id)
                elif isinstance(oe, DataReceived):
                    up[oe.stream_id].received += oe.data
                    ours.acknowledge_received_data(oe.stream_id, oe.flow_controlled_length)
                elif isinstance(oe, StreamEnded):
                    up[oe.stream_id].peer_ended = True
                elif isinstance(oe, PingReceived):
                    pings.append(oe.data)
                else:
                    assert not isinstance(oe, StreamReset), oe
        for sid in responded:
            _ours_send(ours, sid, down[sid])
        for chunk in _chunks(ours.data_to_send_bytes(), rng):
            for ev in theirs.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    status: dict[Any, Any] = dict(ev.headers)
                    assert status[":status"] == "200"
                    got_response.add(ev.stream_id)
                elif isinstance(ev, h2.events.DataReceived):
                    down[ev.stream_id].received += ev.data
                    theirs.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    down[ev.stream_id].peer_ended = True
                else:
                    assert not isinstance(ev, h2.events.StreamReset), ev
        return all(t.peer_ended for t in (*up.values(), *down.values()))

    _run(step)
    for t in (*up.values(), *down.values()):
        t.check()
    assert pings == [b"hbone!!!"]
    assert ours.open_streams == 0
    # graceful close understood by h2
    ours.close()
    (ev,) = theirs.receive_data(ours.data_to_send_bytes())
    assert isinstance(ev, h2.events.ConnectionTerminated) and ev.error_code == 0


def test_interop_h2_reset_and_goaway() -> None:
    ours = H2Connection(client=True)
    theirs = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
    )
    theirs.initiate_connection()
    sid = ours.open_stream("10.0.0.1:80")
    theirs.receive_data(ours.data_to_send_bytes())
    ours.receive_data(theirs.data_to_send())
    theirs.reset_stream(sid, error_code=8)
    ev = ours.receive_data(theirs.data_to_send())
    assert StreamReset(sid, ErrorCode.CANCEL, True) in ev
    sid2 = ours.open_stream("10.0.0.1:81")
    theirs.receive_data(ours.data_to_send_bytes())
    ours.reset_stream(sid2, ErrorCode.CONNECT_ERROR)
    (rst,) = theirs.receive_data(ours.data_to_send_bytes())
    assert isinstance(rst, h2.events.StreamReset) and rst.error_code == ErrorCode.CONNECT_ERROR
    theirs.close_connection(error_code=0, last_stream_id=sid2)
    ev = ours.receive_data(theirs.data_to_send())
    assert ev == [GoAwayReceived(sid2, ErrorCode.NO_ERROR, b"")]
    assert ours.available_streams == 0


# ---------------------------------------------------------------------------------------------
# hostile peers: flood budgets (nghttp2 / Envoy defences), rapid reset, CONTINUATION flood,
# SETTINGS cost, streams held until their work ends (issue 13)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def flood_server(**limits: Any) -> tuple[H2Connection, hpack.Encoder, FakeClock]:
    clock = FakeClock()
    s, enc = raw_server(limits=h2mod.FloodLimits(**limits), clock=clock)
    return s, enc, clock


@pytest.mark.parametrize(
    ("name", "one"),
    [
        ("ping", frame(PING, 0, 0, b"12345678")),
        ("settings", frame(SETTINGS, 0, 0)),
        ("priority", frame(PRIORITY, 0, 1, b"\0\0\0\0\x10")),
        ("unknown", frame(0x42, 0, 0, b"x")),
        ("settings-ack", frame(SETTINGS, FLAG_ACK, 0)),
    ],
)
def test_control_frame_flood_ends_with_enhance_your_calm(name: str, one: bytes) -> None:
    s, _, clock = flood_server(control_frames=50)
    s.receive_data(one * 49)  # within the budget (the client's SETTINGS was the 50th)
    s.data_to_send()
    clock.now += 1.5  # a new window: the budget is back
    s.receive_data(one * 50)
    s.data_to_send()
    expect_conn_error(s, one, ErrorCode.ENHANCE_YOUR_CALM)


def test_ping_flood_replies_are_bounded_by_the_budget() -> None:
    # Attack 4: PINGs never read; the replies queued are at most the budget's worth.
    s, _, _ = flood_server(control_frames=100)
    with pytest.raises(RemoteProtocolError) as info:
        s.receive_data(frame(PING, 0, 0, b"12345678") * 100_000)
    assert info.value.error_code == ErrorCode.ENHANCE_YOUR_CALM
    acks = [f for f in parse_frames(s.data_to_send_bytes()) if f[0] == PING]
    assert len(acks) == 99  # (the client's SETTINGS took one)


def test_window_update_flood() -> None:
    s, _, _ = flood_server(window_updates=20)
    wu = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1))
    s.receive_data(wu * 20)
    expect_conn_error(s, wu, ErrorCode.ENHANCE_YOUR_CALM)


def test_empty_data_and_header_fragments_flood() -> None:
    # CVE-2019-9518: empty DATA without END_STREAM, and empty CONTINUATION frames.
    s, enc, _ = flood_server(empty_frames=10)
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    s.receive_data(frame(DATA, 0, 1) * 10)
    expect_conn_error(s, frame(DATA, 0, 1), ErrorCode.ENHANCE_YOUR_CALM)

    s, enc, _ = flood_server(empty_frames=10, max_continuations=1000)
    s.receive_data(frame(HEADERS, 0, 1, connect_block(enc)))
    s.receive_data(frame(CONTINUATION, 0, 1) * 10)
    expect_conn_error(s, frame(CONTINUATION, 0, 1), ErrorCode.ENHANCE_YOUR_CALM)


def test_empty_end_stream_data_is_not_a_flood() -> None:
    s, enc, _ = flood_server(empty_frames=1)
    for sid in range(1, 20, 2):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        ev = s.receive_data(frame(DATA, FLAG_END_STREAM, sid))
        assert of(ev, StreamEnded)


def test_continuation_flood_cve_2024_27316() -> None:
    # Attack 5: endless (empty or not) CONTINUATION frames are cut at max_continuations.
    s, enc, _ = flood_server(max_continuations=8)
    block = connect_block(enc)
    s.receive_data(frame(HEADERS, 0, 1, block[:1]))
    s.receive_data(frame(CONTINUATION, 0, 1, b"") * 8)
    expect_conn_error(s, frame(CONTINUATION, 0, 1, b""), ErrorCode.ENHANCE_YOUR_CALM)
    # ... and a block split over a few frames is fine.
    s, enc, _ = flood_server(max_continuations=8)
    block = connect_block(enc)
    cut = [len(block) * k // 9 for k in range(10)]
    chunks = [block[cut[k] : cut[k + 1]] for k in range(9)]
    parts = [frame(HEADERS, 0, 1, chunks[0])]
    parts += [frame(CONTINUATION, 0, 1, c) for c in chunks[1:-1]]
    parts.append(frame(CONTINUATION, FLAG_END_HEADERS, 1, chunks[-1]))
    assert len(parts) == 9
    assert of(s.receive_data(b"".join(parts)), RequestReceived)


def test_continuation_header_block_size_is_capped() -> None:
    s, enc, _ = flood_server(max_continuations=10_000)
    s.receive_data(frame(HEADERS, 0, 1, connect_block(enc)))
    with pytest.raises(RemoteProtocolError) as info:
        s.receive_data(frame(CONTINUATION, 0, 1, b"\0" * 16_384) * 20)
    assert info.value.error_code == ErrorCode.ENHANCE_YOUR_CALM


def test_rapid_reset_cve_2023_44487() -> None:
    s, enc, clock = flood_server(early_resets=20, control_frames=10_000)
    sid = 1
    for _ in range(20):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.receive_data(frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCode.CANCEL)))
        sid += 2
    clock.now += 2
    for _ in range(20):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.receive_data(frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCode.CANCEL)))
        sid += 2
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
    s.data_to_send()
    expect_conn_error(
        s, frame(RST_STREAM, 0, sid, struct.pack(">I", 8)), ErrorCode.ENHANCE_YOUR_CALM
    )


def test_resets_after_the_response_are_not_rapid_resets() -> None:
    s, enc, _ = flood_server(early_resets=2, control_frames=10_000)
    for sid in range(1, 200, 2):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.send_response(sid, 200)
        s.receive_data(frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCode.CANCEL)))
    assert not s.closed


def test_closed_streams_still_at_work_do_not_count_against_the_stream_limit() -> None:
    # RFC 9113 5.1.2: only open and half-closed streams count against MAX_CONCURRENT_STREAMS.
    # A stream closed on the wire (ended both ways, or reset) whose work goes on is held, but a
    # peer within the limit is never refused (Rust h2 ``Counts::transition_after`` frees the
    # slot when the stream closes, whatever its handles).
    s, enc = raw_server(max_concurrent_streams=3, hold_streams=True)
    for sid in (1, 3, 5):
        assert of(
            s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc))),
            RequestReceived,
        )
    s.data_to_send()
    # One more than the limit while three are open: refused (REFUSED_STREAM).
    assert not of(
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 7, connect_block(enc))), RequestReceived
    )
    assert rst_codes(s) == {7: ErrorCode.REFUSED_STREAM}
    s.receive_data(frame(RST_STREAM, 0, 1, struct.pack(">I", ErrorCode.CANCEL)))
    s.send_response(3, 200)
    s.send_data(3, b"", end_stream=True)
    s.receive_data(frame(DATA, FLAG_END_STREAM, 3))
    assert s.open_streams == 1 and s.held_streams == 2
    s.data_to_send()
    for sid in (9, 11):  # two slots are free on the wire: both are served
        assert of(
            s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc))),
            RequestReceived,
        )
    assert rst_codes(s) == {}
    s.release_stream(1)
    assert s.held_streams == 1
    s.release_stream(1)  # twice: ignored
    s.release_stream(12345)  # unknown: ignored
    assert s.held_streams == 1


def test_held_streams_have_a_budget_of_their_own() -> None:
    # Rapid reset against slow work: the streams reset on the wire are held while their work
    # goes on; a new stream arriving while the held budget is spent ends the connection
    # (ENHANCE_YOUR_CALM, as nghttp2 and Envoy answer abusive resets), so the work a
    # connection causes stays within max_concurrent_streams + held_streams.
    limits = h2mod.FloodLimits(held_streams=4, early_resets=1000, control_frames=10_000)
    s, enc = raw_server(limits=limits, hold_streams=True)
    for sid in (1, 3, 5, 7):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.receive_data(frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCode.CANCEL)))
    assert s.held_streams == 4 and not s.closed
    s.release_stream(1)  # work ended: room for one more
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 9, connect_block(enc)))
    s.receive_data(frame(RST_STREAM, 0, 9, struct.pack(">I", ErrorCode.CANCEL)))
    s.data_to_send()
    expect_conn_error(
        s, frame(HEADERS, FLAG_END_HEADERS, 11, connect_block(enc)), ErrorCode.ENHANCE_YOUR_CALM
    )


def test_without_hold_streams_a_reset_frees_the_slot() -> None:
    s, enc = raw_server(max_concurrent_streams=1)
    for sid in (1, 3, 5):
        assert of(
            s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc))),
            RequestReceived,
        )
        s.receive_data(frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCode.CANCEL)))


def test_early_data_stays_owed_until_released() -> None:
    # Attack 3: DATA then RST must not refund the connection window while the app still holds
    # the copies; acknowledging or releasing returns it.
    s, enc = raw_server(hold_streams=True, connection_window_size=1 * MiB)
    window0 = s._conn_recv_window
    s.receive_data(frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc)))
    s.receive_data(frame(DATA, 0, 1, b"x" * 100_000))
    s.receive_data(frame(RST_STREAM, 0, 1, struct.pack(">I", ErrorCode.CANCEL)))
    s.data_to_send()
    assert s._conn_recv_window + s._conn_recv_pending == window0 - 100_000
    s.acknowledge_received_data(1, 40_000)
    assert s._conn_recv_window + s._conn_recv_pending == window0 - 60_000
    s.release_stream(1)
    assert s._conn_recv_window + s._conn_recv_pending == window0
    s.acknowledge_received_data(1, 60_000)  # late: ignored
    assert s._conn_recv_window + s._conn_recv_pending == window0


def test_settings_with_many_entries_and_many_streams_is_one_pass() -> None:
    # Attack 1: repeated INITIAL_WINDOW_SIZE entries with many streams open: the streams are
    # touched once per frame, not once per entry, and a frame has at most 32 entries.
    s, enc = raw_server(max_concurrent_streams=500)
    for sid in range(1, 400, 2):
        s.receive_data(frame(HEADERS, FLAG_END_HEADERS, sid, connect_block(enc)))
        s.send_response(sid, 200)
    s.data_to_send()
    entries = b"".join(
        struct.pack(">HI", SettingCode.INITIAL_WINDOW_SIZE, 70_000 + i) for i in range(32)
    )
    ev = s.receive_data(frame(SETTINGS, 0, 0, entries))
    assert len(of(ev, WindowUpdated)) == 200  # one per stream
    assert {e.delta for e in of(ev, WindowUpdated)} == {70_031 - 65_535}
    assert s._streams[1].send_window == 70_031
    too_many = entries + struct.pack(">HI", SettingCode.INITIAL_WINDOW_SIZE, 1)
    expect_conn_error(s, frame(SETTINGS, 0, 0, too_many), ErrorCode.ENHANCE_YOUR_CALM)


def test_header_table_size_updates_stay_bounded() -> None:
    _c, s = connected_pair()
    for size in (100, 0, 4096, 50, 4096, 200) * 5:
        s.receive_data(frame(SETTINGS, 0, 0, settings_payload(header_table_size=size)))
    assert s._table_size_updates == [0, 200]


def test_request_reset_in_the_same_batch_then_response_is_stream_closed() -> None:
    """Found by fuzzing (fuzz/corpus/h2_server/found-reset-in-same-batch): HEADERS and then
    RST_STREAM for the same stream in one receive_data call yield RequestReceived then
    StreamReset; answering the request afterwards raises StreamClosedError (the documented race
    the transport suppresses), and with hold_streams the stream still counts until released."""
    s, enc = raw_server(hold_streams=True)
    ev = s.receive_data(
        frame(HEADERS, FLAG_END_HEADERS, 1, connect_block(enc))
        + frame(RST_STREAM, 0, 1, struct.pack(">I", ErrorCode.CANCEL))
    )
    assert [type(e) for e in ev] == [RequestReceived, StreamReset]
    with pytest.raises(StreamClosedError):
        s.send_response(1, 200)
    assert s.held_streams == 1
    s.release_stream(1)
    assert s.held_streams == 0
