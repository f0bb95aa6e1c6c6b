"""Live input transcription over the WebSocket transport, with the `openai` SDK and the tiny model.

Pins (the tiny model's words are random: the protocol and the prefix property, not words):
- a transcription session (GET /v1/realtime?intent=transcription) that asked for the project's
  extra events (`omni.events: true`) streaming a ~4 s utterance in real time gets partials (conversation.item.input_audio_transcription.delta, or the extra
  omni.input_audio_transcription.partial when no new text became stable) *before*
  input_audio_buffer.speech_stopped, each partial's `omni.text` starts with the previous
  partial's stable prefix (`omni.stable_chars`, never shrinking), no delta is empty, the
  deltas add up to the `completed` transcript, which comes after speech_stopped for the same
  item;
- that session sends no response.* event and no audio at all, refuses response.create, and
  keeps transcribing turn after turn (the item holds its transcript on retrieve);
- a conversation session with `audio.input.transcription` set transcribes its user turns as
  well as answering them, and a text turn after a spoken one gets no transcript events (its
  spoken item keeps its one transcript); without it, none of these events come; a WebSocket session that did
  not ask for the extra events never gets omni.input_audio_transcription.partial;
- a user item committed with no response asked (server VAD with create_response false, or a
  manual commit) gets its `completed` transcript with no response at all; a response.create
  after a manual commit is answered with no second `completed`;
- with speculative start on (the default), a turn answered by a committed speculation keeps
  its transcript: the deltas, non-empty, add up to the non-empty `completed` transcript;
- every event validates strictly against the SDK's GA models.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import Events, ask_text, b64, pcm24, stream_realtime
from support.speech import espeak_at, write_wav

pytestmark = pytest.mark.asyncio(loop_scope="module")
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
PARTIAL = "omni.input_audio_transcription.partial"  # a hypothesis with no new stable text


@pytest.fixture(scope="module")
def long_speech(tmp_path_factory) -> Path:
    """About 4 s of English speech, 16 kHz mono."""
    raw = tmp_path_factory.mktemp("speech4") / "raw.wav"
    text = "Good evening everyone, welcome to the live caption test of this small agent today."
    pcm = espeak_at(text, raw, 16000, speed=160)
    n = len(pcm)
    out = write_wav(raw.with_name("speech4.wav"), pcm, 16000)
    assert 3.0 < n / 16000 < 6.0
    return out


agent = module_agent(max_reply_seconds=1.0, max_reply_tokens=8)


async def connect(agent: RunningAgent, strict, **query: str):
    client = AsyncOpenAI(base_url=f"{agent.url}/v1", api_key="unused-on-an-open-agent")
    manager = client.realtime.connect(model="qwen3-omni", extra_query=query)
    conn = await manager.__aenter__()
    return manager, conn, Events(conn, strict)


def check_partials(events: list[dict[str, Any]], item_id: str) -> dict[str, Any]:
    """The prefix property over one item's events; returns its completed event."""
    partials = [e for e in events if e["type"] in (DELTA, PARTIAL) and e["item_id"] == item_id]
    deltas = [e for e in partials if e["type"] == DELTA]
    completed = [e for e in events if e["type"] == COMPLETED and e["item_id"] == item_id]
    assert len(completed) == 1
    stable, appended = "", ""
    for e in partials:
        text, n = e["omni"]["text"], e["omni"]["stable_chars"]
        assert text.startswith(stable) and n >= len(stable) and n <= len(text)
        stable = text[:n]
        if e["type"] == DELTA:
            assert e["delta"], "an empty delta"
            appended += e["delta"]
        assert stable.startswith(appended) or e is deltas[-1]  # deltas are stable text only
    assert appended == completed[0]["transcript"]
    assert completed[0]["transcript"].startswith(stable)
    return completed[0]


async def test_transcription_session(agent: RunningAgent, long_speech: Path, strict_event) -> None:
    manager, conn, ev = await connect(agent, strict_event, intent="transcription")
    try:
        created = await ev.wait("session.created")
        assert created["session"]["type"] == "transcription"
        assert created["session"]["audio"]["input"]["transcription"] is not None
        await conn.send({"type": "session.update", "session": {"type": "transcription", "omni": {"events": True}}})
        assert (await ev.wait("session.updated"))["session"]["omni"]["events"] is True
        for _turn in range(2):
            start = len(ev.all)
            await stream_realtime(conn, pcm24(long_speech), tail_silence_s=1.2)
            stopped = await ev.wait("input_audio_buffer.speech_stopped", after=start)
            item_id = stopped["item_id"]
            done = await ev.wait(COMPLETED, after=start, timeout=60)
            assert done["item_id"] == item_id
            events = ev.all[start:]
            at_stop = events.index(stopped)
            early = [e for e in events[:at_stop] if e["type"] in (DELTA, PARTIAL) and e["item_id"] == item_id]
            assert len(early) >= 2, [e["type"] for e in events]  # partials while speaking
            assert events.index(done) > at_stop
            check_partials(events, item_id)
        await conn.send({"type": "conversation.item.retrieve", "item_id": item_id})
        item = (await ev.wait("conversation.item.retrieved"))["item"]
        assert item["content"][0]["transcript"] == done["transcript"]
        await conn.send({"type": "response.create", "event_id": "ask"})
        error = await ev.wait("error", where=lambda e: e["error"]["event_id"] == "ask")
        assert error["error"]["code"] == "unsupported"
        await asyncio.sleep(0.5)
        kinds = {e["type"] for e in ev.all}
        assert not {k for k in kinds if k.startswith("response.") or k.startswith("output_audio")}, kinds
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)


