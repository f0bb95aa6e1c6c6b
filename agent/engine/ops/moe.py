"""Fused MoE experts for Qwen3-Omni's thinker and talker sparse blocks.

transformers 5.24 gives both blocks (`Qwen3OmniMoeThinkerTextSparseMoeBlock`,
`Qwen3OmniMoeTalkerTextSparseMoeBlock`) experts stored as 3-D tensors (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) whose forward is picked at run time from `config._experts_implementation`:
"grouped_mm" when the platform allows it, else the Python loop over hit experts ("eager"), which
syncs with the host (`nonzero`, a loop over a tensor) and so can never sit in a CUDA graph. The
dispatch is silent, so a GPU or torch change could put the loop back in the decode step.

`fuse_moe(model)` pins the choice instead: every sparse block is replaced by `FusedSparseMoeBlock`,
which reuses the block's own router, experts, shared expert and shared-expert gate modules (same
Parameters, no copies, same state_dict keys) and computes all routed experts at once with one of
two graph-safe paths (fixed shapes, no host syncs). Launches are what decode costs at real size,
so everything that reads the block's input is one matmul: the router's rows, and for the talker
the shared expert's gate and up rows and its one-row gate, concatenated once (`entry`; the
modules' weights become views of it, so nothing is stored twice). The router's softmax, top-k
and renormalisation are transformers' own, in its order: routing is identical. The paths:

- "grouped": order the (token, expert) pairs by expert, then one `grouped_mm` per projection
  over the expert weight tensors as they are. At decode (one token per row, at most a few
  hundred pairs) the order comes from comparisons alone (`rank_by_expert`: two small
  reductions that inductor fuses into the kernels around them); a prefill's thousands of pairs
  are sorted (`torch.sort`, offsets by `searchsorted`). Both give the stable order. Reads each selected
  expert once. On CPU, decode is memory-bound: for 1 token it is on par with the loop
  (0.9-1.3x across runs, real talker/thinker expert sizes, 1 thread) and 1.1-1.2x for 2-8 tokens;
  gathering weights instead is 3-10x slower. The gain is on GPU: no host sync, so capturable.
- "gather": `index_select` the selected experts' weight slices per (token, expert) pair and `bmm`.
  Copies the selected weights (≈3x the memory traffic), so it is only the fallback where
  `grouped_mm` has no kernel (e.g. CUDA below sm80 or non-bf16 dtypes on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agent.engine.ops.gemv import gathered_gemv, gemv, normed_gemv_with_scale
from agent.engine.quant.modules import Int4Experts, expert_weights

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
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor | Sequence[Callable[[], Tensor]],
    down_proj: Tensor | Sequence[Callable[[], Tensor]],
    act: Activation,
    expert_ids: Tensor | None = None,
    decode: bool = False,
) -> Tensor:
    """All routed experts via grouped matmuls over the unmodified `[E, out, in]` weights.

    hidden [T, H], top_k_index/top_k_weights [T, K] -> [T, H]. The weights, or functions each
    making a slice of a weight's output rows when it is read (a 4-bit stack's unpacking: one float
    slice alive at a time, `Int4Experts.unpacked_slices`). `expert_ids`: arange(E) made once by
    the caller (needed with slices; else made here: a kernel per call and layer in a compiled
    step). `decode`: few pairs, ordered by `rank_by_expert` instead of a sort.
    """
    num_tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    if expert_ids is None and not isinstance(gate_up_proj, Tensor):
        raise ValueError("sliced expert stacks need expert_ids")
    experts = expert_ids if expert_ids is not None else torch.arange(gate_up_proj.shape[0], device=flat.device)
    if decode:
        perm, rank, offs = rank_by_expert(flat, experts)
    else:
        sorted_ids, perm = torch.sort(flat, stable=True)
        # Offsets from the sorted ids with a fixed-size search: no bincount (its output size
        # depends on the data, a host sync that breaks graph capture).
        offs = torch.searchsorted(sorted_ids, experts.to(sorted_ids.dtype), right=True).to(torch.int32)
        rank = None
    x = hidden.index_select(0, perm // k)
    gate, up = _grouped_rows(x, gate_up_proj, offs).chunk(2, dim=-1)
    y = _grouped_rows(act(gate) * up, down_proj, offs)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    # Undo the order (perm is a permutation: a gather by rank, or a deterministic index_copy)
    # and sum the k experts.
    unsorted = y.index_select(0, rank) if rank is not None else torch.empty_like(y).index_copy_(0, perm, y)
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(hidden.dtype)


def rank_by_expert(flat: Tensor, experts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The stable sort of `flat` [P] (expert ids) by comparisons, for a few hundred pairs.

    rank[p]: pairs that sort before p, i.e. with a lower id, or the same id and a lower index;
    perm: its inverse (the pair at each sorted place); offs [E] int32: pairs with id <= e, the
    end of each expert's group. Equal to `torch.sort(flat, stable=True)` and `searchsorted`, but
    made of broadcast compares and sums (P x P and E x P), which a compiled step fuses instead of
    launching a sort and a search; quadratic, so for decode-sized P only."""
    index = torch.arange(flat.shape[0], device=flat.device)
    ids, other = flat.view(-1, 1), flat.view(1, -1)
    before = (other < ids) | ((other == ids) & (index.view(1, -1) < index.view(-1, 1)))
    rank = before.sum(1)
    perm = ((rank.view(1, -1) == index.view(-1, 1)) * index.view(1, -1)).sum(1)
    offs = (other <= experts.to(flat.dtype).view(-1, 1)).sum(1).to(torch.int32)
    return perm, rank, offs


