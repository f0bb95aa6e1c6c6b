"""server_vad's idle_timeout_ms through the official `openai` SDK over the WebSocket (tiny model).

Pins: with the client streaming silence in real time, a reply that has been heard (its audio
deltas played out at real-time pace) is followed, once the silence reaches idle_timeout_ms, by
`input_audio_buffer.timeout_triggered` (its audio_end_ms - audio_start_ms the timeout, on the
input clock, past the reply's audio), then `input_audio_buffer.committed` of the same item and a
response to it; nothing is refused and every event validates against the SDK's GA models. The
timer does not run before the first reply, and a session asking for it under semantic_vad, or
with a value out of range, is refused naming the field.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import ask_text, sdk_session, stream_realtime

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent(max_reply_seconds=1.0, max_reply_tokens=8)
TIMEOUT_MS = 1500


async def test_a_heard_reply_then_silence_prompts_a_reply(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": TIMEOUT_MS}}},
            }
        )
        updated = await ev.wait("session.updated", 10)
        assert updated["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == TIMEOUT_MS
        silence = asyncio.ensure_future(stream_realtime(conn, np.zeros(24_000 * 12, np.int16), tail_silence_s=0))
        try:
            await asyncio.sleep(2.0)  # silence before any reply: no timeout
            assert not ev.of("input_audio_buffer.timeout_triggered")
            await ask_text(conn, "Say something.")
            first = await ev.wait("response.done", 60)
            fired = await ev.wait("input_audio_buffer.timeout_triggered", 20)
            committed = await ev.wait("input_audio_buffer.committed", 10, after=ev.all.index(fired))
            second = await ev.wait("response.done", 60, after=ev.all.index(committed))
        finally:
            silence.cancel()
    assert not ev.of("error"), ev.of("error")
    assert fired["audio_end_ms"] - fired["audio_start_ms"] in range(TIMEOUT_MS, TIMEOUT_MS + 81)
    assert committed["item_id"] == fired["item_id"]
    # A reply of its own, run to its end (this agent caps replies at 8 tokens: `incomplete`).
    assert second["response"]["id"] != first["response"]["id"]
    assert second["response"]["status"] in ("completed", "incomplete"), second["response"]["status_details"]
    # The count began once the first reply's audio had been played out, not when it was made.
    stats = (first["response"].get("omni") or {}).get("stats") or {}
    audio_s = (stats.get("audio_samples") or 0) / 24_000
    deltas = ev.of("response.output_audio.delta")
    assert deltas and fired["_t"] - deltas[0]["_t"] >= audio_s + TIMEOUT_MS / 1000 - 0.2


@pytest.mark.parametrize(
    "turn_detection, message",
    [
        ({"type": "semantic_vad", "idle_timeout_ms": 5000}, "server_vad only"),
        ({"type": "server_vad", "idle_timeout_ms": 10}, "1000..600000"),
    ],
)
async def test_an_idle_timeout_it_cannot_serve_is_refused(
    agent: RunningAgent, strict_event, turn_detection: dict, message: str
) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": turn_detection}}})
        error = await ev.wait("error", 10)
    assert error["error"]["param"] == "session.audio.input.turn_detection.idle_timeout_ms"
    assert message in error["error"]["message"]
