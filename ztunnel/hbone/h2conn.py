"""Sans-IO HTTP/2 endpoint for HBONE (CONNECT tunnels), client and server, with a zero-copy DATA path.

Bytes in, events out; no sockets, no TLS, no clocks. HBONE needs only a subset of HTTP/2 (one
CONNECT stream per proxied TCP connection, no push, no priorities), but that subset is implemented
to RFC 9113. Header blocks we send are plain HPACK literals (see :func:`_encode_block`); blocks we
receive go through a fast path for that form and the ``hpack`` library for everything else.

Buffers and their lifetimes
---------------------------
* **Send**: :meth:`H2Connection.data_to_send` returns a *list* of buffers (hand it to
  ``transport.writelines`` or feed it to TLS). Frame headers are fresh ``bytes``; DATA payloads are
  the caller's own objects (or memoryview slices of them), never copied. uvloop keeps a memoryview
  of what it is given until it is on the wire, so **the caller must not modify or reuse a buffer
  passed to send_data** until it has been written (pass ``bytes``, or a fresh buffer each time).
  Over TLS, join small buffers before ``SSLObject.write`` so 9-byte headers do not become records.
* **Receive**: DATA payloads are streamed, not reassembled: a DATA frame that spans several
  :meth:`~H2Connection.receive_data` calls yields one :class:`DataReceived` per call, and
  ``DataReceived.data`` is the input object itself or a memoryview slice of it, with no copy. If the
  input was ``bytes`` the slice stays valid for as long as it is referenced. If the input was a
  mutable buffer (bytearray, a memoryview of a reusable buffer), the slice is valid only until that
  buffer is reused. Frame boundaries carry no meaning in HTTP/2, so splitting DATA is invisible to
  the application. Only frame headers and non-DATA frames are ever copied into the connection's
  own buffer, and small DATA payloads: the payloads of complete DATA frames of up to
  ``COALESCE_MAX`` bytes for one stream within one call are joined into one event (a
  ``bytearray``), so a peer sending tiny frames costs one event per stream and call, not one per
  frame. :attr:`H2Connection.frames_received` counts frames, for fairness between peers.

Flow control contract
---------------------
* Receive: every :class:`DataReceived` must eventually be passed back through
  :meth:`~H2Connection.acknowledge_received_data` (``flow_controlled_length``) once the bytes have
  been handed on. WINDOW_UPDATE frames are batched: one is sent when half a window has been
  released. When a stream closes, its unacknowledged bytes are returned to the connection window
  automatically and later acknowledgements for it are ignored.
* Send: :meth:`~H2Connection.send_data` accepts what the windows allow and returns the count; the
  driver keeps the rest and retries after :class:`WindowUpdated` for that stream, or for stream 0
  (the connection window: retry every blocked stream).

Errors
------
* The peer breaking the protocol raises :class:`RemoteProtocolError` from ``receive_data`` with the
  wire ``error_code``. A GOAWAY carrying it is already queued, the connection is closed, and the
  exception's ``events`` holds what was decoded before the violation, ending in
  :class:`ConnectionTerminated`. Stream-level violations do not raise: the stream is reset
  (RST_STREAM queued) and a :class:`StreamReset` with ``remote=False`` is emitted.
* Calling the API in a way HTTP/2 forbids raises :class:`LocalProtocolError` (for example
  :class:`StreamClosedError`); the connection is unchanged.

Hostile peers (:class:`FloodLimits`)
-----------------------------------
What a peer can make us spend is bounded by what it sends. Frames that carry no payload but cost
work or a reply (PING, SETTINGS, PRIORITY, RST_STREAM, GOAWAY, unknown types, refused and reset
streams), WINDOW_UPDATEs, empty DATA and header fragments, and streams reset before their
response (rapid reset, CVE-2023-44487) each have a budget per time window; past it the
connection ends with GOAWAY ENHANCE_YOUR_CALM. A budget is one integer decrement per frame; the
clock is read only when one runs out. A header block may have at most ``max_continuations``
CONTINUATION frames and a bounded size (CVE-2024-27316); a SETTINGS frame is applied in one pass
(an INITIAL_WINDOW_SIZE change touches each stream once, whatever the number of entries) and may
carry at most ``max_settings_entries``. Only open and half-closed streams count against
MAX_CONCURRENT_STREAMS (RFC 9113 5.1.2), so a peer within the limit is never refused. With
``hold_streams=True`` a peer-initiated stream closed on the wire (ended or reset, however early)
whose work the application has not finished yet (:meth:`H2Connection.release_stream`) is *held*:
the bytes received on it stay owed to the connection window, and the held streams have a budget
of their own (``held_streams``): a new stream arriving while it is spent ends the connection with
ENHANCE_YOUR_CALM, so resets cannot multiply the work a connection causes.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

from hpack import Decoder
from hpack.table import HeaderTable

Buffer: TypeAlias = bytes | bytearray | memoryview
Headers: TypeAlias = list[tuple[str, str]]

# ---------------------------------------------------------------------------------------------
# Wire constants (RFC 9113 sections 4, 6, 7, 11)

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

FLAG_END_STREAM: Final = 0x1
FLAG_ACK: Final = 0x1
FLAG_END_HEADERS: Final = 0x4
FLAG_PADDED: Final = 0x8
FLAG_PRIORITY: Final = 0x20

MAX_WINDOW: Final = 2**31 - 1
MAX_STREAM_ID: Final = 2**31 - 1
DEFAULT_WINDOW: Final = 65_535
MIN_MAX_FRAME_SIZE: Final = 16_384
MAX_MAX_FRAME_SIZE: Final = 2**24 - 1


class ErrorCode(IntEnum):
    """HTTP/2 error codes (RFC 9113 section 7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class SettingCode(IntEnum):
    """SETTINGS identifiers (RFC 9113 section 6.5.2, RFC 8441)."""

    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6
    ENABLE_CONNECT_PROTOCOL = 0x8


def as_error_code(code: int) -> int:
    """``ErrorCode(code)`` for known codes; unknown codes stay plain ints (they mean INTERNAL)."""
    try:
        return ErrorCode(code)
    except ValueError:
        return code


def is_clean_reset(code: int) -> bool:
    """HBONE treats a reset with NO_ERROR or CANCEL as a clean end of the tunnel (ref 2.4)."""
    return code == ErrorCode.NO_ERROR or code == ErrorCode.CANCEL


# ---------------------------------------------------------------------------------------------
# Errors


class ProtocolError(Exception):
    """An HTTP/2 protocol violation. ``error_code`` is the wire code that applies."""

    def __init__(self, error_code: int, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} ({as_error_code(self.error_code)!s})"


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the connection is finished.

    A GOAWAY with ``error_code`` is queued in ``data_to_send()``. ``events`` holds the events
    decoded before the violation, ending with :class:`ConnectionTerminated`: process them (e.g. to
    flush data already received) and then close the transport after sending the GOAWAY.
    """

    def __init__(self, error_code: int, message: str) -> None:
        super().__init__(error_code, message)
        self.events: list[Event] = []


class LocalProtocolError(ProtocolError):
    """The caller asked for something HTTP/2 forbids; nothing was sent or changed."""


class StreamClosedError(LocalProtocolError):
    """The stream is closed (or closed for sending); often a race with a reset from the peer."""

    def __init__(self, stream_id: int, message: str = "stream is closed") -> None:
        super().__init__(ErrorCode.STREAM_CLOSED, f"{message}: {stream_id}")
        self.stream_id = stream_id


# ---------------------------------------------------------------------------------------------
# Events


class Event:
    """Base of everything ``receive_data`` returns."""

    __slots__ = ()


@dataclass(slots=True)
class RequestReceived(Event):
    """Server side: a new stream's request header block. See :func:`connect_request_error`."""

    stream_id: int
    method: str
    authority: str | None
    headers: Headers
    scheme: str | None = None
    path: str | None = None


@dataclass(slots=True)
class ResponseReceived(Event):
    """Client side: the final (non-1xx) response header block; ``headers`` has no pseudo-headers."""

    stream_id: int
    status: int
    headers: Headers


@dataclass(slots=True)
class TrailersReceived(Event):
    """A trailing header block; a :class:`StreamEnded` follows."""

    stream_id: int
    headers: Headers


@dataclass(slots=True)
class DataReceived(Event):
    """Payload bytes. ``data`` may be a memoryview slice of the input, or a ``bytearray`` of
    several small payloads of the stream joined (see module docstring).

    Pass ``flow_controlled_length`` to ``acknowledge_received_data`` once consumed.
    """

    stream_id: int
    data: Buffer
    flow_controlled_length: int


@dataclass(slots=True)
class StreamEnded(Event):
    """The peer half-closed the stream (END_STREAM): the HBONE equivalent of a TCP FIN."""

    stream_id: int


@dataclass(slots=True)
class StreamReset(Event):
    """The stream is gone. ``remote``: the peer sent RST_STREAM (or refused it via GOAWAY);
    otherwise we reset it because the peer broke the protocol on this stream."""

    stream_id: int
    error_code: int
    remote: bool


@dataclass(slots=True)
class WindowUpdated(Event):
    """Send capacity grew on ``stream_id`` (0: the connection window, retry every stream)."""

    stream_id: int
    delta: int


@dataclass(slots=True)
class RemoteSettingsChanged(Event):
    """The peer's SETTINGS were applied (and acknowledged). ``changed`` maps id -> new value."""

    max_concurrent_streams: int | None
    initial_window_size: int
    max_frame_size: int
    changed: dict[int, int]


@dataclass(slots=True)
class SettingsAcked(Event):
    """The peer acknowledged our SETTINGS."""


@dataclass(slots=True)
class PingReceived(Event):
    """The peer sent a PING; the ACK is already queued."""

    data: bytes


@dataclass(slots=True)
class PingAcked(Event):
    """The peer answered one of our PINGs (``data`` is what :meth:`H2Connection.ping` returned)."""

    data: bytes


@dataclass(slots=True)
class GoAwayReceived(Event):
    """The peer will not process streams above ``last_stream_id``; no new streams can be opened.

    Our streams above ``last_stream_id`` are reported as ``StreamReset(REFUSED_STREAM, remote=True)``
    right after this event (safe to retry on another connection).
    """

    last_stream_id: int
    error_code: int
    debug_data: bytes


@dataclass(slots=True)
class ConnectionTerminated(Event):
    """We ended the connection because the peer broke the protocol (GOAWAY queued)."""

    error_code: int
    last_stream_id: int
    reason: str


@dataclass(slots=True)
class Settings:
    """One side's HTTP/2 settings (RFC 9113 defaults; ``None`` means unlimited)."""

    header_table_size: int = 4096
    enable_push: int = 1
    max_concurrent_streams: int | None = None
    initial_window_size: int = DEFAULT_WINDOW
    max_frame_size: int = MIN_MAX_FRAME_SIZE
    max_header_list_size: int | None = None
    enable_connect_protocol: int = 0


@dataclass(frozen=True, slots=True)
class FloodLimits:
    """Per-connection budgets against floods (nghttp2's and Envoy's defences); each count is per
    ``window`` seconds and exceeding it ends the connection with ENHANCE_YOUR_CALM."""

    window: float = 1.0
    control_frames: int = 1000  # PING, SETTINGS, PRIORITY, RST_STREAM, GOAWAY, unknown, refusals
    window_updates: int = 10_000  # WINDOW_UPDATE frames
    empty_frames: int = 100  # DATA without payload or END_STREAM, empty header fragments
    early_resets: int = 200  # peer streams reset before we answered them (rapid reset)
    # Peer streams closed on the wire whose work goes on (hold_streams): not a rate, a level. Twice
    # the default stream limit, so that a peer turning all its streams over at once is within it.
    held_streams: int = 400
    max_continuations: int = 32  # CONTINUATION frames in one header block
    max_settings_entries: int = 32  # entries in one SETTINGS frame (nghttp2's default)


DEFAULT_FLOOD_LIMITS: Final = FloodLimits()


class _Budget:
    """A count per time window: :meth:`spend` is called when ``left`` went negative."""

    __slots__ = ("clock", "left", "limit", "name", "since", "window")

    def __init__(self, name: str, limit: int, window: float, clock: Callable[[], float]) -> None:
        self.name = name
        self.limit = limit
        self.window = window
        self.clock = clock
        self.left = limit
        self.since = clock()

    def refill_or_raise(self) -> None:
        now = self.clock()
        if now - self.since >= self.window:
            self.since = now
            self.left += self.limit  # (left is -1 or below: what was spent is charged)
            if self.left >= 0:
                return
        raise RemoteProtocolError(
            ErrorCode.ENHANCE_YOUR_CALM,
            f"flood: more than {self.limit} {self.name} in {self.window:g}s",
        )


# ---------------------------------------------------------------------------------------------
# Header validation (RFC 9113 8.2, 8.3)

_BAD_NAME = re.compile(rb"[\x00-\x20A-Z\x7f-\xff:]")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))
_RESPONSE_PSEUDO = frozenset((b":status",))
_STATUS = re.compile(rb"[0-9]{3}\Z")


