"""Admission and the degradation ladder: refuse honestly, degrade before starving anyone.

Before level 1, the first rung: speculative starts (agent/engine/state/phase.py) stop once the P95
exceeds `speculation_p95_s` (they spend engine time on replies that may be discarded) and come
back under it minus the margin. Level 0 (audio): normal replies. Level 1 (text): new replies are text-only (the talker is
paused), so each costs only the Thinker. Level 2 (fallback): replies come from a small
text-only fallback model. The signal is the P95 of the first-response latency over a
sliding window: TTFA for spoken replies, TTFT for text-only ones (a text-only reply's
first response *is* its first token). Rising is immediate; stepping back down needs the
P95 to stay under the threshold minus a margin for `recover_s`, so the ladder does not
flap at the boundary.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from agent import metrics
from agent.gate.token_bucket import TokenBucket

if TYPE_CHECKING:
    from agent.config import Config

LEVEL_NAMES = ("audio", "text", "fallback")


@dataclass(frozen=True)
class LadderSettings:
    text_only_p95_s: float = 0.300
    fallback_p95_s: float = 0.500
    speculation_p95_s: float = 0.200  # above this no speculative starts (below text_only_p95_s)
    margin_s: float = 0.050
    recover_s: float = 10.0
    window: int = 50  # latest samples kept
    window_s: float = 60.0  # and none older than this
    min_samples: int = 5  # no decision on fewer


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class DegradationLadder:
    def __init__(
        self, settings: LadderSettings = LadderSettings(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.s = settings
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=settings.window)
        self.level = 0
        self.speculate = True  # whether sessions may start replies speculatively
        self._below_since: Optional[float] = None
        metrics.DEGRADATION_LEVEL.set(0)

    def _thresholds(self) -> tuple[float, float]:
        return self.s.text_only_p95_s, self.s.fallback_p95_s

    def current_p95(self) -> Optional[float]:
        now = self._clock()
        while self._samples and now - self._samples[0][0] > self.s.window_s:
            self._samples.popleft()
        if len(self._samples) < self.s.min_samples:
            return None
        return p95([v for _, v in self._samples])

    def observe(self, first_response_s: float) -> Optional[int]:
        """Record one reply's first-response latency; returns the new level if it changed."""
        self._samples.append((self._clock(), first_response_s))
        return self.evaluate()

    def evaluate(self) -> Optional[int]:
        """Re-check the level (also call it periodically: recovery needs time to pass)."""
        now = self._clock()
        value = self.current_p95()
        old = self.level
        # The first rung goes before any level: speculation off over its threshold (or at any
        # degraded level), back on only under threshold - margin.
        if self.level > 0 or (value is not None and value > self.s.speculation_p95_s):
            self.speculate = False
        elif value is None or value < self.s.speculation_p95_s - self.s.margin_s:
            self.speculate = True
        if value is None:
            # Too little recent traffic to judge: nobody is waiting, so step down on the clock.
            target = 0
        else:
            text_t, fallback_t = self._thresholds()
            target = 2 if value > fallback_t else 1 if value > text_t else 0
        if target > self.level:
            self.level = target
            self._below_since = None
        elif target < self.level:
            # Step down one level only after staying below (threshold - margin) long enough.
            bound = self._thresholds()[self.level - 1] - self.s.margin_s
            below = value is None or value < bound
            if not below:
                self._below_since = None
            elif self._below_since is None:
                self._below_since = now
            elif now - self._below_since >= self.s.recover_s:
                self.level -= 1
                self._below_since = now if self.level > 0 else None
        if self.level != old:
            metrics.DEGRADATION_LEVEL.set(self.level)
            return self.level
        return None


class Admission:
    """What every session of one engine shares: the ladder, the turn budget, the listeners."""

    def __init__(self, ladder: DegradationLadder, turns: "TurnRateLimiter") -> None:
        self.ladder = ladder
        self.turns = turns
        self._listeners: list[Callable[[int], None]] = []

    @classmethod
    def from_config(cls, config: "Config") -> "Admission":
        settings = LadderSettings(
            text_only_p95_s=config.text_only_p95_ms / 1000,
            fallback_p95_s=config.fallback_p95_ms / 1000,
            speculation_p95_s=config.speculation_p95_ms / 1000,
            margin_s=config.ladder_margin_ms / 1000,
            recover_s=config.ladder_recover_s,
            window=config.ladder_window,
            min_samples=config.ladder_min_samples,
        )
        return cls(DegradationLadder(settings), TurnRateLimiter(config.max_turns_per_s))

    def listen(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call `callback(level)` on every level change; returns the unsubscribe function."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)

    def observe(self, first_response_s: float) -> None:
        self._announce(self.ladder.observe(first_response_s))

    def tick(self) -> None:
        self._announce(self.ladder.evaluate())

    def _announce(self, level: Optional[int]) -> None:
        if level is not None:
            for callback in list(self._listeners):
                callback(level)


class TurnRateLimiter(TokenBucket):
    """Token bucket over turns sent to the engine (per engine, not per session); bursts of a
    second's worth (one at least) unless told."""

    def __init__(
        self, rate_per_s: float = 20.0, burst: Optional[float] = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(rate_per_s, burst if burst is not None else max(1.0, rate_per_s), clock)
