"""Sampled replies: the streaming engine equals generate(do_sample=True) from the same seed.

generate() draws with `torch.multinomial`; here it is patched to draw from the same noise the
engine uses (agent/engine/ops/sampling.py: a race over transformers' own softmax, i.e. a multinomial
draw whose randomness is a function of the reply's seed, stage and draw index). Everything else
is transformers' own: its logits processors (repetition penalty over the whole prompt for the
thinker, suppressed codec ids, temperature, top-k, top-p) and its loop. Pins:
- a sampled reply (thinker, talker and code predictor all sampling, the thinker with a
  repetition penalty) has the same text ids, codes and waveform as generate() on the same
  prompt, and so does a second turn whose prompt holds the first (the penalty sees the history);
- sampling really samples: another seed gives another reply, the same seed the same one, and
  the greedy reply differs from the sampled one;
- compiled (the sampling inside the compiled steps), three sessions stepped together, joining
  one a tick and leaving as they end, so that batches of 1, 2 and 3 rows run in the buckets 1, 2
  and 4 (one padded row), each session with its own seed; the first and the last to join equal
  generate() alone (their frames went through every bucket, padded and not).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from support.engine_drive import SYSTEM, generate_reference, make_audio, speak

from agent.decoding import QWEN_CODE_PREDICTOR, QWEN_TALKER, Decoding, Sampling
from agent.engine.api import ReplyDone
from agent.engine.checkpoints.model import HistoryTurn, build_inputs
from agent.engine.runner.reference import SAMPLES_PER_FRAME
from agent.engine.runner.streaming import StreamingRunner

TOKENS, FRAMES = 8, 24
SECONDS = FRAMES * SAMPLES_PER_FRAME / 24000
SAMPLED = Decoding(Sampling(True, 0.6, 20, 0.95, 1.05), QWEN_TALKER, QWEN_CODE_PREDICTOR, seed=2024)


def make_image(shift: int) -> np.ndarray:
    y, x = np.mgrid[0:64, 0:64]
    return np.stack([x * 4, y * 4, (x + y + shift) % 256], axis=-1).astype(np.uint8)


def sampled_reference(loaded, monkeypatch, decoding: Decoding, seed: int, audio, images, history=()):
    """generate(do_sample=True) on the same prompt, drawing the reply's noise."""
    inputs = build_inputs(loaded, audio, images, SYSTEM, history=history)
    return generate_reference(loaded, inputs, decoding, seed, TOKENS, FRAMES, monkeypatch)


def assert_same(record, ref) -> None:
    text, codes, wav = ref
    assert list(record.text_ids) == text
    assert record.codes.shape == codes.shape and codes.shape[1] > 0
    np.testing.assert_array_equal(record.codes, codes)
    np.testing.assert_allclose(record.wav, wav, atol=1e-4, rtol=0)


def reply(runner: StreamingRunner, sid: str, audio, images) -> ReplyDone:
    speak(runner, sid, audio)
    runner.begin_reply(sid, images)
    done = None
    while runner.has_work():
        done = next((o for o in runner.step() if isinstance(o, ReplyDone)), done)
    assert done is not None and done.session_id == sid
    return done


def test_sampled_turns_equal_generate_from_the_same_seed(loaded, monkeypatch) -> None:
    audio1, image1 = make_audio(1.4, 230, 21), make_image(3)
    audio2 = make_audio(1.1, 310, 22)
    runner = StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, decoding=SAMPLED
    )
    runner.open_session("s")
    done1 = reply(runner, "s", audio1, [image1])
    first = runner.records["s"]
    assert_same(first, sampled_reference(loaded, monkeypatch, SAMPLED, done1.stats["seed"], audio1, [image1]))
    done2 = reply(runner, "s", audio2, [])
    history = [HistoryTurn(audio1, (image1,), first.text_ids)]
    ref = sampled_reference(loaded, monkeypatch, SAMPLED, done2.stats["seed"], audio2, [], history)
    assert_same(runner.records["s"], ref)
    assert done1.stats["seed"] != done2.stats["seed"]

    # Sampling samples: the same seed replays the reply, another seed and greedy do not.
    def first_reply(decoding: Decoding):
        other = StreamingRunner(
            loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, decoding=decoding
        )
        other.open_session("s")
        reply(other, "s", audio1, [image1])
        return other.records["s"]

    again = first_reply(SAMPLED)
    assert again.text_ids == first.text_ids and np.array_equal(again.codes, first.codes)
    for other in (first_reply(replace(SAMPLED, seed=7)), first_reply(Decoding.greedy())):
        assert other.text_ids != first.text_ids or not np.array_equal(other.codes, first.codes)


def test_sampled_sessions_in_padded_batch_buckets_equal_generate_compiled(loaded, monkeypatch, compiled_options):
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=TOKENS,
        max_reply_seconds=SECONDS,
        record=True,
        decoding=SAMPLED,
        **compiled_options,
    )
    batches: list[int] = []
    run = runner.frames.predictor.run

    def counted(hidden, code0, seeds, frames):
        batches.append(code0.shape[0])
        return run(hidden, code0, seeds, frames)

    runner.frames.predictor.run = counted
    inputs = {
        f"s{i}": (make_audio(0.9 + 0.05 * i, 180 + 25 * i, 40 + i), [make_image(i)] if i % 2 == 0 else [])
        for i in range(3)
    }
    for sid, (audio, _) in inputs.items():
        runner.open_session(sid)
        speak(runner, sid, audio)
    seeds: dict[str, int] = {}
    pending = list(inputs)
    while pending or runner.has_work():
        if pending:  # one new reply per tick: the batch grows to three, then shrinks as they end
            sid = pending.pop(0)
            runner.begin_reply(sid, inputs[sid][1])
        for out in runner.step():
            if isinstance(out, ReplyDone):
                seeds[out.session_id] = out.stats["seed"]
    # Bigger buckets are the same code with more rows (on CPU one compile serves every bucket: the
    # batch dim is dynamic); three sessions reach a padded row, more would only add run time.
    assert set(batches) == {1, 2, 3}, sorted(set(batches))
    assert len(set(seeds.values())) == len(inputs)
    # generate() for the first and the last session to join (each reply went through every bucket
    # the batch passed through); one reference costs ~20 s.
    for sid in ("s0", "s2"):
        audio, images = inputs[sid]
        assert_same(runner.records[sid], sampled_reference(loaded, monkeypatch, SAMPLED, seeds[sid], audio, images))
