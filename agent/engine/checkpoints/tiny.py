"""A tiny, random, deterministic Qwen3-Omni checkpoint built from transformers' own classes.

It exists so that every code path (load, prompt building, thinker, talker, code predictor,
code2wav, streaming) runs on a CPU in seconds, with the same `from_pretrained` call as the
real `Qwen/Qwen3-Omni-30B-A3B-Instruct`. Weights are random but seeded; the tokenizer is a
byte-level BPE trained on a fixed corpus (tiny_tokenizer.py), with the real checkpoint's special
tokens in the real order (ids differ: they follow our ~1024-entry vocabulary).
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agent.engine.checkpoints.builds import build_once
from agent.engine.checkpoints.tiny_tokenizer import ADDED_TOKENS, build_tokenizer, single_token_id

if TYPE_CHECKING:
    from agent.config import Config

log = logging.getLogger(__name__)

# Bump when anything below changes the written files: a stale build is then rebuilt.
BUILD_VERSION = 2
MARKER_FILE = "omni_agent_tiny.json"
SEED = 1234
# Our codebook: 2048 codes + 1024 specials. generate() suppresses the top 1024 ids except
# codec EOS, so every codec special id must lie in [2048, 3072). These are the real ids.
TALKER_VOCAB = 3072
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# Calibrated output level for random codes: -20 dBFS is clearly audible after int16 conversion.
TARGET_RMS = 0.1


def make_tiny(path: Path) -> Path:
    """Build the tiny checkpoint into `path` unless a complete build is already there.

    Idempotent and safe against concurrent or interrupted builds (see builds.build_once).
    """
    return build_once(path, MARKER_FILE, BUILD_VERSION, _build_into)


def _build_into(out: Path) -> dict:
    model, tokenizer = build_model()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_preprocessors(out)
    return {"seed": SEED, "params": model.num_parameters()}


def build_model():
    """The tiny model and its tokenizer, in memory (what make_tiny saves)."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_tokenizer()
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok, _ in ADDED_TOKENS}
    role_ids = {r: single_token_id(tokenizer, r) for r in ("system", "user", "assistant")}
    config = tiny_config(vocab_size=len(tokenizer), ids=ids, role_ids=role_ids)

    # fork_rng: seed the default init without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(SEED + 1)
    _init_talker_experts(model, generator)
    _calibrate_code2wav(model, generator)
    _check_finite(model)

    # generate() takes its thinker EOS as an argument (default: the real vocabulary's
    # <|im_end|>), but the saved defaults should still name ours for any other caller.
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|im_start|>"],
    )
    return model, tokenizer


