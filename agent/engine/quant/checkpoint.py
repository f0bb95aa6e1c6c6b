"""A quantized checkpoint loaded straight onto the device, and the readers both sides share.

A quantized checkpoint (written by agent/engine/quant/convert.py, `omni-agent quantize`) is a
folder like the float one whose safetensors hold the *engine's* tensors: the live model's
state_dict keys after transformers' load-time conversion (per-expert hub keys stacked into
`experts.gate_up_proj`), every quantized module as `<name>_nibbles/_scale/_low`, the rest as in
the source. config.json carries `omni_agent_quantization` (the QuantScheme), which is how
`load_model` knows to build the 4-bit structure before reading a byte.

Loading builds the structure with every parameter on the meta device and the non-persistent
buffers (RoPE frequencies) computed as the model's __init__ computes them, swaps in the 4-bit
modules (still meta), then assigns each tensor read from the shards, already on the device
(`safe_open(device=...)`): no float copy of a quantized layer exists at any point.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agent.engine.quant.apply import CONFIG_KEY, QuantScheme, quantize_model

log = logging.getLogger(__name__)

GiB = 2**30
INDEX = "model.safetensors.index.json"
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device; buffers are made for real
    (accelerate's init_empty_weights(include_buffers=False), without the dependency)."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config: Any, dtype: torch.dtype, attn_impl: str = "sdpa") -> nn.Module:
    """The composite model with parameters on meta and real non-persistent buffers."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with params_on_meta():
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation=attn_impl)
    return model


class SourceShards:
    """A safetensors checkpoint read tensor by tensor (memory-mapped, one open file at a time)."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        self.folder = folder
        self.device = device
        index = folder / INDEX
        if index.exists():
            self.where = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder} has no safetensors")
            self.where = {}
            for f in files:
                with safe_open(str(f), "pt") as s:
                    self.where.update({k: f.name for k in s.keys()})

    def get(self, key: str) -> Tensor:
        from safetensors import safe_open

        if key not in self.where:
            raise KeyError(f"{key} is not in the checkpoint at {self.folder}")
        with safe_open(str(self.folder / self.where[key]), "pt", device=self.device) as s:
            return s.get_tensor(key)

    def dtype(self) -> torch.dtype:
        """The float type of the checkpoint's weights, read from a shard's header (reading the
        first weight itself would load an embedding table, ~1 GiB at real size)."""
        from safetensors import safe_open

        key = next(k for k in self.where if k.endswith(".weight"))
        with safe_open(str(self.folder / self.where[key]), "pt", device="cpu") as s:
            name = s.get_slice(key).get_dtype()
        return _SAFETENSORS_DTYPES[name]


# safetensors' header names for the float types a checkpoint's weights come in.
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def load_quantized(
    path: str | Path, config: Any, dtype: torch.dtype, device: torch.device, attn_impl: str
) -> nn.Module:
    """A quantized checkpoint (quantize_checkpoint's output) loaded onto `device`."""
    scheme = QuantScheme.of_config(config)
    if scheme is None:
        raise ValueError(f"{path} is not a quantized checkpoint (no {CONFIG_KEY} in config.json)")
    model = build_skeleton(config, dtype, attn_impl)
    quantize_model(model, scheme)
    source = SourceShards(Path(path), device=str(device))
    expected = set(model.state_dict())
    found = set(source.where)
    if expected != found:
        missing, extra = sorted(expected - found)[:5], sorted(found - expected)[:5]
        raise ValueError(f"{path} does not match its config's model: missing {missing}, unexpected {extra}")
    by_file: dict[str, list[str]] = {}
    for key, file in source.where.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        from safetensors import safe_open

        with safe_open(str(Path(path) / file), "pt", device=str(device)) as s:
            state = {k: s.get_tensor(k) for k in keys}
        _cast_floats(state, model, dtype)
        model.load_state_dict(state, strict=False, assign=True)
        del state
    model.to(device)  # the non-persistent buffers (made on the host by the skeleton)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise ValueError(f"{path}: tensors were not loaded: {left[:5]}")
    if (Path(path) / "generation_config.json").exists():  # as from_pretrained attaches it (generate() reads it)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _cast_floats(state: dict[str, Tensor], model: nn.Module, dtype: torch.dtype) -> None:
    """Float tensors in the dtype the skeleton has for them (the one asked for; --dtype)."""
    current = model.state_dict(keep_vars=True)
    for key, tensor in state.items():
        if tensor.is_floating_point() and current[key].is_floating_point() and tensor.dtype != current[key].dtype:
            state[key] = tensor.to(current[key].dtype)
