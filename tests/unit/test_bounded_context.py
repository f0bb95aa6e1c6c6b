"""A bounded context (interpreter mode: StreamingRunner.set_context_turns), tiny model.

Pins: over 30 utterances the session's thinker row (and the talker's view of the user turns)
stays bounded when at most 3 answered turns are kept: its length never exceeds what it reached
in the first few turns, while without the bound it grows with every turn; every utterance is
still answered, and the history starts over only when 3 answered turns are in it. A turn that
starts the history over (a full context) replays the system and assistant items added before
it, not an instruction change (the new system prompt holds it). Instructions that leave no room
for a reply are refused, the session left as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_drive import make_audio, run_until_idle, speak

from agent.engine.api import ReplyDone
from agent.engine.runner.streaming import StreamingRunner


def utterance(seed: int) -> np.ndarray:
    return make_audio(0.6, 180 + 10 * seed, seed, noise=0.05, loud_first=False)


def talk(runner: StreamingRunner, turns: int, spoken_every: int = 10) -> tuple[list[int], list[int], list[dict]]:
    """`turns` utterances, each answered; the thinker length and talker turns kept after each."""
    lengths, talker_turns, stats = [], [], []
    for n in range(turns):
        wav = utterance(n)
        speak(runner, "s", wav)
        runner.begin_reply("s", [], text_only=n % spoken_every != spoken_every - 1)
        done = [o for o in run_until_idle(runner, 400) if isinstance(o, ReplyDone)]
        assert len(done) == 1 and done[0].reason in ("stop", "length")
        state = runner.sessions["s"]
        lengths.append(state.thinker.length)
        talker_turns.append(len(state.talker_history.backlog))
        stats.append(done[0].stats)
    return lengths, talker_turns, stats


def test_thirty_utterances_stay_bounded(loaded):
    options = dict(max_reply_tokens=4, max_reply_seconds=0.2, audio_window_s=1.0, max_sessions=1)
    bounded = StreamingRunner(loaded, "Translate into French.", **options)
    bounded.open_session("s")
    assert bounded.set_context_turns("s", 3) == 3
    lengths, talker_turns, stats = talk(bounded, 30)
    assert max(lengths[6:]) <= max(lengths[:6])  # no growth after the first cycles
    assert max(talker_turns) <= 3
    resets = [n for n, s in enumerate(stats) if s["history_reset"]]
    assert resets == list(range(3, 30, 3))  # the 4th turn starts over; then it and 2 more are kept

    free = StreamingRunner(loaded, "Translate into French.", **options)
    free.open_session("s")
    grown, _, _ = talk(free, 12)
    assert grown[-1] > 2 * max(lengths)  # what the bound saves, even after 12 turns


def _reset_turn(loaded, add) -> tuple[dict, StreamingRunner]:
    """A session with one answered turn, then `add(runner)`, then a turn too long for what is left
    of a 512-token context (it starts the history over): that turn's ReplyDone stats."""
    runner = StreamingRunner(loaded, "You are a helpful voice assistant.", max_reply_tokens=8, context_limit=512)
    runner.open_session("s")
    runner.add_user_text("s", "Hello" + " there" * 100)
    runner.begin_reply("s", [], text_only=True)
    run_until_idle(runner, 400)
    add(runner)
    runner.add_user_text("s", " word" * 400)
    runner.begin_reply("s", [], text_only=True)
    [done] = [o for o in run_until_idle(runner, 400) if isinstance(o, ReplyDone)]
    assert done.stats["history_reset"] and done.reason in ("stop", "length")
    return done.stats, runner


def test_a_reset_replays_the_items_added_before_its_turn(loaded):
    """A turn that starts the history over replays, before itself, the system and assistant items
    added since the last reply (the conversation lists them there; a reset dropped them), but not
    an instruction change (the reset's system prompt is the new instructions already)."""
    base, _ = _reset_turn(loaded, lambda r: None)
    system, runner = _reset_turn(loaded, lambda r: r.add_system_text("s", "Answer in French."))
    item = len(runner.turns.system_message_ids("Answer in French."))
    assert system["prefill_tokens"] == base["prefill_tokens"] + item
    assistant, _ = _reset_turn(loaded, lambda r: r.add_assistant_text("s", "Bonjour."))
    assert assistant["prefill_tokens"] > base["prefill_tokens"]
    told, runner = _reset_turn(loaded, lambda r: r.set_instructions("s", "Be terse."))
    # The reset puts its system prompt in with the turn (prefill_tokens count it): the new
    # instructions, and the change is not replayed as a message besides.
    prompt = len(runner.turns.system_message_ids("Be terse."))
    assert told["prefill_tokens"] - prompt == base["prefill_tokens"] - len(
        runner.turns.system_message_ids("You are a helpful voice assistant.")
    )
    fed = runner.context("s")["last_reply"]["fed"]
    assert told["context_tokens"] == told["prefill_tokens"] + fed  # the prompt, the turn, the reply: nothing else


def test_instructions_that_leave_no_room_for_a_reply_are_refused(loaded):
    """The engine counts the tokens of a session's instructions (the session bounds their bytes
    first): a prompt that leaves no room for a reply is refused, the session left as it was."""
    runner = StreamingRunner(loaded, "You are a helpful voice assistant.", max_reply_tokens=8, context_limit=512)
    runner.open_session("s")
    length = runner.sessions["s"].thinker.length
    with pytest.raises(ValueError, match="the context holds 512"):
        runner.set_instructions("s", " word" * 500)
    assert runner.sessions["s"].choices.system_prompt is None and runner.sessions["s"].thinker.length == length
    assert runner.set_instructions("s", " word" * 400) == "replaced"
