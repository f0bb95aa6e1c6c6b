"""Speculative start in the streaming runner, on the tiny model under greedy decoding.

Pins:
- a speculation (started on a pause) makes its prefill and first frame but nothing of it comes
  out: every output is held; it then parks (HELD) and costs no more ticks;
- discarded (the user speaks again: drop_speculation, or simply more audio of the turn), it
  leaves no trace: the KV rows are back at their lengths
  and the reply that follows equals, token for token and code for code, the one of a runner
  that never speculated; several pauses in one turn may each start and discard one;
- committed (the turn ended), its held text and first frame come out at once (take_ready,
  before any step), and the reply is the one a plain begin_reply at the pause would give;
- a reply's input counts (ReplyInput) come out once, before its first text, equal to those its
  ReplyDone reports: a speculation's are held with the rest until its commit;
- the scheduler serves speculations last: only in ticks with no first-audio work and no
  session under the low-water mark;
- a conversation edit (a user text item) discards a speculation.
"""

from __future__ import annotations

import numpy as np
from support.engine_drive import PIECE, SYSTEM, make_audio, run_until_idle, speak

from agent.engine.api import AudioOut, ReplyDone, ReplyInput, StageTime, TextDelta
from agent.engine.runner.replies import INPUT_STATS
from agent.engine.runner.scheduler import ReplyView, SchedulerConfig, plan_tick
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.state.phase import ReplyPhase

OPTIONS = dict(max_reply_tokens=8, max_reply_seconds=0.8, audio_window_s=1.0, record=True)


def finish(runner: StreamingRunner, sid: str) -> list:
    outputs = run_until_idle(runner, 300)
    assert sum(isinstance(o, ReplyDone) for o in outputs) == 1
    return outputs


def plain_reply(loaded, *pieces: np.ndarray):
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    runner.open_session("s")
    for audio in pieces:
        speak(runner, "s", audio)
    runner.begin_reply("s", [])
    finish(runner, "s")
    return runner.records["s"]


def speculate_until_held(runner: StreamingRunner, sid: str) -> None:
    assert runner.speculate(sid, [])
    for _ in range(50):
        visible = [o for o in runner.step() if not isinstance(o, StageTime)]
        assert visible == [], "a speculation's output got out"
        if runner.sessions[sid].reply.phase is ReplyPhase.HELD:
            break
    reply = runner.sessions[sid].reply
    assert reply.phase is ReplyPhase.HELD
    assert any(isinstance(o, AudioOut) for o in reply.held) and any(isinstance(o, TextDelta) for o in reply.held)
    assert not runner.has_work(), "a held speculation still takes ticks"


def assert_same(got, want) -> None:
    assert got.text_ids == want.text_ids
    assert got.codes.shape == want.codes.shape and got.codes.shape[1] > 0
    np.testing.assert_array_equal(got.codes, want.codes)


def test_discarded_speculations_leave_no_trace(loaded) -> None:
    a, b, c = make_audio(1.0, 220, 1), make_audio(0.5, 300, 2), make_audio(0.4, 250, 3)
    want = plain_reply(loaded, a, b, c)
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    runner.open_session("s")
    state = runner.sessions["s"]
    speak(runner, "s", a)
    for piece in (b, c):  # two pauses in one turn, each speculated on and spoken over
        lengths = (state.thinker.length, state.talker.length, list(state.closing))
        speculate_until_held(runner, "s")
        assert state.thinker.length > lengths[0]  # the speculation's prefill is in the cache
        if piece is b:
            assert runner.drop_speculation("s")
            assert (state.thinker.length, state.talker.length, list(state.closing)) == lengths
            speak(runner, "s", piece)
        else:
            runner.append_audio("s", piece[:PIECE])  # more of the turn discards it by itself
            assert state.reply is None and not runner.drop_speculation("s")
            speak(runner, "s", piece[PIECE:])
        assert state.reply is None
    runner.begin_reply("s", [])
    outputs = finish(runner, "s")
    done = [o for o in outputs if isinstance(o, ReplyDone)][0]
    assert done.stats["speculative"] is False
    assert_same(runner.records["s"], want)
    assert_input_once(outputs, done)


def assert_input_once(outputs: list, done: ReplyDone) -> None:
    """One ReplyInput, before the first text, with the counts the ReplyDone has."""
    kinds = [type(o) for o in outputs]
    assert kinds.count(ReplyInput) == 1 and kinds.index(ReplyInput) < kinds.index(TextDelta), kinds
    given = outputs[kinds.index(ReplyInput)].stats
    assert given == {key: done.stats[key] for key in INPUT_STATS} and given["input_audio_tokens"] > 0, given


def test_committed_speculation_releases_its_held_frame_at_once(loaded) -> None:
    speech, pause = make_audio(1.2, 200, 4), np.zeros(3 * PIECE, dtype=np.float32)
    want = plain_reply(loaded, speech)
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    runner.open_session("s")
    speak(runner, "s", speech)
    speculate_until_held(runner, "s")
    runner.begin_reply("s", [])
    ready = runner.take_ready()
    assert [type(o) for o in ready][-1] is AudioOut and any(isinstance(o, TextDelta) for o in ready)
    assert runner.sessions["s"].reply.phase is ReplyPhase.STREAMING
    runner.append_audio("s", pause)  # the next turn's audio does not touch the committed reply
    assert runner.sessions["s"].reply.phase is ReplyPhase.STREAMING
    outputs = finish(runner, "s")
    done = [o for o in outputs if isinstance(o, ReplyDone)][0]
    assert done.stats["speculative"] is True and done.stats["first_audio_seconds"] == 0.0
    assert_same(runner.records["s"], want)
    assert_input_once(ready + outputs, done)


def test_an_edit_discards_the_speculation(loaded) -> None:
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    runner.open_session("s")
    speak(runner, "s", make_audio(0.8, 220, 5))
    length = runner.sessions["s"].thinker.length
    speculate_until_held(runner, "s")
    runner.add_user_text("s", "and one more thing")
    assert runner.sessions["s"].reply is None and runner.sessions["s"].thinker.length == length


def test_speculations_are_served_last() -> None:
    config = SchedulerConfig()
    spec = ReplyView("spec", started=1.0, awaiting_first=True, buffer_s=0.0, speculative=True)
    assert plan_tick([spec], config).speculate == ["spec"]
    # A real first-audio reply, or a speaking session under the low-water mark, goes first.
    new = ReplyView("new", started=2.0, awaiting_first=True, buffer_s=0.0)
    starving = ReplyView("low", started=0.0, awaiting_first=False, buffer_s=0.05)
    comfy = ReplyView("ok", started=0.0, awaiting_first=False, buffer_s=0.5)
    assert plan_tick([spec, new], config).speculate == [] and plan_tick([spec, new], config).first == ["new"]
    assert plan_tick([spec, starving], config).speculate == []
    plan = plan_tick([spec, comfy], config)
    assert plan.speculate == ["spec"] and plan.decode == ["ok"] and plan.first == []
