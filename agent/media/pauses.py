"""When a pause inside a turn is worth a speculative reply: after a length this speaker rarely
pauses for and then goes on.

A speculative start (agent/media/vad.py SpeechPaused) begins the reply's prefill and first
frames while the endpointer still waits for the end of turn. Started at every short pause it is
thrown away at every mid-sentence breath: one discarded prefill per pause, per session, which
under load is engine time the speaking sessions need (docs/load.md). People differ in how long
they pause inside a sentence, so the length is learned per session: the mid-turn pauses that
ended with the speaker going on are kept (the last few dozen), and a pause is reported once it
is longer than nearly all of them (a high quantile plus a margin), never shorter than the
configured floor and never so late that the speculation has no head start left before the end
of turn. Until a few pauses were seen, the floor applies (speculate early: nothing is known).
Everything is read off the audio clock, so the same audio always gives the same decisions.
"""

from __future__ import annotations

from collections import deque

# Unvoiced runs shorter than this (60 ms is common) are gaps between syllables, not pauses:
# they would drag the quantile down to where every real pause speculates.
MIN_PAUSE_MS = 80
QUANTILE = 0.9  # a pause longer than 9 in 10 of this speaker's mid-turn pauses
MARGIN_MS = 40  # two sub-frames past that: the endpointer decides per 20 ms
MEMORY = 32  # mid-turn pauses remembered (a speaker's habit, not one sentence's)
MIN_SEEN = 2  # pauses seen before the learned length replaces the floor
# What a speculation keeps of its head start at the latest: enough for a prefill and a first
# frame on the real model at one session (tens of ms each), so a committed speculation still
# has its first audio ready when the end of turn comes.
HEAD_START_MS = 100


class PauseModel:
    """The pause length after which a turn is likely over (owned by one session's endpointer)."""

    def __init__(self, floor_ms: int, ceiling_ms: int) -> None:
        """floor_ms: the configured speculation pause (the earliest it may start); ceiling_ms:
        the latest (the end-of-turn silence less the head start a speculation should keep)."""
        self.floor_ms = floor_ms
        self.ceiling_ms = max(floor_ms, ceiling_ms)
        self._resumed: deque[float] = deque(maxlen=MEMORY)

    def resumed_after(self, pause_ms: float) -> None:
        """A mid-turn unvoiced run of this length ended with the speaker going on."""
        if pause_ms >= MIN_PAUSE_MS:
            self._resumed.append(pause_ms)

    @property
    def threshold_ms(self) -> float:
        """Report a pause once the unvoiced run reaches this."""
        if len(self._resumed) < MIN_SEEN:
            return float(self.floor_ms)
        ordered = sorted(self._resumed)
        # Nearest-rank quantile: with few pauses seen, the longest one.
        rank = min(len(ordered) - 1, int(QUANTILE * len(ordered)))
        return float(min(self.ceiling_ms, max(self.floor_ms, ordered[rank] + MARGIN_MS)))


def pause_model(floor_ms: int, silence_ms: int) -> PauseModel:
    """The model for an endpointer ending turns after silence_ms, speculating no earlier than
    floor_ms."""
    return PauseModel(floor_ms, silence_ms - HEAD_START_MS)
