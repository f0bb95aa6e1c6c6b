"""A streamed reply against transformers' generate() on the same prompt: the tiny model's
exactness helpers (tests/unit/test_streaming_exact.py, test_quantized.py)."""

from __future__ import annotations

import numpy as np

from agent.engine.api import ReplyDone
from agent.engine.checkpoints.model import build_inputs
from agent.engine.runner.reference import SAMPLES_PER_FRAME
from support import engine_drive
from support.engine_drive import SYSTEM, generate_speaking

TOKENS = 8
FRAMES = 20
SECONDS = FRAMES * SAMPLES_PER_FRAME / 24000


def make_audio(seconds: float, freq: float, seed: int) -> np.ndarray:
    # Loudest first: the streamed log-mel clamps with a running maximum, equal to the
    # extractor's once the maximum has been seen (agent/engine/stages/audio_stream.py).
    return engine_drive.make_audio(seconds, freq, seed, onset_s=0.2)


def make_image(shift: int) -> np.ndarray:
    y, x = np.mgrid[0:64, 0:64]
    return np.stack([x * 4, y * 4, (x + y + shift) % 256], axis=-1).astype(np.uint8)


def reference(loaded, audio, images, history=()):
    """generate() on the same prompt: (text ids without the end, codes [16, frames], waveform)."""
    inputs = build_inputs(loaded, audio, images, SYSTEM, history=history)
    sequences, wav, codes = generate_speaking(loaded, TOKENS, FRAMES, **inputs)
    generated = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    text = [t for t in generated if t not in loaded.thinker_eos_ids]
    return text, codes, wav.reshape(-1).numpy(), inputs["input_ids"].shape[1]


def stream_turn(runner, sid, audio, images):
    """One turn fed in 80 ms pieces; returns (outputs per step, ReplyDone)."""
    for i in range(0, len(audio), 1280):
        runner.append_audio(sid, audio[i : i + 1280])
    runner.begin_reply(sid, images)
    steps = []
    while runner.has_work():
        steps.append(runner.step())
    done = steps[-1][-1]
    assert isinstance(done, ReplyDone)
    return steps, done


def assert_same(record, ref, atol=1e-4):
    text, codes, wav, _ = ref
    assert list(record.text_ids) == text
    assert record.codes.shape == codes.shape and codes.shape[1] > 0
    np.testing.assert_array_equal(record.codes, codes)
    assert record.wav.shape == wav.shape
    np.testing.assert_allclose(record.wav, wav, atol=atol, rtol=0)
