"""4-bit weights (agent/engine/quant): the packing, the modules, the checkpoint, and exactness.

Pins:
- int4 packing: codes by halves of a row (byte j = input j low, input j + K/2 high), every
  weight within half a step of its group's grid, each group's min and max on the grid, meta
  tensors give shapes only, and a row that does not split into groups is refused; a layer only
  16 divides (the vision blocks' fc2) is 4-bit at group 16, but stays float under the scheme of a
  checkpoint written before group 16 existed (so that such a checkpoint still loads);
- `Int4Linear` computes F.linear with its dequantized weight; `Int4Experts` equals transformers'
  experts module loaded with the same dequantized stacks (bit for bit), and a fused MoE block
  over 4-bit experts equals the float block on the same weights, prefill and decode; a
  prefill unpacks the stacks a slice of rows at a time (never a whole stack) to the same result;
- `quantize_model` swaps the layers docs/quantization.md lists (the thinker's token table
  included, looked up row by row) and keeps the rest;
- `omni-agent quantize SRC DST` writes a checkpoint whose quantized layers hold no float weight,
  which loads onto the same numbers as quantizing after a float load (`--keep-embeddings`: a
  float token table, loaded as one); a second quantize of
  its output and a folder without config.json are refused with exit status 2;
- the memory plan counts the 4-bit model (weights, fused predictor copies, the prefill's
  unpacked expert stack) from the config alone, as the loaded model measures;
- with the same 4-bit weights, the streaming runner equals generate() (text, codes, waveform),
  eager and compiled, one session and two stepped together;
- compiled with fused projections (the CUDA default), the decode steps over 4-bit weights equal
  the eager steps and call no library matmul.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.compiled import fused_per_batch, generated_code
from support.engine_drive import SYSTEM, assert_steps_equal_eager, fill_with_noise
from support.exact import SECONDS, TOKENS, assert_same, make_audio, make_image, reference, stream_turn
from torch.nn import functional as F

from agent.engine.instruments.kernel_count import KernelCounter
from agent.engine.quant.apply import CONFIG_KEY, QuantScheme, quantize_model
from agent.engine.quant.int4 import LEVELS, dequantize, group_for, quantize
from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear
from agent.engine.runner.streaming import StreamingRunner


def test_packing_by_halves_and_round_to_nearest() -> None:
    from agent.engine.quant import int4

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 256, generator=gen)
    p = quantize(w, 64)
    assert p.nibbles.shape == (3, 8, 128) and p.nibbles.dtype == torch.uint8
    assert p.scale.shape == p.low.shape == (3, 8, 4) and p.group == 64
    back = dequantize(p.nibbles, p.scale, p.low)
    lows, steps = p.low.repeat_interleave(64, dim=-1), p.scale.repeat_interleave(64, dim=-1)
    # Every weight inside its group's grid is within half a step of its code's value; the
    # clipped ones (outside the grid) sit at its ends.
    inside = (w >= lows - 1e-6) & (w <= lows + LEVELS * steps + 1e-6)
    assert float(((back - w).abs() - steps / 2)[inside].max()) <= 1e-5
    assert torch.equal(back[~inside], torch.where(w < lows, lows, lows + LEVELS * steps)[~inside])
    # The codes: byte j holds input j (low nibble) and input j + 128 (high nibble).
    codes = torch.round((w - lows) / steps).clamp(0, LEVELS).to(torch.uint8)
    assert torch.equal(p.nibbles & 0xF, codes[..., :128]) and torch.equal(p.nibbles >> 4, codes[..., 128:])
    # The range search never does worse than the plain min-max grid, group by group.
    saved, int4.SHRINKS = int4.SHRINKS, (1.0,)
    try:
        plain = quantize(w, 64)
    finally:
        int4.SHRINKS = saved
    plain_back = dequantize(plain.nibbles, plain.scale, plain.low)
    err = (back - w).square().view(3, 8, 4, 64).sum(-1)
    plain_err = (plain_back - w).square().view(3, 8, 4, 64).sum(-1)
    assert bool((err <= plain_err + 1e-6).all()) and float(err.sum()) < 0.95 * float(plain_err.sum())
    assert torch.allclose(plain_back.view(3, 8, 4, 64).amax(-1), w.view(3, 8, 4, 64).amax(-1), atol=1e-5)

    meta = quantize(torch.empty(5, 256, device="meta"), 128)
    assert (
        meta.nibbles.device.type == "meta" and meta.nibbles.shape == (5, 128) and meta.nbytes == 5 * 128 + 2 * 5 * 2 * 4
    )
    assert group_for(256) == 128 and group_for(64) == 64 and group_for(96) == 32 and group_for(20) is None
    assert group_for(4304) == 16 and group_for(4304, smallest=32) is None  # the vision blocks' fc2
    with pytest.raises(ValueError, match="groups"):
        quantize(w, 48)


def test_modules_equal_their_float_forwards(loaded) -> None:
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=False).requires_grad_(False)
    q = Int4Linear.from_linear(linear, 32)
    x = torch.randn(4, 64, generator=gen)
    assert torch.equal(q(x), F.linear(x, q.weight))
    assert 0 < float((q.weight - linear.weight).abs().max()) < float(linear.weight.abs().max())

    block = loaded.model.thinker.model.language_model.layers[0].mlp
    experts = block.experts
    q4 = Int4Experts.from_experts(experts, 32, 32)
    reference = type(experts)(loaded.model.config.thinker_config.text_config)
    with torch.no_grad():
        reference.gate_up_proj.copy_(q4.gate_up_proj)
        reference.down_proj.copy_(q4.down_proj)
    hidden = torch.randn(6, experts.hidden_dim, generator=gen)
    index = torch.randint(0, experts.num_experts, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    assert torch.equal(q4(hidden, index, weights), reference(hidden, index, weights))
    assert torch.equal(q4.pick("down_proj", index), q4.down_proj[index])


def test_fused_block_over_4bit_experts_equals_the_float_block(loaded) -> None:
    import copy

    from agent.engine.ops.moe import FusedSparseMoeBlock

    block = copy.deepcopy(loaded.model.talker.model.layers[0].mlp)
    block.experts = Int4Experts.from_experts(block.experts, 32, 32)
    dense = copy.deepcopy(loaded.model.talker.model.layers[0].mlp)
    with torch.no_grad():
        dense.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        dense.experts.down_proj.copy_(block.experts.down_proj)
    fused = FusedSparseMoeBlock(block)
    gen = torch.Generator().manual_seed(2)
    for shape in ((1, 5, 64), (3, 1, 64)):  # a prefill (grouped) and a decode (gathered picks)
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(fused(x), dense(x), rtol=1e-5, atol=1e-5)


def test_a_prefill_unpacks_4bit_experts_a_slice_of_rows_at_a_time(loaded, monkeypatch) -> None:
    import copy

    from agent.engine.ops import moe
    from agent.engine.quant import modules

    block = copy.deepcopy(loaded.model.talker.model.layers[0].mlp)
    block.experts = Int4Experts.from_experts(block.experts, 32, 32)
    fused = moe.FusedSparseMoeBlock(block)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(5))
    whole = fused(x)
    experts = block.experts
    stack = experts.gate_up_proj
    per_row = stack.shape[0] * stack.shape[2] * stack.element_size()
    # A budget of three rows: gate/up and down each come in several slices.
    monkeypatch.setattr(modules, "UNPACK_SLICE_BYTES", 3 * per_row)
    parts = experts.unpacked_slices("gate_up_proj")
    assert len(parts) == -(-stack.shape[1] // 3) and max(p().shape[1] for p in parts) <= 3
    assert torch.equal(torch.cat([p() for p in parts], dim=1), stack)
    assert experts.largest_slice_bytes() == 3 * per_row < stack.numel() * stack.element_size()
    sizes: list[int] = []
    grouped = moe._grouped_matmul

    def counted(x, weight, offs):
        sizes.append(weight.numel() * weight.element_size())
        return grouped(x, weight, offs)

    monkeypatch.setattr(moe, "_grouped_matmul", counted)
    torch.testing.assert_close(fused(x), whole, rtol=1e-6, atol=1e-6)
    assert len(sizes) > 2 and max(sizes) <= 3 * per_row  # never a whole stack


def test_quantize_model_swaps_the_listed_layers(tiny_model_dir) -> None:
    from agent.engine.checkpoints.model import load_model

    model = load_model(str(tiny_model_dir)).model
    report = quantize_model(model, QuantScheme())
    names = set(report.quantized)
    lm = "thinker.model.language_model.layers.0"
    assert {f"{lm}.self_attn.q_proj", f"{lm}.mlp.experts", "thinker.lm_head", "talker.codec_head"} <= names
    assert {"talker.code_predictor.lm_head.14", "talker.code_predictor.model.layers.0.mlp.down_proj"} <= names
    assert "talker.model.layers.0.mlp.shared_expert.down_proj" in names
    assert {"thinker.model.audio_tower.layers.0.fc1", "thinker.model.visual.blocks.0.attn.qkv"} <= names
    assert "code2wav.pre_transformer.layers.0.self_attn.q_proj" in names
    assert not any(n.endswith(("shared_expert.gate_proj", "shared_expert_gate")) for n in names)
    assert not any(n.startswith("talker.text_projection") for n in names)
    fc1 = model.thinker.model.audio_tower.layers[0].fc1
    assert isinstance(fc1, Int4Linear) and fc1.bias is not None  # a bias stays a float parameter
    # The thinker's token table is 4-bit, looked up row by row; the other tables stay float.
    float_table = load_model(str(tiny_model_dir)).model.thinker.model.language_model.embed_tokens
    table = model.thinker.model.language_model.embed_tokens
    assert isinstance(table, Int4Embedding) and table.num_embeddings == float_table.num_embeddings
    ids = torch.tensor([[0, 5, 1056], [7, 7, 3]])
    assert torch.equal(table(ids), table.weight[ids])
    assert 0 < float((table(ids) - float_table(ids)).abs().max()) < float(float_table.weight.abs().max())
    assert isinstance(model.talker.model.codec_embedding, torch.nn.Embedding)
    assert quantize_model(model, QuantScheme()).quantized == []  # idempotent
    tables_kept = quantize_model(load_model(str(tiny_model_dir)).model, QuantScheme(embeddings=False))
    assert set(tables_kept.quantized) == names - {"thinker.model.language_model.embed_tokens"}
    heads_kept = quantize_model(load_model(str(tiny_model_dir)).model, QuantScheme(heads=False))
    assert "thinker.lm_head" not in heads_kept.quantized and len(heads_kept.quantized) == len(names) - 2
    decoders = quantize_model(load_model(str(tiny_model_dir)).model, QuantScheme(encoders=False))
    assert not any(
        n.startswith(("thinker.model.audio", "thinker.model.visual", "code2wav")) for n in decoders.quantized
    )


def test_rows_only_16_divides_are_4bit_unless_the_checkpoint_predates_group_16() -> None:
    def model() -> torch.nn.Module:
        # The path of the vision blocks' second MLP projection (4304 inputs at real size).
        root, node = torch.nn.Module(), None
        root.thinker = torch.nn.Module()
        root.thinker.model = torch.nn.Module()
        root.thinker.model.visual = node = torch.nn.Module()
        node.fc2 = torch.nn.Linear(48, 8)
        return root

    now = model()
    report = quantize_model(now, QuantScheme())
    assert report.quantized == ["thinker.model.visual.fc2"] and report.kept == []
    fc2 = now.thinker.model.visual.fc2
    assert isinstance(fc2, Int4Linear) and fc2.packed.group == 16
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fc2(x), F.linear(x, fc2.weight, fc2.bias))
    # A checkpoint written before group 16 existed has no smallest_group in its config: loading it
    # quantizes the meta model as its writer did, so the layer stays float and its weight loads.
    older = QuantScheme.from_json({"method": "int4", "group": 128, "encoders": True})
    assert older.smallest_group == 32 and QuantScheme.from_json(QuantScheme().to_json()) == QuantScheme()
    before = model()
    report = quantize_model(before, older)
    assert report.quantized == [] and report.kept == [
        ("thinker.model.visual.fc2", "48 inputs do not split into groups")
    ]
    assert type(before.thinker.model.visual.fc2) is torch.nn.Linear
    for bad in ({"smallest_group": 8}, {"group": 8}, {"group": 129}):
        with pytest.raises(ValueError, match="smallest_group"):
            QuantScheme(**bad)


def test_quantize_command_writes_a_checkpoint_that_loads_the_same(tiny_model_dir, tmp_path, capsys) -> None:
    from safetensors import safe_open

    from agent.__main__ import main
    from agent.engine.checkpoints.model import load_model

    dst = tmp_path / "int4"
    assert main(["quantize", str(tiny_model_dir), str(dst)]) == 0
    assert "modules quantized" in capsys.readouterr().out
    config = json.loads((dst / "config.json").read_text())
    assert config[CONFIG_KEY] == {
        "method": "int4",
        "group": 128,
        "smallest_group": 16,
        "heads": True,
        "encoders": True,
        "embeddings": True,
    }
    assert (dst / "tokenizer.json").exists() and (dst / "preprocessor_config.json").exists()
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    expert = "thinker.model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert f"{expert}_nibbles" in index and expert not in index
    assert "thinker.model.language_model.layers.0.self_attn.q_proj.weight" not in index
    with safe_open(str(dst / index[f"{expert}_nibbles"]), "pt") as f:
        assert f.get_tensor(f"{expert}_nibbles").dtype == torch.uint8

    stored = load_model(str(dst)).model
    after = load_model(str(tiny_model_dir), quantize="int4").model
    a, b = stored.state_dict(), after.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(stored.buffers(), after.buffers()))
    assert stored.generation_config.to_dict() == after.generation_config.to_dict()

    table = "thinker.model.language_model.embed_tokens.weight"
    assert f"{table}_nibbles" in index and table not in index
    kept = tmp_path / "tables-kept"
    assert main(["quantize", str(tiny_model_dir), str(kept), "--keep-embeddings"]) == 0
    assert json.loads((kept / "config.json").read_text())[CONFIG_KEY]["embeddings"] is False
    assert table in json.loads((kept / "model.safetensors.index.json").read_text())["weight_map"]
    embed = load_model(str(kept)).model.thinker.model.language_model.embed_tokens
    assert type(embed) is torch.nn.Embedding

    assert main(["quantize", str(dst), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["quantize", str(tiny_model_dir), str(tmp_path / "y"), "--group", "8"]) == 2
    assert "smallest_group" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_memory_plan_counts_the_4bit_model(tiny_model_dir) -> None:
    from transformers import AutoConfig

    from agent.engine.checkpoints.model import complete_config, load_model
    from agent.engine.model_memory import ModelMemory

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    complete_config(config)
    planned = ModelMemory.from_config(config, torch.float32, 10.0, quantize="int4")
    measured = ModelMemory.of_model(load_model(str(tiny_model_dir), quantize="int4").model, 10.0)
    assert planned == measured
    full = ModelMemory.from_config(config, torch.float32, 10.0)
    assert planned.weights < full.weights and planned.engine_weights < full.engine_weights
    assert full.unpacked_experts == 0 < planned.unpacked_experts


@pytest.fixture(scope="module")
def quantized(tiny_model_dir):
    from agent.engine.checkpoints.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_model_dir), quantize="int4")


@pytest.fixture(params=["eager", "compiled"])
def compiled(request, compiled_options) -> dict:
    return compiled_options if request.param == "compiled" else {}


def test_streaming_equals_generate_with_4bit_weights(quantized, compiled) -> None:
    audio, image = make_audio(1.5, 220, 1), make_image(0)
    ref = reference(quantized, audio, [image])
    runner = StreamingRunner(
        quantized, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, **compiled
    )
    runner.open_session("s")
    stream_turn(runner, "s", audio, [image])
    assert_same(runner.records["s"], ref)


def test_two_sessions_stepped_together_equal_generate_with_4bit_weights(quantized, compiled) -> None:
    from agent.engine.api import ReplyDone

    inputs = {"a": (make_audio(1.2, 200, 3), [make_image(5)]), "b": (make_audio(1.0, 310, 4), [])}
    runner = StreamingRunner(
        quantized, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True, **compiled
    )
    for sid, (audio, _) in inputs.items():
        runner.open_session(sid)
        for i in range(0, len(audio), 1280):
            runner.append_audio(sid, audio[i : i + 1280])
    for sid, (_, images) in inputs.items():
        runner.begin_reply(sid, images)
    done = set()
    while runner.has_work():
        done |= {o.session_id for o in runner.step() if isinstance(o, ReplyDone)}
    assert done == {"a", "b"}
    for sid, (audio, images) in inputs.items():
        assert_same(runner.records[sid], reference(quantized, audio, images))
    assert np.all([r.codes.shape[1] > 0 for r in runner.records.values()])


def test_fused_decode_steps_read_4bit_weights_in_their_reductions(quantized, compiled_options) -> None:
    """The GPU's default decode path on CPU: thinker and talker steps compiled per batch with
    fused projections over 4-bit q/k/v, o_proj, experts and heads equal the eager steps, and the
    compiled code calls no library matmul: the unpacking is part of the generated reductions."""
    from agent.engine.ops.fusion import fuse_decoder
    from agent.engine.ops.moe import fuse_moe
    from agent.engine.stages.talker import TalkerOps
    from agent.engine.stages.thinker import ThinkerOps

    model = quantized.model
    fuse_moe(model)
    fuse_decoder(model.thinker.model.language_model)
    fuse_decoder(model.talker.model)
    assert hasattr(model.thinker.model.language_model.layers[0].self_attn, "qkv_int4")
    graphing = fused_per_batch(quantized, compiled_options)
    thinker, talker = ThinkerOps(quantized, 6, 512, graphing), TalkerOps(quantized, 6, 512, graphing=graphing)
    assert thinker.fused_gemv and talker.fused_gemv
    gen = torch.Generator().manual_seed(7)
    fill_with_noise(thinker, talker, gen=gen)
    with KernelCounter() as counter:
        assert_steps_equal_eager(thinker, talker, 3, gen)
    assert len(counter.sources) >= 2, "the steps did not run compiled"
    code = generated_code(counter)
    assert not [line for line in code if "extern_kernels.mm" in line or "grouped_mm" in line]


def test_a_24_gib_card_holds_the_4bit_model_for_two_sessions_with_no_flags() -> None:
    """The real model counted on meta: refused in bf16; in 4-bit, with the default 3 GiB reserve,
    the plan derives 2 sessions at >= 8192 tokens with no flag (no pad row with two slots, the
    prefill's experts unpacked in slices, the token table 4-bit). Without those three it did
    not: one session, or a refusal."""
    from agent.engine.checkpoints.presets import REAL, preset_config
    from agent.engine.memory_plan import RESERVE_BYTES, MemoryPlanError, plan
    from agent.engine.model_memory import RTX4090, GiB, ModelMemory

    config = preset_config(REAL)
    int4 = ModelMemory.from_config(config, torch.bfloat16, 60.0, quantize="int4")
    assert 17 * GiB < int4.weights < 18.5 * GiB and int4.unpacked_experts <= 256 * 2**20
    with pytest.raises(MemoryPlanError):
        plan(ModelMemory.from_config(config, torch.bfloat16, 60.0), RTX4090.free)
    derived = plan(int4, RTX4090.free)
    assert derived.reserve == RESERVE_BYTES == 3 * GiB
    assert derived.sessions == 2 and derived.context >= 8192 and derived.rows == 2
    assert derived.need <= RTX4090.free
