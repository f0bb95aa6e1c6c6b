"""Attention of new tokens against the static slot caches: three kernels, one contract.

Every backend computes, for the rows `slots` of a cache [rows, kv_heads, capacity, head_dim],
softmax(q k^T * scale) v where key j of a row is visible to its query at cache index i iff
j <= i (`index`, [B, T]); grouped KV heads (GQA) are shared by `q_heads / kv_heads` query heads.

- "sdpa": gather the rows' first `key_len` keys, `scaled_dot_product_attention` with a boolean
  mask and `enable_gqa`. On CUDA that combination leaves PyTorch only its math kernel (K/V
  expanded per query head, scores materialised in fp32); on CPU it is the fastest eager choice
  for short contexts, so it is what eager CPU runs.
- "flex": `flex_attention` reading the cache *in place*: the queries are scattered into a
  tensor with one row per cache row (rows not in the call get an empty block list and are never
  read), and a block mask built from `index` lists, per query block, the 128-key blocks a row
  may see (full ones first, the partial one last, its mask applied per element). So a step reads
  each row's live keys rounded up to one block and no padding up to a batch-wide length, GQA is
  native, and the shapes do not depend on the lengths (one compiled kernel per query length).
  Eagerly, flex runs through `torch.compile` (its eager form is an unfused reference).
- "flash": flash-attn's `flash_attn_with_kvcache` (when installed, CUDA, fp16/bf16), reading the
  cache in place through `cache_batch_idx` with per-row `cache_seqlens` and bottom-right causal
  alignment; it needs each row's new tokens at consecutive indices, which every caller here has.
  It is called through a registered custom op (`omni_agent::flash_kvcache`): Dynamo cannot trace
  the C extension, so the compiled steps (torch.compile with fullgraph=True) would fail to
  compile if they met the raw call; the op is one opaque node to them, and its fake
  implementation gives the compiler the output's shape.

`select_backend` is the capability check; `kv_traffic` says how many KV bytes a step reads for
given row lengths on each backend (the benchmark prints it next to the live cache bytes).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch.nn import functional as F

Backend = Literal["sdpa", "flex", "flash"]
BACKENDS: tuple[Backend, ...] = ("sdpa", "flex", "flash")
BLOCK = 128  # flex's sparse block (keys and queries): the granularity of what it skips


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 256
        and importlib.util.find_spec("flash_attn") is not None
    )


def flex_available(device: torch.device) -> bool:
    # flex needs a compiler: triton on CUDA, inductor's C++ template on CPU.
    return device.type in ("cuda", "cpu") and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> Backend:
    """flash-attn where it is installed (CUDA, half precision), flex on any other CUDA device,
    sdpa on CPU. Measured on this project's CPU (one thread, warm): at the tiny model's sizes
    sdpa is 5x faster than compiled flex for a decode step and 1.5x for a 64-token prefill, and
    flex compiles for 5-18 s per new shape; at real head counts flex wins decode (2-2.6x at 1k-4k
    keys) and ties prefill, but a CPU does not serve the real model."""
    if flash_available(device, dtype, head_dim):
        return "flash"
    if device.type == "cuda" and flex_available(device):
        return "flex"
    return "sdpa"


def attend(
    backend: Backend,
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    *,
    key_len: int,
    mask: torch.Tensor | None,
    slot_range: slice | None = None,
) -> torch.Tensor:
    """q [B, q_heads, T, d] (already written to the cache at `index`) -> [B, q_heads, T, d].

    slots [B] long (the cache rows), index [B, T] long. `key_len`, `mask` ([B, 1, T, key_len]
    bool or None) and `slot_range` serve the sdpa path, which reads a fixed key window."""
    if backend == "flex":
        return flex_attend(q, cache_k, cache_v, slots, index, scale)
    if backend == "flash":
        return flash_attend(q, cache_k, cache_v, slots, index, scale)
    return sdpa_attend(q, cache_k, cache_v, slots, scale, key_len=key_len, mask=mask, slot_range=slot_range)


def sdpa_attend(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    *,
    key_len: int,
    mask: torch.Tensor | None,
    slot_range: slice | None = None,
) -> torch.Tensor:
    if slot_range is not None:
        keys = cache_k[slot_range, :, :key_len]
        values = cache_v[slot_range, :, :key_len]
    else:
        keys = cache_k[:, :, :key_len].index_select(0, slots)
        values = cache_v[:, :, :key_len].index_select(0, slots)
    return F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=bool(keys.shape[1] != q.shape[1]),  # bool: see agent/engine/compile/cpu_traces.py
    )


# ---- flex ----------------------------------------------------------------------------------


def slot_block_mask(index_full: torch.Tensor, capacity: int):
    """The block mask of queries at cache indices `index_full` [rows, T] (-1: no query in
    that row) over a cache of `capacity` keys: key j visible iff j <= index. Built from the
    indices with plain tensor ops (no host sync, no [T, capacity] mask materialised), so it can
    sit inside a captured graph or a compiled region."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, n_q = index_full.shape
    q_blocks = -(-n_q // BLOCK)
    kv_blocks = -(-capacity // BLOCK)
    pad = q_blocks * BLOCK - n_q
    idx = index_full
    if pad:
        idx = torch.cat([idx, idx.new_full((rows, pad), -1)], dim=1)
    tiles = idx.view(rows, q_blocks, BLOCK)
    hi = tiles.amax(-1)
    # Pad queries (-1) must not lower a block's minimum: count them as seeing everything.
    lo = torch.where(tiles >= 0, tiles, torch.full_like(tiles, capacity)).amin(-1)
    lo = torch.minimum(lo, hi)  # a block with no query at all: lo = hi = -1
    n_any = torch.clamp(torch.div(hi, BLOCK, rounding_mode="floor") + 1, min=0, max=kv_blocks)
    n_full = torch.clamp(torch.div(lo + 1, BLOCK, rounding_mode="floor"), min=0, max=kv_blocks)
    n_full = torch.minimum(n_full, n_any)
    cols = torch.arange(kv_blocks, device=idx.device, dtype=torch.int32).view(1, 1, 1, -1)
    full_idx = cols.expand(rows, 1, q_blocks, kv_blocks).contiguous()
    # Partial blocks come right after the full ones (indices past a count are never read).
    part_idx = torch.clamp(cols + n_full.view(rows, 1, q_blocks, 1).to(torch.int32), max=kv_blocks - 1)
    lookup = idx  # [rows, q_blocks * BLOCK]

    def visible(b, h, q_idx, kv_idx):
        return kv_idx <= lookup[b, q_idx]

    return BlockMask.from_kv_blocks(
        (n_any - n_full).to(torch.int32).view(rows, 1, q_blocks),
        part_idx.contiguous(),
        n_full.to(torch.int32).view(rows, 1, q_blocks),
        full_idx,
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=visible,
        seq_lengths=(n_q, capacity),
        compute_q_blocks=False,
    )


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # The row lengths live in the block mask (no recompile when they change). Shapes are static:
    # measured on an H200 (torch 2.11), a symbolic query length sends prefill chunks to the
    # flex-decoding lowering, which then finds no kernel. One compile per (rows, query length,
    # capacity): the graphed engine meets a fixed set (batch x token buckets), more than dynamo's
    # default of 8 recompiles per function, so the limit is raised for this one function's code.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def flex_attend(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    rows, capacity = cache_k.shape[0], cache_k.shape[2]
    batch, heads, n_q, head_dim = q.shape
    # Queries in the cache's row order: rows outside the call see no block and cost nothing.
    q_full = q.new_zeros(rows, heads, n_q, head_dim).index_copy(0, slots, q)
    index_full = index.new_full((rows, n_q), -1).index_copy(0, slots, index)
    block_mask = slot_block_mask(index_full, capacity)
    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    # Flex-decoding (chosen for query lengths < 128 on CUDA) handles a whole GQA group per block:
    # it needs n_q x group <= the block size, else it has no kernel config (H200, torch 2.11).
    # Longer chunks take the main flex kernel.
    group = heads // cache_k.shape[1]
    options = {"FORCE_USE_FLEX_ATTENTION": True} if q.is_cuda and n_q * group > BLOCK else None
    out = fn(
        q_full, cache_k, cache_v, block_mask=block_mask, scale=scale, enable_gqa=group != 1, kernel_options=options
    )
    return out.index_select(0, slots)


# ---- flash-attn ----------------------------------------------------------------------------


@torch.library.custom_op("omni_agent::flash_kvcache", mutates_args=())
def flash_kvcache(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """flash-attn's `flash_attn_with_kvcache` as an opaque op: q [B, q_heads, T, d], caches
    [rows, kv_heads, capacity, d], slots [B] and index [B, T] long -> [B, T, q_heads, d]
    (flash's layout, contiguous).

    Dynamo cannot trace into the C extension (flash-attention issue #1386), so a compiled step
    with fullgraph=True that called it directly would fail to compile; as a registered op it is
    one node of the graph, run eagerly, and `_flash_kvcache_fake` gives the compiler its output's
    shape. Nothing is mutated: the caller has already written the new keys and values into the
    cache, and flash is called with no k/v to append, so it only reads the cache."""
    from flash_attn import flash_attn_with_kvcache

    # [rows, kv_heads, capacity, d] viewed as flash's [rows, capacity, kv_heads, d]: same
    # memory, last dim contiguous. A row's T new tokens sit at consecutive indices ending at
    # index[:, -1], so bottom-right causal alignment gives query t the keys <= index[:, t].
    out = flash_attn_with_kvcache(
        q.transpose(1, 2),
        cache_k.transpose(1, 2),
        cache_v.transpose(1, 2),
        cache_seqlens=(index[:, -1] + 1).to(torch.int32),
        cache_batch_idx=slots.to(torch.int32),
        softmax_scale=scale,
        causal=True,
    )
    # flash allocates its output like its q: when q's [B, T, heads, d] view is contiguous (how
    # the projections lay q out, slots.py) the output is too and this copies nothing. The op
    # promises contiguous whatever q's strides, so that the fake below is exact.
    return out.contiguous()


@flash_kvcache.register_fake
def _flash_kvcache_fake(q, cache_k, cache_v, slots, index, scale):
    batch, heads, n_q, head_dim = q.shape
    return q.new_empty(batch, n_q, heads, head_dim)


def flash_attend(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """flash-attn through the registered op (eager and compiled callers alike)."""
    return flash_kvcache(q, cache_k, cache_v, slots, index, float(scale)).transpose(1, 2)


# ---- what a step reads -----------------------------------------------------------------------


@dataclass(frozen=True)
class KVTraffic:
    backend: Backend
    read_bytes: int  # KV bytes the attention of one step moves through memory, all layers
    live_bytes: int  # the keys and values the rows really hold, all layers

    @property
    def ratio(self) -> float:
        return self.read_bytes / self.live_bytes if self.live_bytes else 0.0


def kv_traffic(
    backend: Backend,
    lengths: Sequence[int],
    *,
    layers: int,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    dtype_bytes: int,
    key_len: int | None = None,
) -> KVTraffic:
    """KV bytes one decode step reads for rows holding `lengths` keys (after the step's write).

    A model, counted from what each kernel is documented to touch:
    - flex: every row reads its keys rounded up to whole 128-key blocks;
    - flash: every row reads its keys (the tail tile's loads are predicated off);
    - sdpa: every row reads `key_len` keys (the batch maximum, or the graph's length bucket),
      once for the gather copy, once written and once read back; then, on CUDA's math kernel,
      K/V expanded to every query head (written and read: 2 x q_heads / kv_heads).
    """
    if not lengths:
        raise ValueError("kv_traffic needs at least one row")
    per_key = 2 * layers * kv_heads * head_dim * dtype_bytes  # K and V, every layer
    live = sum(lengths) * per_key
    if backend == "flex":
        read = sum(-(-n // BLOCK) * BLOCK for n in lengths) * per_key
    elif backend == "flash":
        read = live
    elif backend == "sdpa":
        window = key_len if key_len is not None else max(lengths)
        read = len(lengths) * window * per_key * (3 + 2 * q_heads // kv_heads)
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    return KVTraffic(backend, read, live)
