"""Random-weight models at published sizes, built without a download.

`build_random("qwen3-omni-30b-a3b", "cuda", torch.bfloat16)` gives transformers'
`Qwen3OmniMoeForConditionalGeneration` with Qwen3-Omni-30B-A3B-Instruct's dimensions
(agent/engine/checkpoints/presets.py) and seeded random weights, so the GPU engine (KV caches,
CUDA graphs, fused MoE, batching, latency) can be measured at real scale on a machine that has no
checkpoint. It is built on the meta device (no memory, no init compute), materialised once on
the target device with `to_empty`, then initialised there: normal(0, initializer_range) for
weights, the classes' own constants for norms, layer scales, ConvNeXt gammas and SnakeBeta
log-scales, recomputed non-persistent buffers (RoPE frequencies, sinusoid table, code2wav code
offsets), and code2wav's last conv calibrated so random codes decode at about -20 dBFS (the
default init is inaudible, docs/model-facts.md). Parameters take `dtype`; buffers keep the dtype
the classes give them (fp32 RoPE, int64 offsets), as `from_pretrained(dtype=...)` does.

`build_random("tiny", ...)` is `agent.engine.checkpoints.tiny.build_model()` moved to the device.

`build_random(..., quantize="int4")` builds the same model directly in 4-bit (agent/engine/quant):
the structure is swapped on meta (`quantize_model`), then materialised module by module in
`_init_parameters`' order with the same generator, each quantized module's float weight made on
the device, packed and freed before the next one. The result is exactly
`quantize_model(build_random(...))` (same seed, same numbers), but the device never holds more
than the 4-bit model plus one module's float weight (the largest: one layer's expert stack), so
the 30B model builds on a card that could not hold it in bf16.

`load_random` wraps it as a LoadedModel driven by the tiny checkpoint's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agent.engine.checkpoints.presets import (
    cast_parameters,
    merge_overrides,
    meta_model,
    preset_config,
    token_id_overrides,
)
from agent.engine.checkpoints.tiny import calibrate_code2wav

# Calibrated output level for random codes, as in tiny.py: clearly audible in int16.
TARGET_RMS = 0.1

if TYPE_CHECKING:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration


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
        model = cast_parameters(model, dtype).to(device).eval().requires_grad_(False)
        if scheme is not None:  # a few MB: quantized after the build
            from agent.engine.quant.apply import quantize_model

            quantize_model(model, scheme)
        return model
    config = preset_config(preset, overrides)
    if scheme is not None:
        return _build_quantized(config, device, dtype, seed, scheme)
    model = cast_parameters(meta_model(config), dtype)
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

    model = cast_parameters(meta_model(config), dtype)
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
    merged = merge_overrides(dict(overrides or {}), token_id_overrides(tokenizer))
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
