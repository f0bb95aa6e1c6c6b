"""A compiled start-up that is certain to end, fast when warm, with nothing left for the calls.

Pins:
- a process that compiled writes one artifacts file (agent/engine/compile/cache.py); a fresh
  process with an EMPTY inductor directory that loads it compiles the same function without
  generating code (inductor's FX graph cache: hits, no miss) and says "hit"; with a different
  key (another shape, another card) it finds no file and compiles cold ("miss");
- a torn or foreign file is a cold compile, not a failed start;
- the key holds the software, the target and the shapes, not where the model was loaded from;
- flex and flash read each row's length from the cache index: their decode graphs have one key
  length (a 1-wide mask) whatever the context, so a growing conversation needs no new graph;
  sdpa's windows double up to the capacity;
- the CUDA defaults: one compile for every batch bucket, each decoder layer a nested region, and
  `--compile-per-bucket` / `--no-compile-regions` / `--attention` / `--compile-budget-s` reach
  the graph settings;
- a step whose compile fails runs its eager function (same outputs, the reason kept), and once
  the start-up's compile budget is spent the steps not yet compiled run eagerly instead of
  compiling; once the runner serves, a failing call raises (it is not a compile's failure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.config import Config
from agent.engine.compile.cache import ArtifactFile, compiled_shapes, software_key
from agent.engine.compile.inductor import CompileSettings, StepCompiler
from agent.engine.compile.wiring import GraphConfig, Graphing
from agent.engine.ops.slots import SlotKV
from agent.engine.state.kv import KVState
from agent.flags import add_serve_arguments, config_from_args

REPO = Path(__file__).resolve().parents[2]

# One compile in a fresh process: load the file for KEY (if any), compile, save; print the
# cache state and inductor's FX graph cache lookups.
CHILD = """
import json, sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from agent.engine.compile.cache import ArtifactFile
artifacts = ArtifactFile(Path(sys.argv[1]), json.loads(sys.argv[2]))
state = artifacts.load()
step = torch.compile(lambda x: torch.softmax(x * 3, dim=-1).cumsum(-1) + x.amax(-1, keepdim=True), fullgraph=True)
x = torch.arange(24.0).view(4, 6)
out = step(x)
saved = artifacts.save() if state == "miss" else 0
print(json.dumps({"state": state, "saved": saved, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "sum": float(out.sum())}))
"""


def compile_in_fresh_process(root: Path, key: dict, inductor: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor), TORCHINDUCTOR_COMPILE_THREADS="1")
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps(key)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_fresh_process_with_the_file_generates_no_code(tmp_path):
    key = {"torch": torch.__version__, "shapes": [4, 6]}
    cold = compile_in_fresh_process(tmp_path / "cache", key, tmp_path / "inductor-a")
    assert cold["state"] == "miss" and cold["miss"] >= 1 and cold["saved"] > 0
    assert ArtifactFile(tmp_path / "cache", key).path.is_file()

    warm = compile_in_fresh_process(tmp_path / "cache", key, tmp_path / "inductor-b")  # an empty directory
    assert warm["state"] == "hit" and warm["hit"] >= 1 and warm["miss"] == 0, warm
    assert warm["sum"] == cold["sum"]

    other = compile_in_fresh_process(tmp_path / "cache", {**key, "shapes": [8, 6]}, tmp_path / "inductor-c")
    assert other["state"] == "miss" and other["miss"] >= 1  # another key: cold, and its own file
    assert len(list((tmp_path / "cache").glob("steps-*.bin"))) == 2


def test_a_torn_file_is_a_cold_start_not_a_failure(tmp_path):
    artifacts = ArtifactFile(tmp_path, {"a": 1})
    artifacts.path.write_bytes(b"not an artifact file")
    assert artifacts.load() == "miss"
    assert ArtifactFile(tmp_path / "absent", {"a": 1}).load() == "miss"


def test_the_key_names_software_target_and_shapes_not_the_path(loaded):
    kv = SlotKV(loaded.model.thinker.model.language_model, 2, 512, loaded.device, loaded.dtype)
    kv.reserve(512)
    shapes = compiled_shapes(loaded.model.config, loaded.dtype, 2, {"thinker": kv})
    moved = loaded.model.config.__class__.from_dict(loaded.model.config.to_dict())
    moved._name_or_path = "/somewhere/else"
    assert compiled_shapes(moved, loaded.dtype, 2, {"thinker": kv}) == shapes  # same model, other path
    assert compiled_shapes(loaded.model.config, loaded.dtype, 3, {"thinker": kv}) != shapes
    assert shapes["caches"] == {"thinker": (512, kv.backend)}
    software = software_key(torch.device("cpu"))
    assert software["torch"] == torch.__version__ and software["target"].startswith("cpu ")
    a = ArtifactFile(Path("/x"), {**software, **shapes})
    b = ArtifactFile(Path("/x"), {**software, **shapes, "slots": 3})
    assert (
        a.path != b.path
        and a.path == ArtifactFile(Path("/x"), dict(reversed(list({**software, **shapes}.items())))).path
    )


@pytest.mark.parametrize("backend", ["flex", "flash", "sdpa"])
def test_decode_graphs_are_keyed_by_length_only_where_the_kernel_reads_a_window(loaded, backend):
    graphing = Graphing(GraphConfig(mode="off", compile="on", min_key_len=64), loaded.device, 4)
    kv = SlotKV(loaded.model.thinker.model.language_model, 5, 1024, loaded.device, loaded.dtype, backend)
    kv.reserve(1024)
    widths = set()
    for length in (10, 100, 300, 700, 1000):
        rows = graphing.decode_rows([KVState(0, length, length), KVState(1, 5, 5)], kv, loaded.device)
        widths.add(rows.mask.shape[-1])
        assert rows.mask.shape[-1] >= length + 1 or not kv.windowed
    if backend == "sdpa":
        assert graphing.key_lens(kv) == [64, 128, 256, 512, 1024] and widths == {64, 128, 512, 1024}
    else:
        assert graphing.key_lens(kv) == [1] and widths == {1}  # one graph per bucket, any context


def test_cuda_defaults_compile_once_for_every_bucket_with_layer_regions(loaded):
    cuda = Graphing(GraphConfig(mode="off", compile="on"), torch.device("cuda"), 4)  # (wiring only: no CUDA call)
    assert cuda.compiler is not None and cuda.compiler.settings.dynamic_batch and cuda.compiles_regions
    per_bucket = GraphConfig(mode="off", compile="on", compile_dynamic_batch=False, compile_regions=False)
    assert not Graphing(per_bucket, torch.device("cuda"), 4).compiles_regions
    cpu = Graphing(GraphConfig(mode="off", compile="on"), loaded.device, 4)
    assert cpu.compiler is not None and cpu.compiler.settings.dynamic_batch
    assert not cpu.compiles_regions  # CPU compiles only when asked, and then inlined unless told
    assert Graphing(GraphConfig(mode="off", compile="on", compile_regions=True), loaded.device, 4).compiles_regions
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--compile-per-bucket", "--no-compile-regions", "--attention", "flex"])
    )
    assert config.compile_per_bucket and config.compile_regions is False and config.attention == "flex"
    assert Config().compile_regions is None and not Config().compile_per_bucket and Config().attention == "auto"


def _untraceable(x: torch.Tensor) -> torch.Tensor:
    # A host round trip through bytes: dynamo cannot trace it with fullgraph=True.
    scale = float(len(x.numpy().tobytes()) % 7 + 1)
    return x * scale


def test_a_failed_compile_runs_the_step_eagerly_and_says_why():
    compiler = StepCompiler(CompileSettings(dynamic_batch=True), (1, 4))
    step = compiler.wrap("untraceable", _untraceable)
    x = torch.randn(4, 3)
    torch.testing.assert_close(step(x), _untraceable(x))
    torch.testing.assert_close(step(x[:1]), _untraceable(x[:1]))
    assert "compile failed" in compiler.fallbacks()["untraceable"] and step.stats.eager == 2
    # Once serving, a failure is the call's own: it is raised, not hidden behind an eager run.
    serving = StepCompiler(CompileSettings(dynamic_batch=True), (1, 4))
    late = serving.wrap("untraceable", _untraceable)
    serving.finish_start_up()
    with pytest.raises(Exception, match="tobytes|Unsupported|numpy"):
        late(x)
    assert not serving.fallbacks()


def test_a_spent_budget_leaves_later_steps_eager_and_compiled_ones_compiled():
    compiler = StepCompiler(CompileSettings(dynamic_batch=True, budget_s=1e-9), (1, 4))
    first = compiler.wrap("first", lambda x: torch.softmax(x, -1) * 2)
    second = compiler.wrap("second", lambda x: torch.softmax(x, -1) * 3)
    x = torch.randn(4, 5)
    first(x)  # compiles: nothing spent yet; its seconds spend the (tiny) budget
    assert first.stats.compiles and not first.stats.fallback
    torch.testing.assert_close(second(x), torch.softmax(x, -1) * 3)
    assert not second.stats.compiles and "budget" in compiler.fallbacks()["second"]
    first(x)  # already compiled: still compiled
    assert first.stats.calls == 2 and "first" not in compiler.fallbacks()
