"""The tools of a session sent over HTTP (POST /v1/realtime/client_secrets; an offer's session
part takes the same path, agent/transport/http.py `check_tools_off_loop`) are checked on the
decode pool, not on the event loop that paces every call's audio.

Pins: while a key request with a long tool list is checked, the loop goes on running other work
(counted: handled on the loop, it ran none until the answer); the key's session carries the
tools; the pool's CPU is counted as agent_thread_cpu_seconds_total{thread="decode"}; a bad
schema in the list is a 400 naming it (`session.tools[i].parameters`); a transcription session
has no tools and ignores them, bad ones included, as it always has.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from agent.config import Config
from agent.engine.api import Voices
from agent.server import create_app


class IdleEngine:
    """What the app's start-up and shutdown touch; a key request needs no model."""

    ready = True
    voices = Voices()  # (none known: a key's voice is not checked against them)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def _tools(count: int, bad_at: int | None = None) -> list[dict[str, Any]]:
    enum = {"type": "string", "enum": ["a", "b", "c"]}
    nested = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number"}}}}
    tools = [
        {
            "type": "function",
            "name": f"lookup_{i}",
            "parameters": {"type": "object", "properties": {f"p{j}": enum if j % 2 else nested for j in range(12)}},
        }
        for i in range(count)
    ]
    if bad_at is not None:
        tools[bad_at]["parameters"]["properties"]["p0"] = {"type": 5}
    return tools


async def test_a_key_requests_tools_are_checked_off_the_loop() -> None:
    app = create_app(Config(), engine=IdleEngine())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        ticks = 0

        async def count() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        counter = asyncio.ensure_future(count())
        await asyncio.sleep(0)
        start = ticks
        response = await client.post("/v1/realtime/client_secrets", json={"session": {"tools": _tools(60)}})
        counter.cancel()
        body = await response.json()
        assert response.status == 200, body
        assert len(body["session"]["tools"]) == 60
        # The check takes hundreds of ms: on a pool thread the loop spins through it.
        assert ticks - start > 50, ticks - start

        # The pool's threads are counted apart in the CPU metric (thread="decode").
        metrics = await (await client.get("/metrics")).text()
        decode = [
            line for line in metrics.splitlines() if line.startswith('agent_thread_cpu_seconds_total{thread="decode"}')
        ]
        assert decode and float(decode[0].split()[-1]) > 0.05, decode

        response = await client.post("/v1/realtime/client_secrets", json={"session": {"tools": _tools(30, 21)}})
        body = await response.json()
        assert response.status == 400 and body["error"]["param"] == "session.tools[21].parameters", body

        part = {"type": "transcription", "tools": [{"type": "mcp", "server_label": "x"}]}
        response = await client.post("/v1/realtime/client_secrets", json={"session": part})
        body = await response.json()
        assert response.status == 200 and "tools" not in body["session"], body
