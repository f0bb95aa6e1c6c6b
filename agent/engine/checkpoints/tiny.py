"""A tiny, random, deterministic Qwen3-Omni checkpoint built from transformers' own classes.

It exists so that every code path (load, prompt building, thinker, talker, code predictor,
code2wav, streaming) runs on a CPU in seconds, with the same `from_pretrained` call as the
real `Qwen/Qwen3-Omni-30B-A3B-Instruct`. Weights are random but seeded; the tokenizer is a
byte-level BPE trained here on a fixed corpus, with the real checkpoint's special tokens in
the real order (ids differ: they follow our ~1024-entry vocabulary).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agent.engine.checkpoints.builds import build_once

if TYPE_CHECKING:
    from agent.config import Config

log = logging.getLogger(__name__)

# Bump when anything below changes the written files: a stale build is then rebuilt.
BUILD_VERSION = 2
MARKER_FILE = "omni_agent_tiny.json"
SEED = 1234
BPE_VOCAB_SIZE = 1024
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

# The real checkpoint's added tokens, in its order (ids 151643..151675 there).
# (token, special): Qwen3 marks the tool/think tags as non-special added tokens.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# Fixed training text: enough English for a ~1024-entry BPE, with the chat roles repeated so
# that "system", "user" and "assistant" each become one token (the talker finds user turns by
# the token after <|im_start|>).
_CORPUS = """\
You are a helpful voice assistant. You can see the camera and hear the user.
Answer briefly and clearly, in a friendly voice. Describe what you see when asked.
Hello agent, what do you see? I see a person sitting at a desk in front of a window.
The weather is nice today. It is sunny and warm, with a few clouds in the sky.
Can you hear me? Yes, I can hear you well. What would you like to talk about?
Please tell me the time. It is half past three in the afternoon.
What color is the cup on the table? The cup is blue and the table is made of wood.
Thank you very much. You are welcome, I am happy to help with anything else.
One two three four five six seven eight nine ten. 0123456789 + - * / = ( ) [ ] { }
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
"""
_ROLES = "system\nuser\nassistant\n"
_WORDS = (
    "the a an and or but if then when where what who why how which this that these those here there "
    "i you he she it we they me him her us them my your his its our their mine yours is are was were be "
    "been being have has had do does did will would can could shall should may might must not no yes "
    "hello hi thanks please sorry okay good great nice bad big small long short new old high low left right "
    "up down in out on off over under above below near far into onto from to of for with without about "
    "see look hear listen say tell speak talk ask answer know think feel want need like love help try "
    "make take give get go come move turn stop start open close read write play work run walk sit stand "
    "person people man woman child friend camera picture image video sound voice music word sentence "
    "room desk table chair window door wall floor light lamp screen phone computer keyboard book paper "
    "cup glass bottle water coffee tea food apple bread plant flower tree sky cloud sun rain wind snow "
    "red orange yellow green blue purple black white gray brown color shape round square bright dark "
    "one two three four five six seven eight nine ten hundred thousand first second third last next "
    "time day night morning evening today tomorrow yesterday minute hour week month year now soon later "
    "city street car bus train road home house school office shop park river sea mountain world country "
    "question problem idea reason example number part place thing way life hand eye face head name"
).split()


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
    role_ids = {r: _single_token_id(tokenizer, r) for r in ("system", "user", "assistant")}
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


def build_tokenizer():
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on the fixed corpus above."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(_training_text(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Give the added tokens their ids in the vocab itself, in the real order: Qwen2Tokenizer
    # registers its named specials (eos, pad, image_token, ...) first, and add_tokens keeps an
    # id the vocab already has, so this is what fixes the order.
    bpe_size = len(model["vocab"])
    vocab = dict(model["vocab"])
    vocab.update({tok: bpe_size + i for i, (tok, _) in enumerate(ADDED_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    # One call, in order, so the ids follow the real checkpoint's order after the BPE vocab.
    tokenizer.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in ADDED_TOKENS])
    for i, (tok, _) in enumerate(ADDED_TOKENS):
        if tokenizer.convert_tokens_to_ids(tok) != bpe_size + i:
            raise RuntimeError(f"special token {tok} is not at its place in the real order")
    return tokenizer


def _training_text() -> list[str]:
    """The fixed corpus plus seeded random sentences over a word list, enough for ~1024 merges."""
    import random

    rng = random.Random(SEED)
    sentences = []
    for _ in range(400):
        words = rng.choices(_WORDS, k=rng.randint(4, 12))
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return [_CORPUS] * 4 + [_ROLES] * 64 + sentences


def _single_token_id(tokenizer, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"tokenizer splits {word!r} into {ids}: the chat roles must be single tokens")
    return ids[0]


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
    # The output clamps at +-1, so measure before the clamp by running the stack by hand.
    hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
    hidden = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in code2wav.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in code2wav.decoder:
        hidden = block(hidden)
    rms = hidden.float().pow(2).mean().sqrt().item()
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
