"""Decode projections as reductions, so that the compiler can fuse the norm and residual into them.

At decode a projection is a matrix-vector product over a few rows: memory-bound, one launch
reading the weight once. As a library matmul (`F.linear` -> `extern_kernels.mm`) it is a wall
to inductor's fusion: the RMSNorm before it and the residual add after it stay kernels of their
own. Written as a broadcast product summed over the input dim, the same projection is a
reduction that inductor generates itself, and it fuses what surrounds it:
- the norm's weight into the loads, a residual add into the loads of the next reduction or the
  store (inductor picks),
- the norm's sum of squares into the same loop: RMSNorm(x) @ W.T equals
  ((x * g) @ W.T) * rsqrt(mean(x^2) + eps) (the row's scale factors out of the sum), and that
  mean is reduced over the same input dim, once per output: a second accumulator, not a kernel.
The SiLU-gate product before a down projection stays a kernel of its own: its two inputs are
two different outputs of the gate/up reduction, and inductor materialises it rather than
recompute it in the down projection's loop (seen in the generated code; two separate gate and
up reductions in one kernel did not change that).
The product is laid out [outputs, rows] so that every output's weight row is read once, shared
by all rows of the batch (at 1-16 rows, a launch-bound regime: docs/engine-roofline.md).

Only for compiled code (`torch.compiler.is_compiling()` where it is called): eagerly the
broadcast product would be materialised, [outputs, rows, inputs]. The results equal `F.linear`
of the normed input up to float rounding: sums in another order, and the normed input is not
rounded to the model dtype before the product, as transformers' RMSNorm does (fp32 throughout).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T as one reduction (fp32 accumulation) -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = (weight.unsqueeze(1) * rows.unsqueeze(0)).sum(-1)  # [N, rows]: weight streamed once
    return out.t().to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def normed_gemv(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) @ weight.T for a Qwen3 RMSNorm (`.weight`, `.variance_epsilon`), one reduction."""
    return normed_gemv_with_scale(x, norm, weight)[0]


def normed_gemv_with_scale(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`normed_gemv`, and the norm's per-row scale rsqrt(mean(x^2) + eps) [rows] (fp32), which
    the same loop computes: a later reduction over the same input can reuse it instead of
    accumulating the squares again (the MoE experts, `gathered_gemv`)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n = weight.shape[0]
    dot = (weight.unsqueeze(1) * (rows * norm.weight.float()).unsqueeze(0)).sum(-1)  # [N, rows]
    # The sum of squares per output, not per row: the same loop as `dot`, so no kernel of its
    # own (a [rows] reduction would be one); the weight read dominates what it recomputes.
    squares = (rows * rows).unsqueeze(0).expand(n, -1, -1).sum(-1)
    scale = torch.rsqrt(squares / rows.shape[-1] + norm.variance_epsilon)
    out = (dot * scale).t().to(x.dtype).reshape(*x.shape[:-1], n)
    return out, scale[0]


def gathered_gemv(x: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """x[t] @ picked[t, k].T for every row t and each of its K picks (or x[t, k], one input per
    pick): x [T, I] or [T, K, I], picked [T, K, N, I] (the picked experts' weights, as
    `weights[index]` of an [E, N, I] stack or a 4-bit stack's `pick`) -> [T, K, N] in fp32.

    A MoE block's experts at decode: compiled, the pick is an indirect load in the reduction's
    loop (and a 4-bit pick's unpacking is fused into it): no gathered copy, no grouping by expert."""
    rows = x.float()
    rows = rows[:, None, None, :] if rows.dim() == 2 else rows[:, :, None, :]
    return (picked * rows).sum(-1)


def check_norm(norm: nn.Module, weight: torch.Tensor) -> None:
    """`normed_gemv` reads the norm's weight and epsilon and applies them itself: refuse a norm
    whose own forward is not x * rsqrt(mean(x^2) + eps) * weight (tried on a few outputs)."""
    if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
        raise ValueError(f"fused projections need a Qwen3-style RMSNorm, got {type(norm).__name__}")
    with torch.no_grad():
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        want = F.linear(norm(x).float(), weight[:8].float())
        got = normed_gemv(x.float(), norm, weight[:8])  # eager here: 8 outputs, small
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
        raise ValueError(f"{type(norm).__name__} is not the RMSNorm fused projections assume")


def linear(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    return gemv(x, weight) if fused else F.linear(x, weight)


def normed_linear(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    return normed_gemv(x, norm, weight) if fused else F.linear(norm(x), weight)
