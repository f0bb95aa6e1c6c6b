"""Random-weight models at published sizes, built without a download.

`build_random("qwen3-omni-30b-a3b", "cuda", torch.bfloat16)` gives transformers'
`Qwen3OmniMoeForConditionalGeneration` with Qwen3-Omni-30B-A3B-Instruct's dimensions and seeded
random weights, so the GPU engine (KV caches, CUDA graphs, fused MoE, batching, latency) can be
measured at real scale on a machine that has no checkpoint. It is built on the meta device (no
memory, no init compute), materialised once on the target device with `to_empty`, then
initialised there: normal(0, initializer_range) for weights, the classes' own constants for
norms, layer scales, ConvNeXt gammas and SnakeBeta log-scales, recomputed non-persistent buffers
(RoPE frequencies, sinusoid table, code2wav code offsets), and code2wav's last conv calibrated
so random codes decode at about -20 dBFS (the default init is inaudible, docs/model-facts.md). Parameters
take `dtype`; buffers keep the dtype the classes give them (fp32 RoPE, int64 offsets), as
`from_pretrained(dtype=...)` does.

Dimensions marked "published" are the published ones (docs/model-facts.md); GUESSED_FIELDS names the rest, filled
from the published config.json as recalled (they do not change the parameter count except where
the test pins it against the published 35.3 B total and 3.35 B thinker-active).

`build_random("tiny", ...)` is `agent.engine.checkpoints.tiny.build_model()` moved to the device.

`build_random(..., quantize="int4")` builds the same model directly in 4-bit (agent/engine/quant):
the structure is swapped on meta (`quantize_model`), then materialised module by module in
`_init_parameters`' order with the same generator, each quantized module's float weight made on
the device, packed and freed before the next one. The result is exactly
`quantize_model(build_random(...))` (same seed, same numbers), but the device never holds more
than the 4-bit model plus one module's float weight (the largest: one layer's expert stack), so
the 30B model builds on a card that could not hold it in bf16.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agent.engine.checkpoints.tiny import calibrate_code2wav

REAL = "qwen3-omni-30b-a3b"
PRESETS = ("tiny", REAL)
# Calibrated output level for random codes, as in tiny.py: clearly audible in int16.
TARGET_RMS = 0.1

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
    kwargs = _merge(real_config_dict(), overrides or {})
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
    model = _build_meta(config)
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


def build_random(
    preset: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    quantize: str = "",
) -> Qwen3OmniMoeForConditionalGeneration:
    """A seeded random model of `preset`, eval mode, no grad. dtype defaults to bf16 on CUDA, fp32 elsewhere.
    `quantize` ("int4"): the model in 4-bit, built without a float copy on the device (module docstring)."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    scheme = _scheme(quantize)
    if preset == "tiny":
        if overrides:
            raise ValueError("the tiny preset takes no overrides")
        from agent.engine.checkpoints.tiny import build_model

        model, _ = build_model()
        # Floating parameters only: keep buffers' dtypes (fp32 RoPE, int64 offsets).
        model = _cast_parameters(model, dtype).to(device).eval().requires_grad_(False)
        if scheme is not None:  # a few MB: quantized after the build
            from agent.engine.quant.apply import quantize_model

            quantize_model(model, scheme)
        return model
    config = preset_config(preset, overrides)
    if scheme is not None:
        return _build_quantized(config, device, dtype, seed, scheme)
    model = _cast_parameters(_build_meta(config), dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        _init_parameters(model, config.initializer_range, config.code2wav_config.layer_scale_initial_scale, generator)
        _restore_buffers(model)
        calibrate_code2wav(model.code2wav, generator, TARGET_RMS)
    return model.eval().requires_grad_(False)


def _scheme(quantize: str):
    if not quantize:
        return None
    from agent.engine.quant.apply import QuantScheme

    return QuantScheme(method=quantize)  # refuses an unknown method


def _build_quantized(
    config: Qwen3OmniMoeConfig, device: torch.device, dtype: torch.dtype, seed: int, scheme
) -> Qwen3OmniMoeForConditionalGeneration:
    """build_random in 4-bit: `quantize_model(build_random(...))` without the float model.

    The float structure's modules are walked in `_init_parameters`' order (model.modules()), with
    the one generator, so every draw is the one the float build makes: a kept module's tensors
    are made on the device and initialised in place; a quantized module's float weights are made
    on the device as temporaries, initialised by the same rule, packed (`quant.int4.quantize`,
    the group its meta stand-in was given) into the stand-in's buffers, and dropped."""
    from agent.engine.quant.apply import quantize_model
    from agent.engine.quant.int4 import Packed, quantize

    model = _cast_parameters(_build_meta(config), dtype)
    float_modules = list(model.named_modules())  # before the swap: the float modules, in init order
    report = quantize_model(model, scheme)  # on meta: the structure only
    stand_ins = {name: model.get_submodule(name) for name in report.quantized}
    std, layer_scale = config.initializer_range, config.code2wav_config.layer_scale_initial_scale
    generator = torch.Generator(device=device).manual_seed(seed)
    made: dict[int, nn.Parameter] = {}  # meta parameter -> its device one (keeps shared ones shared)
    with torch.no_grad():
        for name, module in float_modules:
            stand_in = stand_ins.get(name)
            params = list(module.named_parameters(recurse=False))
            if stand_in is None:
                for pname, param in params:
                    if id(param) not in made:
                        made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                    module._parameters[pname] = made[id(param)]
                for bname, buf in module.named_buffers(recurse=False):
                    module._buffers[bname] = torch.empty_like(buf, device=device)  # recomputed below
                _init_module(module, std, layer_scale, generator)
                continue
            for pname, param in params:
                if id(param) in made:
                    raise RuntimeError(f"{name}.{pname} is shared with a kept module: cannot quantize it alone")
                module._parameters[pname] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
            _init_module(module, std, layer_scale, generator)  # the draws the float build makes
            for pname, param in params:
                if f"{pname}_nibbles" not in stand_in._buffers:  # a bias: float in the stand-in too
                    stand_in._parameters[pname] = module._parameters[pname]
                    continue
                meta = Packed(*(getattr(stand_in, f"{pname}_{part}") for part in ("nibbles", "scale", "low")))
                packed = quantize(module._parameters[pname], meta.group, meta.scale.dtype)
                for part in ("nibbles", "scale", "low"):
                    stand_in._buffers[f"{pname}_{part}"] = getattr(packed, part)
                module._parameters[pname] = param  # back to meta: the float weight is freed here
        _restore_buffers(model)
        calibrate_code2wav(model.code2wav, generator, TARGET_RMS)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"not materialised: {left[:5]}")
    return model.eval().requires_grad_(False)


