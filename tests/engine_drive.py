"""Shared by the engine tests: microphone audio and the loop that feeds it to a runner
(imported by test modules, not a test itself)."""

from __future__ import annotations

import numpy as np
import torch

from agent.engine.stream import StreamingRunner

PIECE = 1280  # 80 ms of 16 kHz microphone audio: one ingest chunk


def make_audio(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A tone plus seeded noise at 16 kHz. Loudest first: the streamed log-mel then equals the
    feature extractor's (its normalisation uses the running maximum, which the first sample fixes)."""
    t = np.arange(int(16000 * seconds)) / 16000
    wav = 0.2 * np.sin(2 * np.pi * freq * t) + np.random.default_rng(seed).standard_normal(t.shape) * 0.02
    wav[:40] = 0.5
    return wav.astype(np.float32)


def speak(runner: StreamingRunner, sid: str, audio: np.ndarray) -> None:
    """Hand `audio` to the runner in ingest-sized pieces, as the engine thread does."""
    for i in range(0, len(audio), PIECE):
        runner.append_audio(sid, audio[i : i + PIECE])


def assert_loop_equals_eager(predictor, batch: int, seed: int) -> torch.Tensor:
    """The code predictor's loop as the engine runs it (`run`: graphed, compiled) against the
    eager loop (`_run`) on seeded inputs: the same codes exactly, the same embedding sums to
    float rounding, and codes that vary (a loop that really ran). Returns the codes."""
    gen = torch.Generator().manual_seed(seed)
    hidden = predictor.talker_embed.embedding_dim
    with torch.inference_mode():
        last = torch.randn(batch, 1, hidden, generator=gen)
        code0 = torch.randint(0, 2048, (batch,), generator=gen)
        codes, sums = predictor.run(last, code0)
        want_codes, want_sums = predictor._run(last, code0)
    torch.testing.assert_close(codes, want_codes, rtol=0, atol=0)
    torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-4)
    assert len(set(codes[:, 1:].flatten().tolist())) > 1
    return codes
