"""Static per-session KV slots and one decoder forward that advances many sessions at once.

gpt-fast's layout, for continuous batching: every session owns a *slot* (a row) of each
decoder's cache, `keys[layer]` of shape [slots, kv_heads, capacity, head_dim]. A forward takes
the rows of the sessions it advances (`slots`), the physical cache index of every new token
(`index`, [B, T]: where its key/value is written, and up to where it may attend) and its RoPE
positions (3-D multimodal rows for the thinker and talker, 1-D for the code predictor). So
sessions with different history lengths decode in one batched forward with no padding
copies: a key at index j of row b is visible to a query at index i iff j <= i, and whatever a
row held beyond its current length (a cropped turn, an earlier reply) is masked the same way.
Cropping a session is therefore just lowering its length counter.

The forward drives the Hugging Face layers' own submodules (projections, norms, MoE / MLP
blocks, rotary embedding) and replaces only the attention-with-cache plumbing, so the numbers
are those of transformers' forward up to float rounding; the streaming tests pin tokens and
codes against generate().

Attention itself is one of three kernels (agent/engine/ops/attention.py), chosen per cache by a
capability check: sdpa on CPU, FlexAttention or flash-attn on CUDA (both read the cache in
place, each row only up to its own length). `SlotKV.traffic` gives the KV bytes a step reads.

Capacity grows on demand (in steps of `GROW`, up to `limit`) so that a CPU test does not
allocate a full context per slot; a CUDA-graph path must `reserve()` the limit up front, since
captured graphs hold tensor addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.engine.api import SlotsExhausted
from agent.engine.ops.attention import Backend, KVTraffic, attend, kv_traffic, select_backend
from agent.engine.ops.fusion import is_fused, qkv, qkv_weight
from agent.engine.ops.gemv import check_norm, gemv, normed_gemv
from agent.engine.ops.moe import FusedSparseMoeBlock

GROW = 256  # capacity step (tokens): amortises re-allocation without over-allocating on CPU


class SlotPool:
    """Slot indices handed to sessions: one per open session, reused after close."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.size = size
        self._free = list(range(size))

    def take(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.size} session slots are in use (max_sessions)")
        return self._free.pop(0)

    def give(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.size:
            raise ValueError(f"slot {slot} is not taken")
        self._free.append(slot)
        self._free.sort()  # low slots first: active rows stay contiguous more often (cheap views)


class SlotKV:
    """One decoder's static KV cache: [slots, kv_heads, capacity, head_dim] per layer."""

    def __init__(
        self,
        body: nn.Module,
        slots: int,
        limit: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: Backend | None = None,
    ) -> None:
        config = body.config
        self.n_layers = len(body.layers)
        self.kv_heads = config.num_key_value_heads
        self.q_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # The attention kernel of forwards on this cache (agent/engine/ops/attention.py); rows with
        # a mask that is not causal by index (code2wav's sliding window) always take sdpa.
        self.backend: Backend = backend or select_backend(device, dtype, self.head_dim)
        self.slots, self.limit = slots, limit
        self.device, self.dtype = device, dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0

    @property
    def windowed(self) -> bool:
        """Whether a causal step's attention reads a fixed key window (sdpa), so its graphs are
        keyed by the window's length; flex and flash read each row's own length instead."""
        return self.backend == "sdpa"

    def traffic(self, lengths: Sequence[int], key_len: int | None = None) -> KVTraffic:
        """KV bytes one decode step of rows holding `lengths` keys reads with this cache's
        backend, next to the bytes they hold (`key_len`: sdpa's window, default the longest)."""
        return kv_traffic(
            self.backend,
            lengths,
            layers=self.n_layers,
            kv_heads=self.kv_heads,
            q_heads=self.q_heads,
            head_dim=self.head_dim,
            dtype_bytes=torch.empty(0, dtype=self.dtype).element_size(),
            key_len=key_len,
        )

    def reserve(self, length: int) -> None:
        """Make room for `length` tokens per slot (rounded up to GROW, at most `limit`)."""
        if length <= self.capacity:
            return
        if length > self.limit:
            raise RuntimeError(f"KV slot overflow: {length} tokens > limit {self.limit}")
        capacity = min(self.limit, -(-length // GROW) * GROW)
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        # Zeros, not empty: a masked key still meets the query in the dot product, and garbage
        # NaN/inf there would poison the softmax (NaN * 0 is NaN).
        grown = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(2 * self.n_layers)]
        for old, new in zip(self.keys + self.values, grown):
            new[:, :, : self.capacity].copy_(old)
        self.keys, self.values = grown[: self.n_layers], grown[self.n_layers :]
        self.capacity = capacity


@dataclass
class Rows:
    """Which slots a forward advances and where their new tokens go."""

    slots: list[int]
    index: torch.Tensor  # [B, T] long: physical cache index of each new token
    key_len: int  # max(index) + 1: how much of the cache the batch reads
    mask: torch.Tensor | None  # [B, 1, T, key_len] bool, None when every row sees all key_len keys
    slot_range: slice | None  # the rows as a slice when they are consecutive (views, no gather)
    slot_tensor: torch.Tensor
    start: int | None = None  # the common first index when all rows write at the same place
    # The mask is exactly "key j visible iff j <= index" (what flex / flash-attn compute from
    # `index` alone); False for any other mask (a sliding window), which only sdpa applies.
    causal: bool = False

    @classmethod
    def make(cls, slots: Sequence[int], starts: Sequence[int], n_new: int, device: torch.device) -> "Rows":
        """Rows whose `n_new` new tokens go at starts[b], starts[b] + 1, ..."""
        slots = list(slots)
        index = torch.tensor(list(starts), dtype=torch.long).view(-1, 1) + torch.arange(n_new).view(1, -1)
        key_len = max(starts) + n_new
        mask = None
        if n_new > 1 or min(starts) != max(starts):
            keys = torch.arange(key_len).view(1, 1, -1)
            mask = (keys <= index.unsqueeze(-1)).unsqueeze(1).to(device)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        slot_range = slice(slots[0], slots[0] + len(slots)) if consecutive else None
        return cls(
            slots=slots,
            index=index.to(device),
            key_len=key_len,
            mask=mask,
            slot_range=slot_range,
            slot_tensor=torch.tensor(slots, dtype=torch.long, device=device),
            start=starts[0] if min(starts) == max(starts) else None,
            causal=True,
        )

    @classmethod
    def static(cls, slots: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> "Rows":
        """One new token per row, everything a device tensor (a graphed decode step): slots,
        index [B] long, mask [B, key_len] bool. Attention reads key_len = mask.shape[-1] keys
        of every row whatever its length, so the shapes are the same at every call."""
        return cls(
            slots=[],
            index=index.view(-1, 1),
            key_len=mask.shape[-1],
            mask=mask.view(mask.shape[0], 1, 1, -1),
            slot_range=None,
            slot_tensor=slots,
            causal=True,
        )


# A pytree node (its fields the leaves): a decoder layer's nested compile region takes Rows as
# an argument, and the compiler reuses a traced region only for inputs it can flatten.
torch.utils._pytree.register_dataclass(Rows)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # The same values without a concatenation, which inductor makes a buffer of its own (a
        # kernel per half, then one reading it back): the halves swapped by index, the first
        # negated, all one pointwise expression that fuses into the q/k norm's kernel.
        # (A gather by a constant index, not `roll`: torch 2.11's roll guards on the element
        # count, which an unbacked batch cannot answer.)
        dim = x.shape[-1]
        half = dim // 2
        lanes = torch.arange(dim, device=x.device)
        rolled = x.index_select(-1, (lanes + half) % dim)
        return torch.where(lanes < half, -rolled, rolled)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x [B, heads, T, d], cos/sin [B, T, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def attention(
    attn: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    rows: Rows,
    backend: Backend = "sdpa",
    norm: nn.Module | None = None,
) -> torch.Tensor:
    """One attention block of a Qwen3-style layer (q/k norms, RoPE, GQA) against the slot cache.
    `hidden` is the block's normed input; or, with `norm` (a compiled decode step's fused
    projections, agent/engine/ops/gemv.py), its input before `norm`, which the q/k/v reduction
    applies itself, and the output projection is a reduction too."""
    batch, n_new, _ = hidden.shape
    if norm is not None:
        q, k, v = normed_gemv(hidden, norm, qkv_weight(attn)).split(attn.qkv_splits, dim=-1)
    else:
        q, k, v = qkv(attn, hidden)  # one matmul once fused (agent/engine/ops/fusion.py)

    def heads(x: torch.Tensor) -> torch.Tensor:
        # Head counts spelled out, not -1: with an unbacked batch (compiled steps over flex
        # caches) torch 2.11 cannot infer a -1 beside it (it would guard on batch != 0).
        return x.reshape(batch, n_new, x.shape[-1] // attn.head_dim, attn.head_dim)

    q = attn.q_norm(heads(q)).transpose(1, 2)
    k = attn.k_norm(heads(k)).transpose(1, 2)
    v = heads(v).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if rows.slot_range is not None and rows.start is not None:  # one block: a plain copy
        cache_k[rows.slot_range, :, rows.start : rows.start + n_new] = k
        cache_v[rows.slot_range, :, rows.start : rows.start + n_new] = v
    else:
        # Advanced indices split by a slice put their broadcast dims first: [B, T, kv_heads, d].
        write = (rows.slot_tensor.view(-1, 1), slice(None), rows.index)
        cache_k[write] = k.transpose(1, 2)
        cache_v[write] = v.transpose(1, 2)
    out = attend(
        backend if rows.causal else "sdpa",
        q,
        cache_k,
        cache_v,
        rows.slot_tensor,
        rows.index,
        attn.scaling,
        key_len=rows.key_len,
        mask=rows.mask,
        slot_range=rows.slot_range,
    )
    out = out.transpose(1, 2).reshape(batch, n_new, out.shape[1] * out.shape[-1])
    return gemv(out, attn.o_proj.weight) if norm is not None else attn.o_proj(out)


def decoder_forward(
    body: nn.Module,
    kv: SlotKV,
    rows: Rows,
    embeds: torch.Tensor,
    rope_positions: torch.Tensor,
    capture_layer: int | None = None,
    deepstack: list[torch.Tensor] | None = None,
    visual_mask: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fused: bool = False,
    regions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `body` (a transformers decoder: .layers, .norm, .rotary_emb) on new tokens of `rows`.

    rope_positions: [3, B, T] (multimodal RoPE) or [B, T]. Returns the final-normed hidden
    states [B, T, hidden] and, when `capture_layer` is given, transformers' hidden_states[k]
    (0: the inputs; k: layer k-1's output before DeepStack is added; the last: the normed output).
    DeepStack features are added at the visual positions after the first layers, as transformers does.
    `rope`: (cos, sin) already made by `body.rotary_emb` for these positions (a caller that
    repeats the same positions, like the code predictor, makes them once).
    `fused`: inside a compiled decode step, every projection a reduction with the norm before it
    folded in (agent/engine/ops/gemv.py; `check_fused_decoder` says whether `body` allows it); the
    final norm is then left to the caller, which may fold it into its head (`hidden` is returned
    before `body.norm`).
    `regions`: inside a compiled step, each layer a nested compile region
    (`torch.compiler.nested_compile_region`): the compiler traces and generates code for one
    layer and calls it for all of them, so a step's cold compile no longer grows with depth
    (48 thinker layers at real size; scripts/bench_compile.py: 0.4 s a layer against 20 s
    inlined, on CPU). Inductor then fuses nothing across a layer boundary; counted on CPU a
    layer has fewer scheduled kernels that way, not more (19.0 against 21.5).
    """
    if fused and (capture_layer is not None or deepstack is not None):
        raise ValueError("the fused decoder path captures no layer and adds no DeepStack features")
    kv.reserve(rows.key_len)
    cos, sin = rope if rope is not None else body.rotary_emb(embeds, rope_positions)
    hidden = embeds
    captured = embeds if capture_layer == 0 else None
    # One region per layer when asked: compiled once, its code stamped out for every layer.
    run_layer = _layer_region if regions else decoder_layer
    for i, layer in enumerate(body.layers):
        hidden = run_layer(layer, hidden, cos, sin, kv.keys[i], kv.values[i], rows, kv.backend, fused)
        if capture_layer == i + 1:
            captured = hidden
        if deepstack is not None and i < len(deepstack):
            hidden = hidden.clone()
            hidden[visual_mask] = hidden[visual_mask] + deepstack[i]
    if fused:
        return hidden, captured
    hidden = body.norm(hidden)
    if capture_layer == len(body.layers):
        captured = hidden
    return hidden, captured


def decoder_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    rows: Rows,
    backend: Backend,
    fused: bool,
) -> torch.Tensor:
    """One decoder layer of `decoder_forward` (attention against the slot cache, then the MLP
    or MoE block, each with its residual add); writes the new keys and values in place."""
    if fused:  # no layer scales (check_fused_decoder)
        hidden = hidden + attention(
            layer.self_attn, hidden, cos, sin, cache_k, cache_v, rows, backend, norm=layer.input_layernorm
        )
        return hidden + layer.mlp.forward_normed(hidden, layer.post_attention_layernorm)
    residual = hidden
    out = attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, cache_k, cache_v, rows, backend)
    scale = getattr(layer, "self_attn_layer_scale", None)
    hidden = residual + (scale(out) if scale is not None else out)
    residual = hidden
    out = layer.mlp(layer.post_attention_layernorm(hidden))
    scale = getattr(layer, "mlp_layer_scale", None)
    return residual + (scale(out) if scale is not None else out)


# Outside a compile this is a plain call of decoder_layer.
_layer_region = torch.compiler.nested_compile_region(decoder_layer)


def check_fused_decoder(body: nn.Module) -> None:
    """Refuse a decoder that `decoder_forward(..., fused=True)` would compute wrongly: every
    layer needs its q/k/v weights concatenated (fusion.fuse_decoder), a fused MoE block
    (moe.fuse_moe: dense MLPs have no fused form here), no layer scales, and Qwen3 RMSNorms
    (gemv.check_norm, tried on a few outputs)."""
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not is_fused(attn) or not isinstance(mlp, FusedSparseMoeBlock):
            raise ValueError(f"layer {i}: fused decode needs fused q/k/v and a fused MoE block")
        if any(getattr(layer, name, None) is not None for name in ("self_attn_layer_scale", "mlp_layer_scale")):
            raise ValueError(f"layer {i}: fused decode does not apply layer scales")
        shared = getattr(mlp, "shared_expert", None)
        if attn.o_proj.bias is not None or (shared is not None and shared.down_proj.bias is not None):
            raise ValueError(f"layer {i}: fused decode assumes bias-free output projections")
        check_norm(layer.input_layernorm, qkv_weight(attn))
        check_norm(layer.post_attention_layernorm, mlp.entry)
