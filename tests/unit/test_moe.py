"""Fused MoE experts: the same function as transformers' sparse MoE blocks, computed at once.

Pins: for the thinker block and the talker block (shared expert + its sigmoid gate), built from
the config classes with initialised experts, `FusedSparseMoeBlock` ("grouped" and "gather"
paths) equals the block's Python loop over experts (`experts_implementation="eager"`) within
1e-5 for 1, 3 and 17 tokens, shares the block's Parameters (no copies, same state_dict keys)
and its router module (so routing is identical), its router and shared-expert weights being views
of the one `entry` matmul weight; at decode (one token per row) the pairs are ordered by
`rank_by_expert`, which equals the stable sort and its offsets for ids with repeats, ties and
absent experts; it traces with torch.compile(fullgraph=True)
in fp32; compiled, its fused decode form (`forward_normed`: the norm folded into reductions that
read the picked experts in place, routing without the full softmax) equals the block on the
normed input, with and without renormalised picks; `fuse_moe` swaps every sparse block of the tiny Qwen3-Omni (4 thinker + 2 talker) and
the swapped model gives the same greedy text and the same waveform as the unswapped one. A
micro-benchmark prints the 1-token decode time against the loop (not asserted). On CUDA
(`-m gpu`): the fused block in bf16 equals the loop and replays inside a captured CUDA graph.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import Qwen3OmniMoeTalkerConfig, Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from agent.engine.ops.moe import FusedSparseMoeBlock, experts_grouped, fuse_moe, rank_by_expert

torch.set_num_threads(1)


def _thinker_block(hidden=64, experts=8, top_k=2, inter=32, seed=0):
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config=dict(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    ).text_config
    return _init(hf.Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg), cfg, seed)


def _talker_block(hidden=64, experts=8, top_k=3, inter=32, shared=48, seed=0):
    cfg = Qwen3OmniMoeTalkerConfig(
        text_config=dict(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    ).text_config
    # Read by the block but not declared by the config class (docs/model-facts.md).
    cfg.shared_expert_intermediate_size = shared
    return _init(hf.Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg), cfg, seed)


@torch.no_grad()
def _init(block, cfg, seed):
    # Routed experts are torch.empty and the router zero by default: initialise everything.
    cfg._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block.eval()


BLOCKS = {"thinker": _thinker_block, "talker": _talker_block}


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("method", ["grouped", "gather"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
@torch.no_grad()
def test_fused_block_equals_the_loop_over_experts(kind, method, tokens):
    block = BLOCKS[kind]()
    fused = FusedSparseMoeBlock(block, method=method)
    assert fused.method == method
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
    expected = block(x)  # the eager Python loop
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    # Also against transformers' default dispatch and with a batch dimension.
    block.experts.config._experts_implementation = "grouped_mm"
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    xb = x.expand(2, -1, -1).contiguous()
    torch.testing.assert_close(fused(xb), expected.expand(2, -1, -1), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_fused_block_shares_weights_router_and_state_dict_keys():
    block = _talker_block()
    fused = FusedSparseMoeBlock(block)
    assert fused.gate is block.gate and fused.experts is block.experts
    assert fused.shared_expert is block.shared_expert and fused.shared_expert_gate is block.shared_expert_gate
    assert list(fused.state_dict()) == list(block.state_dict())
    assert list(FusedSparseMoeBlock(_thinker_block()).state_dict()) == list(_thinker_block().state_dict())
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(fused.state_dict().values(), block.state_dict().values()))
    # The shared expert's gate matters: zeroing it must change the output.
    x = torch.randn(1, 3, 64)
    before = fused(x)
    block.shared_expert_gate.weight.fill_(-30.0)
    assert not torch.allclose(fused(x), before, atol=1e-4)
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        FusedSparseMoeBlock(block, method="loop")


@pytest.mark.parametrize("pairs, experts", [(1, 8), (6, 8), (48, 8), (128, 128)])
def test_rank_by_expert_is_the_stable_sort(pairs, experts):
    gen = torch.Generator().manual_seed(pairs)
    flat = torch.randint(0, max(2, experts // 3), (pairs,), generator=gen)  # repeats, absent experts
    ids = torch.arange(experts)
    perm, rank, offs = rank_by_expert(flat, ids)
    sorted_ids, want_perm = torch.sort(flat, stable=True)
    assert perm.tolist() == want_perm.tolist()
    assert perm[rank].tolist() == list(range(pairs))  # rank is its inverse
    assert offs.tolist() == torch.searchsorted(sorted_ids, ids, right=True).tolist()


@torch.no_grad()
def test_decode_ordering_gives_the_sorted_result_bit_for_bit():
    block = _thinker_block()
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 64, generator=gen)
    _, weights, index = block.gate(hidden)
    args = (hidden, index, weights, block.experts.gate_up_proj, block.experts.down_proj, block.experts.act_fn)
    assert torch.equal(experts_grouped(*args, decode=True), experts_grouped(*args, decode=False))


@torch.no_grad()
def test_entry_weights_are_views_of_one_matmul():
    block = _talker_block()
    fused = FusedSparseMoeBlock(block)
    parts = (block.gate, block.shared_expert.gate_proj, block.shared_expert.up_proj, block.shared_expert_gate)
    base = fused.entry.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == base for m in parts)
    assert sum(m.weight.shape[0] for m in parts) == fused.entry.shape[0]


@torch.no_grad()
def test_fused_block_compiles_fullgraph_in_fp32():
    block = _thinker_block()
    fused = FusedSparseMoeBlock(block, method="grouped")
    compiled = torch.compile(fused, fullgraph=True, dynamic=False)
    x = torch.randn(1, 1, 64)
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("renormalised", [True, False])
@torch.no_grad()
def test_forward_normed_compiled_equals_the_block_on_the_normed_input(kind, renormalised):
    block = BLOCKS[kind]()
    block.gate.norm_topk_prob = renormalised  # both real configs renormalise; the talker class's default does not
    fused = FusedSparseMoeBlock(block)
    norm = hf.Qwen3OmniMoeRMSNorm(64, eps=1e-6)
    norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(3)) * 2  # 3 decode rows
    compiled = torch.compile(fused.forward_normed, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, norm), block(norm(x)), rtol=1e-5, atol=1e-5)


def _prompt(tokenizer) -> torch.Tensor:
    text = "<|im_start|>user\nHello agent, what do you see?<|im_end|>\n<|im_start|>assistant\n"
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


@torch.no_grad()
def _generate(model, tokenizer, input_ids):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        speaker="chelsie",
        return_audio=True,
        thinker_do_sample=False,
        talker_do_sample=False,
        thinker_max_new_tokens=6,
        thinker_min_new_tokens=1,
        thinker_eos_token_id=[im_end],
        talker_max_new_tokens=6,
    )


def test_fuse_moe_swaps_every_block_and_keeps_greedy_outputs():
    from agent.engine.checkpoints.tiny import build_model

    model, tokenizer = build_model()
    model.set_experts_implementation("eager")  # the reference is transformers' loop
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert fuse_moe(model) == 4 + 2
    assert fuse_moe(model) == 0
    assert list(model.state_dict()) == keys
    fused_blocks = [m for m in model.modules() if isinstance(m, FusedSparseMoeBlock)]
    assert len(fused_blocks) == 6 and {b.source_class for b in fused_blocks} == {
        "Qwen3OmniMoeThinkerTextSparseMoeBlock",
        "Qwen3OmniMoeTalkerTextSparseMoeBlock",
    }
    ids = _prompt(tokenizer)
    seq_ref, wav_ref = _generate(reference, tokenizer, ids)
    seq, wav = _generate(model, tokenizer, ids)
    assert seq.shape[1] > ids.shape[1]
    assert torch.equal(seq, seq_ref)
    assert wav.shape == wav_ref.shape and wav.numel() > 0
    torch.testing.assert_close(wav, wav_ref, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_decode_micro_benchmark_prints_speedup():
    # Real talker expert dims (hidden 1024, moe_intermediate 384, top-6) with 32 instead of 128
    # experts: a decode token reads only its 6 experts, so E barely matters here.
    block = _talker_block(hidden=1024, experts=32, top_k=6, inter=384, shared=768)
    fused = FusedSparseMoeBlock(block, method="grouped")
    x = torch.randn(1, 1, 1024)

    def per_call(fn, n=10):
        fn(x)
        start = time.perf_counter()
        for _ in range(n):
            fn(x)
        return (time.perf_counter() - start) / n * 1e3

    loop_ms, fused_ms = per_call(block), per_call(fused)
    print(
        f"\n1-token talker MoE decode (CPU, 1 thread): loop {loop_ms:.2f} ms, fused {fused_ms:.2f} ms, "
        f"speedup {loop_ms / fused_ms:.2f}x"
    )
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", sorted(BLOCKS))
@torch.no_grad()
def test_gpu_fused_block_bf16_equals_loop_and_replays_in_a_graph(kind):
    from agent.engine.compile.capture import CUDAGraphed

    exact = BLOCKS[kind](hidden=256, experts=16, inter=128).to("cuda")  # fp32 loop: the truth
    block = copy.deepcopy(exact).to(torch.bfloat16)
    fused = FusedSparseMoeBlock(block)
    assert fused.method == ("grouped" if torch.cuda.get_device_capability() >= (8, 0) else "gather")
    graphed = CUDAGraphed(fused, warmup_iters=2, clone_outputs=True)
    for _step in range(5):
        x = torch.randn(4, 1, 256, device="cuda")
        truth = exact(x)
        xb = x.to(torch.bfloat16)
        loop_err = (block(xb).float() - truth).abs().max().item()
        fused_err = (fused(xb).float() - truth).abs().max().item()
        # bf16 rounding differs by summation order: no worse than the loop's own error.
        assert fused_err <= 2 * loop_err + 1e-2, (fused_err, loop_err)
        torch.testing.assert_close(graphed(xb), fused(xb))
    assert graphed.stats.captures == 1 and graphed.stats.replays == 3
