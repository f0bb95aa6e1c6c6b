"""Fused q/k/v projections (agent/engine/ops/fusion.py): one matmul, the same numbers, no copies.

Pins: on a real Qwen3-Omni thinker attention block (the config class, tiny widths, GQA), after
`fuse_qkv` the module's own q/k/v projections read views of `qkv_weight` (one storage, the
state_dict keys unchanged), `qkv()` gives what the three projections give, transformers' own
forward of the block is unchanged, a second fuse is a no-op, and a block with biases keeps its
three matmuls; `fuse_decoder` fuses every layer of a decoder.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from agent.engine.ops.fusion import QKV, fuse_decoder, fuse_qkv, qkv

torch.set_num_threads(1)


def _attention(seed: int = 0) -> nn.Module:
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ).text_config
    attn = hf.Qwen3OmniMoeThinkerTextAttention(cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return attn


@torch.no_grad()
def test_fused_projections_equal_the_three_and_share_storage():
    attn = _attention()
    x = torch.randn(2, 5, 64)
    want = (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    keys = list(attn.state_dict())
    assert fuse_qkv(attn)
    got = qkv(attn, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    base = getattr(attn, QKV).untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == base for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert list(attn.state_dict()) == keys  # the fused weight is not a state_dict entry
    assert (attn.q_proj(x) == want[0]).all()  # transformers' own projections read the same numbers
    assert not fuse_qkv(attn)  # already fused


@torch.no_grad()
def test_a_block_with_biases_is_left_alone():
    attn = _attention()
    attn.k_proj = nn.Linear(64, 32, bias=True)
    assert not fuse_qkv(attn)
    assert not hasattr(attn, QKV)
    x = torch.randn(1, 3, 64)
    torch.testing.assert_close(qkv(attn, x)[1], attn.k_proj(x))


def test_fuse_decoder_fuses_every_layer(loaded):
    lm = loaded.model.thinker.model.language_model
    already = sum(hasattr(layer.self_attn, QKV) for layer in lm.layers)
    assert fuse_decoder(lm) == len(lm.layers) - already
    assert all(hasattr(layer.self_attn, QKV) for layer in lm.layers)
