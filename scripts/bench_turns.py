"""End of turn on a corpus that knows the truth: the semantic end of turn against a fixed silence.

The corpus (scripts/turn_corpus.py, espeak-ng, many voices, rates and pitches) holds complete
utterances, utterances with a pause inside where the speaker is not done (150-700 ms: mid-clause,
after a conjunction, in a list, between digits, a hesitation), backchannels ("uh-huh", "yeah")
and interruptions. By default only its held-out part is read, which no setting was tuned on.
Each utterance runs through the real Endpointer (Silero voice detection, 80 ms chunks on the
audio clock), twice, side by side:

- fixed: the acoustic endpointer with --fixed-ms of silence (server_vad's 300 ms default);
- semantic: semantic_vad at --eagerness, each pause judged by Smart Turn v3.2 (the fetched ONNX
  model, agent/media/smart_turn.py). A verdict counts from the audio time it was asked plus the
  compute it really took here (one thread), rounded up to the next 20 ms the endpointer decides
  on, so a slow judge costs what it would cost live.

Per utterance: commit ms = the turn's end (SpeechStopped.at) less the true end of speech, for
complete utterances; a false cut = a turn ended before the true end of speech (any utterance).
Backchannels and interruptions run with the agent speaking (the echo guard at a quiet level):
an interrupt = a confirmed barge-in (SpeechStarted). The last line:

    complete_commit_ms_p50=… incomplete_false_cut_rate=… backchannel_interrupt_rate=…
    fixed_commit_ms_p50=… fixed_false_cut_rate=… judge_ms_p50=… pauses_judged_per_utterance=…

    .venv/bin/python scripts/bench_turns.py [--count 240] [--split heldout|tune|all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turn_corpus import Item, build_corpus, load_corpus, read_wav  # noqa: E402

from agent.config import Config  # noqa: E402
from agent.media.ingest import AudioChunk  # noqa: E402
from agent.media.semantic_turn import SemanticEnd, SemanticPolicy  # noqa: E402
from agent.media.smart_turn import SmartTurn  # noqa: E402
from agent.media.turn_events import SpeechStarted, SpeechStopped  # noqa: E402
from agent.media.turn_model import default_path  # noqa: E402
from agent.media.vad import Endpointer  # noqa: E402
from agent.realtime.session_config import turn_detection  # noqa: E402

CHUNK = 1280  # 80 ms at 16 kHz
LATE_S = 0.05  # a stop this much before the true end of speech is a cut (the corpus's precision)


class _Answer:
    def __init__(self, p: float, ready_at: float) -> None:
        self.p, self.ready_at = p, ready_at

    def probability_at(self, t: float) -> Optional[float]:
        return self.p if t >= self.ready_at - 1e-9 else None


class ClockedJudge:
    """Smart Turn, its answer due on the audio clock when the compute it took here is over."""

    def __init__(self, model: SmartTurn, fixed_ms: Optional[float]) -> None:
        self.model, self.fixed_ms = model, fixed_ms
        self.compute_ms: list[float] = []

    def ask(self, audio: np.ndarray, at: float) -> _Answer:
        began = time.perf_counter()
        p = self.model.probability(audio)
        took = (time.perf_counter() - began) * 1000
        self.compute_ms.append(took)
        return _Answer(p, at + (self.fixed_ms if self.fixed_ms is not None else took) / 1000)


@dataclass
class Outcome:
    item: Item
    stops: list[float]  # SpeechStopped.at, audio time of the file
    starts: int
    judged: int = 0


def run(endpointer: Endpointer, pcm: np.ndarray) -> tuple[list[float], int]:
    """Feed a file; the audio times at which turns ended, and how many began."""
    pcm = np.concatenate([pcm, np.zeros(-len(pcm) % CHUNK, np.float32)])
    stops, starts = [], 0
    for i in range(len(pcm) // CHUNK):
        for event in endpointer.push(AudioChunk(pcm=pcm[i * CHUNK : (i + 1) * CHUNK], index=i, start=i * 0.08)):
            if isinstance(event, SpeechStopped):
                stops.append(event.at)
            elif isinstance(event, SpeechStarted):
                starts += 1
    return stops, starts


def pcm_of(item: Item) -> np.ndarray:
    return read_wav(item.path).astype(np.float32) / 32768.0


def commit_ms(o: Outcome) -> Optional[float]:
    """Silence from the true end of speech to the turn's end (None: no turn ended after it)."""
    after = [s for s in o.stops if s >= o.item.end_of_speech_s - LATE_S]
    return (after[0] - o.item.end_of_speech_s) * 1000 if after else None


