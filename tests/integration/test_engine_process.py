"""The engine in a child process (`--engine-process`, agent/engine/process.py), tiny model.

Pins:
- the agent serves as with the engine thread: over the WebSocket (official `openai` SDK) a text
  turn gets transcript and audio deltas and a completed response.done; a required tool call
  arrives as a function_call item; a command the engine refuses (an assistant message after
  images not yet answered) comes back as an `error` naming the field; response.cancel mid-reply ends it as cancelled; the voices the
  child's runner offers reach the parent (GET /v1/omni/config lists the tiny model's speakers);
- over WebRTC (an aiortc peer) a spoken turn is answered with audible audio on the track;
- the child's CPU counts as `engine` in agent_thread_cpu_seconds_total, and the runners' own
  counters (speculation outcomes) reach the parent's /metrics;
- the child killed: /healthz fails, and a session whose reply was in flight gets its end
  (response.done failed with the reason), the process itself goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import ask_text, png_url, sdk_session

from agent.client.client import AgentClient
from agent.engine.process import ProcessEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent(max_reply_seconds=2.0, max_reply_tokens=12, engine_process=True)

LIGHT = {
    "type": "function",
    "name": "set_light",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
}


async def test_websocket_turns_through_the_process(agent: RunningAgent, strict_event) -> None:
    assert isinstance(agent.engine, ProcessEngine) and agent.engine.pid != os.getpid()
    async with aiohttp.ClientSession() as http, http.get(f"{agent.url}/v1/omni/config") as resp:
        config = await resp.json()
    assert config["voices"] == ["aiden", "chelsie", "ethan"] and config["default_voice"] == "ethan", config
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        mark = len(ev.all)
        await ask_text(conn, "Hello there.")
        done = await ev.wait("response.done", 60, after=mark)
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        rid = done["response"]["id"]
        assert [e for e in ev.all[mark:] if e["type"] == "response.output_audio.delta" and e["response_id"] == rid]
        assert [e for e in ev.all[mark:] if e["type"] == "response.output_audio_transcript.delta"]

        mark = len(ev.all)
        await ask_text(conn, "Lights on.", tools=[LIGHT], tool_choice="required")
        done = await ev.wait("response.done", 60, after=mark)
        assert [o["type"] for o in done["response"]["output"]] == ["function_call"], done["response"]

        # Refused in the child (an assistant message cannot follow images not yet answered):
        # the error comes back naming the field, and the item is withdrawn.
        mark = len(ev.all)
        picture = {"type": "input_image", "image_url": png_url(np.zeros((32, 32, 3), np.uint8))}
        await conn.send(
            {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [picture]}}
        )
        said = {"type": "output_text", "text": "A picture."}
        await conn.send(
            {"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [said]}}
        )
        error = await ev.wait("error", 10, after=mark)
        assert error["error"]["param"] == "item" and "images" in error["error"]["message"], error
        await ev.wait("conversation.item.deleted", 10, after=mark)

        mark = len(ev.all)
        await ask_text(conn, "Tell me a long story.")
        await ev.wait("response.output_audio.delta", 60, after=mark)
        await conn.response.cancel()
        done = await ev.wait("response.done", 30, after=mark)
        assert done["response"]["status"] == "cancelled"


async def test_webrtc_turn_and_engine_cpu(agent: RunningAgent, speech_wav: Path) -> None:
    client = AgentClient(agent.url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("response.done", 90)
        for _ in range(100):
            if client.result.audible_samples >= 12_000:
                break
            await asyncio.sleep(0.1)
        assert client.result.audible_samples >= 12_000
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{agent.url}/metrics") as resp:
            text = await resp.text()
    engine = [line for line in text.splitlines() if line.startswith('agent_thread_cpu_seconds_total{thread="engine"}')]
    assert engine and float(engine[0].split()[-1]) > 0.5, engine
    # The runners' own counters reach the parent's /metrics (the turn's end started a speculation).
    started = [
        line for line in text.splitlines() if line.startswith('agent_speculative_replies_total{outcome="started"}')
    ]
    assert started and float(started[0].split()[-1]) >= 1, started


async def test_a_dead_engine_process_is_reported(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        mark = len(ev.all)
        await ask_text(conn, "Tell me a long story.")
        await ev.wait("response.created", 30, after=mark)
        os.kill(agent.engine.pid, signal.SIGKILL)
        done = await ev.wait("response.done", 30, after=mark)
        assert done["response"]["status"] == "failed" and "engine process died" in str(done["response"]), done
        async with aiohttp.ClientSession() as http:
            for _ in range(50):
                async with http.get(f"{agent.url}/healthz") as resp:
                    if resp.status != 200:
                        break
                await asyncio.sleep(0.1)
            assert resp.status != 200
