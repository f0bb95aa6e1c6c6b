"""Back-pressure on the camera: the throttle state machine and the session's video feed.

Pins:
- SenderThrottle: backlog at the high-water mark -> "throttled" (1 fps, half size); still there
  after pause_after_s -> "paused"; restored ("open", full rate) only once the backlog has stayed
  at or under the low-water mark for hold_s, so a backlog hovering near the marks does not flap;
  each change is one event and counted in agent_video_throttle_events_total{state}; the time
  spent throttled is counted as it passes.
- VideoFeed against the real Engine thread: while the engine takes frames the backlog stays
  empty and nothing is throttled; a stalled engine thread backs frames up in the bounded ring
  (never more than MAX_IN_FLIGHT in the engine's inbox), the sender is throttled then paused,
  frames sent while paused are dropped unconverted (reason="paused"); releasing the engine drains
  the backlog and, after the hold, restores the sender. The engine shows a reply the newest
  frames it took when the session passes none. With --no-video (Config.video False) the engine
  gets no frame and the sender is asked once to pause; the session's own switch (omni.video) does
  the same (reason "video_off", the backlog dropped) and, turned on again, tells the sender the
  rate it may use ("video_on"); it cannot turn on a camera --no-video turned off.
"""

from __future__ import annotations

import asyncio
import fractions
import threading
from dataclasses import dataclass

import av
import numpy as np

from agent import metrics
from agent.config import Config
from agent.engine.api import Output, ReplyDone
from agent.engine.commands import SessionCommand
from agent.engine.loop import Engine
from agent.media.backpressure import SenderThrottle
from agent.media.video_feed import MAX_IN_FLIGHT, VideoFeed


def _count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_no_video_asks_the_sender_to_pause_once_and_sends_the_engine_nothing() -> None:
    runner = HoldingRunner()
    engine = Engine(lambda: runner)
    await engine.start()
    events: list[dict] = []
    feed = VideoFeed(Config(video=False), engine, "s1", events.append)
    try:
        for t, frame in _frames(0.0, 1.0):
            feed.push(frame, t)
        assert feed.sent == 0 and len(feed.ring) == 0
        assert [(e["paused"], e["reason"]) for e in events] == [(True, "video_disabled")]
    finally:
        feed.close()
        await engine.stop()


async def test_the_session_switch_pauses_and_resumes_the_sender() -> None:
    """omni.video off: the backlog is dropped, the sender is asked once to pause, the engine gets
    no frame; on again: the sender is told the throttle's rate and frames flow. --no-video wins."""
    runner = HoldingRunner()
    engine = Engine(lambda: runner)
    await engine.start()
    events: list[dict] = []
    feed = VideoFeed(Config(), engine, "s1", events.append)
    denied = VideoFeed(Config(video=False), engine, "s2", [].append)
    try:
        feed.set_enabled(False)
        for t, frame in _frames(0.0, 1.0):
            feed.push(frame, t)
        assert feed.sent == 0 and len(feed.ring) == 0
        assert [(e["paused"], e["reason"]) for e in events] == [(True, "video_off")]
        feed.set_enabled(False)  # no change: nothing said
        feed.set_enabled(True)
        assert [(e["paused"], e["reason"], e["max_fps"]) for e in events[1:]] == [(False, "video_on", 4.0)]
        for t, frame in _frames(1.0, 2.0):
            feed.push(frame, t)
        assert feed.sent > 0
        denied.set_enabled(True)
        assert not denied.enabled
    finally:
        feed.close()
        denied.close()
        await engine.stop()


def test_throttle_phases_and_hold() -> None:
    t = SenderThrottle(fps=4.0, high_water=6, low_water=1, hold_s=2.0, pause_after_s=3.0)
    before = {s: _count("agent_video_throttle_events_total", state=s) for s in ("throttled", "paused", "open")}
    seconds_before = _count("agent_video_throttled_seconds_total")
    assert t.observe(3, 0.0) is None and t.phase == "open"
    state = t.observe(6, 1.0)
    assert state is not None and state.phase == "throttled"
    assert state.event("ingest_backlog") == {
        "type": "input_video.throttle",
        "max_fps": 1.0,
        "scale_resolution_down_by": 2.0,
        "paused": False,
        "reason": "ingest_backlog",
    }
    assert t.observe(8, 2.0) is None  # still high, but not for pause_after_s yet
    paused = t.observe(8, 4.5)
    assert paused is not None and paused.paused and paused.phase == "paused"
    # Low, but not held: a backlog bouncing back up resets the hold.
    assert t.observe(0, 5.0) is None
    assert t.observe(3, 6.0) is None
    assert t.observe(1, 6.5) is None
    assert t.observe(0, 8.0) is None  # 1.5 s at the low-water mark
    restored = t.observe(0, 8.6)
    assert restored is not None and restored.phase == "open" and restored.max_fps == 4.0
    assert restored.scale_resolution_down_by == 1.0 and not restored.paused
    assert t.events == 3
    for s in ("throttled", "paused", "open"):
        assert _count("agent_video_throttle_events_total", state=s) == before[s] + 1
    assert abs(_count("agent_video_throttled_seconds_total") - seconds_before - 7.6) < 1e-6