class _Malformed(Exception):
    """A header block that decodes but breaks HTTP/2 message rules: a stream PROTOCOL_ERROR."""


def _check_regular(name: bytes, value: bytes) -> None:
    if not name or _BAD_NAME.search(name):
        raise _Malformed(f"invalid header name {name!r}")
    if _BAD_VALUE.search(value):
        raise _Malformed(f"invalid value for header {name.decode('latin-1')}")
    if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
        raise _Malformed(f"connection-specific header {name.decode('latin-1')}")


def _split_fields(
    raw: Iterable[tuple[bytes, bytes]], allowed_pseudo: frozenset[bytes]
) -> tuple[dict[bytes, bytes], Headers, int]:
    """Validate a decoded block: (pseudo-headers, regular headers as str, header list size)."""
    pseudo: dict[bytes, bytes] = {}
    regular: Headers = []
    size = 0
    for name, value in raw:
        size += len(name) + len(value) + 32
        if name[:1] == b":":
            if regular:
                raise _Malformed("pseudo-header after a regular header")
            if name not in allowed_pseudo:
                raise _Malformed(f"unexpected pseudo-header {name.decode('latin-1')}")
            if name in pseudo:
                raise _Malformed(f"duplicate pseudo-header {name.decode('latin-1')}")
            if _BAD_VALUE.search(value):
                raise _Malformed(f"invalid value for {name.decode('latin-1')}")
            pseudo[name] = value
        else:
            _check_regular(name, value)
            regular.append((name.decode("ascii"), value.decode("utf-8", "surrogateescape")))
    return pseudo, regular, size


def _encode_fields(headers: Iterable[tuple[str, str]], out: list[tuple[bytes, bytes]]) -> None:
    """Validate caller-supplied regular headers and append them as bytes to ``out``."""
    for name, value in headers:
        bname = name.encode("ascii", "surrogateescape")
        bvalue = value.encode("utf-8", "surrogateescape")
        try:
            _check_regular(bname, bvalue)
        except _Malformed as exc:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, str(exc)) from None
        out.append((bname, bvalue))


# ---------------------------------------------------------------------------------------------
# HPACK (RFC 7541) for the blocks HBONE exchanges
#
# We send every field as a literal without indexing, never Huffman-coded, with the name indexed
# from the static table when it is there (``:status 200`` is fully indexed). The block is valid
# HPACK for any decoder and leaves both dynamic tables empty, and encoding it is a few byte
# appends instead of the ``hpack`` encoder's table search and bookkeeping per field (~20 us per
# CONNECT request). Receiving, :func:`_decode_literal_block` handles exactly that form (and
# static indexed fields); anything else (Huffman, the dynamic table, size updates) returns None
# and the whole block goes to the ``hpack`` decoder, so the connection's HPACK state stays exact.

_STATIC: Final = HeaderTable.STATIC_TABLE  # index 1..61 -> (name, value) bytes
_STATIC_NAME: Final = {name: i + 1 for i, (name, _) in reversed(list(enumerate(_STATIC)))}
_STATIC_FIELD: Final = {field: i + 1 for i, field in enumerate(_STATIC)}
_STATIC_TABLE_SIZE: Final = len(_STATIC)
_DEFAULT_HEADER_TABLE: Final = 4096


