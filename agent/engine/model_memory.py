"""What one model keeps on the device: its weights and what each session slot's caches cost.

Counted from a built model, on the meta device before anything is loaded (`from_config`) or as
loaded (`of_model`), so the memory plan (agent/engine/memory_plan.py) and the benchmarks
(scripts/bench_load.py, scripts/bench_bytes.py) read the same bytes the engine will hold. The
cards the planner is asked about by name live here too: their free memory is a fact about the
hardware, not about the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GiB = 2**30
KiB = 2**10


@dataclass(frozen=True)
class Card:
    """A GPU as the planner sees it: the device memory free before the model is loaded."""

    name: str
    free: int


# torch reports 79.2 GiB for an H100 80GB (HBM3) and 139.8 GiB for an H200; the CUDA context and
# the libraries' handles take about 0.5 GiB of it before the load. An RTX 4090 is counted at its
# nominal 24 GiB (the 4-bit model's target card).
CUDA_CONTEXT_BYTES = GiB // 2
H100_80G = Card("H100 80GB", int(79.2 * GiB) - CUDA_CONTEXT_BYTES)
H200 = Card("H200", int(139.8 * GiB) - CUDA_CONTEXT_BYTES)
RTX4090 = Card("RTX 4090 24GB", 24 * GiB - CUDA_CONTEXT_BYTES)


@dataclass(frozen=True)
class ModelMemory:
    """What the engine keeps on the device for one model, per slot and in all."""

    weights: int  # parameters and buffers as loaded
    engine_weights: int  # the code predictor's concatenated projections (code_predictor.FusedWeights)
    # A 4-bit model's prefill unpacks one layer's expert stacks for its grouped matmuls, a slice
    # of rows at a time (quant/modules.py UNPACK_SLICE_BYTES): the largest slice in float.
    unpacked_experts: int
    thinker_kv_token: int  # K and V of one token in one slot, every thinker layer
    talker_kv_token: int
    talker_extra_tokens: int  # the talker's cache beyond the context: a reply's frames + 16
    slot_state: int  # code2wav's per-slot ring cache, key positions and conv states
    fixed_state: int  # the code predictor's cache (largest batch bucket x 17 tokens)
    dtype: str

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype, max_reply_seconds: float, quantize: str = "") -> ModelMemory:
        """From a `Qwen3OmniMoeConfig` (complete_config applied), nothing allocated: the model is
        built on the meta device and counted; 4-bit as the checkpoint's config says it is stored,
        or as `quantize` (--quantize) will make it."""
        from agent.engine.checkpoints.presets import cast_parameters, meta_model
        from agent.engine.quant.apply import QuantScheme, quantize_model

        model = cast_parameters(meta_model(config), dtype)
        scheme = QuantScheme.of_config(config) or (QuantScheme(method=quantize) if quantize else None)
        if scheme is not None:
            quantize_model(model, scheme)
        return cls.of_model(model, max_reply_seconds)

    @classmethod
    def of_model(cls, model: torch.nn.Module, max_reply_seconds: float) -> ModelMemory:
        """From a built `Qwen3OmniMoeForConditionalGeneration` (on the meta device, or loaded:
        then one code2wav slot, ~3 MB, is made on its device to be counted)."""
        from agent.engine.checkpoints.model import OUTPUT_RATE
        from agent.engine.codecs.code2wav import SlotCode2Wav
        from agent.engine.codecs.output_audio import talker_tokens_for
        from agent.engine.quant.modules import Int4Experts

        config = model.config
        # The model's dtype from a norm (never quantized; the embedding may be 4-bit, and its
        # float `weight` would unpack the whole table).
        weight = model.thinker.model.language_model.norm.weight
        size = weight.element_size()
        weights = _bytes(model)
        slot = SlotCode2Wav(model.code2wav, 1)
        slot_state = sum(
            t.numel() * t.element_size() for t in (*slot.kv.keys, *slot.kv.values, slot.key_pos, *slot.states.values())
        )
        del slot
        predictor = config.talker_config.code_predictor_config
        # FusedWeights copies q/k/v and gate/up of every predictor layer, packed if they are.
        engine_weights = sum(
            _bytes(m)
            for layer in model.talker.code_predictor.model.layers
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            + (layer.mlp.gate_proj, layer.mlp.up_proj)
        )
        # A prefill unpacks each stack a slice of rows at a time: the largest slice is alive.
        unpacked = [m.largest_slice_bytes() for m in model.modules() if isinstance(m, Int4Experts)]
        tokens = config.talker_config.num_code_groups + 1  # the talker's hidden state and codebook 0, then 15 codes
        return cls(
            weights=weights,
            engine_weights=engine_weights,
            unpacked_experts=max(unpacked, default=0),
            thinker_kv_token=_kv_token(config.thinker_config.text_config, size),
            talker_kv_token=_kv_token(config.talker_config.text_config, size),
            talker_extra_tokens=talker_tokens_for(max_reply_seconds, OUTPUT_RATE) + 16,
            slot_state=slot_state,
            fixed_state=16 * tokens * _kv_token(predictor, size),  # 16 rows: the largest graph bucket
            dtype=str(weight.dtype).removeprefix("torch."),
        )

    def kv_per_slot(self, context: int) -> int:
        """One slot's caches at `context` tokens (what a session, or the pad row, costs)."""
        return (
            self.thinker_kv_token * context
            + self.talker_kv_token * (context + self.talker_extra_tokens)
            + self.slot_state
        )

    @property
    def fixed(self) -> int:
        """Everything that does not grow with sessions or context (the reserve aside)."""
        return self.weights + self.engine_weights + self.fixed_state + self.unpacked_experts


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _head_dim(text_config: Any) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _kv_token(text_config: Any, size: int) -> int:
    return text_config.num_hidden_layers * 2 * text_config.num_key_value_heads * _head_dim(text_config) * size
