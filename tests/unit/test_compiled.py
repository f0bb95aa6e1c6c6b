"""The compiled per-frame path (agent/engine/compile/inductor.py) equals the eager one, on the tiny model.

Pins:
- each compiled step function (thinker decode, talker step, the whole code-predictor loop,
  code2wav's push) gives the eager function's outputs and state writes, for every batch bucket
  (1, 2, 4, 8, 16) and for a batch padded up to its bucket (3 -> 4) (the code predictor with
  fused projections, as CUDA compiles it: tests/unit/test_gemv.py);
- the compiled end-of-turn prefills (thinker and talker, one compile for every batch, token
  bucket and key window) give the eager prefill's logits, hidden states and cache writes for
  ragged rows across token buckets;
- on CPU one compile serves every bucket (the batch dim is unbacked: one graph for every batch;
  sdpa's full-capacity key window one more), made at start-up: the runner's constructor
  compiles, live calls do not (dynamo compiles no new graph);
- contexts growing past every attention window after start-up compile nothing and capture
  nothing: every window's graph exists before the runner is ready;
- per-bucket mode compiles once per bucket seen, never for a padded batch's own size, and runs a
  batch above every bucket eagerly;
- `--compile` / `--no-compile` / `--compile-regions` reach the runner, and "auto" leaves CPU eager.
The streaming-equals-generate() tests run with compilation on as well (test_streaming_exact.py).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from support.engine_drive import assert_loop_equals_eager, assert_steps_equal_eager, fill_with_noise
from torch._dynamo.utils import counters

from agent.engine.compile.capture import GraphPool
from agent.engine.compile.inductor import CompiledStep, CompileSettings, PaddedBackend
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.bucketed_prefill import PrefillRow
from agent.engine.state.kv import KVState
from agent.flags import add_serve_arguments, config_from_args

BATCHES = (1, 2, 3, 4, 8, 16)  # every bucket, and 3 padded to 4


@pytest.fixture(scope="module")
def runner(loaded, compiled_options):
    torch.manual_seed(0)
    graphs_before = counters["stats"]["unique_graphs"]
    runner = StreamingRunner(loaded, "hi", **compiled_options)
    fill_with_noise(runner.thinker, runner.talker)
    runner.graphs_at_start = counters["stats"]["unique_graphs"]  # dynamo's compiled graphs so far
    runner.start_up_graphs = runner.graphs_at_start - graphs_before
    return runner


def test_start_up_compiles_each_step_once_for_every_bucket(runner):
    compiler = runner.graphing.compiler
    assert compiler is not None and runner.graphing.batch_sizes == (1, 2, 4, 8, 16)
    seconds = compiler.compile_seconds()
    assert set(seconds) == {
        "thinker_decode",
        "talker_step",
        "code_predictor",
        "code2wav",
        "thinker_prefill",
        "talker_prefill",
    }
    assert all(list(s) == [0] for s in seconds.values()), seconds  # 0: one function for all buckets
    # ... and one graph each for every batch: no batch size (1, or conv's >= 16 on CPU) traced a
    # graph of its own. Over sdpa's slot caches the key window equal to the cache's capacity is a
    # slice of the whole cache, contiguous, which the trace guards on: one more graph for it, made
    # at start-up with every window (none is left for a call).
    windowed = {"thinker_decode", "talker_step", "thinker_prefill", "talker_prefill"}
    graphs = compiler.graph_counts()
    assert graphs == {step: 2 if step in windowed else 1 for step in seconds}, graphs
    assert runner.start_up_graphs == sum(graphs.values())


@pytest.mark.parametrize("batch", BATCHES)
def test_thinker_and_talker_steps_equal_eager(runner, batch):
    assert_steps_equal_eager(runner.thinker, runner.talker, batch, torch.Generator().manual_seed(batch))
    assert runner.graphing.compiler.steps["thinker_decode"].stats.calls > 0


@pytest.mark.parametrize("batch", BATCHES)
def test_code_predictor_loop_equals_eager(runner, batch):
    assert_loop_equals_eager(runner.frames.predictor, batch, seed=100 + batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_code2wav_push_equals_eager_with_its_state(runner, batch):
    gen = torch.Generator().manual_seed(200 + batch)
    c2w = runner.frames.code2wav
    slots = torch.randperm(16, generator=gen)[:batch]
    quantizers = c2w.code2wav.config.num_quantizers

    def snapshot():
        return [t.clone() for t in (*c2w.states.values(), c2w.key_pos, *c2w.kv.keys, *c2w.kv.values)]

    def restore(saved):
        for t, s in zip((*c2w.states.values(), c2w.key_pos, *c2w.kv.keys, *c2w.kv.values), saved):
            t.copy_(s)

    with torch.inference_mode():
        for frame in range(3):  # fresh rows first, then rows with conv state and ring entries
            codes = torch.randint(0, 2048, (batch, quantizers, 1), generator=gen)
            frames = torch.full((batch,), frame, dtype=torch.long)
            fresh = torch.full((batch,), int(frame == 0), dtype=torch.long)
            before = snapshot()
            compiled = c2w._graph(codes, slots, frames, fresh).clone()
            after = snapshot()
            restore(before)
            eager = c2w._step(codes, slots, frames, fresh)
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
            for got, want in zip(after, snapshot()):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ops_name", ["thinker", "talker"])
@pytest.mark.parametrize("lengths", [(16,), (3, 20, 9), (40, 64)])
def test_prefill_buckets_equal_eager(runner, ops_name, lengths):
    ops = getattr(runner, ops_name)
    prefiller = ops.prefiller
    gen = torch.Generator().manual_seed(sum(lengths))
    hidden = prefiller.body.config.hidden_size
    rows = []
    for slot, n in zip(torch.randperm(15, generator=gen)[: len(lengths)].tolist(), lengths):
        start = int(torch.randint(0, 100, (1,), generator=gen))
        rope = (start + torch.arange(n)).expand(3, -1).clone()
        rows.append(PrefillRow(slot + 1, start, torch.randn(n, hidden, generator=gen), rope))
    pool = prefiller.pool
    assert pool is not None
    with torch.inference_mode():
        compiled = prefiller.run(rows)
        written = [(k.clone(), v.clone()) for k, v in zip(ops.kv.keys, ops.kv.values)]
        prefiller.pool = None
        try:
            eager = prefiller.run(rows)
        finally:
            prefiller.pool = pool
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.last_hidden, eager.last_hidden, rtol=1e-4, atol=1e-4)
    if eager.captured is not None:
        for got, want in zip(compiled.captured, eager.captured, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (k, v), k2, v2 in zip(written, ops.kv.keys, ops.kv.values):
        for row in rows:  # the real tokens' keys and values (pads differ by design: not read)
            span = slice(row.start, row.start + row.n)
            torch.testing.assert_close(k[row.slot, :, span], k2[row.slot, :, span], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v[row.slot, :, span], v2[row.slot, :, span], rtol=1e-4, atol=1e-4)
    assert runner.graphing.compiler.steps[f"{ops_name}_prefill"].stats.calls > 0


def test_live_calls_never_recompiled(runner):
    # Every bucket, padded batches and fresh inputs above ran on what start-up compiled.
    assert runner.graphs_at_start > 0
    assert counters["stats"]["unique_graphs"] == runner.graphs_at_start


def test_growing_contexts_compile_and_capture_nothing_after_start_up(runner):
    graphing = runner.graphing
    windows = graphing.key_lens(runner.thinker.kv)
    assert len(windows) >= 3  # the contexts below cross several windows
    graphs = counters["stats"]["unique_graphs"]
    captures = {name: pool.stats.captures for name, pool in graphing.pools.items()}
    hidden = runner.loaded.model.talker.config.text_config.hidden_size
    with torch.inference_mode():
        for length in [n - 1 for n in windows] + [windows[0]]:  # each window's last key, then back
            for batch in (1, 3):
                runner.thinker.decode([KVState(s, length, length) for s in range(batch)], [5] * batch)
                runner.talker.step([KVState(s, length, length) for s in range(batch)], torch.zeros(batch, 1, hidden))
    assert counters["stats"]["unique_graphs"] == graphs
    assert {name: pool.stats.captures for name, pool in graphing.pools.items()} == captures
    # ... and each decode step really ran at every window (one graph per bucket and window).
    decode = graphing.pools["thinker_decode"]._state.graphs
    assert {key[-1][0][1] for key in decode} == set(windows)


def test_per_bucket_mode_compiles_once_per_bucket_and_runs_big_batches_eagerly():
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 2, dim=-1) + x.sum(-1, keepdim=True)

    compiled = CompiledStep("toy", step, (1, 2, 4), CompileSettings(dynamic_batch=False))
    pool = GraphPool(compiled, (1, 2, 4), warmup_iters=0, backend=PaddedBackend())
    for batch in (3, 4, 1, 3, 5):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(pool(x), step(x))
    assert sorted(compiled.stats.compiles) == [1, 4]  # 3 ran padded to 4; 1 once
    assert compiled.stats.eager == 1  # 5: above every bucket


def test_compile_flags_reach_the_runner(loaded):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args([])).compile == "auto"
    assert config_from_args(parser.parse_args(["--no-compile"])).compile == "off"
    assert config_from_args(parser.parse_args(["--compile", "on"])).compile == "on"
    eager = StreamingRunner.from_config(loaded, config_from_args(parser.parse_args(["--max-sessions", "1"])))
    assert eager.graphing.compiler is None and not eager.graphing.enabled  # auto: CPU stays eager
    assert not eager.graphing.config.compile_regions
    args = parser.parse_args(["--max-sessions", "1", "--no-compile", "--compile-regions"])
    regions = StreamingRunner.from_config(loaded, config_from_args(args))
    assert regions.graphing.config.compile_regions  # reaches the graphing (a no-op without compiling)
    assert not regions.graphing.compiles_regions and not regions.thinker.regions
