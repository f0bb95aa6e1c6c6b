"""What crosses the boundary between the asyncio side and the engine thread.

The engine thread calls a Runner (engine-thread only, owns every torch object) and turns
its outputs into callbacks on the asyncio loop. The commands that go the other way are in
agent/engine/commands.py; the Runner protocol and its optional capabilities (below) name every
method a command may reach. Everything here is plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, TypeGuard, TypeVar, Union

import numpy as np


@dataclass(frozen=True)
class TextDelta:
    session_id: str
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallDelta:
    """Text of a reply's tool call `index` (0, 1, … within the reply): what the thinker wrote
    between `<tool_call>` and `</tool_call>` (the tags are not in it); `done` at the closing tag.
    Never voiced and never in the transcript (agent/engine/stages/frame_batch.py)."""

    session_id: str
    index: int
    text: str
    done: bool = False


@dataclass(frozen=True)
class AudioOut:
    """PCM for the outbound track: int16 mono at 24 kHz (one codec frame is 1920 samples)."""

    session_id: str
    pcm: np.ndarray


@dataclass(frozen=True)
class ReplyInput:
    """What a reply's end-of-turn prefill put in the model, sent as soon as it is done (its
    counts: prefill_tokens, input_audio/image/video_tokens). A response cancelled later still
    reports its input usage from it: the cancelled reply's own ReplyDone comes after the
    client has been told the response is done."""

    session_id: str
    stats: dict = field(default_factory=dict)


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


Output = Union[TextDelta, CallDelta, AudioOut, ReplyInput, ReplyDone, StageTime, TranscriptOut]


@dataclass(frozen=True)
class Voices:
    """The talker speakers a session may name in `audio.output.voice`, and the one "default"
    means. Read once the model is loaded (the page's voice picker lists them); empty for a runner
    that speaks with one voice only."""

    names: tuple[str, ...] = ()
    default: str = ""


class Runner(Protocol):
    """The model side of the engine. Every method runs on the engine thread only.

    A session streams its microphone audio in with append_audio while the user speaks
    (a runner may encode and prefill it incrementally); begin_reply marks the end of the
    turn; step() advances every active reply by one unit of work and returns what it made.

    These are what every runner does (GenerateRunner in agent/engine/runner/reference.py, the
    text-only FallbackRunner). The optional capabilities are the small Protocols below, each
    all-or-nothing; the engine loop looks for them with `supports` and answers a command that
    needs one the runner lacks with NotImplementedError. StreamingRunner has every one.
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


class Speculating(Protocol):
    """Start the reply on a pause of the turn, its output held (agent/engine/runner/speculation.py)."""

    def speculate(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> bool:
        """Start the reply to the turn so far; its output is held until begin_reply commits it."""
        ...

    def drop_speculation(self, session_id: str) -> bool:
        """The user went on: discard the held reply, if any, invisibly."""
        ...

    def take_ready(self) -> list[Output]:
        """Output made by a command, not a step: the held output a committed speculation
        released, a cancelled reply's end (the loop emits it at once)."""
        ...


class VideoIntake(Protocol):
    """The camera as video in the turn, encoded as frames arrive (agent/engine/runner/intake.py)."""

    def append_video(self, session_id: str, image: np.ndarray, at: float) -> None:
        """One RGB uint8 HxWx3 frame at `at` seconds on the session's audio clock."""

    def set_video(self, session_id: str, on: bool) -> bool: ...


class TurnControl(Protocol):
    """Scheduling of a session's turns (agent/engine/runner/intake.py)."""

    def hold_turn(self, session_id: str) -> int:
        """End the turn without a reply yet: it waits, apart, for a later begin_reply."""
        ...

    def set_priority(self, session_id: str, priority: int) -> int: ...


class Transcribing(Protocol):
    """Transcripts of the user's turns (agent/engine/runner/transcriber.py)."""

    def set_transcription(self, session_id: str, mode: str) -> str:
        """mode: off | on | only (a transcription session: nothing is answered)."""
        ...

    def set_transcript_item(self, session_id: str, item_id: str) -> None: ...

    def end_turn(self, session_id: str) -> None:
        """A transcription session's turn ended: its final transcript follows."""

    def end_user_item(self, session_id: str, transcript: bool = True) -> None:
        """A conversation's user item ended with no reply asked: where it ends is marked (a
        discard keeps it) and, with `transcript`, its final transcript follows (the turn goes
        on: the model answers its items together)."""


class ConversationEditing(Protocol):
    """Edits of a session's conversation in the model's context (agent/engine/runner/edits.py)."""

    def add_user_text(self, session_id: str, text: str) -> int: ...

    def add_system_text(self, session_id: str, text: str) -> int:
        """A system message item, in the conversation where it is added."""
        ...

    def add_assistant_text(self, session_id: str, text: str, joins: bool = False) -> int:
        """An assistant message item (a replayed conversation), where it is added; `joins`: it
        continues the assistant turn replayed just before, if that is still the last one added."""
        ...

    def drop_turn_items(self, session_id: str) -> None:
        """The turn's text and image items go (another runner answered them)."""

    def add_user_image(self, session_id: str, image: Any) -> int:
        """An image of the user's message (RGB uint8 HxWx3): shown with the turn being spoken."""
        ...

    def set_voice(self, session_id: str, voice: str) -> str: ...

    def set_instructions(self, session_id: str, text: str) -> str: ...

    def set_context_turns(self, session_id: str, turns: int) -> int: ...

    def set_reply_instructions(self, session_id: str, text: str) -> int: ...

    def truncate_reply(self, session_id: str, audio_frames: int, missing_ok: bool = False) -> dict:
        """Keep the latest reply's text up to its first `audio_frames` codec frames (missing_ok:
        no latest reply in the model's context is no error)."""
        ...

    def context(self, session_id: str) -> dict: ...


class CallsTools(Protocol):
    """Tool calls in Qwen's format, grammar-constrained (agent/engine/stages/tool_grammar.py)."""

    def set_tools(self, session_id: str, tools: Any) -> int:
        """The session's tools and tool choice (an agent.tools.spec.ToolSet) for its next
        replies; returns how many tools. Raises ToolSchemaError for a schema the grammar
        cannot take."""
        ...

    def set_reply_tools(self, session_id: str, tools: Any) -> int:
        """The next reply's own tools (a ToolSet; None: the session's). Call before begin_reply."""
        ...


class Speaks(Protocol):
    """More than one talker speaker to choose from (what SetVoice picks among)."""

    def voices(self) -> Voices: ...


class TakesHistory(Protocol):
    """A runner without KV context (the fallback) is told the recent conversation per reply."""

    def set_history(self, session_id: str, history: Sequence[tuple[str, str]]) -> None: ...


Capability = TypeVar("Capability")
_MEMBERS: dict[type, tuple[str, ...]] = {}


def supports(runner: Any, capability: type[Capability]) -> TypeGuard[Capability]:
    """Whether `runner` has every method of the capability Protocol. Looked up with getattr, so a
    wrapper that forwards its runner's methods (tests wrap runners so) has what its runner has."""
    members = _MEMBERS.get(capability)
    if members is None:
        members = _MEMBERS[capability] = tuple(
            name for name, value in vars(capability).items() if callable(value) and not name.startswith("_")
        )
    return all(callable(getattr(runner, name, None)) for name in members)


def voices_of(runner: Any) -> Voices:
    """The voices a session of this runner may choose: none where it has no choice to offer
    (the reference and fallback runners speak, if at all, with the loaded speaker)."""
    if supports(runner, Speaks) and supports(runner, ConversationEditing):
        return runner.voices()
    return Voices()


class ReplySink(Protocol):
    """Per-session receiver of engine output. Called on the asyncio loop only. Optional, looked
    up when needed: on_transcript(TranscriptOut), on_call(CallDelta), on_input(ReplyInput), and
    on_open_failed(message) when the engine could not open the session at all."""

    def on_text(self, delta: TextDelta) -> None: ...

    def on_audio(self, audio: AudioOut) -> None: ...

    def on_done(self, done: ReplyDone) -> None: ...


class EngineBusy(RuntimeError):
    """The inbox is full: the engine is not keeping up with this many sessions."""


class SlotsExhausted(RuntimeError):
    """Every slot of the engine's static caches is taken (agent/engine/ops/slots.py SlotPool): the
    engine is at capacity, which a client hears as such (error code `capacity`), not as a failure."""
