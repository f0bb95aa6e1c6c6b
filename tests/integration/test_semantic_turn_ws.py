"""semantic_vad through a real session (the official `openai` SDK over the WebSocket transport, the
tiny model, the real Smart Turn v3.2 judge the agent loads from its cache dir).

Pins: a finished question streamed in real time, then silence, is judged at its pause
(agent_turn_judgments_total counts a complete verdict) and its turn ends well before the long
silence a turn judged unfinished waits for: the speech_stopped event comes sooner after the end
of speech than on a server_vad session told to wait that long (800 ms), the same audio, the same
agent; both turns are answered. A session that asks for server_vad is never judged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import pcm24, sdk_session, stream_realtime
from support.speech import espeak_at, write_wav

from agent import metrics
from agent.config import Config
from agent.media.turn_model import default_path

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent(max_reply_seconds=1.0, max_reply_tokens=8)
LEAD_S = 0.3


@pytest.fixture(scope="module")
def question(tmp_path_factory) -> Path:
    if not default_path(Config().cache_dir).is_file():
        missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        missing("no end-of-turn model: run `omni-agent fetch-turn-model` (make install does)")
    out = tmp_path_factory.mktemp("q") / "q.wav"
    pcm = espeak_at("What's the weather like in Paris tomorrow?", out.with_name("raw.wav"), 16000)
    return write_wav(out, np.concatenate([np.zeros(int(LEAD_S * 16000)), pcm]), 16000)


def judged(verdict: str) -> float:
    return metrics.REGISTRY.get_sample_value("agent_turn_judgments_total", {"verdict": verdict}) or 0.0


async def turn(agent: RunningAgent, wav: Path, turn_detection: dict, strict_event) -> float:
    """Seconds from the end of speech (as sent, in real time) to speech_stopped's arrival."""
    pcm = pcm24(wav)
    voiced = np.nonzero(np.abs(pcm) > 300)[0]
    speech_s = (voiced[-1] + 1) / 24_000
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": turn_detection}}})
        await ev.wait("session.updated", 10)
        began = time.monotonic()
        await stream_realtime(conn, pcm, tail_silence_s=1.5)
        stopped = await ev.wait("input_audio_buffer.speech_stopped", 30)
        await ev.wait("response.done", 90)
    assert not ev.of("error"), ev.of("error")
    return stopped["_t"] - (began + speech_s)


async def test_a_finished_question_ends_its_turn_before_the_long_silence(
    agent: RunningAgent, question: Path, strict_event
) -> None:
    complete = judged("complete")
    semantic = await turn(agent, question, {"type": "semantic_vad", "eagerness": "auto"}, strict_event)
    assert judged("complete") >= complete + 1
    asked = sum(judged(v) for v in ("complete", "incomplete", "failed"))
    fixed = await turn(agent, question, {"type": "server_vad", "silence_duration_ms": 800}, strict_event)
    assert sum(judged(v) for v in ("complete", "incomplete", "failed")) == asked  # server_vad: never judged
    assert semantic < fixed, f"semantic_vad {semantic * 1000:.0f} ms, server_vad 800 {fixed * 1000:.0f} ms"
