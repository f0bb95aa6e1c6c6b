"""A hub-shaped checkpoint at real widths: its files, and the host memory loading it takes.

Pins, on Qwen3-Omni-30B-A3B's real widths with one layer in every stack (random bf16 weights
written by agent/engine/hub_checkpoint.py once for the module, ~3.3 GiB, the tiny tokenizer):
- the folder has the released shape: several safetensors shards holding per-expert keys; a
  config.json with `rope_scaling` and `rope_theta` beside it (no `rope_parameters`) in the thinker's
  and the talker's text configs, `rope_theta` in the code predictor's and code2wav's,
  `torch_dtype` bfloat16 and the architecture; Qwen's preprocessor_config.json (128 mels,
  16-px patches merged 2x2); a generation_config.json;
- transformers reads that config into the preset's RoPE (sections [24, 20, 20] interleaved,
  theta 1e6; code2wav 1e4) and the talker's norm_topk_prob (true);
- load_model in a fresh process onto a device that is not host memory ("meta": placement, no
  bytes read) holds at most 10% of the checkpoint in anonymous host memory at any moment (the
  old from_pretrained-then-.to(device) path staged ~70% of it: every expert tensor);
- load_model onto the CPU in float32 works (every parameter float32, on the CPU) and holds,
  beyond the process before it and the model after it, at most half the model's bytes (one
  layer's experts being stacked), never a second copy;
- on CUDA (`-m gpu`): loading onto the GPU holds at most 10% of the checkpoint + 1 GiB of host
  memory.
Host memory is anonymous RSS (agent/engine/load_memory.py): the mapped shards are page cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.engine.load_memory import LoadMemory, measure_load_in_subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir: Path) -> Path:
    """Written in a subprocess, so that this process never holds the model (3.3 GiB)."""
    dst = tmp_path_factory.mktemp("hub") / "qwen3-omni-1-layer"
    subprocess.run([sys.executable, "-m", "agent.engine.hub_checkpoint", str(dst), "--layers", "1",
                    "--tokenizer-from", str(tiny_model_dir)], cwd=ROOT, check=True, capture_output=True)
    return dst


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
    assert (pre["feature_size"], pre["hop_length"], pre["n_fft"], pre["sampling_rate"], pre["chunk_length"]) == \
        (128, 160, 400, 16000, 300)
    assert (pre["patch_size"], pre["temporal_patch_size"], pre["merge_size"]) == (16, 2, 2)
    assert (pre["min_pixels"], pre["max_pixels"], pre["image_mean"]) == (3136, 12845056, [0.5, 0.5, 0.5])
    assert json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert (checkpoint / "tokenizer_config.json").is_file()


def test_transformers_reads_the_released_config_as_the_preset(checkpoint: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    for text in (config.thinker_config.text_config, config.talker_config.text_config):
        rope = text.rope_parameters
        assert (rope["rope_type"], rope["rope_theta"], rope["mrope_section"], rope["interleaved"]) == \
            ("default", 1_000_000, [24, 20, 20], True)
    assert config.code2wav_config.rope_parameters["rope_theta"] == 10_000
    assert config.talker_config.code_predictor_config.rope_parameters["rope_theta"] == 1_000_000
    assert config.talker_config.text_config.norm_topk_prob is True
    assert config.talker_config.text_config.num_experts == 128


def test_a_load_onto_another_device_keeps_the_checkpoint_off_the_host(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "meta", "bfloat16")
    assert load.device == "meta" and load.model_bytes > 0.9 * _bytes(checkpoint)
    held = load.anon_peak - load.anon_before
    assert held <= 0.10 * _bytes(checkpoint), _report(load, checkpoint)


def test_a_float32_load_onto_the_cpu_works_without_a_second_copy(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "cpu", "float32")
    assert (load.device, load.dtype, load.param_dtypes) == ("cpu", "float32", "float32")
    assert load.model_bytes > 1.9 * _bytes(checkpoint)  # bf16 on disk, float32 in memory
    assert load.staging <= 0.5 * load.model_bytes, _report(load, checkpoint)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_onto_the_gpu_keeps_the_checkpoint_off_the_host(checkpoint: Path) -> None:
    load = measure_load_in_subprocess(checkpoint, "cuda", "bfloat16")
    assert load.device.startswith("cuda") and load.param_dtypes == "bfloat16"
    assert load.anon_peak - load.anon_before <= 0.10 * _bytes(checkpoint) + 2**30, _report(load, checkpoint)


def _report(load: LoadMemory, checkpoint: Path) -> str:
    gib = 2**30
    return (f"checkpoint {_bytes(checkpoint) / gib:.2f} GiB; anonymous RSS before {load.anon_before / gib:.2f}, "
            f"peak {load.anon_peak / gib:.2f}, after {load.anon_after / gib:.2f} GiB; staging "
            f"{load.staging / gib:.2f} GiB; model {load.model_bytes / gib:.2f} GiB on {load.device}")
