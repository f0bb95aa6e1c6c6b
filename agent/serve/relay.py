"""ASGI → the replica's own aiohttp app: Serve's ingress speaks ASGI, the agent speaks aiohttp.

Each replica runs the unchanged aiohttp application (agent/server.py: handlers, auth
middleware, admission) on a private Unix socket, and this bridge relays every request the
Serve proxy hands it: the request as it came, the response streamed back chunk by chunk (so
SSE stays live), WebSockets both ways. No handler exists twice; the bridge only adds what is
about *replicas*: a follow-up for another replica's call is answered 410 at once (its owner is
gone, since the router sends follow-ups to a live owner), and a new call may be refused by
the replica's gate (draining, offer rate) before it reaches the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import aiohttp

from agent.serve.ownership import REPLICA_HEADER, is_offer, owner_from_request

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# Per hop, not per message (RFC 9110 §7.6.1): never relayed.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "proxy-connection", "te"}


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str
    retry_after_s: Optional[int] = None

    def body(self) -> bytes:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return json.dumps({"error": {"message": self.message, "type": kind, "code": self.code, "param": None}}).encode()


class _OfferInFlight:
    """One offer in its bridge's `offers_in_flight`, from the `with` until answered() or the
    block's end, whichever comes first (a refused or failed offer counts no longer either)."""

    def __init__(self, bridge: "AsgiBridge") -> None:
        self._bridge = bridge
        self._pending = False

    def __enter__(self) -> "_OfferInFlight":
        self._bridge.offers_in_flight += 1
        self._pending = True
        return self

    def answered(self) -> None:
        if self._pending:
            self._pending = False
            self._bridge.offers_in_flight -= 1

    def __exit__(self, *exc: object) -> None:
        self.answered()


class AsgiBridge:
    """An ASGI app relaying to the aiohttp app listening on `socket_path`."""

    def __init__(self, socket_path: str, replica_id: str, gate: Callable[[], Optional[Refusal]]) -> None:
        self.replica_id = replica_id
        self._gate = gate
        self.offers_in_flight = 0  # offers past the gate whose answer has not come back yet
        self._socket_path = socket_path
        self._http: Optional[aiohttp.ClientSession] = None

    def _session(self) -> aiohttp.ClientSession:
        # Created lazily so it belongs to the loop the requests arrive on (the replica's user loop).
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self._socket_path),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
        elif kind == "http":
            await self._http_request(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)

    def _refusal(self, scope: Scope) -> Optional[Refusal]:
        path = scope.get("path", "")
        owner = owner_from_request(path, scope.get("query_string", b""), scope.get("headers", []))
        if owner is not None and owner != self.replica_id:
            return Refusal(
                410, "the replica this request names is gone (its calls ended with it); start a new call", "call_gone"
            )
        if scope["type"] == "http" and is_offer(scope.get("method", ""), path):
            return self._gate()
        return None

    def _target(self, scope: Scope) -> str:
        path = scope.get("raw_path") or scope.get("path", "/").encode()
        if isinstance(path, bytes):
            path = path.decode("latin-1")
        query = scope.get("query_string", b"").decode("latin-1")
        return f"http://replica{path}" + (f"?{query}" if query else "")

    def _headers(self, scope: Scope) -> list[tuple[str, str]]:
        return [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope.get("headers", [])
            if k.decode("latin-1").lower() not in _HOP_BY_HOP
        ]

    async def _http_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope)
        if refusal is not None:
            await self._send_refusal(refusal, send)
            return
        if not is_offer(scope.get("method", ""), scope.get("path", "")):
            await self._relay(scope, receive, send, on_answer=None)
            return
        # An offer counts as a call from here until its answer comes back (the call's session
        # counts from its answer on): the router's view of this replica is never short of it.
        with _OfferInFlight(self) as offer:
            await self._relay(scope, receive, send, on_answer=offer.answered)

    async def _relay(self, scope: Scope, receive: Receive, send: Send, on_answer: Optional[Callable[[], None]]) -> None:
        body = bytearray()
        while True:  # bodies are small (an SDP offer, a JSON object): read whole
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with self._session().request(
            scope["method"],
            self._target(scope),
            headers=self._headers(scope),
            data=bytes(body) if body else None,
            allow_redirects=False,
        ) as resp:
            if on_answer is not None:
                on_answer()
            headers = [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in resp.headers.items()
                if k.lower() not in _HOP_BY_HOP
            ]
            headers.append((REPLICA_HEADER.encode(), self.replica_id.encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            # Chunk by chunk, as they come: an SSE stream must not wait for a buffer to fill.
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_refusal(self, refusal: Refusal, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (REPLICA_HEADER.encode(), self.replica_id.encode())]
        if refusal.retry_after_s is not None:
            headers.append((b"retry-after", str(refusal.retry_after_s).encode()))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": refusal.body(), "more_body": False})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()  # websocket.connect
        if first["type"] != "websocket.connect":
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await send({"type": "websocket.close", "code": 4000 + refusal.status, "reason": refusal.message})
            return
        protocols = scope.get("subprotocols") or ()
        try:
            upstream = await self._session().ws_connect(
                self._target(scope), headers=self._headers(scope), protocols=protocols, autoping=True
            )
        except aiohttp.WSServerHandshakeError as exc:
            # The handler refused (auth, capacity): say so as an HTTP status, as aiohttp would.
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": exc.status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "websocket.http.response.body", "body": exc.message.encode(), "more_body": False})
            return
        await send(
            {
                "type": "websocket.accept",
                "subprotocol": upstream.protocol,
                "headers": [(REPLICA_HEADER.encode(), self.replica_id.encode())],
            }
        )

        async def downstream() -> None:
            async for msg in upstream:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await send({"type": "websocket.send", "text": msg.data})
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await send({"type": "websocket.send", "bytes": msg.data})
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})

        relay = asyncio.ensure_future(downstream())
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is not None:
                    await upstream.send_str(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send_bytes(message["bytes"])
        finally:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay
            await upstream.close()


async def _lifespan(receive: Receive, send: Send) -> None:
    # The replica starts and stops the agent itself (agent/serve/replica.py); nothing to do here.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
