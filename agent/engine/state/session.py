"""Per-session streaming state: one resettable dataclass per session, one per reply (its phase
in agent/engine/state/phase.py, moved only by agent/engine/runner/replies.py; what its stages
made in agent/engine/state/reply.py, each advanced by its own stage).

Everything a session carries between engine steps lives here (its slot in the batched KV
caches and code2wav state, position counters, the talker's view of the user turns, the reply's
codec history), so that a session can be dropped or reset in one assignment. The tensors
themselves are rows of the runner's slot tensors (agent/engine/ops/slots.py, agent/engine/codecs/code2wav.py).

Two members are objects of their stages rather than plain data: a turn's AudioStream (the
incremental log-mel and encoder state, agent/engine/stages/audio_stream.py) and its TurnVideo
(the turn's grids on the audio clock, agent/engine/stages/video_clock.py). Each advances itself
and belongs to the one turn that holds it; nothing else in this package imports a stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from agent.engine.api import Output
from agent.engine.stages.audio_stream import AudioStream
from agent.engine.stages.video_clock import TurnVideo
from agent.engine.state.kv import KVState
from agent.engine.state.phase import ReplyPhase
from agent.engine.state.reply import CallStage, PlayoutClock, PrefillStage, TextStage, VoiceStage
from agent.engine.state.video import AVBlock, GridPlace


@dataclass
class TalkerTurn:
    """One user turn as the talker sees it: the thinker's token ids and the talker inputs
    (text_projection of embeddings at text positions, hidden_projection of the thinker's
    accept layer at media positions), as generate() builds them."""

    ids: list[int] = field(default_factory=list)
    embeds: list[torch.Tensor] = field(default_factory=list)  # [1, n_i, hidden] pieces
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class TalkerHistory:
    """The earlier user turns in a session's talker cache (generate() gives the talker every user
    turn of the prompt): the cache length and position that cover them, and the turns answered
    text-only since, which wait in the backlog until the next spoken reply. Changed by the
    talker's prefix (agent/engine/stages/reply_prefill.py), a history reset and a reply's end."""

    backlog: list[TalkerTurn] = field(default_factory=list)
    length: int = 0  # talker cache length covering the earlier user turns
    pos: int = 0

    def copy(self) -> TalkerHistory:
        return TalkerHistory(list(self.backlog), self.length, self.pos)


@dataclass
class TurnVideoState:
    """A turn's camera as video (agent/engine/stages/video_clock.py), changed by VideoPrefill
    (agent/engine/stages/video_prefill.py) only, and by a history reset that replays the turn:
    the turn's grids (None: no video in this turn), the audio-in-video block while it is open,
    and the grids prefilled so far (features and places, for a replay)."""

    grids: TurnVideo | None = None
    block: AVBlock | None = None
    feats: list = field(default_factory=list)  # ImageFeatures per placed grid
    places: list[GridPlace] = field(default_factory=list)

    def fork(self) -> TurnVideoState:
        return TurnVideoState(
            self.grids.fork() if self.grids is not None else None,
            replace(self.block) if self.block is not None else None,
            list(self.feats),
            list(self.places),
        )


def join_text(before: list[int], ids: list[int], newline: Sequence[int]) -> list[int]:
    """A turn's user text items, each on a line of its own: two messages run together would
    read as one sentence ("Hi.What is this?"), and a function call's results are joined so in
    Qwen's template (agent/tools/qwen_format.py)."""
    return [*before, *newline, *ids] if before and ids else [*before, *ids]


