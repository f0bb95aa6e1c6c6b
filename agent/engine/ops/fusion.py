"""Concatenated projections for the engine's decoder path: one matmul where there were three.

At decode every matmul is a launch (and a CUDA-graph node) whatever its width, and at real size
the per-frame path is launch-bound (docs/engine-roofline.md). A Qwen3 attention block projects
the same normed hidden state three times (q, k, v), so `fuse_qkv` concatenates the three weights
once, row-wise, into `attn.qkv_weight` and re-points `q_proj`, `k_proj` and `v_proj` at views of
it: no second copy of the weights (the real thinker's are ~1 GB), and transformers' own forward
(the `generate()` reference) reads the very same numbers. `slots.attention` then makes q, k and
v with one `F.linear` and a split; the results equal the three projections up to float rounding
(a wider matmul may sum in another order).

It must run after the model reached its device and dtype: `Module.to` converts each parameter
on its own and would turn the views back into copies (still correct, no longer shared).
"""

from __future__ import annotations

import torch
from torch import nn

QKV = "qkv_weight"


def fuse_qkv(attn: nn.Module) -> bool:
    """Fuse one attention block's projections; False when it cannot (biases) or already is."""
    if hasattr(attn, QKV):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if any(p.bias is not None for p in projections):
        return False  # Qwen3 has none; a checkpoint with biases keeps the three matmuls
    with torch.no_grad():
        fused = torch.cat([p.weight for p in projections], dim=0)
        attn.register_buffer(QKV, fused, persistent=False)  # the state_dict keeps q/k/v keys
        row = 0
        for p in projections:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
            row += n
    attn.qkv_splits = tuple(p.weight.shape[0] for p in projections)
    return True


def fuse_decoder(body: nn.Module) -> int:
    """Fuse every attention block of a decoder (`body.layers[i].self_attn`); returns how many."""
    return sum(fuse_qkv(layer.self_attn) for layer in body.layers)


def qkv(attn: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections of `hidden` [..., hidden]: one matmul when fused, else three."""
    weight = getattr(attn, QKV, None)
    if weight is None:
        return attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
    return torch.nn.functional.linear(hidden, weight).split(attn.qkv_splits, dim=-1)
