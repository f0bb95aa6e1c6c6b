"""A reply's phase and the only transitions it may take, in one place.

A reply in the streaming engine is in exactly one phase at a time. One object moves it: the
runner's reply lifecycle, Replies (agent/engine/runner/replies.py), the only caller of
ReplyState.move (a new reply, commit, discard, cancel, first frame, finish, fail); the runner's
step() and the speculation component ask it. A move always goes through `ReplyPhase.to`, which
refuses a transition that is not in `TRANSITIONS`. What each stage has produced (prefill job,
text tokens, codec frames) is kept in its own small object (agent/engine/state/reply.py:
PrefillStage, TextStage, VoiceStage), advanced by that stage; the phase says what the reply as
a whole is doing.

    SPECULATING -> HELD -> STREAMING -> ENDED
         |           |         ^  \
         |           +-> DISCARDED  +-> CANCELLING -> ENDED
         +-> PREFILLING ---+  (PREFILLING -> CANCELLING too)
         +-> DISCARDED

Speculative start (a short pause in the user's speech): the reply is prefilled and its first
frame made while the user may still go on (SPECULATING), then parked with that frame held
(HELD). At the end of the turn it is committed (HELD -> STREAMING: the held output goes out at
once; SPECULATING -> PREFILLING: the rest of its prefill runs as for any reply); if the user
speaks again first it is DISCARDED: rolled back, nothing of it was ever seen.
"""

from __future__ import annotations

from enum import Enum


class IllegalTransition(RuntimeError):
    """A reply was asked to move between two phases that have no transition between them."""


class ReplyPhase(Enum):
    SPECULATING = "speculating"  # speculative: prefill and first frame into the hold, invisible
    HELD = "held"  # speculative, first frame made and held; parked until commit or discard
    PREFILLING = "prefilling"  # end-of-turn prefill pending or running (in chunks)
    STREAMING = "streaming"  # prefilled: thinker one token ahead of the talker, a frame a tick
    CANCELLING = "cancelling"  # cancel asked (or its work failed): ended at once, by the same call
    ENDED = "ended"  # stopped, capped or cancelled: its ReplyDone went out
    DISCARDED = "discarded"  # a speculation the user spoke over: rolled back, never seen

    @property
    def speculative(self) -> bool:
        """Whether nothing of the reply may reach the client yet."""
        return self in (ReplyPhase.SPECULATING, ReplyPhase.HELD)

    @property
    def prefilling(self) -> bool:
        """Whether its end-of-turn prefill is still to finish (a first-audio deadline, or a
        speculative one)."""
        return self in (ReplyPhase.SPECULATING, ReplyPhase.PREFILLING)

    def to(self, new: ReplyPhase) -> ReplyPhase:
        """`new`, if this phase may move there; else IllegalTransition."""
        if new not in TRANSITIONS[self]:
            raise IllegalTransition(f"a reply cannot go from {self.value} to {new.value}")
        return new


TRANSITIONS: dict[ReplyPhase, frozenset[ReplyPhase]] = {
    ReplyPhase.SPECULATING: frozenset({ReplyPhase.HELD, ReplyPhase.PREFILLING, ReplyPhase.DISCARDED}),
    ReplyPhase.HELD: frozenset({ReplyPhase.STREAMING, ReplyPhase.DISCARDED}),
    ReplyPhase.PREFILLING: frozenset({ReplyPhase.STREAMING, ReplyPhase.CANCELLING}),
    ReplyPhase.STREAMING: frozenset({ReplyPhase.ENDED, ReplyPhase.CANCELLING}),
    ReplyPhase.CANCELLING: frozenset({ReplyPhase.ENDED}),
    ReplyPhase.ENDED: frozenset(),
    ReplyPhase.DISCARDED: frozenset(),
}
