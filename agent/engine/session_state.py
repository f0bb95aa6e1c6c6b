"""Per-session streaming state: one resettable dataclass per session, one per reply.

Everything a session carries between engine steps lives here (its slot in the batched KV
caches and code2wav state, position counters, the talker's view of the user turns, the reply's
codec history), so that a session can be dropped or reset in one assignment. The tensors
themselves are rows of the runner's slot tensors (agent/engine/slots.py, code2wav_slots.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from agent.engine.audio_stream import AudioStream
from agent.engine.detok import IncrementalDecoder
from agent.engine.scheduler import PlayoutClock

if TYPE_CHECKING:  # turns.py builds on this module: annotation only
    from agent.engine.turns import ReplyPrefill


@dataclass
class KVState:
    """A session's row of a decoder's slot cache and where the next token goes.

    `length` is the physical cache length (the text-position row and the causal mask);
    `next_pos` the next multimodal-RoPE position, which runs ahead of `length` after images
    (an image's tokens share positions, the text after it continues from their max + 1).
    """

    slot: int
    length: int = 0
    next_pos: int = 0

    def crop(self, length: int, next_pos: int) -> None:
        """Forget everything after the first `length` tokens: a static cache masks keys by
        index, so what lies beyond is never read again and is overwritten by the next tokens."""
        self.length, self.next_pos = min(length, self.length), next_pos


@dataclass
class TalkerTurn:
    """One user turn as the talker sees it: the thinker's token ids and the talker inputs
    (text_projection of embeddings at text positions, hidden_projection of the thinker's
    accept layer at media positions), as generate() builds them."""

    ids: list[int] = field(default_factory=list)
    embeds: list[torch.Tensor] = field(default_factory=list)  # [1, n_i, hidden] pieces
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class TurnState:
    """The user turn being spoken: audio in, prefill as the audio becomes final."""

    audio: AudioStream
    pcm: list[np.ndarray] = field(default_factory=list)  # mic audio not yet encoded (busy engine)
    header_done: bool = False  # <|im_start|>user\n (and the previous reply's closing) prefilled
    audio_open: bool = False  # <|audio_start|> prefilled
    pending_audio: list[torch.Tensor] = field(default_factory=list)  # final tokens not yet prefilled
    audio_tokens: int = 0
    samples: int = 0
    # For a rollback (discard_turn) or a context reset: where the turn started, and what it
    # prefilled so far (token ids and the audio features that fill its audio pads).
    start_length: int = 0
    start_pos: int = 0
    ids: list[int] = field(default_factory=list)  # user-role ids prefilled (no closing, no assistant header)
    audio_feats: list[torch.Tensor] = field(default_factory=list)
    talker: TalkerTurn = field(default_factory=TalkerTurn)
    prefill_tokens: int = 0  # thinker tokens prefilled for this turn (closing and header included)
    history_reset: bool = False  # the context filled up and the history was dropped
    # Realtime API additions: user text items (after the audio, inside the same user message)
    # and a per-response system message put right before the assistant header.
    text_ids: list[int] = field(default_factory=list)
    reply_system_ids: list[int] = field(default_factory=list)


@dataclass
class ReplyState:
    """One reply in flight: thinker one token ahead of the talker, code2wav frame by frame."""

    text_only: bool
    talker_max_tokens: int
    turn: TurnState  # the user turn answered (from begin_reply on, state.turn is the next one)
    started: float  # runner clock at begin_reply
    images: list[np.ndarray] = field(default_factory=list)
    frames_encoded_at_end: int = 0  # of `images`, those not encoded on arrival (agent/engine/video.py)
    cancelled: bool = False
    job: ReplyPrefill | None = None  # the end-of-turn prefill while it runs in chunks
    prefilled: bool = False
    tokens: list[int] = field(default_factory=list)  # thinker tokens generated (the end token too)
    fed: int = 0  # how many of `tokens` the thinker cache holds
    thinker_done: bool = False
    thinker_reason: str = ""  # "stop" | "length"
    decoder: IncrementalDecoder | None = None  # the reply's text deltas (set at begin_reply)
    # talker
    talker_started: bool = False
    talker_done: bool = False
    talker_reason: str = ""
    codes0: list[int] = field(default_factory=list)  # codebook-0 tokens generated
    last_hidden: torch.Tensor | None = None  # talker's last hidden state for codes0[-1]
    next_codec_embed: torch.Tensor | None = None  # sum of the last frame's 16 codebook embeddings
    frame_codes: list[list[int]] = field(default_factory=list)  # all 16 codes of each rendered frame
    pending_frame: bool = False  # codes0[-1] still needs its residual codes and audio
    samples_out: int = 0
    first_audio: float | None = None  # seconds from begin_reply to the first audio
    playout: PlayoutClock = field(default_factory=PlayoutClock)  # the client's buffer, estimated
    stage_seconds: dict[str, float] = field(default_factory=dict)
    wav: list[np.ndarray] = field(default_factory=list)  # float samples, kept when recording


@dataclass(frozen=True)
class ReplyRecord:
    """What a finished reply produced, kept for tests and benchmarks (record=True)."""

    text_ids: tuple[int, ...]
    codes: np.ndarray  # [num_quantizers, frames]
    wav: np.ndarray  # float32 at 24 kHz
    prefill_tokens: int  # thinker tokens prefilled for this turn (its own, not the history's)


@dataclass(frozen=True)
class LastReply:
    """Where the session's latest finished reply sits in the thinker cache, for a truncation:
    its tokens start at (start_length, start_pos); `fed` of them are in the cache."""

    start_length: int
    start_pos: int
    tokens: tuple[int, ...]  # text tokens (no end token)
    fed: int


@dataclass
class SessionState:
    slot: int  # the session's row in every slot tensor (thinker, talker, code2wav)
    thinker: KVState
    talker: KVState
    turn: TurnState
    # The talker cache starts with every earlier user turn (generate() gives the talker all user
    # turns of the prompt); a turn answered text-only waits in the backlog until the next spoken reply.
    talker_backlog: list[TalkerTurn] = field(default_factory=list)
    talker_history_length: int = 0  # talker cache length covering the earlier user turns
    talker_history_pos: int = 0
    closing: list[int] = field(default_factory=list)  # the previous reply's unfed tail + <|im_end|>\n
    reply: ReplyState | None = None
    pending_stages: list[tuple[str, float]] = field(default_factory=list)  # emitted by the next step()
    system_prompt: str | None = None  # the session's own instructions (None: the runner's)
    voice: str = ""  # the talker speaker of the session's replies ("": the loaded one)
    pending_system: list[int] = field(default_factory=list)  # a system message for the next turn's start
    last_reply: LastReply | None = None  # until the next reply begins


def mrope_positions(
    ids: Sequence[int],
    start: int,
    grids: Iterator[tuple[int, int, int]],
    image_pad: int,
    merge: int,
    position_id_per_seconds: float,
) -> tuple[torch.Tensor, int]:
    """[3, n] multimodal RoPE positions of `ids`, continuing from `start`; and the next position.

    Equal to transformers' get_rope_index on a prompt holding text, audio and images (no
    video): text and audio advance by one per token; an image's tokens take (t, h, w) offsets
    from the position after <|vision_start|>, and what follows continues from their max + 1.
    """
    out = torch.empty(3, len(ids), dtype=torch.long)
    pos, i = start, 0
    while i < len(ids):
        if ids[i] != image_pad:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        t, h, w = next(grids)
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if any(tok != image_pad for tok in ids[i : i + count]):
            raise ValueError("image placeholder run does not match its grid")
        t_idx = (torch.arange(t).float() * position_id_per_seconds).long().view(-1, 1, 1).expand(t, gh, gw)
        h_idx = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
        w_idx = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
        block = torch.stack([t_idx.flatten(), h_idx.flatten(), w_idx.flatten()]) + pos
        out[:, i : i + count] = block
        pos = int(block.max()) + 1
        i += count
    return out, pos


@contextmanager
def timed(state: SessionState, stage: str) -> Iterator[None]:
    """Time one session's work: a StageTime of the next step() output and the reply's totals."""
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    state.pending_stages.append((stage, elapsed))
    if state.reply is not None:
        state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed


def add_batch_time(states: Sequence[SessionState], stage: str, elapsed: float) -> None:
    """A batched stage's wall time counts in full for every reply in the batch (each waited for it)."""
    for state in states:
        if state.reply is not None:
            state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed
