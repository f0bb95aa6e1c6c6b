"""Attention backends over the static slot caches (agent/engine/ops/attention.py).

Pins:
- flex attention, reading the cache in place with a block mask built from the rows' cache
  indices, equals the sdpa path (gathered keys, boolean mask, enable_gqa) for ragged decode
  lengths on both sides of 128-key block boundaries, grouped KV heads, non-consecutive slots,
  prefill chunks that straddle block boundaries or span several query blocks, and a cache
  shorter than one block (the code predictor's);
- the same through the tiny thinker's decoder: a chunked prefill of two sessions and batched
  decode steps on a flex cache give the hidden states of an sdpa cache;
- the capability check: CPU runs sdpa, flash-attn is never picked without CUDA;
- the KV traffic model: flex reads each row's keys rounded up to a block (within 1.2x of the
  live cache from 640 keys per row), sdpa's math path many times the live bytes.
"""

from __future__ import annotations

import pytest
import torch

from agent.engine.ops.attention import BLOCK, flex_attend, kv_traffic, sdpa_attend, select_backend
from agent.engine.ops.slots import Rows, SlotKV, decoder_forward


def sdpa_reference(q, cache_k, cache_v, slots, index, scale):
    key_len = int(index.max()) + 1
    mask = (torch.arange(key_len, device=index.device).view(1, 1, -1) <= index.unsqueeze(-1)).unsqueeze(1)
    return sdpa_attend(q, cache_k, cache_v, slots, scale, key_len=key_len, mask=mask)


CASES = [
    # (capacity, new tokens per row, first index per row, slots)
    (384, 1, [126, 127, 128, 129, 0], [4, 0, 2, 1, 3]),  # decode around one block boundary
    (384, 1, [255, 5, 300], [3, 1, 0]),  # ragged decode, slots out of order
    (384, 40, [100, 250, 3], [1, 4, 2]),  # prefill chunks across 128 and 256
    (384, 130, [60, 0], [2, 0]),  # a chunk spanning two query blocks
    (17, 2, [0, 0, 0], [0, 1, 2]),  # a cache shorter than a block (code predictor)
]


@pytest.mark.parametrize("capacity,n_new,starts,slots", CASES)
def test_flex_equals_sdpa(capacity, n_new, starts, slots):
    gen = torch.Generator().manual_seed(capacity + n_new)
    rows, kv_heads, q_heads, head_dim = 5, 2, 4, 16
    cache_k = torch.randn(rows, kv_heads, capacity, head_dim, generator=gen)
    cache_v = torch.randn(rows, kv_heads, capacity, head_dim, generator=gen)
    slots_t = torch.tensor(slots)
    index = torch.tensor(starts).view(-1, 1) + torch.arange(n_new).view(1, -1)
    q = torch.randn(len(slots), q_heads, n_new, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = flex_attend(q, cache_k, cache_v, slots_t, index, scale)
    ref = sdpa_reference(q, cache_k, cache_v, slots_t, index, scale)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_thinker_decoder_on_a_flex_cache_equals_sdpa(loaded):
    lm = loaded.model.thinker.model.language_model
    embed = lm.get_input_embeddings()
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    # Session 0 (slot 2) prefills 150 tokens in chunks of 100 + 50 (the second straddles 128),
    # session 1 (slot 0) 20; then three batched decode steps at different lengths.
    prompts = {2: torch.randint(0, vocab, (150,), generator=gen), 0: torch.randint(0, vocab, (20,), generator=gen)}
    outs: dict[str, list[torch.Tensor]] = {}
    for backend in ("sdpa", "flex"):
        kv = SlotKV(lm, 3, 512, loaded.device, loaded.dtype, backend=backend)
        got, length = [], {}
        with torch.inference_mode():
            for slot, ids in prompts.items():
                done = 0
                for chunk in (100, 50) if slot == 2 else (20,):
                    rows = Rows.make([slot], [done], chunk, loaded.device)
                    rope = torch.arange(done, done + chunk).view(1, 1, -1).expand(3, -1, -1)
                    hidden, _ = decoder_forward(lm, kv, rows, embed(ids[done : done + chunk].view(1, -1)), rope)
                    got.append(hidden)
                    done += chunk
                length[slot] = done
            for step in range(3):
                slots = [2, 0]
                rows = Rows.make(slots, [length[s] for s in slots], 1, loaded.device)
                tokens = torch.randint(0, vocab, (2, 1), generator=torch.Generator().manual_seed(step))
                rope = torch.tensor([length[s] for s in slots]).view(1, -1, 1).expand(3, -1, -1)
                hidden, _ = decoder_forward(lm, kv, rows, embed(tokens), rope)
                got.append(hidden)
                for s in slots:
                    length[s] += 1
        outs[backend] = got
    assert len(outs["flex"]) == len(outs["sdpa"]) == 6
    for flex, sdpa in zip(outs["flex"], outs["sdpa"]):
        torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-4)


