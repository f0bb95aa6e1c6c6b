"""Load Qwen3-Omni (real or tiny) and build the thinker's inputs without the HF processor.

`Qwen3OmniMoeProcessor` needs torchvision (for its video processor), which does not import
beside the CPU torch wheel, so the chat prompt, placeholder tokens, log-mel features and image
patches are made here from the tokenizer, `WhisperFeatureExtractor` and the image processor.
Every token id is looked up from the tokenizer or the config, so the same code serves the real
checkpoint's vocabulary and the tiny one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

OUTPUT_RATE = 24000  # code2wav's sample rate; no config stores it


@dataclass(frozen=True)
class PromptIds:
    """Token ids the prompt builder and the talker need, read from the tokenizer."""

    im_start: int
    im_end: int
    endoftext: int
    newline: tuple[int, ...]
    system: tuple[int, ...]
    user: tuple[int, ...]
    assistant: tuple[int, ...]
    audio_start: int
    audio_end: int
    audio_pad: int
    vision_start: int
    vision_end: int
    image_pad: int
    tool_call: int  # <tool_call>: opens a tool call (Qwen's format, docs/tools.md)
    tool_call_end: int  # </tool_call>

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "PromptIds":
        def one(token: str) -> int:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer has no {token}")
            return int(token_id)

        def text(s: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(s, add_special_tokens=False))

        return cls(
            im_start=one("<|im_start|>"),
            im_end=one("<|im_end|>"),
            endoftext=one("<|endoftext|>"),
            newline=text("\n"),
            system=text("system"),
            user=text("user"),
            assistant=text("assistant"),
            audio_start=one("<|audio_start|>"),
            audio_end=one("<|audio_end|>"),
            audio_pad=one("<|audio_pad|>"),
            vision_start=one("<|vision_start|>"),
            vision_end=one("<|vision_end|>"),
            image_pad=one("<|image_pad|>"),
            tool_call=one("<tool_call>"),
            tool_call_end=one("</tool_call>"),
        )


@dataclass
class LoadedModel:
    model: Any  # Qwen3OmniMoeForConditionalGeneration
    tokenizer: Any
    feature_extractor: Any  # WhisperFeatureExtractor
    image_processor: Any  # Qwen2VLImageProcessor(Pil)
    device: torch.device
    dtype: torch.dtype
    speaker: str
    ids: PromptIds
    output_rate: int = OUTPUT_RATE

    @property
    def thinker_eos_ids(self) -> list[int]:
        """What ends a reply: <|im_end|> (and <|endoftext|>), in this vocabulary."""
        return [self.ids.im_end, self.ids.endoftext]


def load_model(
    path_or_id: str, device: str = "auto", dtype: str = "auto", attn_impl: str | None = None, quantize: str = ""
) -> LoadedModel:
    """from_pretrained for the real checkpoint and the tiny one alike (no download is forced).

    The weights are placed on `device` by from_pretrained itself (a one-device map), tensor by
    tensor from the memory-mapped safetensors, so the host never holds the whole checkpoint:
    loading on the CPU and moving the model with `.to(device)` afterwards staged the real one in
    host RAM first (its ~60 GiB of stacked experts as new memory; docs/memory.md). "meta" is a
    dry run: shapes and placement, no bytes read.

    A quantized checkpoint (`omni-agent quantize`, config.json names its scheme) is loaded as it
    is stored, 4-bit layers and all (agent/engine/quant/checkpoint.py). `quantize` ("int4")
    quantizes a float checkpoint after the load instead: the float weights pass through the
    device first, so it suits a card that holds them; a smaller one needs the quantized folder.
    """
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if attn_impl is None:
        attn_impl = "flash_attention_2" if torch_device.type == "cuda" and _has_flash_attn() else "sdpa"

    from agent.engine.quant.apply import QuantScheme, quantize_model
    from agent.engine.quant.checkpoint import load_quantized

    config = AutoConfig.from_pretrained(path_or_id)
    complete_config(config)
    stored = QuantScheme.of_config(config)
    if stored is not None:
        if quantize and quantize != stored.method:
            raise ValueError(f"{path_or_id} is quantized as {stored.method}, not {quantize}")
        model = load_quantized(path_or_id, config, torch_dtype, _map_device(torch_device), attn_impl)
    else:
        # One device in the map: transformers attaches no accelerate dispatch hooks (only a map
        # over several devices or disk does), so the engine may still swap modules (fused MoE, q/k/v).
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path_or_id,
            config=config,
            dtype=torch_dtype,
            attn_implementation=attn_impl,
            device_map={"": _map_device(torch_device)},
        )
        if quantize:
            quantize_model(model, QuantScheme(method=quantize))
    model.eval()
    # Inference only: no weight needs a gradient (and a CPU graph's trace refuses to record a
    # weight that asks for one: agent/engine/compile/cpu_traces.py).
    model.requires_grad_(False)
    # The composite's __init__ copies sub-configs: re-apply on the live sub-model configs.
    complete_config(model.config)
    model.talker.config.audio_config = model.thinker.config.audio_config

    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    feature_extractor = WhisperFeatureExtractor.from_pretrained(path_or_id)
    image_processor = _load_image_processor(path_or_id)
    speakers = model.config.talker_config.speaker_id or {}
    speaker = "ethan" if "ethan" in speakers else next(iter(speakers), "")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        feature_extractor=feature_extractor,
        image_processor=image_processor,
        device=torch_device,
        dtype=torch_dtype,
        speaker=speaker,
        ids=PromptIds.from_tokenizer(tokenizer),
    )


def complete_config(config) -> None:
    """Add fields transformers 5.24 reads but its config classes do not declare (docs/model-facts.md)."""
    thinker, talker = config.thinker_config, config.talker_config
    if getattr(talker, "spatial_merge_size", None) is None:
        talker.spatial_merge_size = thinker.vision_config.spatial_merge_size
    if getattr(thinker, "vision_start_token_id", None) is None:
        thinker.vision_start_token_id = talker.vision_start_token_id
    if getattr(talker.text_config, "shared_expert_intermediate_size", None) is None:
        raise ValueError("talker_config.text_config.shared_expert_intermediate_size is missing from the checkpoint")
    # With audio plus an image, the talker's get_rope_index reads config.audio_config.n_window.
    if not hasattr(getattr(talker, "audio_config", None), "n_window"):
        talker.audio_config = thinker.audio_config


def resolve_device(device: str) -> torch.device:
    """--device: auto is CUDA when there is one, else the CPU."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype: auto is bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def _map_device(device: torch.device) -> torch.device:
    """The device for from_pretrained's map: CUDA with its index (the current device), as `.to` would pick."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _load_image_processor(path_or_id: str):
    # The torch ("fast") image processor needs torchvision, which may not import here.
    from transformers import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        return Qwen2VLImageProcessorPil.from_pretrained(path_or_id)
    return Qwen2VLImageProcessor.from_pretrained(path_or_id)


def audio_token_count(n_feature_frames: int, n_window: int) -> int:
    """Thinker tokens for a log-mel of n frames: 13 per full 100-frame chunk plus the tail's."""
    chunk = n_window * 2
    tail = n_feature_frames % chunk
    tail_tokens = ((((tail - 1) // 2 + 1) - 1) // 2 + 1 - 1) // 2 + 1
    return tail_tokens + (n_feature_frames // chunk) * 13


def encode_audio(loaded: LoadedModel, audios: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Log-mel features and mask exactly as the HF processor makes them (no 30 s padding;
    several audios are padded to the longest, the mask says how long each is)."""
    fe = loaded.feature_extractor
    feats = fe(
        [np.asarray(a, dtype=np.float32) for a in audios],
        sampling_rate=fe.sampling_rate,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {
        "input_features": feats["input_features"].to(loaded.device, loaded.dtype),
        "feature_attention_mask": feats["attention_mask"].to(loaded.device),
    }


def encode_images(loaded: LoadedModel, images: list[np.ndarray]) -> dict[str, torch.Tensor]:
    # Always H x W x 3: said outright, or the processor guesses a small image (a side of 1 or 3
    # pixels) to be channels first and misreads it.
    out = loaded.image_processor(
        images=[np.asarray(im, dtype=np.uint8) for im in images], return_tensors="pt", input_data_format="channels_last"
    )
    return {
        "pixel_values": out["pixel_values"].to(loaded.device, loaded.dtype),
        "image_grid_thw": out["image_grid_thw"].to(loaded.device),
    }


def image_token_counts(loaded: LoadedModel, image_grid_thw: torch.Tensor) -> list[int]:
    merge = loaded.model.config.thinker_config.vision_config.spatial_merge_size
    return [int(n) for n in (image_grid_thw.prod(-1) // merge**2).tolist()]


def system_turn_ids(ids: PromptIds, tokenizer, system_prompt: str) -> list[int]:
    """<|im_start|>system\\n{prompt}<|im_end|>\\n"""
    body = tokenizer.encode(system_prompt, add_special_tokens=False)
    return [ids.im_start, *ids.system, *ids.newline, *body, ids.im_end, *ids.newline]


def user_turn_ids(ids: PromptIds, n_audio_tokens: int, image_tokens: list[int]) -> list[int]:
    """<|im_start|>user\\n[audio][images]<|im_end|>\\n<|im_start|>assistant\\n

    Audio first, then the frames: the streaming engine prefills the audio while the user is
    still speaking, and the frames sampled during the turn are only known at its end.
    """
    out = [ids.im_start, *ids.user, *ids.newline]
    if n_audio_tokens > 0:
        out += [ids.audio_start, *([ids.audio_pad] * n_audio_tokens), ids.audio_end]
    for n in image_tokens:
        out += [ids.vision_start, *([ids.image_pad] * n), ids.vision_end]
    out += [ids.im_end, *ids.newline, *assistant_start_ids(ids)]
    return out


def closing_ids(ids: PromptIds, reply_ids: Sequence[int]) -> list[int]:
    """An earlier assistant reply as history: its text, then <|im_end|>\\n. reply_ids are the
    reply's text tokens (no end token); the assistant header is already in user_turn_ids."""
    return [*reply_ids, ids.im_end, *ids.newline]


@dataclass(frozen=True)
class HistoryTurn:
    """An earlier exchange, for a multi-turn prompt: what the user sent and what was answered."""

    audio_16k: np.ndarray
    images: tuple[np.ndarray, ...]
    reply_ids: tuple[int, ...]


def assistant_start_ids(ids: PromptIds) -> list[int]:
    return [ids.im_start, *ids.assistant, *ids.newline]


def build_inputs(
    loaded: LoadedModel,
    audio_16k: np.ndarray,
    images: list[np.ndarray],
    system_prompt: str,
    history: Sequence[HistoryTurn] = (),
) -> dict[str, torch.Tensor]:
    """Everything generate()/the thinker needs for a chat prompt: system, the history turns,
    then a user turn with the audio and the images, ending in `<|im_start|>assistant\\n`."""
    turns = [*((t.audio_16k, list(t.images), list(t.reply_ids)) for t in history), (audio_16k, images, None)]
    audios = [np.asarray(a, dtype=np.float32) for a, _, _ in turns if len(a) > 0]
    all_images = [im for _, ims, _ in turns for im in ims]
    inputs: dict[str, torch.Tensor] = {}
    audio_tokens: list[int] = []
    if audios:
        inputs.update(encode_audio(loaded, audios))
        n_window = loaded.model.config.thinker_config.audio_config.n_window
        audio_tokens = [audio_token_count(int(n), n_window) for n in inputs["feature_attention_mask"].sum(-1)]
    image_tokens: list[int] = []
    if all_images:
        inputs.update(encode_images(loaded, all_images))
        image_tokens = image_token_counts(loaded, inputs["image_grid_thw"])

    prompt = system_turn_ids(loaded.ids, loaded.tokenizer, system_prompt)
    for audio, ims, reply in turns:
        n_audio = audio_tokens.pop(0) if len(audio) > 0 else 0
        prompt += user_turn_ids(loaded.ids, n_audio, [image_tokens.pop(0) for _ in ims])
        if reply is not None:
            prompt += closing_ids(loaded.ids, reply)
    input_ids = torch.tensor([prompt], dtype=torch.long, device=loaded.device)
    inputs["input_ids"] = input_ids
    inputs["attention_mask"] = torch.ones_like(input_ids)
    return inputs
