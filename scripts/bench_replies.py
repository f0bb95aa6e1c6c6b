"""Timed replies for scripts/bench_engine.py: sessions that speak, end their turns at one moment,
and are stepped to the end of their replies; what each reply measured (TTFT, TTFA, the stages
before the first audio frame, per-frame costs, real-time factor) and the table of medians."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from bench_kernels import speak

from agent.engine.api import AudioOut, ReplyDone, StageTime, TextDelta


@dataclass
class Reply:
    ttft: float = float("nan")
    ttfa: float = float("nan")
    total: float = float("nan")
    audio_s: float = 0.0
    first: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # stage → s before first audio
    per_frame: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


def run_replies(runner, audio: np.ndarray, image: np.ndarray, sessions: int, tag: str) -> list[Reply]:
    """Open `sessions` sessions, 'speak' the audio into each, end all turns at once, step to the end."""
    sids = [f"{tag}{i}" for i in range(sessions)]
    # Work done while the user was speaking (incremental encode/prefill, and the stage
    # records it left pending) is not end-of-turn latency: speak() lets the runner finish it.
    speak(runner, sids, audio)
    replies = {sid: Reply() for sid in sids}
    t0 = time.perf_counter()
    for sid in sids:
        runner.begin_reply(sid, [image])
    open_ = set(sids)
    while open_:
        for out in runner.step():
            now = time.perf_counter() - t0
            sid = getattr(out, "session_id", "")
            r = replies.get(sid)
            if r is None:
                continue
            if isinstance(out, StageTime):
                if np.isnan(r.ttfa):
                    r.first[out.stage] += out.seconds
                if out.stage in ("code_predictor", "code2wav"):
                    r.per_frame[out.stage].append(out.seconds)
            elif isinstance(out, TextDelta) and np.isnan(r.ttft):
                r.ttft = now
            elif isinstance(out, AudioOut):
                if np.isnan(r.ttfa):
                    r.ttfa = now
                r.audio_s += len(out.pcm) / 24000
            elif isinstance(out, ReplyDone):
                r.total = now
                open_.discard(sid)
    for sid in sids:
        runner.close_session(sid)
    return [replies[sid] for sid in sids]


def med(values: list[float]) -> float:
    values = [v for v in values if not np.isnan(v)]
    return statistics.median(values) if values else float("nan")


def summarize(name: str, runs: list[list[Reply]]) -> dict[str, float]:
    flat = [r for run in runs for r in run]
    pf = lambda stage: med([statistics.mean(r.per_frame[stage]) for r in flat if r.per_frame[stage]])  # noqa: E731
    return {
        "name": name,
        "pre": med([r.first["audio_encoder"] + r.first["vision_encoder"] + r.first["preprocessing"] for r in flat]),
        "thinker": med([r.first["thinker_prefill"] + r.first["thinker_decode"] for r in flat]),
        "talker": med([r.first["talker_step"] for r in flat]),
        "mtp": med([r.first["code_predictor"] for r in flat]),
        "codec": med([r.first["code2wav"] for r in flat]),
        "ttft": med([r.ttft for r in flat]),
        "cp_frame": pf("code_predictor"),
        "c2w_frame": pf("code2wav"),
        "ttfa": med([r.ttfa for r in flat]),
        "ttfa_max": max((r.ttfa for r in flat), default=float("nan")),
        "rtf": med([r.total / r.audio_s for r in flat if r.audio_s]),
        "audio_s": med([r.audio_s for r in flat]),
    }


def print_table(rows: list[dict[str, float]], title: str) -> None:
    """The rows of summarize() as one table, in milliseconds."""
    ms = lambda v: "     -" if np.isnan(v) else f"{v * 1000:6.1f}"  # noqa: E731
    print(f"\n{title} (medians, ms; the five stage columns are time spent before the first audio frame)")
    print(
        f"{'run':<18} {'pre+enc':>7} {'thinker':>7} {'talker':>6} {'MTP':>6} {'codec':>6} {'TTFT':>6} "
        f"{'TTFA':>6} {'TTFA max':>8} {'MTP/frm':>7} {'c2w/frm':>7} {'RTF':>5} {'audio s':>7}"
    )
    for r in rows:
        print(
            f"{r['name']:<18} {ms(r['pre']):>7} {ms(r['thinker']):>7} {ms(r['talker']):>6} {ms(r['mtp']):>6} "
            f"{ms(r['codec']):>6} {ms(r['ttft']):>6} {ms(r['ttfa']):>6} {ms(r['ttfa_max']):>8} "
            f"{ms(r['cp_frame']):>7} {ms(r['c2w_frame']):>7} {r['rtf']:5.2f} {r['audio_s']:7.2f}"
        )
