"""The camera frames the engine holds per session (engine thread only).

Frames reach the engine as they are sampled (Engine.append_video), not all at once at the end
of the turn: taking them is what tells the session's VideoFeed that the engine keeps up, and
its backlog is what the sender is throttled by (agent/media/backpressure.py). A runner that takes the
camera as video itself (StreamingRunner.append_video: agent/engine/stages/video_prefill.py) puts every
frame in the turn; one that does not (the reference and fallback runners) is given the newest
`keep` of them with the reply, as still images.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class LatestFrames:
    """Per session, the newest `keep` frames taken (RGB uint8 HxWx3) with their audio-clock time."""

    def __init__(self, keep: int) -> None:
        assert keep >= 0
        self._keep = keep
        self._frames: dict[str, deque[tuple[float, np.ndarray]]] = {}

    def add(self, session_id: str, image: np.ndarray, at: float) -> None:
        frames = self._frames.get(session_id)
        if frames is None:
            frames = self._frames[session_id] = deque(maxlen=self._keep)
        frames.append((at, image))

    def latest(self, session_id: str) -> list[np.ndarray]:
        """The newest frames, oldest first (left in place: a turn without new ones sees the same view)."""
        return [image for _, image in self._frames.get(session_id, ())]

    def drop(self, session_id: str) -> None:
        self._frames.pop(session_id, None)
