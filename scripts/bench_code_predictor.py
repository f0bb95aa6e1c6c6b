"""The code-predictor loop alone, compiled, with fused projections and with library matmuls, side by side.

Each 80 ms codec frame runs the code predictor's 15 sequential steps through its 5 layers: at
real size the loop is launch-bound (docs/engine-roofline.md). Compiled, its projections are
either reductions with the norms, gate and residual adds fused in (agent/engine/ops/gemv.py, the
default) or library matmuls (`GraphConfig(fused_gemv=False)`). This builds only the code
predictor at Qwen3-Omni-30B-A3B's dimensions (random weights, `--layers` deep) and the talker
embedding it reads, wires it as the engine does (`Graphing`: compile on; CUDA graphs on CUDA,
padded buckets on CPU) and, for each variant in one process, reports:
- the time of one loop (`run()`: a frame batch's 15 codebooks), median over `--iters`, per batch;
- the launches of one compiled loop (agent/engine/instruments/kernel_count.py: the generated `call()`'s
  launching statements; on CPU also `sched`, the fused nodes Triton would launch one kernel each).

    python scripts/bench_code_predictor.py --device cuda --batch 1,4      # on a GPU (gpu_check.sh)
    python scripts/bench_code_predictor.py --layers 1 --batch 1 --iters 3   # CPU: the launch counts

Timing on a shared CPU is noisy and not what the variants are for (a GPU's launch cost is):
on CPU read the launch columns. Last line:
`cp_ms_b1_fused=T cp_ms_b1_library=T cp_speedup_b1=R launches_fused=N launches_library=N`.

`--steps` compares instead how the loop's steps are compiled, both with fused projections:
each step one nested compile region, generated once and called 15 times (`CodeStep.forward`,
the engine's way), against every step inlined, the loop unrolled (`CodeStep.step` called
directly). Its table adds the cold compile (a fresh inductor cache per variant, so each is a
cold start); last line `cp_compile_s_regions=S cp_compile_s_unrolled=S compile_speedup=R
sched_regions=N sched_unrolled=N cp_ms_b1_regions=T cp_ms_b1_unrolled=T`.

    python scripts/bench_code_predictor.py --steps --layers 1 --batch 1 --iters 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
from torch import nn


def build(layers: int, device: torch.device, dtype: torch.dtype) -> types.SimpleNamespace:
    """A talker stand-in holding what CodePredictorOps reads: the code predictor, the codec
    embedding and the number of codebooks (the real talker is ~6 GB more)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as CodePredictor,
    )

    from agent.engine.checkpoints.presets import REAL, preset_config

    talker_config = preset_config(REAL).talker_config
    config = talker_config.code_predictor_config
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        predictor = CodePredictor(config).to(dtype).eval()
        embed = nn.Embedding(talker_config.text_config.vocab_size, config.hidden_size).to(dtype)
    return types.SimpleNamespace(
        code_predictor=predictor,
        get_input_embeddings=lambda: embed,
        config=types.SimpleNamespace(num_code_groups=talker_config.num_code_groups),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    talker,
    fused: bool,
    batches: list[int],
    iters: int,
    device: torch.device,
    dtype: torch.dtype,
    dynamic_batch: bool,
    unrolled: bool = False,
):
    from agent.engine.compile.wiring import GraphConfig, Graphing
    from agent.engine.instruments.kernel_count import KernelCounter, marking_scheduled_kernels
    from agent.engine.stages.code_predictor import CodePredictorOps

    config = GraphConfig(
        batch_sizes=tuple(batches),
        compile="on",
        compile_dynamic_batch=dynamic_batch,
        fused_gemv=fused,
        compile_cache=Path(tempfile.mkdtemp(prefix="bench-cp-")),  # a cold compile per variant
    )
    graphing = Graphing(config, device, max(batches))
    torch._dynamo.reset()  # the other variant's compiled loop must not serve this one
    with marking_scheduled_kernels(), KernelCounter() as counter:
        ops = CodePredictorOps(talker, device, dtype, graphing)
        if unrolled:  # each step called as a plain method: dynamo inlines it, the loop unrolled
            ops.code_step.forward = ops.code_step.step
        started = time.perf_counter()
        ops.capture_graphs()  # compiles, then warms (and on CUDA captures) every bucket
        sync(device)
        compile_s = time.perf_counter() - started
    calls = max(counter.graph_calls.total(), 1)
    # The compiled loop's own kernels (the eager copies around it count 1 in both: left out).
    eager = counter.total - counter.compiled.total()
    launches, scheduled = counter.compiled.total() / calls, (counter.scheduled.total() - eager) / calls
    hidden = talker.get_input_embeddings().embedding_dim
    times = {}
    for batch in batches:
        last = torch.randn(batch, 1, hidden, device=device, dtype=dtype)
        code0 = torch.randint(0, 2048, (batch,), device=device)
        ops.run(last, code0)
        samples = []
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            ops.run(last, code0)
            sync(device)
            samples.append(time.perf_counter() - t0)
        times[batch] = statistics.median(samples)
    return times, launches, scheduled, compile_s, graphing.mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=5, help="code-predictor depth (published: 5)")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--steps",
        action="store_true",
        help="compare the steps as nested compile regions (the engine's way) with the loop unrolled, both fused",
    )
    p.add_argument(
        "--dynamic-batch",
        action="store_true",
        help="one compile for every batch (the engine's CPU default) instead of one per batch (its CUDA "
        "default, and fused differently: count and time what production runs)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    talker = build(args.layers, device, dtype)
    results = {}
    variants = (
        (("regions", True, False), ("unrolled", True, True))
        if args.steps
        else (("fused", True, False), ("library", False, False))
    )
    with torch.inference_mode():
        for name, fused, unrolled in variants:
            results[name] = measure(
                talker, fused, args.batch, args.iters, device, dtype, args.dynamic_batch, unrolled=unrolled
            )
            print(f"# {name}: compiled and captured in {results[name][3]:.0f} s", flush=True)
    if args.steps:
        report_steps(args, results, device)
        return
    mode = results["fused"][4]
    compiles = "one compile for all batches" if args.dynamic_batch else "one compile per batch"
    print(
        f"\nCODE PREDICTOR LOOP (15 steps x {args.layers} layers, real width, bf16, {device}, graphs={mode}, "
        f"{compiles}, torch {torch.__version__}); ms per loop, median of {args.iters}; launches and sched per loop, "
        f"averaged over the batches"
    )
    print(f"{'projections':<12} {'launches':>9} {'sched':>7} " + " ".join(f"{f'b{b} ms':>8}" for b in args.batch))
    for name, (times, launches, scheduled, _, _) in results.items():
        print(
            f"{name:<12} {launches:>9.0f} {scheduled:>7.0f} " + " ".join(f"{times[b] * 1e3:>8.2f}" for b in args.batch)
        )
    b1 = args.batch[0]
    fused_ms, library_ms = results["fused"][0][b1] * 1e3, results["library"][0][b1] * 1e3
    print(
        f"cp_ms_b{b1}_fused={fused_ms:.2f} cp_ms_b{b1}_library={library_ms:.2f} "
        f"cp_speedup_b{b1}={library_ms / fused_ms:.2f} launches_fused={results['fused'][1]:.0f} "
        f"launches_library={results['library'][1]:.0f}"
    )


def report_steps(args: argparse.Namespace, results: dict, device: torch.device) -> None:
    compiles = "one compile for all batches" if args.dynamic_batch else "one compile per batch"
    print(
        f"\nCODE PREDICTOR STEPS (15 steps x {args.layers} layers, real width, bf16, {device}, fused projections, "
        f"{compiles}, torch {torch.__version__}); cold compile and capture in s; launches and sched per loop; "
        f"ms per loop, median of {args.iters}"
    )
    print(
        f"{'steps':<10} {'compile s':>10} {'launches':>9} {'sched':>7} "
        + " ".join(f"{f'b{b} ms':>8}" for b in args.batch)
    )
    for name, (times, launches, scheduled, compile_s, _) in results.items():
        print(
            f"{name:<10} {compile_s:>10.1f} {launches:>9.0f} {scheduled:>7.0f} "
            + " ".join(f"{times[b] * 1e3:>8.2f}" for b in args.batch)
        )
    b1 = args.batch[0]
    regions, unrolled = results["regions"], results["unrolled"]
    print(
        f"cp_compile_s_regions={regions[3]:.1f} cp_compile_s_unrolled={unrolled[3]:.1f} "
        f"compile_speedup={unrolled[3] / regions[3]:.2f} sched_regions={regions[2]:.0f} "
        f"sched_unrolled={unrolled[2]:.0f} cp_ms_b{b1}_regions={regions[0][b1] * 1e3:.2f} "
        f"cp_ms_b{b1}_unrolled={unrolled[0][b1] * 1e3:.2f}"
    )


if __name__ == "__main__":
    main()
