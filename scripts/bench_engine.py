"""Engine benchmark in the Qwen3-Omni report's terms, measured side by side in one run.

For the same input (an utterance plus one camera frame) it times:
  * transformers' generate(return_audio=True) (GenerateRunner): no audio until the whole
    reply exists, so its TTFA is its whole run;
  * the streaming engine (StreamingRunner) after a 1 s and an 8 s utterance, the audio
    having been encoded and prefilled while it was "spoken" (untimed, as in a live call):
    TTFA must not grow with the utterance;
  * optionally several sessions ending their turns at the same moment (--batch).

Stages: preprocessing + encoders at end of turn, Thinker first token, Talker first token,
code predictor and code2wav per frame, TTFA, real-time factor (compute / audio length).
Last line: `ttfa_ratio_vs_reference=R utterance_growth=G`.

    .venv/bin/python scripts/bench_engine.py [--repeats 3] [--model PATH] [--batch 1,4] [--context 4096]

The engine is sized to the run, not to the card: one session slot per session of the largest
--batch, --context tokens each (4096 unless told), so a run at real size fits an 80 GB H100
(docs/memory.md).

With --kernels (scripts/bench_kernels.py, docs/engine-roofline.md) it instead counts the
kernels of one engine tick and of the end-of-turn path at real structure (1 and 2 layers per
stack, extrapolated to full depth) and prints a *predicted* H200 time per tick and TTFA. Last
line: `kernels_per_tick_b1=N kernels_per_tick_b4=N kernels_code_predictor=N
kernels_end_of_turn=N predicted_rtf_b4=R predicted_ttfa_b1_ms=T`.

    .venv/bin/python scripts/bench_engine.py --kernels --preset qwen3-omni-30b-a3b --layers 1,2

With --kernels --quantize int4 (scripts/bench_bytes.py) it counts no kernels: it counts the bytes of
the 4-bit model against bf16 on the meta device (weights per stack at 1 and 2 layers extrapolated
to full depth and checked against a full-depth count, the memory plan on a 24 GB card, bytes one
tick reads). Last line: `weights_gib_bf16=X weights_gib_int4=Y total_gib_2_sessions_int4=Z
bytes_per_tick_int4_over_bf16=R`.

    .venv/bin/python scripts/bench_engine.py --kernels --preset qwen3-omni-30b-a3b --layers 1,2 --quantize int4

With --load (scripts/bench_load.py, docs/memory.md) it instead measures what loading the real
checkpoint costs: a hub-shaped random checkpoint at real widths with 1 and 2 layers per stack,
each loaded in a fresh process as `--model DIR` would be (cuda if there is one, else cpu; bf16),
host memory (anonymous RSS) and device memory extrapolated to full depth, and the memory plan's
sessions on an 80 GB H100 and an H200. Last line: `host_peak_gib_full_depth=X
device_peak_gib_full_depth=Y plan_sessions_h100_80g=N plan_sessions_h200=M`.

    .venv/bin/python scripts/bench_engine.py --load --preset qwen3-omni-30b-a3b --layers 1,2
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replies import print_table, run_replies, summarize  # noqa: E402

from agent.config import Config  # noqa: E402


def utterance(seconds: float, seed: int = 0) -> np.ndarray:
    """Speech-like test audio: a loud onset, then noise under a syllable-rate envelope."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    env = 0.25 + 0.2 * np.sin(2 * np.pi * 4 * t) ** 2
    pcm = (rng.standard_normal(n) * env).astype(np.float32) * 0.3
    pcm[:160] = 0.9  # the loudest part first: the streamed log-mel clamp is then exact
    return np.clip(pcm, -1, 1)


def camera_frame(seed: int = 0, side: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)


def load(args: argparse.Namespace):
    import torch

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    from agent.engine.checkpoints.model import load_model
    from agent.engine.checkpoints.tiny import ensure_model

    if args.preset:
        from agent.engine.checkpoints.random_weights import load_random

        return load_random(
            args.preset, device=args.device, tokenizer_from=ensure_model(Config()), quantize=args.quantize
        )
    return load_model(
        ensure_model(Config(model=args.model)), device=args.device, dtype=args.dtype, quantize=args.quantize
    )


