"""Group-wise 4-bit weights: how a float matrix becomes nibbles, scales and offsets, and back.

A weight [..., N, K] (one row per output, K inputs; leading dims are experts) is cut into groups
of `group` consecutive inputs along each row; each group keeps its own affine map

    w ~= q * scale + low,   q in 0..15,   scale = (max - min) / 15,   low = min

(round to nearest: the "RTN" scheme gpt-fast and torchao's int4 weight-only use). Two q values
share a byte. The byte layout is by halves, not neighbours: byte j of a row holds input j in its
low nibble and input j + K/2 in its high one, so unpacking is two elementwise ops and one
concatenation along the row, which inductor folds into the loads of the reduction that reads the
weight (agent/engine/ops/gemv.py): a compiled decode step never writes the float weight out.

Bytes: K/2 for the nibbles plus two model-dtype numbers per group, i.e. 0.5 + 4/group bytes a
weight in bf16 (0.53 at group 128, against 2): docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LEVELS = 15  # the largest 4-bit code
GROUPS = (128, 64, 32)  # tried in this order: the first that divides a row's inputs is used
ROW_CHUNK = 4096  # rows quantized at once (bounds the float temporaries for an expert stack)


def group_for(inputs: int, preferred: int = 128) -> int | None:
    """The group size for rows of `inputs` weights: `preferred` if it divides them, else the
    next smaller of GROUPS that does; None when none does (the layer stays unquantized)."""
    for group in (preferred, *(g for g in GROUPS if g < preferred)):
        if inputs % group == 0 and inputs % 2 == 0:
            return group
    return None


@dataclass(frozen=True)
class Packed:
    """A quantized weight: nibbles [..., N, K/2] (uint8), scale and low [..., N, K/group]."""

    nibbles: Tensor
    scale: Tensor
    low: Tensor

    @property
    def group(self) -> int:
        return self.nibbles.shape[-1] * 2 // self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.nibbles, self.scale, self.low))


def quantize(weight: Tensor, group: int, dtype: torch.dtype | None = None) -> Packed:
    """`weight` [..., N, K] -> Packed, scale and low in `dtype` (the weight's by default).
    Works on the meta device (shapes only). Rows are done ROW_CHUNK at a time so that a stack
    of experts never has a float copy of itself in flight."""
    dtype = dtype or weight.dtype
    *lead, n, k = weight.shape
    if k % group or k % 2:
        raise ValueError(f"{k} inputs do not split into groups of {group}")
    rows = weight.reshape(-1, k)
    nibbles = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows.shape[0], k // group, dtype=dtype, device=weight.device)
    low = torch.empty_like(scale)
    if weight.device.type != "meta":
        for start in range(0, rows.shape[0], ROW_CHUNK):
            part = slice(start, start + ROW_CHUNK)
            nibbles[part], scale[part], low[part] = _quantize_rows(rows[part], group, dtype)
    shape = (*lead, n)
    return Packed(nibbles.view(*shape, k // 2), scale.view(*shape, -1), low.view(*shape, -1))


def _quantize_rows(rows: Tensor, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    w = rows.float().view(rows.shape[0], -1, group)
    lo, hi = w.amin(-1), w.amax(-1)
    # The stored (rounded) scale and low are the ones the codes are chosen against, so the
    # dequantized weight is the nearest grid point of the grid that is really used.
    scale = ((hi - lo) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)
    low = lo.to(dtype)
    q = torch.round((w - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, LEVELS)
    q = q.view(rows.shape[0], -1).to(torch.uint8)
    half = q.shape[-1] // 2
    return q[:, :half] | (q[:, half:] << 4), scale, low


def dequantize(nibbles: Tensor, scale: Tensor, low: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The float weight [..., N, K] of a packed one (any leading dims: an expert pick, a stack).
    Elementwise and one concatenation: compiled, it is fused into whatever reads it."""
    dtype = dtype or scale.dtype
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).to(dtype)
    k = q.shape[-1]
    groups = scale.shape[-1]
    grouped = q.view(*q.shape[:-1], groups, k // groups)
    w = grouped * scale.to(dtype).unsqueeze(-1) + low.to(dtype).unsqueeze(-1)
    return w.view(*q.shape)


def relative_error(weight: Tensor, packed: Packed) -> float:
    """||w - dequant(w)|| / ||w|| over the whole tensor (fp32)."""
    w = weight.float()
    back = dequantize(packed.nibbles, packed.scale, packed.low, torch.float32)
    return float(torch.linalg.vector_norm(w - back) / torch.linalg.vector_norm(w).clamp_min(1e-30))
