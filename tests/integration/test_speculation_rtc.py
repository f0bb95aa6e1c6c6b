"""Speculative start over real aiortc peers on loopback, with the real tiny Qwen3-Omni.

Pins:
- a 200 ms pause in the middle of the user's sentence starts a speculative reply (it reaches
  the 120 ms pause mark) that is discarded when the user goes on: no response event and no
  audible reply audio before the turn really ends, one turn only, and the final reply's words
  and token count equal those of an agent with speculation off, on the same audio;
- speech then silence: the reply is committed from the held buffer (the engine's counters say
  so, and the reply's stats), its events in the usual order (speech_stopped → committed →
  response.created → transcript → output_audio_buffer.started → response.done).
"""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path

import numpy as np
from support.realtime_helpers import start_agent

from agent import metrics
from agent.client.client import AgentClient


def counter(outcome: str) -> float:
    return metrics.SPECULATIONS.labels(outcome=outcome)._value.get()


def paused_wav(speech_wav: Path, out: Path, pause_s: float = 0.2) -> Path:
    """The speech with `pause_s` of silence cut into a loud (voiced) spot in its middle, so the
    pause is mid-sentence and shorter than the end-of-turn silence."""
    with wave.open(str(speech_wav)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    voiced = np.flatnonzero(np.abs(pcm) > 1000)
    first, last = voiced[0], voiced[-1]
    frame = rate // 50
    middle = range(first + (last - first) // 3, first + 2 * (last - first) // 3 - frame, frame)
    at = max(middle, key=lambda i: float(np.mean(np.abs(pcm[i : i + frame].astype(np.float32)))))
    pcm = np.concatenate([pcm[:at], np.zeros(int(pause_s * rate), np.int16), pcm[at:]])
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out


async def one_turn(url: str, wav: Path) -> AgentClient:
    client = AgentClient(url, wav, video=False)
    try:
        await client.connect()
        await client.wait_event("response.done", timeout=90)
        await asyncio.sleep(0.3)  # the last events
    finally:
        await client.close()
    return client


def reply_of(client: AgentClient) -> tuple[str, int]:
    done = client.result.of_type("response.done")[0]["response"]
    return done["output"][0]["content"][0]["transcript"], done["usage"]["output_tokens"]


async def test_mid_sentence_pause_is_invisible_and_changes_nothing(
    tiny_model_dir: Path, speech_wav: Path, tmp_path: Path, strict_events
) -> None:
    wav = paused_wav(speech_wav, tmp_path / "paused.wav")
    on = await start_agent(tiny_model_dir, max_sessions=1)
    try:
        started, discarded = counter("started"), counter("discarded")
        client = await one_turn(on.url, wav)
        assert counter("started") > started and counter("discarded") > discarded, "the pause was not speculated on"
    finally:
        await on.stop()
    r = client.result
    types = strict_events(r.events)
    assert (
        types.count("input_audio_buffer.speech_started") == 1 and types.count("input_audio_buffer.speech_stopped") == 1
    )
    stopped = types.index("input_audio_buffer.speech_stopped")
    assert not [t for t in types[:stopped] if t.startswith(("response.", "output_audio_buffer."))], types[:stopped]
    stopped_at = r.of_type("input_audio_buffer.speech_stopped")[0]["_t"]
    assert all(t >= stopped_at for t, _ in r.audible_log), "reply audio was heard during the pause"
    assert len(r.of_type("response.done")) == 1

    off = await start_agent(tiny_model_dir, max_sessions=1, speculative_start=False)
    try:
        started = counter("started")
        plain = await one_turn(off.url, wav)
        assert counter("started") == started
    finally:
        await off.stop()
    assert reply_of(client) == reply_of(plain)
    assert reply_of(client)[1] > 0


async def test_end_of_turn_commits_the_held_reply(tiny_model_dir: Path, speech_wav: Path, strict_events) -> None:
    # A long end-of-turn silence: the held frame is surely ready when the turn ends, however
    # busy this machine is (the order of things is pinned, not their speed).
    agent = await start_agent(tiny_model_dir, max_sessions=1, vad_silence_ms=900)
    try:
        held, early = counter("committed_held"), counter("committed_prefilling")
        client = await one_turn(agent.url, speech_wav)
        assert counter("committed_held") == held + 1 and counter("committed_prefilling") == early
    finally:
        await agent.stop()
    r = client.result
    types = strict_events(r.events)
    order = [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.output_audio_transcript.delta",
        "output_audio_buffer.started",
        "response.done",
    ]
    positions = [types.index(kind) for kind in order]
    assert positions == sorted(positions), types
    done = r.of_type("response.done")[0]["response"]
    assert done["omni"]["stats"]["speculative"] is True
    assert done["omni"]["ttfa_ms"] is not None