@dataclass
class TurnState:
    """The user turn being spoken: audio in, prefill as the audio becomes final."""

    audio: AudioStream
    pcm: list[np.ndarray] = field(default_factory=list)  # mic audio not yet encoded (busy engine)
    header_done: bool = False  # <|im_start|>user\n (and the previous reply's closing) prefilled
    audio_open: bool = False  # <|audio_start|> prefilled
    pending_audio: list[torch.Tensor] = field(default_factory=list)  # final tokens not yet prefilled
    # Where the turn's committed user items end (TurnPrefill.cut_audio: an item committed with
    # no reply asked): its audio tokens and samples then. A discard keeps them: the conversation
    # lists those items, so the model keeps their audio (TurnPrefill.drop_speech).
    kept_tokens: int = 0
    kept_samples: int = 0
    samples: int = 0
    # For a rollback (discard_turn) or a context reset: where the turn started, and what it
    # prefilled so far (token ids and the audio features that fill its audio pads).
    start_length: int = 0
    start_pos: int = 0
    ids: list[int] = field(default_factory=list)  # user-role ids prefilled (no closing, no assistant header)
    audio_feats: list[torch.Tensor] = field(default_factory=list)
    talker: TalkerTurn = field(default_factory=TalkerTurn)
    prefill_tokens: int = 0  # thinker tokens prefilled for this turn (closing and header included)
    # A part of the turn begun while the user speaks and not all in the cache yet (a TurnJob of
    # agent/engine/stages/turn_parts.py: one whose closing is long goes in a chunk per tick);
    # nothing else of the turn is prefilled before it.
    flushing: Any = None
    history_reset: bool = False  # the context filled up and the history was dropped
    # Realtime API additions: user text items (after the audio, inside the same user message,
    # each on a line of its own: add_text) and a per-response system message put right before
    # the assistant header.
    text_ids: list[int] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)  # user image items (RGB uint8), shown after the audio
    reply_system_ids: list[int] = field(default_factory=list)
    reply_tools: Any = None  # a per-response ToolSet (None: the session's); ends with its response
    video: TurnVideoState = field(default_factory=TurnVideoState)  # the camera as video
    # A speculation's fork: the turn it was copied from, so that what follows the turn being
    # spoken (its transcript, agent/engine/runner/transcriber.py) knows the fork is that turn.
    origin: TurnState | None = field(default=None, compare=False, repr=False)

    @property
    def audio_token_count(self) -> int:
        """The turn's final audio tokens so far, prefilled or waiting."""
        return sum(int(t.shape[0]) for t in (*self.audio_feats, *self.pending_audio))

    @property
    def queued_seconds(self) -> float:
        """The turn's audio the engine has so far (encoded or queued): the clock frames are put on."""
        return (self.samples + sum(len(p) for p in self.pcm)) / 16000

    def fork(self) -> TurnState:
        """A copy to answer speculatively: the speculation may prefill, finish the encoder and
        record the talker's view on it, while this one goes on receiving the user's audio."""
        talker = TalkerTurn(list(self.talker.ids), list(self.talker.embeds), list(self.talker.image_grids))
        return replace(
            self,
            audio=self.audio.fork(),
            pcm=list(self.pcm),
            pending_audio=list(self.pending_audio),
            ids=list(self.ids),
            audio_feats=list(self.audio_feats),
            talker=talker,
            text_ids=list(self.text_ids),
            images=list(self.images),
            reply_system_ids=list(self.reply_system_ids),
            video=self.video.fork(),
            origin=self,
        )


@dataclass
class ReplyState:
    """One reply in flight. Its `phase` (agent/engine/state/phase.py) is moved only by the
    runner's reply lifecycle (agent/engine/runner/replies.py); each stage keeps what it has made
    in its own object (agent/engine/state/reply.py), advanced by its own module: `prefill` by
    agent/engine/stages/turn_prefill.py, `text` (thinker) and `voice` (talker, code predictor,
    code2wav) by agent/engine/stages/frame_batch.py."""

    phase: ReplyPhase
    text_only: bool
    turn: TurnState  # the user turn answered (from begin_reply on, state.turn is the next one)
    started: float  # runner clock at begin_reply (a speculation: at its commit)
    prefill: PrefillStage
    text: TextStage
    voice: VoiceStage
    calls: CallStage = field(default_factory=CallStage)  # its tool calls
    images: list[np.ndarray] = field(default_factory=list)
    frames_encoded_at_end: int = 0  # of `images`, those not encoded on arrival (agent/engine/state/latest_frames.py)
    first_audio: float | None = None  # seconds from begin_reply to the first audio
    prefill_done: float | None = None  # seconds from begin_reply to the end of its prefill (engine-timed)
    playout: PlayoutClock = field(default_factory=PlayoutClock)  # the client's buffer, estimated
    stage_seconds: dict[str, float] = field(default_factory=dict)
    held: list[Output] = field(default_factory=list)  # a speculation's output, until its commit
    rollback: Rollback | None = None  # a speculation: how to undo it
    from_speculation: bool = False  # committed from a speculative start
    seed: int = 0  # the reply's sampling stream (agent/engine/ops/sampling.py): its draws depend on nothing else

    def move(self, phase: ReplyPhase) -> None:
        self.phase = self.phase.to(phase)

    @property
    def finished(self) -> bool:
        """Both stages are done: nothing left to make."""
        return self.text.done and (self.text_only or self.voice.done)


