"""Random-weight presets built directly in 4-bit (`build_random(..., quantize="int4")`).

Pins, on a scaled-down variant of the real preset (one layer per stack) on CPU:
- the 4-bit build is exactly `quantize_model(build_random(...))` with the same seed, every
  packed weight, kept float weight and buffer bit for bit (so the same init distributions and
  the same seed logic) but code2wav's loudness-calibrated last conv (within 10 %), and another
  seed gives another model;
- no quantized module keeps a float weight: the 4-bit modules own no parameter but a bias, nothing is
  left on meta, and the state dict has no float `weight`/`gate_up_proj`/`down_proj` for them;
- while it builds, no more than one module's float weights exist besides the model's own
  tensors (what lets the 30B model build on a card that cannot hold it in bf16);
- `load_random(..., quantize="int4")` gives a LoadedModel the streaming runner speaks a reply with.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from agent.engine.checkpoints import random_weights
from agent.engine.checkpoints.presets import REAL, scaled_overrides
from agent.engine.checkpoints.random_weights import build_random
from agent.engine.quant import int4
from agent.engine.quant.apply import QuantScheme, quantize_model
from agent.engine.quant.modules import Int4Experts, Int4Linear

torch.set_num_threads(1)

OVERRIDES = scaled_overrides(layers=1)


def _int4(seed: int = 0) -> torch.nn.Module:
    return build_random(REAL, "cpu", torch.float32, overrides=OVERRIDES, seed=seed, quantize="int4")


@pytest.fixture(scope="module")
def built() -> torch.nn.Module:
    return _int4()


def test_the_4bit_build_is_the_float_build_quantized(built) -> None:
    reference = build_random(REAL, "cpu", torch.float32, overrides=OVERRIDES, seed=0)
    report = quantize_model(reference, QuantScheme())
    assert report.quantized
    ours, theirs = dict(built.named_buffers()), dict(reference.named_buffers())
    ours.update(built.named_parameters())
    theirs.update(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    # But one: code2wav's last conv is scaled to an output loudness measured by running code2wav,
    # whose transformer is already 4-bit in the 4-bit build (float in the float one).
    calibrated = "code2wav.decoder.6.conv.weight"
    assert different in ([], [calibrated]), different[:5]
    torch.testing.assert_close(ours[calibrated], theirs[calibrated], rtol=0.1, atol=0)
    other = _int4(seed=1).state_dict()
    packed = next(k for k in other if k.endswith("gate_up_proj_nibbles"))
    assert not torch.equal(other[packed], built.state_dict()[packed])


def test_quantized_modules_hold_no_float_weight(built) -> None:
    stand_ins = {n: m for n, m in built.named_modules() if isinstance(m, (Int4Linear, Int4Experts))}
    assert any(isinstance(m, Int4Experts) for m in stand_ins.values())
    assert any(n.startswith("talker.code_predictor") for n in stand_ins)
    for name, module in stand_ins.items():
        # A bias is the one float parameter a 4-bit module may own.
        assert [n for n, _ in module.named_parameters(recurse=False)] in ([], ["bias"]), name
        assert module.weight_nibbles.dtype if isinstance(module, Int4Linear) else module.gate_up_proj_nibbles.dtype
    keys = built.state_dict().keys()
    floats = {f"{n}.{w}" for n in stand_ins for w in ("weight", "gate_up_proj", "down_proj")}
    assert not floats & keys
    assert all(t.device.type == "cpu" for t in (*built.parameters(), *built.buffers()))


def _live_float_tensors() -> dict[int, torch.Tensor]:
    # Plain tensors and parameters only: a worker that ran compiled tests before still holds
    # fake tensors with symbolic sizes, which cannot be compared with a number.
    return {
        id(t): t
        for t in gc.get_objects()
        if type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.is_floating_point()
        and t.numel() > 1024
    }


def test_one_module_of_float_weights_at_a_time(monkeypatch) -> None:
    """At each packing, the live float tensors that are neither the model's own nor older than
    the build add up to at most the largest quantized module's float weights."""
    before: set[int] = set()
    models: list[torch.nn.Module] = []
    foreign: list[int] = []
    stacks: list[bool] = []
    build_meta, quantize = random_weights.meta_model, int4.quantize

    def tracking_meta(config):
        gc.collect()
        before.update(_live_float_tensors())
        models.append(build_meta(config))
        return models[-1]

    def counting(weight, group, dtype=None):
        stacks.append(weight.dim() == 3)
        if not stacks[-1] or sum(stacks) % 2:  # counted at each expert stack's second packing (a walk is slow)
            return quantize(weight, group, dtype)
        model = models[-1]
        own = {t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
        live = _live_float_tensors()
        stray = {t.data_ptr(): t for i, t in live.items() if i not in before and t.data_ptr() not in own}
        foreign.append(sum(t.numel() * t.element_size() for t in stray.values()))
        return quantize(weight, group, dtype)

    monkeypatch.setattr(random_weights, "meta_model", tracking_meta)
    monkeypatch.setattr(int4, "quantize", counting)
    model = _int4()
    largest = max(
        sum(getattr(m, f"{n}_nibbles").numel() * 2 * 4 for n in names)  # fp32 floats, two per byte
        for m in model.modules()
        for names in [("weight",) if isinstance(m, Int4Linear) else ("gate_up_proj", "down_proj")]
        if isinstance(m, (Int4Linear, Int4Experts))
    )
    assert len(foreign) == sum(isinstance(m, Int4Experts) for m in model.modules())
    assert 0 < max(foreign) <= largest, (foreign, largest)


def test_load_random_in_4bit_speaks_a_reply(tiny_model_dir) -> None:
    from agent.engine.api import AudioOut, ReplyDone
    from agent.engine.runner.streaming import StreamingRunner

    loaded = random_weights.load_random(REAL, "cpu", str(tiny_model_dir), overrides=OVERRIDES, quantize="int4")
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert isinstance(loaded.model.thinker.lm_head, Int4Linear)
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
    done = [o for o in outs if isinstance(o, ReplyDone)]
    assert done and done[0].reason in ("stop", "length"), done
    assert sum(len(o.pcm) for o in outs if isinstance(o, AudioOut)) > 0
