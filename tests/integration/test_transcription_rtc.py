"""A transcription-only WebRTC call: the offer's session part has `type: "transcription"`.

Pins, with a real aiortc peer (agent.client.client.AgentClient) and the official SDK's calls.create:
- the answer sends no audio back (its audio section is recvonly) and no audio arrives;
- the user's turn is transcribed (input_audio_transcription.delta/completed on the data
  channel, after speech_stopped for the completed) and never answered: no response.* and no
  output_audio_buffer.* events;
- every event validates strictly against the SDK's GA models.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from support.realtime_helpers import RunningAgent, module_agent, wait_no_sessions

from agent.client.client import AgentClient

pytestmark = pytest.mark.asyncio(loop_scope="module")


agent = module_agent(max_reply_seconds=1.0, max_reply_tokens=8)


async def test_transcription_call(agent: RunningAgent, speech_wav: Path, strict_events) -> None:
    sdk = AsyncOpenAI(base_url=f"{agent.url}/v1", api_key="unused-on-an-open-agent")
    answers: list[str] = []

    async def signal(offer: str) -> tuple[str, str]:
        raw = await sdk.realtime.calls.with_raw_response.create(sdp=offer, session={"type": "transcription"})
        answers.append(raw.text)
        return raw.text, raw.headers["location"]

    client = AgentClient(agent.url, speech_wav, video=False)
    try:
        await client.connect(signal=signal)
        created = await client.wait_event("session.created", 10)
        assert created["session"]["type"] == "transcription"
        done = await client.wait_event("conversation.item.input_audio_transcription.completed", 90)
        await asyncio.sleep(1.0)  # anything that would follow the turn (a reply) has had time to start
        await sdk.realtime.calls.hangup(client.result.call_id)
        await wait_no_sessions(agent.url, "hangup left the session open")
    finally:
        await client.close()
    r = client.result
    types = strict_events(r.events)
    assert not r.of_type("error"), r.of_type("error")
    audio = answers[0].split("m=audio", 1)[1].split("m=", 1)[0]
    assert "a=recvonly" in audio, audio
    assert r.audible_samples == 0
    assert not [t for t in types if t.startswith("response.") or t.startswith("output_audio_buffer.")], types
    stopped = r.of_type("input_audio_buffer.speech_stopped")[0]
    assert done["item_id"] == stopped["item_id"]
    assert types.index("input_audio_buffer.speech_stopped") < types.index(done["type"])
