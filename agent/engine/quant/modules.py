"""The quantized stand-ins for a linear layer, an embedding table and a stack of MoE experts.

Each keeps the packed weight as buffers (state_dict keys `<module>.<name>_nibbles`, `_scale`,
`_low`: what a quantized checkpoint stores, agent/engine/quant/checkpoint.py) and present the
float weight under the attribute the original had (`weight`; `gate_up_proj`, `down_proj`),
computed from the buffers on each read. So transformers' own forwards (the `generate()`
reference) and the engine's streaming paths read the very same numbers, and code that only reads
a weight needs no change: eagerly the read materialises the float weight for that one call;
compiled, the unpacking is fused into the reduction that consumes it (ops/gemv.py).

Where reading the whole float weight would be wasteful, the modules give narrower reads:
`Int4Experts.pick` dequantizes only the picked experts (a decode step's gathered reductions,
ops/moe.py), and `forward` dequantizes one hit expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from agent.engine.quant.int4 import Packed, dequantize, quantize

# A prefill's grouped matmuls need an expert stack as float weights (grouped_mm reads no 4-bit
# stack). Unpacked whole, the thinker's gate/up stack is 0.75 GiB of bf16 at real size, memory a
# 24 GiB card does not have to spare; unpacked in slices of its output rows, one slice alive at a
# time, it is at most this much (the memory plan counts the same number). Each slice is one more
# grouped_mm reading the same activations: a few MB, against the slice's hundreds.
UNPACK_SLICE_BYTES = 256 * 2**20


def row_slices(rows: int, bytes_per_row: int, budget: int | None = None) -> list[tuple[int, int]]:
    """[start, end) row ranges, as even as can be, each at most `budget` bytes (one row at least;
    default UNPACK_SLICE_BYTES, read when called)."""
    budget = budget or UNPACK_SLICE_BYTES
    most = max(1, budget // bytes_per_row)  # rows a slice may hold
    count = -(-rows // most)  # so that no even slice passes `most` rows
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def _register(module: nn.Module, name: str, packed: Packed, persistent: bool = True) -> None:
    module.register_buffer(f"{name}_nibbles", packed.nibbles, persistent=persistent)
    module.register_buffer(f"{name}_scale", packed.scale, persistent=persistent)
    module.register_buffer(f"{name}_low", packed.low, persistent=persistent)


def _packed(module: nn.Module, name: str) -> Packed:
    return Packed(getattr(module, f"{name}_nibbles"), getattr(module, f"{name}_scale"), getattr(module, f"{name}_low"))


def _dequantized(module: nn.Module, name: str, index: Tensor | None = None) -> Tensor:
    """The float weight `name` from the module's buffers (read by attribute, no Packed built:
    a compiled step traces plain buffer reads), of the experts in `index` when given."""
    nibbles, scale, low = (getattr(module, f"{name}_{part}") for part in ("nibbles", "scale", "low"))
    if index is not None:
        nibbles, scale, low = nibbles[index], scale[index], low[index]
    return dequantize(nibbles, scale, low)


class Int4Linear(nn.Module):
    """An `nn.Linear` with 4-bit group-wise weights (agent/engine/quant/int4.py); a bias, if any,
    stays a float parameter."""

    def __init__(self, packed: Packed, bias: Tensor | None = None, persistent: bool = True) -> None:
        super().__init__()
        self.out_features = packed.nibbles.shape[0]
        self.in_features = packed.nibbles.shape[1] * 2
        _register(self, "weight", packed, persistent)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int) -> "Int4Linear":
        with torch.no_grad():
            return cls(quantize(linear.weight, group), linear.bias)

    @property
    def packed(self) -> Packed:
        return _packed(self, "weight")

    @property
    def weight(self) -> Tensor:
        """The float weight [out, in], in the model's dtype (the scales' dtype)."""
        return _dequantized(self, "weight")

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, group={self.packed.group}"
        )


class Int4Embedding(nn.Module):
    """An `nn.Embedding` with 4-bit group-wise rows: a lookup gathers the rows' nibbles and
    scales and unpacks only those (a step reads a few rows of a 0.6 GiB table)."""

    def __init__(self, packed: Packed, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings = packed.nibbles.shape[0]
        self.embedding_dim = packed.nibbles.shape[1] * 2
        self.padding_idx = padding_idx
        _register(self, "weight", packed)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: int) -> "Int4Embedding":
        with torch.no_grad():
            return cls(quantize(embedding.weight, group), embedding.padding_idx)

    @property
    def packed(self) -> Packed:
        return _packed(self, "weight")

    @property
    def weight(self) -> Tensor:
        """The whole float table (what transformers reads for its dtype and device; a lookup
        never makes it)."""
        return _dequantized(self, "weight")

    def forward(self, ids: Tensor) -> Tensor:
        return _dequantized(self, "weight", ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group={self.packed.group}"


class Int4Experts(nn.Module):
    """transformers' `Qwen3OmniMoe{Thinker,Talker}TextExperts` with 4-bit expert stacks:
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] become packed buffers, same forward."""

    def __init__(self, gate_up: Packed, down: Packed, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = gate_up.nibbles.shape[0]
        self.hidden_dim = gate_up.nibbles.shape[-1] * 2
        self.intermediate_dim = gate_up.nibbles.shape[1] // 2
        self.act_fn = act_fn
        _register(self, "gate_up_proj", gate_up)
        _register(self, "down_proj", down)

    @classmethod
    def from_experts(cls, experts: nn.Module, group_gate_up: int, group_down: int) -> "Int4Experts":
        with torch.no_grad():
            return cls(
                quantize(experts.gate_up_proj, group_gate_up), quantize(experts.down_proj, group_down), experts.act_fn
            )

    @property
    def gate_up_proj(self) -> Tensor:
        """Every expert's float gate/up weight [E, 2I, H] (a prefill's grouped matmul reads all)."""
        return _dequantized(self, "gate_up_proj")

    @property
    def down_proj(self) -> Tensor:
        return _dequantized(self, "down_proj")

    def unpacked_slices(self, name: str, budget: int | None = None) -> list[Callable[[], Tensor]]:
        """The float stack `name` [E, out, in] as functions each unpacking a slice of its output
        rows [E, out_i, in] when called (concatenated along out, they are the whole stack)."""
        nibbles = getattr(self, f"{name}_nibbles")
        experts, rows, half = nibbles.shape
        size = getattr(self, f"{name}_scale").element_size()
        return [
            partial(self._rows, name, start, end) for start, end in row_slices(rows, experts * half * 2 * size, budget)
        ]

    def largest_slice_bytes(self, budget: int | None = None) -> int:
        """The most float bytes `unpacked_slices` holds at once, over both stacks."""
        most = 0
        for name in ("gate_up_proj", "down_proj"):
            experts, rows, half = getattr(self, f"{name}_nibbles").shape
            per_row = experts * half * 2 * getattr(self, f"{name}_scale").element_size()
            most = max(most, max(end - start for start, end in row_slices(rows, per_row, budget)) * per_row)
        return most

    def _rows(self, name: str, start: int, end: int) -> Tensor:
        nibbles, scale, low = (getattr(self, f"{name}_{part}")[:, start:end] for part in ("nibbles", "scale", "low"))
        return dequantize(nibbles, scale, low)

    def group_of(self, name: str) -> int:
        return _packed(self, name).group

    def pick(self, name: str, index: Tensor) -> Tensor:
        """The float weights of the experts in `index` (any shape) -> [*index.shape, out, in]:
        only the picked experts' nibbles are read (gathered), then unpacked."""
        return _dequantized(self, name, index)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """transformers' loop over the experts a batch hit, one expert dequantized at a time."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # One class more than experts, as transformers does: an index equal to num_experts
            # (a padded pick) hits no expert.
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit:
            expert = expert[0]
            if expert == self.num_experts:
                continue
            pos, token = torch.where(mask[expert])
            gate, up = F.linear(hidden_states[token], self.pick("gate_up_proj", expert)).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.pick("down_proj", expert))
            y = y * top_k_weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def expert_weights(experts: nn.Module, name: str, index: Tensor) -> Tensor:
    """The float weights `name` of the picked experts, for dense and 4-bit expert stacks alike."""
    if isinstance(experts, Int4Experts):
        return experts.pick(name, index)
    return getattr(experts, name)[index]


def concat_rows(linears: tuple[nn.Module, ...]) -> Tensor | Int4Linear:
    """The linears' weights stacked row-wise into one (a copy): a float tensor, or for 4-bit
    linears one non-persistent `Int4Linear` (rows are quantized independently, so concatenating
    the packed rows is exact)."""
    if all(isinstance(m, Int4Linear) for m in linears):
        if len({m.packed.group for m in linears}) != 1:
            raise ValueError("linears quantized with different group sizes")
        parts = (torch.cat([getattr(m, f"weight_{p}") for m in linears], dim=0) for p in ("nibbles", "scale", "low"))
        if any(m.bias is not None for m in linears):
            raise ValueError("concatenated linears are bias-free")
        return Int4Linear(Packed(*parts), persistent=False)
    return torch.cat([m.weight for m in linears], dim=0)


def float_weight(weight: Tensor | Int4Linear) -> Tensor:
    """A weight from `concat_rows` as a float tensor (a 4-bit one unpacked where it is read)."""
    return weight.weight if isinstance(weight, Int4Linear) else weight
