"""Shared by the tests (imported, not a test): a raw WebSocket client that asks for a lot and
never reads, what no client library lets a test be: a socket with a small receive buffer, so
the agent's writes to it back up (its transport pauses)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct


def _frame(event: dict) -> bytes:
    """A masked text frame (a client's), 64-bit length form."""
    payload, mask = json.dumps(event).encode(), os.urandom(4)
    head = b"\x81" + bytes([0x80 | 127]) + struct.pack(">Q", len(payload))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def stalled_client(url: str, query: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Opens GET /v1/realtime?{query} on `url` (http://host:port), then sends a 100 KB item
    and 60 retrievals of it (6 MB of answers) that it never reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        (
            f"GET /v1/realtime?{query} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: realtime\r\n"
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n\r\n"
        ).encode()
    )
    if b" 101 " not in await reader.readuntil(b"\r\n\r\n"):
        raise AssertionError("the WebSocket was not accepted")
    text = {"type": "input_text", "text": "x" * 100_000}
    item = {"id": "item_big", "type": "message", "role": "user", "content": [text]}
    writer.write(_frame({"type": "conversation.item.create", "item": item}))
    for _ in range(60):
        writer.write(_frame({"type": "conversation.item.retrieve", "item_id": "item_big"}))
    await writer.drain()
    return reader, writer
