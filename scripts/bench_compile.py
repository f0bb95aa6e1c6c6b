"""Cold compile time of the thinker's and talker's steps against depth, each layer inlined or a region.

At real depth (48 thinker layers, 20 talker layers) the compiled path's start-up did not finish
inside a GPU session's time (bench/results/engine-h200-2026-12-04.txt): every step is traced and
compiled with all its layers unrolled, so its cold compile grows with depth. With
`GraphConfig(compile_regions=True)` each decoder layer is a nested compile region
(agent/engine/ops/slots.py `decoder_forward`): traced and compiled once, called per layer.

For each depth in `--layers` and each way (inlined, regions) this starts a fresh process with an
empty inductor cache (a cold start, one compile thread) that builds the real structure at
CPU-test widths (agent/engine/checkpoints/presets.py `scaled_overrides`: every stack `L` layers
deep, real head counts, fused q/k/v and MoE as the runner fuses them), wires the steps as CUDA
compiles them (fused projections, one compile for every batch bucket) and times each step's
first compile. The per-layer slope between the two depths extrapolates to the real depths.
Beside the times, the kernels one call of the thinker's and the talker's step launches at batch 4
(agent/engine/instruments/kernel_count.py, scheduled count: about a Triton kernel each): what a
region boundary costs, since inductor fuses nothing across it.

    .venv/bin/python scripts/bench_compile.py --layers 2,6

Last line: `thinker_decode_s_per_layer_inlined=A thinker_decode_s_per_layer_regions=B
thinker_decode_s_at_48_inlined=C thinker_decode_s_at_48_regions=D talker_step_s_at_20_inlined=E
talker_step_s_at_20_regions=F kernels_per_layer_inlined=G kernels_per_layer_regions=H` (the
kernels: the thinker's step per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("thinker_decode", "talker_step", "thinker_prefill", "talker_prefill")
COUNTED = ("thinker_decode", "talker_step")  # kernels of one call each, batch 4
DEPTHS = {"thinker_decode": 48, "thinker_prefill": 48, "talker_step": 20, "talker_prefill": 20}


def measure(layers: int, regions: bool) -> dict[str, float]:
    """In this process: build, wire and compile once; each step's first-call seconds."""
    import torch

    sys.path.insert(0, str(REPO))
    from agent.config import Config
    from agent.engine.checkpoints.presets import REAL, scaled_overrides
    from agent.engine.checkpoints.random_weights import load_random
    from agent.engine.checkpoints.tiny import ensure_model
    from agent.engine.compile.wiring import GraphConfig, Graphing
    from agent.engine.instruments.kernel_count import KernelCounter, marking_scheduled_kernels
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.stages.talker import TalkerOps
    from agent.engine.stages.thinker import ThinkerOps

    torch.set_num_threads(1)
    loaded = load_random(REAL, "cpu", ensure_model(Config()), overrides=scaled_overrides(layers=layers))
    fuse_moe(loaded.model)  # as the runner does before wiring the steps
    fuse_decoder(loaded.model.thinker.model.language_model)
    fuse_decoder(loaded.model.talker.model)
    config = GraphConfig(
        mode="off",
        compile="on",
        batch_sizes=(1, 4),
        compile_dynamic_batch=True,
        fused_gemv=True,
        compile_regions=regions,
    )
    graphing = Graphing(config, loaded.device, 4)
    thinker, talker = ThinkerOps(loaded, 4, 512, graphing), TalkerOps(loaded, 4, 512, graphing=graphing)
    compiler = graphing.compiler
    assert compiler is not None
    with torch.inference_mode(), marking_scheduled_kernels():
        thinker.capture_graphs()
        talker.capture_graphs()
    seconds = compiler.compile_seconds()
    result = {step: sum(seconds.get(step, {}).values()) for step in STEPS}
    # One more call of each decode step, counted: every row a pad row, the shortest key read.
    # Inputs made in inference mode like the captures' (else the guards recompile, unmarked).
    with torch.inference_mode():
        key_len = graphing.key_lens(thinker.kv)[0]
        rows = graphing.example_rows(4, thinker.pad_slot, key_len, loaded.device)
        embeds = torch.zeros(4, 1, loaded.model.talker.config.text_config.hidden_size, dtype=loaded.dtype)
    with torch.inference_mode(), KernelCounter() as counter:
        with counter.stage("thinker_decode"):
            compiler.steps["thinker_decode"](rows.tokens, rows.slots, rows.index, rows.positions, rows.mask)
        with counter.stage("talker_step"):
            compiler.steps["talker_step"](embeds, rows.slots, rows.index, rows.positions, rows.mask)
    result.update({f"{step}_kernels": float(counter.scheduled[step]) for step in COUNTED})
    return result


