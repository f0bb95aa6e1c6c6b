"""The caption routes on an agent started with an API key (agent/transport/captions_http.py).

Pins, with real offers answered by the agent (throwaway peers that never connect: the calls
exist from their 201 until hung up):
- GET /v1/omni/calls/latest/events: no key or a wrong key → 401 JSON; with the API key an SSE
  stream that says `omni.call.waiting` with no call, `omni.call.started` with the call id when a
  call is answered (one made with an ephemeral key too: minted from the API key), and
  `omni.call.ended` then `omni.call.waiting` when it is hung up; one opened with an ephemeral
  key follows the calls made with that key only;
- a finished call: its events route answers 410 (`call_ended`), its captions.vtt 200 `text/vtt`
  starting with WEBVTT; an unknown id 404 (`call_not_found`) on both; captions.vtt needs the key
  like every /v1/realtime route (401); once the book has let a call go, captions.vtt is 410.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from support.realtime_helpers import RunningAgent, module_agent, offer_sdp

from agent.transport.captions_http import CAPTIONS

pytestmark = pytest.mark.asyncio(loop_scope="module")
API_KEY = "sk-omni-captions-key"
READ_S = 10.0  # every SSE read is bounded

agent = module_agent(api_key=API_KEY, max_reply_tokens=4, max_reply_seconds=0.5)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _next_event(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The next `data:` event of an SSE stream (keep-alive comments skipped)."""
    while True:
        line = await asyncio.wait_for(resp.content.readline(), READ_S)
        assert line, "the stream ended"
        if line.startswith(b"data:"):
            return json.loads(line[5:])


async def _no_event(resp: aiohttp.ClientResponse, within_s: float = 1.0) -> bool:
    """Whether no `data:` event comes within `within_s`."""
    try:
        await asyncio.wait_for(_next_event(resp), within_s)
    except asyncio.TimeoutError:
        return True
    return False


async def _mint(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/v1/realtime/client_secrets", json={}, headers=_auth(API_KEY)) as resp:
        assert resp.status == 200
        return (await resp.json())["value"]


async def _call(http: aiohttp.ClientSession, url: str, key: str) -> str:
    async with http.post(
        f"{url}/v1/realtime/calls", data=await offer_sdp(), headers={"Content-Type": "application/sdp", **_auth(key)}
    ) as resp:
        assert resp.status == 201, await resp.text()
        return resp.headers["Location"].rsplit("/", 1)[-1]


async def _hangup(http: aiohttp.ClientSession, url: str, call_id: str) -> None:
    async with http.delete(f"{url}/v1/realtime/calls/{call_id}", headers=_auth(API_KEY)) as resp:
        assert resp.status == 204


async def test_latest_needs_a_key(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        for headers in ({}, _auth("sk-wrong"), _auth("ek_00_11")):
            async with http.get(f"{agent.url}/v1/omni/calls/latest/events", headers=headers) as resp:
                assert resp.status == 401 and resp.content_type == "application/json"
                assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_latest_follows_calls_in_its_scope(agent: RunningAgent) -> None:
    url = f"{agent.url}/v1/omni/calls/latest/events"
    async with aiohttp.ClientSession() as http:
        ek_a, ek_b = await _mint(http, agent.url), await _mint(http, agent.url)
        async with (
            http.get(url, headers=_auth(API_KEY)) as api,
            http.get(url, headers=_auth(ek_b)) as other,
        ):
            assert api.status == 200 and api.content_type == "text/event-stream"
            assert await _next_event(api) == {"type": "omni.call.waiting"}
            assert await _next_event(other) == {"type": "omni.call.waiting"}
            call = await _call(http, agent.url, ek_a)
            try:
                assert await _next_event(api) == {"type": "omni.call.started", "call_id": call}
                assert await _no_event(other)  # another ephemeral key's call
                async with http.get(url, headers=_auth(ek_a)) as mine:
                    assert await _next_event(mine) == {"type": "omni.call.started", "call_id": call}
            finally:
                await _hangup(http, agent.url, call)
            assert await _next_event(api) == {"type": "omni.call.ended", "call_id": call}
            assert await _next_event(api) == {"type": "omni.call.waiting"}


async def test_a_finished_call_is_gone_and_keeps_its_captions(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        call = await _call(http, agent.url, API_KEY)
        vtt = f"{agent.url}/v1/realtime/calls/{call}/captions.vtt"
        async with http.get(vtt, headers=_auth(API_KEY)) as resp:  # a running call has its captions too
            assert resp.status == 200 and resp.content_type == "text/vtt"
        await _hangup(http, agent.url, call)
        async with http.get(f"{agent.url}/v1/realtime/calls/{call}/events", headers=_auth(API_KEY)) as resp:
            assert resp.status == 410
            assert (await resp.json())["error"]["code"] == "call_ended"
        async with http.get(vtt, headers=_auth(API_KEY)) as resp:
            assert resp.status == 200 and resp.content_type == "text/vtt" and resp.charset == "utf-8"
            assert (await resp.text()).startswith("WEBVTT\n")
        async with http.get(vtt) as resp:
            assert resp.status == 401
        for route in ("events", "captions.vtt"):
            async with http.get(f"{agent.url}/v1/realtime/calls/rtc_unknown/{route}", headers=_auth(API_KEY)) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "call_not_found"
        book = agent.app[CAPTIONS]
        keep = book.keep_s
        book.keep_s = -1.0  # every finished call is past its time now
        try:
            async with http.get(vtt, headers=_auth(API_KEY)) as resp:
                assert resp.status == 410
                body = await resp.json()
                assert body["error"]["code"] == "call_ended" and "no longer kept" in body["error"]["message"]
        finally:
            book.keep_s = keep
