"""The byte model behind the predicted H200 time (agent/engine/instruments/roofline.py).

Pins: the expected number of distinct MoE experts is k for one token, grows with the batch and
approaches E; at the real preset (meta device, nothing allocated) one batch-1 thinker decode
with no context reads exactly the thinker's active parameters (counted independently by
presets.count_parameters) minus the embedding table plus one row; batching reads the weights
once (4 rows cost far less than 4 ticks), KV bytes grow linearly with context; the time model
adds bytes over efficient bandwidth to kernels times the per-kernel cost; and the depth-reduced
presets the kernel run counts on keep every per-layer size of the real model.
"""

from __future__ import annotations

import pytest

from agent.engine.checkpoints.presets import REAL, _build_meta, count_parameters, depth_overrides, preset_config
from agent.engine.instruments.roofline import H200, ByteModel, expected_experts


def test_expected_experts_spread():
    assert expected_experts(1, 8, 128) == pytest.approx(8)
    spread = [expected_experts(b, 8, 128) for b in (1, 4, 10, 100, 10_000)]
    assert spread == sorted(spread) and spread[1] < 4 * 8
    assert spread[-1] == pytest.approx(128)
    assert expected_experts(0, 8, 128) == 0


@pytest.fixture(scope="module")
def real():
    config = preset_config(REAL)
    return config, ByteModel.of(_build_meta(config))


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
    one, two = (ByteModel.of(_build_meta(preset_config(REAL, depth_overrides(n)))) for n in (1, 2))
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
