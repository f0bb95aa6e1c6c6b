"""Decode projections as reductions (agent/engine/gemv.py): equal to the library path, fused when compiled.

Pins:
- compiled, `normed_gemv` equals `F.linear(RMSNorm(x), W)` and `gemv` equals `F.linear`, for one
  and several rows, in float32 and bfloat16 (to the rounding of the dtype);
- compiled, an MLP tail `h + gemv(silu(g) * u, W)` runs with no library matmul (the projection
  is generated code), while `F.linear` leaves one extern call;
- `check_norm` accepts the Qwen3 RMSNorm and refuses a norm with another formula (a LayerNorm,
  an RMSNorm whose weight is offset by one);
- the engine fuses them on CUDA by default and on CPU only when asked (the C++ backend's loops
  for them are slow);
- the tiny model's code-predictor loop, compiled per batch with fused projections as CUDA
  compiles it, gives the eager loop's codes exactly and its embedding sums for a batch of 3
  (padded to 4: one compile, ~1 min here), and the compiled loop calls no library matmul.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeRMSNorm

from agent.engine.gemv import check_norm, gemv, normed_gemv
from agent.engine.kernel_count import wrapper_launches

K, N = 64, 96


def norm_of(dtype: torch.dtype) -> Qwen3OmniMoeRMSNorm:
    norm = Qwen3OmniMoeRMSNorm(K, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_reductions_equal_the_library_projections(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1, K, generator=gen) * 3).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    norm = norm_of(dtype)
    fused = torch.compile(lambda x: (normed_gemv(x, norm, w), gemv(x, w)), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        got_normed, got_plain = fused(x)
        want_normed, want_plain = F.linear(norm(x), w), F.linear(x, w)
    assert got_normed.shape == want_normed.shape == (rows, 1, N) and got_normed.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got_normed, want_normed, **tol)
    torch.testing.assert_close(got_plain, want_plain, **tol)


@contextmanager
def generated_sources() -> Iterator[list[str]]:
    """The generated wrapper source of every compiled graph called inside the block."""
    from torch._inductor.output_code import CompiledFxGraph

    sources: list[str] = []
    original = CompiledFxGraph.__call__

    def record(graph, inputs):
        sources.append(graph.source_code)
        return original(graph, inputs)

    CompiledFxGraph.__call__ = record
    try:
        yield sources
    finally:
        CompiledFxGraph.__call__ = original


def compiled_launches(fn, *args) -> dict[str, int]:
    with generated_sources() as sources, torch.inference_mode():
        torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    assert len(sources) == 1
    return dict(wrapper_launches(sources[0]))


def test_the_mlp_tail_compiles_without_a_library_matmul():
    gen = torch.Generator().manual_seed(0)
    h, g, u = (torch.randn(2, 1, K, generator=gen) for _ in range(3))
    w = torch.randn(K, K, generator=gen)
    fused = compiled_launches(lambda h, g, u: h + gemv(F.silu(g) * u, w), h, g, u)
    library = compiled_launches(lambda h, g, u: h + F.linear(F.silu(g) * u, w), h, g, u)
    assert not any("extern" in callee for callee in fused), fused
    assert sum(n for callee, n in library.items() if "extern" in callee) == 1, library


def test_check_norm_refuses_other_norms():
    w = torch.randn(N, K)
    check_norm(norm_of(torch.float32), w)
    with pytest.raises(ValueError, match="RMSNorm"):
        check_norm(nn.LayerNorm(K), w)

    class OffsetRMSNorm(Qwen3OmniMoeRMSNorm):  # Gemma's formula: weight + 1
        def forward(self, x):
            return super().forward(x) + x / x.pow(2).mean(-1, keepdim=True).add(self.variance_epsilon).sqrt()

    with pytest.raises(ValueError, match="not the RMSNorm"):
        check_norm(OffsetRMSNorm(K), w)


def test_fused_projections_default_to_cuda_only():
    from agent.engine.graphing import GraphConfig, Graphing

    cpu = torch.device("cpu")
    assert Graphing(GraphConfig(compile="on"), cpu, 4).fused_gemv is False
    assert Graphing(GraphConfig(compile="on", fused_gemv=True), cpu, 4).fused_gemv is True


def test_the_code_predictor_loop_with_fused_projections_equals_eager(loaded, compiled_options):
    from agent.engine.code_predictor import CodePredictorOps
    from agent.engine.graphing import GraphConfig, Graphing

    cache = compiled_options["graphs"].compile_cache
    config = GraphConfig(mode="off", compile="on", compile_cache=cache, batch_sizes=(4,),
                         compile_dynamic_batch=False, fused_gemv=True)
    ops = CodePredictorOps(loaded.model.talker, loaded.device, loaded.dtype, Graphing(config, loaded.device, 4))
    assert ops.fused_gemv
    hidden = ops.talker_embed.embedding_dim
    with generated_sources() as sources:
        for batch in (3, 4):
            gen = torch.Generator().manual_seed(300 + batch)
            with torch.inference_mode():
                last = torch.randn(batch, 1, hidden, generator=gen)
                code0 = torch.randint(0, 2048, (batch,), generator=gen)
                codes, sums = ops.run(last, code0)
                want_codes, want_sums = ops._run(last, code0)
            torch.testing.assert_close(codes, want_codes, rtol=0, atol=0)
            torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-4)
            assert len(set(codes[:, 1:].flatten().tolist())) > 1  # a loop that really ran
    assert sources, "the loop did not run compiled"
    assert not any("extern_kernels.mm" in line for source in sources for line in source.splitlines()
                   if not line.lstrip().startswith("#"))
