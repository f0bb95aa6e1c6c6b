"""Barge-in truncates the reply to what was heard, over real aiortc peers on loopback.

Pins: when the user speaks over a spoken reply (WebRTC), the agent announces
`input_audio_buffer.speech_started`, then the reply's cancelled `response.done`, then
`conversation.item.truncated` for that reply, and the session's KV slot then holds exactly the
reply tokens of the frames the track had played (one text token per codec frame: the talker
reads reply token i for frame i), the assistant turn closed after them; checked by the tokens
in the slot (StreamingRunner.context), not by timing. And when the engine is behind (its thread
held), a truncation of the running reply and the next response.create, both queued behind the
reply's cancel, cut that reply and then answer: the truncated event, the next reply's
response.done, and no `error` event (the truncation used to wait for the cancelled reply's end
to come back and land behind the next reply's begin, refused; the begin replaced the cancelled
reply unended).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.engine_hold import HeldEngine, Hold
from support.realtime_helpers import long_replies_engine, start_agent, talker_never_ends

from agent.client.client import AgentClient, WsAgentClient
from agent.config import CODEC_FRAME_SAMPLES
from agent.engine.commands import Context
from agent.transport.http import SESSIONS


async def test_barge_in_keeps_only_the_heard_words(tiny_model_dir: Path, speech_wav: Path, strict_events) -> None:
    # Speculation off: one reply per turn, started at the end of the turn (the simplest timeline).
    # Echo guard's level rule off: this client plays espeak speech quieter than the tiny model's
    # voice and never plays the reply back (the guard has its own tests: test_echo_rtc.py).
    # Replies run to their 4 s cap: a random talker ending after a second would leave nothing to cut.
    agent = await start_agent(
        tiny_model_dir,
        engine=long_replies_engine,
        max_sessions=1,
        max_reply_tokens=48,
        max_reply_seconds=4.0,
        speculative_start=False,
        echo_guard=False,
    )
    client = AgentClient(agent.url, speech_wav, video=False)
    try:
        await client.connect()
        created = await client.wait_event("session.created", timeout=30)
        await client.wait_event("output_audio_buffer.started", timeout=60)
        # From here the server VAD still interrupts but creates no reply: the barge-in speech
        # must not start a reply of its own before the slot is inspected (a state race on a
        # loaded machine, not something to skip on).
        client.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {
                        "input": {
                            "turn_detection": {
                                "type": "server_vad",
                                "create_response": False,
                                "interrupt_response": True,
                            }
                        }
                    },
                },
            }
        )
        updated = await client.wait_event("session.updated", timeout=30)
        assert updated["session"]["audio"]["input"]["turn_detection"]["create_response"] is False
        for _ in range(100):  # some of the reply is heard, far from all of it (4 s)
            if client.result.audible_samples > 0.4 * 48000:
                break
            await asyncio.sleep(0.05)
        client.audio.play()  # talk over it
        truncated = await client.wait_event("conversation.item.truncated", timeout=30)
        context = await agent.engine.send(created["session"]["id"], Context())
    finally:
        await client.close()
        await agent.stop()
    r = client.result
    strict_events(r.events)
    assert truncated["item_id"] == r.of_type("response.output_item.added")[0]["item"]["id"]
    heard_frames = truncated["audio_end_ms"] // 80
    assert heard_frames > 0
    # The cause before what it does (OpenAI's order): the barge-in's speech_started, then the
    # reply's cancelled response.done.
    kinds = [e["type"] for e in r.events]
    cancelled = next(i for i, e in enumerate(r.events) if kinds[i] == "response.done")
    assert r.events[cancelled]["response"]["status"] == "cancelled"
    assert "input_audio_buffer.speech_started" in kinds[kinds.index("response.created") : cancelled], kinds
    last = context["last_reply"]
    assert last is not None, "the truncated reply is not the session's latest"
    # One reply token per heard frame (the reply had more: 48 tokens, up to 4 s of audio).
    assert len(last["tokens"]) == heard_frames < 48
    # The slot holds the history up to the reply, then the heard tokens the thinker had fed;
    # the other heard tokens and <|im_end|> come right after them, with the next user turn.
    assert not context["replying"], "no reply may start: create_response is off"
    end = last["start_length"] + last["fed"]
    if context["turn_start_length"] is not None:  # the barge-in speech is being prefilled
        assert context["turn_start_length"] == end
    else:
        assert context["thinker_length"] == end
        assert context["closing"][: heard_frames - last["fed"]] == last["tokens"][last["fed"] :]


async def test_truncate_and_next_reply_queued_behind_a_cancel_on_a_busy_engine(tiny_model_dir: Path, speech_wav: Path):
    held = HeldEngine(wrap=talker_never_ends)
    agent = await start_agent(
        tiny_model_dir, engine=held, max_sessions=1, max_reply_tokens=48, max_reply_seconds=4.0, speculative_start=False
    )
    client = WsAgentClient(agent.url, speech_wav)
    try:
        await client.connect()
        first = await client.wait_event("response.output_item.added", timeout=60)
        for _ in range(200):  # bounded: two codec frames of its audio have come
            if client.result.received_samples >= 2 * CODEC_FRAME_SAMPLES:
                break
            await asyncio.sleep(0.05)
        assert client.result.received_samples >= 2 * CODEC_FRAME_SAMPLES
        session_id = next(iter(agent.app[SESSIONS]))  # the WebSocket session's id
        holding = agent.engine.send(session_id, Hold())  # the engine thread is busy from here on
        await client.send(
            {
                "type": "conversation.item.truncate",
                "item_id": first["item"]["id"],
                "content_index": 0,
                "audio_end_ms": 80,
            }
        )
        await client.send({"type": "response.create"})
        await client.wait_event("response.done", timeout=30)  # the first, cancelled by the truncation
        for _ in range(100):  # bounded: the second response.created (its begin is queued as well)
            if len(client.result.of_type("response.created")) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(client.result.of_type("response.created")) == 2
        held.release()
        await holding
        truncated = await client.wait_event("conversation.item.truncated", timeout=30)
        for _ in range(600):  # bounded: the second reply ends (4 s cap)
            if len(client.result.of_type("response.done")) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        held.release()
        await client.close()
        await agent.stop()
    r = client.result
    assert not r.of_type("error"), r.of_type("error")
    assert truncated["item_id"] == first["item"]["id"] and truncated["audio_end_ms"] == 80
    statuses = [d["response"]["status"] for d in r.of_type("response.done")]
    assert len(statuses) == 2 and statuses[0] == "cancelled" and statuses[1] in ("completed", "incomplete"), statuses
    assert r.of_type("response.done")[1]["response"]["output"], "the second reply said nothing"