# Tokens per session slot in the timed run (--context): the bench's turns need < 1000. The engine's
# own default (32768 tokens, 8 slots) is ~29 GiB of KV beside 65.8 GiB of weights at real size,
# more than an 80 GB H100 holds; this keeps every bench on one.
BENCH_CONTEXT = 4096
KERNEL_CONTEXT = 1024  # --context of the kernel and byte models (--kernels): KV bytes a tick reads
PROFILED_BATCHES = (1, 4)  # --profile-ticks profiles these batches (scripts/bench_profile.py)


def bench_config(cfg: Config, batches: Sequence[int], context: int, profile_ticks: int = 0) -> Config:
    """The Config's session slots and context sized to the run: as many slots as the largest batch
    it runs (the profiled ones too), `context` tokens each, and no transcription slots."""
    slots = max([*batches, *(PROFILED_BATCHES if profile_ticks else ())])
    return replace(cfg, max_sessions=slots, max_transcription_sessions=0, context_limit=context)


def cap_memory(gib: float, device: str) -> None:
    """--memory-cap-gib: a smaller card's budget on a large one. The caching allocator refuses
    (out of memory) past `gib` of this process's allocations (the CUDA context is not counted);
    set before the first allocation, so the load itself runs under it."""
    import torch

    if not device.startswith("cuda"):
        print(f"--memory-cap-gib {gib:g}: no cap on {device} (CUDA only)")
        return
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)
    print(f"memory cap: {gib:g} GiB of {total / 2**30:.1f} GiB on cuda:{index}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint path or id (default: the tiny model)")
    p.add_argument("--preset", default="", help="e.g. qwen3-omni-30b-a3b: real dimensions, random weights")
    p.add_argument("--random-weights", action="store_true", help="with --preset (it never downloads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--quantize",
        choices=("", "int4"),
        default="",
        help="4-bit weights (agent/engine/quant); with --kernels: count the weight, memory-plan and per-tick "
        "bytes of the int4 model against bf16 on the meta device instead of counting kernels (scripts/bench_bytes.py)",
    )
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"tokens of KV per session: the timed run's slots, one per session of the largest --batch "
        f"(default {BENCH_CONTEXT}); with --kernels, the byte model's (default {KERNEL_CONTEXT})",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--max-reply-tokens", type=int, default=24)
    p.add_argument("--max-reply-seconds", type=float, default=2.0)
    p.add_argument(
        "--decoding",
        choices=("greedy", "sample"),
        default="greedy",
        help="token choice in every stage: greedy, or sampled with a real model's defaults "
        "(agent/decoding.py: the choice is then a compiled, graphed step of its own)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip generate() (slow at real size)")
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=0.0,
        help="CUDA: cap this process's device memory (set_per_process_memory_fraction, before the load); "
        "the static caches are sized to the run whether capped or not (--context)",
    )
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="stream eagerly on CUDA")
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default=None,
        help="torch.compile of the per-frame path (passed to the engine's Config; default: its own)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_const", const="off")
    p.add_argument(
        "--fused-gemv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compiled decode-step projections (thinker, talker, code predictor) as fused reductions "
        "(agent/engine/ops/gemv.py) or library matmuls (default: the engine's, fused on CUDA; the kernel run counts fused)",
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument(
        "--compile-dynamic-batch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one compile per step for every batch bucket, or one per bucket (default: the engine's, "
        "one for all buckets)",
    )
    p.add_argument(
        "--compile-regions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each decoder layer once as a nested region, called per layer (default: the engine's, "
        "on CUDA: a cold compile that does not grow with depth; scripts/bench_compile.py)",
    )
    p.add_argument(
        "--compile-budget-s",
        type=float,
        default=0.0,
        help="seconds of compiling the start-up may spend; steps not compiled by then run eagerly, graphed "
        "(0: no limit), so a time-limited run always gets its rows",
    )
    p.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="where the compiled steps' cache lives (inductor's directory and the artifacts file, loaded "
        "before compiling and written after; default: the engine's, under its cache dir)",
    )
    p.add_argument(
        "--profile-ticks",
        type=int,
        default=0,
        help="after the table: the kernels the device ran per steady tick at batch 1 and 4 "
        "(torch.profiler over N steps; scripts/bench_profile.py)",
    )
    k = p.add_argument_group("kernel run (--kernels)")
    k.add_argument(
        "--kernels", action="store_true", help="count kernels and bytes at real structure, predict H200 time"
    )
    k.add_argument("--layers", type=ints, default=[1, 2], help="two depths per stack to difference (default 1,2)")
    k.add_argument("--kernel-batches", type=ints, default=[1, 4, 10], help="steady-tick batch sizes (1 and 4 always)")
    k.add_argument(
        "--graphs",
        choices=("fake", "off"),
        default="fake",
        help="fake: the CUDA-graph wiring on CPU (fused MoE, buckets), as a CUDA run would execute",
    )
    k.add_argument("--kernel-utterance-s", type=float, default=2.5, help="utterance before the counted end of turn")
    k.add_argument("--kernel-reply-tokens", type=int, default=64)
    k.add_argument("--kernel-ops", type=int, default=15, help="print the N most frequent eager ops (0: none)")
    k.add_argument(
        "--count-vocab",
        type=int,
        default=4096,
        help="thinker vocabulary of the counted models (the 152064-row LM head costs ~0.5 s a call on CPU "
        "and is one kernel at any size; the byte model uses the real one)",
    )
    m = p.add_argument_group("load run (--load)")
    m.add_argument(
        "--load",
        action="store_true",
        help="host/device memory of loading the checkpoint (uses --preset and --layers), and the memory plan",
    )
    m.add_argument("--load-dir", default=None, help="where the temporary checkpoints go (default: the system temp dir)")
    args = p.parse_args()
    if args.context is None:
        args.context = KERNEL_CONTEXT if args.kernels else BENCH_CONTEXT
    # Each step's compile time as it finishes: a cold compile at real depth can outlast a time
    # limit on the device, and the log then says how far it got.
    logging.basicConfig(format="# %(relativeCreated)7.0f ms  %(message)s", stream=sys.stdout)
    logging.getLogger("agent.engine.compile").setLevel(logging.INFO)
    if args.load:
        if len(set(args.layers)) != 2:
            p.error("--layers takes two different depths, e.g. 1,2")
        from bench_load import run as run_load

        run_load(args)
        return
    if args.kernels:
        import torch

        if len(set(args.layers)) != 2:
            p.error("--layers takes two different depths, e.g. 1,2")
        if args.quantize:
            from bench_bytes import run as run_bytes

            run_bytes(args)
            return
        if args.threads:
            torch.set_num_threads(args.threads)
        from bench_kernels import run

        with torch.inference_mode():
            run(args, utterance)
        return
    if args.preset and not args.random_weights:
        p.error("--preset needs --random-weights: no checkpoint is downloaded")

    from agent.engine.runner.reference import GenerateRunner
    from agent.engine.runner.streaming import StreamingRunner

    if args.memory_cap_gib:
        cap_memory(args.memory_cap_gib, args.device)
    started = time.perf_counter()
    loaded = load(args)
    print(f"# loaded in {time.perf_counter() - started:.1f} s", flush=True)
    from agent.decoding import QWEN_CODE_PREDICTOR, QWEN_TALKER, QWEN_THINKER, Decoding

    sampled = Decoding(QWEN_THINKER, QWEN_TALKER, QWEN_CODE_PREDICTOR, seed=0)
    cfg = Config(
        max_reply_tokens=args.max_reply_tokens,
        max_reply_seconds=args.max_reply_seconds,
        audio_window_s=1.0,
        cuda_graphs=args.cuda_graphs,
        sampling=sampled if args.decoding == "sample" else Decoding.greedy(seed=0),
    )
    if args.compile is not None:
        if "compile" not in {f.name for f in fields(Config)}:
            p.error("--compile: this engine's Config has no compile option yet")
        cfg = replace(cfg, compile=args.compile)
    cfg = replace(cfg, compile_budget_s=args.compile_budget_s)
    cfg = bench_config(cfg, args.batch, args.context, args.profile_ticks)
    print(f"# slots: {cfg.max_sessions} x {cfg.context_limit} tokens", flush=True)
    from agent.engine.compile.wiring import GraphConfig

    graphs = GraphConfig(
        fused_gemv=args.fused_gemv,
        compile_dynamic_batch=args.compile_dynamic_batch,
        compile_regions=args.compile_regions,
        compile_cache=args.compile_cache,
    )
    started = time.perf_counter()
    stream = StreamingRunner.from_config(loaded, cfg, graphs=graphs)
    compiler = stream.graphing.compiler
    if compiler is not None:
        # Which steps run compiled: a failed or over-budget compile runs that step eagerly
        # (graphed); the rows below then measure that mix, so it is said first.
        seconds = {step: sum(s.values()) for step, s in compiler.compile_seconds().items()}
        report, fallbacks = compiler.cache_report(), compiler.fallbacks()
        print(
            f"# start-up {time.perf_counter() - started:.1f} s (compile cache file: {stream.graphing.artifacts_state}); "
            + "; ".join(
                f"{step} {'eager: ' + fallbacks[step] if step in fallbacks else f'compiled {seconds[step]:.1f} s, cache {report[step]}'}"
                for step in compiler.steps
            ),
            flush=True,
        )
    image = camera_frame()
    short, long_ = utterance(1.0), utterance(8.0, seed=1)

    run_replies(stream, short, image, 1, "warm")  # first-call allocations, lazy init
    rows = []
    for b in args.batch:
        for name, audio, tag in ((f"stream 1 s x{b}", short, "s"), (f"stream 8 s x{b}", long_, "l")):
            rows.append(
                summarize(name, [run_replies(stream, audio, image, b, f"{tag}{b}_{i}_") for i in range(args.repeats)])
            )
            # A row as soon as it is measured: a run cut short by its time limit keeps what it had.
            r = rows[-1]
            print(
                f"# {name}: ttfa_ms={r['ttfa'] * 1000:.1f} rtf={r['rtf']:.2f} cp_frame_ms={r['cp_frame'] * 1000:.1f}",
                flush=True,
            )
    if args.profile_ticks:
        from bench_profile import report, tick_kernels

        try:
            report([tick_kernels(stream, short, image, b, args.profile_ticks, f"p{b}_") for b in (1, 4)])
        except Exception as e:  # the timed rows above must still print (a profiler that fails on the device)
            print(f"profile failed: {type(e).__name__}: {e}", flush=True)
    ref_row = None
    if not args.no_reference:
        reference = GenerateRunner(loaded, cfg.system_prompt, args.max_reply_tokens, args.max_reply_seconds)
        run_replies(reference, short, image, 1, "rwarm")
        ref_row = summarize(
            "generate() 1 s", [run_replies(reference, short, image, 1, f"r{i}_") for i in range(args.repeats)]
        )
        rows.insert(0, ref_row)

    # Whether the streamed rows ran on CUDA graphs (captures per stage stay at one per batch
    # bucket and attention length; refused = batches above the largest bucket, run eagerly).
    stats = [f"{k}={v.captures}c/{v.replays}r/{v.refused}x" for k, v in stream.graphing.stats().items()]
    print(f"\ngraphs={stream.graphing.mode} " + " ".join(stats))
    if args.device == "cuda":
        import torch

        print(f"cuda_peak_allocated_gib={torch.cuda.max_memory_allocated() / 2**30:.1f}")
        if args.memory_cap_gib:
            print(
                f"memory_cap_gib={args.memory_cap_gib:g} "
                f"cuda_peak_reserved_gib={torch.cuda.max_memory_reserved() / 2**30:.2f}"
            )
    print_table(rows, f"model={args.preset or args.model or 'tiny'} device={args.device} repeats={args.repeats}")
    one = next(r for r in rows if r["name"] == "stream 1 s x1") if 1 in args.batch else rows[-2]
    eight = next(r for r in rows if r["name"] == "stream 8 s x1") if 1 in args.batch else rows[-1]
    ratio = one["ttfa"] / ref_row["ttfa"] if ref_row else float("nan")
    print(f"ttfa_ratio_vs_reference={ratio:.3f} utterance_growth={eight['ttfa'] / one['ttfa']:.2f}")


if __name__ == "__main__":
    main()
