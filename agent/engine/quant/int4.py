"""Group-wise 4-bit weights: how a float matrix becomes nibbles, scales and offsets, and back.

A weight [..., N, K] (one row per output, K inputs; leading dims are experts) is cut into groups
of `group` consecutive inputs along each row; each group keeps its own affine map

    w ~= q * scale + low,   q in 0..15,   scale = (max - min) / 15,   low = min

(round to nearest, the "RTN" scheme of gpt-fast and torchao's int4 weight-only, with the group's
range shrunk where that lowers its squared error: SHRINKS). Two q values share a byte. The byte
layout is by halves, not neighbours: byte j of a row holds input j in its
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
# Tried in this order: the first that divides a row's inputs is used. 16 exists for the vision
# blocks' second MLP projection (4,304 inputs = 16 x 269, 0.25 GiB in bf16): at 0.75 bytes a
# weight it still keeps 62 % off, where leaving it float kept none.
GROUPS = (128, 64, 32, 16)
ROW_CHUNK = 4096  # rows quantized at once (bounds the float temporaries for an expert stack)


def group_for(inputs: int, preferred: int = 128, smallest: int = GROUPS[-1]) -> int | None:
    """The group size for rows of `inputs` weights: `preferred` if it divides them, else the
    next smaller of GROUPS (down to `smallest`) that does; None when none does (the layer stays
    unquantized)."""
    for group in (preferred, *(g for g in GROUPS if smallest <= g < preferred)):
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


# Range shrink factors tried per group (each group keeps the one with the least squared error):
# clipping a group's extremes a little makes the grid finer for the many weights in between, and
# for bell-shaped weights that wins (the search of AWQ's and GPTQ's RTN baselines).
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _quantize_rows(rows: Tensor, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    # Only each group's best grid (scale, low: a number per group) is kept across the shrinks and
    # its codes are made once at the end, in place where a temporary is not needed: the codes of
    # every trial were kept and merged before, and that took 1.6x the time for the same bits.
    w = rows.float().view(rows.shape[0], -1, group)
    lo, hi = w.amin(-1), w.amax(-1)
    mid = (lo + hi) / 2
    best = None
    for shrink in SHRINKS:
        scale, low = _grid(mid + (lo - mid) * shrink, mid + (hi - mid) * shrink, dtype)
        err = _codes(w, scale, low).mul_(scale.float().unsqueeze(-1)).add_(low.float().unsqueeze(-1))
        err = err.sub_(w).square_().sum(-1)
        if best is None:
            best = [scale, low, err]
            continue
        better = err < best[2]
        best[0] = torch.where(better, scale, best[0])
        best[1] = torch.where(better, low, best[1])
        best[2] = torch.where(better, err, best[2])
    scale, low, _ = best
    q = _codes(w, scale, low).view(rows.shape[0], -1).to(torch.uint8)
    half = q.shape[-1] // 2
    return q[:, :half] | (q[:, half:] << 4), scale, low


def _grid(lo: Tensor, hi: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The grid from lo to hi (per group) as its scale and low, rounded to `dtype` first: the
    codes are chosen against the stored numbers, so the dequantized weight is the nearest point
    of the grid that is really used."""
    tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else torch.finfo(torch.float32).tiny
    return ((hi - lo) / LEVELS).clamp_min(tiny).to(dtype), lo.to(dtype)


def _codes(w: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """Codes (float) of w [rows, groups, group] on the grid of each group."""
    return torch.round((w - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, LEVELS)


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
