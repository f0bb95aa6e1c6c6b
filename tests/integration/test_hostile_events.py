"""Hostile client events: each gets an `error` event, the session goes on, others are not held up.

Pins, over the WebSocket transport of a real agent (tiny model; WebRTC's data channel feeds
the same handler, tests/integration/test_agent_loopback.py sends it bad events too): non-JSON,
JSON that is not an event (answered with its event_id where it has one), unknown types,
wrong field types (an item id that is not a string or is past GA's 32
characters too), an event over the size limit (an append too, past its 15 MiB of audio: an
error, not the socket closed) and a binary frame each get an `error` event naming what was wrong, and the session then
answers a valid event; a flood far above `--max-events-per-s` is dropped past the limit and
reported in `rate_limited` errors (a few, not one per event), the flooding session still
works afterwards, and a second session's reply during the flood completes.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp
import pytest
import pytest_asyncio
from support.realtime_helpers import RunningAgent, start_agent

from agent.realtime import client_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

EVENTS_PER_S = 100
FLOOD = 5000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(tiny_model_dir: Path):
    running = await start_agent(
        tiny_model_dir, max_reply_seconds=1.0, max_reply_tokens=8, max_events_per_s=EVENTS_PER_S
    )
    yield running
    await running.stop()


class Ws:
    """A raw WebSocket client: what a hostile client can send, beyond what an SDK allows."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                event = json.loads(msg.data)
                event["_t"] = time.monotonic()
                self.events.append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, kind: str, timeout: float, after: int = 0, code: Optional[str] = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events[after:]:
                if event["type"] == kind and (code is None or event["error"]["code"] == code):
                    return event
            assert not self._task.done(), f"the socket closed: {[e['type'] for e in self.events]}"
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind} ({code}) in {[e['type'] for e in self.events[after:]]}")

    async def close(self) -> None:
        await self.ws.close()
        self._task.cancel()


async def _open(http: aiohttp.ClientSession, agent: RunningAgent) -> Ws:
    ws = Ws(await http.ws_connect(f"{agent.url}/v1/realtime?model=qwen3-omni", protocols=("realtime",)))
    await ws.wait("session.created", 10)
    return ws


BAD = [
    ("not JSON", "garbage", "invalid_json"),
    ("JSON array", "[1, 2]", "invalid_event"),
    ("type not a string", '{"type": 7}', "invalid_event"),
    ("unknown type", '{"type": "no.such.event"}', "unknown_event"),
    ("session not an object", '{"type": "session.update", "session": [1]}', "invalid_value"),
    ("modalities wrong", '{"type": "session.update", "session": {"output_modalities": ["smell"]}}', "invalid_value"),
    ("audio not a string", '{"type": "input_audio_buffer.append", "audio": 12}', "invalid_value"),
    ("audio not base64", '{"type": "input_audio_buffer.append", "audio": "!!!"}', "invalid_value"),
    ("item not an object", '{"type": "conversation.item.create", "item": "hi"}', "missing_required_parameter"),
    (
        "audio_end_ms a string",
        '{"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": "9"}',
        "invalid_value",
    ),
    (  # GA's limit on a client-chosen id (a UUID's 36 characters is too long there)
        "item id too long",
        '{"type": "conversation.item.create", "item": {"id": "'
        + "i" * 33
        + '", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}',
        "string_above_max_length",
    ),
    (
        "item id a number",
        '{"type": "conversation.item.create", "item": {"id": 7, "type": "message", "role": "user", '
        '"content": [{"type": "input_text", "text": "hi"}]}}',
        "invalid_type",
    ),
    ("response a list", '{"type": "response.create", "response": []}', "invalid_value"),
    ("max_output_tokens wrong", '{"type": "response.create", "response": {"max_output_tokens": -3}}', "invalid_value"),
    (
        "huge event",
        json.dumps({"type": "session.update", "session": {"instructions": "x" * 400_000}}),
        "event_too_large",
    ),
    (  # past the 15 MiB of audio an append may carry, within what the socket reads: an error, not a close
        "huge append",
        '{"type": "input_audio_buffer.append", "audio": "' + "A" * (client_events.MAX_MESSAGE_CHARS + 4096) + '"}',
        "event_too_large",
    ),
]