def tiny_config(vocab_size: int, ids: dict[str, int], role_ids: dict[str, int]):
    """Tiny dims, real structure. Fields the code reads but the config classes do not declare
    are set here explicitly (see docs/model-facts.md): talker spatial_merge_size, the talker's
    shared_expert_intermediate_size and the thinker's vision_start_token_id."""
    from transformers import Qwen3OmniMoeConfig

    hidden = 64
    # mrope sections must sum to head_dim / 2 (head_dim 16 here).
    mrope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [2, 3, 3],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    media_ids = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }
    thinker = {
        "text_config": {
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 32768,
            "rope_parameters": dict(mrope),
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": hidden,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 800,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
        "user_token_id": role_ids["user"],
        # The real checkpoint's clock: 13 time positions a second, one per audio token (12.5 Hz);
        # transformers' default of 25 would run a camera's grids ahead of the audio they go with.
        "position_id_per_seconds": 13,
        **media_ids,
    }
    talker = {
        "text_config": {
            "vocab_size": TALKER_VOCAB,
            "hidden_size": hidden,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 32768,
            "rope_parameters": dict(mrope),
        },
        "code_predictor_config": {
            "vocab_size": 2048,
            "hidden_size": hidden,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_code_groups": 16,
            "max_position_embeddings": 64,
        },
        "num_code_groups": 16,
        "thinker_hidden_size": hidden,
        "accept_hidden_layer": 2,
        "spatial_merge_size": 2,
        "speaker_id": dict(SPEAKERS),
        "position_id_per_seconds": 13,
        **CODEC_IDS,
        **media_ids,
    }
    code2wav = {
        "codebook_size": 2048,
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "sliding_window": 72,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        "max_position_embeddings": 8000,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=role_ids["system"],
        user_token_id=role_ids["user"],
        assistant_token_id=role_ids["assistant"],
    )


@torch.no_grad()
def _init_talker_experts(model, generator: torch.Generator) -> None:
    """transformers 5.24 leaves the talker's routed experts as torch.empty and its router at zero."""
    std = model.config.talker_config.initializer_range
    for layer in model.talker.model.layers:
        moe = layer.mlp
        if not hasattr(moe, "experts"):
            continue
        for tensor in (moe.experts.gate_up_proj, moe.experts.down_proj, moe.gate.weight):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


@torch.no_grad()
def _calibrate_code2wav(model, generator: torch.Generator) -> None:
    """Default init decodes random codes at ~-108 dBFS: inaudible once in int16."""
    calibrate_code2wav(model.code2wav, generator, TARGET_RMS)


@torch.no_grad()
def calibrate_code2wav(code2wav, generator: torch.Generator, target_rms: float) -> None:
    """Scale code2wav's last conv so random codes decode at `target_rms` (a random model
    meant to be heard; the presets' real-size random model uses it too)."""
    cfg = code2wav.config
    last = code2wav.decoder[-1].conv
    last.bias.zero_()
    device = last.weight.device
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 24), generator=generator, device=device)
    # A bf16 conv on the CPU has no fast kernel: at real size this measurement took ~280 s of the
    # ~310 s it takes to write a one-layer checkpoint. It runs on a float32 copy there instead
    # (a few hundred MB, dropped at once); only the scale it yields touches the model.
    probe = code2wav
    if device.type == "cpu" and last.weight.dtype != torch.float32:
        probe = copy.deepcopy(code2wav).float()
    # The output clamps at +-1, so measure before the clamp by running the stack by hand.
    hidden = probe.code_embedding(codes + probe.code_offset).mean(1)
    hidden = probe.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in probe.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in probe.decoder:
        hidden = block(hidden)
    rms = hidden.float().pow(2).mean().sqrt().item()
    del probe, hidden
    if not rms > 0:
        raise RuntimeError("code2wav produced silence before calibration")
    last.weight.mul_(target_rms / rms)


def _check_finite(model) -> None:
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RuntimeError(f"non-finite values in {name}")


def _save_preprocessors(out: Path) -> None:
    """One preprocessor_config.json holding both the feature extractor's and the image
    processor's fields, as the real checkpoint does (each save_pretrained would overwrite it)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    merged: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for i, proc in enumerate(
            (
                WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160),
                # 16-px patches merged 2x2: a 64x64 frame is 4 tokens; max 256x256 (64 tokens).
                Qwen2VLImageProcessorPil(
                    patch_size=16,
                    merge_size=2,
                    temporal_patch_size=2,
                    min_pixels=32 * 32,
                    max_pixels=256 * 256,
                    image_mean=[0.5, 0.5, 0.5],
                    image_std=[0.5, 0.5, 0.5],
                ),
            )
        ):
            sub = Path(scratch) / str(i)
            proc.save_pretrained(sub)
            merged.update(json.loads((sub / "preprocessor_config.json").read_text()))
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True))


def ensure_model(config: Config) -> str:
    """The model path or hub id to load; builds the tiny checkpoint on first use."""
    if config.model:
        return config.model
    path = Path(config.model_path)
    log.info("using the tiny Qwen3-Omni at %s (built on first use)", path)
    return str(make_tiny(path))