async def test_conversation_with_input_transcription(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    manager, conn, ev = await connect(agent, strict_event)
    try:
        await ev.wait("session.created")
        await stream_realtime(conn, pcm24(speech_wav), tail_silence_s=1.0)
        await ev.wait("response.done")
        assert not ev.of(DELTA) and not ev.of(PARTIAL) and not ev.of(COMPLETED)  # not asked for
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}}
        )
        await ev.wait("session.updated")
        start = len(ev.all)
        await stream_realtime(conn, pcm24(speech_wav), tail_silence_s=1.0)
        stopped = await ev.wait("input_audio_buffer.speech_stopped", after=start)
        await ev.wait(COMPLETED, after=start, timeout=60)
        await ev.wait("response.done", after=start)
        check_partials(ev.all[start:], stopped["item_id"])
        assert not ev.of(PARTIAL), "an extra event type on a WebSocket that did not ask for it"
        # A text turn after it transcribes nothing: the spoken item keeps its one transcript
        # (each text turn sent that item's transcription again, with new words).
        start = len(ev.all)
        await ask_text(conn, "And in writing?")
        await ev.wait("response.done", after=start)
        assert not [e for e in ev.all[start:] if e["type"] in (DELTA, COMPLETED)]
        assert len([e for e in ev.all if e["type"] == COMPLETED and e["item_id"] == stopped["item_id"]]) == 1
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)


async def test_a_speculated_turn_keeps_its_transcript(agent: RunningAgent, long_speech: Path, strict_event) -> None:
    manager, conn, ev = await connect(agent, strict_event)
    try:
        await ev.wait("session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": {}}}})
        await ev.wait("session.updated")
        await stream_realtime(conn, pcm24(long_speech), tail_silence_s=1.2)
        stopped = await ev.wait("input_audio_buffer.speech_stopped")
        completed = await ev.wait(COMPLETED, timeout=60)
        done = await ev.wait("response.done")
        assert done["response"]["omni"]["stats"]["speculative"] is True, "the turn was not answered speculatively"
        deltas = [e["delta"] for e in ev.of(DELTA) if e["item_id"] == stopped["item_id"]]
        assert deltas, "no text became stable: the test would prove nothing"
        # (the bug: the committed speculation's turn was transcribed over, and completed came empty)
        assert completed["transcript"] and completed["transcript"].startswith("".join(deltas))
        check_partials(ev.all, stopped["item_id"])
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)


async def test_an_item_committed_without_a_response_is_transcribed(
    agent: RunningAgent, speech_wav: Path, strict_event
) -> None:
    manager, conn, ev = await connect(agent, strict_event)
    try:
        await ev.wait("session.created")
        vad = {"type": "server_vad", "create_response": False}
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"transcription": {}, "turn_detection": vad}}}
        )
        await ev.wait("session.updated")
        await stream_realtime(conn, pcm24(speech_wav), tail_silence_s=1.0)
        stopped = await ev.wait("input_audio_buffer.speech_stopped")
        completed = await ev.wait(COMPLETED, timeout=60)  # (it waited for a response before)
        assert completed["item_id"] == stopped["item_id"]
        check_partials(ev.all, stopped["item_id"])
        # Manual turns: the commit alone completes the item's transcript.
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await ev.wait("session.updated")
        start = len(ev.all)
        await conn.input_audio_buffer.append(audio=b64(pcm24(speech_wav)))
        await conn.input_audio_buffer.commit()
        committed = await ev.wait("input_audio_buffer.committed", after=start)
        completed = await ev.wait(COMPLETED, after=start, timeout=60)
        assert completed["item_id"] == committed["item_id"]
        assert abs(completed["usage"]["seconds"] - len(pcm24(speech_wav)) / 24_000) < 0.1  # the audio committed
        assert not [e for e in ev.all if e["type"].startswith("response.")], "nothing was asked to respond"
        start = len(ev.all)
        await conn.response.create()
        await ev.wait("response.done", after=start, timeout=60)
        await asyncio.sleep(0.5)
        assert not [e for e in ev.all[start:] if e["type"] == COMPLETED], "the item was transcribed once"
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)


async def test_bad_intent_is_refused(agent: RunningAgent) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{agent.url}/v1/realtime?intent=dictation") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "intent"


async def test_interpreter_preset(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    """omni.interpret_to over the SDK: the preset's instructions and no barge-in come back in
    session.updated, the engine takes the bounded context without error, and a turn is answered."""
    manager, conn, ev = await connect(agent, strict_event)
    try:
        await ev.wait("session.created")
        await conn.send({"type": "session.update", "session": {"type": "realtime", "omni": {"interpret_to": "French"}}})
        session = (await ev.wait("session.updated"))["session"]
        assert "French" in session["instructions"] and session["omni"]["interpret_to"] == "French"
        assert session["audio"]["input"]["turn_detection"]["interrupt_response"] is False
        await stream_realtime(conn, pcm24(speech_wav), tail_silence_s=1.0)
        await ev.wait("response.done")
        assert not ev.of("error"), ev.of("error")
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)
