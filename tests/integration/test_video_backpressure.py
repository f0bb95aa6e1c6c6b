"""Back-pressure on the camera over a real call: the Python client obeys the agent's throttle.

Pins, with the aiortc client (agent/client.py) sending a 10 fps camera pattern to the agent
(tiny model, streaming engine) on loopback: while the engine keeps up nothing is throttled and
the client sends its full rate; when the engine thread is stalled the session's video backlog
reaches its high-water mark, the client receives `input_video.throttle` on the data channel and
its sent frame rate drops (1 fps, then paused); once the engine is released and the backlog has
stayed low for the hold time, a `recovered` throttle event restores the rate and the client
sends at its full rate again. The metrics count the throttle events and the time throttled,
at most a few frames wait in the stalled engine's inbox, and audio is never throttled (the reply still comes).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.client import AgentClient
from agent.config import Config
from agent.engine import Engine, runner_factory
from agent.metrics import REGISTRY
from agent.realtime.app import SESSIONS
from agent.server import create_app
from agent.video_feed import MAX_IN_FLIGHT
from realtime_helpers import free_port


class Holdable:
    """The real runner, plus a `hold` call that blocks the engine thread until released."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def hold(self, session_id: str) -> None:
        self.release.wait(30)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _until(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return predicate()


async def test_python_client_obeys_throttle_from_a_stalled_engine(tiny_model_dir: Path, speech_wav: Path) -> None:
    port = free_port()
    config = Config(port=port, ice_hosts=("127.0.0.1",), model=str(tiny_model_dir), fallback_model="none",
                    threads=1, max_reply_seconds=1.0, video_throttle_hold_s=1.0, video_pause_after_s=2.0)
    primary = runner_factory(config)
    holdable: list[Holdable] = []
    engine = Engine(lambda: holdable.append(Holdable(primary())) or holdable[0], inbox_size=512)
    app = create_app(config, engine)
    app_runner = web.AppRunner(app)
    await app_runner.setup()
    await web.TCPSite(app_runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    client = AgentClient(url, speech_wav, video=True, video_fps=10)
    events_before = {s: _metric("agent_video_throttle_events_total", state=s) for s in ("throttled", "open")}
    seconds_before = _metric("agent_video_throttled_seconds_total")
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                async with http.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
        await client.connect()
        await client.wait_event("session.created", 20)
        video = client.video
        assert video is not None
        assert await _until(lambda: video.fps(2.0) >= 6, 20), f"the client should send ~10 fps, sends {video.fps()}"
        assert not client.result.of_type("input_video.throttle"), "an engine that keeps up must not throttle"
        full_rate = video.fps(2.0)

        session = next(iter(app[SESSIONS].values())).session
        held = engine.call(session.id, "hold")
        peak_backlog = 0.0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not video.paused:
            peak_backlog = max(peak_backlog, session.video.backlog)
            await asyncio.sleep(0.1)
        throttles = client.result.of_type("input_video.throttle")
        assert [e["paused"] for e in throttles] == [False, True], throttles
        assert throttles[0]["max_fps"] == 1.0 and throttles[0]["scale_resolution_down_by"] == 2.0
        assert peak_backlog >= config.video_high_water
        assert session.video.in_flight <= config.video_frames_per_turn + MAX_IN_FLIGHT, "frames crowd the inbox"
        await asyncio.sleep(2.0)
        assert video.fps(2.0) == 0, "a paused client sends no frames"

        holdable[0].release.set()
        await held
        assert await _until(lambda: len(client.result.of_type("input_video.throttle")) >= 3, 15)
        restored = client.result.of_type("input_video.throttle")[2]
        assert restored["reason"] == "recovered" and restored["paused"] is False and restored["max_fps"] == 4.0
        assert await _until(lambda: video.fps(2.0) >= 0.6 * min(full_rate, 4.0), 10), "the client's rate must recover"
        assert not video.paused and video.scale == 1.0

        assert _metric("agent_video_throttle_events_total", state="throttled") == events_before["throttled"] + 1
        assert _metric("agent_video_throttle_events_total", state="open") == events_before["open"] + 1
        assert _metric("agent_video_throttled_seconds_total") - seconds_before >= 2.0
        # Audio was never throttled: the turn spoken during the stall is still answered.
        assert await _until(lambda: bool(client.result.of_type("response.done")), 60)
    finally:
        for h in holdable:
            h.release.set()
        await client.close()
        await app_runner.cleanup()
