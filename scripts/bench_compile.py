"""A GPU user's first start, measured on CPU: cold and warm compile of the thinker's and talker's steps.

What the CUDA engine does by default at start-up (agent/engine/compile/wiring.py), run through
inductor's C++ backend: each per-frame step compiled once for every batch bucket (the batch
symbolic), each decoder layer a nested compile region, fused projections, and the attention
kernel CUDA uses (`--attention flex`, forced; CPU would pick sdpa). For each depth in
`--layers` a fresh process with an empty cache directory builds the real structure
(`--preset qwen3-omni-30b-a3b`: real head counts and head_dim; `--widths real` keeps every real
width and expert count, `scaled` the CPU-test widths of presets.scaled_overrides), wires and
compiles the thinker's decode and prefill and the talker's step and prefill, and writes the
compile cache file (agent/engine/compile/cache.py). That is the cold start. A second fresh
process at the deepest depth, with an empty inductor directory but the cache file, is the warm
start (a restart, or a new machine given the file): Dynamo traces again, nothing is generated.

After each start is "ready" the process drives the decode steps at growing contexts (past
several attention length tiers, batches 1, 3 and 4) and counts what dynamo compiled and what
the graph pools captured meanwhile (must be 0), and reads the generated code for any buffer
as large as a layer's KV cache (a region that copied its cache instead of writing it in place).

    .venv/bin/python scripts/bench_compile.py --preset qwen3-omni-30b-a3b --layers 2,4 --attention flex

Last line: `compiles_per_step=N depth_growth=R cold_start_s=C warm_start_s=W warm_over_cold=Q
captures_after_ready=K kv_copy_bytes=B prefill_graphs=P eager_steps=E` (N: the most dynamo graphs
a per-frame step made; R: cold start at the deeper depth over the shallower; C, W: seconds of the
deeper depth's start-up compile, cold and warm, Q their ratio; K: compiles plus captures after
ready, all starts; B: bytes of cache-sized buffers in the generated code; P: graphs of a prefill,
one per token bucket with flex; E: steps whose compile failed and that ran eagerly instead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("thinker_decode", "talker_step", "thinker_prefill", "talker_prefill")
SLOTS, CONTEXT = 4, 4096
GROWING = (100, 300, 700, 1500, 3000)  # cache lengths after ready: past the 256/512/... tiers


def measure(layers: int, attention: str, widths: str, cache: Path) -> dict[str, object]:
    """In this process: build, wire and compile once (loading `cache`'s file when there), then
    drive the decode steps at growing contexts; seconds, counts and cache results as JSON."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(REPO))
    from agent.config import Config
    from agent.engine.checkpoints.presets import REAL, depth_overrides, scaled_overrides
    from agent.engine.checkpoints.random_weights import load_random
    from agent.engine.checkpoints.tiny import ensure_model
    from agent.engine.compile.cache import compiled_shapes
    from agent.engine.compile.wiring import GraphConfig, Graphing
    from agent.engine.instruments.kernel_count import KernelCounter, largest_buffer_bytes
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.stages.talker import TalkerOps
    from agent.engine.stages.thinker import ThinkerOps
    from agent.engine.state.kv import KVState

    torch.set_num_threads(1)
    overrides = depth_overrides(layers) if widths == "real" else scaled_overrides(layers=layers)
    loaded = load_random(REAL, "cpu", ensure_model(Config()), overrides=overrides)
    fuse_moe(loaded.model)  # as the runner does before wiring the steps
    fuse_decoder(loaded.model.thinker.model.language_model)
    fuse_decoder(loaded.model.talker.model)
    # The CUDA defaults: one compile for all buckets, regions, fused projections; the pools pad
    # through a backend that captures nothing (CPU), and still count their "captures".
    config = GraphConfig(
        mode="off",
        compile="on",
        batch_sizes=(1, 4),
        fused_gemv=True,
        compile_regions=True,
        attention=attention,
        compile_cache=cache,
    )
    graphing = Graphing(config, loaded.device, SLOTS)
    thinker = ThinkerOps(loaded, SLOTS, CONTEXT, graphing)
    talker = TalkerOps(loaded, SLOTS, CONTEXT, graphing=graphing)
    compiler = graphing.compiler
    assert compiler is not None and compiler.settings.dynamic_batch and graphing.compiles_regions
    started = time.perf_counter()
    caches = {"thinker": thinker.kv, "talker": talker.kv}
    loaded_state = graphing.load_compile_cache(compiled_shapes(loaded.model.config, loaded.dtype, SLOTS, caches))
    with torch.inference_mode():
        thinker.capture_graphs()
        talker.capture_graphs()
    saved = graphing.finish_start_up()
    start_s = time.perf_counter() - started

    # Ready: growing contexts, batches 1, 3 (padded to 4) and 4, counted.
    graphs_at_ready = counters["stats"]["unique_graphs"]
    captures_at_ready = sum(pool.stats.captures for pool in graphing.pools.values())
    hidden = loaded.model.talker.config.text_config.hidden_size
    with torch.inference_mode(), KernelCounter() as counter:
        for length in GROWING:
            for batch in (1, 3, 4):
                states = [KVState(slot, length, length) for slot in range(batch)]
                thinker.decode(states, [5] * batch)
                states = [KVState(slot, length, length) for slot in range(batch)]
                talker.step(states, torch.zeros(batch, 1, hidden, dtype=loaded.dtype))
    after_ready = (counters["stats"]["unique_graphs"] - graphs_at_ready) + (
        sum(pool.stats.captures for pool in graphing.pools.values()) - captures_at_ready
    )
    layer_bytes = min(kv.keys[0].numel() * kv.keys[0].element_size() for kv in caches.values())
    biggest = max((largest_buffer_bytes(source) for source in counter.sources.values()), default=0)
    seconds = compiler.compile_seconds()
    return {
        "start_s": start_s,
        "steps_s": {step: sum(seconds.get(step, {}).values()) for step in STEPS},
        "graphs": compiler.graph_counts(),
        "cache": compiler.cache_report(),
        "fallbacks": compiler.fallbacks(),
        "file": loaded_state,
        "saved_bytes": saved,
        "after_ready": after_ready,
        "kv_copy_bytes": biggest if biggest >= layer_bytes else 0,
        "layer_kv_bytes": layer_bytes,
        "backend": thinker.kv.backend,
        "capacity": thinker.kv.capacity,
    }


def run_fresh(layers: int, attention: str, widths: str, cache: Path, python: str) -> dict[str, object]:
    """`measure` in a new process whose inductor directory is empty (the compile cache file in
    `cache/artifacts` is what a warm start has)."""
    with tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_COMPILE_THREADS="1")
        cmd = [python, __file__, "--child", str(layers), "--attention", attention, "--widths", widths]
        out = subprocess.run([*cmd, "--cache", str(cache)], env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"layers={layers} failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-omni-30b-a3b", choices=["qwen3-omni-30b-a3b"])
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--attention", default="flex", choices=["flex", "sdpa"])
    p.add_argument("--widths", default="scaled", choices=["scaled", "real"])
    p.add_argument("--python", default=sys.executable, help="the interpreter of the runs (another torch's venv)")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.attention, args.widths, args.cache)))
        return
    if len(set(args.layers)) != 2:
        p.error("--layers takes two different depths, e.g. 2,4")
    low, high = sorted(set(args.layers))
    version = subprocess.run(
        [args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"# torch {version}, attention {args.attention}, {args.widths} widths, slots {SLOTS} x {CONTEXT} keys")
    print(
        f"{'layers':>6} {'start':>5} {'file':>5} {'start_s':>8} "
        + " ".join(f"{s:>15}" for s in STEPS)
        + f" {'graphs/step':>11} {'cache':>6} {'after_ready':>11} {'kv_copy_B':>9} {'saved_MiB':>9}"
    )
    rows: dict[tuple[int, str], dict] = {}
    with tempfile.TemporaryDirectory() as keep_high:
        for layers, kind in ((low, "cold"), (high, "cold"), (high, "warm")):
            if kind == "cold" and layers == high:
                cache = Path(keep_high)  # kept for the warm start
            elif kind == "cold":
                cache = Path(tempfile.mkdtemp())
            row = rows[layers, kind] = run_fresh(layers, args.attention, args.widths, cache, args.python)
            steps = " ".join(f"{row['steps_s'][s]:>15.1f}" for s in STEPS)
            cache_states = set(row["cache"].values())
            print(f"# graphs {row['graphs']}, cache {row['cache']}, eager {row['fallbacks'] or 'none'}", flush=True)
            print(
                f"{layers:>6} {kind:>5} {row['file']:>5} {row['start_s']:>8.1f} {steps} "
                f"{max(row['graphs'].values()):>11} {'/'.join(sorted(cache_states)):>6} {row['after_ready']:>11} "
                f"{row['kv_copy_bytes']:>9} {row['saved_bytes'] / 2**20:>9.1f}",
                flush=True,
            )
    cold_low, cold, warm = rows[low, "cold"], rows[high, "cold"], rows[high, "warm"]
    print(f"# backend {cold['backend']}, capacity {cold['capacity']}, one layer's keys {cold['layer_kv_bytes']} B")
    # The per-frame steps: one graph each for every batch; a flex prefill has one per token bucket.
    per_step = max(max(r["graphs"][s] for s in ("thinker_decode", "talker_step")) for r in rows.values())
    prefill = max(max(r["graphs"][s] for s in ("thinker_prefill", "talker_prefill")) for r in rows.values())
    eager = sorted({step for r in rows.values() for step in r["fallbacks"]})
    after = sum(r["after_ready"] for r in rows.values())
    copies = max(r["kv_copy_bytes"] for r in rows.values())
    print(
        f"compiles_per_step={per_step} depth_growth={cold['start_s'] / cold_low['start_s']:.2f} "
        f"cold_start_s={cold['start_s']:.1f} warm_start_s={warm['start_s']:.1f} "
        f"warm_over_cold={warm['start_s'] / cold['start_s']:.2f} captures_after_ready={after} kv_copy_bytes={copies} "
        f"prefill_graphs={prefill} eager_steps={','.join(eager) or 'none'}"
    )


if __name__ == "__main__":
    main()
