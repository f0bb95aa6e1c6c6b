"""flash-attn under torch.compile (agent/engine/ops/attention.py `flash_kvcache`).

Pins, on CPU, with a stand-in `flash_attn` module whose `flash_attn_with_kvcache` Dynamo cannot
trace (it reads the row lengths and slots back as host bytes, as opaque to it as the real C extension):
- calling the stand-in directly inside torch.compile(fullgraph=True) fails to compile (so the
  stand-in is a faithful proxy for flash-attention issue #1386);
- `attend("flash", ...)` inside torch.compile(fullgraph=True) compiles, because flash is reached
  through the registered custom op `omni_agent::flash_kvcache`, and equals the sdpa backend for
  ragged rows of a slot cache with grouped KV heads, single-token and multi-token steps, both
  eagerly and compiled (inductor);
- `torch.library.opcheck` passes on the op: its schema (nothing mutated), its fake (the output's
  shape, dtype and strides match the real call) and its AOT dispatch.
"""

from __future__ import annotations

import struct
import sys
import types

import pytest
import torch

from agent.engine.ops.attention import attend, flash_attend, flash_kvcache

ROWS, KV_HEADS, Q_HEADS, HEAD_DIM, CAPACITY = 6, 2, 4, 16, 96  # GQA: 2 query heads per KV head
SCALE = HEAD_DIM**-0.5


def _untraceable_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, softmax_scale, causal):
    """flash's contract in plain torch: q [B, T, H, d], caches [rows, capacity, kv_heads, d],
    bottom-right causal (query t of a row holding L keys sees keys <= L - T + t), output
    allocated like q. The lengths and slots are read back as raw host bytes (`struct` over
    numpy's `tobytes`, which Dynamo does not model: a graph break, as the real C extension is)
    and drive a Python loop."""
    assert causal
    batch, n_q, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    assert cache_seqlens.dtype == cache_batch_idx.dtype == torch.int32  # as flash requires
    lengths = struct.unpack(f"={batch}i", cache_seqlens.numpy().tobytes())
    rows = struct.unpack(f"={batch}i", cache_batch_idx.numpy().tobytes())
    out = torch.empty_like(q)
    for b, (length, row) in enumerate(zip(lengths, rows)):
        keys = k_cache[row, :length].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
        values = v_cache[row, :length].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale  # [H, T, L]
        visible = torch.arange(length).view(1, -1) <= (length - n_q + torch.arange(n_q)).view(-1, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[b] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


@pytest.fixture
def stand_in_flash(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = _untraceable_flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    torch._dynamo.reset()
    yield module
    torch._dynamo.reset()


def _case(n_new: int, starts: list[int], slots: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(ROWS, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen)
    cache_v = torch.randn(ROWS, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen)
    index = torch.tensor(starts).view(-1, 1) + torch.arange(n_new).view(1, -1)
    q = torch.randn(len(slots), Q_HEADS, n_new, HEAD_DIM, generator=gen)
    return q, cache_k, cache_v, torch.tensor(slots), index


def _sdpa(q, cache_k, cache_v, slots, index):
    key_len = int(index.max()) + 1
    mask = (torch.arange(key_len).view(1, 1, -1) <= index.unsqueeze(-1)).unsqueeze(1)
    return attend("sdpa", q, cache_k, cache_v, slots, index, SCALE, key_len=key_len, mask=mask)


# (new tokens per row, first cache index per row, slots): ragged lengths, slots out of order.
CASES = [
    (1, [0, 40, 95, 17], [3, 0, 5, 1]),  # decode: 1, 41, 96 (a full row) and 18 keys
    (1, [63, 8], [2, 4]),
    (5, [0, 30, 91], [1, 5, 0]),  # multi-token steps: a row's first chunk, a middle, the end
    (12, [50, 3], [4, 2]),
]


def test_the_stand_in_is_untraceable_with_fullgraph(stand_in_flash):
    q, cache_k, cache_v, slots, index = _case(*CASES[0], seed=0)

    def raw(q, cache_k, cache_v, slots, index):  # what flash_attend did before the op
        return stand_in_flash.flash_attn_with_kvcache(
            q.transpose(1, 2),
            cache_k.transpose(1, 2),
            cache_v.transpose(1, 2),
            cache_seqlens=(index[:, -1] + 1).to(torch.int32),
            cache_batch_idx=slots.to(torch.int32),
            softmax_scale=SCALE,
            causal=True,
        ).transpose(1, 2)

    # Eagerly it is the reference...
    torch.testing.assert_close(raw(q, cache_k, cache_v, slots, index), _sdpa(q, cache_k, cache_v, slots, index))
    # ...but a fullgraph compile of the raw call cannot trace it (a graph break).
    with pytest.raises(torch._dynamo.exc.Unsupported, match="tobytes"):
        torch.compile(raw, fullgraph=True, backend="eager")(q, cache_k, cache_v, slots, index)


@pytest.mark.parametrize("dynamic", [False, True])
def test_flash_through_the_op_compiles_with_fullgraph_and_equals_sdpa(stand_in_flash, dynamic):
    def step(q, cache_k, cache_v, slots, index):
        # key_len and mask serve only sdpa: flash reads each row's length from `index`.
        return attend("flash", q, cache_k, cache_v, slots, index, SCALE, key_len=1, mask=None)

    # inductor: the compiler the engine's steps use; the graph here is two views around the op
    # (an extern call), so it builds in seconds on a CPU. dynamic=False as in the engine's
    # per-bucket compiles (one graph per query length); dynamic=True as with a symbolic batch
    # (the fake then builds its output from symbolic sizes).
    compiled = torch.compile(step, fullgraph=True, backend="inductor", dynamic=dynamic)
    for seed, (n_new, starts, slots) in enumerate(CASES):
        q, cache_k, cache_v, slots_t, index = _case(n_new, starts, slots, seed)
        ref = _sdpa(q, cache_k, cache_v, slots_t, index)
        eager = flash_attend(q, cache_k, cache_v, slots_t, index, SCALE)
        out = compiled(q, cache_k, cache_v, slots_t, index)
        assert out.shape == ref.shape == (len(slots), Q_HEADS, n_new, HEAD_DIM)
        torch.testing.assert_close(eager, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_opcheck_passes_on_the_flash_op(stand_in_flash):
    for seed, (n_new, starts, slots) in enumerate(CASES[::2]):
        q, cache_k, cache_v, slots_t, index = _case(n_new, starts, slots, seed)
        torch.library.opcheck(flash_kvcache, (q, cache_k, cache_v, slots_t, index, SCALE))
        # q already in flash's [B, T, heads, d] memory order (the model's projections): the
        # op's output is contiguous either way, as its fake says.
        q_flash = q.transpose(1, 2).contiguous().transpose(1, 2)
        torch.library.opcheck(flash_kvcache, (q_flash, cache_k, cache_v, slots_t, index, SCALE))
        got = flash_kvcache(q_flash, cache_k, cache_v, slots_t, index, SCALE)
        assert got.is_contiguous() and got.shape == (len(slots), n_new, Q_HEADS, HEAD_DIM)
