"""Concatenated projections for the engine's decoder path: one matmul where there were three.

At decode every matmul is a launch (and a CUDA-graph node) whatever its width, and at real size
the per-frame path is launch-bound (docs/engine-roofline.md). A Qwen3 attention block projects
the same normed hidden state three times (q, k, v), so `fuse_qkv` concatenates the three weights
once, row-wise, into `attn.qkv_weight` and re-points `q_proj`, `k_proj` and `v_proj` at views of
it: no second copy of the weights (the real thinker's are ~1 GB), and transformers' own forward
(the `generate()` reference) reads the very same numbers. `slots.attention` then makes q, k and
v with one `F.linear` and a split; the results equal the three projections up to float rounding
(a wider matmul may sum in another order).

A 4-bit model (agent/engine/quant) is fused the same way: the three projections' nibbles, scales
and lows are concatenated row-wise into one `Int4Linear` (`attn.qkv_int4`, buffers not
persistent) and the projections' buffers become views of it; `qkv_weight(attn)` gives the float
weight either way (unpacked where it is read).

It must run after the model reached its device and dtype: `Module.to` converts each parameter
on its own and would turn the views back into copies (still correct, no longer shared).
"""

from __future__ import annotations

import torch
from torch import nn

from agent.engine.quant.int4 import Packed
from agent.engine.quant.modules import Int4Linear

QKV = "qkv_weight"
QKV_INT4 = "qkv_int4"
PARTS = ("weight_nibbles", "weight_scale", "weight_low")


def fuse_qkv(attn: nn.Module) -> bool:
    """Fuse one attention block's projections; False when it cannot (biases) or already is."""
    if is_fused(attn):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if any(p.bias is not None for p in projections):
        return False  # Qwen3 has none; a checkpoint with biases keeps the three matmuls
    if all(isinstance(p, Int4Linear) for p in projections):
        _fuse_int4(attn, projections)
    elif any(isinstance(p, Int4Linear) for p in projections):
        return False  # mixed precision: three matmuls
    else:
        with torch.no_grad():
            fused = torch.cat([p.weight for p in projections], dim=0)
            attn.register_buffer(QKV, fused, persistent=False)  # the state_dict keeps q/k/v keys
            row = 0
            for p in projections:
                n = p.weight.shape[0]
                p.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
                row += n
    attn.qkv_splits = tuple(p.out_features for p in projections)
    return True


def _fuse_int4(attn: nn.Module, projections: tuple[nn.Module, ...]) -> None:
    if len({p.packed.group for p in projections}) != 1:
        raise ValueError("q/k/v quantized with different group sizes")
    with torch.no_grad():
        parts = [torch.cat([getattr(p, part) for p in projections], dim=0) for part in PARTS]
        attn.add_module(QKV_INT4, Int4Linear(Packed(*parts), persistent=False))
        row = 0
        for p in projections:
            n = p.out_features
            for part, fused in zip(PARTS, parts):
                setattr(p, part, fused[row : row + n])
            row += n


def is_fused(attn: nn.Module) -> bool:
    return hasattr(attn, QKV) or hasattr(attn, QKV_INT4)


def qkv_weight(attn: nn.Module) -> torch.Tensor:
    """The fused [q; k; v] float weight (a 4-bit one unpacked where it is read)."""
    fused = getattr(attn, QKV_INT4, None)
    return fused.weight if fused is not None else getattr(attn, QKV)


def fuse_decoder(body: nn.Module) -> int:
    """Fuse every attention block of a decoder (`body.layers[i].self_attn`); returns how many."""
    return sum(fuse_qkv(layer.self_attn) for layer in body.layers)


def qkv(attn: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections of `hidden` [..., hidden]: one matmul when fused, else three."""
    if not is_fused(attn):
        return attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
    return torch.nn.functional.linear(hidden, qkv_weight(attn)).split(attn.qkv_splits, dim=-1)