def _grouped_rows(x: Tensor, weight: Tensor | Sequence[Callable[[], Tensor]], offs: Tensor) -> Tensor:
    """x [S, in] sorted by expert, times a stack [E, out, in] or its row slices -> [S, out]
    (in the weight's dtype). A slice is made, read and dropped before the next is made."""
    if isinstance(weight, Tensor):
        return _grouped_matmul(x.to(weight.dtype), weight.transpose(-2, -1), offs)
    outs = [_grouped_matmul_of(x, part, offs) for part in weight]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _grouped_matmul_of(x: Tensor, part: Callable[[], Tensor], offs: Tensor) -> Tensor:
    weight = part()  # (alive only in this frame: freed before the next slice is made)
    return _grouped_matmul(x.to(weight.dtype), weight.transpose(-2, -1), offs)


def _grouped_matmul(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """x [S, in] sorted by expert, weight [E, in, out] -> [S, out]."""
    if torch.compiler.is_compiling() and weight.dtype != torch.bfloat16:
        # grouped_mm's meta kernel is bf16-only, so dynamo cannot trace it in fp32 (CPU tests,
        # a compiled CPU decode step). transformers registers an opaque op for exactly this case
        # (a loop over experts with one host sync: CPU only; CUDA non-bf16 resolves to "gather").
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offs)
    return _grouped_mm_fn()(x, weight, offs=offs)


