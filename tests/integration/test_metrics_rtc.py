"""Every operational metric exists on /metrics and moves when its event happens.

Pins, over a real call (aiortc client on loopback, tiny model, streaming engine): TTFT and
TTFA histograms count the reply; stage histograms see thinker/talker/code-predictor/
code2wav time; sessions_active rises and falls; frames over 4 fps are dropped and counted
(the video ring's backlog and the throttle metrics move in test_video_backpressure.py); the playout buffer fills; an engine that falls behind real
time mid-reply produces counted underruns; a bad offer is counted as rejected; the
degradation level and GPU gauges are exported (they move in test_ladder_rtc / on a GPU); so are
the standard process_* series (resident memory, CPU seconds moving).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
from support.realtime_helpers import start_agent

from agent.client.client import AgentClient
from agent.config import Config
from agent.engine.api import AudioOut
from agent.engine.factory import build_engine
from agent.engine.loop import Engine


class StallAfterFirstAudio:
    """Wraps a runner so that, once a reply has spoken, each step takes 3x real time."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._spoke = False

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def begin_reply(self, session_id: str, images: list, text_only: bool = False) -> None:
        self._spoke = False
        self._inner.begin_reply(session_id, images, text_only)

    def step(self):
        if self._spoke:
            time.sleep(0.24)  # one 80 ms frame per step: the playout buffer must run dry
        outputs = self._inner.step()
        self._spoke = self._spoke or any(isinstance(o, AudioOut) for o in outputs)
        return outputs


async def _scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _sum(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k == prefix or k.startswith(prefix + "{"))


async def _wait_sessions_gauge_zero(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Scrape until agent_sessions_active is 0 (bounded: 10 s); the last scrape."""
    for _ in range(100):
        values = await _scrape(http, url)
        if _sum(values, "agent_sessions_active") == 0:
            return values
        await asyncio.sleep(0.1)
    return values


def _stalling_engine(config: Config) -> Engine:
    return build_engine(config, wrap=StallAfterFirstAudio)


async def test_metrics_exist_and_move(tiny_model_dir: Path, speech_wav: Path) -> None:
    running = await start_agent(tiny_model_dir, engine=_stalling_engine, max_reply_seconds=2.0)
    url = running.url
    client = AgentClient(url, speech_wav, video=True)
    peaks = {"agent_sessions_active": 0.0, "agent_playout_buffer_seconds": 0.0}
    async with aiohttp.ClientSession() as http:
        try:
            before = await _scrape(http, url)
            async with http.post(
                f"{url}/v1/realtime/calls", data=b"", headers={"Content-Type": "application/sdp"}
            ) as resp:
                assert resp.status == 400
            await client.connect()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not client.result.of_type("response.done"):
                now = await _scrape(http, url)
                for name in peaks:
                    peaks[name] = max(peaks[name], _sum(now, name))
                await asyncio.sleep(0.05)
            during = await _scrape(http, url)
        finally:
            await client.close()
        after = await _wait_sessions_gauge_zero(http, url)
        await running.stop()

    assert client.result.of_type("response.done"), "the reply never finished"
    moved = lambda name: _sum(during, name) - _sum(before, name)  # noqa: E731
    assert moved("agent_time_to_first_token_seconds_count") == 1
    assert moved("agent_time_to_first_audio_seconds_count") == 1
    for stage in ("thinker_prefill", "talker_step", "code_predictor", "code2wav"):
        key = f'agent_stage_seconds_count{{stage="{stage}"}}'
        assert during.get(key, 0) > before.get(key, 0), f"{stage} not timed"
    assert peaks["agent_sessions_active"] == 1 and _sum(after, "agent_sessions_active") == 0
    assert peaks["agent_playout_buffer_seconds"] > 0
    assert moved('agent_ingest_dropped_frames_total{kind="video",reason="rate"}') > 0
    assert moved("agent_playout_underruns_total") > 0, "a stalled engine must show underruns"
    assert moved('agent_offers_rejected_total{reason="bad_request"}') == 1
    assert "agent_degradation_level" in during and "agent_gpu_utilization_ratio" in during
    # The standard process series operators' dashboards read (a registry of our own had none).
    assert during["process_resident_memory_bytes"] > 100e6 and moved("process_cpu_seconds_total") > 0
