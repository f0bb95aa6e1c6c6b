"""Bytes of the 4-bit model against the bf16 one at real size, on the meta device (nothing allocated).

`scripts/bench_engine.py --kernels --preset qwen3-omni-30b-a3b --layers 1,2 --quantize int4` runs
this instead of the kernel count:

  * weights: meta models at the two depths per stack, real widths, bf16, and a copy quantized
    with `quantize_model(copy, QuantScheme())`; the bytes of their actual tensors (parameters
    and buffers, at their element sizes: nibbles 1 byte, scales and offsets bf16, RoPE tables
    fp32) per part of each stack, differenced between the depths and extrapolated to the real
    ones, then checked against a full-depth meta count of the whole model;
  * the memory plan on a 24 GB card (model_memory.RTX4090): what it derives with no flags, and
    the total for 2 sessions at 8192 tokens of context;
  * bytes one steady tick reads at batch 1 (instruments/roofline.py ByteModel, which counts a
    4-bit module's packed bytes) for int4 against bf16.

Last line: `weights_gib_bf16=X weights_gib_int4=Y total_gib_2_sessions_int4=Z
bytes_per_tick_int4_over_bf16=R`.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GiB = 2**30
SESSIONS = 2
CONTEXT = 8192


def tensors(modules: list[nn.Module]) -> dict[int, Tensor]:
    """Every distinct parameter and buffer of `modules`, by identity."""
    out: dict[int, Tensor] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            out[id(t)] = t
    return out


def size(ts: dict[int, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


@dataclass(frozen=True)
class Part:
    stack: str  # thinker, talker, code predictor, everything else
    name: str
    modules: Callable[[nn.Module], list[nn.Module]]
    repeats: Callable[[object], int]  # how many copies a config has (layers; 1 for a fixed part)
    minus: Callable[[nn.Module], list[nn.Module]] = lambda m: []  # noqa: E731


def _lm(m):
    return m.thinker.model.language_model


def _cp(m):
    return m.talker.code_predictor


PARTS = (
    Part(
        "thinker", "decoder layers", lambda m: [_lm(m).layers], lambda c: c.thinker_config.text_config.num_hidden_layers
    ),
    Part("thinker", "embed_tokens", lambda m: [_lm(m).embed_tokens], lambda c: 1),
    Part(
        "thinker",
        "lm_head, norm, rope",
        lambda m: [_lm(m), m.thinker.lm_head],
        lambda c: 1,
        lambda m: [_lm(m).layers, _lm(m).embed_tokens],
    ),
    Part(
        "talker",
        "decoder layers",
        lambda m: [m.talker.model.layers],
        lambda c: c.talker_config.text_config.num_hidden_layers,
    ),
    Part("talker", "codec_embedding", lambda m: [m.talker.model.codec_embedding], lambda c: 1),
    Part(
        "talker",
        "codec_head, projections, norm",
        lambda m: [m.talker],
        lambda c: 1,
        lambda m: [m.talker.model.layers, m.talker.model.codec_embedding, _cp(m)],
    ),
    Part(
        "code predictor",
        "decoder layers",
        lambda m: [_cp(m).model.layers],
        lambda c: c.talker_config.code_predictor_config.num_hidden_layers,
    ),
    Part("code predictor", "15 codec embeddings", lambda m: [_cp(m).model.codec_embedding], lambda c: 1),
    Part(
        "code predictor",
        "15 heads, norm",
        lambda m: [_cp(m)],
        lambda c: 1,
        lambda m: [_cp(m).model.layers, _cp(m).model.codec_embedding],
    ),
    Part(
        "everything else",
        "audio encoder layers",
        lambda m: [m.thinker.model.audio_tower.layers],
        lambda c: c.thinker_config.audio_config.encoder_layers,
    ),
    Part(
        "everything else",
        "audio encoder rest",
        lambda m: [m.thinker.model.audio_tower],
        lambda c: 1,
        lambda m: [m.thinker.model.audio_tower.layers],
    ),
    Part(
        "everything else",
        "vision blocks",
        lambda m: [m.thinker.model.visual.blocks],
        lambda c: c.thinker_config.vision_config.depth,
    ),
    Part(
        "everything else",
        "vision deepstack mergers",
        lambda m: [m.thinker.model.visual.merger_list],
        lambda c: len(c.thinker_config.vision_config.deepstack_visual_indexes),
    ),
    Part(
        "everything else",
        "vision rest",
        lambda m: [m.thinker.model.visual],
        lambda c: 1,
        lambda m: [m.thinker.model.visual.blocks, m.thinker.model.visual.merger_list],
    ),
    Part(
        "everything else",
        "code2wav transformer layers",
        lambda m: [m.code2wav.pre_transformer.layers],
        lambda c: c.code2wav_config.num_hidden_layers,
    ),
    Part(
        "everything else",
        "code2wav rest",
        lambda m: [m.code2wav],
        lambda c: 1,
        lambda m: [m.code2wav.pre_transformer.layers],
    ),
)
STACKS = ("thinker", "talker", "code predictor", "everything else")


def part_bytes(model: nn.Module) -> dict[tuple[str, str], int]:
    """Bytes of each part; ("everything else", "unassigned") is what no part claims (0 expected)."""
    out: dict[tuple[str, str], int] = {}
    claimed: dict[int, Tensor] = {}
    for part in PARTS:
        ts = tensors(part.modules(model))
        for key in tensors(part.minus(model)):
            ts.pop(key, None)
        overlap = set(ts) & set(claimed)
        if overlap:
            raise RuntimeError(f"{part.stack} / {part.name} shares {len(overlap)} tensors with an earlier part")
        claimed.update(ts)
        out[(part.stack, part.name)] = size(ts)
    rest = {k: t for k, t in tensors([model]).items() if k not in claimed}
    out[("everything else", "unassigned")] = size(rest)
    return out


def meta_model(config, quantize: bool):
    from agent.engine.checkpoints.presets import cast_parameters, meta_model
    from agent.engine.quant.apply import QuantScheme, quantize_model

    model = cast_parameters(meta_model(config), torch.bfloat16)
    if quantize:
        model = copy.deepcopy(model)
        quantize_model(model, QuantScheme())
    return model


def kinds(model: nn.Module) -> Counter[str]:
    """Bytes by kind of tensor: packed nibbles, group scales/offsets, float weights kept, others."""
    from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear

    out: Counter[str] = Counter()
    packed = {
        id(b)
        for m in model.modules()
        if isinstance(m, (Int4Linear, Int4Experts, Int4Embedding))
        for b in m.buffers(False)
    }
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if id(t) in packed:
            out["4-bit nibbles" if name.endswith("_nibbles") else "4-bit group scales + lows (bf16)"] += nbytes
        elif isinstance(t, nn.Parameter):
            out["float weights kept"] += nbytes
        else:
            out["other buffers (RoPE, offsets)"] += nbytes
    return out


def kept_float(model: nn.Module, top: int = 12) -> list[tuple[str, int]]:
    """The largest float parameters left in a quantized model, layer indices folded ('*')."""
    out: Counter[str] = Counter()
    for name, p in model.named_parameters():
        out[re.sub(r"\.\d+\.", ".*.", name)] += p.numel() * p.element_size()
    return out.most_common(top)


MEASURED_OVERHEAD = int(1.16 * GiB)  # beyond weights and KV, H200, 8 sessions, graphs on, not compiled


def run(args: argparse.Namespace) -> None:
    from agent.config import Config
    from agent.engine.checkpoints.model import complete_config
    from agent.engine.checkpoints.presets import REAL, depth_overrides, merge_overrides, preset_config
    from agent.engine.instruments.roofline import ByteModel
    from agent.engine.memory_plan import RESERVE_BYTES, MemoryPlanError, pad_rows, plan
    from agent.engine.model_memory import CUDA_CONTEXT_BYTES, RTX4090, ModelMemory

    if args.preset != REAL:
        raise SystemExit(f"--kernels --quantize needs --preset {REAL}")
    if args.quantize != "int4":
        raise SystemExit(f"--quantize {args.quantize!r}: only int4 is counted")
    low, high = sorted(args.layers)

    def config_at(layers: int | None):
        config = preset_config(REAL, None if layers is None else merge_overrides(depth_overrides(layers), {}))
        complete_config(config)
        return config

    configs = {n: config_at(n) for n in (low, high)}
    full_config = config_at(None)
    counts: dict[tuple[str, int], dict[tuple[str, str], int]] = {}
    for kind in ("bf16", "int4"):
        for n in (low, high):
            counts[(kind, n)] = part_bytes(meta_model(configs[n], kind == "int4"))

    print(
        f"\nWEIGHT BYTES (meta device, {REAL} at real widths, {low} and {high} layers per stack, bf16 and "
        "quantize_model(QuantScheme()) = int4 group 128, heads quantized; parameters and buffers at their own "
        f"element sizes; per-copy bytes = ({high}L - {low}L) / copies, full = {low}L + (copies - {low}L copies) x per copy)"
    )
    header = (
        f"{'stack':<16} {'part':<30} {'copies':>6} {'bf16/copy':>14} {'bf16 full':>15} "
        f"{'int4/copy':>14} {'int4 full':>15} {'int4/bf16':>9}"
    )
    print(header)
    full: dict[str, Counter[tuple[str, str]]] = {"bf16": Counter(), "int4": Counter()}
    keys = [(p.stack, p.name, p.repeats) for p in PARTS] + [("everything else", "unassigned", lambda c: 1)]
    warnings = []
    for stack, name, repeats in keys:
        n_low, n_high, n_full = repeats(configs[low]), repeats(configs[high]), repeats(full_config)
        row = {}
        for kind in ("bf16", "int4"):
            a, b = counts[(kind, low)][(stack, name)], counts[(kind, high)][(stack, name)]
            if n_high == n_low:
                if a != b:
                    warnings.append(f"{stack} / {name} ({kind}) changes with depth: {a} -> {b} bytes")
                per, total = a, a
            else:
                per_f = (b - a) / (n_high - n_low)
                per = round(per_f)
                total = round(a + (n_full - n_low) * per_f)
            full[kind][(stack, name)] = total
            row[kind] = (per, total)
        ratio = row["int4"][1] / row["bf16"][1] if row["bf16"][1] else float("nan")
        print(
            f"{stack:<16} {name:<30} {n_full:>6} {row['bf16'][0]:>14,} {row['bf16'][1]:>15,} "
            f"{row['int4'][0]:>14,} {row['int4'][1]:>15,} {ratio:>9.3f}"
        )
    print(f"{'-' * len(header)}")
    totals = {}
    for stack in STACKS:
        b = sum(v for (s, _), v in full["bf16"].items() if s == stack)
        q = sum(v for (s, _), v in full["int4"].items() if s == stack)
        totals[stack] = (b, q)
        print(
            f"{stack:<16} {'(stack total)':<30} {'':>6} {'':>14} {b:>15,} {'':>14} {q:>15,} {q / b:>9.3f}"
            f"   {b / GiB:6.2f} -> {q / GiB:5.2f} GiB"
        )
    extrapolated = {kind: sum(full[kind].values()) for kind in ("bf16", "int4")}
    print(
        f"{'all':<16} {'(extrapolated)':<30} {'':>6} {'':>14} {extrapolated['bf16']:>15,} {'':>14} "
        f"{extrapolated['int4']:>15,} {extrapolated['int4'] / extrapolated['bf16']:>9.3f}"
        f"   {extrapolated['bf16'] / GiB:6.2f} -> {extrapolated['int4'] / GiB:5.2f} GiB"
    )
    for w in warnings:
        print(f"WARNING: {w}")

    # The cross-check: the whole model at full depth, counted directly (cheap on meta).
    models = {kind: meta_model(full_config, kind == "int4") for kind in ("bf16", "int4")}
    direct = {kind: size(tensors([m])) for kind, m in models.items()}
    for kind in ("bf16", "int4"):
        verdict = "equal" if direct[kind] == extrapolated[kind] else f"DIFFER by {direct[kind] - extrapolated[kind]:,}"
        print(f"full-depth meta count, {kind}: {direct[kind]:,} bytes ({direct[kind] / GiB:.3f} GiB): {verdict}")
    per_part_direct = part_bytes(models["int4"])
    mismatched = [k for k, v in per_part_direct.items() if v != full["int4"][k]]
    if mismatched:
        print(f"WARNING: parts whose extrapolation differs from the full-depth count: {mismatched}")

    print("\nint4 model by kind of tensor (full depth):")
    for kind, nbytes in kinds(models["int4"]).most_common():
        print(f"  {kind:<36} {nbytes:>15,}  {nbytes / GiB:6.2f} GiB")
    print("largest float parameters kept in the int4 model (layer index folded to *, all copies):")
    for name, nbytes in kept_float(models["int4"]):
        print(f"  {name:<64} {nbytes:>15,}  {nbytes / GiB:6.3f} GiB")

    # ---- the memory plan on a 24 GB card -------------------------------------------------------
    reply_s = Config().max_reply_seconds or 60.0
    memory = ModelMemory.from_config(full_config, torch.bfloat16, reply_s, quantize="int4")
    print(
        f"\nMEMORY PLAN, int4 (model_memory.ModelMemory.from_config(..., quantize='int4'), max reply {reply_s:g} s) "
        f"on {RTX4090.name}: {RTX4090.free:,} bytes free before the load (24 GiB - CUDA context "
        f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB)"
    )
    if memory.weights != direct["int4"]:
        print(f"WARNING: the plan counts {memory.weights:,} weight bytes, this count {direct['int4']:,}")
    try:
        derived = plan(memory, RTX4090.free)
        print(derived.describe())
        print(f"plan with no flags: {derived.sessions} sessions x {derived.context} tokens")
    except MemoryPlanError as exc:
        print(f"plan with no flags: refused: {exc}")
    pads = pad_rows(SESSIONS)  # none where every batch size is a graph bucket
    rows = SESSIONS + pads
    parts = {
        "weights (parameters and buffers)": memory.weights,
        "engine_weights (code predictor's fused copies)": memory.engine_weights,
        "unpacked_experts (prefill's transient expert stack)": memory.unpacked_experts,
        "fixed_state (code predictor cache)": memory.fixed_state,
        f"KV: {rows} rows ({SESSIONS} sessions + {pads} pad) x kv_per_slot({CONTEXT})": rows
        * memory.kv_per_slot(CONTEXT),
        "reserve": RESERVE_BYTES,
        "CUDA context": CUDA_CONTEXT_BYTES,
    }
    total = sum(parts.values())
    print(f"total for {SESSIONS} sessions at {CONTEXT} tokens of context:")
    for name, nbytes in parts.items():
        print(f"  {name:<58} {nbytes:>15,}  {nbytes / GiB:6.2f} GiB")
    print(f"  {'total':<58} {total:>15,}  {total / GiB:6.2f} GiB (card: 24 GiB)")
    # The reserve is the one part not counted from shapes. What it stands for was measured once
    # (bench/results/engine-h200-2026-11-30.txt: 1.16 GiB beyond weights and KV at 8 sessions,
    # graphs on, steps not compiled); with that in its place, for comparison only:
    measured = total - RESERVE_BYTES + MEASURED_OVERHEAD
    print(
        f"  {'with the H200-measured 1.16 GiB in place of the reserve':<58} {measured:>15,}  "
        f"{measured / GiB:6.2f} GiB (the compiled steps' buffers not measured yet)"
    )
    try:
        asked = plan(memory, RTX4090.free, sessions=SESSIONS, context=CONTEXT)
        print(f"the plan admits --max-sessions {SESSIONS} --context-limit {CONTEXT} on {RTX4090.name}")
        del asked
    except MemoryPlanError as exc:
        print(f"the plan refuses --max-sessions {SESSIONS} --context-limit {CONTEXT}: {exc}")

    # ---- bytes per tick -------------------------------------------------------------------------
    byte_models = {kind: ByteModel.of(m, element=2) for kind, m in models.items()}
    ticks = {kind: bm.tick(1, args.context) for kind, bm in byte_models.items()}
    print(
        f"\nBYTES PER STEADY TICK at batch 1, {args.context} tokens of KV (instruments/roofline.py ByteModel: "
        "4-bit modules at their packed bytes, KV in bf16)"
    )
    print(f"{'stage':<16} {'bf16':>15} {'int4':>15} {'int4/bf16':>9}")
    for stage in ticks["bf16"]:
        b, q = ticks["bf16"][stage], ticks["int4"][stage]
        print(f"{stage:<16} {b:>15,.0f} {q:>15,.0f} {q / b:>9.3f}")
    tick_b, tick_q = sum(ticks["bf16"].values()), sum(ticks["int4"].values())
    print(f"{'total':<16} {tick_b:>15,.0f} {tick_q:>15,.0f} {tick_q / tick_b:>9.3f}")

    targets = (
        ("weights_gib_int4 <= 20", direct["int4"] / GiB <= 20),
        (f"total_gib_{SESSIONS}_sessions_int4 <= 22", total / GiB <= 22),
        ("bytes_per_tick_int4_over_bf16 <= 0.4", tick_q / tick_b <= 0.4),
    )
    print("targets: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in targets))
    print(
        f"weights_gib_bf16={direct['bf16'] / GiB:.3f} weights_gib_int4={direct['int4'] / GiB:.3f} "
        f"total_gib_{SESSIONS}_sessions_int4={total / GiB:.3f} bytes_per_tick_int4_over_bf16={tick_q / tick_b:.3f}"
    )
