"""Shared by the engine tests: microphone audio and the loop that feeds it to a runner
(imported by test modules, not a test itself)."""

from __future__ import annotations

import numpy as np

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
