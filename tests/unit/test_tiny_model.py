"""The tiny Qwen3-Omni checkpoint and the reference GenerateRunner.

Pins: make_tiny writes a checkpoint that from_pretrained loads back tensor-for-tensor; two
builds are identical (every weight seeded, including the talker experts transformers leaves
as torch.empty); a second make_tiny on a complete build returns without rebuilding; the
tokenizer carries the real checkpoint's special tokens in the real order with single-token
chat roles; transformers' generate() on audio + an image gives text and an AUDIBLE waveform
(code2wav calibrated, not the default ~-108 dBFS); GenerateRunner turns one reply into
StageTime, TextDelta, 1920-sample int16 AudioOut chunks and ReplyDone, honours text_only,
its caps, and cancellation.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from support import engine_drive

from agent.engine.api import AudioOut, ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.model import build_inputs
from agent.engine.checkpoints.tiny import BUILD_VERSION, MARKER_FILE, build_model, make_tiny
from agent.engine.checkpoints.tiny_tokenizer import ADDED_TOKENS
from agent.engine.runner.reference import SAMPLES_PER_FRAME, GenerateRunner, to_pcm16


def dbfs(pcm16: np.ndarray) -> float:
    rms = np.sqrt(np.mean((pcm16.astype(np.float64) / 32768.0) ** 2))
    return 20 * np.log10(max(rms, 1e-12))


def make_audio(seconds: float = 1.5) -> np.ndarray:
    return engine_drive.make_audio(seconds, 220, 7, onset_s=0.2, loud_first=False)


def make_image() -> np.ndarray:
    y, x = np.mgrid[0:64, 0:64]
    return np.stack([x * 4, y * 4, (x + y) * 2], axis=-1).astype(np.uint8)


def test_build_is_deterministic_and_round_trips_exactly(loaded):
    first, _ = build_model()
    second, _ = build_model()
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    on_disk = loaded.model.state_dict()
    assert on_disk.keys() == a.keys()
    for name in a:
        assert torch.equal(on_disk[name], a[name]), name
    # The talker experts are really initialised (not left empty/zero).
    experts = loaded.model.talker.model.layers[0].mlp.experts.gate_up_proj
    assert experts.abs().max() > 0 and torch.isfinite(experts).all()
    assert loaded.model.talker.model.layers[0].mlp.gate.weight.abs().max() > 0
    params = sum(p.numel() for p in loaded.model.parameters())
    assert 4e6 < params < 16e6, params


def test_make_tiny_is_idempotent(tiny_model_dir):
    marker = tiny_model_dir / MARKER_FILE
    assert json.loads(marker.read_text())["build_version"] == BUILD_VERSION
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert make_tiny(tiny_model_dir) == tiny_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before


def test_tokenizer_specials_and_roles(loaded):
    tok = loaded.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t, _ in ADDED_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ADDED_TOKENS))), "specials not in the real order"
    assert ids[0] >= 1000 and len(tok) == ids[-1] + 1
    for role in ("system", "user", "assistant"):
        assert len(tok.encode(role, add_special_tokens=False)) == 1, role
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.decode(build_inputs(loaded, make_audio(), [make_image()], "Be brief.")["input_ids"][0])
    # Audio first (prefilled while the user speaks), then the frames known at end of turn.
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|audio_start|>")
    assert prompt.endswith(
        "<|audio_end|><|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    text = "Hello agent, what do you see?"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_build_inputs_counts_media_tokens(loaded):
    inputs = build_inputs(loaded, make_audio(1.5), [make_image()], "Be brief.")
    ids = inputs["input_ids"][0]
    # 1.5 s -> 150 mel frames -> 13 tokens for the full second + 7 for the 50-frame tail.
    assert int(inputs["feature_attention_mask"].sum()) == 150
    assert int((ids == loaded.ids.audio_pad).sum()) == 20
    # 64x64 with 16-px patches merged 2x2 -> 2x2 = 4 tokens.
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((ids == loaded.ids.image_pad).sum()) == 4


def test_reference_generate_speaks_audibly(loaded):
    inputs = build_inputs(loaded, make_audio(1.5), [make_image()], "You are a helpful voice assistant.")
    sequences, wav = loaded.model.generate(
        **inputs,
        speaker=loaded.speaker,
        return_audio=True,
        thinker_do_sample=False,
        talker_do_sample=False,
        thinker_max_new_tokens=8,
        thinker_eos_token_id=loaded.thinker_eos_ids,
        talker_max_new_tokens=13,
    )
    new_tokens = sequences[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) > 0
    pcm = to_pcm16(wav)
    assert len(pcm) > 5 * SAMPLES_PER_FRAME
    assert dbfs(pcm) > -40.0, dbfs(pcm)


def test_generate_runner_emits_text_audio_done(loaded):
    runner = GenerateRunner(loaded, "You are a helpful voice assistant.", max_reply_tokens=6, max_reply_seconds=0.8)
    runner.open_session("s1")
    audio = make_audio(1.5)
    for i in range(0, len(audio), 1280):  # 80 ms pieces, as the media side sends them
        runner.append_audio("s1", audio[i : i + 1280])
    assert not runner.has_work()
    runner.begin_reply("s1", [make_image()])
    assert runner.has_work()
    outputs = runner.step()
    assert not runner.has_work()

    assert isinstance(outputs[0], StageTime) and outputs[0].stage == "generate" and outputs[0].seconds > 0
    deltas = [o for o in outputs if isinstance(o, TextDelta)]
    chunks = [o for o in outputs if isinstance(o, AudioOut)]
    done = outputs[-1]
    assert isinstance(done, ReplyDone) and done.session_id == "s1"
    assert len(deltas) == 1 and 0 < len(deltas[0].token_ids) <= 6
    assert done.text == deltas[0].text
    assert chunks and all(c.pcm.dtype == np.int16 for c in chunks)
    assert all(len(c.pcm) == SAMPLES_PER_FRAME for c in chunks[:-1])
    pcm = np.concatenate([c.pcm for c in chunks])
    assert len(pcm) <= 10 * SAMPLES_PER_FRAME  # 0.8 s cap = 10 frames
    assert dbfs(pcm) > -40.0
    assert done.reason in ("stop", "length")


def test_generate_runner_text_only_and_cancel(loaded):
    runner = GenerateRunner(loaded, "Be brief.", max_reply_tokens=4)
    runner.open_session("a")
    runner.append_audio("a", make_audio(1.0))
    runner.begin_reply("a", [], text_only=True)
    outputs = runner.step()
    assert not any(isinstance(o, AudioOut) for o in outputs)
    assert isinstance(outputs[-1], ReplyDone) and outputs[-1].stats["text_tokens"] <= 4

    runner.append_audio("a", make_audio(1.0))
    runner.begin_reply("a", [])
    runner.cancel_reply("a")
    assert runner.step() == [ReplyDone("a", "cancelled")]
    assert not runner.has_work()


def test_generate_runner_survives_an_immediate_end(loaded, eager_to_end):
    runner = GenerateRunner(loaded, "Be brief.", max_reply_tokens=6, max_reply_seconds=0.8)
    runner.open_session("s")
    runner.append_audio("s", make_audio(1.0))
    runner.begin_reply("s", [])
    outputs = runner.step()
    done = outputs[-1]
    assert isinstance(done, ReplyDone) and done.reason in ("stop", "length")
    # The end is held back for one token, so the reply has exactly one text token.
    assert done.stats["text_tokens"] == 1