def _hpack_int(out: bytearray, value: int, prefix_bits: int, first: int) -> None:
    """Append ``value`` as an HPACK integer with an N-bit prefix (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        out.append(first | value)
        return
    out.append(first | limit)
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)


# The start of a literal field without indexing for each name sent so far (its static index, or
# the name itself), so that a field costs a dict lookup and two appends. Only our own outgoing
# names get here (a handful); bounded all the same.
_NAME_PREFIX: dict[bytes, bytes] = {}
_NAME_PREFIX_MAX = 256


def _name_prefix(name: bytes) -> bytes:
    out = bytearray()
    idx = _STATIC_NAME.get(name)
    if idx is None:
        out.append(0)  # literal without indexing, new name
        _hpack_int(out, len(name), 7, 0)
        out += name
    else:
        _hpack_int(out, idx, 4, 0)  # literal without indexing, indexed name
    prefix = bytes(out)
    if len(_NAME_PREFIX) < _NAME_PREFIX_MAX:
        _NAME_PREFIX[name] = prefix
    return prefix


def _encode_block(fields: list[tuple[bytes, bytes]], size_updates: list[int]) -> bytes:
    """A header block of literals without indexing (see above), after any table size updates."""
    out = bytearray()
    for size in size_updates:
        _hpack_int(out, size, 5, 0x20)
    prefixes = _NAME_PREFIX
    for name, value in fields:
        if name in _STATIC_NAME:  # (a name with no static entry cannot match a whole field)
            idx = _STATIC_FIELD.get((name, value))
            if idx is not None:
                out.append(0x80 | idx)  # indexed field (static table)
                continue
        prefix = prefixes.get(name)
        out += prefix if prefix is not None else _name_prefix(name)
        n = len(value)
        if n < 127:
            out.append(n)  # (the 7-bit prefix holds it: _hpack_int's first case)
        else:
            _hpack_int(out, n, 7, 0)
        out += value
    return bytes(out)


def _hpack_int_tail(block: bytes, pos: int, value: int) -> tuple[int, int]:
    """Finish an HPACK integer whose prefix was full (``value``); (integer, new position).
    Raises IndexError when truncated, or ValueError past 2**28 (nothing HBONE sends)."""
    shift = 0
    while True:
        b = block[pos]
        pos += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 21:
            raise ValueError("HPACK integer too large")


def _decode_literal_block(block: bytes, max_list_size: int) -> list[tuple[bytes, bytes]] | None:
    """Decode a block made only of static indexed fields and non-Huffman literals without (or
    never) indexing: the form :func:`_encode_block` writes. None for anything else, including
    any malformed or over-limit input (the ``hpack`` decoder then decodes it or says why)."""
    fields: list[tuple[bytes, bytes]] = []
    n = len(block)
    pos = 0
    size = 0
    try:
        while pos < n:
            b = block[pos]
            pos += 1
            if b & 0x80:  # indexed field
                idx = b & 0x7F
                if not 0 < idx <= _STATIC_TABLE_SIZE:
                    return None  # 0 is invalid; above: the dynamic table (or a multi-byte index)
                field = _STATIC[idx - 1]
                fields.append(field)
                size += 32 + len(field[0]) + len(field[1])
                continue
            if b & 0xE0:  # 01xxxxxx incremental indexing, 001xxxxx table size update
                return None
            idx = b & 0x0F  # 0000xxxx without indexing, 0001xxxx never indexed
            if idx == 0x0F:  # a name index >= 15 takes more bytes
                idx, pos = _hpack_int_tail(block, pos, idx)
            if idx:
                if idx > _STATIC_TABLE_SIZE:
                    return None
                name = _STATIC[idx - 1][0]
            else:
                b = block[pos]
                pos += 1
                length = b & 0x7F
                if b & 0x80 or length == 0x7F:
                    return None  # Huffman-coded or a long name
                name = block[pos : pos + length]
                pos += length
                if len(name) != length:
                    return None
            b = block[pos]
            pos += 1
            length = b & 0x7F
            if b & 0x80:
                return None  # Huffman-coded
            if length == 0x7F:
                length, pos = _hpack_int_tail(block, pos, length)
            value = block[pos : pos + length]
            pos += length
            if len(value) != length:
                return None
            fields.append((name, value))
            size += 32 + len(name) + length
    except (IndexError, ValueError):  # truncated, or an absurd integer
        return None
    if size > max_list_size:
        return None
    return fields


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "surrogateescape")


def connect_request_error(request: RequestReceived) -> str | None:
    """Why a request is not an acceptable HBONE CONNECT (the server answers 400), or None.

    RFC 9113 8.5: ``:method CONNECT``, ``:authority`` set, no ``:scheme`` and no ``:path``.
    """
    if request.method != "CONNECT":
        return f"method {request.method!r} is not CONNECT"
    if request.scheme is not None or request.path is not None:
        return "CONNECT request carries :scheme or :path"
    if not request.authority:
        return "CONNECT request without :authority"
    return None


# ---------------------------------------------------------------------------------------------
# Framing helpers

_HDR = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id: the 9-byte frame header
_pack_hdr = _HDR.pack
_unpack_hdr = _HDR.unpack_from
_U32 = struct.Struct(">I")
_FRAME_U32 = struct.Struct(">IBII")  # a whole 13-byte frame with one 32-bit payload word
_SETTING = struct.Struct(">HI")
_GOAWAY_HEAD = struct.Struct(">II")
_U64 = struct.Struct(">Q")

_WU_LT: Final = (4 << 8) | WINDOW_UPDATE
_RST_LT: Final = (4 << 8) | RST_STREAM

# Why a stream left the table, remembered for a while to classify late frames (RFC 9113 5.1).
_ENDED: Final = 0  # END_STREAM both ways: further DATA/HEADERS are a connection error
_RESET_LOCAL: Final = 1  # we sent RST_STREAM: frames still in flight are ignored
_RESET_REMOTE: Final = 2  # the peer sent RST_STREAM: further frames are a stream error
_CLOSED_MEMORY: Final = 1024

DEFAULT_STREAM_WINDOW: Final = 4 * 1024 * 1024
DEFAULT_CONNECTION_WINDOW: Final = 16 * 1024 * 1024
DEFAULT_MAX_FRAME_SIZE: Final = 1024 * 1024
DEFAULT_SEND_FRAME_SIZE: Final = 64 * 1024
DEFAULT_SERVER_MAX_STREAMS: Final = 200
DEFAULT_CLIENT_HEADER_LIST: Final = 16 * 1024
DEFAULT_SERVER_HEADER_LIST: Final = 64 * 1024
# DATA payloads up to this size are copied and joined per stream within one receive_data call
# (cheaper than an event, a slice and an iovec each); larger ones are handed on as slices.
COALESCE_MAX: Final = 1024


class _Stream:
    """Per-stream state. ``closed`` is set when the stream leaves the connection's table."""

    __slots__ = (
        "closed",
        "headers_received",
        "headers_sent",
        "held",
        "local",
        "local_closed",
        "recv_pending",
        "recv_window",
        "remote_closed",
        "send_window",
        "sid",
        "unacked",
    )

    def __init__(self, sid: int, local: bool, send_window: int, recv_window: int) -> None:
        self.sid = sid
        self.local = local  # initiated by us
        self.headers_sent = False
        self.headers_received = False
        self.local_closed = False  # we sent END_STREAM
        self.remote_closed = False  # the peer sent END_STREAM
        self.closed = False
        self.send_window = send_window
        self.recv_window = recv_window  # what the peer may still send
        self.recv_pending = 0  # acknowledged by the app, not yet returned by WINDOW_UPDATE
        self.unacked = 0  # delivered to the app, not yet acknowledged
        self.held = False  # counted until release_stream (hold_streams)


