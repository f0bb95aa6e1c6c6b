"""The degradation ladder end to end: real peers, the real tiny models, a slowed engine.

Pins: when the engine's first response slows past the text-only threshold, new replies
become text-only and the client is told (`omni.response.mode`); slower still, replies come
from the text-only fallback model; once the engine is fast again the ladder steps back
down one level at a time to spoken replies. agent_degradation_level follows. The slowness
is injected as lateness added to each measured first response (see below), so the steps
follow the ladder's logic, not how loaded the machine happens to be.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support.realtime_helpers import start_agent
from support.speech import espeak, read_wav, write_wav

from agent.client.client import AgentClient
from agent.engine.runner.fallback import make_tiny_text
from agent.transport.http import ADMISSION


@pytest.fixture(scope="module")
def short_wav(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ladder") / "hi.wav"
    pcm, rate = read_wav(espeak("Hello there.", out.with_name("raw.wav"), speed=190))
    return write_wav(out, np.concatenate([np.zeros(rate // 4), pcm]), rate)


async def _level(url: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("agent_degradation_level "):
                    return float(line.split()[1])
    raise AssertionError("agent_degradation_level not exported")


# The engine's measured first response plus an injected lateness is what the ladder judges.
# The lateness is added where the ladder reads it (Admission.observe), so it is exact, and the
# thresholds sit far above what the machine's own load can add (the tiny model answers in well
# under a second): no reply crosses a threshold by accident on a busy machine. (A real sleep
# in the engine, as before, also delays the reply past the client's next utterance, which
# then barges in and cancels it before it is measured.)
TEXT_ONLY_MS, FALLBACK_MS = 10_000, 30_000
SLOW_S, SLOWER_S = 20.0, 60.0


async def test_ladder_degrades_and_recovers(tiny_model_dir: Path, short_wav: Path, tmp_path: Path) -> None:
    fallback_dir = make_tiny_text(tmp_path / "tiny-text", tokenizer_dir=tiny_model_dir)
    running = await start_agent(
        tiny_model_dir,
        fallback_model=str(fallback_dir),
        max_reply_tokens=12,
        max_reply_seconds=1.0,
        text_only_p95_ms=TEXT_ONLY_MS,
        fallback_p95_ms=FALLBACK_MS,
        ladder_margin_ms=50,
        ladder_recover_s=1.0,
        ladder_min_samples=2,
        ladder_window=3,
    )
    delay = [0.0]
    admission = running.app[ADMISSION]
    measured = admission.observe
    admission.observe = lambda first_response_s: measured(first_response_s + delay[0])  # type: ignore[method-assign]
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
