"""Long instructions go into the cache a chunk per tick, and nobody waits on them but their own session.

Pins, on the tiny model, for the system prompt (agent/engine/stages/system_prefill.py):
- instructions of thousands of tokens are in the cache a chunk (prefill_chunk_tokens) at a time:
  the first when they are set, the rest one chunk per tick; another session's reply gets its
  frames in the ticks between the chunks;
- a turn that ends before its session's prompt is all in waits for it: the prompt's chunks go
  in the reply's first-audio budget, the turn's audio after them, and the reply equals
  generate() on that prompt;
- instructions that replace a prompt half in start the cache over: the reply equals that of a
  session that had them from the start;
- no speculation starts while the prompt goes in, and one does once it is in;
- a turn that fills the context starts the history over with the prompt in its own chunks
  (no tick adds more than a chunk to the cache), and its reply equals generate() on the fresh
  single-turn prompt; cancelled before that prefill ends, it leaves an empty cache and the prompt
  waiting, so the next turn's reply equals generate() on its own single-turn prompt.
And for instructions changed after a reply (a system message in the next turn's closing,
TurnPrefill.flush_audios), with the 1 s audio window that prefills speech as it comes:
- while the user speaks, the turn's first part (the closing, then the speech) goes in a chunk
  at a time (on an idle engine one per piece of audio that arrives, else one per tick), and
  the reply equals that of a runner that prefills the closing in one forward;
- a system item added while that part is half in takes the turn back out of the cache and goes
  before it: the reply equals the one-forward runner's after the same commands.
"""

from __future__ import annotations

import math

import numpy as np
from support.engine_drive import PIECE, SYSTEM, generate_speaking, run_until_idle, speak
from support.exact import FRAMES, SECONDS, TOKENS, assert_same, make_audio

from agent.engine.api import AudioOut, ReplyDone
from agent.engine.checkpoints.model import build_inputs, system_turn_ids
from agent.engine.runner.scheduler import SchedulerConfig
from agent.engine.runner.streaming import StreamingRunner

CHUNK = 256  # the scheduler's default prefill_chunk_tokens


def long_prompt(words: int, topic: str = "brief") -> str:
    return " ".join(f"rule{i} is to be {topic}" for i in range(words // 5))


def runner_for(loaded, **options) -> StreamingRunner:
    return StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, **options)


def answer(runner: StreamingRunner, sid: str, audio: np.ndarray) -> None:
    """A turn of `audio`, then its reply, to the end."""
    speak(runner, sid, audio)
    runner.begin_reply(sid, [])
    run_until_idle(runner)


def generated(loaded, prompt: str, audio: np.ndarray) -> tuple:
    """generate() on the single-turn prompt, as assert_same takes it."""
    inputs = build_inputs(loaded, audio, [], prompt)
    sequences, wav, codes = generate_speaking(loaded, TOKENS, FRAMES, **inputs)
    text = [t for t in sequences[0, inputs["input_ids"].shape[1] :].tolist() if t not in loaded.thinker_eos_ids]
    return (text, codes, wav.reshape(-1).numpy(), inputs["input_ids"].shape[1])


def assert_same_reply(a, b) -> None:
    """Two recorded replies: the same text, prefill and codes."""
    assert a.text_ids == b.text_ids and a.prefill_tokens == b.prefill_tokens
    np.testing.assert_array_equal(a.codes, b.codes)


def test_a_long_prompt_goes_in_a_chunk_per_tick_between_another_sessions_frames(loaded) -> None:
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=64, max_reply_seconds=3.0)
    runner.open_session("a")
    speak(runner, "a", make_audio(1.0, 220, 1))
    runner.begin_reply("a", [])
    runner.step()  # a speaks from here on

    runner.open_session("b")
    prompt = long_prompt(1500)
    n = len(system_turn_ids(loaded.ids, loaded.tokenizer, prompt))
    assert n > 4 * CHUNK
    assert runner.set_instructions("b", prompt) == "replaced"
    b = runner.sessions["b"]
    assert b.thinker.length == CHUNK  # the first chunk at once

    lengths, frames = [b.thinker.length], []
    while b.system is not None:
        outputs = runner.step()
        lengths.append(b.thinker.length)
        frames.append(sum(isinstance(o, AudioOut) and o.session_id == "a" for o in outputs))
        assert len(lengths) < 200
    assert lengths[-1] == n
    growth = np.diff(lengths)
    assert growth.max() <= CHUNK
    assert np.count_nonzero(growth) >= math.ceil((n - CHUNK) / CHUNK)
    # a's frames came out while b's prompt went in, not only after it.
    moved = np.flatnonzero(growth)
    assert sum(frames[moved[0] : moved[-1]]) > 0