def test_cpu_selects_sdpa_and_never_flash():
    assert select_backend(torch.device("cpu"), torch.float32, 128) == "sdpa"
    assert select_backend(torch.device("cpu"), torch.bfloat16, 128) == "sdpa"


def test_kv_traffic_flex_reads_whole_blocks_sdpa_math_expands():
    dims = dict(layers=48, kv_heads=4, q_heads=32, head_dim=128, dtype_bytes=2)
    per_key = 2 * 48 * 4 * 128 * 2
    lengths = [640, 1000, 3000, 129]
    flex = kv_traffic("flex", lengths, **dims)
    assert flex.live_bytes == sum(lengths) * per_key
    assert flex.live_bytes <= flex.read_bytes < flex.live_bytes + len(lengths) * BLOCK * per_key
    for n in (640, 1000, 8000):
        assert kv_traffic("flex", [n, n + 1], **dims).ratio <= 1.2
    assert kv_traffic("flash", lengths, **dims).ratio == 1.0
    sdpa = kv_traffic("sdpa", lengths, **dims)
    assert sdpa.ratio > 10 * flex.ratio
    with pytest.raises(ValueError):
        kv_traffic("flex", [], **dims)


# ---- on a CUDA device (`-m gpu`; skipped without one) ------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_gpu_backends_equal_sdpa_and_replay_in_a_cuda_graph(backend, dtype):
    from agent.engine.compile.capture import CUDAGraphed
    from agent.engine.ops.attention import attend, flash_available

    device = torch.device("cuda")
    if backend == "flash" and not flash_available(device, dtype, 128):
        pytest.skip("flash-attn is not installed or does not take this dtype")
    rows, kv_heads, q_heads, head_dim, capacity = 9, 4, 32, 128, 2000  # not a block multiple
    cache_k = torch.randn(rows, kv_heads, capacity, head_dim, device=device, dtype=dtype)
    cache_v = torch.randn(rows, kv_heads, capacity, head_dim, device=device, dtype=dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for n_new, starts in ((1, [127, 1000, 5, 1500]), (64, [100, 900, 0, 1400])):
        slots = torch.tensor([3, 0, 7, 8], device=device)
        index = torch.tensor(starts, device=device).view(-1, 1) + torch.arange(n_new, device=device)
        q = torch.randn(4, q_heads, n_new, head_dim, device=device, dtype=dtype)

        def run(q, slots, index):
            return attend(backend, q, cache_k, cache_v, slots, index, head_dim**-0.5, key_len=1, mask=None)

        out = run(q, slots, index)
        ref = sdpa_reference(q.float(), cache_k.float(), cache_v.float(), slots, index, head_dim**-0.5)
        torch.testing.assert_close(out.float(), ref, **tol)
        graphed = CUDAGraphed(run, warmup_iters=1)
        for _ in range(3):  # warm-up (compiles), capture, replay
            replayed = graphed(q, slots, index)
        assert graphed.stats.replays >= 1
        torch.testing.assert_close(replayed.float(), out.float(), atol=1e-3, rtol=1e-3)


def test_a_slot_cache_reports_its_backend_traffic(loaded):
    lm = loaded.model.thinker.model.language_model
    for backend in ("sdpa", "flex"):
        kv = SlotKV(lm, 2, 1024, loaded.device, loaded.dtype, backend=backend)
        got = kv.traffic([300, 700])
        want = kv_traffic(
            backend,
            [300, 700],
            layers=len(lm.layers),
            kv_heads=lm.config.num_key_value_heads,
            q_heads=lm.config.num_attention_heads,
            head_dim=kv.head_dim,
            dtype_bytes=torch.finfo(loaded.dtype).bits // 8,
        )
        assert got == want and got.backend == backend
