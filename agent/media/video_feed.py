"""One session's camera path on the asyncio side: sample, queue, hand to the engine, push back.

    track reader ─► VideoSampler (4 fps) ─► FrameRing (backlog) ─► Engine.append_video
                                               │ backlog            (at most MAX_IN_FLIGHT
                                               ▼                     frames not yet taken)
                                   SenderThrottle ─► input_video.throttle to the client

The ring holds the frames not yet handed to the engine. While the engine keeps up it stays
near empty; when the engine falls behind (a long prefill, an overloaded host) it fills, and
once the backlog (the ring plus the frames handed over but not yet taken) passes its
high-water mark the client is asked to send less (agent/media/backpressure.py). Only
MAX_IN_FLIGHT frames wait in the engine's inbox at a time, so a stalled engine backs frames
up here, in a bounded drop-oldest ring, and never crowds the inbox the audio needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

import av

from agent.config import Config
from agent.engine.api import EngineBusy
from agent.engine.loop import Engine
from agent.media.backpressure import SenderThrottle
from agent.media.ingest import VideoSample, VideoSampler
from agent.media.rings import FrameRing
from agent.metrics import INGEST_DROPPED

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # frames handed to the engine and not yet taken
RECHECK_S = 0.25  # while throttled, the backlog is looked at this often (no frames may arrive)


class VideoFeed:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        session_id: str,
        emit: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine, self._session_id, self._emit, self._clock = engine, session_id, emit, clock
        self._frames_per_turn = config.video_frames_per_turn
        self.sampler = VideoSampler(fps=config.video_fps, max_side=config.video_max_side)
        self.ring: FrameRing[VideoSample] = FrameRing(config.ingest_buffer_frames, kind="video")
        self.throttle = SenderThrottle(
            config.video_fps,
            config.video_high_water,
            config.video_low_water,
            config.video_throttle_hold_s,
            config.video_pause_after_s,
        )
        self.in_flight = 0
        self.sent = 0  # frames handed to the engine
        self._allowed = config.video  # --no-video: the camera is never looked at
        self.enabled = config.video  # ... and the session's own switch (omni.video, set_enabled)
        self._told_off = False  # the sender was asked to pause because the camera is off
        self._timer: Optional[asyncio.TimerHandle] = None
        self._closed = False

    def push(self, frame: av.VideoFrame, audio_clock: float) -> None:
        """A received camera frame (called by the track reader for every frame)."""
        if self._closed:
            return
        if not self.enabled:
            # The agent does not look at the camera: ask the sender, once, to stop sending it
            # (a frame that still comes is dropped unconverted).
            INGEST_DROPPED.labels(kind="video", reason="disabled").inc()
            if not self._told_off:
                self._told_off = True
                reason = "video_off" if self._allowed else "video_disabled"
                self._emit(self.throttle.states["paused"].event(reason))
            return
        if self.throttle.state.paused:
            # The sender was asked to stop; one that goes on costs no conversion here.
            INGEST_DROPPED.labels(kind="video", reason="paused").inc()
        else:
            sample = self.sampler.push(frame, audio_clock)
            if sample is not None:
                self.ring.put(sample)  # full: the oldest goes (reason="full")
                self._pump()
        self._check()

    def set_enabled(self, on: bool) -> None:
        """The session's camera switch. Off: the frames not yet handed over are dropped and the
        sender is asked to pause at its next frame (a session without a camera hears nothing).
        On again: a sender that was asked to pause is told the rate the throttle allows now.
        Under --no-video it stays off."""
        on = on and self._allowed
        if on == self.enabled or self._closed:
            return
        self.enabled = on
        if not on:
            dropped = len(self.ring.drain())
            if dropped:
                INGEST_DROPPED.labels(kind="video", reason="disabled").inc(dropped)
            return
        if self._told_off:
            self._told_off = False
            self._emit(self.throttle.state.event("video_on"))

    def flush_for_turn(self) -> None:
        """End of turn: the newest frames go to the engine now, ahead of the reply, whatever is
        in flight; an older backlog is superseded (the reply is shown only the newest)."""
        pending = self.ring.drain()
        keep = pending[-self._frames_per_turn :] if self._frames_per_turn else []
        if len(pending) > len(keep):
            INGEST_DROPPED.labels(kind="video", reason="superseded").inc(len(pending) - len(keep))
        for sample in keep:
            self._send(sample)
        self._check()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.ring.clear()  # the ring's gauge is a sum over sessions
        # _emit is the session's bound method: dropping it breaks the session -> feed -> session
        # cycle, so the call is freed by reference counting at once, not at a rare full GC.
        self._emit = _closed

    # ---- to the engine ---------------------------------------------------------------------
    def _pump(self) -> None:
        while self.in_flight < MAX_IN_FLIGHT and len(self.ring):
            self._send(self.ring.pop_oldest())

    def _send(self, sample: VideoSample) -> None:
        try:
            future = self._engine.append_video(self._session_id, sample.image, sample.audio_clock)
        except EngineBusy:
            INGEST_DROPPED.labels(kind="video", reason="engine_busy").inc()
            return
        self.in_flight += 1
        self.sent += 1
        future.add_done_callback(self._taken)

    def _taken(self, _future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not self._closed:
            self._pump()
            self._check()

    # ---- back to the sender ----------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """Frames sampled and not yet taken by the engine: queued here or in its inbox (an end of
        turn sends the newest past the in-flight cap, so both count)."""
        return len(self.ring) + self.in_flight

    def _check(self) -> None:
        state = self.throttle.observe(self.backlog, self._clock())
        if state is not None:
            reason = "recovered" if state.phase == "open" else "ingest_backlog"
            log.info("session %s: video %s (backlog %d)", self._session_id, state.phase, self.backlog)
            self._emit(state.event(reason))
        if self.throttle.phase != "open" and self._timer is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        if not self._closed:
            self._check()


def _closed(event: dict[str, Any]) -> None:
    """Where a closed feed's events go: nowhere."""
