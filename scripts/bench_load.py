"""`bench_engine.py --load`: host and device memory of loading the real checkpoint, extrapolated
from random-weight checkpoints at real widths and a few layers (docs/memory.md).

For each depth in --layers (e.g. 1 and 2 layers in every stack) it writes the hub-shaped
checkpoint (agent/engine/checkpoints/hub.py: safetensors shards with the released per-expert
keys, the released config.json form; bf16) into a temp dir, then loads it in a fresh process
exactly as `omni-agent --model DIR` does (agent.engine.checkpoints.model.load_model on "cuda" when there is
one, else "cpu", in bf16) and measures that load from inside the process
(agent/engine/instruments/load_memory.py): anonymous RSS sampled every 2 ms, ru_maxrss, the model's bytes and,
on CUDA, torch.cuda.max_memory_allocated().

What is counted as host memory: anonymous RSS. The shards are memory-mapped; their pages are
page cache the kernel drops and re-reads under pressure, so they are shown (file peak) but are not
what a load "needs". On a GPU the model keeps nothing on the host and the host peak is the whole
anonymous peak. On a CPU-only machine the model's own tensors are host memory: the host peak
reported is then the anonymous peak less what the loaded model keeps (the interpreter, libraries
and the load's staging: what a GPU load needs on the host too), and "device" is the model's bytes.

Each measurement is extrapolated linearly to the published depths (48 thinker, 32 audio, 27
vision, 20 talker, 5 code-predictor and 8 code2wav layers). The stacks' depths differ and the
vision tower's DeepStack mergers grow with the depth here (one per layer up to 3), so the axis of
the fit is the model's bytes rather than its layer count: one line through the two depths'
(model bytes, value) points, read at the full model's bytes counted on the meta device. The
memory planner (agent/engine/memory_plan.py) then sizes sessions for the full-depth device bytes on an 80 GB
H100 and an H200.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def stack_layers(model) -> dict[str, object]:
    """One layer of every stack whose depth --layers sets."""
    thinker, talker = model.thinker.model, model.talker
    return {
        "thinker": thinker.language_model.layers,
        "audio_encoder": thinker.audio_tower.layers,
        "vision_encoder": thinker.visual.blocks,
        "talker": talker.model.layers,
        "code_predictor": talker.code_predictor.model.layers,
        "code2wav": model.code2wav.pre_transformer.layers,
    }


def full_depths(preset: str) -> dict[str, int]:
    from agent.engine.checkpoints.presets import meta_model, preset_config

    return {name: len(layers) for name, layers in stack_layers(meta_model(preset_config(preset))).items()}


def extrapolate(low: float, high: float, a: float, b: float, x: float) -> float:
    """The line through (low, a) and (high, b), at x."""
    return a + (b - a) * (x - low) / (high - low)


def run(args) -> None:
    import torch

    from agent.config import Config
    from agent.engine.checkpoints.presets import REAL, preset_config
    from agent.engine.checkpoints.tiny import ensure_model
    from agent.engine.instruments.load_memory import LoadMemory, measure_load_in_subprocess
    from agent.engine.memory_plan import MemoryPlanError, plan_for_cards
    from agent.engine.model_memory import H100_80G, H200, ModelMemory

    if args.preset != REAL:
        raise SystemExit(f"--load needs --preset {REAL}")
    low, high = sorted(args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16"
    tokenizer = ensure_model(Config())  # the tiny tokenizer: load_model needs one, ids are looked up
    measured: dict[int, tuple[int, LoadMemory]] = {}
    with tempfile.TemporaryDirectory(prefix="omni-load-", dir=args.load_dir) as tmp:
        for layers in (low, high):
            dst = Path(tmp) / f"layers-{layers}"
            log(f"writing {REAL} with {layers} layer(s) per stack, bf16, hub-shaped, into {dst}")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "agent.engine.checkpoints.hub",
                    str(dst),
                    "--layers",
                    str(layers),
                    "--tokenizer-from",
                    str(tokenizer),
                ],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            checkpoint = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
            log(f"loading it in a fresh process: load_model(device={device!r}, dtype={dtype!r})")
            measured[layers] = (checkpoint, measure_load_in_subprocess(dst, device, dtype))
            shutil.rmtree(dst)  # the next depth's shards need the disk, not these
    depths = full_depths(REAL)
    exact = ModelMemory.from_config(preset_config(REAL), torch.bfloat16, 60.0)  # counted, nothing allocated
    x = {layers: measured[layers][1].model_bytes for layers in (low, high)}

    columns = {
        "checkpoint": lambda c, m: c,
        "anon before": lambda c, m: m.anon_before,
        "anon peak": lambda c, m: m.anon_peak,
        "anon after": lambda c, m: m.anon_after,
        "file peak": lambda c, m: m.file_peak,
        "maxrss": lambda c, m: m.maxrss,
        "staging": lambda c, m: m.staging,
        "host peak": lambda c, m: m.host_peak,
        "device": lambda c, m: m.device_peak,
    }

    def at_full(a: float, b: float) -> float:
        return extrapolate(x[low], x[high], a, b, exact.weights)

    full = {name: at_full(fn(*measured[low]), fn(*measured[high])) for name, fn in columns.items()}
    seconds = at_full(measured[low][1].seconds, measured[high][1].seconds)
    on = measured[low][1]
    print(
        f"\nLOAD {REAL}, random bf16 weights at real widths, hub-shaped checkpoint; each depth loaded in a fresh "
        f"process by agent.engine.checkpoints.model.load_model(device={device!r}, dtype={dtype!r}); tensors on {on.device}"
    )
    print(
        "GiB; anon = anonymous RSS (counted), file = mapped shards and libraries (page cache, not counted); "
        + (
            "host peak = the whole anonymous peak (the model is on the GPU); device = max_memory_allocated"
            if not on.on_host
            else "CPU: the model is host memory, so host peak = anonymous peak less what the loaded "
            "model keeps (interpreter, libraries and staging), staging = what the load held beyond the process "
            "before it and the model after it; device = the model's bytes"
        )
    )
    print(f"{'layers':<22}" + "".join(f"{name:>12}" for name in columns) + f"{'load s':>9}")
    for layers in (low, high):
        checkpoint, m = measured[layers]
        print(
            f"{layers:<22}"
            + "".join(f"{fn(checkpoint, m) / GiB:12.2f}" for fn in columns.values())
            + f"{m.seconds:9.1f}"
        )
    print(f"{'full (extrapolated)':<22}" + "".join(f"{full[name] / GiB:12.2f}" for name in columns) + f"{seconds:9.0f}")
    print(
        f"full depth: {', '.join(f'{k} {v}' for k, v in depths.items())} layers; each column extrapolated "
        f"linearly from {low} and {high} layers per stack over the model's bytes ({x[low] / GiB:.2f} and "
        f"{x[high] / GiB:.2f} GiB) to the full model's {exact.weights / GiB:.2f} GiB (counted on the meta device)"
    )

    memory = replace(exact, weights=int(full["device"]))  # the planner fed the measured full-depth bytes
    plans = plan_for_cards(memory, (H100_80G, H200))
    print(
        "\nPLAN (agent/engine/memory_plan.py, no flags given; free = what torch reports for the card less "
        f"0.5 GiB of CUDA context: H100 80GB {H100_80G.free / GiB:.1f} GiB, H200 {H200.free / GiB:.1f} GiB)"
    )
    for card, result in plans.items():
        if isinstance(result, MemoryPlanError):
            print(f"{card}: refused: {result}")
        else:
            print(
                f"{card}: {result.sessions} sessions x {result.context} tokens; needs {result.need / GiB:.1f} GiB "
                f"(weights {result.weights / GiB:.1f}, KV {result.kv / GiB:.1f}, reserve {result.reserve / GiB:.1f})"
            )

    def sessions(card) -> int:
        result = plans[card.name]
        return 0 if isinstance(result, MemoryPlanError) else result.sessions

    print(
        f"host_peak_gib_full_depth={full['host peak'] / GiB:.2f} "
        f"device_peak_gib_full_depth={full['device'] / GiB:.2f} "
        f"plan_sessions_h100_80g={sessions(H100_80G)} plan_sessions_h200={sessions(H200)}"
    )
