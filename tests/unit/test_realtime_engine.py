"""The streaming runner's conversation edits behind the Realtime API, on the tiny model.

Pins, by the tokens in the session's KV slot:
- a user text item is prefilled inside the user message, after the audio, and the reply's
  usage splits input tokens into text and audio; a turn's text items are each on a line of
  their own, also when a reply cancelled in its prefill gives its turn back;
- `instructions` before the first turn replace the prefilled system prompt; later ones are
  queued as a system message in front of the next user turn;
- truncating the latest reply to the audio heard keeps exactly the text tokens the talker had
  read by then: the cache is cut there and the assistant turn closed (<|im_end|>) before the
  next turn; a turn already being prefilled is taken back out and prefilled again after it;
- per-response instructions are a system message right before that reply's assistant header;
- a system message item leaves the session's prompt alone and goes where it is added: after
  the user's text items before it (a user turn of their own), queued before the next turn; a
  reply asked with nothing of the user's since (after a system or assistant item) has no empty
  user message before its header; added after user audio committed with no reply (and no
  speech since), it follows that audio, which becomes a closed user message (the talker hears
  it with the next reply); added while the user speaks, before that turn (its audio is taken back
  out of the cache and prefilled after it); added during a reply, after the reply, followed by
  instructions changed during the same reply (both kept, in order); added during a reply that is
  cancelled before its prefill ends, after the text of the turn it gives back (before its audio); instructions changed while
  the user speaks go before that turn too, so its reply follows them;
- an assistant message item (a replayed conversation) is a closed assistant turn after a user
  turn made of the text items before it; while the user speaks it goes before the speech; with
  images not yet answered it is refused; a replayed call that joins it (parallel calls) goes
  into that turn after a newline, while the user speaks too, during a reply too, and opens a
  turn of its own once a reply has prefilled that one;
- a reply cancelled before its prefill ended (its turn given back) is the latest one: a
  truncation refuses (or with missing_ok answers `absent`) rather than cut the reply before
  it, and so after the fallback answered a turn (drop_turn_items: the earlier reply of this
  model's was once cut in its place);
- a truncation while a reply runs is refused; a cancel ends the reply at once (its ReplyDone
  ready before any tick), so a truncation of it and the next reply's begin queued right behind
  the cancel (one drain of a busy engine's inbox) cut that reply and begin after it;
- a session's voice picks the talker speaker: naming the loaded speaker changes nothing,
  another speaker changes the reply's audio, an unknown one is refused with the list.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_drive import SYSTEM, make_audio, run_until_idle

from agent.engine.api import AudioOut, ReplyDone
from agent.engine.checkpoints.model import assistant_start_ids, system_turn_ids
from agent.engine.runner.scheduler import SchedulerConfig
from agent.engine.runner.streaming import StreamingRunner


@pytest.fixture
def runner(loaded):
    # A 1 s audio window: audio becomes final (and is prefilled) while the user speaks.
    return StreamingRunner(loaded, SYSTEM, max_reply_tokens=8, max_reply_seconds=1.0, audio_window_s=1.0)


def run_reply(runner: StreamingRunner, sid: str, text_only: bool = False) -> ReplyDone:
    runner.begin_reply(sid, [], text_only=text_only)
    done = [o for o in run_until_idle(runner, 500) if isinstance(o, ReplyDone)]
    assert len(done) == 1
    return done[0]


def speech(seconds: float) -> np.ndarray:
    return make_audio(seconds, 220, noise=0.0, loud_first=False)  # a plain tone


def test_text_item_is_prefilled_in_the_user_message(runner, loaded) -> None:
    runner.open_session("s")
    n = runner.add_user_text("s", "What is the weather like?")
    assert n == len(loaded.tokenizer.encode("What is the weather like?", add_special_tokens=False))
    before = runner.sessions["s"].thinker.length
    done = run_reply(runner, "s")
    ids = loaded.ids
    header = 1 + len(ids.user) + len(ids.newline)
    expected = header + n + 1 + len(ids.newline) + len(assistant_start_ids(ids))
    assert done.stats["prefill_tokens"] == expected
    assert done.stats["input_audio_tokens"] == 0
    assert runner.sessions["s"].thinker.length == before + expected + runner.sessions["s"].last_reply.fed


def test_instructions_replace_then_queue(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    new = "Answer like a pirate, in one short sentence."
    assert runner.set_instructions("s", new) == "replaced"
    assert state.thinker.length == len(system_turn_ids(loaded.ids, loaded.tokenizer, new))
    runner.add_user_text("s", "Hi")
    run_reply(runner, "s", text_only=True)
    assert runner.set_instructions("s", "Be brief.") == "appended"
    message = system_turn_ids(loaded.ids, loaded.tokenizer, "Be brief.")
    assert state.closing[-len(message) :] == message
    runner.add_user_text("s", "Again")
    done = run_reply(runner, "s", text_only=True)
    assert done.stats["prefill_tokens"] >= len(message) + 2  # the queued message went in with the turn


def test_a_system_item_goes_where_it_is_added(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    system_before = state.thinker.length
    # Before any turn: queued in front of the next user turn; the session's prompt is untouched.
    n = runner.add_system_text("s", "The user is in Paris.")
    message = system_turn_ids(loaded.ids, loaded.tokenizer, "The user is in Paris.")
    assert n == len(message) and state.closing == message
    assert state.choices.system_prompt is None and state.thinker.length == system_before  # (None: the runner's)
    runner.add_user_text("s", "Hi")
    done = run_reply(runner, "s", text_only=True)
    own = (
        1
        + len(loaded.ids.user)
        + len(loaded.ids.newline)
        + len(loaded.tokenizer.encode("Hi", add_special_tokens=False))
    )
    own += 1 + len(loaded.ids.newline) + len(assistant_start_ids(loaded.ids))
    assert done.stats["prefill_tokens"] == own + len(message)
    # While the user speaks: the turn's audio so far is taken back out and goes in after it.
    audio = speech(2.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    assert state.turn.header_done
    start = state.turn.start_length
    second = system_turn_ids(loaded.ids, loaded.tokenizer, "Now answer in French.")
    runner.add_system_text("s", "Now answer in French.")
    assert not state.turn.header_done and state.thinker.length == start and state.turn.pending_audio
    assert state.closing[-len(second) :] == second
    done = run_reply(runner, "s")
    assert done.stats["input_audio_tokens"] > 0 and done.reason in ("stop", "length")
    # During a reply: after it, with the reply's own end, as are instructions changed meanwhile.
    runner.add_user_text("s", "More?")
    runner.begin_reply("s", [], text_only=True)
    runner.step()
    third = system_turn_ids(loaded.ids, loaded.tokenizer, "Keep it short.")
    runner.add_system_text("s", "Keep it short.")
    runner.set_instructions("s", "Be kind.")
    run_until_idle(runner, 500)
    kind = system_turn_ids(loaded.ids, loaded.tokenizer, "Be kind.")
    assert state.closing[-len(third) - len(kind) :] == third + kind


def test_an_assistant_item_closes_the_user_items_before_it(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    ids, tok = loaded.ids, loaded.tokenizer
    im_end = [ids.im_end, *ids.newline]
    # A replayed exchange: the user's text, then the assistant's answer to it.
    runner.add_user_text("s", "Where am I?")
    n = runner.add_assistant_text("s", "In Paris.")
    user = [ids.im_start, *ids.user, *ids.newline, *tok.encode("Where am I?", add_special_tokens=False), *im_end]
    answer = [*assistant_start_ids(ids), *tok.encode("In Paris.", add_special_tokens=False), *im_end]
    assert state.closing == user + answer and n == len(user + answer)
    assert state.turn.text_ids == []  # (the user's text is that exchange's now, not the next turn's)
    runner.add_user_text("s", "And now?")
    done = run_reply(runner, "s", text_only=True)
    own = 1 + len(ids.user) + len(ids.newline) + len(tok.encode("And now?", add_special_tokens=False))
    own += 1 + len(ids.newline) + len(assistant_start_ids(ids))
    assert done.stats["prefill_tokens"] == own + len(user + answer)
    # While the user speaks, the exchange goes before the speech, which is prefilled again after it.
    audio = speech(2.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    assert state.turn.header_done
    runner.add_assistant_text("s", "Anything else?")
    assert not state.turn.header_done and state.turn.pending_audio
    # Pictures not yet answered must be answered first: their turn has to be prefilled.
    runner.add_user_image("s", np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="images"):
        runner.add_assistant_text("s", "A picture.")


def test_a_system_item_follows_the_user_text_before_it_and_no_empty_turn_is_answered(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    ids, tok = loaded.ids, loaded.tokenizer
    im_end = [ids.im_end, *ids.newline]
    runner.add_user_text("s", "Hello there.")
    n = runner.add_system_text("s", "Be brief.")
    user = [ids.im_start, *ids.user, *ids.newline, *tok.encode("Hello there.", add_special_tokens=False), *im_end]
    system = system_turn_ids(ids, tok, "Be brief.")
    # The conversation's order: the user's text, then the system item (it once went first).
    assert state.closing == user + system and n == len(system) and state.turn.text_ids == []
    # Nothing of the user's after them: the reply follows the system message directly, with no
    # empty user message in between.
    done = run_reply(runner, "s", text_only=True)
    assert done.stats["prefill_tokens"] == len(user + system) + len(assistant_start_ids(ids))
    # So after a replayed assistant message.
    runner.add_user_text("s", "Where am I?")
    runner.add_assistant_text("s", "In Paris.")
    before = state.closing[:]
    done = run_reply(runner, "s", text_only=True)
    assert done.stats["prefill_tokens"] == len(before) + len(assistant_start_ids(ids))


def test_an_item_added_after_committed_audio_follows_it(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    ids, tok = loaded.ids, loaded.tokenizer
    audio = speech(1.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    runner.end_user_item("s")  # committed, no reply asked
    tokens = sum(int(t.shape[0]) for t in (*state.turn.audio_feats, *state.turn.pending_audio))
    start = state.turn.start_length if state.turn.header_done else state.thinker.length  # (partly prefilled)
    runner.add_user_text("s", "See above.")
    runner.add_system_text("s", "Be brief.")
    # The audio item is a closed user message now, in the cache; the text and the system item
    # follow it (they once went in front of it).
    system = system_turn_ids(ids, tok, "Be brief.")
    text = tok.encode("See above.", add_special_tokens=False)
    user_text = [ids.im_start, *ids.user, *ids.newline, *text, ids.im_end, *ids.newline]
    assert state.closing == user_text + system and not state.turn.header_done
    sealed = 1 + len(ids.user) + len(ids.newline) + 1 + tokens + 1 + 1 + len(ids.newline)
    assert state.thinker.length == start + sealed
    assert state.talker_history.backlog[-1].ids.count(ids.audio_pad) == tokens
    done = run_reply(runner, "s", text_only=True)
    assert done.stats["prefill_tokens"] == len(user_text + system) + len(assistant_start_ids(ids))
    # Speech after the committed item (not an item yet): the added turn goes before the turn.
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    runner.end_user_item("s")
    runner.append_audio("s", audio[:12800])
    runner.add_system_text("s", "Still brief.")
    assert state.turn.kept_tokens and state.closing[-len(system_turn_ids(ids, tok, "Still brief.")) :]


def test_replayed_calls_join_the_assistant_turn_replayed_last(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    ids, tok = loaded.ids, loaded.tokenizer
    im_end = [ids.im_end, *ids.newline]

    def encoded(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    call_a, call_b = '<tool_call>\n{"name": "a"}\n</tool_call>', '<tool_call>\n{"name": "b"}\n</tool_call>'
    runner.add_assistant_text("s", "Let me look.")
    runner.add_assistant_text("s", call_a, joins=True)
    head = [*assistant_start_ids(ids), *encoded("Let me look."), *encoded("\n" + call_a)]
    assert state.closing == [*head, *im_end]
    # While the user speaks, the turn still goes before the speech, prefilled again after it.
    audio = speech(2.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    assert state.turn.header_done
    n = runner.add_assistant_text("s", call_b, joins=True)
    whole = [*head, *encoded("\n" + call_b), *im_end]
    assert state.closing == whole and n == len(whole) and not state.turn.header_done
    # A reply prefills it: a call joining it now opens a turn of its own, after the reply.
    done = run_reply(runner, "s", text_only=True)
    assert done.stats["prefill_tokens"] > len(whole) and state.closing[-len(im_end) :] == im_end
    runner.begin_reply("s", [], text_only=True)
    runner.add_assistant_text("s", call_a, joins=True)
    runner.add_assistant_text("s", call_b, joins=True)  # during the reply: joins the one after it
    joined = [*assistant_start_ids(ids), *encoded(call_a), *encoded("\n" + call_b), *im_end]
    assert state.after_reply == joined
    run_until_idle(runner, 500)
    assert state.closing[-len(joined) :] == joined


def test_a_turns_text_items_are_each_on_a_line_of_their_own(loaded) -> None:
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=8, schedule=SchedulerConfig(prefill_chunk_tokens=4))
    runner.open_session("s")
    state = runner.sessions["s"]

    def encoded(text: str) -> list[int]:
        return loaded.tokenizer.encode(text, add_special_tokens=False)

    first = runner.add_user_text("s", "Hi there.")
    second = runner.add_user_text("s", "Tell me a story about the sea")
    line = [*encoded("Hi there."), *loaded.ids.newline, *encoded("Tell me a story about the sea")]
    assert state.turn.text_ids == line and (first, second) == (len(encoded("Hi there.")), len(line) - first)
    runner.begin_reply("s", [], text_only=True)
    runner.step()
    assert state.reply is not None and not state.reply.prefill.done
    runner.add_user_text("s", "Short, please.")  # (the next turn's, while the reply runs)
    runner.cancel_reply("s")
    run_until_idle(runner)
    assert state.turn.text_ids == [*line, *loaded.ids.newline, *encoded("Short, please.")]


def test_items_added_during_a_reply_cancelled_in_its_prefill_follow_its_text(loaded) -> None:
    # 4 tokens a tick: the end of the turn spans several ticks.
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=8, schedule=SchedulerConfig(prefill_chunk_tokens=4))
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Tell me a story about the sea")
    runner.begin_reply("s", [], text_only=True)
    runner.step()
    assert state.reply is not None and not state.reply.prefill.done
    runner.add_system_text("s", "Be brief.")
    assert state.after_reply  # (waiting for the reply's end)
    runner.cancel_reply("s")
    run_until_idle(runner)
    ids = loaded.ids
    message = system_turn_ids(ids, loaded.tokenizer, "Be brief.")
    story = loaded.tokenizer.encode("Tell me a story about the sea", add_special_tokens=False)
    user = [ids.im_start, *ids.user, *ids.newline, *story, ids.im_end, *ids.newline]
    # The conversation's order: the user's text, the (empty) reply, then the message.
    assert state.after_reply == [] and state.closing == user + message and not state.turn.header_done
    done = run_reply(runner, "s", text_only=True)  # answered now, after the message
    assert done.stats["prefill_tokens"] == len(user + message) + len(assistant_start_ids(ids))


def test_a_reply_the_model_never_held_has_nothing_to_truncate(loaded) -> None:
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=8, schedule=SchedulerConfig(prefill_chunk_tokens=4))
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Hi")
    run_reply(runner, "s", text_only=True)
    earlier = state.last_reply
    assert earlier is not None and earlier.tokens
    runner.add_user_text("s", "Tell me a story about the sea")
    runner.begin_reply("s", [], text_only=True)  # cancelled before its first tick
    assert state.reply is not None and not state.reply.prefill.done
    runner.cancel_reply("s")
    run_until_idle(runner)
    # The latest reply is the cancelled one, which the model never held (its begin made the
    # earlier one untruncatable): a truncation refuses, or with missing_ok cuts nothing.
    with pytest.raises(RuntimeError):
        runner.truncate_reply("s", 0)
    closing = list(state.closing)
    result = runner.truncate_reply("s", 0, missing_ok=True)
    assert result["absent"] and result["kept_tokens"] == 0 and state.closing == closing
    # The fallback's reply is no reply of this model's either.
    runner.add_user_text("s", "Again")
    run_reply(runner, "s", text_only=True)
    assert state.last_reply is not None
    runner.drop_turn_items("s")
    assert runner.truncate_reply("s", 0, missing_ok=True)["absent"]


def test_instructions_changed_while_the_user_speaks_apply_to_that_turn(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Hi")
    run_reply(runner, "s", text_only=True)
    audio = speech(2.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    assert state.turn.header_done
    assert runner.set_instructions("s", "Whisper.") == "appended"
    message = system_turn_ids(loaded.ids, loaded.tokenizer, "Whisper.")
    assert not state.turn.header_done and state.closing[-len(message) :] == message
    assert state.after_reply == []  # (not left for after the next reply)


def test_truncate_cuts_the_cache_to_the_heard_tokens(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Tell me a story")
    done = run_reply(runner, "s")
    last = state.last_reply
    assert last is not None and len(last.tokens) >= 3 and done.stats["audio_frames"] >= 3
    assert state.thinker.length == last.start_length + last.fed
    result = runner.truncate_reply("s", 2)  # two 80 ms frames heard: two tokens read by the talker
    im_end = [loaded.ids.im_end, *loaded.ids.newline]
    assert result["kept_tokens"] == 2
    assert state.thinker.length == last.start_length + min(2, last.fed)
    assert state.closing == [*last.tokens[min(2, last.fed) : 2], *im_end]
    closing = list(state.closing)
    # The next turn starts with the closed, shortened reply.
    runner.add_user_text("s", "And then?")
    done2 = run_reply(runner, "s")
    ids = loaded.ids
    own = 1 + len(ids.user) + len(ids.newline) + len(loaded.tokenizer.encode("And then?", add_special_tokens=False))
    own += 1 + len(ids.newline) + len(assistant_start_ids(ids))
    assert done2.stats["prefill_tokens"] == own + len(closing)


def test_truncate_takes_back_a_turn_being_spoken(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Tell me a story")
    run_reply(runner, "s")
    last = state.last_reply
    # The user barges in: on an idle engine their audio is prefilled at once.
    audio = speech(2.5)
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    assert state.turn.header_done and state.thinker.length > last.start_length + last.fed
    runner.truncate_reply("s", 1)
    assert state.thinker.length == last.start_length + min(1, last.fed)
    assert not state.turn.header_done and state.turn.pending_audio
    done = run_reply(runner, "s")
    assert done.stats["input_audio_tokens"] > 0 and done.reason in ("stop", "length")


def test_truncate_while_replying_is_refused(runner) -> None:
    runner.open_session("s")
    runner.add_user_text("s", "Hello")
    runner.begin_reply("s", [])
    runner.step()
    with pytest.raises(RuntimeError):
        runner.truncate_reply("s", 1)


def test_a_cancel_ends_the_reply_at_once_for_the_truncation_and_begin_behind_it(runner, loaded) -> None:
    runner.open_session("s")
    state = runner.sessions["s"]
    runner.add_user_text("s", "Tell me a story")
    runner.begin_reply("s", [])
    frames = 0
    for _ in range(200):  # bounded: until it has spoken three frames
        outputs = runner.step()
        assert not [o for o in outputs if isinstance(o, ReplyDone)], "the reply ended before its cancel"
        frames += sum(isinstance(o, AudioOut) for o in outputs)
        if frames >= 3:
            break
    assert frames >= 3
    # No step from here on until the next reply runs: a busy engine's one drain of its inbox.
    runner.cancel_reply("s")
    ended = runner.take_ready()
    assert isinstance(ended[-1], ReplyDone) and ended[-1].reason == "cancelled"
    assert state.reply is None and state.last_reply is not None
    last = state.last_reply
    assert runner.truncate_reply("s", 2)["kept_tokens"] == 2
    assert state.thinker.length == last.start_length + min(2, last.fed)
    runner.add_user_text("s", "And then?")
    done = run_reply(runner, "s")
    assert done.reason in ("stop", "length") and done.stats["prefill_tokens"] > 0


def test_per_response_instructions_sit_before_the_assistant_header(runner, loaded) -> None:
    runner.open_session("s")
    n = runner.add_user_text("s", "Hi")
    m = runner.set_reply_instructions("s", "Answer in one word.")
    assert m == len(system_turn_ids(loaded.ids, loaded.tokenizer, "Answer in one word."))
    done = run_reply(runner, "s", text_only=True)
    ids = loaded.ids
    own = 1 + len(ids.user) + len(ids.newline) + n + 1 + len(ids.newline) + len(assistant_start_ids(ids))
    assert done.stats["prefill_tokens"] == own + m
    # Only that response: the next one has no system message of its own.
    runner.add_user_text("s", "Hi")
    done = run_reply(runner, "s", text_only=True)
    closing = done.stats["prefill_tokens"] - own
    assert 0 < closing < m


def reply_audio(runner: StreamingRunner, sid: str) -> np.ndarray:
    runner.add_user_text(sid, "Say something.")
    runner.begin_reply(sid, [])
    pcm = []
    for _ in range(500):
        if not runner.has_work():
            break
        pcm += [o.pcm for o in runner.step() if isinstance(o, AudioOut)]
    assert pcm
    return np.concatenate(pcm)


def test_voice_picks_the_talker_speaker(runner, loaded) -> None:
    for sid in ("default", "same", "other"):
        runner.open_session(sid)
    assert runner.set_voice("same", loaded.speaker.upper()) == loaded.speaker.lower()
    other = next(v for v in runner.talker.voices if v != loaded.speaker.lower())
    runner.set_voice("other", other)
    with pytest.raises(ValueError, match="this model speaks as"):
        runner.set_voice("other", "marin")
    assert runner.sessions["other"].choices.voice == other  # a refused voice changes nothing
    base = reply_audio(runner, "default")
    assert np.array_equal(reply_audio(runner, "same"), base)
    changed = reply_audio(runner, "other")
    assert changed.shape != base.shape or not np.array_equal(changed, base)