def _build_meta(config: Qwen3OmniMoeConfig) -> Qwen3OmniMoeForConditionalGeneration:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        return Qwen3OmniMoeForConditionalGeneration(config)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
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


def _init_parameters(model: nn.Module, std: float, layer_scale: float, generator: torch.Generator) -> None:
    """The classes' own init, made explicit (transformers 5.24 skips the talker's experts)."""
    for module in model.modules():
        _init_module(module, std, layer_scale, generator)


def _init_module(module: nn.Module, std: float, layer_scale: float, generator: torch.Generator) -> None:
    """One module's own parameters (not its children's), drawing from `generator` in order."""
    kind = type(module).__name__
    for name, param in module.named_parameters(recurse=False):
        if "Norm" in kind:
            param.fill_(1.0 if name == "weight" else 0.0)
        elif kind.endswith("LayerScale"):
            param.fill_(layer_scale)
        elif kind.endswith("ConvNeXtBlock") and name == "gamma":
            param.fill_(1e-6)  # the class's own layer-scale start
        elif kind.endswith("SnakeBeta"):
            param.zero_()  # log-scale alpha/beta: exp(0) = 1
        elif name == "bias":
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        module.weight[module.padding_idx].zero_()


def _restore_buffers(model: nn.Module) -> None:
    """Recompute every non-persistent buffer `to_empty` left uninitialised; refuse unknown ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear

    for name, module in model.named_modules():
        owned = {n for n, _ in module.named_buffers(recurse=False)}
        if not owned or isinstance(
            module, (Int4Linear, Int4Experts, Int4Embedding)
        ):  # packed weights, made by the build
            continue
        if owned == {"inv_freq", "original_inv_freq"}:
            rope_type = module.rope_type
            fn = {
                "axial": getattr(module, "compute_axial_rope_parameters", None),
                "default": getattr(module, "compute_default_rope_parameters", None),
            }.get(rope_type)
            inv_freq, _ = (fn or ROPE_INIT_FUNCTIONS[rope_type])(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
        elif isinstance(module, hf.SinusoidsPositionEmbedding):
            module.positional_embedding.copy_(module.compute_default_singular_positional_embedding())
        elif isinstance(module, hf.Qwen3OmniMoeCode2Wav):
            cfg = module.config
            module.code_offset.copy_(torch.arange(cfg.num_quantizers).view(1, -1, 1) * cfg.codebook_size)
        else:
            raise RuntimeError(
                f"don't know how to initialise buffers {sorted(owned)} of {name} ({type(module).__name__})"
            )


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
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


def load_random(
    preset: str,
    device: str,
    tokenizer_from: str,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    overrides: Mapping[str, Any] | None = None,
    quantize: str = "",
):
    """A LoadedModel of `preset` with random weights, driven by the tokenizer and
    preprocessors saved at `tokenizer_from` (the tiny checkpoint): benchmarks at real size
    without the checkpoint. `overrides` (e.g. depth_overrides) merge under the token ids.
    `quantize` ("int4"): built directly in 4-bit (build_random), as `load_model(quantize=)` gives."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from agent.engine.checkpoints.model import LoadedModel, PromptIds, _load_image_processor, complete_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    merged = _merge(dict(overrides or {}), token_id_overrides(tokenizer))
    model = build_random(preset, device, dtype, overrides=merged, seed=seed, quantize=quantize)
    complete_config(model.config)
    model.talker.config.audio_config = model.thinker.config.audio_config
    speakers = model.config.talker_config.speaker_id or {}
    param = next(p for p in model.parameters() if p.is_floating_point())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(tokenizer_from),
        image_processor=_load_image_processor(tokenizer_from),
        device=param.device,
        dtype=param.dtype,
        speaker="ethan" if "ethan" in speakers else next(iter(speakers), ""),
        ids=PromptIds.from_tokenizer(tokenizer),
    )
