"""How far the 4-bit model (agent/engine/quant) is from the bf16 one, on a real-width random model.

The thinker's text path of `random_weights.build_random("qwen3-omni-30b-a3b")` with 1 (or more) layers
per stack, at real widths, 128 experts and the real vocabulary (the talker, code2wav and the
encoders are dropped once built). Its bf16 weights are the reference; copies are quantized with
`quantize_model(copy, QuantScheme())` (heads quantized, the default) and with
`QuantScheme(heads=False)` (lm_head kept in bf16). All three then compute in fp32, so what differs
is the quantization of the weights, not bf16 arithmetic. One teacher-forced forward over
--tokens fixed random token ids of the real vocabulary through
`model.thinker.model.language_model` then `model.thinker.lm_head`:

  * per decoder layer: the relative error ||q - f|| / ||f|| of its output (the residual stream,
    errors of earlier layers included), of its update (output - input), and of its update given
    the float model's own input ("isolated": this layer's weights alone);
  * the final hidden state's and the logits' relative error;
  * top-1 agreement of the logits over the tokens (and top-1 of one in the other's top 5).

Random weights are a weak proxy for a trained model: their logits have no confident winner, so a
small perturbation flips the top-1 more easily than in a trained model (the margins are printed).

    PYTHONPATH=. .venv/bin/python scripts/bench_quant.py --layers 1 --tokens 320

Last line: `top1_agreement_int4=A top1_agreement_int4_heads_kept=B max_layer_rel_error=E`
(the deepest run; E is the largest per-layer output error of the heads-quantized model).
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.engine.checkpoints.presets import REAL, depth_overrides, scaled_overrides  # noqa: E402
from agent.engine.checkpoints.random_weights import build_random
from agent.engine.quant.apply import QuantScheme, quantize_model  # noqa: E402

STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"# {time.perf_counter() - STARTED:6.0f} s  {message}", flush=True)


def rel(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def thinker_text(layers: int, seed: int, scaled: bool = False) -> nn.Module:
    """The composite at `layers` layers per stack, bf16, with only the thinker's text path left
    (`scaled`: at CPU-test widths, a smoke test of this script)."""
    overrides = scaled_overrides(layers) if scaled else depth_overrides(layers)
    model = build_random(REAL, "cpu", torch.bfloat16, overrides=overrides, seed=seed)
    for name in ("talker", "code2wav"):
        delattr(model, name)
    for name in ("audio_tower", "visual"):
        delattr(model.thinker.model, name)
    gc.collect()
    return model


class Taps:
    """Each decoder layer's, attention's, MoE block's and router's inputs (args, kwargs) and
    outputs during one forward, by label: "layer", "self_attn", "mlp", "router"."""

    LABELS = ("layer", "self_attn", "mlp", "router")

    def __init__(self, layers: nn.ModuleList) -> None:
        self.inputs: dict[str, list[tuple[tuple, dict]]] = {k: [] for k in self.LABELS}
        self.outputs: dict[str, list] = {k: [] for k in self.LABELS}
        self.handles = []
        for layer in layers:
            for label, module in zip(self.LABELS, (layer, layer.self_attn, layer.mlp, layer.mlp.gate)):
                self.handles.append(module.register_forward_hook(self._hook(label), with_kwargs=True))

    def _hook(self, label: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            self.inputs[label].append((args, kwargs))
            self.outputs[label].append(output)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def first(output) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def layer_input(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.inference_mode()
def forward(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor, Taps]:
    lm = model.thinker.model.language_model
    taps = Taps(lm.layers)
    try:
        hidden = lm(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        taps.close()
    logits = model.thinker.lm_head(hidden)
    return hidden, logits, taps


def routing_agreement(picks_q: Tensor, picks_f: Tensor) -> float:
    """The fraction of (token, expert) picks the two routers share."""
    same = (picks_q.unsqueeze(-1) == picks_f.unsqueeze(-2)).any(-1)
    return float(same.float().mean())


def top1(logits_q: Tensor, logits_f: Tensor) -> tuple[float, float]:
    a, b = logits_q.argmax(-1), logits_f.argmax(-1)
    in_top5 = (logits_q.topk(5, dim=-1).indices == b.unsqueeze(-1)).any(-1)
    return float((a == b).float().mean()), float(in_top5.float().mean())


def measure(name: str, quant: nn.Module, ref: dict, ids: Tensor) -> dict[str, float]:
    log(f"{name}: forward")
    hidden, logits, taps = forward(quant, ids)
    rows = []
    q_layers = quant.thinker.model.language_model.layers
    tq, tf = taps, ref["taps"]
    with torch.inference_mode():
        for i, layer in enumerate(q_layers):
            (args_f, kwargs_f), (args_q, kwargs_q) = tf.inputs["layer"][i], tq.inputs["layer"][i]
            x_f, x_q = layer_input(args_f, kwargs_f), layer_input(args_q, kwargs_q)
            out_f, out_q = first(tf.outputs["layer"][i]), first(tq.outputs["layer"][i])
            iso = first(layer(*args_f, **kwargs_f))
            a_args, a_kwargs = tf.inputs["self_attn"][i]
            attn_iso = first(layer.self_attn(*a_args, **a_kwargs))
            m_args, m_kwargs = tf.inputs["mlp"][i]
            mlp_iso = first(layer.mlp(*m_args, **m_kwargs))
            rows.append(
                (
                    i,
                    rel(out_q, out_f),
                    rel(out_q - x_q, out_f - x_f),
                    rel(iso - x_f, out_f - x_f),
                    rel(attn_iso, first(tf.outputs["self_attn"][i])),
                    rel(mlp_iso, first(tf.outputs["mlp"][i])),
                    rel(first(tq.outputs["mlp"][i]), first(tf.outputs["mlp"][i])),
                    routing_agreement(tq.outputs["router"][i][2], tf.outputs["router"][i][2]),
                )
            )
    agree, top5 = top1(logits, ref["logits"])
    print(
        f"{name}: per decoder layer, relative errors against bf16 (output: the residual stream after the layer; "
        "update: output - input; isolated: given the float model's input; attn/MoE isolated: that block alone "
        "given the float input; MoE in path: the block in the quantized forward; routing: share of the "
        "(token, expert) picks the quantized forward's router makes that the float one makes)"
    )
    print(
        f"  {'layer':>5} {'output':>8} {'update':>8} {'isolated':>9} {'attn iso':>9} {'MoE iso':>8} "
        f"{'MoE path':>9} {'routing':>8}"
    )
    for i, out, upd, iso, attn, mlp, mlp_path, route in rows:
        print(f"  {i:>5} {out:>8.4f} {upd:>8.4f} {iso:>9.4f} {attn:>9.4f} {mlp:>8.4f} {mlp_path:>9.4f} {route:>8.3f}")
    result = {
        "max_layer": max(r[1] for r in rows),
        "max_update": max(r[2] for r in rows),
        "max_isolated": max(r[3] for r in rows),
        "hidden": rel(hidden, ref["hidden"]),
        "logits": rel(logits, ref["logits"]),
        "top1": agree,
        "top5": top5,
    }
    print(
        f"  final hidden {result['hidden']:.4f}  logits {result['logits']:.4f}  "
        f"top-1 agreement {agree:.4f}  bf16 top-1 in int4 top-5 {top5:.4f}"
    )
    return result


def run_depth(layers: int, tokens: int, seed: int, scaled: bool = False) -> dict[str, dict[str, float]]:
    widths = "CPU-test widths (--scaled)" if scaled else "real widths"
    log(f"building {REAL} at {layers} layer(s) per stack, {widths}, bf16 (thinker text path kept)")
    model = thinker_text(layers, seed, scaled)
    vocab = model.config.thinker_config.text_config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed + 1))
    schemes = {"int4": QuantScheme(), "int4_heads_kept": QuantScheme(heads=False)}
    quantized: dict[str, nn.Module] = {}
    for name, scheme in schemes.items():
        log(f"{name}: quantizing a copy ({scheme})")
        quantized[name] = copy.deepcopy(model)
        report = quantize_model(quantized[name], scheme)
        kept = [m for m, _ in report.kept]
        log(f"{name}: {len(report.quantized)} modules quantized, kept: {kept or 'none'}")
    log("casting to fp32 for the forwards (weights keep their bf16 / 4-bit values)")
    for m in (model, *quantized.values()):
        m.float()
    log("bf16 reference: forward")
    hidden, logits, taps = forward(model, ids)
    ref = {"hidden": hidden, "logits": logits, "taps": taps}
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).squeeze(0)
    spread = logits.std(-1).squeeze(0)
    print(
        f"reference logits ({tokens} tokens, vocabulary {vocab}): std {float(spread.mean()):.4f}, "
        f"top-1 minus top-2 margin median {float(margin.median()):.4f} "
        f"(= {float((margin / spread).median()):.3f} std)"
    )
    del model
    gc.collect()
    results = {}
    for name in schemes:
        results[name] = measure(name, quantized[name], ref, ids)
        del quantized[name]
        gc.collect()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--tokens", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--scaled", action="store_true", help="CPU-test widths (presets.scaled_overrides): a smoke test")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {}
    for layers in args.layers:
        results[layers] = run_depth(layers, args.tokens, args.seed, args.scaled)
        r = results[layers]
        print(
            f"layers={layers} top1_agreement_int4={r['int4']['top1']:.3f} "
            f"top1_agreement_int4_heads_kept={r['int4_heads_kept']['top1']:.3f} "
            f"max_layer_rel_error={r['int4']['max_layer']:.4f}"
        )
        gc.collect()
    r = results[max(results)]
    print(
        f"top1_agreement_int4={r['int4']['top1']:.3f} top1_agreement_int4_heads_kept={r['int4_heads_kept']['top1']:.3f} "
        f"max_layer_rel_error={r['int4']['max_layer']:.4f}"
    )


if __name__ == "__main__":
    main()
