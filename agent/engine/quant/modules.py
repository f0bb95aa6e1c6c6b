"""The quantized stand-ins for a linear layer and a stack of MoE experts.

Both keep the packed weight as buffers (state_dict keys `<module>.<name>_nibbles`, `_scale`,
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

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from agent.engine.quant.int4 import Packed, dequantize, quantize


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