def experts_gathered(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, experts: nn.Module) -> Tensor:
    """All routed experts via per-pair weight gathers and batched matmuls (graph-safe anywhere).
    A 4-bit stack gathers the picked experts' nibbles and unpacks only those."""
    num_tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    gate_up_proj = expert_weights(experts, "gate_up_proj", flat)  # [T*K, 2I, H]
    x = hidden.to(gate_up_proj.dtype).repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*K, H, 1]
    gate_up = torch.bmm(gate_up_proj, x).squeeze(-1)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    down = expert_weights(experts, "down_proj", flat)
    y = torch.bmm(down, (experts.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return y.view(num_tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _stack(experts: nn.Module, name: str) -> Tensor | list[Callable[[], Tensor]]:
    """A float expert stack as experts_grouped takes it: a 4-bit one in slices unpacked when read."""
    if isinstance(experts, Int4Experts):
        return experts.unpacked_slices(name)
    return getattr(experts, name)


def _probe(experts: nn.Module) -> Tensor:
    """A tensor with the expert weights' device and model dtype, without unpacking a 4-bit stack."""
    return experts.gate_up_proj_scale if isinstance(experts, Int4Experts) else experts.gate_up_proj


class FusedSparseMoeBlock(nn.Module):
    """Drop-in forward for a thinker or talker sparse MoE block, sharing its modules.

    Submodule names match the original (`gate`, `experts`, and for the talker `shared_expert`,
    `shared_expert_gate`) so state_dict keys stay the same.
    """

    def __init__(self, block: nn.Module, method: Method = "auto") -> None:
        super().__init__()
        # Re-register the block's own children in its order: same modules, same state_dict.
        for name, child in block.named_children():
            self.add_module(name, child)
        self.has_shared_expert = hasattr(block, "shared_expert")
        self.method = resolve_method(method, _probe(self.experts))
        weights = _probe(self.experts)
        # Not persistent: the state_dict keeps the original block's keys.
        self.register_buffer("expert_ids", torch.arange(weights.shape[0], device=weights.device), persistent=False)
        self.source_class = type(block).__name__
        self._fuse_entry()

    def _fuse_entry(self) -> None:
        """One weight for every projection of the block's input (see the module docstring)."""
        modules = [self.gate]
        if self.has_shared_expert:
            shared = self.shared_expert
            modules += [shared.gate_proj, shared.up_proj, self.shared_expert_gate]
        if any(getattr(m, "bias", None) is not None for m in modules):
            raise ValueError("the fused MoE entry assumes bias-free router and shared expert (Qwen3-Omni)")
        with torch.no_grad():
            entry = torch.cat([m.weight for m in modules], dim=0)
            self.register_buffer("entry", entry, persistent=False)
            row = 0
            for m in modules:
                n = m.weight.shape[0]
                m.weight = nn.Parameter(entry[row : row + n], requires_grad=False)
                row += n
        self.entry_splits = [m.weight.shape[0] for m in modules]

    def forward(self, hidden_states: Tensor) -> Tensor:
        batch, seq, hidden_dim = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden_dim)
        parts = F.linear(flat, self.entry).split(self.entry_splits, dim=-1)
        routing_weights, selected = self._route(parts[0])
        experts = self.experts
        if self.method == "grouped" and not (seq == 1 and isinstance(experts, Int4Experts)):
            # (A 4-bit stack at decode is gathered instead: grouped_mm needs every expert's
            # float weight, which would unpack all of them for the few picked.)
            # A 4-bit stack is unpacked where experts_grouped reads it, a slice of rows at a
            # time: one slice is alive at once (the memory plan's unpacked_experts).
            out = experts_grouped(
                flat,
                selected,
                routing_weights,
                _stack(experts, "gate_up_proj"),
                _stack(experts, "down_proj"),
                experts.act_fn,
                self.expert_ids,
                decode=seq == 1,
            )
        else:
            out = experts_gathered(flat, selected, routing_weights, experts)
        if self.has_shared_expert:
            gate, up, shared_gate = parts[1:]
            mlp = self.shared_expert
            # Same order of operations as the talker block: sigmoid gate times shared MLP, added last.
            shared = F.sigmoid(shared_gate) * mlp.down_proj(mlp.act_fn(gate) * up)
            out = out + shared
        return out.reshape(batch, seq, hidden_dim)

    def forward_normed(self, hidden_states: Tensor, norm: nn.Module) -> Tensor:
        """`forward(norm(hidden_states))` for a compiled decode step, as fused reductions
        (agent/engine/ops/gemv.py): the router's and shared expert's projections with the norm folded
        in; each picked expert's weights read in place by a reduction over the token's scaled
        input, times the norm's row scale that the router's loop already computed. The normed
        input is never written out, no pair is sorted, no grouped matmul launched. At batch B
        two tokens that pick the same expert read it twice (grouped_mm reads it once): the
        price of having no sort."""
        batch, seq, hidden_dim = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden_dim)
        entry, row_scale = normed_gemv_with_scale(flat, norm, self.entry)
        parts = entry.split(self.entry_splits, dim=-1)
        routing_weights, selected = self._route_picks(parts[0])
        experts = self.experts
        scaled = flat.float() * norm.weight.float()
        gate_up_w = expert_weights(experts, "gate_up_proj", selected)
        gate_up = (gathered_gemv(scaled, gate_up_w) * row_scale.view(-1, 1, 1)).to(flat.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        down_w = expert_weights(experts, "down_proj", selected)
        picks = gathered_gemv(experts.act_fn(gate) * up, down_w).to(flat.dtype)  # [T, K, H]
        out = (picks.float() * routing_weights.float().unsqueeze(-1)).sum(1)
        if self.has_shared_expert:
            gate, up, shared_gate = parts[1:]
            mlp = self.shared_expert
            shared = F.sigmoid(shared_gate) * gemv(mlp.act_fn(gate) * up, mlp.down_proj.weight)
            out = out + shared.float()
        return out.to(hidden_states.dtype).reshape(batch, seq, hidden_dim)

    def _route_picks(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """`_route` without the softmax over every expert: top-k of the logits picks the same
        experts (softmax is monotonic), and when the picks' weights are renormalised, the full
        softmax's denominator cancels: they are the softmax of the k picked logits. Otherwise
        the denominator is one sum over every expert. Equal to `_route` up to float rounding."""
        router = self.gate
        top_logits, top_index = torch.topk(logits.float(), router.top_k, dim=-1)
        # Sorted, so the max is the first pick: the softmax needs no reduction for it.
        weights = torch.exp(top_logits - top_logits[..., :1])
        if router.norm_topk_prob:  # the softmax over the picks
            return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), top_index
        everything = torch.exp(logits.float() - top_logits[..., :1]).sum(-1, keepdim=True)
        return (weights / everything).to(logits.dtype), top_index

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """transformers' TopKRouter after its matmul: softmax in fp32, top-k, renormalise."""
        router = self.gate
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return top_value.to(logits.dtype), top_index

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
