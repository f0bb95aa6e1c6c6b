"""StreamingRunner equals transformers' generate(), frame by frame, on the tiny model.

Pins, under greedy decoding with audio + an image as input:
- the streamed reply has the same text ids, the same 16 codec codes per frame and the same
  waveform (within 1e-4) as `generate(return_audio=True)` on the same prompt;
- the first AudioOut comes out of the very first step (one codec frame, not the whole reply);
- a second turn in the same session prefills only its own tokens (the earlier turns and the
  first reply stay in the KV caches) and still equals generate() on the two-turn prompt;
- with a 1 s audio window the audio is prefilled while the user speaks and the result still
  equals generate() run with the same window;
- a reply whose model wants to end at once still speaks one token (same rule as GenerateRunner);
- a full context drops the session's history, says so in ReplyDone.stats, and the reply then
  equals generate() on the fresh single-turn prompt;
- with the per-frame steps compiled (agent/engine/compile/inductor.py) a reply, and two sessions
  stepped together, still equal generate().
The audio starts with its loudest sample: the streamed log-mel clamps with a running maximum
(agent/engine/stages/audio_stream.py), which equals the extractor's once the maximum has been seen.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_drive import SYSTEM
from support.exact import SECONDS, TOKENS, assert_same, make_audio, make_image, reference, stream_turn

from agent.engine.api import AudioOut, ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.model import HistoryTurn, build_inputs
from agent.engine.runner.reference import SAMPLES_PER_FRAME
from agent.engine.runner.streaming import StreamingRunner


@pytest.fixture(params=["eager", "compiled"])
def compiled(request, compiled_options) -> dict:
    """Runner options: the eager path, or the compiled per-frame path (tests/unit/test_compiled.py)."""
    return compiled_options if request.param == "compiled" else {}


def test_single_turn_equals_generate_and_audio_starts_at_once(loaded, compiled):
    audio, image = make_audio(1.5, 220, 1), make_image(0)
    ref = reference(loaded, audio, [image])
    runner = StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, **compiled
    )
    runner.open_session("s")
    steps, done = stream_turn(runner, "s", audio, [image])
    assert_same(runner.records["s"], ref)

    first = steps[0]
    assert any(isinstance(o, AudioOut) for o in first), "no audio in the first step"
    assert {o.stage for o in first if isinstance(o, StageTime)} >= {
        "thinker_prefill",
        "audio_encoder",
        "vision_encoder",
        "talker_step",
        "code_predictor",
        "code2wav",
    }
    chunks = [o.pcm for step in steps for o in step if isinstance(o, AudioOut)]
    assert all(c.dtype == np.int16 and len(c) <= SAMPLES_PER_FRAME for c in chunks)
    assert sum(len(c) for c in chunks) == len(ref[2]) == done.stats["audio_samples"]
    text = "".join(o.text for step in steps for o in step if isinstance(o, TextDelta))
    assert text == done.text == loaded.tokenizer.decode(ref[0], skip_special_tokens=True)
    assert done.stats["prefill_tokens"] == ref[3] - len(
        loaded.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special_tokens=False)
    )


def test_second_turn_reuses_the_cache_and_equals_generate(loaded):
    audio1, image1 = make_audio(1.5, 220, 1), make_image(0)
    audio2, image2 = make_audio(1.2, 330, 2), make_image(40)
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    runner.open_session("s")
    stream_turn(runner, "s", audio1, [image1])
    first = runner.records["s"]
    _, done = stream_turn(runner, "s", audio2, [image2])

    history = [HistoryTurn(audio1, (image1,), first.text_ids)]
    ref = reference(loaded, audio2, [image2], history=history)
    assert_same(runner.records["s"], ref)
    # Turn 1 left prompt1 + every reply token but the last (never fed) in the cache; turn 2
    # prefilled the rest of the two-turn prompt and nothing else.
    prompt1 = build_inputs(loaded, audio1, [image1], SYSTEM)["input_ids"].shape[1]
    assert done.stats["prefill_tokens"] == ref[3] - (prompt1 + len(first.text_ids) - 1)
    assert not done.stats["history_reset"]


def test_audio_is_prefilled_while_the_user_speaks(loaded):
    tower = loaded.model.thinker.model.audio_tower
    audio, image = make_audio(2.4, 260, 3), make_image(7)
    runner = StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, audio_window_s=1.0, record=True
    )
    runner.open_session("s")
    before = runner.sessions["s"].thinker.length
    for i in range(0, len(audio), 1280):
        runner.append_audio("s", audio[i : i + 1280])
    # Two full 1 s windows are final: header + audio_start + 2 x 13 tokens are already in.
    assert runner.sessions["s"].thinker.length - before == 3 + 1 + 26
    runner.begin_reply("s", [image])
    while runner.has_work():
        runner.step()
    saved = tower.n_window_infer
    tower.n_window_infer = 100  # the reference must attend in the same 1 s windows
    try:
        ref = reference(loaded, audio, [image])
    finally:
        tower.n_window_infer = saved
    assert_same(runner.records["s"], ref)


def test_immediate_end_still_speaks_one_token(loaded, eager_to_end):
    audio = make_audio(1.0, 200, 4)
    ref = reference(loaded, audio, [])
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    runner.open_session("s")
    _, done = stream_turn(runner, "s", audio, [])
    assert done.stats["text_tokens"] == 1
    assert_same(runner.records["s"], ref)


def test_full_context_drops_the_history(loaded):
    audio1, audio2 = make_audio(1.0, 220, 5), make_audio(1.0, 300, 6)
    prompt = build_inputs(loaded, audio2, [], SYSTEM)["input_ids"].shape[1]
    # Room for one turn and its reply, not for two.
    limit = prompt + TOKENS + 8 + 4
    runner = StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, context_limit=limit, record=True
    )
    runner.open_session("s")
    _, done1 = stream_turn(runner, "s", audio1, [])
    assert not done1.stats["history_reset"]
    _, done2 = stream_turn(runner, "s", audio2, [])
    assert done2.stats["history_reset"]
    assert done2.stats["context_tokens"] <= limit
    assert_same(runner.records["s"], reference(loaded, audio2, []))


def test_text_only_turn_then_spoken_turn_equals_generate(loaded):
    """A text-only reply does not run the talker; the next spoken reply still gives the talker
    every user turn, as generate() does."""
    audio1, audio2, image2 = make_audio(1.0, 240, 8), make_audio(1.1, 180, 9), make_image(90)
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    runner.open_session("s")
    runner.append_audio("s", audio1)
    runner.begin_reply("s", [], text_only=True)
    steps = []
    while runner.has_work():
        steps.append(runner.step())
    assert not any(isinstance(o, AudioOut) for step in steps for o in step)
    first = runner.records["s"]
    assert len(first.text_ids) > 0 and first.codes.shape[1] == 0
    stream_turn(runner, "s", audio2, [image2])
    ref = reference(loaded, audio2, [image2], history=[HistoryTurn(audio1, (), first.text_ids)])
    assert_same(runner.records["s"], ref)


def test_cancel_then_next_turn_keeps_what_was_said(loaded):
    audio1, audio2 = make_audio(1.0, 210, 10), make_audio(1.0, 350, 11)
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    runner.open_session("s")
    runner.append_audio("s", audio1)
    runner.begin_reply("s", [])
    for _ in range(3):
        runner.step()
    runner.cancel_reply("s")
    done = runner.step()[-1]
    assert isinstance(done, ReplyDone) and done.reason == "cancelled"
    assert not runner.has_work()
    said = runner.records["s"].text_ids
    assert 0 < len(said) < TOKENS
    stream_turn(runner, "s", audio2, [])
    ref = reference(loaded, audio2, [], history=[HistoryTurn(audio1, (), said)])
    assert_same(runner.records["s"], ref)


def test_discard_turn_rolls_back_the_prefilled_audio(loaded):
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, audio_window_s=1.0)
    runner.open_session("s")
    start = runner.sessions["s"].thinker.length
    runner.append_audio("s", make_audio(1.3, 220, 12))
    assert runner.sessions["s"].thinker.length > start
    runner.discard_turn("s")
    # The static slot cache masks keys by index: the length is all there is to roll back.
    assert runner.sessions["s"].thinker.length == start


def test_a_discard_keeps_the_audio_of_committed_items(loaded):
    """A user item committed with no reply (end_user_item), more speech, a discard: only the
    speech after the item goes; the reply to what follows is the one of the turn that never
    had that speech (text, codes, tokens prefilled). Without an item, the whole turn goes."""
    item, dropped, after = make_audio(1.4, 220, 21), make_audio(0.9, 330, 22), make_audio(1.1, 440, 23)

    def answer(runner: StreamingRunner, sid: str, spoken: list[np.ndarray], discard_after: int | None):
        runner.open_session(sid)
        for n, wav in enumerate(spoken):
            runner.append_audio(sid, wav)
            if n == 0:
                runner.end_user_item(sid)  # the item is committed; the turn goes on
            while runner.has_work():  # prefilled before the discard: it comes back out of the cache
                runner.step()
            if n == discard_after:
                runner.discard_turn(sid)
        runner.begin_reply(sid, [])
        while runner.has_work():
            runner.step()
        return runner.records[sid]

    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    kept = answer(runner, "kept", [item, after], None)
    cleared = answer(runner, "cleared", [item, dropped, after], 1)
    assert cleared.prefill_tokens == kept.prefill_tokens
    assert cleared.text_ids == kept.text_ids and np.array_equal(cleared.codes, kept.codes)
    # No item committed: the discard takes the whole turn, as a false start.
    runner.open_session("false_start")
    start = runner.sessions["false_start"].thinker.length
    runner.append_audio("false_start", dropped)
    runner.discard_turn("false_start")
    state = runner.sessions["false_start"]
    assert state.thinker.length == start and not state.turn.pending_audio and not state.turn.kept_tokens


def test_two_sessions_stepped_together_stay_independent(loaded, compiled):
    inputs = {"a": (make_audio(1.2, 220, 13), [make_image(5)]), "b": (make_audio(1.0, 400, 14), [])}
    runner = StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, **compiled
    )
    for sid, (audio, _) in inputs.items():
        runner.open_session(sid)
        runner.append_audio(sid, audio)
    runner.begin_reply("a", inputs["a"][1])
    runner.step()  # "b" starts one frame later
    runner.begin_reply("b", inputs["b"][1])
    done = set()
    while runner.has_work():
        done |= {o.session_id for o in runner.step() if isinstance(o, ReplyDone)}
    assert done == {"a", "b"}
    for sid, (audio, images) in inputs.items():
        assert_same(runner.records[sid], reference(loaded, audio, images))