def test_a_turn_ended_before_its_prompt_is_in_waits_for_it_and_equals_generate(loaded) -> None:
    prompt = long_prompt(700, "kind")
    audio = make_audio(1.0, 260, 2)
    ref = generated(loaded, prompt, audio)

    runner = runner_for(loaded)
    runner.open_session("s")
    state = runner.sessions["s"]
    n = len(system_turn_ids(loaded.ids, loaded.tokenizer, prompt))
    assert n > 3 * CHUNK
    runner.set_instructions("s", prompt)
    speak(runner, "s", audio)
    assert state.thinker.length == CHUNK  # the audio waits behind the prompt
    runner.begin_reply("s", [])
    first = runner.step()  # the reply's budget goes to the prompt
    assert state.thinker.length == 2 * CHUNK
    assert not any(isinstance(o, AudioOut) for o in first)
    run_until_idle(runner)
    assert_same(runner.records["s"], ref)


def test_instructions_replacing_a_prompt_half_in_start_the_cache_over(loaded) -> None:
    audio = make_audio(1.0, 300, 3)
    final = long_prompt(400, "calm")
    runner = runner_for(loaded)
    runner.open_session("changed")
    runner.set_instructions("changed", long_prompt(1200))
    runner.step()
    assert runner.sessions["changed"].system is not None  # half in
    assert runner.set_instructions("changed", final) == "replaced"
    runner.open_session("direct")
    runner.set_instructions("direct", final)
    for sid in ("changed", "direct"):
        answer(runner, sid, audio)
    n = len(system_turn_ids(loaded.ids, loaded.tokenizer, final))
    assert_same_reply(runner.records["changed"], runner.records["direct"])
    assert runner.sessions["changed"].last_reply.start_length == runner.sessions["direct"].last_reply.start_length
    assert runner.sessions["direct"].last_reply.start_length > n


def test_no_speculation_starts_while_the_prompt_goes_in(loaded) -> None:
    runner = runner_for(loaded)
    runner.open_session("s")
    runner.set_instructions("s", long_prompt(700))
    speak(runner, "s", make_audio(0.6, 220, 4))
    assert not runner.speculate("s", [])
    while runner.sessions["s"].system is not None:
        runner.step()
    assert runner.speculate("s", [])


def _after_a_reply(loaded, chunk: int) -> StreamingRunner:
    """A session that has had one reply, with the 1 s audio window (speech prefilled as it comes)."""
    runner = runner_for(loaded, audio_window_s=1.0, schedule=SchedulerConfig(prefill_chunk_tokens=chunk))
    runner.open_session("s")
    answer(runner, "s", make_audio(1.0, 220, 5))
    return runner