@dataclass(frozen=True)
class Rollback:
    """What a speculative reply may change in its session, as it was before the reply began: a
    discard puts these back. The KV caches need no copy: their rows are static, and lowering
    a length forgets everything past it (KVState.crop). The answered turn needs none either:
    the speculation works on a fork of it (TurnState.fork) while the original keeps listening."""

    thinker: tuple[int, int]  # (length, next_pos)
    talker: tuple[int, int]
    talker_history: TalkerHistory  # a copy
    closing: tuple[int, ...]
    closing_tail: int
    last_reply: LastReply | None

    @classmethod
    def of(cls, state: SessionState) -> Rollback:
        return cls(
            (state.thinker.length, state.thinker.next_pos),
            (state.talker.length, state.talker.next_pos),
            state.talker_history.copy(),
            tuple(state.closing),
            state.closing_tail,
            state.last_reply,
        )

    def restore(self, state: SessionState) -> None:
        state.thinker.crop(*self.thinker)
        state.talker.crop(*self.talker)
        state.talker_history = self.talker_history.copy()
        state.closing, state.closing_tail = list(self.closing), self.closing_tail
        state.last_reply = self.last_reply


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
    voice_end: int | None = None  # where its first tool call starts: the talker spoke none of it


@dataclass
class SessionChoices:
    """What the session asked for, by its commands: set only by the runner's command components
    (edits: instructions, voice, context turns; intake: the camera switch; transcription
    commands: transcription-only), read by the stages."""

    system_prompt: str | None = None  # the session's own instructions (None: the runner's)
    voice: str = ""  # the talker speaker of the session's replies ("": the loaded one)
    max_turns: int = 0  # a bounded context (interpreter mode): answered turns kept at most; 0: no bound
    captions_only: bool = False  # a transcription-only session: no replies, its turns never prefilled
    video: bool = True  # the camera enters its turns as video (the session's switch; --no-video: off for all)
    tools: Any = None  # the session's ToolSet (agent/tools/spec.py); None: no tools


@dataclass
class SessionState:
    slot: int  # the session's row in every slot tensor (thinker, talker, code2wav)
    thinker: KVState
    talker: KVState
    turn: TurnState
    # The talker cache starts with every earlier user turn; see TalkerHistory.
    talker_history: TalkerHistory = field(default_factory=TalkerHistory)
    closing: list[int] = field(default_factory=list)  # the previous reply's unfed tail + <|im_end|>\n
    # How many of closing's first tokens end the previous reply (its unfed tail and its end); the
    # rest are whole turns added since (system and assistant items), which a history reset keeps,
    # but for the instruction changes among them (the reset's system prompt is the latest).
    closing_tail: int = 0
    instruction_turns: list[list[int]] = field(default_factory=list)
    reply: ReplyState | None = None
    # (stage, seconds, sessions in the call) for StageTime outputs, emitted by the next step()
    pending_stages: list[tuple[str, float, int]] = field(default_factory=list)
    choices: SessionChoices = field(default_factory=SessionChoices)  # what the session asked for
    # Whole turns added during a reply (system and assistant items, changed instructions): they
    # follow its closing, at the start of the next user turn.
    after_reply: list[int] = field(default_factory=list)
    last_reply: LastReply | None = None  # until the next reply begins
    # The assistant turn the client replayed last, as added (edits.py): a call replayed right
    # behind it joins it while it still ends the turns waiting to be prefilled.
    replayed_turn: tuple[int, ...] = ()
    context_turns: int = 0  # answered turns in the thinker cache since its last history reset
    last_frame: tuple[float, np.ndarray] | None = None  # (engine clock, frame): seeds the next turn's first grid
    # Turns that ended while a reply was in flight (interpreter mode), oldest first: each is
    # answered by the next begin_reply, in order; none is prefilled before its reply starts.
    held_turns: list[TurnState] = field(default_factory=list)
    # The system prompt while it goes into the cache in chunks: a PrefillJob
    # (agent/engine/stages/thinker.py) of SystemPrefill's (agent/engine/stages/system_prefill.py),
    # the stage's own type; None once it is all in. Nothing else of the session is prefilled before.
    system: Any = None

    def closing_prefilled(self) -> None:
        """The closing is in the cache (or went with the history): none waits, nothing to replay."""
        self.closing, self.closing_tail, self.instruction_turns = [], 0, []


@contextmanager
def timed(state: SessionState, stage: str) -> Iterator[None]:
    """Time one session's work: a StageTime of the next step() output and the reply's totals."""
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    state.pending_stages.append((stage, elapsed, 1))
    if state.reply is not None:
        state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed


@contextmanager
def timed_all(states: Sequence[SessionState], stage: str) -> Iterator[None]:
    """`timed` for a batched call: every session in it waited for all of it."""
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    for state in states:
        # One call: /metrics counts its time and the call once (StageTime.batch), each session's
        # histogram the whole wait.
        state.pending_stages.append((stage, elapsed, len(states)))
        if state.reply is not None:
            state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed


def add_batch_time(states: Sequence[SessionState], stage: str, elapsed: float) -> None:
    """A batched stage's wall time counts in full for every reply in the batch (each waited for it)."""
    for state in states:
        if state.reply is not None:
            state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed
