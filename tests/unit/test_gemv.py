"""Decode projections as reductions (agent/engine/ops/gemv.py): equal to the library path, fused when compiled.

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
  (padded to 4: one compile, ~1 min here), and the compiled loop calls no library matmul;
  its 14 one-token steps are one nested compile region, generated once and called 14 times
  (the loop is not unrolled);
- so do its thinker decode and talker steps (fused MoE experts too: no grouped matmul), equal
  to the eager steps for ragged rows in random slots; and so again with each decoder layer a
  nested compile region (`compile_regions`), whose one generated body each step calls once per
  layer;
- the CUDA default wiring (one compile for every bucket, the batch unbacked over flex caches,
  regions, fused projections, flex attention forced on CPU) equals the eager steps for
  batches 1, 3 and 4, one graph per step;
- a decoder the fused path would compute wrongly (dense MLPs, layer scales, another norm) is
  refused when the steps are built.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from support.compiled import fused_per_batch, generated_code
from support.engine_drive import assert_loop_equals_eager, assert_steps_equal_eager, fill_with_noise
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeRMSNorm

from agent.engine.instruments.kernel_count import KernelCounter, region_functions, wrapper_launches
from agent.engine.ops.gemv import check_norm, gemv, normed_gemv

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


def compiled_launches(fn, *args) -> dict[str, int]:
    with KernelCounter() as counter, torch.inference_mode():
        torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    assert len(counter.sources) == 1
    return dict(wrapper_launches(*counter.sources.values()))


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
    from agent.engine.compile.wiring import GraphConfig, Graphing

    cpu = torch.device("cpu")
    assert Graphing(GraphConfig(compile="on"), cpu, 4).fused_gemv is False
    assert Graphing(GraphConfig(compile="on", fused_gemv=True), cpu, 4).fused_gemv is True


def test_the_code_predictor_loop_with_fused_projections_equals_eager(loaded, compiled_options):
    from agent.engine.stages.code_predictor import CodePredictorOps

    graphing = fused_per_batch(loaded, compiled_options)
    ops = CodePredictorOps(loaded.model.talker, loaded.device, loaded.dtype, graphing)
    assert ops.fused_gemv
    with KernelCounter() as counter:
        for batch in (3, 4):
            assert_loop_equals_eager(ops, batch, seed=300 + batch)
    assert counter.sources, "the loop did not run compiled"
    assert not [line for line in generated_code(counter) if "extern_kernels.mm" in line]
    (source,) = counter.sources.values()  # batch 3 ran padded to 4: one graph
    calls = Counter(re.findall(r"= (\w*subgraph\w*)\(", source))
    assert set(calls) <= region_functions(source), calls
    # The one-token steps share one generated body (the first step, two tokens, is another shape).
    assert max(calls.values()) == ops.num_groups - 2 and sum(calls.values()) <= ops.num_groups - 1, calls


def _fused_steps_equal_eager(loaded, compiled_options, seed: int, regions: bool = False):
    """Thinker and talker steps compiled per batch with fused projections (and, with `regions`,
    one nested region per layer), checked against the eager steps for batches 3 and 4; the
    ops and the kernel counter that watched the compiled calls."""
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.stages.talker import TalkerOps
    from agent.engine.stages.thinker import ThinkerOps

    model = loaded.model
    fuse_moe(model)  # what the runner does first (no-ops when already done)
    fuse_decoder(model.thinker.model.language_model)
    fuse_decoder(model.talker.model)
    graphing = fused_per_batch(loaded, compiled_options, regions=regions)
    thinker, talker = ThinkerOps(loaded, 6, 512, graphing), TalkerOps(loaded, 6, 512, graphing=graphing)
    assert thinker.fused_gemv and talker.fused_gemv
    assert thinker.regions == talker.regions == regions
    gen = torch.Generator().manual_seed(seed)
    fill_with_noise(thinker, talker, gen=gen)
    with KernelCounter() as counter:
        for batch in (3, 4):
            assert_steps_equal_eager(thinker, talker, batch, gen)
    return thinker, talker, counter


def test_the_thinker_and_talker_steps_with_fused_projections_equal_eager(loaded, compiled_options):
    """Their decode steps compiled per batch with fused projections and MoE experts (as CUDA
    compiles them) against the eager steps (library matmuls, grouped experts), ragged rows."""
    _, _, counter = _fused_steps_equal_eager(loaded, compiled_options, seed=7)
    assert len(counter.sources) >= 2, "the steps did not run compiled"
    assert not [line for line in generated_code(counter) if "extern_kernels.mm" in line or "grouped_mm" in line]


def test_decode_steps_with_one_region_per_layer_equal_eager(loaded, compiled_options):
    """`GraphConfig(compile_regions=True)`: a cold compile that does not grow with depth (one
    layer generated, called per layer), the same numbers."""
    thinker, talker, counter = _fused_steps_equal_eager(loaded, compiled_options, seed=11, regions=True)
    layers = sorted((len(thinker.lm.layers), len(talker.talker.model.layers)))
    calls = []
    for source in counter.sources.values():
        (region,) = region_functions(source)  # one body, generated once
        calls.append(source.count(f"= {region}("))
    assert sorted(calls) == layers, calls  # the thinker's step and the talker's: one call per layer


def test_the_cuda_default_wiring_with_flex_attention_equals_eager(loaded, compiled_options):
    """What CUDA runs by default, on CPU: one compile for every batch bucket (the batch unbacked
    over flex's slot caches), each layer a nested region, fused projections, flex attention
    reading the caches in place. Batches 1, 3 (padded to 4) and 4 equal the eager steps, and each
    step is one graph for all of them (no batch of its own: a warm start has one graph to find)."""
    from agent.engine.compile.wiring import GraphConfig, Graphing
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.stages.talker import TalkerOps
    from agent.engine.stages.thinker import ThinkerOps

    fuse_moe(loaded.model)
    fuse_decoder(loaded.model.thinker.model.language_model)
    fuse_decoder(loaded.model.talker.model)
    config = GraphConfig(
        mode="off",
        compile="on",
        compile_cache=compiled_options["graphs"].compile_cache,
        batch_sizes=(1, 4),
        fused_gemv=True,
        compile_regions=True,
        attention="flex",
    )
    graphing = Graphing(config, loaded.device, 4)
    thinker, talker = ThinkerOps(loaded, 4, 512, graphing), TalkerOps(loaded, 4, 512, graphing=graphing)
    assert thinker.kv.backend == talker.kv.backend == "flex" and thinker.regions and thinker.fused_gemv
    gen = torch.Generator().manual_seed(21)
    fill_with_noise(thinker, talker, gen=gen)
    for batch in (4, 3, 1):
        assert_steps_equal_eager(thinker, talker, batch, gen)
    graphs = graphing.compiler.graph_counts()
    assert graphs["thinker_decode"] == graphs["talker_step"] == 1, graphs


def test_a_decoder_the_fused_path_would_get_wrong_is_refused(loaded):
    """At start-up, not as wrong numbers: code2wav's transformer (dense MLPs, layer scales), and
    a thinker layer whose norm is not the Qwen3 RMSNorm; the thinker as it is passes."""
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.ops.slots import check_fused_decoder

    with pytest.raises(ValueError, match="fused MoE block"):
        check_fused_decoder(loaded.model.code2wav.pre_transformer)
    fuse_moe(loaded.model)
    lm = loaded.model.thinker.model.language_model
    fuse_decoder(lm)
    check_fused_decoder(lm)
    layer = lm.layers[0]
    rms = layer.input_layernorm
    layer.input_layernorm = nn.LayerNorm(rms.weight.shape[0])
    try:
        with pytest.raises(ValueError, match="RMSNorm"):
            check_fused_decoder(lm)
    finally:
        layer.input_layernorm = rms
