"""The degradation ladder end to end: real peers, the real tiny models, a slowed engine.

Pins: when the engine's first response slows past the text-only threshold, new replies
become text-only and the client is told (`omni.response.mode`); slower still, replies come
from the text-only fallback model; once the engine is fast again the ladder steps back
down one level at a time to spoken replies. agent_degradation_level follows.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import wave
from pathlib import Path
from typing import Callable

import aiohttp
import numpy as np
import pytest

from agent.client import AgentClient
from agent.config import Config
from agent.engine import Engine, fallback_factory, runner_factory
from agent.engine.fallback import make_tiny_text
from realtime_helpers import start_agent


class SlowStart:
    """Wraps a runner so each reply starts `delay[0]` seconds late, like an overloaded GPU."""

    def __init__(self, inner, delay: list[float]) -> None:
        self._inner = inner
        self._delay = delay

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def begin_reply(self, session_id: str, images: list, text_only: bool = False) -> None:
        time.sleep(self._delay[0])  # on the engine thread: exactly where model time goes
        self._inner.begin_reply(session_id, images, text_only)


@pytest.fixture(scope="module")
def short_wav(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ladder") / "hi.wav"
    raw = out.with_name("raw.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "190", "-w", str(raw), "Hello there."], check=True)
    with wave.open(str(raw)) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.concatenate([np.zeros(rate // 4, np.int16), pcm]).tobytes())
    return out


async def _level(url: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("agent_degradation_level "):
                    return float(line.split()[1])
    raise AssertionError("agent_degradation_level not exported")


# Thresholds far from both the tiny model's own first response (well under 1 s even on a
# loaded 2-core machine) and each other; the injected delays are lower bounds on the latency
# (a sleep never ends early), so "above a threshold" holds under any load, and "below the next
# one" leaves seconds of slack.
TEXT_ONLY_MS, FALLBACK_MS = 1500, 5000
SLOW_S, SLOWER_S = 2.0, 6.0


def _slow_engine(delay: list[float]) -> Callable[[Config], Engine]:
    def build(config: Config) -> Engine:
        primary = runner_factory(config)
        return Engine(lambda: SlowStart(primary(), delay), fallback_factory=fallback_factory(config))

    return build


async def test_ladder_degrades_and_recovers(tiny_model_dir: Path, short_wav: Path, tmp_path: Path) -> None:
    fallback_dir = make_tiny_text(tmp_path / "tiny-text", tokenizer_dir=tiny_model_dir)
    delay = [0.0]
    running = await start_agent(tiny_model_dir, engine=_slow_engine(delay), fallback_model=str(fallback_dir),
                                max_reply_tokens=12, max_reply_seconds=1.0,
                                text_only_p95_ms=TEXT_ONLY_MS, fallback_p95_ms=FALLBACK_MS, ladder_margin_ms=50,
                                ladder_recover_s=1.0, ladder_min_samples=2, ladder_window=3)
    url = running.url
    client = AgentClient(url, short_wav, video=False, repeat_after_s=2.0)
    levels_seen: list[float] = []
    try:
        await client.connect()
        deadline = time.monotonic() + 180
        phase = "baseline"
        while time.monotonic() < deadline:
            modes = [e["mode"] for e in client.result.of_type("omni.response.mode")]
            done = client.result.of_type("response.done")
            if phase == "baseline" and done:
                phase, delay[0] = "slow", SLOW_S  # above the text-only threshold, below fallback
            elif phase == "slow" and "text" in modes:
                phase, delay[0] = "slower", SLOWER_S  # above the fallback threshold
            elif phase == "slower" and "fallback" in modes:
                phase, delay[0] = "recovering", 0.0
                levels_seen.append(await _level(url))
            elif phase == "recovering" and modes[-1:] == ["audio"]:
                phase = "recovered"
                levels_seen.append(await _level(url))
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()
        await running.stop()

    events = client.result.events
    modes = [e["mode"] for e in events if e["type"] == "omni.response.mode"]
    assert phase == "recovered", f"stuck in phase {phase}; modes {modes}"
    assert modes[:2] == ["text", "fallback"], modes
    assert modes[-2:] == ["text", "audio"], "recovery must step down one level at a time"
    assert levels_seen == [2.0, 0.0]
    created = [e for e in events if e["type"] == "response.created"]
    modes_created = [e["omni"]["mode"] for e in created]
    assert modes_created[0] == "audio" and "text" in modes_created and "fallback" in modes_created
    # Fallback replies still speak in text: their deltas reach the client.
    fallback_ids = {e["response"]["id"] for e in created if e["omni"]["mode"] == "fallback"}
    assert any(e["response_id"] in fallback_ids for e in events if e["type"] == "response.output_text.delta")
    # Text-only and fallback replies send no audio, and say so in their output modalities.
    silent_ids = {e["response"]["id"] for e in created if e["omni"]["mode"] != "audio"}
    assert all(e["response"]["output_modalities"] == ["text"] for e in created if e["response"]["id"] in silent_ids)
    assert not [e for e in events if e["type"] == "output_audio_buffer.started" and e["response_id"] in silent_ids]
