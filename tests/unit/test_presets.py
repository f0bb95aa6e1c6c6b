"""Random-weight presets: the published Qwen3-Omni-30B-A3B shape, built without a download.

Pins: the real preset's config has the published dimensions (both MoE routers renormalising
their top-k, as the released config.json says) and, counted on the meta device (nothing
allocated), 35.3 B parameters with 3.35 B thinker-active and 0.29 B talker-active per
token (docs/model-facts.md); the meta -> to_empty -> init path, run on a scaled-down variant on CPU, gives
the classes' own initial values (norms 1, biases 0, layer scales, SnakeBeta log-scales, the same
RoPE/sinusoid/code-offset buffers; weights normal(0, 0.02), the talker's experts and router
included), is deterministic per seed, keeps buffers' dtypes under bf16, and every submodule
(audio encoder, vision encoder, thinker, talker, code predictor, code2wav) runs a finite forward,
code2wav at an audible level. The "tiny" preset delegates to agent.engine.checkpoints.tiny. On a CUDA device
with room for it (`-m gpu`), the full-size model builds in bf16 and decodes.
"""

from __future__ import annotations

import pytest
import torch

from agent.engine.checkpoints.presets import GUESSED_FIELDS, REAL, count_parameters, preset_config, scaled_overrides
from agent.engine.checkpoints.random_weights import build_random

torch.set_num_threads(1)


def test_real_config_has_the_published_dimensions():
    cfg = preset_config(REAL)
    text, audio, vision = (
        cfg.thinker_config.text_config,
        cfg.thinker_config.audio_config,
        cfg.thinker_config.vision_config,
    )
    talker, cp, c2w = cfg.talker_config.text_config, cfg.talker_config.code_predictor_config, cfg.code2wav_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert (text.head_dim, text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (128, 128, 8, 768)
    assert text.vocab_size == 152064
    assert (audio.encoder_layers, audio.d_model, vision.depth, vision.hidden_size) == (32, 1280, 27, 1152)
    assert (talker.num_hidden_layers, talker.hidden_size, talker.num_experts, talker.num_experts_per_tok) == (
        20,
        1024,
        128,
        6,
    )
    assert (talker.moe_intermediate_size, talker.shared_expert_intermediate_size) == (384, 768)
    # Both routers renormalise their top-k weights (released config.json; the talker class defaults to False).
    assert text.norm_topk_prob is True and talker.norm_topk_prob is True
    assert not any("norm_topk_prob" in field for field in GUESSED_FIELDS)
    assert cfg.talker_config.accept_hidden_layer == 24
    assert (cp.num_hidden_layers, cp.hidden_size, cp.num_code_groups) == (5, 1024, 16)
    assert (c2w.num_hidden_layers, c2w.hidden_size, c2w.sliding_window, c2w.decoder_dim) == (8, 1024, 72, 1536)
    # Fields the code reads but the config classes do not declare (docs/model-facts.md).
    assert cfg.talker_config.spatial_merge_size == 2 and cfg.thinker_config.vision_start_token_id == 151652


def test_real_parameter_counts_match_the_published_model_without_allocating():
    counts = count_parameters(preset_config(REAL))
    assert abs(counts.total - 35.3e9) < 0.05e9, counts
    assert abs(counts.thinker_active - 3.35e9) < 0.01e9, counts
    assert abs(counts.talker_active - 0.29e9) < 0.01e9, counts


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError):
        build_random("qwen-9000", "cpu")
    with pytest.raises(ValueError):
        build_random("tiny", "cpu", overrides={"x": 1})


@pytest.fixture(scope="module")
def scaled():
    return build_random(REAL, "cpu", torch.float32, overrides=scaled_overrides(), seed=0)


