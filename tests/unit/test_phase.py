"""The reply phase machine (agent/engine/state/phase.py): every legal transition is taken, every
other pair of phases raises IllegalTransition, and the terminal phases have no way out."""

from __future__ import annotations

import itertools

import pytest

from agent.engine.state.phase import TRANSITIONS, IllegalTransition, ReplyPhase

LEGAL = {
    (ReplyPhase.SPECULATING, ReplyPhase.HELD),
    (ReplyPhase.SPECULATING, ReplyPhase.PREFILLING),
    (ReplyPhase.SPECULATING, ReplyPhase.DISCARDED),
    (ReplyPhase.HELD, ReplyPhase.STREAMING),
    (ReplyPhase.HELD, ReplyPhase.DISCARDED),
    (ReplyPhase.PREFILLING, ReplyPhase.STREAMING),
    (ReplyPhase.PREFILLING, ReplyPhase.CANCELLING),
    (ReplyPhase.STREAMING, ReplyPhase.ENDED),
    (ReplyPhase.STREAMING, ReplyPhase.CANCELLING),
    (ReplyPhase.CANCELLING, ReplyPhase.ENDED),
}


def test_the_table_is_the_documented_one() -> None:
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL
    assert set(TRANSITIONS) == set(ReplyPhase)


@pytest.mark.parametrize("start,end", sorted(LEGAL, key=lambda p: (p[0].value, p[1].value)))
def test_every_legal_transition(start: ReplyPhase, end: ReplyPhase) -> None:
    assert start.to(end) is end


ILLEGAL = sorted(set(itertools.product(ReplyPhase, ReplyPhase)) - LEGAL, key=lambda p: (p[0].value, p[1].value))


@pytest.mark.parametrize("start,end", ILLEGAL)
def test_every_other_transition_raises(start: ReplyPhase, end: ReplyPhase) -> None:
    with pytest.raises(IllegalTransition):
        start.to(end)


def test_whole_lives() -> None:
    # An ordinary reply, a cancelled one, a committed speculation, a discarded one.
    for path in (
        ["PREFILLING", "STREAMING", "ENDED"],
        ["PREFILLING", "CANCELLING", "ENDED"],
        ["SPECULATING", "HELD", "STREAMING", "CANCELLING", "ENDED"],
        ["SPECULATING", "PREFILLING", "STREAMING", "ENDED"],
        ["SPECULATING", "HELD", "DISCARDED"],
    ):
        phase = ReplyPhase[path[0]]
        for name in path[1:]:
            phase = phase.to(ReplyPhase[name])
        assert phase.name == path[-1]
    assert ReplyPhase.SPECULATING.speculative and ReplyPhase.HELD.speculative
    assert not any(p.speculative for p in ReplyPhase if p not in (ReplyPhase.SPECULATING, ReplyPhase.HELD))
    assert not TRANSITIONS[ReplyPhase.ENDED] and not TRANSITIONS[ReplyPhase.DISCARDED]
