"""End-of-turn cost of the camera, in the engine alone: time from begin_reply to the first audio.

Three ways to end the same 3 s spoken turn, alternated so that drift hits them alike:
  off     no camera;
  video   a 640x480 camera at 4 fps, handed over as it arrives during the turn (the video
          path: grids encoded and prefilled among the audio tokens while the user speaks);
  stills  two 640x480 frames given to the reply as still images at the end of the turn
          (encoded and prefilled on the critical path: the cost the video path removes).
The realtime path adds decoding and sampling the camera on top (scripts/bench_rtc.py measures
that, camera on vs off, end to end); this isolates what the model does at the end of the turn.
Per mode: first audio P50, and per turn the grids encoded and prefilled after the turn ended.
Last line: `eot_video_ratio=R eot_stills_ratio=S video_tokens=V` (video / off and stills / off,
medians; video tokens per turn).

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
from agent.engine.api import AudioOut, ReplyDone  # noqa: E402
from agent.engine.checkpoints.model import load_model  # noqa: E402
from agent.engine.checkpoints.tiny import ensure_model  # noqa: E402
from agent.engine.runner.streaming import StreamingRunner  # noqa: E402


def speech_like(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.shape) * 0.02
    return (0.2 * np.sin(2 * np.pi * 220 * t) * (t > 0.2) + noise).astype(np.float32)


def one_turn(
    runner: StreamingRunner, sid: str, audio: np.ndarray, frames: list[np.ndarray], mode: str
) -> tuple[float, dict]:
    runner.open_session(sid)
    try:
        fed = 0
        for i in range(0, len(audio), 1280):
            while mode == "video" and fed < len(frames) and fed / 4 <= i / 16000:
                runner.append_video(sid, frames[fed], fed / 4)
                fed += 1
            runner.append_audio(sid, audio[i : i + 1280])
        started = time.perf_counter()
        runner.begin_reply(sid, frames[-2:] if mode == "stills" else [])
        first, stats = float("nan"), {}
        while runner.has_work():
            outputs = runner.step()
            if np.isnan(first) and any(isinstance(o, AudioOut) for o in outputs):
                first = time.perf_counter() - started
            for o in outputs:
                if isinstance(o, ReplyDone):
                    stats = o.stats
        return first, stats
    finally:
        runner.close_session(sid)


def moving(seconds: float) -> list[np.ndarray]:
    """A 640x480 camera at 4 fps: a bright square moving over a textured background."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)
    frames = []
    for i in range(int(seconds * 4)):
        f = base.copy()
        x = (40 * i) % 560
        f[200:280, x : x + 80] = 255
        frames.append(f)
    return frames


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("OMNI_AGENT_MODEL", ""))
    p.add_argument("--device", default="cpu")
    p.add_argument("--turns", type=int, default=6, help="turns per mode")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ensure_model(Config(model=args.model)), device=args.device, dtype="auto")
    runner = StreamingRunner(
        loaded,
        "You are a helpful assistant.",
        max_reply_tokens=8,
        max_reply_seconds=0.5,
        audio_window_s=Config().audio_window_s,
    )
    audio, frames = speech_like(3.0, 1), moving(3.0)
    one_turn(runner, "warm", audio, frames, "video")
    one_turn(runner, "warm2", audio, frames, "stills")
    modes = ("off", "video", "stills")
    times: dict[str, list[float]] = {m: [] for m in modes}
    late: dict[str, list[tuple[int, int, int]]] = {m: [] for m in modes}
    for turn in range(args.turns):
        for mode in modes:
            first, stats = one_turn(runner, f"{mode}{turn}", audio, frames, mode)
            times[mode].append(first)
            late[mode].append(
                (
                    int(stats.get("video_grids_encoded_at_end_of_turn", 0)),
                    int(stats.get("video_grids_prefilled_at_end_of_turn", 0)),
                    int(stats.get("input_video_tokens", 0) + stats.get("input_image_tokens", 0)),
                )
            )
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(
        f"{'camera':>7} {'turns':>5} {'first audio p50':>15} {'grids encoded at end':>21} "
        f"{'grids prefilled at end':>23} {'visual tokens':>14}"
    )
    for mode in modes:
        enc = max(e for e, _, _ in late[mode])
        pre = max(p for _, p, _ in late[mode])
        tok = int(np.median([t for _, _, t in late[mode]]))
        print(f"{mode:>7} {len(times[mode]):>5} {med[mode] * 1000:>12.1f} ms {enc:>21} {pre:>23} {tok:>14}")
    video_tokens = int(np.median([t for _, _, t in late["video"]]))
    print(
        f"eot_video_ratio={med['video'] / med['off']:.2f} eot_stills_ratio={med['stills'] / med['off']:.2f} "
        f"video_tokens={video_tokens}"
    )


if __name__ == "__main__":
    main()
