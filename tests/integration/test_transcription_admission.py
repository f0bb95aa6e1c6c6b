"""Transcription sessions on a limit of their own (--max-transcription-sessions), over the real
app and engine (tiny model).

Pins, with max_sessions=1 and max_transcription_sessions=2:
- one conversation is admitted, a second gets 503 `capacity` naming the session limit, though
  no transcription session is open yet: transcription sessions do not share max_sessions;
- with the conversation open, two transcription sessions are admitted on the WebSocket, and a
  third gets 503 `capacity` naming the transcription limit (Retry-After); so does a WebRTC
  offer whose session part has type transcription;
- /metrics counts them apart: agent_transcription_sessions_active is 2 while they are open
  (agent_sessions_active counts all three), 0 once all are closed;
- the engine has a slot for each (max_sessions + max_transcription_sessions): both
  transcription sessions, speaking at once beside the open conversation, get their
  `…input_audio_transcription.completed`, and no `error` comes;
- with the limit unset (0, the default) a transcription session counts against max_sessions:
  the same agent config without it refuses it while a conversation holds the only slot;
- a conversation asking for input transcription with no engine slot left for it: `error` code
  `capacity` naming the parameter, every time it asks; its turns are still answered;
- a session admitted but not opened by the engine (fewer slots than admission allows, as when
  two offers pass admission at once): on the WebSocket it gets an `error` (code
  session_failed, naming the cause) and its socket is closed; a WebRTC offer is not answered
  but refused, 503 `capacity` naming the cause; the session before them goes on being served.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from openai import APIStatusError, AsyncOpenAI
from support.realtime_helpers import RunningAgent, metric, refused_upgrade, start_agent, wait_no_sessions
from support.realtime_ws import pcm24

from agent.client.client import AgentClient
from agent.engine.factory import build_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(tiny_model_dir: Path):
    running = await start_agent(
        tiny_model_dir, max_sessions=1, max_transcription_sessions=2, max_reply_seconds=1.0, max_reply_tokens=8
    )
    yield running
    await running.stop()


def ws_url(agent: RunningAgent, query: str = "") -> str:
    return agent.url.replace("http", "ws") + "/v1/realtime?model=x" + query


async def events_until(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout_s: float) -> list[dict]:
    seen: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while not seen or seen[-1]["type"] != kind:
        msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        seen.append(json.loads(msg.data))
    return seen


async def speak(ws: aiohttp.ClientWebSocketResponse, pcm: np.ndarray) -> None:
    """20 ms appends on the wall clock, then a second of silence (server VAD ends the turn)."""
    audio = np.concatenate([pcm, np.zeros(24_000, np.int16)])
    start = time.monotonic()
    for i, at in enumerate(range(0, len(audio), 480)):
        chunk = base64.b64encode(audio[at : at + 480].astype("<i2").tobytes()).decode()
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))


async def test_transcription_sessions_have_their_own_limit(agent: RunningAgent, speech_wav: Path) -> None:
    async with aiohttp.ClientSession() as http:
        conversation = await http.ws_connect(ws_url(agent))
        try:
            assert (await events_until(conversation, "session.created", 15))[-1]["type"] == "session.created"
            error = await refused_upgrade(http, ws_url(agent))
            assert error["code"] == "capacity" and "session limit reached (1)" in error["message"]

            captions = [await http.ws_connect(ws_url(agent, "&intent=transcription")) for _ in range(2)]
            try:
                for ws in captions:
                    created = (await events_until(ws, "session.created", 15))[-1]
                    assert created["session"]["type"] == "transcription"
                error = await refused_upgrade(http, ws_url(agent, "&intent=transcription"))
                assert error["code"] == "capacity" and "transcription session limit reached (2)" in error["message"]
                assert await metric(http, agent.url, "agent_transcription_sessions_active ") == 2
                assert await metric(http, agent.url, "agent_sessions_active{") == 3

                # WebRTC asks the same question: its offer is refused before any peer is made.
                sdk = AsyncOpenAI(
                    base_url=f"{agent.url}/v1", api_key="unused-on-an-open-agent", max_retries=0
                )  # a 503 is the answer

                async def signal(offer: str) -> tuple[str, str]:
                    raw = await sdk.realtime.calls.with_raw_response.create(
                        sdp=offer, session={"type": "transcription"}
                    )
                    return raw.text, raw.headers["location"]

                client = AgentClient(agent.url, speech_wav, video=False)
                try:
                    with pytest.raises(APIStatusError) as exc:
                        await client.connect(signal=signal)
                    assert exc.value.status_code == 503
                    assert "transcription session limit reached (2)" in exc.value.response.text
                finally:
                    await client.close()

                # Both have an engine slot: both transcribe a turn, spoken at the same time.
                pcm = pcm24(speech_wav)
                seen = await asyncio.gather(
                    *(asyncio.gather(speak(ws, pcm), events_until(ws, COMPLETED, 60)) for ws in captions)
                )
                for _, events in seen:
                    assert not [e for e in events if e["type"] == "error"], events
                    assert events[-1]["transcript"] is not None
            finally:
                for ws in captions:
                    await ws.close()
        finally:
            await conversation.close()
    await wait_no_sessions(agent.url, "closed sessions stayed open")
    async with aiohttp.ClientSession() as http:
        assert await metric(http, agent.url, "agent_transcription_sessions_active ") == 0


async def test_without_a_limit_transcription_sessions_share_max_sessions(tiny_model_dir: Path) -> None:
    shared = await start_agent(tiny_model_dir, max_sessions=1)
    try:
        async with aiohttp.ClientSession() as http:
            conversation = await http.ws_connect(ws_url(shared))
            try:
                await events_until(conversation, "session.created", 15)
                error = await refused_upgrade(http, ws_url(shared, "&intent=transcription"))
                assert error["code"] == "capacity" and "session limit reached (1)" in error["message"]
            finally:
                await conversation.close()
    finally:
        await shared.stop()


async def test_a_session_the_engine_cannot_open_ends_with_an_error(tiny_model_dir: Path, speech_wav: Path) -> None:
    # Admission lets in 2, the engine has 1 slot: the second session is admitted, then refused.
    short = await start_agent(
        tiny_model_dir, engine=lambda config: build_engine(replace(config, max_sessions=1)), max_sessions=2
    )
    try:
        async with aiohttp.ClientSession() as http:
            first = await http.ws_connect(ws_url(short))
            try:
                await events_until(first, "session.created", 15)
                second = await http.ws_connect(ws_url(short))
                events = await events_until(second, "error", 15)
                assert events[-1]["error"]["code"] == "session_failed", events
                assert "slots are in use" in events[-1]["error"]["message"]
                msg = await second.receive(timeout=5)  # then the server closes the socket
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg

                sdk = AsyncOpenAI(base_url=f"{short.url}/v1", api_key="unused-on-an-open-agent", max_retries=0)

                async def signal(offer: str) -> tuple[str, str]:
                    raw = await sdk.realtime.calls.with_raw_response.create(sdp=offer)
                    return raw.text, raw.headers["location"]

                client = AgentClient(short.url, speech_wav, video=False)
                try:
                    with pytest.raises(APIStatusError) as exc:
                        await client.connect(signal=signal)
                    assert exc.value.status_code == 503 and exc.value.response.headers.get("Retry-After")
                    assert "could not open" in exc.value.response.text and "slots are in use" in exc.value.response.text
                finally:
                    await client.close()
                # The first session is untouched: it still answers a client event.
                await first.send_str(
                    json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
                )
                updated = (await events_until(first, "session.updated", 15))[-1]
                assert updated["session"]["instructions"] == "Be brief."
            finally:
                await first.close()
        await wait_no_sessions(short.url, "the failed session stayed open")
    finally:
        await short.stop()


async def test_a_conversation_without_a_slot_for_its_transcription_hears_capacity(
    tiny_model_dir: Path, speech_wav: Path
) -> None:
    """A conversation transcribes in a cache slot of its own; with the engine's only slot held by
    the conversation itself, asking for input transcription gets an `error` with code
    `capacity` naming the parameter, the conversation goes on (its turn is answered, no
    transcript events), and the same session.update again is refused again: the session did not
    go on believing it transcribes (it would have asked the engine nothing the second time)."""
    single = await start_agent(tiny_model_dir, max_sessions=1, max_reply_seconds=1.0, max_reply_tokens=8)
    transcribe = {"type": "realtime", "audio": {"input": {"transcription": {"model": "thinker"}}}}
    try:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url(single))
            try:
                await events_until(ws, "session.created", 15)
                for _ in range(2):
                    await ws.send_str(json.dumps({"type": "session.update", "session": transcribe}))
                    error = (await events_until(ws, "error", 15))[-1]["error"]
                    assert error["code"] == "capacity", error
                    assert error["param"] == "session.audio.input.transcription", error
                    assert "slots are in use" in error["message"], error
                await speak(ws, pcm24(speech_wav))
                events = await events_until(ws, "response.done", 60)
                assert not [e for e in events if e["type"].startswith("conversation.item.input_audio_transcription")]
                assert not [e for e in events if e["type"] == "error"], events
            finally:
                await ws.close()
    finally:
        await single.stop()