def _reference_build():
    """The same config built the ordinary way (CPU constructors + transformers' own init)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3OmniMoeForConditionalGeneration(preset_config(REAL, scaled_overrides())).eval()


@torch.no_grad()
def test_init_matches_the_classes_own_values(scaled):
    ours = dict(scaled.named_parameters())
    reference = _reference_build()
    calibrated = "code2wav.decoder.%d.conv.weight" % (len(scaled.code2wav.decoder) - 1)
    checked_random = 0
    for name, ref in reference.named_parameters():
        mine = ours[name]
        assert mine.shape == ref.shape and mine.device.type == "cpu", name
        assert torch.isfinite(mine).all(), name
        # transformers leaves the talker's routed experts empty and its router at zero (docs/model-facts.md).
        talker_moe = name.startswith("talker.model.layers.") and (".mlp.experts." in name or ".mlp.gate." in name)
        if name == calibrated:
            continue
        flat = ref.flatten()
        if bool((flat == flat[0]).all()) and not talker_moe:
            assert torch.equal(mine, ref), f"{name}: expected the constant {flat[0].item()}"
        else:
            # normal(0, 0.02): a 4-sigma band for this many samples.
            n = mine.numel()
            std, mean = mine.float().std().item(), mine.float().mean().item()
            assert abs(std - 0.02) < 4 * 0.02 / (2 * n) ** 0.5 + 1e-3 and abs(mean) < 4 * 0.02 / n**0.5, name
            checked_random += 1
    assert checked_random > 50
    ref_buffers = dict(reference.named_buffers())
    for name, buf in scaled.named_buffers():
        assert buf.dtype == ref_buffers[name].dtype, name
        torch.testing.assert_close(buf, ref_buffers[name], rtol=0, atol=0, msg=name)


@torch.no_grad()
def test_build_is_deterministic_per_seed_and_bf16_keeps_buffer_dtypes(scaled):
    again = build_random(REAL, "cpu", torch.float32, overrides=scaled_overrides(), seed=0)
    other = build_random(REAL, "cpu", torch.bfloat16, overrides=scaled_overrides(), seed=1)
    first = scaled.state_dict()
    for name, value in again.state_dict().items():
        assert torch.equal(value, first[name]), name
    name = "thinker.model.language_model.layers.0.self_attn.q_proj.weight"
    assert other.state_dict()[name].dtype == torch.bfloat16
    assert not torch.equal(other.state_dict()[name].float(), first[name].to(torch.bfloat16).float())
    assert other.thinker.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
    assert other.code2wav.code_offset.dtype == torch.int64
    assert not any(p.requires_grad for p in other.parameters())


@torch.no_grad()
def test_every_submodule_runs_a_forward(scaled):
    width = scaled.config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(0)
    audio = scaled.thinker.model.audio_tower(torch.randn(128, 200, generator=gen), feature_lens=torch.tensor([200]))
    assert audio.last_hidden_state.shape == (26, width)  # 2 s of mel at 13 tokens/s
    vision = scaled.thinker.model.visual(
        torch.randn(16, 3 * 2 * 16 * 16, generator=gen), grid_thw=torch.tensor([[1, 4, 4]])
    )
    assert vision.pooler_output.shape == (4, width)
    ids = torch.randint(0, 4000, (1, 7), generator=gen)
    thinker = scaled.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    assert thinker.logits.shape == (1, 7, 4096)
    accept = scaled.config.talker_config.accept_hidden_layer
    talker_in = scaled.talker.hidden_projection(thinker.hidden_states[accept]) + scaled.talker.text_projection(
        thinker.hidden_states[0]
    )
    hidden = scaled.talker.model(inputs_embeds=talker_in).last_hidden_state
    codec_logits = scaled.talker.codec_head(hidden)
    assert codec_logits.shape == (1, 7, 3072)
    predictor = scaled.talker.code_predictor(inputs_embeds=torch.stack([hidden[:, -1], hidden[:, -2]], dim=1))
    assert predictor.logits.shape == (1, 2, 2048)
    wav = scaled.code2wav(torch.randint(0, 2048, (1, 16, 4), generator=gen))
    assert wav.shape == (1, 1, 4 * 1920 - 555)
    rms = wav.pow(2).mean().sqrt().item()
    assert 0.03 < rms < 0.3, rms  # calibrated near -20 dBFS; the default init gives ~1e-6
    for out in (audio.last_hidden_state, vision.pooler_output, thinker.logits, codec_logits, predictor.logits):
        assert torch.isfinite(out).all()


@torch.no_grad()
def test_tiny_preset_delegates_to_the_tiny_builder():
    model = build_random("tiny", "cpu")
    assert model.config.thinker_config.text_config.hidden_size == 64
    assert model.num_parameters() < 20_000_000
    assert not model.training and not any(p.requires_grad for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 90 * 2**30,
    reason="needs a CUDA device with >= 90 GiB (the full model is 65.7 GiB in bf16)",
)
@torch.no_grad()
def test_gpu_full_size_builds_in_bf16_and_decodes():
    model = build_random(REAL, "cuda", torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = torch.randint(0, 150000, (1, 16), device="cuda")
    out = model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.logits.shape == (1, 16, 152064) and torch.isfinite(out.logits).all()
    wav = model.code2wav(torch.randint(0, 2048, (1, 16, 4), device="cuda"))
    assert wav.float().pow(2).mean().sqrt().item() > 0.03
    del model
    torch.cuda.empty_cache()


def test_load_random_drives_a_scaled_preset_with_the_tiny_tokenizer(tiny_model_dir) -> None:
    """The real-size benchmark path, scaled down: special ids follow the tiny tokenizer and
    a streamed reply produces text and audio."""
    import numpy as np

    from agent.engine.api import AudioOut, ReplyDone
    from agent.engine.checkpoints import random_weights
    from agent.engine.checkpoints.presets import merge_overrides
    from agent.engine.runner.streaming import StreamingRunner

    real_build = random_weights.build_random

    def scaled(preset, device, dtype=None, *, overrides=None, seed=0, quantize=""):
        merged = merge_overrides(scaled_overrides(), overrides or {})
        return real_build(preset, device, dtype, overrides=merged, seed=seed, quantize=quantize)

    random_weights.build_random = scaled
    try:
        loaded = random_weights.load_random(REAL, "cpu", str(tiny_model_dir))
    finally:
        random_weights.build_random = real_build
    assert loaded.model.config.thinker_config.audio_token_id == loaded.ids.audio_pad
    runner = StreamingRunner(loaded, "hi", max_reply_tokens=4, max_reply_seconds=0.5)
    runner.open_session("s")
    runner.append_audio("s", np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1)
    runner.begin_reply("s", [np.zeros((64, 64, 3), np.uint8)])
    outs = []
    for _ in range(40):
        outs += runner.step()
        if any(isinstance(o, ReplyDone) for o in outs):
            break
    # Random weights over a 4096-token vocab mostly pick ids the tiny tokenizer cannot spell,
    # so the text may decode empty; the reply must still run to its end and speak.
    done = [o for o in outs if isinstance(o, ReplyDone)]
    assert done and done[0].reason in ("stop", "length"), done
    assert sum(len(o.pcm) for o in outs if isinstance(o, AudioOut)) > 0