def test_instructions_changed_after_a_reply_go_in_a_chunk_per_tick_while_the_user_speaks(loaded) -> None:
    prompt, audio = long_prompt(1200, "calm"), make_audio(3.0, 300, 6)
    records = []
    for chunk in (CHUNK, 1 << 16):
        runner = _after_a_reply(loaded, chunk)
        state = runner.sessions["s"]
        assert runner.set_instructions("s", prompt) == "appended"
        n = len(system_turn_ids(loaded.ids, loaded.tokenizer, prompt))
        lengths, halfway = [state.thinker.length], 0
        for i in range(0, len(audio), PIECE):  # an idle engine prefills as the audio comes
            runner.append_audio("s", audio[i : i + PIECE])
            lengths.append(state.thinker.length)
            halfway += state.turn.flushing is not None
        if chunk == CHUNK:
            assert np.diff(lengths).max() <= CHUNK  # a chunk per piece of audio at most
            assert halfway >= n // CHUNK - 1
            while state.turn.flushing is not None:
                runner.step()
                lengths.append(state.thinker.length)
                assert len(lengths) < 100
            assert np.diff(lengths).max() <= CHUNK
        else:
            assert np.diff(lengths).max() > n and halfway == 0  # the closing in one forward
        runner.begin_reply("s", [])
        run_until_idle(runner)
        records.append(runner.records["s"])
    assert_same_reply(*records)  # chunked, whole


def test_a_system_item_added_while_the_closing_goes_in_goes_before_the_turn(loaded) -> None:
    records = []
    for chunk in (CHUNK, 1 << 16):
        runner = _after_a_reply(loaded, chunk)
        runner.set_instructions("s", long_prompt(1200, "calm"))
        speak(runner, "s", make_audio(1.2, 300, 7))  # final audio from 1 s on: a few chunks in
        assert (runner.sessions["s"].turn.flushing is not None) == (chunk == CHUNK)  # half in
        runner.add_system_text("s", "The user is in Paris.")
        assert runner.sessions["s"].turn.flushing is None  # the turn came back out
        runner.begin_reply("s", [])
        run_until_idle(runner)
        records.append(runner.records["s"])
    assert_same_reply(*records)  # chunked, whole


def _full_after_one_turn(loaded, prompt: str, room: int) -> StreamingRunner:
    """A session with the long prompt and one answered turn, its context room for one turn of
    `room` prompt tokens and its reply, not for two."""
    runner = runner_for(loaded, context_limit=room + TOKENS + 8 + 4)
    runner.open_session("s")
    runner.set_instructions("s", prompt)
    answer(runner, "s", make_audio(1.0, 220, 8))
    return runner


def test_a_full_context_puts_a_long_prompt_in_again_a_chunk_per_tick(loaded) -> None:
    prompt, audio2 = long_prompt(700, "kind"), make_audio(1.0, 300, 9)
    ref = generated(loaded, prompt, audio2)
    runner = _full_after_one_turn(loaded, prompt, ref[3])
    state = runner.sessions["s"]
    speak(runner, "s", audio2)
    runner.begin_reply("s", [])
    lengths, done = [state.thinker.length], []
    while runner.has_work():
        done += [o for o in runner.step() if isinstance(o, ReplyDone)]
        lengths.append(state.thinker.length)
    assert done[0].stats["history_reset"]
    assert min(lengths) <= CHUNK + 1  # the history went
    assert np.diff(lengths).max() <= CHUNK + 1  # then a chunk a tick (and the reply's tokens)
    assert_same(runner.records["s"], ref)


def test_a_reset_cancelled_before_its_prefill_ends_leaves_the_prompt_waiting(loaded) -> None:
    prompt, audio3 = long_prompt(700, "kind"), make_audio(1.0, 260, 10)
    ref = generated(loaded, prompt, audio3)
    runner = _full_after_one_turn(loaded, prompt, ref[3])
    speak(runner, "s", make_audio(1.0, 300, 9))
    runner.begin_reply("s", [])
    runner.step()  # the reset and the prompt's first chunk
    state = runner.sessions["s"]
    assert 0 < state.thinker.length <= CHUNK
    runner.cancel_reply("s")
    assert state.thinker.length == 0  # the prompt waits with the items, to go in with the next turn
    run_until_idle(runner)
    runner.discard_turn("s")
    answer(runner, "s", audio3)
    assert_same(runner.records["s"], ref)
