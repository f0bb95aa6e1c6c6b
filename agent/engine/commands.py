"""The engine's commands: what the asyncio side asks of the engine thread, as typed messages.

Every command is a frozen dataclass; the engine thread (agent/engine/core.py) dispatches on its type
through one table, never on a name. The session a command is for travels beside it (the loop's
envelope), so a session's commands are plain data about *what*, not *whom*.

Two kinds:

- The turn's stream, each with its own Engine method (no answer, except where said): OpenSession
  (answered: opened, or why not), AppendAudio, AppendVideo (answered once taken: the sender's
  back-pressure signal), DiscardTurn, BeginReply, CancelReply, Speculate, DropSpeculation,
  CloseSession, and Stop (the whole engine).
- Session commands (`SessionCommand`): one runner method each, sent with `Engine.send(session_id,
  command)`, whose future gets the method's return value or its exception. A runner that lacks
  the capability a command needs (agent/engine/api.py: Speculating, VideoIntake, Transcribing,
  TurnControl, ConversationEdits, CallsTools) answers NotImplementedError.

Plain data only: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from agent.engine.api import ReplySink

# ---- the turn's stream -------------------------------------------------------------------


@dataclass(frozen=True)
class OpenSession:
    sink: ReplySink


@dataclass(frozen=True)
class AppendAudio:
    pcm: np.ndarray  # float32 mono 16 kHz


@dataclass(frozen=True)
class AppendVideo:
    image: np.ndarray  # RGB uint8 HxWx3
    at: float  # the frame's time on the session's audio clock


@dataclass(frozen=True)
class DiscardTurn:
    pass


@dataclass(frozen=True)
class BeginReply:
    images: tuple = ()  # the frames to show (empty: the newest taken)
    mode: str = "audio"  # audio | text | fallback (agent/engine/loop.py MODES)
    history: tuple = ()  # (role, text) pairs, for the fallback model


@dataclass(frozen=True)
class CancelReply:
    pass


@dataclass(frozen=True)
class Speculate:
    images: tuple = ()
    mode: str = "audio"


@dataclass(frozen=True)
class DropSpeculation:
    pass


@dataclass(frozen=True)
class CloseSession:
    pass


@dataclass(frozen=True)
class Stop:
    pass


StreamCommand = (
    OpenSession
    | AppendAudio
    | AppendVideo
    | DiscardTurn
    | BeginReply
    | CancelReply
    | Speculate
    | DropSpeculation
    | CloseSession
    | Stop
)


# ---- session commands: one runner method each ----------------------------------------------


@dataclass(frozen=True)
class SessionCommand:
    """A runner method run in order with the session's other commands (Engine.send)."""


@dataclass(frozen=True)
class SetTranscription(SessionCommand):
    mode: str  # off | on | only


@dataclass(frozen=True)
class SetTranscriptItem(SessionCommand):
    item_id: str


@dataclass(frozen=True)
class EndTurn(SessionCommand):
    pass


@dataclass(frozen=True)
class EndUserItem(SessionCommand):
    """A conversation's user item was committed with no reply asked (a manual commit, or server
    VAD without create_response): its audio ends here (a discard of the turn keeps it) and so
    does its transcript (`transcript` false: an audio item the client gave, not speech to
    transcribe); the turn goes on."""

    transcript: bool = True


@dataclass(frozen=True)
class SetInstructions(SessionCommand):
    text: str


@dataclass(frozen=True)
class SetContextTurns(SessionCommand):
    turns: int


@dataclass(frozen=True)
class SetVideo(SessionCommand):
    on: bool


@dataclass(frozen=True)
class SetPriority(SessionCommand):
    priority: int


@dataclass(frozen=True)
class HoldTurn(SessionCommand):
    pass


@dataclass(frozen=True)
class AddUserText(SessionCommand):
    text: str


@dataclass(frozen=True)
class AddSystemText(SessionCommand):
    text: str


@dataclass(frozen=True)
class AddAssistantText(SessionCommand):
    text: str
    # A replayed call right behind a replayed assistant message or call: it continues that
    # assistant turn (Qwen's template writes a message's text and its calls as one turn).
    joins: bool = False


@dataclass(frozen=True)
class AddUserImage(SessionCommand):
    image: np.ndarray  # RGB uint8 HxWx3, already sized for the vision encoder


@dataclass(frozen=True)
class SetVoice(SessionCommand):
    voice: str


@dataclass(frozen=True)
class SetReplyInstructions(SessionCommand):
    text: str


@dataclass(frozen=True)
class SetTools(SessionCommand):
    tools: object  # agent.tools.spec.ToolSet: the session's tools and tool choice


@dataclass(frozen=True)
class SetReplyTools(SessionCommand):
    tools: object  # a ToolSet for the next reply only; None: the session's


@dataclass(frozen=True)
class TruncateReply(SessionCommand):
    """Keep the latest reply's first `audio_frames` frames (a text reply's: tokens) in the
    model's context. missing_ok: a latest reply the model does not hold (one cancelled before
    its prefill ended, or the fallback model's) is no error: there is nothing to cut."""

    audio_frames: int
    missing_ok: bool = False


@dataclass(frozen=True)
class Context(SessionCommand):
    """The session's model context, for tests and diagnostics (StreamingRunner.context)."""


def describe(command: object) -> str:
    """A command's name in words, for messages: SetVoice() -> "set voice"."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", type(command).__name__).lower()