def cut(o: Outcome) -> bool:
    return any(s < o.item.end_of_speech_s - LATE_S for s in o.stops)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a random positive scores above a random negative), ties half."""
    if not positive or not negative:
        return float("nan")
    pos, neg = np.array(positive)[:, None], np.array(negative)[None, :]
    return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


def print_separation(model: SmartTurn, items: list[Item], ask_after_ms: int) -> None:
    """The judge alone, where the truth is known: its P at ask_after_ms into each inner pause
    (the speaker goes on) against its P as long after the end of each complete utterance."""
    by_engine: dict[str, tuple[list[float], list[float]]] = {}
    for item in items:
        if item.kind not in ("complete", "incomplete"):
            continue
        pcm = pcm_of(item)
        ends, pauses = by_engine.setdefault(getattr(item, "engine", "espeak-ng"), ([], []))
        heard = [int((s + ask_after_ms / 1000) * 16000) for s in (item.end_of_speech_s, *(a for a, _ in item.pauses))]
        if item.kind == "complete":
            ends.append(model.probability(pcm[: heard[0]]))
        pauses += [model.probability(pcm[:n]) for n in heard[1:]]
    print(f"\njudge alone (P at {ask_after_ms} ms into the silence): complete ends against inner pauses")
    print(f"{'engine':<12}{'ends':>6}{'pauses':>8}{'P end p50':>11}{'P pause p50':>13}{'AUC':>7}")
    for engine, (ends, pauses) in sorted(by_engine.items()):
        print(
            f"{engine:<12}{len(ends):>6}{len(pauses):>8}{pct(ends, 0.5):>11.2f}{pct(pauses, 0.5):>13.2f}"
            f"{auc(ends, pauses):>7.3f}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, help="a corpus folder (default: built under /tmp for count and seed)")
    parser.add_argument("--count", type=int, default=240, help="complete + incomplete utterances built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=["heldout", "tune", "all"], default="heldout")
    parser.add_argument("--eagerness", choices=["low", "medium", "auto", "high"], default="auto")
    parser.add_argument("--fixed-ms", type=int, default=Config().vad_silence_ms, help="the fixed silence compared")
    parser.add_argument(
        "--tiers",
        help="override the eagerness's tiers (tuning): P:ms pairs, surest first, e.g. 0.97:150,0.5:600",
    )
    parser.add_argument("--long-ms", type=int, help="override the eagerness's long silence (tuning)")
    parser.add_argument("--ask-after-ms", type=int, help="override when a pause is asked about (tuning)")
    parser.add_argument("--judge-ms", type=float, help="count every verdict this late instead of as measured")
    parser.add_argument("--turn-model", type=Path, default=default_path(Config().cache_dir))
    args = parser.parse_args(argv)

    corpus = args.corpus or Path(f"/tmp/omni-turn-corpus-{args.count}-{args.seed}")
    items = load_corpus(corpus) if (corpus / "corpus.jsonl").exists() else build_corpus(corpus, args.count, args.seed)
    items = [i for i in items if args.split == "all" or i.split == args.split]
    td = turn_detection(
        {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": args.eagerness}}}}, 0
    )
    assert td is not None and td.semantic is not None
    policy, long_ms = td.semantic, args.long_ms or td.silence_ms
    if args.tiers:
        pairs = [pair.split(":") for pair in args.tiers.split(",")]
        policy = SemanticPolicy(tiers=tuple((float(p), int(ms)) for p, ms in pairs), ask_after_ms=policy.ask_after_ms)
    if args.ask_after_ms:
        policy = SemanticPolicy(tiers=policy.tiers, ask_after_ms=args.ask_after_ms)
    judge = ClockedJudge(SmartTurn(args.turn_model), args.judge_ms)
    config = Config()

    fixed: list[Outcome] = []
    semantic: list[Outcome] = []
    barge: list[Outcome] = []
    for item in items:
        pcm = pcm_of(item)
        if item.kind in ("complete", "incomplete"):
            fixed.append(Outcome(item, *run(Endpointer(silence_ms=args.fixed_ms), pcm)))
            end = SemanticEnd(judge, policy)
            semantic.append(Outcome(item, *run(Endpointer(silence_ms=long_ms, semantic=end), pcm), judged=end.asked))
        else:
            # The agent is speaking, quietly (-40 dBFS): barge-in needs barge_in_ms of voice.
            ep = Endpointer(silence_ms=config.vad_silence_ms, barge_in_ms=config.barge_in_ms, echo=lambda: 0.01)
            barge.append(Outcome(item, *run(ep, pcm)))

    def rows(outcomes: list[Outcome], kind: str) -> list[Outcome]:
        return [o for o in outcomes if o.item.kind == kind]

    print(
        f"# bench_turns: {len(items)} items ({args.split}), eagerness {args.eagerness}, {policy}, "
        f"long silence {long_ms} ms; fixed {args.fixed_ms} ms"
    )
    print(
        f"{'endpointer':<12}{'kind':<12}{'n':>5}{'commit p50':>12}{'commit p90':>12}{'false cuts':>12}{'judged/utt':>12}"
    )
    for name, outcomes in (("fixed", fixed), ("semantic", semantic)):
        for kind in ("complete", "incomplete"):
            sel = rows(outcomes, kind)
            commits = [c for c in map(commit_ms, sel) if c is not None]
            cuts = sum(map(cut, sel))
            judged = statistics.mean(o.judged for o in sel) if sel else 0.0
            print(
                f"{name:<12}{kind:<12}{len(sel):>5}{pct(commits, 0.5):>12.0f}{pct(commits, 0.9):>12.0f}"
                f"{cuts / max(1, len(sel)):>12.3f}{judged:>12.2f}"
            )
    print(f"\n{'pause kind':<14}{'n':>5}{'fixed cuts':>12}{'semantic cuts':>15}")
    kinds = sorted({o.item.pause_kind for o in rows(semantic, "incomplete")})
    for pk in kinds:
        f_sel = [o for o in rows(fixed, "incomplete") if o.item.pause_kind == pk]
        s_sel = [o for o in rows(semantic, "incomplete") if o.item.pause_kind == pk]
        print(f"{pk:<14}{len(s_sel):>5}{sum(map(cut, f_sel)):>12}{sum(map(cut, s_sel)):>15}")
    interrupts = {k: sum(o.starts > 0 for o in rows(barge, k)) for k in ("backchannel", "interruption")}
    counts = {k: len(rows(barge, k)) for k in ("backchannel", "interruption")}
    print(
        f"\nbarge-in (barge_in_ms={config.barge_in_ms}): backchannels interrupting {interrupts['backchannel']}/"
        f"{counts['backchannel']}, interruptions confirmed {interrupts['interruption']}/{counts['interruption']}"
    )
    ms = judge.compute_ms
    print(
        f"judge compute: {len(ms)} calls, p50 {pct(ms, 0.5):.1f} ms, p95 {pct(ms, 0.95):.1f} ms (one thread)"
        + (f"; verdicts counted {args.judge_ms:g} ms late" if args.judge_ms is not None else "")
    )

    print_separation(judge.model, items, policy.ask_after_ms)

    s_complete = [c for c in map(commit_ms, rows(semantic, "complete")) if c is not None]
    f_complete = [c for c in map(commit_ms, rows(fixed, "complete")) if c is not None]
    s_inc, f_inc = rows(semantic, "incomplete"), rows(fixed, "incomplete")
    judged = [o.judged for o in semantic]
    print(
        f"complete_commit_ms_p50={pct(s_complete, 0.5):.0f} "
        f"incomplete_false_cut_rate={sum(map(cut, s_inc)) / max(1, len(s_inc)):.3f} "
        f"backchannel_interrupt_rate={interrupts['backchannel'] / max(1, counts['backchannel']):.3f} "
        f"fixed_commit_ms_p50={pct(f_complete, 0.5):.0f} "
        f"fixed_false_cut_rate={sum(map(cut, f_inc)) / max(1, len(f_inc)):.3f} "
        f"judge_ms_p50={pct(ms, 0.5):.1f} "
        f"pauses_judged_per_utterance={statistics.mean(judged) if judged else 0:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
