"""Fused MoE experts for Qwen3-Omni's thinker and talker sparse blocks.

transformers 5.24 gives both blocks (`Qwen3OmniMoeThinkerTextSparseMoeBlock`,
`Qwen3OmniMoeTalkerTextSparseMoeBlock`) experts stored as 3-D tensors (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) whose forward is picked at run time from `config._experts_implementation`:
"grouped_mm" when the platform allows it, else the Python loop over hit experts ("eager"), which
syncs with the host (`nonzero`, a loop over a tensor) and so can never sit in a CUDA graph. The
dispatch is silent, so a GPU or torch change could put the loop back in the decode step.

`fuse_moe(model)` pins the choice instead: every sparse block is replaced by `FusedSparseMoeBlock`,
which reuses the block's own router, experts, shared expert and shared-expert gate modules (same
Parameters, no copies, same state_dict keys; the router runs unchanged so routing is identical)
and computes all routed experts at once with one of two graph-safe paths (fixed shapes, no host
syncs):

- "grouped": sort the (token, expert) pairs by expert, offsets by `searchsorted`, then one
  `grouped_mm` per projection over the expert weight tensors as they are. Reads each selected
  expert once. On CPU, decode is memory-bound: for 1 token it is on par with the loop
  (0.9-1.3x across runs, real talker/thinker expert sizes, 1 thread) and 1.1-1.2x for 2-8 tokens;
  gathering weights instead is 3-10x slower. The gain is on GPU: no host sync, so capturable.
- "gather": `index_select` the selected experts' weight slices per (token, expert) pair and `bmm`.
  Copies the selected weights (≈3x the memory traffic), so it is only the fallback where
  `grouped_mm` has no kernel (e.g. CUDA below sm80 or non-bf16 dtypes on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Method = Literal["auto", "grouped", "gather"]
Activation = Callable[[Tensor], Tensor]


def _sparse_block_classes() -> tuple[type[nn.Module], ...]:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    return (m.Qwen3OmniMoeThinkerTextSparseMoeBlock, m.Qwen3OmniMoeTalkerTextSparseMoeBlock)


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(weight: Tensor) -> bool:
    """Whether `grouped_mm` has a kernel for these expert weights (device and dtype)."""
    if _grouped_mm_fn() is None:
        return False
    if weight.device.type == "cpu":
        return True
    if weight.device.type == "cuda":
        # The CUDA kernels (CUTLASS grouped GEMM) are bf16-only and need sm80+.
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return False


def resolve_method(method: Method, weight: Tensor) -> Literal["grouped", "gather"]:
    if method == "auto":
        return "grouped" if grouped_mm_supported(weight) else "gather"
    if method not in ("grouped", "gather"):
        raise ValueError(f"unknown MoE method {method!r}")
    return method


def experts_grouped(
    hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor, act: Activation,
    expert_ids: Tensor | None = None,
) -> Tensor:
    """All routed experts via grouped matmuls over the unmodified `[E, out, in]` weights.

    hidden [T, H], top_k_index/top_k_weights [T, K] -> [T, H]. `expert_ids`: arange(E) made
    once by the caller (else here: a kernel per call and layer in a compiled step).
    """
    num_tokens, k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    # Offsets from the sorted ids with a fixed-size search: no bincount (its output size
    # depends on the data, a host sync that breaks graph capture).
    experts = expert_ids if expert_ids is not None else torch.arange(num_experts, device=flat.device)
    experts = experts.to(sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    x = hidden.index_select(0, perm // k).to(gate_up_proj.dtype)
    gate_up = _grouped_matmul(x, gate_up_proj.transpose(-2, -1), offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = _grouped_matmul(act(gate) * up, down_proj.transpose(-2, -1), offs)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    # Undo the sort (perm is a permutation: index_copy is deterministic) and sum the k experts.
    unsorted = torch.empty_like(y).index_copy_(0, perm, y)
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _grouped_matmul(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """x [S, in] sorted by expert, weight [E, in, out] -> [S, out]."""
    if torch.compiler.is_compiling() and weight.dtype != torch.bfloat16:
        # grouped_mm's meta kernel is bf16-only, so dynamo cannot trace it in fp32 (CPU tests,
        # a compiled CPU decode step). transformers registers an opaque op for exactly this case
        # (a loop over experts with one host sync: CPU only; CUDA non-bf16 resolves to "gather").
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offs)
    return _grouped_mm_fn()(x, weight, offs=offs)


def experts_gathered(
    hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor, act: Activation
) -> Tensor:
    """All routed experts via per-pair weight gathers and batched matmuls (graph-safe anywhere)."""
    num_tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    x = hidden.to(gate_up_proj.dtype).repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*K, H, 1]
    gate_up = torch.bmm(gate_up_proj.index_select(0, flat), x).squeeze(-1)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm(down_proj.index_select(0, flat), (act(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return y.view(num_tokens, k, -1).sum(dim=1).to(hidden.dtype)


class FusedSparseMoeBlock(nn.Module):
    """Drop-in forward for a thinker or talker sparse MoE block, sharing its modules.

    Submodule names match the original (`gate`, `experts`, and for the talker `shared_expert`,
    `shared_expert_gate`) so state_dict keys and output-recorder hooks on the router still work.
    """

    def __init__(self, block: nn.Module, method: Method = "auto") -> None:
        super().__init__()
        # Re-register the block's own children in its order: same modules, same state_dict.
        for name, child in block.named_children():
            self.add_module(name, child)
        self.has_shared_expert = hasattr(block, "shared_expert")
        self.method = resolve_method(method, self.experts.gate_up_proj)
        weights = self.experts.gate_up_proj
        # Not persistent: the state_dict keeps the original block's keys.
        self.register_buffer("expert_ids", torch.arange(weights.shape[0], device=weights.device), persistent=False)
        self.source_class = type(block).__name__

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seq, hidden_dim = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden_dim)
        # Compiled: the router's own forward, without the output-capturing hooks transformers
        # registers on it once generate() has run (they read a ContextVar, which dynamo cannot
        # trace; they only record router logits, which the engine never asks for).
        router = self.gate.forward if torch.compiler.is_compiling() else self.gate
        _, routing_weights, selected = router(flat)
        experts = self.experts
        if self.method == "grouped":
            out = experts_grouped(
                flat, selected, routing_weights, experts.gate_up_proj, experts.down_proj, experts.act_fn, self.expert_ids
            )
        else:
            out = experts_gathered(flat, selected, routing_weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
        if self.has_shared_expert:
            # Same order of operations as the talker block: sigmoid gate times shared MLP, added last.
            shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            out = out + shared
        return out.reshape(batch, seq, hidden_dim)

    def extra_repr(self) -> str:
        return f"method={self.method}, replaces={self.source_class}"


def fuse_moe(model: nn.Module, method: Method = "auto") -> int:
    """Replace every thinker/talker sparse MoE block of `model` in place; returns how many.

    Already fused blocks are left alone (a second call returns 0).
    """
    classes = _sparse_block_classes()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, classes)
    ]
    for parent, name, child in targets:
        setattr(parent, name, FusedSparseMoeBlock(child, method=method))
    return len(targets)
