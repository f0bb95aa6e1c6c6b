"""A random-weight checkpoint folder shaped like the released Qwen/Qwen3-Omni-30B-A3B-Instruct.

`save_real_checkpoint(dst, layers)` writes what a user downloads from the hub, at real widths
(every hidden size, head count, expert count and vocabulary) but with `layers` layers in every
stack, so that the load path (`agent.engine.checkpoints.model.load_model`) and its host-memory cost can be
exercised on a machine that has neither the 65.8 GiB checkpoint nor a GPU:

- safetensors shards and their index, written by transformers' `save_pretrained`, which already
  reverts its fused expert tensors to the released per-expert keys
  (`...mlp.experts.N.gate_proj.weight`), so loading runs the same weight conversion as the real
  checkpoint does;
- `config.json` rewritten into the released (transformers 4.57 era) form: RoPE as `rope_scaling`
  plus `rope_theta` beside it instead of transformers 5's `rope_parameters` (docs/memory.md,
  "The checkpoint"), `torch_dtype`, the 4.57 `transformers_version`;
- `preprocessor_config.json` with the released feature extractor's and image processor's fields;
- `generation_config.json`.

No tokenizer is written: pass `tokenizer_from` (a folder holding one, e.g. the tiny checkpoint)
to copy its files in, or put the real tokenizer's files into `dst` afterwards: `load_model`
needs one, and every id it uses is looked up from it.

    python -m agent.engine.checkpoints.hub DST --layers 1 [--tokenizer-from DIR]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from agent.engine.checkpoints.presets import REAL, depth_overrides
from agent.engine.checkpoints.random_weights import build_random

# The transformers release the published config.json was written with.
RELEASED_TRANSFORMERS = "4.57.0.dev0"
SHARD_SIZE = "1GB"  # several shards even at one layer per stack, as the release has (15 of ~5 GB)
# The tokenizer's files, as `save_pretrained` of a Qwen2 tokenizer writes them (any that exist are copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# generation_config.json: the Qwen chat ends on <|im_end|> or <|endoftext|>. Only these ids are
# written (the release's sampling fields are not reproduced here): agent/decoding.py then uses
# Qwen's demo sampling, as it does for any checkpoint whose file does not say.
ENDOFTEXT_ID = 151643


def save_real_checkpoint(
    dst: Path, layers: int, dtype: torch.dtype = torch.bfloat16, *, tokenizer_from: Path | None = None, seed: int = 0
) -> Path:
    """Write the real preset with `layers` layers per stack into `dst`, hub-shaped; returns `dst`.

    The model is built on the CPU (about 3.3 GB at one layer per stack in bf16, 1.7 GB more per
    layer) and freed before this returns."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model = build_random(REAL, "cpu", dtype, overrides=depth_overrides(layers), seed=seed)
    try:
        model.save_pretrained(dst, max_shard_size=SHARD_SIZE)
    finally:
        del model
        gc.collect()
    config_path = dst / "config.json"
    config_path.write_text(
        json.dumps(released_config(json.loads(config_path.read_text()), dtype), indent=2, sort_keys=True)
    )
    write_preprocessor_config(dst)
    (dst / "generation_config.json").write_text(json.dumps(generation_config(), indent=2, sort_keys=True))
    if tokenizer_from is not None:
        copy_tokenizer(Path(tokenizer_from), dst)
    return dst


def released_config(saved: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """transformers 5's config.json of Qwen3OmniMoeForConditionalGeneration, in the released form."""
    out = copy.deepcopy(saved)
    out.pop("dtype", None)
    out["torch_dtype"] = str(dtype).removeprefix("torch.")
    out["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    out["model_type"] = "qwen3_omni_moe"
    out["transformers_version"] = RELEASED_TRANSFORMERS
    thinker, talker = out["thinker_config"], out["talker_config"]
    # Multimodal RoPE: the section split and the interleaving go in `rope_scaling`, theta beside it.
    for text in (thinker["text_config"], talker["text_config"]):
        rope = dict(text.pop("rope_parameters"))
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope
    # Plain RoPE: a theta alone (the release writes `rope_scaling: null` for the code predictor).
    predictor = talker["code_predictor_config"]
    predictor["rope_theta"] = predictor.pop("rope_parameters")["rope_theta"]
    predictor["rope_scaling"] = None
    code2wav = out["code2wav_config"]
    code2wav["rope_theta"] = code2wav.pop("rope_parameters")["rope_theta"]
    # The vision tower's 2-D RoPE has no field in the release: the class default (axial) applies.
    thinker["vision_config"].pop("rope_parameters", None)
    # transformers 5 renames the talker's expert count through its attribute_map; 4.57 wrote num_experts.
    talker_text = talker["text_config"]
    if "num_local_experts" in talker_text:
        talker_text["num_experts"] = talker_text.pop("num_local_experts")
    return out


def preprocessor_config() -> dict[str, Any]:
    """The released preprocessor_config.json: one file for the feature extractor and the image
    processor, as Qwen3OmniMoeProcessor's parts read it (each `save_pretrained` would overwrite it)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    merged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        parts = (
            # 128 mels, 100 frames a second (10 ms hop, 25 ms windows); chunk_length 300 s: the
            # extractor's n_samples is five minutes, not Whisper's 30 s.
            WhisperFeatureExtractor(
                feature_size=128,
                sampling_rate=16000,
                hop_length=160,
                n_fft=400,
                chunk_length=300,
                padding_value=0.0,
                return_attention_mask=True,
            ),
            # 16-px patches, 2 frames deep, merged 2x2 into one token: 32 px a token side.
            Qwen2VLImageProcessorPil(
                patch_size=16,
                temporal_patch_size=2,
                merge_size=2,
                min_pixels=56 * 56,
                max_pixels=28 * 28 * 16384,
                image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5],
            ),
        )
        for i, part in enumerate(parts):
            sub = Path(scratch) / str(i)
            part.save_pretrained(sub)
            merged.update(json.loads((sub / "preprocessor_config.json").read_text()))
    merged.update(
        image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen3OmniMoeProcessor",
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
    )
    return merged


def write_preprocessor_config(dst: Path) -> None:
    (Path(dst) / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2, sort_keys=True))


def generation_config() -> dict[str, Any]:
    from agent.engine.checkpoints.presets import real_config_dict

    im_end = real_config_dict()["im_end_token_id"]
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [im_end, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "transformers_version": RELEASED_TRANSFORMERS,
    }


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy a saved tokenizer's files from `src` into `dst`; returns the names copied."""
    copied = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    if "tokenizer_config.json" not in copied:
        raise FileNotFoundError(f"no tokenizer in {src}")
    for name in copied:
        shutil.copyfile(Path(src) / name, Path(dst) / name)
    return copied


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dst", type=Path)
    p.add_argument("--layers", type=int, default=1, help="layers in every stack (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tokenizer-from", type=Path, default=None, help="a folder whose tokenizer files are copied in")
    args = p.parse_args(argv)
    print(save_real_checkpoint(args.dst, args.layers, getattr(torch, args.dtype), tokenizer_from=args.tokenizer_from))


if __name__ == "__main__":
    main()
