"""The semantic end of turn: at a pause, is the utterance complete?

The acoustic endpointer (agent/media/vad.py) ends a turn after a fixed silence, long enough
that a speaker pausing mid-sentence is rarely cut, and so every complete turn waits it out too.
With a judge, each pause is asked once, early (``ask_after_ms`` of unvoiced audio, past the gaps
between syllables), how likely the turn's audio so far is a finished utterance, P. The policy's
tiers map P to the silence that then ends the turn: the surer the judge, the shorter (ending no
sooner than the verdict is in); below every tier the turn waits for the endpointer's long
silence. Voice before the verdict withdraws the question: the next pause asks again, about the
longer utterance.

The verdict is read off the audio clock: a judge's answer is a `Pending` asked for its
probability at an audio time, so a live judge (a worker thread, agent/media/smart_turn.py)
answers once its result is in, and a benchmark's judge can answer exactly when the compute it
measured would have let it (scripts/bench_turns.py), for the same decisions either way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from agent.config import INPUT_RATE

# What the judge hears at most: Smart Turn reads the last 8 s.
MAX_AUDIO_S = 8.0


@dataclass(frozen=True)
class SemanticPolicy:
    """When to ask and how to act on the answer (semantic_vad's eagerness picks one)."""

    # (P(complete) at least, silence in ms that then ends the turn), surest first.
    tiers: tuple[tuple[float, int], ...] = ((0.5, 100),)
    ask_after_ms: int = 60  # unvoiced audio before asking: gaps between syllables are shorter

    def silence_ms(self, p: float) -> Optional[int]:
        """The silence that ends a turn judged P(complete) = p; None: the long one."""
        return next((ms for at_least, ms in self.tiers if p >= at_least), None)


class Pending(Protocol):
    """One question to a judge."""

    def probability_at(self, t: float) -> Optional[float]:
        """P(complete) if the answer is in by audio time `t`, else None."""


class CompletenessJudge(Protocol):
    """The narrow port the endpointer needs: ask about an utterance's audio."""

    def ask(self, audio: np.ndarray, at: float) -> Pending:
        """`audio`: the turn's last seconds, 16 kHz float in [-1, 1], ending at audio time `at`."""


class SemanticEnd:
    """One session's pause judgments (owned by its Endpointer)."""

    def __init__(self, judge: CompletenessJudge, policy: SemanticPolicy) -> None:
        self.judge = judge
        self.policy = policy
        self._audio: deque[np.ndarray] = deque()  # the turn's complete chunks, at most MAX_AUDIO_S
        self._samples = 0
        self._pending: Optional[Pending] = None
        self._asked = False  # this pause was asked about
        self._verdict: Optional[float] = None  # this pause's answer, once in
        self.asked = 0  # questions asked (a cost counter for benchmarks)

    def start_turn(self) -> None:
        self._audio.clear()
        self._samples = 0
        self.voiced()

    def add(self, pcm: np.ndarray) -> None:
        """A chunk of the turn's audio, in order."""
        self._audio.append(pcm)
        self._samples += len(pcm)
        while self._audio and self._samples - len(self._audio[0]) >= MAX_AUDIO_S * INPUT_RATE:
            self._samples -= len(self._audio.popleft())

    def voiced(self) -> None:
        """Voice: any question about the last pause is void."""
        self._pending = None
        self._asked = False
        self._verdict = None

    def ends(self, t: float, silence_ms: float, tail: np.ndarray) -> bool:
        """At audio time `t`, `silence_ms` into a pause: end the turn now? `tail`: the turn's
        audio past the chunks add()ed, up to `t` (the chunk still arriving)."""
        p = self.policy
        if not self._asked and silence_ms >= p.ask_after_ms - 1e-6:
            self._asked = True
            self.asked += 1
            audio = np.concatenate([*self._audio, tail]) if self._audio or len(tail) else tail
            self._pending = self.judge.ask(audio[-int(MAX_AUDIO_S * INPUT_RATE) :].astype(np.float32), t)
        if self._verdict is None and self._pending is not None:
            self._verdict = self._pending.probability_at(t)
        if self._verdict is None:
            return False
        needed = p.silence_ms(self._verdict)
        return needed is not None and silence_ms >= needed - 1e-6

    @property
    def verdict(self) -> Optional[float]:
        """This pause's P(complete), once in."""
        return self._verdict
