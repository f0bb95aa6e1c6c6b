"""Interpreter pipelining over the WebSocket transport, with the `openai` SDK and the tiny model.

Pins: in interpreter mode (omni.interpret_to), three utterances spoken back to back with short
gaps, each ending while the previous translation is still being made (the test checks that this
overlap happened: an utterance's speech_stopped comes before the previous response.done), get
three responses and no error event (no `conversation_already_has_active_response`); the
responses come one after the other, in the order of the utterances; every user item gets its
input transcript, the items of the conversation alternate user, assistant, user, ... (each
response's item right after its own user item, `previous_item_id` saying so), and each response
used the audio of one utterance only (its usage counts fewer audio tokens than two utterances).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from support.realtime_helpers import RunningAgent, start_agent, talker_never_ends
from support.realtime_ws import Events, pcm24, stream_realtime

from agent.config import Config
from agent.engine.factory import fallback_factory, inbox_size, runner_factory
from agent.engine.loop import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
# Per talker step: a 4 s reply (50 steps) takes >= 5 s to make, about twice the ~2.6 s from one
# speech_stopped to the next (1.8 s of speech, 0.8 s of silence). At 0.05 s (>= 2.5 s) a fast CI
# machine finished a reply just before the next utterance ended, and the overlap never happened.
FRAME_DELAY_S = 0.1


def slow_long_replies(config: Config) -> Engine:
    """Replies that run to max_reply_seconds and are made no faster than ~0.8x real time, so
    the next utterance ends while one is still being made, whatever the machine's speed."""
    build = runner_factory(config)

    def make():
        runner = talker_never_ends(build())
        runner.loaded.model.talker.codec_head.register_forward_hook(lambda *_: time.sleep(FRAME_DELAY_S))
        return runner

    return Engine(
        make,
        inbox_size=inbox_size(config),
        fallback_factory=fallback_factory(config),
        frames_per_turn=config.video_frames_per_turn,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(tiny_model_dir: Path):
    running = await start_agent(
        tiny_model_dir, engine=slow_long_replies, max_reply_seconds=4.0, max_reply_tokens=24, speculative_start=False
    )
    yield running
    await running.stop()


async def test_three_utterances_back_to_back(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    client = AsyncOpenAI(base_url=f"{agent.url}/v1", api_key="unused-on-an-open-agent")
    manager = client.realtime.connect(model="qwen3-omni")
    conn = await manager.__aenter__()
    ev = Events(conn, strict_event)
    try:
        await ev.wait("session.created")
        await conn.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "omni": {"interpret_to": "French"},
                    "audio": {"input": {"transcription": {"model": "thinker"}}},
                },
            }
        )
        await ev.wait("session.updated")
        speech = pcm24(speech_wav)
        for _ in range(3):  # 0.8 s gaps: > the 300 ms of silence that ends a turn
            await stream_realtime(conn, speech, tail_silence_s=0.8)
        for n in range(1, 4):
            await ev.wait("response.done", 120, where=lambda e, n=n: len(ev.of("response.done")) >= n)
        await ev.wait(
            "conversation.item.input_audio_transcription.completed",
            30,
            where=lambda e: len(ev.of("conversation.item.input_audio_transcription.completed")) >= 3,
        )
    finally:
        ev.close()
        await manager.__aexit__(None, None, None)

    assert not ev.of("error"), ev.of("error")
    types = [e["type"] for e in ev.all]
    stopped = ev.of("input_audio_buffer.speech_stopped")
    created, done = ev.of("response.created"), ev.of("response.done")
    assert len(stopped) == 3 and len(created) == 3 and len(done) == 3
    user_items = [e["item_id"] for e in stopped]
    # The overlap under test happened: an utterance ended while the previous reply was being made.
    at = {id(e): i for i, e in enumerate(ev.all)}
    assert any(at[id(stopped[k + 1])] < at[id(done[k])] for k in range(2)), types
    # One response at a time, in order: created_k+1 after done_k.
    for k in range(2):
        assert at[id(done[k])] < at[id(created[k + 1])]
    assert [d["response"]["id"] for d in done] == [c["response"]["id"] for c in created]
    # Each response's item follows its own user item.
    added = [e for e in ev.all if e["type"] == "conversation.item.added" and e["item"]["role"] == "assistant"]
    assert [e["previous_item_id"] for e in added] == user_items
    assert all(d["response"]["status"] in ("completed", "incomplete") for d in done)
    # Every response answered one utterance: not the audio of two.
    audio_tokens = [d["response"]["usage"]["input_token_details"]["audio_tokens"] for d in done]
    assert all(0 < n < 1.5 * min(audio_tokens) for n in audio_tokens), audio_tokens
    # Every user item has its input transcript; the conversation alternates user, assistant.
    completed = {e["item_id"] for e in ev.of("conversation.item.input_audio_transcription.completed")}
    assert completed == set(user_items)
    assistant_items = [d["response"]["output"][0]["id"] for d in done]
    order = _items_order(ev.all)
    expected = [x for pair in zip(user_items, assistant_items) for x in pair]
    assert order == expected, (order, expected)


def _items_order(events: list[dict[str, Any]]) -> list[str]:
    """The conversation's item order as a client rebuilds it from previous_item_id."""
    order: list[str] = []
    for e in events:
        if e["type"] not in ("conversation.item.added", "input_audio_buffer.committed"):
            continue
        item_id = e["item"]["id"] if "item" in e else e["item_id"]
        if item_id in order:
            continue
        previous = e.get("previous_item_id")
        at = order.index(previous) + 1 if previous in order else (0 if previous is None else len(order))
        order.insert(at, item_id)
    return order
