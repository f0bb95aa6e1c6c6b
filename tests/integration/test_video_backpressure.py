"""Back-pressure on the camera over a real call: the Python client obeys the agent's throttle.

Pins, with the aiortc client (agent/client/client.py) sending a 10 fps camera pattern to the agent
(tiny model, streaming engine) on loopback: while the engine keeps up nothing is throttled and
the client sends its full rate; when the engine thread is stalled the session's video backlog
reaches its high-water mark, the client receives `input_video.throttle` on the data channel and
its sent frame rate drops (1 fps, then paused); once the engine is released and the backlog has
stayed low for the hold time, a `recovered` throttle event restores the rate and the client
sends at its full rate again. The metrics count the throttle events and the time throttled,
at most a few frames wait in the stalled engine's inbox, and audio is never throttled (the reply still comes).
The session's camera switch reaches the sender too: `omni.video: false` pauses the client's camera
and the engine is handed no frame; `true` resumes it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from support.engine_hold import HeldEngine, Hold
from support.realtime_helpers import start_agent

from agent.client.client import AgentClient
from agent.media.video_feed import MAX_IN_FLIGHT
from agent.metrics import REGISTRY
from agent.transport.http import SESSIONS


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
    held = HeldEngine()
    agent = await start_agent(
        tiny_model_dir, engine=held, max_reply_seconds=1.0, video_throttle_hold_s=1.0, video_pause_after_s=2.0
    )
    config, engine, url = agent.config, agent.engine, agent.url
    client = AgentClient(url, speech_wav, video=True, video_fps=10)
    events_before = {s: _metric("agent_video_throttle_events_total", state=s) for s in ("throttled", "open")}
    seconds_before = _metric("agent_video_throttled_seconds_total")
    try:
        await client.connect()
        await client.wait_event("session.created", 20)
        video = client.video
        assert video is not None
        assert await _until(lambda: video.fps(2.0) >= 6, 20), f"the client should send ~10 fps, sends {video.fps()}"
        assert not client.result.of_type("input_video.throttle"), "an engine that keeps up must not throttle"
        full_rate = video.fps(2.0)

        session = next(iter(agent.app[SESSIONS].values())).session
        # The backlog the agent itself saw at each decision: sampling it from here every 0.1 s
        # missed the peak on a loaded machine (5 seen, the throttle had seen 6).
        throttle, decided = session.video.throttle, []
        observe = throttle.observe

        def watched(backlog: int, now: float):
            state = observe(backlog, now)
            if state is not None:
                decided.append((state.phase, backlog))
            return state

        throttle.observe = watched
        holding = engine.send(session.id, Hold())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not video.paused:
            await asyncio.sleep(0.1)
        throttles = client.result.of_type("input_video.throttle")
        assert [e["paused"] for e in throttles] == [False, True], throttles
        assert throttles[0]["max_fps"] == 1.0 and throttles[0]["scale_resolution_down_by"] == 2.0
        assert [phase for phase, _ in decided] == ["throttled", "paused"], decided
        assert all(backlog >= config.video_high_water for _, backlog in decided), decided
        assert session.video.in_flight <= config.video_frames_per_turn + MAX_IN_FLIGHT, "frames crowd the inbox"
        await asyncio.sleep(2.0)
        assert video.fps(2.0) == 0, "a paused client sends no frames"

        held.release()
        await holding
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
        held.release()
        await client.close()
        await agent.stop()


async def test_omni_video_off_pauses_the_python_client_and_on_resumes_it(
    tiny_model_dir: Path, speech_wav: Path
) -> None:
    """The session's camera switch reaches the sender: `omni.video: false` in a session.update
    pauses the client's camera (it sends no frames, the engine is handed none), `true` restores it."""
    agent = await start_agent(tiny_model_dir)
    client = AgentClient(agent.url, speech_wav, video=True, video_fps=10)
    try:
        await client.connect()
        await client.wait_event("session.created", 20)
        await client.wait_open()
        video = client.video
        assert video is not None
        assert await _until(lambda: video.fps(1.0) >= 6, 20), f"the client should send ~10 fps, sends {video.fps()}"
        session = next(iter(agent.app[SESSIONS].values())).session

        client.send({"type": "session.update", "session": {"type": "realtime", "omni": {"video": False}}})
        assert await _until(lambda: video.paused, 10), client.result.of_type("input_video.throttle")
        off = client.result.of_type("input_video.throttle")
        assert [(e["paused"], e["reason"]) for e in off] == [(True, "video_off")]
        handed = session.video.sent
        await asyncio.sleep(1.5)
        assert video.fps(1.0) == 0, "a paused client sends no frames"
        assert session.video.sent == handed, "the engine is handed no frame while the camera is off"

        client.send({"type": "session.update", "session": {"type": "realtime", "omni": {"video": True}}})
        assert await _until(lambda: not video.paused and video.fps(2.0) >= 2.4, 10), "the client's camera must resume"
        on = client.result.of_type("input_video.throttle")[1:]
        assert [(e["paused"], e["reason"]) for e in on] == [(False, "video_on")]
        assert await _until(lambda: session.video.sent > handed, 10), "frames reach the engine again"
        assert not client.result.of_type("error"), client.result.of_type("error")
    finally:
        await client.close()
        await agent.stop()
