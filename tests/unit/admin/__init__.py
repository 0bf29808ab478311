"""Tests for ztunnel.admin, plus a tiny raw HTTP/1.1 client shared by them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> RawResponse:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    length = 0 if head_only else int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return RawResponse(status, headers, body)


async def request(
    port: int,
    method: str = "GET",
    target: str = "/",
    *,
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> RawResponse:
    """One request on a fresh connection, ``Connection: close``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        hdrs = {"Host": "localhost", "Connection": "close", **(headers or {})}
        raw = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
        writer.write((raw + "\r\n").encode())
        await writer.drain()
        return await read_response(reader, head_only=method == "HEAD")
    finally:
        writer.close()
        await writer.wait_closed()