class HoldingRunner:
    """A model-less runner whose `hold` call blocks the engine thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.images: list[list] = []
        self.pending: list[str] = []

    def open_session(self, sid: str) -> None: ...

    def close_session(self, sid: str) -> None: ...

    def append_audio(self, sid: str, pcm: np.ndarray) -> None: ...

    def discard_turn(self, sid: str) -> None: ...

    def hold(self, sid: str) -> None:
        self.release.wait(10)

    def begin_reply(self, sid: str, images: list, text_only: bool = False) -> None:
        self.images.append(images)
        self.pending.append(sid)

    def cancel_reply(self, sid: str) -> None: ...

    def has_work(self) -> bool:
        return bool(self.pending)

    def idle_s(self) -> float:
        return 0.0

    def step(self) -> list[Output]:
        return [ReplyDone(self.pending.pop(0), "stop")]


@dataclass(frozen=True)
class Hold(SessionCommand):
    """Stall the engine thread (HoldingRunner.hold) until the test releases it."""


class Sink:
    def on_text(self, delta) -> None: ...

    def on_audio(self, audio) -> None: ...

    def on_done(self, done) -> None: ...


def _frames(start_s: float, seconds: float, fps: float = 10.0):
    """Camera frames with pts on a 90 kHz clock; each frame's pixels say its number."""
    for i in range(int(seconds * fps)):
        t = start_s + i / fps
        frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), int(t * fps) % 256, np.uint8), format="rgb24")
        frame.pts, frame.time_base = round(t * 90_000), fractions.Fraction(1, 90_000)
        yield t, frame


async def test_feed_throttles_a_stalled_engine_and_restores_it() -> None:
    runner = HoldingRunner()
    engine = Engine(lambda: runner, frames_per_turn=2)
    engine.register(Hold, lambda r, sid, _cmd: r.hold(sid))
    await engine.start()
    config = Config(
        video_fps=4.0,
        ingest_buffer_frames=8,
        video_high_water=6,
        video_low_water=1,
        video_throttle_hold_s=1.0,
        video_pause_after_s=1.0,
    )
    now = [0.0]
    events: list[dict] = []
    feed = VideoFeed(config, engine, "s1", events.append, clock=lambda: now[0])
    engine.open_session("s1", Sink())
    paused_before = _count("agent_ingest_dropped_frames_total", kind="video", reason="paused")

    async def play(start: float, seconds: float) -> None:
        for t, frame in _frames(start, seconds):
            now[0] = t
            feed.push(frame, t)
            await asyncio.sleep(0.005)

    try:
        await play(0.0, 2.0)
        for _ in range(100):
            if feed.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert feed.sent == 8 and len(feed.ring) == 0 and not events, "a keeping-up engine must not throttle"

        held = engine.send("s1", Hold())
        await play(2.0, 1.0)  # 4 samples: 2 in flight, the rest back up
        assert feed.in_flight == MAX_IN_FLIGHT and 0 < len(feed.ring) and feed.backlog < 6
        await play(3.0, 1.0)  # the backlog reaches the high-water mark
        assert [e["max_fps"] for e in events] == [1.0] and not events[0]["paused"]
        assert feed.in_flight == MAX_IN_FLIGHT, "a stalled engine's inbox must not fill with frames"
        await play(4.0, 1.5)  # the sender (ignoring the throttle) keeps the ring full: pause
        assert events[-1]["paused"] is True and feed.throttle.phase == "paused"
        assert _count("agent_ingest_dropped_frames_total", kind="video", reason="paused") > paused_before
        assert len(feed.ring) == config.ingest_buffer_frames

        runner.release.set()
        await held
        for _ in range(200):
            if len(feed.ring) == 0 and feed.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert len(feed.ring) == 0, "the backlog must drain once the engine takes frames again"
        assert feed.throttle.phase == "paused", "restored before the hold time"
        now[0] += 1.1
        await asyncio.sleep(0.4)  # the feed's own recheck timer sees the hold has passed
        assert events[-1] == {
            "type": "input_video.throttle",
            "max_fps": 4.0,
            "scale_resolution_down_by": 1.0,
            "paused": False,
            "reason": "recovered",
        }
        assert [e["reason"] for e in events] == ["ingest_backlog", "ingest_backlog", "recovered"]

        engine.begin_reply("s1", [])
        for _ in range(100):
            if runner.images:
                break
            await asyncio.sleep(0.01)
        assert len(runner.images[0]) == 2  # the newest two frames the engine took
        newest = runner.images[0][-1]
        assert newest.shape[2] == 3 and newest.dtype == np.uint8
    finally:
        runner.release.set()
        feed.close()
        engine.close_session("s1")
        await engine.stop()
