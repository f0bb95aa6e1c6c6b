"""A runner that answers nothing, for an Engine's primary or fallback place in tests that watch
the other one (imported by test modules, not a test itself)."""

from __future__ import annotations

import numpy as np


class IdleRunner:
    """Records the sessions it was asked to reply to (`begun`), and never has work."""

    def __init__(self) -> None:
        self.begun: list[str] = []

    def open_session(self, sid: str) -> None: ...

    def close_session(self, sid: str) -> None: ...

    def append_audio(self, sid: str, pcm: np.ndarray) -> None: ...

    def discard_turn(self, sid: str) -> None: ...

    def begin_reply(self, sid: str, images: list, text_only: bool = False) -> None:
        self.begun.append(sid)

    def cancel_reply(self, sid: str) -> None: ...

    def has_work(self) -> bool:
        return False

    def idle_s(self) -> float:
        return 0.0

    def step(self) -> list:
        return []
