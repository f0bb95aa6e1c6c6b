"""End-of-turn cost of the camera, in the engine alone: time from begin_reply to the first audio.

Three ways to end the same 1.5 s spoken turn, alternated so that drift hits them alike:
  off      no camera;
  arrival  two 448x336 frames, encoded as they arrived (Engine.append_video → StreamingRunner);
  late     the same two frames, seen only at the end of the turn (encoded on the critical path).
The realtime path adds decoding and sampling the camera on top (scripts/bench_rtc.py measures
that, camera on vs off, end to end); this isolates what the model does at the end of the turn.
Last line: `eot_camera_ratio=R eot_camera_late_ratio=L` (arrival / off and late / off, medians).

    .venv/bin/python scripts/bench_video.py [--model PATH] [--turns 6] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.config import Config  # noqa: E402
from agent.engine import ensure_model  # noqa: E402
from agent.engine.api import AudioOut, ReplyDone  # noqa: E402
from agent.engine.model import load_model  # noqa: E402
from agent.engine.stream import StreamingRunner  # noqa: E402


def speech_like(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.shape) * 0.02
    return (0.2 * np.sin(2 * np.pi * 220 * t) * (t > 0.2) + noise).astype(np.float32)


def one_turn(runner: StreamingRunner, sid: str, audio: np.ndarray, frames: list[np.ndarray], mode: str) -> tuple[float, int]:
    runner.open_session(sid)
    try:
        if mode == "arrival":
            for i, frame in enumerate(frames):
                runner.append_video(sid, frame, 0.25 * i)
        for i in range(0, len(audio), 1280):
            runner.append_audio(sid, audio[i : i + 1280])
        started = time.perf_counter()
        runner.begin_reply(sid, [] if mode == "off" else frames)
        first, late = float("nan"), 0
        while runner.has_work():
            outputs = runner.step()
            if np.isnan(first) and any(isinstance(o, AudioOut) for o in outputs):
                first = time.perf_counter() - started
            for o in outputs:
                if isinstance(o, ReplyDone):
                    late = int(o.stats.get("frames_encoded_at_end_of_turn", 0))
        return first, late
    finally:
        runner.close_session(sid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("OMNI_AGENT_MODEL", ""))
    p.add_argument("--device", default="cpu")
    p.add_argument("--turns", type=int, default=6, help="turns per mode")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ensure_model(Config(model=args.model)), device=args.device, dtype="auto")
    runner = StreamingRunner(loaded, "You are a helpful assistant.", max_reply_tokens=8, max_reply_seconds=0.5)
    rng = np.random.default_rng(0)
    audio = speech_like(1.5, 1)
    one_turn(runner, "warm", audio, [rng.integers(0, 255, (336, 448, 3), dtype=np.uint8)], "late")
    times: dict[str, list[float]] = {"off": [], "arrival": [], "late": []}
    late_frames: dict[str, int] = {k: 0 for k in times}
    for turn in range(args.turns):
        frames = [rng.integers(0, 255, (336, 448, 3), dtype=np.uint8) for _ in range(2)]
        for mode in times:
            first, late = one_turn(runner, f"{mode}{turn}", audio, frames, mode)
            times[mode].append(first)
            late_frames[mode] += late
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{'camera':>8} {'turns':>5} {'first audio p50':>15} {'frames encoded at end':>22}")
    for mode, values in times.items():
        print(f"{mode:>8} {len(values):>5} {med[mode] * 1000:>12.1f} ms {late_frames[mode]:>22}")
    print(f"eot_camera_ratio={med['arrival'] / med['off']:.2f} eot_camera_late_ratio={med['late'] / med['off']:.2f}")


if __name__ == "__main__":
    main()