async def test_bad_events_get_errors_and_the_session_goes_on(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        ws = await _open(http, agent)
        try:
            for what, text, code in BAD:
                mark = len(ws.events)
                await ws.ws.send_str(text)
                error = await ws.wait("error", 10, after=mark)
                assert error["error"]["code"] == code, f"{what}: {error}"
                print(f"  {what}: {code}: {error['error']['message'][:80]}")
            mark = len(ws.events)
            await ws.ws.send_str('{"event_id": "evt_no_type", "session": {}}')  # answered with its event_id
            error = (await ws.wait("error", 10, after=mark))["error"]
            assert (error["code"], error["event_id"], error["param"]) == ("invalid_event", "evt_no_type", "type")
            mark = len(ws.events)
            await ws.ws.send_bytes(b"\x00\x01binary")
            assert (await ws.wait("error", 10, after=mark))["error"]["code"] == "invalid_event"
            mark = len(ws.events)
            await ws.ws.send_str(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
            updated = await ws.wait("session.updated", 10, after=mark)
            assert updated["session"]["instructions"] == "Be brief."
        finally:
            await ws.close()
    print(f"\nevents: {len(BAD) + 1} bad events, {len(BAD) + 1} error events, session still answering")


async def test_a_flood_is_rate_limited_and_slows_no_one(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        flooder, other = await _open(http, agent), await _open(http, agent)
        try:
            # The other session's text turn, alone, then again during the flood.
            durations = []
            for flood in (False, True):
                mark = len(other.events)
                started = time.monotonic()
                await other.ws.send_str(
                    json.dumps(
                        {
                            "type": "conversation.item.create",
                            "item": {
                                "type": "message",
                                "role": "user",
                                "content": [{"type": "input_text", "text": "Hello."}],
                            },
                        }
                    )
                )
                await other.ws.send_str(
                    json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}})
                )
                if flood:
                    # An empty append does nothing and answers nothing: only the limit can speak.
                    noop = json.dumps({"type": "input_audio_buffer.append", "audio": ""})
                    for i in range(FLOOD):
                        await flooder.ws.send_str(noop)
                        if i % 500 == 0:
                            await asyncio.sleep(0)
                done = await other.wait("response.done", 60, after=mark)
                durations.append(time.monotonic() - started)
                assert done["response"]["status"] in ("completed", "incomplete"), done
            limited = await flooder.wait("error", 10, code="rate_limited")
            assert "a second" in limited["error"]["message"]
            # The flooding session still works once it sends at a sane rate.
            await asyncio.sleep(1.0)  # the bucket refills: a second's worth
            mark = len(flooder.events)
            await flooder.ws.send_str(json.dumps({"type": "session.update", "session": {"instructions": "Hi."}}))
            await flooder.wait("session.updated", 10, after=mark)
            errors = flooder.of("error")
            dropped = sum(
                int(e["error"]["message"].rsplit(": ", 1)[1].split()[0])
                for e in errors
                if e["error"]["code"] == "rate_limited"
            )
        finally:
            await flooder.close()
            await other.close()
    print(
        f"\nflood: {FLOOD} events at a limit of {EVENTS_PER_S}/s: {len(errors)} rate_limited errors reporting "
        f"{dropped} dropped; other session's turn {durations[0]:.2f} s alone, {durations[1]:.2f} s during the flood"
    )
    assert len(errors) <= 10, "a flood must not be answered event for event"
    assert dropped >= FLOOD // 2
    # Wide: the flood costs the loop a JSON parse per event at most, never seconds.
    assert durations[1] < 3 * durations[0] + 5.0
