"""A reply's parts of state (ReplyState.prefill, .text, .voice, .playout in
agent/engine/state/session.py), one small object each, living with the rest of the engine's
state and each advanced by one owner only: PrefillStage by agent/engine/stages/turn_prefill.py
(its end-of-turn part, agent/engine/stages/reply_prefill.py), TextStage (the thinker) and
VoiceStage (talker, code predictor, code2wav) by agent/engine/stages/frame_batch.py, and the
PlayoutClock (the client's buffer, estimated) by the frame batcher as frames go out (the reply
lifecycle, agent/engine/runner/replies.py, starts it over at a speculation's commit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agent.engine.codecs.detok import IncrementalDecoder


@dataclass
class PrefillStage:
    """A reply's end-of-turn prefill, advanced by TurnPrefill: the job while it runs in chunks."""

    # The running job: a ReplyPrefill (agent/engine/stages/reply_prefill.py), the stage's own type.
    job: Any = None
    done: bool = False  # the prompt is in the thinker cache; the reply's first token can be taken


@dataclass
class TextStage:
    """A reply's thinker side: its tokens (the end token too) and how many the thinker cache
    holds (the thinker stays one token ahead of the talker)."""

    decoder: IncrementalDecoder  # the reply's text deltas
    tokens: list[int] = field(default_factory=list)
    fed: int = 0
    done: bool = False
    reason: str = ""  # "stop" | "length"
    # The index of the reply's first <tool_call>: the talker reads the tokens before it only
    # (None: no call yet, the talker reads every token).
    voice_end: int | None = None

    def talker_view(self) -> tuple[int, bool]:
        """(n, ended) as the talker reads the reply: its tokens are tokens[:n], and when `ended`
        the last of them (the end token, the capped last one, or the first <tool_call>) is not
        read but closes its text side."""
        if self.voice_end is not None:
            return self.voice_end + 1, True
        return len(self.tokens), self.done


@dataclass
class CallStage:
    """A reply's tool calls (agent/engine/stages/frame_batch.py advances it): the grammar that
    constrains them (a ToolMatcher, agent/engine/stages/tool_grammar.py; None: the reply may not
    call, and <tool_call> is plain text unless `banned`) and the call being written."""

    matcher: Any = None
    banned: bool = False  # tool choice none: the tools are in the context, but no call may begin
    open: bool = False  # inside <tool_call> … </tool_call>
    count: int = 0  # calls opened so far
    tokens: int = 0  # tokens inside calls (they do not count against the reply's text cap)
    decoder: IncrementalDecoder | None = None  # the open call's text


@dataclass
class VoiceStage:
    """A reply's talker, code-predictor and code2wav side."""

    max_tokens: int  # talker (codebook-0) tokens at most: the reply's audio cap
    started: bool = False  # its talker prefix is in the talker cache
    read: int = 0  # reply tokens the talker has read (its prefix reads the first)
    done: bool = False
    reason: str = ""
    codes0: list[int] = field(default_factory=list)  # codebook-0 tokens generated
    last_hidden: torch.Tensor | None = None  # talker's last hidden state for codes0[-1]
    next_codec_embed: torch.Tensor | None = None  # sum of the last frame's 16 codebook embeddings
    frame_codes: list[list[int]] = field(default_factory=list)  # all 16 codes of each rendered frame
    pending_frame: bool = False  # codes0[-1] still needs its residual codes and audio
    samples_out: int = 0
    wav: list[np.ndarray] = field(default_factory=list)  # float samples, kept when recording


@dataclass
class PlayoutClock:
    """Where the session's outbound audio stands, as the engine can tell without the client."""

    first_audio_at: float | None = None  # runner clock at the reply's first audio
    play_end: float | None = None  # when the audio handed out so far ends playing
    produced_s: float = 0.0

    def add(self, now: float, seconds: float) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = now
        start = now if self.play_end is None else max(self.play_end, now)
        self.play_end = start + seconds
        self.produced_s += seconds

    def buffer_s(self, now: float) -> float | None:
        return None if self.play_end is None else self.play_end - now
