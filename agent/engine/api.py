"""What crosses the boundary between the asyncio side and the engine thread.

The engine thread calls a Runner (engine-thread only, owns every torch object) and turns
its outputs into callbacks on the asyncio loop. Everything here is plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Union

import numpy as np


@dataclass(frozen=True)
class TextDelta:
    session_id: str
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AudioOut:
    """PCM for the outbound track: int16 mono at 24 kHz (one codec frame is 1920 samples)."""

    session_id: str
    pcm: np.ndarray


@dataclass(frozen=True)
class ReplyDone:
    session_id: str
    reason: str  # "stop" (model ended) | "length" (cap reached) | "cancelled" | "error"
    text: str = ""
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TranscriptOut:
    """A transcript of the user's turn (agent/engine/runner/transcriber.py): the whole text so far, of
    which the first `stable_chars` characters are final; `final`: the turn's last one."""

    session_id: str
    item_id: str | None  # the user item, as the session named it (set_transcript_item)
    text: str
    stable_chars: int
    final: bool = False


@dataclass(frozen=True)
class StageTime:
    """One stage's duration, for agent_stage_seconds{stage=...}."""

    stage: str  # preprocessing | audio_encoder | vision_encoder | thinker_prefill | thinker_decode
    # | talker_step | code_predictor | code2wav | generate
    seconds: float
    session_id: str = ""
    batch: int = 1  # sessions served by the same (batched) call; `seconds` is the whole call's


Output = Union[TextDelta, AudioOut, ReplyDone, StageTime, TranscriptOut]


class Runner(Protocol):
    """The model side of the engine. Every method runs on the engine thread only.

    A session streams its microphone audio in with append_audio while the user speaks
    (a runner may encode and prefill it incrementally); begin_reply marks the end of the
    turn; step() advances every active reply by one unit of work and returns what it made.

    Optional (the engine loop uses them where a runner has them; StreamingRunner does):
    speculate(session_id, images, text_only) starts the reply on a pause, its output held;
    drop_speculation(session_id) discards it; begin_reply commits it, and take_ready() returns
    the held output it released, which the loop emits at once.
    """

    def open_session(self, session_id: str) -> None: ...

    def close_session(self, session_id: str) -> None: ...

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        """pcm: float32 mono 16 kHz in [-1, 1], any length."""

    def discard_turn(self, session_id: str) -> None:
        """Forget audio appended since the last reply (a false start)."""

    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> None:
        """End of turn: images are RGB uint8 HxWx3 frames sampled during the turn."""

    def cancel_reply(self, session_id: str) -> None:
        """Barge-in: stop the reply now; the next step emits ReplyDone(reason="cancelled")."""

    def has_work(self) -> bool: ...

    def idle_s(self) -> float:
        """With has_work(): seconds a step can wait and lose nothing (0: step now)."""
        ...

    def step(self) -> list[Output]: ...


class ReplySink(Protocol):
    """Per-session receiver of engine output. Called on the asyncio loop only. Optional, looked
    up when needed: on_transcript(TranscriptOut), and on_open_failed(message) when the engine
    could not open the session at all."""

    def on_text(self, delta: TextDelta) -> None: ...

    def on_audio(self, audio: AudioOut) -> None: ...

    def on_done(self, done: ReplyDone) -> None: ...


class EngineBusy(RuntimeError):
    """The inbox is full: the engine is not keeping up with this many sessions."""