class H2Connection:
    """One HTTP/2 connection endpoint (``client=True``: we send the preface and open streams).

    The initial preface/SETTINGS/WINDOW_UPDATE are queued by the constructor; call
    :meth:`data_to_send` and write them out before anything else.

    Parameters (defaults follow ztunnel, reference 2.5):
      ``initial_window_size`` stream receive window (4 MiB); ``connection_window_size`` connection
      receive window (16 MiB, announced by a WINDOW_UPDATE on stream 0); ``max_frame_size`` the
      largest frame we accept (1 MiB); ``max_concurrent_streams`` peer-initiated streams we allow
      (server default 200, client: not advertised); ``max_header_list_size`` (16 KiB client,
      64 KiB server); ``send_frame_size`` the DATA frame size we emit, capped by the peer's
      MAX_FRAME_SIZE (64 KiB: see benchmarks/bench_h2conn.py).
    """

    def __init__(
        self,
        client: bool,
        *,
        initial_window_size: int = DEFAULT_STREAM_WINDOW,
        connection_window_size: int = DEFAULT_CONNECTION_WINDOW,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_concurrent_streams: int | None = None,
        max_header_list_size: int | None = None,
        send_frame_size: int = DEFAULT_SEND_FRAME_SIZE,
        limits: FloodLimits = DEFAULT_FLOOD_LIMITS,
        hold_streams: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= initial_window_size <= MAX_WINDOW:
            raise ValueError(f"initial_window_size out of range: {initial_window_size}")
        if not DEFAULT_WINDOW <= connection_window_size <= MAX_WINDOW:
            raise ValueError(f"connection_window_size out of range: {connection_window_size}")
        if not MIN_MAX_FRAME_SIZE <= max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise ValueError(f"max_frame_size out of range: {max_frame_size}")
        if not 1 <= send_frame_size <= MAX_MAX_FRAME_SIZE:
            raise ValueError(f"send_frame_size out of range: {send_frame_size}")
        if max_concurrent_streams is None and not client:
            max_concurrent_streams = DEFAULT_SERVER_MAX_STREAMS
        if max_header_list_size is None:
            max_header_list_size = (
                DEFAULT_CLIENT_HEADER_LIST if client else DEFAULT_SERVER_HEADER_LIST
            )

        self.client: Final = client
        self._local = Settings(
            enable_push=0 if client else 1,
            max_concurrent_streams=max_concurrent_streams,
            initial_window_size=initial_window_size,
            max_frame_size=max_frame_size,
            max_header_list_size=max_header_list_size,
        )
        self._remote = Settings()
        self._header_table_size = _DEFAULT_HEADER_TABLE  # our encoder's table size (unused)
        self._table_size_updates: list[int] = []  # to signal at the start of the next block
        # Hard HPACK limit: past it the decoder stops mid-block and the connection is lost
        # (COMPRESSION_ERROR). Past the advertised (soft) limit only the stream is reset.
        hard_limit = max(2 * max_header_list_size, 65_536)
        self._decoder = Decoder(max_header_list_size=hard_limit)
        self._hard_header_list = hard_limit
        self._max_block = hard_limit + 16_384

        self._out: list[Buffer] = []
        self._buf = bytearray()
        self._streams: dict[int, _Stream] = {}
        self._recent_closed: dict[int, int] = {}
        self._local_parity = 1 if client else 0
        self._next_sid = 1 if client else 2
        self._highest_remote = 0
        self._local_open = 0
        self._remote_open = 0
        # hold_streams: closed peer streams not yet released -> bytes still owed to the window.
        self._hold_streams = hold_streams
        self._held: dict[int, int] = {}
        self._limits = limits
        w = limits.window
        self._ctl = _Budget("control frames", limits.control_frames, w, clock)
        self._wu = _Budget("WINDOW_UPDATE frames", limits.window_updates, w, clock)
        self._empty = _Budget("empty frames", limits.empty_frames, w, clock)
        self._early_rst = _Budget("early stream resets", limits.early_resets, w, clock)
        self._cont_frames = 0

        self._conn_send_window = DEFAULT_WINDOW
        self._conn_recv_window = connection_window_size
        self._conn_recv_pending = 0
        self._conn_threshold = max(connection_window_size // 2, 1)
        self._stream_threshold = max(initial_window_size // 2, 1)
        self._send_frame_pref = send_frame_size
        self._send_frame = min(send_frame_size, MIN_MAX_FRAME_SIZE)

        self._preface_left = 0 if client else len(PREFACE)
        self._awaiting_settings = True  # the peer's first frame must be SETTINGS
        self._cont_sid = 0  # expecting CONTINUATION frames for this stream
        self._cont_block = bytearray()
        self._cont_flags = 0
        self._cont_self_dep = False
        self.frames_received = 0  # every frame header parsed (fairness: a peer pays per frame)
        # Within one receive_data call: stream id -> the event its small DATA payloads join.
        self._joined: dict[int, DataReceived] = {}
        self._data_remaining = 0  # payload bytes left in the DATA frame being streamed
        self._data_stream: _Stream | None = None  # None: discard the payload
        self._data_end = False

        self._closed = False
        self._goaway_sent = False
        self._goaway_last = MAX_STREAM_ID
        self._goaway_received = False
        self._peer_goaway_last = MAX_STREAM_ID
        self._ping_seq = 0

        settings: list[tuple[int, int]] = []
        if client:
            settings.append((SettingCode.ENABLE_PUSH, 0))
        if max_concurrent_streams is not None:
            settings.append((SettingCode.MAX_CONCURRENT_STREAMS, max_concurrent_streams))
        settings += [
            (SettingCode.INITIAL_WINDOW_SIZE, initial_window_size),
            (SettingCode.MAX_FRAME_SIZE, max_frame_size),
            (SettingCode.MAX_HEADER_LIST_SIZE, max_header_list_size),
        ]
        body = b"".join(_SETTING.pack(k, v) for k, v in settings)
        head = PREFACE if client else b""
        update = b""
        if connection_window_size > DEFAULT_WINDOW:
            increment = connection_window_size - DEFAULT_WINDOW
            update = _FRAME_U32.pack(_WU_LT, 0, 0, increment)
        self._out.append(head + _pack_hdr(len(body) << 8 | SETTINGS, 0, 0) + body + update)

    # -----------------------------------------------------------------------------------------
    # Introspection

    @property
    def local_settings(self) -> Settings:
        """The settings we advertised (a copy)."""
        s = self._local
        return Settings(
            s.header_table_size,
            s.enable_push,
            s.max_concurrent_streams,
            s.initial_window_size,
            s.max_frame_size,
            s.max_header_list_size,
            s.enable_connect_protocol,
        )

    @property
    def remote_settings(self) -> Settings:
        """The peer's settings as currently applied (a copy)."""
        s = self._remote
        return Settings(
            s.header_table_size,
            s.enable_push,
            s.max_concurrent_streams,
            s.initial_window_size,
            s.max_frame_size,
            s.max_header_list_size,
            s.enable_connect_protocol,
        )

    @property
    def remote_max_concurrent_streams(self) -> int | None:
        """The peer's SETTINGS_MAX_CONCURRENT_STREAMS (None: unlimited), without a copy."""
        return self._remote.max_concurrent_streams

    @property
    def closed(self) -> bool:
        """True once a final GOAWAY was queued (:meth:`close` or a protocol error)."""
        return self._closed

    @property
    def goaway_received(self) -> bool:
        return self._goaway_received

    @property
    def available_streams(self) -> int:
        """How many more streams :meth:`open_stream` may open now (0 for a server)."""
        if not self.client or self._closed or self._goaway_received or self._goaway_sent:
            return 0
        limit = self._remote.max_concurrent_streams
        room = (MAX_WINDOW if limit is None else limit) - self._local_open
        ids_left = (MAX_STREAM_ID - self._next_sid) // 2 + 1
        return max(0, min(room, ids_left))

    @property
    def open_streams(self) -> int:
        """Streams in the open or half-closed states (both directions of initiation)."""
        return self._local_open + self._remote_open

    @property
    def connection_send_window(self) -> int:
        return self._conn_send_window

    @property
    def max_outbound_frame_size(self) -> int:
        """The DATA frame size send_data uses: ``min(send_frame_size, peer MAX_FRAME_SIZE)``."""
        return self._send_frame

    def stream_send_window(self, stream_id: int) -> int:
        """Bytes send_data could send on the stream now (min of stream and connection windows)."""
        st = self._streams.get(stream_id)
        if st is None or st.local_closed:
            return 0
        return max(0, min(st.send_window, self._conn_send_window))

    def stream_is_open(self, stream_id: int) -> bool:
        return stream_id in self._streams

    # -----------------------------------------------------------------------------------------
    # Output

    @property
    def has_output(self) -> bool:
        """Whether :meth:`data_to_send` has anything."""
        return bool(self._out)

    def data_to_send(self) -> list[Buffer]:
        """Take the queued output as a list of buffers (see the module docstring on lifetimes)."""
        out = self._out
        if not out:
            return []
        self._out = []
        return out

    def data_to_send_bytes(self) -> bytes:
        """Take the queued output joined into one ``bytes`` (one copy; for TLS or tests)."""
        return b"".join(self.data_to_send())

    # -----------------------------------------------------------------------------------------
    # Client API

    def open_stream(
        self, authority: str, headers: Iterable[tuple[str, str]] = (), *, end_stream: bool = False
    ) -> int:
        """Open a CONNECT stream: HEADERS with ``:method CONNECT`` and ``:authority`` (no :scheme,
        no :path), then ``headers`` (lower-case names, e.g. baggage, forwarded, traceparent).
        Returns the new stream id. Check :attr:`available_streams` first."""
        if not self.client:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "a server cannot open streams")
        self._check_usable()
        if self.available_streams <= 0:
            raise LocalProtocolError(ErrorCode.REFUSED_STREAM, "no stream available")
        bauth = authority.encode("utf-8", "surrogateescape")
        if not bauth or _BAD_VALUE.search(bauth):
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, f"invalid authority {authority!r}")
        fields: list[tuple[bytes, bytes]] = [(b":method", b"CONNECT"), (b":authority", bauth)]
        _encode_fields(headers, fields)
        sid = self._next_sid
        self._next_sid = sid + 2
        st = _Stream(sid, True, self._remote.initial_window_size, self._local.initial_window_size)
        st.headers_sent = True
        st.headers_received = False
        self._streams[sid] = st
        self._local_open += 1
        self._send_header_block(sid, fields, end_stream)
        if end_stream:
            st.local_closed = True
        return sid

    # -----------------------------------------------------------------------------------------
    # Server API

    def send_response(
        self,
        stream_id: int,
        status: int,
        headers: Iterable[tuple[str, str]] = (),
        *,
        end_stream: bool = False,
    ) -> None:
        """Send the (final) response header block: 200 opens the tunnel; an error status should
        use ``end_stream=True`` (headers-only, as ztunnel does)."""
        if self.client:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "a client cannot send responses")
        self._check_usable()
        st = self._streams.get(stream_id)
        if st is None or st.local_closed:
            raise StreamClosedError(stream_id)
        if st.headers_sent:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "response already sent")
        if not 200 <= status <= 999:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, f"unsupported status {status}")
        fields: list[tuple[bytes, bytes]] = [(b":status", b"%d" % status)]
        _encode_fields(headers, fields)
        st.headers_sent = True
        self._send_header_block(stream_id, fields, end_stream)
        if end_stream:
            self._local_end(st)

    # -----------------------------------------------------------------------------------------
    # Both sides

    def send_data(self, stream_id: int, data: Buffer, end_stream: bool = False) -> int:
        """Queue as much of ``data`` as the flow-control windows allow; return the bytes taken.

        ``data`` is not copied: it (or memoryview slices of it) is queued as is, in DATA frames of
        :attr:`max_outbound_frame_size`. ``end_stream`` applies only if all of ``data`` was taken;
        with empty ``data`` it sends an empty END_STREAM frame (no window needed). The caller keeps
        the rest and retries after :class:`WindowUpdated`.
        """
        if self._closed:
            self._check_usable()
        st = self._streams.get(stream_id)
        if st is None or st.local_closed:
            raise StreamClosedError(stream_id)
        if not st.headers_sent:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA before response headers")
        n = len(data)
        if not n:
            if end_stream:
                self._out.append(_pack_hdr(0, FLAG_END_STREAM, stream_id))
                self._local_end(st)
            return 0
        allowed = st.send_window
        cw = self._conn_send_window
        if cw < allowed:
            allowed = cw
        if allowed <= 0:
            return 0
        if allowed >= n:
            allowed = n
        else:
            end_stream = False
        out = self._out
        frame = self._send_frame
        flags = FLAG_END_STREAM if end_stream else 0
        if allowed <= frame:
            out.append(_pack_hdr(allowed << 8, flags, stream_id))
            out.append(data if allowed == n else memoryview(data)[:allowed])
        else:
            mv = memoryview(data)
            full = _pack_hdr(frame << 8, 0, stream_id)  # shared by every full frame
            append = out.append
            off = 0
            last = allowed - frame
            while off < last:
                append(full)
                nxt = off + frame
                append(mv[off:nxt])
                off = nxt
            append(_pack_hdr((allowed - off) << 8, flags, stream_id))
            append(mv[off:allowed])
        self._conn_send_window = cw - allowed
        st.send_window -= allowed
        if end_stream:
            self._local_end(st)
        return allowed

    def frame_data_in_place(self, stream_id: int, buf: bytearray, n: int) -> int:
        """Frame ``n`` payload bytes that the caller already placed in ``buf`` as DATA frames, in
        place; return how many bytes of ``buf`` are frames (``n`` plus 9 per frame).

        The layout: a 9-byte gap for the frame header before every :attr:`max_outbound_frame_size`
        bytes of payload (payload ``k`` starts at ``9 + k * (frame + 9)``), so a TCP read scattered
        into those slots (``recvmsg_into``) becomes wire-ready HTTP/2 with no copy. Nothing is queued: the caller writes
        ``buf[:returned]`` out itself, after :meth:`data_to_send` (frames queued earlier go first).
        ``n`` must be within :meth:`stream_send_window` (read no more than that); no END_STREAM.
        """
        if self._closed:
            self._check_usable()
        st = self._streams.get(stream_id)
        if st is None or st.local_closed:
            raise StreamClosedError(stream_id)
        if not st.headers_sent:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA before response headers")
        cw = self._conn_send_window
        if not 0 < n <= st.send_window or n > cw:
            raise LocalProtocolError(
                ErrorCode.FLOW_CONTROL_ERROR, f"{n} bytes exceed the send window of {stream_id}"
            )
        frame = self._send_frame
        pack_into = _HDR.pack_into
        pos = 0
        left = n
        while left > frame:
            pack_into(buf, pos, frame << 8, 0, stream_id)
            pos += 9 + frame
            left -= frame
        pack_into(buf, pos, left << 8, 0, stream_id)
        self._conn_send_window = cw - n
        st.send_window -= n
        return pos + 9 + left

    def end_stream(self, stream_id: int) -> None:
        """Half-close our side: an empty DATA frame with END_STREAM (the TCP FIN of HBONE)."""
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, error_code: int = ErrorCode.CANCEL) -> None:
        """Send RST_STREAM and forget the stream. A no-op if the stream is already closed."""
        st = self._streams.get(stream_id)
        if st is None:
            if stream_id <= 0 or self._is_idle(stream_id):
                raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, f"no stream {stream_id}")
            return
        if self._closed:
            return
        self._out.append(_FRAME_U32.pack(_RST_LT, 0, stream_id, error_code))
        self._close_stream(st, _RESET_LOCAL)

    def acknowledge_received_data(self, stream_id: int, n: int) -> None:
        """Release ``n`` received bytes (a DataReceived.flow_controlled_length) back to the peer.

        WINDOW_UPDATEs are sent only once half a window has been released (connection and
        stream separately). Ignored for streams that are already closed.
        """
        if n <= 0:
            if n == 0:
                return
            raise ValueError(f"negative acknowledgement: {n}")
        st = self._streams.get(stream_id)
        if st is None:
            owed = self._held.get(stream_id)
            if owed:  # a closed stream the app still holds: its bytes go back now
                n = min(n, owed)
                self._held[stream_id] = owed - n
                self._release_conn(n)
            return
        left = st.unacked - n
        if left < 0:
            raise LocalProtocolError(
                ErrorCode.FLOW_CONTROL_ERROR,
                f"acknowledged {n} bytes but only {st.unacked} are outstanding on {stream_id}",
            )
        st.unacked = left
        p = self._conn_recv_pending + n
        if p >= self._conn_threshold:
            self._out.append(_FRAME_U32.pack(_WU_LT, 0, 0, p))
            self._conn_recv_window += p
            p = 0
        self._conn_recv_pending = p
        if not st.remote_closed:
            p = st.recv_pending + n
            if p >= self._stream_threshold:
                self._out.append(_FRAME_U32.pack(_WU_LT, 0, stream_id, p))
                st.recv_window += p
                p = 0
            st.recv_pending = p

    def release_stream(self, stream_id: int) -> None:
        """``hold_streams``: the application's work for a peer stream has ended. Once closed on
        the wire, the stream was held until now (counted against ``held_streams``, and the
        bytes delivered on it against the connection window); both are returned. The stream
        itself is left as it is (close or reset it first). Unknown or already released streams
        are ignored."""
        st = self._streams.get(stream_id)
        if st is not None:
            st.held = False
            return
        owed = self._held.pop(stream_id, None)
        if owed:
            self._release_conn(owed)

    def charge(self, n: int = 1) -> RemoteProtocolError | None:
        """Count ``n`` units of work the peer caused outside the parser (a request the
        application refused as malformed) against the control-frame budget. When that exhausts
        it the connection is closed (GOAWAY ENHANCE_YOUR_CALM queued) and the error returned."""
        if self._closed:
            return None
        try:
            self._spend_control(n)
        except RemoteProtocolError as exc:
            self._terminate(exc, [])
            return exc
        return None

    @property
    def held_streams(self) -> int:
        """Peer streams closed on the wire and not yet released (``hold_streams``)."""
        return len(self._held)

    def ping(self, opaque: bytes | None = None) -> bytes:
        """Send a PING; returns its 8 opaque bytes (matched by a later :class:`PingAcked`)."""
        self._check_usable()
        if opaque is None:
            self._ping_seq += 1
            opaque = _U64.pack(self._ping_seq & 0xFFFF_FFFF_FFFF_FFFF)
        if len(opaque) != 8:
            raise ValueError("PING payload must be 8 bytes")
        self._out.append(_pack_hdr(8 << 8 | PING, 0, 0) + opaque)
        return opaque

    def goaway(
        self,
        error_code: int = ErrorCode.NO_ERROR,
        *,
        last_stream_id: int | None = None,
        debug_data: bytes = b"",
    ) -> None:
        """Send GOAWAY: peer streams above ``last_stream_id`` (default: the highest seen) will be
        refused; existing streams may finish. No new streams are opened afterwards."""
        self._check_usable()
        last = self._highest_remote if last_stream_id is None else last_stream_id
        if not 0 <= last <= MAX_STREAM_ID:
            raise ValueError(f"last_stream_id out of range: {last}")
        last = min(last, self._goaway_last)
        self._goaway_sent = True
        self._goaway_last = last
        body = _GOAWAY_HEAD.pack(last, error_code) + debug_data
        self._out.append(_pack_hdr(len(body) << 8 | GOAWAY, 0, 0) + body)

    def close(self, error_code: int = ErrorCode.NO_ERROR, debug_data: bytes = b"") -> None:
        """Send a final GOAWAY and stop: later input is ignored and sending raises."""
        if self._closed:
            return
        self.goaway(error_code, debug_data=debug_data)
        self._closed = True

    # -----------------------------------------------------------------------------------------
    # Input

    def receive_data(self, data: Buffer) -> list[Event]:
        """Feed bytes from the peer; return the events they complete.

        Raises :class:`RemoteProtocolError` if the peer broke the protocol (see the class).
        Input after the connection is closed is ignored.
        """
        if self._closed:
            return []
        events: list[Event] = []
        try:
            if self._preface_left:
                data = self._take_preface(data)
            self._feed(data, events)
        except RemoteProtocolError as exc:
            self._terminate(exc, events)
            raise
        except Exception as exc:  # a bug here must still end the connection cleanly
            err = RemoteProtocolError(ErrorCode.INTERNAL_ERROR, f"internal error: {exc!r}")
            self._terminate(err, events)
            raise err from exc
        finally:
            if self._joined:  # (the events are the caller's now)
                self._joined.clear()
        return events

    def _terminate(self, exc: RemoteProtocolError, events: list[Event]) -> None:
        last = min(self._highest_remote, self._goaway_last)
        reason = exc.message.encode("utf-8", "replace")[:256]
        body = _GOAWAY_HEAD.pack(last, exc.error_code) + reason
        self._out.append(_pack_hdr(len(body) << 8 | GOAWAY, 0, 0) + body)
        self._closed = True
        self._goaway_sent = True
        self._goaway_last = last
        events.append(ConnectionTerminated(as_error_code(exc.error_code), last, exc.message))
        exc.events = events

    def _take_preface(self, data: Buffer) -> Buffer:
        left = self._preface_left
        k = min(left, len(data))
        start = len(PREFACE) - left
        if bytes(data[:k]) != PREFACE[start : start + k]:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "invalid connection preface")
        self._preface_left = left - k
        return memoryview(data)[k:] if k else data

    def _feed(self, data: Buffer, events: list[Event]) -> None:
        n = len(data)
        pos = 0
        mv: memoryview | None = None
        buf = self._buf
        joined = self._joined  # (emptied by receive_data after each call)
        while True:
            if pos >= n:
                return
            rem = self._data_remaining
            if rem:
                # Inside a DATA payload: hand it on as it arrives, without reassembly.
                take = n - pos
                if take > rem:
                    take = rem
                st = self._data_stream
                if st is not None and st.closed:  # reset by the app mid-frame
                    st = self._data_stream = None
                if st is None:
                    self._release_conn(take)
                else:
                    if take == n:
                        chunk: Buffer = data
                    else:
                        if mv is None:
                            mv = memoryview(data)
                        chunk = mv[pos : pos + take]
                    st.unacked += take
                    if joined:
                        joined.pop(st.sid, None)  # (later payloads must not join earlier)
                    events.append(DataReceived(st.sid, chunk, take))
                pos += take
                rem -= take
                self._data_remaining = rem
                if rem:
                    return
                self._data_stream = None
                if self._data_end and st is not None:
                    self._remote_end(st, events)
                continue
            if buf:
                # Complete a frame started by an earlier call.
                blen = len(buf)
                if mv is None:
                    mv = memoryview(data)
                if blen < 9:
                    take = min(9 - blen, n - pos)
                    buf += mv[pos : pos + take]
                    pos += take
                    if blen + take < 9:
                        return
                    lt, flags, sid = _unpack_hdr(buf, 0)
                    length = lt >> 8
                    ftype = lt & 0xFF
                    sid &= MAX_STREAM_ID
                    self.frames_received += 1
                    self._check_header(ftype, flags, sid, length)
                    if ftype == DATA and not flags & FLAG_PADDED:
                        buf.clear()
                        self._start_data(sid, flags, length, events)
                        continue
                else:
                    lt, flags, sid = _unpack_hdr(buf, 0)
                    length = lt >> 8
                    ftype = lt & 0xFF
                    sid &= MAX_STREAM_ID
                need = 9 + length - len(buf)
                take = min(need, n - pos)
                if take:
                    buf += mv[pos : pos + take]
                    pos += take
                if take < need:
                    return
                payload = bytes(buf[9:])
                buf.clear()
                self._process_frame(ftype, flags, sid, payload, events)
                continue
            # Fast path: whole frames straight from the input.
            max_frame = self._local.max_frame_size
            small = COALESCE_MAX
            frames = self.frames_received  # (counted locally, stored at every way out)
            while True:
                avail = n - pos
                if avail < 9:
                    self.frames_received = frames
                    if avail:
                        if mv is None:
                            mv = memoryview(data)
                        buf += mv[pos:]
                    return
                lt, flags, sid = _unpack_hdr(data, pos)
                length = lt >> 8
                ftype = lt & 0xFF
                sid &= MAX_STREAM_ID
                frames += 1
                if length > max_frame or self._cont_sid or self._awaiting_settings:
                    self._check_header(ftype, flags, sid, length)
                end = pos + 9 + length
                if ftype == DATA and not flags & FLAG_PADDED:
                    st = self._begin_data(sid, length, events)
                    if end <= n:  # the whole frame is here: deliver it at once
                        if length:
                            if st is None:
                                self._release_conn(length)
                            else:
                                if mv is None:
                                    mv = memoryview(data)
                                st.unacked += length
                                if length <= small:
                                    self._join(sid, mv[pos + 9 : end], length, events)
                                else:
                                    if joined:
                                        joined.pop(sid, None)
                                    events.append(DataReceived(sid, mv[pos + 9 : end], length))
                        elif not flags & FLAG_END_STREAM:
                            self._spend_empty()
                        if st is not None and flags & FLAG_END_STREAM:
                            self._remote_end(st, events)
                        pos = end
                        continue
                    # The payload continues in later input: stream it as it arrives.
                    self.frames_received = frames
                    if joined:
                        joined.pop(sid, None)
                    pos += 9
                    self._data_remaining = length
                    self._data_stream = st
                    self._data_end = bool(flags & FLAG_END_STREAM)
                    break
                if end > n:
                    self.frames_received = frames
                    if mv is None:
                        mv = memoryview(data)
                    buf += mv[pos:]
                    return
                payload = bytes(data[pos + 9 : end])
                pos = end
                self._process_frame(ftype, flags, sid, payload, events)

    def _check_header(self, ftype: int, flags: int, sid: int, length: int) -> None:
        if length > self._local.max_frame_size:
            raise RemoteProtocolError(
                ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds MAX_FRAME_SIZE"
            )
        if self._cont_sid and (ftype != CONTINUATION or sid != self._cont_sid):
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "expected CONTINUATION")
        if self._awaiting_settings and (ftype != SETTINGS or flags & FLAG_ACK):
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "first frame is not SETTINGS")

    # -----------------------------------------------------------------------------------------
    # DATA

    def _start_data(self, sid: int, flags: int, length: int, events: list[Event]) -> None:
        st = self._begin_data(sid, length, events)
        if length:
            self._data_remaining = length
            self._data_stream = st
            self._data_end = bool(flags & FLAG_END_STREAM)
        elif not flags & FLAG_END_STREAM:
            self._spend_empty()
        elif st is not None:
            self._remote_end(st, events)

    def _begin_data(self, sid: int, length: int, events: list[Event]) -> _Stream | None:
        """Account a DATA frame of ``length`` bytes; the stream to deliver to, or None (discard:
        the bytes are released as they arrive)."""
        if sid == 0:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        window = self._conn_recv_window - length
        if window < 0:
            raise RemoteProtocolError(
                ErrorCode.FLOW_CONTROL_ERROR, "DATA exceeds the connection window"
            )
        self._conn_recv_window = window
        st = self._streams.get(sid)
        if st is None:
            self._on_missing_stream(sid, "DATA")
            return None
        if st.remote_closed:
            self._stream_error(st, ErrorCode.STREAM_CLOSED, events)
            return None
        if not st.headers_received:
            self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
            return None
        window = st.recv_window - length
        if window < 0:
            self._stream_error(st, ErrorCode.FLOW_CONTROL_ERROR, events)
            return None
        st.recv_window = window
        return st

    def _padded_data(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        length = len(payload)
        if not length or payload[0] >= length:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "padding exceeds the frame")
        size = length - 1 - payload[0]
        st = self._begin_data(sid, length, events)
        if st is None:
            self._release_conn(length)
            return
        if size:
            st.unacked += size
            if size <= COALESCE_MAX:
                self._join(sid, payload[1 : 1 + size], size, events)
            else:
                if self._joined:
                    self._joined.pop(sid, None)
                events.append(DataReceived(sid, payload[1 : 1 + size], size))
        # Padding is flow-controlled but never reaches the app: release it here.
        self._release_conn(length - size)
        if flags & FLAG_END_STREAM:
            self._remote_end(st, events)
        else:
            p = st.recv_pending + length - size
            if p >= self._stream_threshold:
                self._out.append(_FRAME_U32.pack(_WU_LT, 0, sid, p))
                st.recv_window += p
                p = 0
            st.recv_pending = p

    def _join(self, sid: int, chunk: Buffer, n: int, events: list[Event]) -> None:
        """Deliver a small DATA payload: joined to the stream's event of this call, if any."""
        ev = self._joined.get(sid)
        if ev is None:
            self._joined[sid] = ev = DataReceived(sid, chunk, n)
            events.append(ev)
            return
        data = ev.data
        if type(data) is not bytearray:
            data = ev.data = bytearray(data)  # (the first payload, a slice of the input)
        data += chunk
        ev.flow_controlled_length += n

    def _release_conn(self, n: int) -> None:
        p = self._conn_recv_pending + n
        if p >= self._conn_threshold:
            self._out.append(_FRAME_U32.pack(_WU_LT, 0, 0, p))
            self._conn_recv_window += p
            p = 0
        self._conn_recv_pending = p

    # -----------------------------------------------------------------------------------------
    # Other frames

    def _process_frame(
        self, ftype: int, flags: int, sid: int, payload: bytes, events: list[Event]
    ) -> None:
        if ftype == HEADERS:
            self._on_headers(flags, sid, payload, events)
            return
        if ftype == CONTINUATION:
            self._on_continuation(flags, sid, payload, events)
            return
        if ftype == DATA:
            self._padded_data(sid, flags, payload, events)
            return
        if ftype == WINDOW_UPDATE:
            wu = self._wu
            wu.left -= 1
            if wu.left < 0:
                wu.refill_or_raise()
            self._on_window_update(sid, payload, events)
            return
        # Everything else is a control frame: no payload for the app, work or a reply for us.
        ctl = self._ctl
        ctl.left -= 1
        if ctl.left < 0:
            ctl.refill_or_raise()
        if ftype == SETTINGS:
            self._on_settings(flags, sid, payload, events)
        elif ftype == PING:
            if sid:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PING is not 8 bytes")
            if flags & FLAG_ACK:
                events.append(PingAcked(payload))
            else:
                self._out.append(_pack_hdr(8 << 8 | PING, FLAG_ACK, 0) + payload)
                events.append(PingReceived(payload))
        elif ftype == RST_STREAM:
            self._on_rst_stream(sid, payload, events)
        elif ftype == GOAWAY:
            self._on_goaway(sid, payload, events)
        elif ftype == PRIORITY:
            self._on_priority(sid, payload, events)
        elif ftype == PUSH_PROMISE:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE (push is disabled)")
        # Unknown frame types are ignored (RFC 9113 4.1, 5.5), after counting them above.

    def _spend_empty(self) -> None:
        """A frame with no payload that does nothing (CVE-2019-9518)."""
        e = self._empty
        e.left -= 1
        if e.left < 0:
            e.refill_or_raise()

    def _spend_control(self, n: int = 1) -> None:
        c = self._ctl
        c.left -= n
        if c.left < 0:
            c.refill_or_raise()

    def _on_settings(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & FLAG_ACK:
            if payload:
                raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with payload")
            events.append(SettingsAcked())
            return
        if len(payload) % 6:
            raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length not 6n")
        if len(payload) // 6 > self._limits.max_settings_entries:
            raise RemoteProtocolError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"SETTINGS with more than {self._limits.max_settings_entries} entries",
            )
        if len(payload) >= 48:
            self._spend_control(len(payload) // 48)  # one unit per 8 entries, beyond the frame
        self._awaiting_settings = False
        remote = self._remote
        changed: dict[int, int] = {}
        # One pass over the entries (later ones win, RFC 9113 6.5.3); the resulting
        # INITIAL_WINDOW_SIZE change is applied to the streams once, after the loop.
        old_window = remote.initial_window_size
        for off in range(0, len(payload), 6):
            ident, value = _SETTING.unpack_from(payload, off)
            if ident == SettingCode.HEADER_TABLE_SIZE:
                remote.header_table_size = value
                # We may use a smaller table than allowed (we never add to it), but a change of
                # its size must be signalled at the start of the next block (RFC 7541 4.2).
                size = min(value, _DEFAULT_HEADER_TABLE)
                if size != self._header_table_size:
                    self._header_table_size = size
                    # Only the smallest and the last matter (RFC 7541 4.2): at most two.
                    u = self._table_size_updates
                    low = min([*u, size])
                    u[:] = [size] if low == size else [low, size]
            elif ident == SettingCode.ENABLE_PUSH:
                if value > 1 or (self.client and value):
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad ENABLE_PUSH")
                remote.enable_push = value
            elif ident == SettingCode.MAX_CONCURRENT_STREAMS:
                remote.max_concurrent_streams = value
            elif ident == SettingCode.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise RemoteProtocolError(
                        ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large"
                    )
                remote.initial_window_size = value
            elif ident == SettingCode.MAX_FRAME_SIZE:
                if not MIN_MAX_FRAME_SIZE <= value <= MAX_MAX_FRAME_SIZE:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                remote.max_frame_size = value
                self._send_frame = min(self._send_frame_pref, value)
            elif ident == SettingCode.MAX_HEADER_LIST_SIZE:
                remote.max_header_list_size = value
            elif ident == SettingCode.ENABLE_CONNECT_PROTOCOL:
                if value > 1:
                    raise RemoteProtocolError(
                        ErrorCode.PROTOCOL_ERROR, "bad ENABLE_CONNECT_PROTOCOL"
                    )
                remote.enable_connect_protocol = value
            else:
                continue  # unknown settings are ignored
            changed[ident] = value
        delta = remote.initial_window_size - old_window
        if delta:
            # Touching every stream is work the peer did not pay for: charge it.
            self._spend_control(len(self._streams) // 16)
            for st in self._streams.values():
                w = st.send_window + delta
                if w > MAX_WINDOW:
                    raise RemoteProtocolError(
                        ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow"
                    )
                st.send_window = w
                if delta > 0 and not st.local_closed:
                    events.append(WindowUpdated(st.sid, delta))
        self._out.append(_pack_hdr(SETTINGS, FLAG_ACK, 0))
        events.append(
            RemoteSettingsChanged(
                remote.max_concurrent_streams,
                remote.initial_window_size,
                remote.max_frame_size,
                changed,
            )
        )

    def _on_window_update(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        inc = _U32.unpack(payload)[0] & MAX_WINDOW
        if sid == 0:
            if not inc:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            w = self._conn_send_window + inc
            if w > MAX_WINDOW:
                raise RemoteProtocolError(
                    ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow"
                )
            self._conn_send_window = w
            events.append(WindowUpdated(0, inc))
            return
        st = self._streams.get(sid)
        if st is None:
            if self._is_idle(sid):
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on idle stream")
            return  # closed streams: late updates are harmless
        if not inc:
            self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
            return
        w = st.send_window + inc
        if w > MAX_WINDOW:
            self._stream_error(st, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        st.send_window = w
        if not st.local_closed:
            events.append(WindowUpdated(sid, inc))

    def _on_rst_stream(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM is not 4 bytes")
        if sid == 0:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        st = self._streams.get(sid)
        if st is None:
            if self._is_idle(sid):
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on idle stream")
            return
        code = as_error_code(_U32.unpack(payload)[0])
        if not st.local and not st.headers_sent:
            # Reset before we answered: the rapid-reset pattern (CVE-2023-44487).
            e = self._early_rst
            e.left -= 1
            if e.left < 0:
                e.refill_or_raise()
        self._close_stream(st, _RESET_REMOTE)
        events.append(StreamReset(sid, code, True))

    def _on_goaway(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
        last, code = _GOAWAY_HEAD.unpack_from(payload)
        last &= MAX_STREAM_ID
        self._goaway_received = True
        self._peer_goaway_last = min(self._peer_goaway_last, last)
        events.append(GoAwayReceived(last, as_error_code(code), payload[8:]))
        for st in [s for s in self._streams.values() if s.local and s.sid > last]:
            self._close_stream(st, _RESET_REMOTE)
            events.append(StreamReset(st.sid, ErrorCode.REFUSED_STREAM, True))

    def _on_priority(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        st = self._streams.get(sid)
        if len(payload) != 5:
            if st is None:
                raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY is not 5 bytes")
            self._stream_error(st, ErrorCode.FRAME_SIZE_ERROR, events)
        elif _U32.unpack_from(payload)[0] & MAX_STREAM_ID == sid:
            if st is None:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "stream depends on itself")
            self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
        # Otherwise ignored: RFC 9113 deprecates the priority scheme.

    # -----------------------------------------------------------------------------------------
    # Header blocks

    def _on_headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        start = 0
        end = len(payload)
        if flags & FLAG_PADDED:
            if not end:
                raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short")
            end -= payload[0]
            start = 1
        self_dep = False
        if flags & FLAG_PRIORITY:
            if len(payload) < start + 5:
                raise RemoteProtocolError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short")
            self_dep = _U32.unpack_from(payload, start)[0] & MAX_STREAM_ID == sid
            start += 5
        if end < start:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "padding exceeds the frame")
        fragment = payload[start:end]
        if flags & FLAG_END_HEADERS:
            self._on_header_block(sid, fragment, flags, self_dep, events)
        else:
            if not fragment:
                self._spend_empty()
            self._cont_sid = sid
            self._cont_block = bytearray(fragment)
            self._cont_flags = flags
            self._cont_self_dep = self_dep
            self._cont_frames = 0

    def _on_continuation(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not self._cont_sid:  # (a CONTINUATION for another stream fails _check_header)
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "unexpected CONTINUATION")
        block = self._cont_block
        block += payload
        if len(block) > self._max_block:
            raise RemoteProtocolError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        # CVE-2024-27316: a bounded number of CONTINUATION frames per block, and empty ones
        # count as empty frames.
        self._cont_frames += 1
        if self._cont_frames > self._limits.max_continuations:
            raise RemoteProtocolError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"more than {self._limits.max_continuations} CONTINUATION frames in a header block",
            )
        if not payload and not flags & FLAG_END_HEADERS:
            self._spend_empty()
        if flags & FLAG_END_HEADERS:
            self._cont_sid = 0
            self._cont_block = bytearray()
            self._on_header_block(sid, bytes(block), self._cont_flags, self._cont_self_dep, events)

    def _on_header_block(
        self, sid: int, block: bytes, flags: int, self_dep: bool, events: list[Event]
    ) -> None:
        # Decode first, whatever happens to the stream: the HPACK context is connection-wide.
        try:
            raw: Iterable[tuple[bytes, bytes]] | None = _decode_literal_block(
                block, self._hard_header_list
            )
            if raw is None:
                raw = self._decoder.decode(block, raw=True)
        except Exception as exc:
            raise RemoteProtocolError(
                ErrorCode.COMPRESSION_ERROR, f"HPACK decoding failed: {exc}"
            ) from exc
        end_stream = bool(flags & FLAG_END_STREAM)
        st = self._streams.get(sid)
        if st is None:
            if not self._is_idle(sid):
                self._on_missing_stream(sid, "HEADERS", unknown_is_fatal=True)
                return
            if self.client or (sid & 1) == self._local_parity:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on idle {sid}")
            self._new_remote_stream(sid, raw, end_stream, self_dep, events)
            return
        if self_dep:
            self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
            return
        if st.remote_closed:
            self._stream_error(st, ErrorCode.STREAM_CLOSED, events)
            return
        limit = self._local.max_header_list_size
        if self.client and not st.headers_received:
            try:
                pseudo, headers, size = _split_fields(raw, _RESPONSE_PSEUDO)
                status_raw = pseudo.get(b":status")
                if status_raw is None or not _STATUS.match(status_raw):
                    raise _Malformed("missing or invalid :status")
                status = int(status_raw)
                if status == 101 or (status < 200 and end_stream):
                    raise _Malformed(f"status {status} is not allowed here")
                if limit is not None and size > limit:
                    raise _Malformed("header list too large")
            except _Malformed:
                self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
                return
            if status < 200:
                return  # informational responses are not surfaced
            st.headers_received = True
            events.append(ResponseReceived(sid, status, headers))
        else:
            # Trailers: must end the stream and carry no pseudo-headers.
            try:
                if not end_stream:
                    raise _Malformed("second header block without END_STREAM")
                _, headers, size = _split_fields(raw, frozenset())
                if limit is not None and size > limit:
                    raise _Malformed("header list too large")
            except _Malformed:
                self._stream_error(st, ErrorCode.PROTOCOL_ERROR, events)
                return
            events.append(TrailersReceived(sid, headers))
        if end_stream:
            self._remote_end(st, events)

    def _new_remote_stream(
        self,
        sid: int,
        raw: Iterable[tuple[bytes, bytes]],
        end_stream: bool,
        self_dep: bool,
        events: list[Event],
    ) -> None:
        self._highest_remote = sid
        rst = _FRAME_U32.pack
        if self_dep:
            self._out.append(rst(_RST_LT, 0, sid, ErrorCode.PROTOCOL_ERROR))
            self._remember_closed(sid, _RESET_LOCAL)
            return
        limit = self._local.max_concurrent_streams
        if len(self._held) >= self._limits.held_streams:
            # Streams closed on the wire whose work goes on do not count against the peer's
            # concurrency (RFC 9113 5.1.2), but against this budget of their own.
            raise RemoteProtocolError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"flood: more than {self._limits.held_streams} closed streams still at work",
            )
        if (self._goaway_sent and sid > self._goaway_last) or (
            limit is not None and self._remote_open >= limit
        ):
            self._spend_control()  # a reply we queue for nothing
            self._out.append(rst(_RST_LT, 0, sid, ErrorCode.REFUSED_STREAM))
            self._remember_closed(sid, _RESET_LOCAL)
            return
        try:
            pseudo, headers, size = _split_fields(raw, _REQUEST_PSEUDO)
            method = pseudo.get(b":method")
            if not method:
                raise _Malformed("missing :method")
            hlimit = self._local.max_header_list_size
            if hlimit is not None and size > hlimit:
                raise _Malformed("header list too large")
        except _Malformed:
            self._spend_control()
            self._out.append(rst(_RST_LT, 0, sid, ErrorCode.PROTOCOL_ERROR))
            self._remember_closed(sid, _RESET_LOCAL)
            return
        st = _Stream(sid, False, self._remote.initial_window_size, self._local.initial_window_size)
        st.headers_received = True
        st.held = self._hold_streams
        self._streams[sid] = st
        self._remote_open += 1
        events.append(
            RequestReceived(
                sid,
                method.decode("utf-8", "surrogateescape"),
                _text(pseudo.get(b":authority")),
                headers,
                _text(pseudo.get(b":scheme")),
                _text(pseudo.get(b":path")),
            )
        )
        if end_stream:
            self._remote_end(st, events)

    def _send_header_block(
        self, sid: int, fields: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        # Literals, no Huffman coding: see _encode_block.
        block = _encode_block(fields, self._table_size_updates)
        self._table_size_updates.clear()
        mfs = self._remote.max_frame_size
        flags = FLAG_END_STREAM if end_stream else 0
        out = self._out
        if len(block) <= mfs:
            out.append(_pack_hdr(len(block) << 8 | HEADERS, flags | FLAG_END_HEADERS, sid) + block)
            return
        out.append(_pack_hdr(mfs << 8 | HEADERS, flags, sid) + block[:mfs])
        off = mfs
        while off < len(block):
            chunk = block[off : off + mfs]
            off += len(chunk)
            last = FLAG_END_HEADERS if off >= len(block) else 0
            out.append(_pack_hdr(len(chunk) << 8 | CONTINUATION, last, sid) + chunk)

    # -----------------------------------------------------------------------------------------
    # Stream bookkeeping

    def _is_idle(self, sid: int) -> bool:
        if (sid & 1) == self._local_parity:
            return sid >= self._next_sid
        return sid > self._highest_remote

    def _on_missing_stream(self, sid: int, kind: str, unknown_is_fatal: bool = False) -> None:
        """A DATA/HEADERS frame for a stream not in the table (RFC 9113 5.1, 5.1.1).

        ``unknown_is_fatal``: a HEADERS frame for a lower id than the highest seen that we have
        no record of is an attempt to open a stream out of order (PROTOCOL_ERROR).
        """
        if self._is_idle(sid):
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, f"{kind} on idle stream {sid}")
        reason = self._recent_closed.get(sid)
        if reason == _RESET_LOCAL:
            return  # frames in flight after our RST_STREAM are ignored
        if reason == _ENDED:
            raise RemoteProtocolError(
                ErrorCode.STREAM_CLOSED, f"{kind} on stream {sid} after END_STREAM"
            )
        if reason is None and unknown_is_fatal:
            raise RemoteProtocolError(
                ErrorCode.PROTOCOL_ERROR, f"{kind} on unexpected stream id {sid}"
            )
        self._spend_control()
        self._out.append(_FRAME_U32.pack(_RST_LT, 0, sid, ErrorCode.STREAM_CLOSED))
        self._remember_closed(sid, _RESET_LOCAL)

    def _stream_error(self, st: _Stream, code: int, events: list[Event]) -> None:
        self._spend_control()
        self._out.append(_FRAME_U32.pack(_RST_LT, 0, st.sid, code))
        self._close_stream(st, _RESET_LOCAL)
        events.append(StreamReset(st.sid, as_error_code(code), False))

    def _remote_end(self, st: _Stream, events: list[Event]) -> None:
        st.remote_closed = True
        events.append(StreamEnded(st.sid))
        if st.local_closed:
            self._close_stream(st, _ENDED)

    def _local_end(self, st: _Stream) -> None:
        st.local_closed = True
        if st.remote_closed:
            self._close_stream(st, _ENDED)

    def _close_stream(self, st: _Stream, reason: int) -> None:
        if st.closed:
            return
        st.closed = st.local_closed = st.remote_closed = True
        del self._streams[st.sid]
        if st.local:
            self._local_open -= 1
        else:
            self._remote_open -= 1
        if st.held:
            # Still counted, and what the app was given still owed, until release_stream.
            self._held[st.sid] = st.unacked
        elif st.unacked:
            self._release_conn(st.unacked)
        st.unacked = 0
        self._remember_closed(st.sid, reason)

    def _remember_closed(self, sid: int, reason: int) -> None:
        rc = self._recent_closed
        rc[sid] = reason
        if len(rc) > _CLOSED_MEMORY:
            del rc[next(iter(rc))]

    def _check_usable(self) -> None:
        if self._closed:
            raise LocalProtocolError(ErrorCode.PROTOCOL_ERROR, "connection is closed")
