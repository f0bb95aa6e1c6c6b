"""What one session's long instructions cost the others: the engine thread's longest block and
another session's time to first audio.

Side by side in one run, on the tiny model (CPU) or --model: session B sets instructions of N
tokens, and at that moment session C's turn ends; session A is speaking. Two cases:
- open: B sets them before its first turn; they replace its system prompt
  (agent/engine/stages/system_prefill.py).
- changed: B has had a reply. The instructions wait for B's next turn as a system message in
  its closing, and B starts speaking (agent/engine/stages/turn_prefill.py flush_audios).
Each case is measured twice on the same runner code. "now" uses chunks of
prefill_chunk_tokens: the first chunk when the instructions are set or the audio arrives, the
rest a chunk per tick. "before" uses one chunk as large as the context, so everything goes in
one forward, as it did before.
- longest block: the longest single call on the engine thread until B's instructions are in
  and C's reply has its first audio. That call is the set_instructions command, an
  append_audio, or one tick. Every session's audio and commands wait that long.
- C first audio: from B's command (C's end of turn is queued right behind it) to C's first
  AudioOut.
- B in: until B's instructions are all in the cache.

    python scripts/bench_system_prefill.py
    python scripts/bench_system_prefill.py --tokens 2000,8000,16000 --repeats 3 --cases open,changed

Prints a table (medians over --repeats) and a last line with the ratios before / now at the
largest size, per case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from agent.engine.api import AudioOut
from agent.engine.checkpoints.model import load_model, system_turn_ids
from agent.engine.checkpoints.tiny import make_tiny
from agent.engine.runner.scheduler import SchedulerConfig
from agent.engine.runner.streaming import StreamingRunner

CONTEXT = 32768


def tone(seconds: float, freq: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def prompt_of(loaded, tokens: int) -> str:
    """Instructions of about `tokens` tokens (never fewer)."""
    rules, n = [], 0
    while n < tokens:
        rules.append(" ".join(f"rule{len(rules)}-{j} is to be brief and kind." for j in range(50)))
        n = len(system_turn_ids(loaded.ids, loaded.tokenizer, " ".join(rules)))
    return " ".join(rules)


def speak(runner: StreamingRunner, sid: str, audio: np.ndarray) -> None:
    for i in range(0, len(audio), 1280):
        runner.append_audio(sid, audio[i : i + 1280])


def one(loaded, prompt: str, chunk: int, case: str) -> dict:
    runner = StreamingRunner(
        loaded,
        "You are a helpful voice assistant.",
        max_reply_tokens=64,
        max_reply_seconds=30.0,
        max_sessions=4,
        context_limit=CONTEXT,
        audio_window_s=1.0,  # the agent's default: speech is prefilled as it comes
        schedule=SchedulerConfig(prefill_chunk_tokens=chunk),
    )
    for sid in ("a", "b", "c"):
        runner.open_session(sid)
    if case == "changed":  # b has had a reply: its new instructions wait for its next turn
        speak(runner, "b", tone(1.0, 440))
        runner.begin_reply("b", [])
    while runner.has_work():
        runner.step()
    speak(runner, "a", tone(1.0, 220))
    runner.begin_reply("a", [])
    for _ in range(3):  # a speaks
        runner.step()
    speak(runner, "c", tone(1.0, 330))

    b = runner.sessions["b"]
    want = len(system_turn_ids(loaded.ids, loaded.tokenizer, prompt)) + (b.thinker.length if case == "changed" else 0)
    started = time.perf_counter()
    runner.set_instructions("b", prompt)
    blocks = [time.perf_counter() - started]
    if case == "changed":  # b speaks: the instructions go in with its turn (a busy engine: in ticks)
        audio = tone(1.5, 440)
        for i in range(0, len(audio), 1280):
            tick = time.perf_counter()
            runner.append_audio("b", audio[i : i + 1280])
            blocks.append(time.perf_counter() - tick)
    runner.begin_reply("c", [])
    first = b_in = None
    ticks = 0
    for _ in range(2000):
        if b_in is None and b.system is None and b.thinker.length >= want and b.turn.flushing is None:
            b_in = time.perf_counter() - started
        if first is not None and b_in is not None:
            break
        tick = time.perf_counter()
        outputs = runner.step()
        blocks.append(time.perf_counter() - tick)
        ticks += 1
        if first is None and any(isinstance(o, AudioOut) and o.session_id == "c" for o in outputs):
            first = time.perf_counter() - started
    return {"block": max(blocks), "first": first, "b_in": b_in, "ticks": ticks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a checkpoint path or hub id (default: the tiny model)")
    parser.add_argument("--tokens", default="2000,8000,16000", help="instruction sizes, in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=SchedulerConfig().prefill_chunk_tokens)
    parser.add_argument(
        "--cases",
        default="open,changed",
        help="open: instructions set before B's first turn; changed: after B's first reply, then B speaks",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or str(make_tiny(Path.home() / ".cache" / "omni-agent" / "tiny-qwen3-omni"))
    loaded = load_model(path)

    rows = []
    for case in args.cases.split(","):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            prompt = prompt_of(loaded, tokens)
            n = len(system_turn_ids(loaded.ids, loaded.tokenizer, prompt))
            for name, chunk in (("before: one forward", CONTEXT), (f"now: chunks of {args.chunk}", args.chunk)):
                runs = [one(loaded, prompt, chunk, case) for _ in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append((case, n, name, med))

    print(
        f"{'case':<7} | {'prompt':>7} | {'instructions go in':<20} | {'longest block':>13} | {'C first audio':>13}"
        f" | {'B in':>8} | ticks"
    )
    print("-" * 96)
    for case, n, name, m in rows:
        print(
            f"{case:<7} | {n:>7} | {name:<20} | {m['block'] * 1000:>10.0f} ms | {m['first'] * 1000:>10.0f} ms"
            f" | {m['b_in'] * 1000:>5.0f} ms | {m['ticks']:.0f}"
        )
    last = []
    for case in args.cases.split(","):
        (_, n, _, before), (_, _, _, now) = [r for r in rows if r[0] == case][-2:]
        last.append(
            f"{case}: prompt={n} longest_block before/now={before['block'] / now['block']:.1f}x"
            f" c_first_audio before/now={before['first'] / now['first']:.1f}x"
            f" b_in now/before={now['b_in'] / before['b_in']:.2f}x"
        )
    print("; ".join(last))


if __name__ == "__main__":
    main()
