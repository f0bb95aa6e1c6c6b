"""Back-pressure to the video sender: high/low-water marks with a hold time, WebRTC style.

The server cannot slow a WebRTC sender down by not reading (aiortc's receive queue is
unbounded, and the ingest ring drops the oldest frame instead of waiting), so it asks: an
`input_video.throttle` event tells the client to lower its frame rate and resolution, or to
pause the camera, and the client applies it to its encoder (the page with
RTCRtpSender.setParameters, the Python client on its source track). Audio is never throttled.

The decision is a small state machine over the backlog of camera frames the engine has not
taken yet (the session's ingest ring), in three phases:

    open ──backlog ≥ high──► throttled ──still ≥ high for pause_after_s──► paused
      ▲                          │                                            │
      └── backlog ≤ low, held for hold_s (from either) ◄──────────────────────┘

Holding the low-water mark before restoring keeps a sender that hovers around the marks
from flapping between rates. Pure logic with an injected clock: VideoFeed (video_feed.py)
feeds it the backlog and sends what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from agent import metrics


@dataclass(frozen=True)
class ThrottleState:
    """What the sender is asked to do. `phase` names the machine's state."""

    phase: str  # open | throttled | paused
    max_fps: float
    scale_resolution_down_by: float
    paused: bool

    def event(self, reason: str) -> dict[str, Any]:
        return {
            "type": "input_video.throttle",
            "max_fps": self.max_fps,
            "scale_resolution_down_by": self.scale_resolution_down_by,
            "paused": self.paused,
            "reason": reason,
        }


class SenderThrottle:
    """Decides, from the ingest backlog over time, what the video sender should be asked."""

    def __init__(
        self,
        fps: float,
        high_water: int,
        low_water: int,
        hold_s: float,
        pause_after_s: float,
        throttled_fps: float = 1.0,
        throttled_scale: float = 2.0,
    ) -> None:
        assert 0 <= low_water < high_water, "the low-water mark must be under the high-water mark"
        self._high, self._low = high_water, low_water
        self._hold_s, self._pause_after_s = hold_s, pause_after_s
        self.states = {
            "open": ThrottleState("open", fps, 1.0, False),
            "throttled": ThrottleState("throttled", min(fps, throttled_fps), throttled_scale, False),
            "paused": ThrottleState("paused", min(fps, throttled_fps), throttled_scale, True),
        }
        self.state = self.states["open"]
        self._since: Optional[float] = None  # when the current phase began
        self._low_since: Optional[float] = None  # when the backlog last fell to the low-water mark
        self._accounted: Optional[float] = None  # time throttled counted up to here
        self.events = 0

    @property
    def phase(self) -> str:
        return self.state.phase

    def observe(self, backlog: int, now: float) -> Optional[ThrottleState]:
        """The backlog at `now`; returns the new state when the sender must be told, else None."""
        self._account(now)
        if backlog > self._low:
            self._low_since = None
        elif self._low_since is None:
            self._low_since = now
        phase = self.state.phase
        if phase == "open":
            return self._enter("throttled", now) if backlog >= self._high else None
        if self._low_since is not None and now - self._low_since >= self._hold_s:
            return self._enter("open", now)
        if phase == "throttled" and backlog >= self._high and now - (self._since or now) >= self._pause_after_s:
            return self._enter("paused", now)
        return None

    def _enter(self, phase: str, now: float) -> ThrottleState:
        self.state = self.states[phase]
        self._since = now
        self._low_since = None
        self.events += 1
        metrics.VIDEO_THROTTLE_EVENTS.labels(state=phase).inc()
        return self.state

    def _account(self, now: float) -> None:
        # Time throttled is counted as it passes, so the metric moves during a long stall too.
        if self.state.phase != "open" and self._accounted is not None and now > self._accounted:
            metrics.VIDEO_THROTTLED_SECONDS.inc(now - self._accounted)
        self._accounted = now
