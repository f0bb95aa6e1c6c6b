"""Qwen3-Omni's published sizes as transformers configs, without a download.

`preset_config("qwen3-omni-30b-a3b")` is Qwen3-Omni-30B-A3B-Instruct's `Qwen3OmniMoeConfig`;
`depth_overrides` / `scaled_overrides` shrink it (fewer layers; narrower, for tests) and
`token_id_overrides` points its special-token ids at a tokenizer's. `meta_model` builds the
structure on the meta device (no memory, no init compute): parameter counts, byte counts and the
memory plan read it. The random-weight models at these sizes are built by
agent/engine/checkpoints/random_weights.py.

Dimensions marked "published" are the published ones (docs/model-facts.md); GUESSED_FIELDS names the rest, filled
from the published config.json as recalled (they do not change the parameter count except where
the test pins it against the published 35.3 B total and 3.35 B thinker-active).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

REAL = "qwen3-omni-30b-a3b"
PRESETS = ("tiny", REAL)

if TYPE_CHECKING:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

GUESSED_FIELDS = (
    "thinker.text: intermediate_size=768 (unused: every layer is sparse), rope mrope_section [24,20,20] interleaved",
    "thinker.audio: encoder_attention_heads=20, encoder_ffn_dim=5120, downsample_hidden_size=480, output_dim=2048",
    "thinker.vision: intermediate_size=4304, num_heads=16, num_position_embeddings=2304, deepstack [8,16,24]",
    "talker.text: num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=2048 (unused)",
    "talker.code_predictor: num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072",
    "code2wav: num_attention_heads=16, num_key_value_heads=16, intermediate_size=3072, rope_theta=10000",
)


def real_config_dict() -> dict[str, Any]:
    """Qwen3-Omni-30B-A3B-Instruct as nested config kwargs (see GUESSED_FIELDS)."""
    mrope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [24, 20, 20],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    media = {
        "audio_token_id": 151675,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "audio_start_token_id": 151669,
        "vision_start_token_id": 151652,
    }
    return {
        "thinker_config": {
            "text_config": {
                "vocab_size": 152064,
                "hidden_size": 2048,
                "intermediate_size": 768,
                "num_hidden_layers": 48,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "norm_topk_prob": True,
                "max_position_embeddings": 65536,
                "rope_parameters": dict(mrope),
                "rms_norm_eps": 1e-6,
            },
            "audio_config": {
                "encoder_layers": 32,
                "d_model": 1280,
                "encoder_attention_heads": 20,
                "encoder_ffn_dim": 5120,
                "num_mel_bins": 128,
                "downsample_hidden_size": 480,
                "output_dim": 2048,
                "n_window": 50,
                "n_window_infer": 800,
                "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 27,
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_heads": 16,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 2048,
                "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [8, 16, 24],
            },
            "user_token_id": 872,
            "position_id_per_seconds": 13,
            **media,
        },
        "talker_config": {
            "text_config": {
                "vocab_size": 3072,
                "hidden_size": 1024,
                "intermediate_size": 2048,
                "num_hidden_layers": 20,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 6,
                "moe_intermediate_size": 384,
                "shared_expert_intermediate_size": 768,
                # Published (the released config.json); the talker config class defaults to False.
                "norm_topk_prob": True,
                "max_position_embeddings": 65536,
                "rope_parameters": dict(mrope),
                "rms_norm_eps": 1e-6,
            },
            "code_predictor_config": {
                "vocab_size": 2048,
                "hidden_size": 1024,
                "intermediate_size": 3072,
                "num_hidden_layers": 5,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "num_code_groups": 16,
                "max_position_embeddings": 32768,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            "num_code_groups": 16,
            "thinker_hidden_size": 2048,
            "accept_hidden_layer": 24,
            # Read by the code, not declared by the config class (docs/model-facts.md).
            "spatial_merge_size": 2,
            "codec_pad_id": 2148,
            "codec_bos_id": 2149,
            "codec_eos_token_id": 2150,
            "codec_nothink_id": 2155,
            "codec_think_bos_id": 2156,
            "codec_think_eos_id": 2157,
            "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            "position_id_per_seconds": 13,
            **media,
        },
        "code2wav_config": {
            "codebook_size": 2048,
            "hidden_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "intermediate_size": 3072,
            "sliding_window": 72,
            "num_quantizers": 16,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 1536,
            "max_position_embeddings": 8000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "im_start_token_id": 151644,
        "im_end_token_id": 151645,
        "tts_pad_token_id": 151671,
        "tts_bos_token_id": 151672,
        "tts_eos_token_id": 151673,
        "system_token_id": 8948,
        "user_token_id": 872,
        "assistant_token_id": 77091,
    }


def scaled_overrides(layers: int = 2, width: int = 256, experts: int = 16, vocab: int = 4096) -> dict[str, Any]:
    """Overrides giving the real structure at CPU-test size: `layers` per stack, narrow widths,
    fewer experts (same top-k), small vocab. Head counts and head_dim stay real."""
    return {
        "thinker_config": {
            "text_config": {
                "num_hidden_layers": layers,
                "hidden_size": width,
                "num_experts": experts,
                "moe_intermediate_size": 64,
                "intermediate_size": 64,
                "vocab_size": vocab,
            },
            "audio_config": {
                "encoder_layers": layers,
                "d_model": width,
                "encoder_attention_heads": 4,
                "encoder_ffn_dim": 2 * width,
                "downsample_hidden_size": 32,
                "output_dim": width,
            },
            "vision_config": {
                "depth": layers,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_heads": 4,
                "out_hidden_size": width,
                "deepstack_visual_indexes": list(range(min(layers, 3))),
            },
        },
        "talker_config": {
            "text_config": {
                "num_hidden_layers": layers,
                "hidden_size": width,
                "num_experts": experts,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 128,
                "intermediate_size": 128,
            },
            "code_predictor_config": {
                "num_hidden_layers": layers,
                "hidden_size": width,
                "intermediate_size": 2 * width,
            },
            "thinker_hidden_size": width,
            "accept_hidden_layer": layers,
        },
        "code2wav_config": {
            "num_hidden_layers": layers,
            "hidden_size": width,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 2 * width,
            "decoder_dim": 96,
        },
    }


def depth_overrides(layers: int) -> dict[str, Any]:
    """Overrides keeping every real width, head count and expert count but giving each stack
    (thinker, audio and vision encoders, talker, code predictor, code2wav's transformer)
    `layers` layers: what a per-layer kernel count needs (scripts/bench_engine.py --kernels
    differences 1 and 2 layers and extrapolates to the published depths)."""
    if layers < 1:
        raise ValueError("at least one layer per stack")
    return {
        "thinker_config": {
            "text_config": {"num_hidden_layers": layers},
            "audio_config": {"encoder_layers": layers},
            "vision_config": {"depth": layers, "deepstack_visual_indexes": list(range(min(layers, 3)))},
        },
        "talker_config": {
            "text_config": {"num_hidden_layers": layers},
            "code_predictor_config": {"num_hidden_layers": layers},
            "accept_hidden_layer": min(layers, 24),
        },
        "code2wav_config": {"num_hidden_layers": layers},
    }


def preset_config(preset: str = REAL, overrides: Mapping[str, Any] | None = None) -> Qwen3OmniMoeConfig:
    """The preset's `Qwen3OmniMoeConfig`, with `overrides` merged in (nested dicts)."""
    from transformers import Qwen3OmniMoeConfig

    if preset != REAL:
        raise ValueError(
            f"no config preset {preset!r} (known: {REAL!r}; 'tiny' comes from agent.engine.checkpoints.tiny)"
        )
    kwargs = merge_overrides(real_config_dict(), overrides or {})
    config = Qwen3OmniMoeConfig(**kwargs)
    # Declared nowhere, read by the talker block and generate() (docs/model-facts.md): set on the objects.
    talker_text = kwargs["talker_config"]["text_config"]
    config.talker_config.text_config.shared_expert_intermediate_size = talker_text["shared_expert_intermediate_size"]
    config.talker_config.spatial_merge_size = kwargs["talker_config"]["spatial_merge_size"]
    config.thinker_config.vision_start_token_id = kwargs["thinker_config"]["vision_start_token_id"]
    return config


@dataclass(frozen=True)
class ParameterCount:
    total: int
    thinker_text: int
    thinker_active: int  # per token: routed experts count top-k of E
    talker_active: int  # the talker decoder (talker.model) per token: top-k of E routed experts
    code_predictor: int


def count_parameters(config: Qwen3OmniMoeConfig) -> ParameterCount:
    """Exact counts from a meta-device model: nothing is allocated."""
    model = meta_model(config)
    thinker_lm = model.thinker.model.language_model
    thinker_text = _numel(thinker_lm) + _numel(model.thinker.lm_head)
    talker = _numel(model.talker.model)
    return ParameterCount(
        total=_numel(model),
        thinker_text=thinker_text,
        thinker_active=thinker_text - _inactive_experts(thinker_lm, config.thinker_config.text_config),
        talker_active=talker - _inactive_experts(model.talker.model, config.talker_config.text_config),
        code_predictor=_numel(model.talker.code_predictor),
    )


def meta_model(config: Qwen3OmniMoeConfig) -> Qwen3OmniMoeForConditionalGeneration:
    """The model's structure on the meta device: shapes and dtypes, nothing allocated."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        return Qwen3OmniMoeForConditionalGeneration(config)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Floating parameters to `dtype` (buffers keep theirs, as from_pretrained(dtype=...) does)."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)  # in place: keeps identities (and any tied weights)
    return model


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _inactive_experts(text_model: nn.Module, text_config) -> int:
    per_layer = sum(
        layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
        for layer in text_model.layers
        if hasattr(layer.mlp, "experts")
    )
    return per_layer * (text_config.num_experts - text_config.num_experts_per_tok) // text_config.num_experts


def merge_overrides(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, nested dicts key by key (neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def token_id_overrides(tokenizer) -> dict[str, Any]:
    """Config overrides that point a preset's special-token ids at `tokenizer`'s own ids.

    A random-weight model at real size is driven with the tiny model's tokenizer (no
    download); its prompt tokens must be the ids the config routes audio/image/tts by.
    """

    def one(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    def word(text: str) -> int:
        (token_id,) = tokenizer.encode(text, add_special_tokens=False)
        return int(token_id)

    media = {
        "audio_token_id": one("<|audio_pad|>"),
        "image_token_id": one("<|image_pad|>"),
        "video_token_id": one("<|video_pad|>"),
        "audio_start_token_id": one("<|audio_start|>"),
        "vision_start_token_id": one("<|vision_start|>"),
    }
    return {
        "thinker_config": {**media, "user_token_id": word("user")},
        "talker_config": dict(media),
        "im_start_token_id": one("<|im_start|>"),
        "im_end_token_id": one("<|im_end|>"),
        "tts_pad_token_id": one("<tts_pad>"),
        "tts_bos_token_id": one("<tts_text_bos>"),
        "tts_eos_token_id": one("<tts_text_eod>"),
        "system_token_id": word("system"),
        "user_token_id": word("user"),
        "assistant_token_id": word("assistant"),
    }
