"""The worker channel: frames in order, fds with their frame, big frames, EOF."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from ztunnel.workers.ipc import Channel, ChannelClosed

pytestmark = [pytest.mark.timeout(20), pytest.mark.both_loops]


async def _pair() -> tuple[Channel, Channel, asyncio.Queue[tuple[Any, list[int]]], asyncio.Event]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: asyncio.Queue[tuple[Any, list[int]]] = asyncio.Queue()
    closed = asyncio.Event()
    ca = Channel(a, lambda m, f: None)
    cb = Channel(b, lambda m, f: got.put_nowait((m, f)), closed.set)
    return ca, cb, got, closed


async def test_messages_in_order_with_their_fds() -> None:
    ca, cb, got, _ = await _pair()
    r, w = os.pipe()
    ca.send(("first", 1))
    ca.send(("with-fd", 2), [w])
    os.close(w)  # the channel sent a duplicate: ours may go at once
    ca.send(("last", 3))
    m1, f1 = await got.get()
    m2, f2 = await got.get()
    m3, f3 = await got.get()
    assert (m1, f1, m3, f3) == (("first", 1), [], ("last", 3), [])
    assert m2 == ("with-fd", 2) and len(f2) == 1
    os.write(f2[0], b"through the passed fd")
    assert os.read(r, 100) == b"through the passed fd"
    os.close(f2[0])
    os.close(r)
    ca.close()
    cb.close()


async def test_a_frame_larger_than_the_socket_buffers() -> None:
    ca, cb, got, _ = await _pair()
    big = os.urandom(8 << 20)
    ca.send(big)
    ca.send("after")
    assert ca.pending_bytes > 0  # queued, written as the peer reads
    assert (await got.get())[0] == big
    assert (await got.get())[0] == "after"
    ca.close()
    cb.close()


async def test_peer_close_is_reported_and_sending_fails() -> None:
    ca, cb, _, closed = await _pair()
    ca.close()
    await asyncio.wait_for(closed.wait(), 5)
    with pytest.raises(ChannelClosed):
        cb.send("nobody")
