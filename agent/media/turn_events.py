"""The events of a turn on the session's audio clock, as the endpointer (agent/media/vad.py) reports
them and the session's turn-taking (agent/realtime/server_turn.py) acts on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from agent.media.ingest import AudioChunk


@dataclass(frozen=True)
class SpeechStarted:
    """A turn began. ``at``: start of its audio (pre-roll included), ``onset``: first voiced sub-frame."""

    at: float
    onset: float


@dataclass(frozen=True)
class SpeechAudio:
    """One chunk of the current turn: the pre-roll first, then every chunk until the turn ends."""

    chunk: AudioChunk


@dataclass(frozen=True)
class SpeechStopped:
    """End of turn. ``at``: when the silence reached silence_ms (or the forced cut),
    ``end_of_speech``: end of the last voiced sub-frame."""

    at: float
    end_of_speech: float
    forced: bool = False  # max_turn_s reached while still speaking


@dataclass(frozen=True)
class SpeechPaused:
    """Inside a turn, ``pause_ms`` of unvoiced audio since ``end_of_speech``: the turn may be
    over (it is, if the silence reaches ``silence_ms`` before any voice)."""

    at: float
    end_of_speech: float


@dataclass(frozen=True)
class SpeechResumed:
    """Voice again after a SpeechPaused, before the turn ended: the pause was mid-sentence."""

    at: float


@dataclass(frozen=True)
class BargeInCandidate:
    """While the agent plays: voice above its echo level that may become a barge-in.
    ``onset``: the start of the candidate's first counted voiced sub-frame."""

    onset: float


@dataclass(frozen=True)
class BargeInDropped:
    """The last BargeInCandidate ended without a turn; ``at``: when that was decided (audio clock)."""

    at: float


TurnEvent = Union[
    SpeechStarted, SpeechAudio, SpeechStopped, SpeechPaused, SpeechResumed, BargeInCandidate, BargeInDropped
]
