"""Interpreter pipelining in the streaming runner (StreamingRunner.hold_turn), tiny model.

Pins: an utterance that ends while a reply is in flight is held apart: the audio spoken after it
does not join it, and none of the later turn's audio enters the thinker cache while a turn is
held (it would come before the held turn's answer); the next begin_reply answers the held turn
(its own audio only), the one after it the turn spoken since; every turn's transcript is final
once, in order, under its own item; a cancelled reply with a turn held behind it drops its turn
rather than reordering.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_drive import PIECE, SYSTEM, make_audio, run_until_idle

from agent.engine.api import ReplyDone, TranscriptOut
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.audio_stream import num_audio_tokens


@pytest.fixture
def runner(loaded):
    return StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.4, audio_window_s=1.0, max_sessions=3
    )


def audio(seconds: float, seed: int):
    """As the transcription tests speak: noisy, onset at the start."""
    return make_audio(seconds, 220, seed, noise=0.05, loud_first=False)


def feed(runner: StreamingRunner, sid: str, wav: np.ndarray, step: bool) -> list:
    outs = []
    for i in range(0, len(wav), PIECE):
        runner.append_audio(sid, wav[i : i + PIECE])
        if step:
            outs += run_until_idle(runner)
    return outs


def test_held_turn_is_answered_next_with_its_own_audio(runner):
    runner.open_session("s")
    runner.set_transcription("s", "on")
    state = runner.sessions["s"]
    u1, u2, u3 = audio(1.3, 1), audio(2.1, 2), audio(0.9, 3)
    runner.set_transcript_item("s", "u1")
    outs = feed(runner, "s", u1, step=True)
    runner.begin_reply("s", [], text_only=True)
    runner.set_transcript_item("s", "u2")
    outs += feed(runner, "s", u2, step=False)  # spoken while reply 1 is in flight
    assert state.reply is not None
    assert runner.hold_turn("s") == 1
    runner.set_transcript_item("s", "u3")
    outs += feed(runner, "s", u3, step=False)
    outs += run_until_idle(runner)  # reply 1 ends; the held turn waits for its begin_reply
    assert [type(o) for o in outs if isinstance(o, ReplyDone)] == [ReplyDone]
    assert len(state.held_turns) == 1 and state.reply is None
    assert not state.turn.header_done  # turn 3 is not in the cache ahead of turn 2's answer
    dones = []
    for _ in range(2):
        runner.begin_reply("s", [], text_only=True)
        step_outs = run_until_idle(runner)
        outs += step_outs
        dones += [o for o in step_outs if isinstance(o, ReplyDone)]
    assert [d.stats["input_audio_tokens"] for d in dones] == [num_audio_tokens(len(u2)), num_audio_tokens(len(u3))]
    assert not state.held_turns
    finals = [o.item_id for o in outs if isinstance(o, TranscriptOut) and o.final]
    assert finals == ["u1", "u2", "u3"]


def test_cancelled_reply_with_a_held_turn_drops_its_turn(runner):
    runner.open_session("s")
    state = runner.sessions["s"]
    feed(runner, "s", audio(1.0, 4), step=True)
    before = state.thinker.length - state.turn.prefill_tokens  # the cache without turn 1
    runner.begin_reply("s", [], text_only=True)
    feed(runner, "s", audio(1.2, 5), step=False)
    runner.hold_turn("s")
    runner.cancel_reply("s")  # before its prefill ran
    outs = run_until_idle(runner)
    assert [o.reason for o in outs if isinstance(o, ReplyDone)] == ["cancelled"]
    assert len(state.held_turns) == 1 and state.reply is None
    assert state.thinker.length == before  # the cancelled turn left nothing in the cache
    runner.begin_reply("s", [], text_only=True)
    done = [o for o in run_until_idle(runner) if isinstance(o, ReplyDone)]
    assert done[0].stats["input_audio_tokens"] == num_audio_tokens(int(1.2 * 16000))
