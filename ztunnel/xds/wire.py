"""Reading istiod's delta responses without holding two copies of a snapshot.

A full snapshot is one ``DeltaDiscoveryResponse``: 200,000 pods make about 80 MiB on the wire,
and parsing it whole into protobuf objects costs as much again. :class:`LazyDeltaResponse`
keeps only the bytes: its top-level fields are found by walking the wire format once, and each
``Resource`` is parsed when it is reached, then dropped. :func:`recv_bounded` refuses a message
over the size Rust accepts (200 MiB, ``src/xds/client.rs`` ``max_decoding_message_size``)
before reading its body, so a hostile istiod cannot make us buffer more.

Pure but for :func:`recv_bounded`, which reads from a grpclib stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from google.protobuf.message import DecodeError

from ztunnel.xds.protos import discovery_pb2 as ds

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_RESOURCE_BYTES",
    "LazyDeltaResponse",
    "MessageTooLarge",
    "TooLargeResource",
    "recv_bounded",
]

MAX_MESSAGE_BYTES = 200 << 20  # Rust's max_decoding_message_size
# One resource (a Workload, Service or Authorization): far above any real one (a pod is a few
# hundred bytes), so a resource this big is refused alone, with a NACK naming it.
MAX_RESOURCE_BYTES = 1 << 20

# DeltaDiscoveryResponse field numbers (envoy/service/discovery/v3/discovery.proto).
_SYSTEM_VERSION_INFO, _RESOURCES, _TYPE_URL, _NONCE, _REMOVED = 1, 2, 4, 5, 6


class MessageTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"xDS message of {size} bytes is larger than the {limit} allowed")
        self.size = size


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    shift = 0
    value = 0
    while True:
        if i >= len(data):
            raise DecodeError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


class TooLargeResource:
    """Stands for a resource over :data:`MAX_RESOURCE_BYTES` (never parsed): its name, for the
    NACK."""

    __slots__ = ("name", "size")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size


class LazyDeltaResponse:
    """The fields of a ``DeltaDiscoveryResponse``; ``resources`` yields each ``Resource``
    parsed on demand (a :class:`TooLargeResource` for one over the limit)."""

    __slots__ = ("_data", "_spans", "nonce", "removed_resources", "system_version_info", "type_url")

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._spans: list[tuple[int, int]] = []
        self.type_url = ""
        self.nonce = ""
        self.system_version_info = ""
        self.removed_resources: list[str] = []
        self._walk()

    def _walk(self) -> None:
        data = self._data
        i, n = 0, len(data)
        while i < n:
            tag, i = _varint(data, i)
            field, wire = tag >> 3, tag & 7
            if wire == 2:
                length, i = _varint(data, i)
                end = i + length
                if end > n:
                    raise DecodeError("truncated field")
                if field == _RESOURCES:
                    self._spans.append((i, end))
                elif field in (_TYPE_URL, _NONCE, _SYSTEM_VERSION_INFO, _REMOVED):
                    text = bytes(data[i:end]).decode("utf-8", "strict")
                    if field == _TYPE_URL:
                        self.type_url = text
                    elif field == _NONCE:
                        self.nonce = text
                    elif field == _SYSTEM_VERSION_INFO:
                        self.system_version_info = text
                    else:
                        self.removed_resources.append(text)
                i = end
            elif wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:
                raise DecodeError(f"unsupported wire type {wire}")
        if i != n:
            raise DecodeError("truncated field")

    @property
    def resources(self) -> _Resources:
        return _Resources(self)


class _Resources:
    __slots__ = ("_resp",)

    def __init__(self, resp: LazyDeltaResponse) -> None:
        self._resp = resp

    def __len__(self) -> int:
        return len(self._resp._spans)

    def __iter__(self) -> Iterator[Any]:
        data = self._resp._data
        for start, end in self._resp._spans:
            if end - start > MAX_RESOURCE_BYTES:
                yield TooLargeResource(_resource_name(data[start:end]), end - start)
                continue
            yield ds.Resource.FromString(data[start:end])


def _resource_name(data: memoryview) -> str:
    """The ``name`` (field 3) of a serialized Resource, found by stepping over its top-level
    fields (a few, whatever their size: nothing is parsed or copied but the name)."""
    try:
        i, n = 0, len(data)
        while i < n:
            tag, i = _varint(data, i)
            field, wire = tag >> 3, tag & 7
            if wire == 2:
                length, i = _varint(data, i)
                if field == 3:
                    return bytes(data[i : i + min(length, 512)]).decode("utf-8", "replace")
                i += length
            elif wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:
                return ""
    except DecodeError:
        pass
    return ""


async def recv_bounded(stream: Any, limit: int = MAX_MESSAGE_BYTES) -> LazyDeltaResponse | None:
    """The next DeltaDiscoveryResponse of a grpclib client stream (None once it ended), read as
    grpclib's ``Stream.recv_message`` reads it but refusing a body over ``limit`` bytes before
    reading it (grpclib has no limit of its own). Uses grpclib's stream internals (pinned:
    grpclib < 0.5); the xDS tests run it against a real grpclib server."""
    if not stream._recv_initial_metadata_done:
        await stream.recv_initial_metadata()
    with stream._wrapper:
        h2_stream = stream._stream
        meta = await h2_stream.recv_data(5)
        if not meta:
            return None
        if meta[0]:
            raise DecodeError("compressed xDS messages are not supported")
        size = int.from_bytes(meta[1:5], "big")
        if size > limit:
            raise MessageTooLarge(size, limit)
        body = await h2_stream.recv_data(size)
        if len(body) != size:
            raise DecodeError(f"truncated message: {len(body)} of {size} bytes")
        stream._messages_received += 1
        h2_stream.connection.messages_received += 1
        h2_stream.connection.last_message_received = time.monotonic()
        return LazyDeltaResponse(body)
