"""The byte model behind the predicted H200 time (agent/engine/instruments/roofline.py).

Pins: the expected number of distinct MoE experts is k for one token, grows with the batch and
approaches E; at the real preset (meta device, nothing allocated) one batch-1 thinker decode
with no context reads exactly the thinker's active parameters (counted independently by
presets.count_parameters) minus the embedding table plus one row; batching reads the weights
once (4 rows cost far less than 4 ticks), KV bytes grow linearly with context; the time model
adds bytes over efficient bandwidth to kernels times the per-kernel cost; the depth-reduced
presets the kernel run counts on keep every per-layer size of the real model; and a 4-bit model
(agent/engine/quant, quantized on the meta device) is counted in real bytes: its experts, dense
layer weights and heads at exactly the bytes of their packed buffers (nibbles, bf16 scales and
lows) plus the float parameters kept, its embedding rows and KV as before.
"""

from __future__ import annotations

import pytest
import torch

from agent.engine.checkpoints.presets import (
    REAL,
    cast_parameters,
    count_parameters,
    depth_overrides,
    meta_model,
    preset_config,
    scaled_overrides,
)
from agent.engine.instruments.roofline import H200, ByteModel, expected_experts
from agent.engine.quant.apply import QuantScheme, quantize_model
from agent.engine.quant.modules import Int4Experts, Int4Linear


def test_expected_experts_spread():
    assert expected_experts(1, 8, 128) == pytest.approx(8)
    spread = [expected_experts(b, 8, 128) for b in (1, 4, 10, 100, 10_000)]
    assert spread == sorted(spread) and spread[1] < 4 * 8
    assert spread[-1] == pytest.approx(128)
    assert expected_experts(0, 8, 128) == 0


@pytest.fixture(scope="module")
def real():
    config = preset_config(REAL)
    return config, ByteModel.of(meta_model(config))


def test_batch_one_decode_reads_the_active_parameters(real):
    config, model = real
    active = count_parameters(config).thinker_active
    text = config.thinker_config.text_config
    embed_table = text.vocab_size * text.hidden_size
    assert model.tick(1, 0)["thinker_decode"] == pytest.approx(2 * (active - embed_table + text.hidden_size))


def test_batching_and_context(real):
    _, model = real
    one, four = sum(model.tick(1, 0).values()), sum(model.tick(4, 0).values())
    assert one < four < 4 * one
    kv = model.tick(1, 2048)["thinker_decode"] - model.tick(1, 1024)["thinker_decode"]
    assert kv == pytest.approx(model.tick(1, 1024)["thinker_decode"] - model.tick(1, 0)["thinker_decode"])
    assert kv == 1024 * 2 * model.thinker.kv_per_token


def test_time_model():
    assert H200.seconds(0.6 * 4.8e12, 0) == pytest.approx(1.0)
    assert H200.seconds(0, 1000) == pytest.approx(4e-3)


def test_depth_overrides_keep_every_per_layer_size(real):
    _, full = real
    one, two = (ByteModel.of(meta_model(preset_config(REAL, depth_overrides(n)))) for n in (1, 2))
    assert (two.thinker.layers, two.talker.layers) == (2, 2)
    for a, b in ((two.thinker, full.thinker), (two.talker, full.talker)):
        assert (a.dense_per_layer, a.expert, a.experts, a.top_k, a.head, a.embed_row) == (
            b.dense_per_layer,
            b.expert,
            b.experts,
            b.top_k,
            b.head,
            b.embed_row,
        )
    # Stacks without a per-layer split: 1 layer plus (depth - 1) x the 1 -> 2 difference is the full size.
    assert one.predictor_layers + 4 * (two.predictor_layers - one.predictor_layers) == full.predictor_layers
    assert one.audio_encoder + 31 * (two.audio_encoder - one.audio_encoder) == full.audio_encoder
    assert one.code2wav + 7 * (two.code2wav - one.code2wav) == full.code2wav


def _held(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and its 4-bit modules' buffers, at their own element sizes."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    packed = sum(
        b.numel() * b.element_size()
        for m in module.modules()
        if isinstance(m, (Int4Linear, Int4Experts))
        for b in m.buffers(recurse=False)
    )
    return params + packed


def test_a_quantized_model_is_counted_in_packed_bytes():
    config = preset_config(REAL, scaled_overrides(layers=2))
    model = cast_parameters(meta_model(config), torch.bfloat16)
    float_bm = ByteModel.of(model, element=2)
    quantize_model(model, QuantScheme())
    bm = ByteModel.of(model, element=2)
    lm, head = model.thinker.model.language_model, model.thinker.lm_head
    experts = [layer.mlp.experts for layer in lm.layers]
    assert all(isinstance(e, Int4Experts) for e in experts) and isinstance(head, Int4Linear)
    packed_experts = sum(
        getattr(e, f"{w}_{part}").numel() * getattr(e, f"{w}_{part}").element_size()
        for e in experts
        for w in ("gate_up_proj", "down_proj")
        for part in ("nibbles", "scale", "low")
    )
    text = config.thinker_config.text_config
    assert bm.thinker.expert * bm.thinker.experts * bm.thinker.layers == packed_experts
    assert bm.thinker.dense_per_layer * bm.thinker.layers == _held(lm.layers) - packed_experts
    assert bm.thinker.head == head.packed.nbytes + _held(lm.norm)
    assert bm.predictor_head == model.talker.code_predictor.lm_head[0].packed.nbytes
    # Batch 1, no context: every layer's dense part, top-k of E experts, norm and head, one embedding row.
    k, e = text.num_experts_per_tok, text.num_experts
    expected = _held(lm.layers) - packed_experts * (e - k) / e + bm.thinker.head + text.hidden_size * 2
    assert bm.tick(1, 0)["thinker_decode"] == pytest.approx(expected)
    # 4-bit: 0.5 byte a weight plus two bf16 numbers a group, against 2 bytes a weight.
    assert bm.thinker.expert / float_bm.thinker.expert == pytest.approx((0.5 + 4 / 128) / 2, rel=0.1)
    # KV stays in the engine's dtype.
    assert bm.tick(1, 1024)["thinker_decode"] - bm.tick(1, 0)["thinker_decode"] == 1024 * 2 * bm.thinker.kv_per_token
