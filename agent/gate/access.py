"""Who may reach the agent, and how often: cross-origin access and a per-address call rate.

Both are off the loopback default's path: with no `--cors-origin` the agent sends no CORS
headers at all (a page must come from the agent's own origin), and the call rate only bites
a client that opens calls faster than a person could.
"""

from __future__ import annotations

import re
import time
from collections import deque
from typing import Awaitable, Callable, Optional

from aiohttp import web

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_WINDOW_S = 60.0
_BASE_HEADERS = ("Authorization", "Content-Type", "OpenAI-Beta")
_BASE_LOWER = frozenset(h.lower() for h in _BASE_HEADERS)
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")  # an HTTP token (RFC 9110)


class CallRate:
    """New calls per client address over the last minute (a sliding window).

    `admit(address)` counts the call and returns None, or refuses it and returns the seconds
    until that address may call again. Addresses idle for a minute are forgotten, so the
    table is bounded by the addresses active in the last minute.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._calls: dict[str, deque[float]] = {}
        self._next_sweep = 0.0

    def admit(self, address: str) -> Optional[float]:
        if self.per_minute <= 0:
            return None
        now = self._clock()
        self._sweep(now)
        calls = self._calls.setdefault(address, deque())
        while calls and now - calls[0] >= _WINDOW_S:
            calls.popleft()
        if len(calls) >= self.per_minute:
            return max(1.0, _WINDOW_S - (now - calls[0]))
        calls.append(now)
        return None

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _WINDOW_S
        for address in [a for a, calls in self._calls.items() if not calls or now - calls[-1] >= _WINDOW_S]:
            del self._calls[address]


def cors_middleware(origins: tuple[str, ...]) -> Callable:
    """CORS for exactly these origins ("*" for any): preflights answered, headers on replies.
    Requests from other origins get no CORS headers, so browsers keep their pages out."""
    allowed = set(origins)
    methods = "GET, POST, DELETE, OPTIONS"

    def allow(origin: Optional[str]) -> Optional[str]:
        if origin is None:
            return None
        if "*" in allowed:
            return "*"
        return origin if origin in allowed else None

    @web.middleware
    async def cors(request: web.Request, handler: _Handler) -> web.StreamResponse:
        origin = allow(request.headers.get("Origin"))
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if origin is None:
                return web.json_response(
                    {
                        "error": {
                            "message": "origin not allowed",
                            "type": "invalid_request_error",
                            "code": "cors_forbidden",
                            "param": None,
                        }
                    },
                    status=403,
                )
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": methods,
                    "Access-Control-Allow-Headers": _allowed_headers(
                        request.headers.get("Access-Control-Request-Headers", "")
                    ),
                    "Access-Control-Max-Age": "600",
                    "Vary": "Origin",
                },
            )
        response = await handler(request)
        if origin is not None and not response.prepared:  # SSE/WebSocket: headers already sent
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Location, Retry-After"
            response.headers["Vary"] = "Origin"
        return response

    return cors


def _allowed_headers(requested: str) -> str:
    """The preflight's allowed headers: ours, and those the page asks for when they are plain
    header names. SDKs add their own (the openai SDK's x-stainless-*, the Agents SDK's
    x-openai-agents-sdk); a fixed list would make the browser refuse every call they make.
    The allowed origins are the gate, not the header names, so reflecting them opens nothing."""
    names = [n.strip() for n in requested.split(",") if n.strip()][:64]
    extra = [n for n in names if _HEADER_NAME.match(n) and n.lower() not in _BASE_LOWER]
    return ", ".join([*_BASE_HEADERS, *extra])
