"""The barge-in pause over real aiortc peers on loopback.

Pins: when the user talks over a spoken reply, the agent's outbound track is paused on the
barge-in candidate and the confirmed barge-in then flushes that pause (the
agent_barge_in_pauses_total{outcome="flushed"} counter moves), the reply is cut
(output_audio_buffer.cleared) and truncated to what was heard; with --no-barge-in-pause the same
barge-in happens with no pause at all.
"""

from __future__ import annotations

from pathlib import Path

from support.realtime_helpers import long_replies_engine, start_agent

from agent.client.client import AgentClient
from agent.metrics import REGISTRY


def pauses() -> dict[str, float]:
    return {
        o: REGISTRY.get_sample_value("agent_barge_in_pauses_total", {"outcome": o}) or 0.0
        for o in ("flushed", "resumed", "expired")
    }


async def talk_over_reply(tiny_model_dir: Path, speech_wav: Path, **overrides) -> tuple[dict, dict[str, float]]:
    # The tiny model's random voice is louder than the test speech: a -20 dB margin lets that
    # speech count as a barge-in over it (the echo guard's level rule is not what is tested here).
    # The reply runs to its cap (8 s): the random talker could otherwise end it before the
    # 600 ms of voice a barge-in needs (without the pause the reply plays on meanwhile).
    agent = await start_agent(
        tiny_model_dir,
        engine=long_replies_engine,
        max_sessions=1,
        max_reply_tokens=200,
        max_reply_seconds=8.0,
        speculative_start=False,
        echo_margin_db=-20.0,
        **overrides,
    )
    client = AgentClient(agent.url, speech_wav, video=False)
    before = pauses()
    try:
        await client.connect()
        await client.wait_event("output_audio_buffer.started", timeout=60)
        client.audio.play()  # talk over it at once: the random voice may end within a second
        truncated = await client.wait_event("conversation.item.truncated", timeout=30)
    finally:
        await client.close()
        await agent.stop()
    after = pauses()
    return truncated, {o: after[o] - before[o] for o in after}


async def test_a_barge_in_pauses_the_reply_then_flushes_it(tiny_model_dir: Path, speech_wav: Path) -> None:
    truncated, moved = await talk_over_reply(tiny_model_dir, speech_wav)
    assert truncated["audio_end_ms"] > 0
    assert moved["flushed"] >= 1, f"no pause was flushed by the barge-in: {moved}"


async def test_without_the_pause_the_barge_in_still_cuts(tiny_model_dir: Path, speech_wav: Path) -> None:
    truncated, moved = await talk_over_reply(tiny_model_dir, speech_wav, barge_in_pause=False)
    assert truncated["audio_end_ms"] > 0
    assert moved == {"flushed": 0, "resumed": 0, "expired": 0}