def run_fresh(layers: int, regions: bool) -> dict[str, float]:
    """`measure` in a new process with an empty inductor cache: a cold start."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1")
        cmd = [sys.executable, __file__, "--child", str(layers), "--regions" if regions else "--inlined"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"layers={layers} regions={regions} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 6])
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--regions", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--inlined", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.regions)))
        return
    if len(set(args.layers)) != 2:
        p.error("--layers takes two different depths, e.g. 2,6")
    low, high = sorted(set(args.layers))
    results: dict[tuple[int, bool], dict[str, float]] = {}
    print(
        f"{'layers':>6} {'way':>8} "
        + " ".join(f"{s:>16}" for s in STEPS)
        + "".join(f"{s + ' k':>18}" for s in COUNTED)
        + "   (seconds of each step's compiles; k: kernels of one call, batch 4)"
    )
    for regions in (False, True):
        for layers in (low, high):
            row = results[layers, regions] = run_fresh(layers, regions)
            way = "regions" if regions else "inlined"
            times = " ".join(f"{row[s]:>16.1f}" for s in STEPS)
            kernels = "".join(f"{row[s + '_kernels']:>18.0f}" for s in COUNTED)
            print(f"{layers:>6} {way:>8} {times}{kernels}", flush=True)

    def per_layer(step: str, regions: bool) -> float:
        return (results[high, regions][step] - results[low, regions][step]) / (high - low)

    def at_depth(step: str, regions: bool) -> float:
        return results[high, regions][step] + per_layer(step, regions) * (DEPTHS[step] - high)

    def kernels_per_layer(step: str, regions: bool) -> float:
        return per_layer(f"{step}_kernels", regions)

    print()
    for step in STEPS:
        print(
            f"{step:>16}: per layer {per_layer(step, False):6.2f} s inlined, {per_layer(step, True):6.2f} s regions; "
            f"at {DEPTHS[step]} layers {at_depth(step, False):7.1f} s inlined, {at_depth(step, True):7.1f} s regions"
        )
    for step in COUNTED:
        print(
            f"{step:>16}: {kernels_per_layer(step, False):.1f} kernels per layer inlined, "
            f"{kernels_per_layer(step, True):.1f} as regions"
        )
    print(
        f"thinker_decode_s_per_layer_inlined={per_layer('thinker_decode', False):.2f} "
        f"thinker_decode_s_per_layer_regions={per_layer('thinker_decode', True):.2f} "
        f"thinker_decode_s_at_48_inlined={at_depth('thinker_decode', False):.1f} "
        f"thinker_decode_s_at_48_regions={at_depth('thinker_decode', True):.1f} "
        f"talker_step_s_at_20_inlined={at_depth('talker_step', False):.1f} "
        f"talker_step_s_at_20_regions={at_depth('talker_step', True):.1f} "
        f"kernels_per_layer_inlined={kernels_per_layer('thinker_decode', False):.1f} "
        f"kernels_per_layer_regions={kernels_per_layer('thinker_decode', True):.1f}"
    )


if __name__ == "__main__":
    main()
