"""What the agent is playing, for the echo guard: the level of its recent outbound audio.

Through a speakerphone the agent hears itself: its reply comes back in the microphone some
50-300 ms later (network both ways, the client's jitter buffer and playout, our 80 ms chunks),
attenuated by the room and by the browser's echo canceller. While audio plays, the endpointer
(agent/media/vad.py) therefore lets a sub-frame count towards a barge-in only when it is louder than
``margin_db`` under the loudest 20 ms the agent sent within ``window_s``: the window covers the
echo's delay, and the loudest frame bounds what its echo can be. The outbound track owns this
meter (it records each frame it sends); the endpointer only reads it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import numpy as np


def rms(pcm: np.ndarray) -> float:
    """RMS of int16 samples on a 0..1 scale (full-scale square wave = 1)."""
    if not len(pcm):
        return 0.0
    x = pcm.astype(np.float64) / 32768.0
    return float(np.sqrt(np.mean(x * x)))


def threshold_gain(margin_db: float) -> float:
    """Linear gain of a level margin in dB (-6 dB -> 0.5)."""
    return float(10 ** (margin_db / 20))


class PlayoutLevel:
    """The loudest recent outbound frame: None once nothing audible was sent for window_s."""

    def __init__(self, window_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._frames: deque[tuple[float, float]] = deque()  # (sent at, rms), audible frames only

    def record(self, pcm: np.ndarray) -> None:
        """One frame just handed to the sender (int16). Silence is not recorded."""
        level = rms(pcm)
        if level > 0.0:
            self._frames.append((self._clock(), level))
            self._expire(self._clock())

    def clear(self) -> None:
        self._frames.clear()

    def level(self) -> Optional[float]:
        self._expire(self._clock())
        return max((v for _, v in self._frames), default=None)

    def _expire(self, now: float) -> None:
        while self._frames and now - self._frames[0][0] > self.window_s:
            self._frames.popleft()
