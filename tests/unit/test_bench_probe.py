"""The kernel benchmark's stage labels still fit the engine (scripts/bench_kernels.py).

Pins: `probe_runner` wraps methods a tiny StreamingRunner has (a renamed or moved method fails
here, not on the day someone counts kernels at real size), and one steady tick plus one end of
turn, measured the way `bench_engine.py --kernels` measures them, count kernels under every
stage label the roofline table reads: the four per-frame stages in the tick; the audio tail,
both prefills, the code predictor and code2wav at the end of the turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from support.engine_drive import SYSTEM

from agent.engine.runner.streaming import StreamingRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_kernels import measure, probe_runner  # noqa: E402


def test_every_stage_label_counts_kernels(loaded) -> None:
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=8, max_reply_seconds=1.0)
    probe = probe_runner(runner)
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(16000) * 0.1).astype(np.float32)  # 1 s of noise: a turn to answer
    with torch.inference_mode():
        phases = measure(runner, probe, [1], audio)
    tick, turn = phases["tick_b1"], phases["end_of_turn"]
    for stage in ("thinker_decode", "talker_step", "code_predictor", "code2wav"):
        assert tick.kernels[stage] > 0, (stage, dict(tick.kernels))
        assert tick.calls[stage] == [1], (stage, tick.calls)
    for stage in ("audio_tail", "thinker_prefill", "talker_prefill", "code_predictor", "code2wav"):
        assert turn.kernels[stage] > 0, (stage, dict(turn.kernels))
