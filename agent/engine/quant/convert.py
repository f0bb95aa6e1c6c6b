"""Quantize a checkpoint once: `omni-agent quantize SRC DST` (the format: quant/checkpoint.py).

Quantizing streams: the model's structure is built on the meta device, and each live tensor is
read from the source's memory-mapped shards, converted (for a stack of experts: one expert at a
time, quantized as it is read) and appended to the current output shard, which is written out
once it reaches `shard_bytes`. Host memory stays at one source tensor (the largest is the
thinker's 0.6 GiB embedding) plus one output shard, whatever the checkpoint's size.

Which hub keys make which live tensor is asked of transformers itself (`revert_weight_conversion`,
the function `save_pretrained` uses), one live key at a time: a rename, or for an expert stack
the per-expert `gate_proj`/`up_proj` (concatenated, gate first, as the forward's `chunk(2)`
splits them) or `down_proj` keys.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from agent.engine.quant.apply import CONFIG_KEY, QuantReport, QuantScheme, quantize_model
from agent.engine.quant.checkpoint import INDEX, SourceShards, build_skeleton
from agent.engine.quant.int4 import Packed, quantize
from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear

GiB = 2**30
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ShardWriter:
    """Appends tensors and writes a shard once `shard_bytes` are held; then the index."""

    def __init__(self, folder: Path, shard_bytes: int) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, Tensor] = {}
        self.held = 0
        self.files: list[dict[str, Tensor] | str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, key: str, tensor: Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        self.pending[key] = tensor
        self.held += tensor.numel() * tensor.element_size()
        self.total += tensor.numel() * tensor.element_size()
        if self.held >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in self.pending})
        self.files.append(name)
        self.pending, self.held = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2))


@dataclass(frozen=True)
class QuantizeSummary:
    report: QuantReport
    source_bytes: int  # the live float model's parameters and buffers
    written_bytes: int  # the quantized checkpoint's tensors
    shards: int


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    scheme: QuantScheme = QuantScheme(),
    device: str = "cpu",
    shard_bytes: int = 2 * GiB,
) -> QuantizeSummary:
    """Write the 4-bit checkpoint of `src` (a float checkpoint folder) into `dst` (see module doc)."""
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from agent.engine.checkpoints.model import complete_config

    src, dst = Path(src), Path(dst)
    config = AutoConfig.from_pretrained(src)
    if QuantScheme.of_config(config) is not None:
        raise ValueError(f"{src} is already quantized")
    complete_config(config)
    source = SourceShards(src, device=device)
    dtype = source.dtype()
    float_model = build_skeleton(config, dtype)
    float_state = float_model.state_dict()
    source_bytes = sum(t.numel() * t.element_size() for t in float_state.values())
    quant_model = build_skeleton(config, dtype)
    report = quantize_model(quant_model, scheme)

    def live(key: str) -> Tensor:
        """The live tensor `key` of the float model, assembled from the source's keys."""
        parts = revert_weight_conversion(float_model, {key: float_state[key]})
        if len(parts) == 1:
            (name,) = parts
            return source.get(name)
        raise ValueError(f"{key}: {len(parts)} checkpoint tensors, not an expert stack")

    def packed_experts(key: str, group: int) -> Packed:
        """An expert stack quantized one expert at a time, each into its slot of the stack: a
        list of per-expert pieces stacked at the end held the packed stack twice, and its
        small long-lived pieces, strewn among each expert's freed temporaries, kept the heap
        from reusing them (glibc then held ~4x the live bytes at the peak)."""
        parts = revert_weight_conversion(float_model, {key: float_state[key]})
        by_expert: dict[int, dict[str, str]] = {}
        for name in parts:
            match = EXPERT_KEY.search(name)
            if match is None:
                raise ValueError(f"{key}: unexpected checkpoint key {name}")
            by_expert.setdefault(int(match.group(1)), {})[match.group(2)] = name
        stack: Packed | None = None
        for slot, e in enumerate(sorted(by_expert)):
            names = by_expert[e]
            if key.endswith("gate_up_proj"):
                w = torch.cat([source.get(names["gate_proj"]), source.get(names["up_proj"])], dim=0)
            else:
                w = source.get(names["down_proj"])
            piece = quantize(w.to(dtype), group)
            del w
            if stack is None:
                stack = Packed(*(torch.empty(len(by_expert), *t.shape, dtype=t.dtype) for t in _fields(piece)))
            for into, part in zip(_fields(stack), _fields(piece)):
                into[slot].copy_(part)
        if stack is None:
            raise ValueError(f"{key}: no experts in the checkpoint")
        return stack

    dst.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(dst, shard_bytes)
    written: set[str] = set()
    for owner, module in quant_model.named_modules():
        if isinstance(module, (Int4Linear, Int4Embedding)):
            packed = quantize(live(f"{owner}.weight").to(dtype), module.packed.group)
            written |= _add_packed(writer, owner, "weight", packed)
        elif isinstance(module, Int4Experts):
            for name in ("gate_up_proj", "down_proj"):
                written |= _add_packed(writer, owner, name, packed_experts(f"{owner}.{name}", module.group_of(name)))
    for key in quant_model.state_dict():
        if key not in written:
            writer.add(key, live(key))
    writer.close()
    _copy_side_files(src, dst, scheme)
    return QuantizeSummary(report, source_bytes, writer.total, len(writer.files))


def _fields(packed: Packed) -> tuple[Tensor, Tensor, Tensor]:
    return packed.nibbles, packed.scale, packed.low


def _add_packed(writer: ShardWriter, owner: str, name: str, packed: Packed) -> set[str]:
    keys = {f"{owner}.{name}_{part}": getattr(packed, part) for part in ("nibbles", "scale", "low")}
    for key, tensor in keys.items():
        writer.add(key, tensor)
    return set(keys)


def _copy_side_files(src: Path, dst: Path, scheme: QuantScheme) -> None:
    """Everything but the weights, and config.json with the scheme added (its other fields as the
    source wrote them, so the release's form is kept)."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config[CONFIG_KEY] = scheme.to_json()
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
