"""The streaming engine's CUDA-graph path, proven on CPU with the fake capture backend.

Pins, on the tiny model (greedy unless said), a runner with `graphs=fake_graph_config()` (the GPU wiring:
fused MoE, reserved slot caches, static device-tensor inputs, fixed-length masked attention,
GraphPool padding, capture/replay; agent/engine/instruments/fake_graphs.py makes capture execute nothing,
refuse host syncs and check that every replay issues the captured ops on the same memory):
- gives the SAME text ids and codec codes, and audio within 1e-5, as the eager runner, for one
  session over two turns and for three sessions batched (rows padded to the bucket of 4);
- captures one graph per batch bucket and stage at start-up and none later: ticks replay them,
  the 3-row ticks replay the bucket-4 graphs;
- sampled (every stage, a thinker repetition penalty, agent/decoding.py), the same replies as
  the eager runner from the same seed, the thinker's and talker's token choice replayed as graphs
  of their own (agent/engine/stages/token_choice.py) and sampling inside the code-predictor graph;
- with one or two slots no batch is padded: the KV caches get no scratch row (the start-up
  captures write into slot 0 before a session takes it) and replies are unchanged;
- longer contexts get their own attention-length graphs, each captured once, same outputs;
- a batch above the largest bucket runs eagerly (refused, not captured) with the same outputs;
- `config.cuda_graphs=False` (--no-cuda-graphs) never captures nor fuses, whatever the graph
  settings ask; graphed calls from another thread than the builder's raise;
- the fake backend is as strict as CUDA where it matters: a host sync fails the capture,
  capture leaves state untouched, a replay whose Python path or memory changed raises.
On a CUDA device (`-m gpu`): the same equalities with real graphs (tiny model in fp32), and a
bf16 graphed reply runs to its end with audio.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.engine_drive import SYSTEM, make_audio, run_until_idle, speak

from agent.config import Config
from agent.decoding import QWEN_CODE_PREDICTOR, QWEN_TALKER, Decoding, Sampling
from agent.engine.checkpoints.model import load_model
from agent.engine.compile.capture import CUDAGraphed, GraphPool
from agent.engine.instruments.fake_graphs import FakeCaptureBackend, fake_graph_config
from agent.engine.ops.moe import FusedSparseMoeBlock
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.bucketed_prefill import PREFILL_BUCKETS

OPTIONS = dict(max_reply_tokens=10, max_reply_seconds=1.2, audio_window_s=1.0, record=True, context_limit=1024)
STAGES = ("thinker_decode", "talker_step", "code_predictor", "code2wav")
PREFILLS = ("thinker_prefill", "talker_prefill")  # one graph per (batch, token) bucket
FAKE = fake_graph_config()


AUDIO = {"a": make_audio(1.0, 220, 1), "b": make_audio(1.6, 330, 2), "c": make_audio(1.3, 180, 3)}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.set_num_threads(1)
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def eager_loaded(tiny):
    return load_model(tiny, device="cpu")


@pytest.fixture(scope="module")
def graph_loaded(tiny):
    # A model of its own: a graphed runner fuses the MoE blocks of the model it is given.
    return load_model(tiny, device="cpu")


def converse(runner: StreamingRunner, sids: list[str], turns: int = 1) -> dict[str, list]:
    """Every session speaks, all turns end at once, step to the end; `turns` times."""
    records: dict[str, list] = {sid: [] for sid in sids}
    for sid in sids:
        runner.open_session(sid)
    for turn in range(turns):
        for sid in sids:
            audio = AUDIO[sid][: len(AUDIO[sid]) - turn * 4000]
            speak(runner, sid, audio)
        for sid in sids:
            runner.begin_reply(sid, [])
        run_until_idle(runner, 200)
        for sid in sids:
            records[sid].append(runner.records[sid])
    return records


def assert_same(got: dict[str, list], want: dict[str, list]) -> None:
    assert got.keys() == want.keys()
    for sid in want:
        for g, w in zip(got[sid], want[sid], strict=True):
            assert g.text_ids == w.text_ids, sid
            assert w.codes.shape[1] > 0, "the reply made no audio: nothing compared"
            np.testing.assert_array_equal(g.codes, w.codes, err_msg=sid)
            assert g.wav.shape == w.wav.shape
            np.testing.assert_allclose(g.wav, w.wav, rtol=0, atol=1e-5, err_msg=sid)


@pytest.fixture(scope="module")
def eager_three(eager_loaded):
    return converse(StreamingRunner(eager_loaded, SYSTEM, graphs="off", **OPTIONS), ["a", "b", "c"])


def graph_stats(runner: StreamingRunner) -> dict[str, tuple[int, int, int]]:
    return {name: (s.captures, s.replays, s.refused) for name, s in runner.graphing.stats().items()}


def start_captures(runner: StreamingRunner) -> dict[str, int]:
    """The graphs every pool must hold once the runner is built: each batch bucket at every
    key window sdpa can read (decode steps), every window a token bucket can need (prefills);
    none is left to capture in a call."""
    g, sizes = runner.graphing, len(runner.graphing.batch_sizes)
    caches = {"thinker": runner.thinker.kv, "talker": runner.talker.kv}
    windows = {"thinker_decode": len(g.key_lens(caches["thinker"])), "talker_step": len(g.key_lens(caches["talker"]))}
    pairs = {
        f"{name}_prefill": sum(k >= g.key_len(n, kv) for n in PREFILL_BUCKETS for k in g.key_lens(kv))
        for name, kv in caches.items()
    }
    return {
        **{name: sizes * windows.get(name, 1) for name in STAGES},
        **{name: sizes * pairs[name] for name in PREFILLS},
    }


def test_one_session_two_turns_graphed_equals_eager(eager_loaded, graph_loaded):
    want = converse(StreamingRunner(eager_loaded, SYSTEM, graphs="off", **OPTIONS), ["a"], turns=2)
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, **OPTIONS)
    assert any(isinstance(m, FusedSparseMoeBlock) for m in graph_loaded.model.modules())
    assert_same(converse(runner, ["a"], turns=2), want)
    stats = runner.graphing.stats()
    assert set(stats) == set(STAGES + PREFILLS)
    assert all(s.replays > 4 and s.refused == 0 and s.eager == 0 for s in stats.values()), stats


def test_three_sessions_padded_to_four_equal_eager_and_reuse_one_graph_per_size(graph_loaded, eager_three):
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, **OPTIONS)
    sizes = runner.graphing.batch_sizes
    assert sizes == (1, 2, 4, 8)
    at_start = graph_stats(runner)
    assert {name: c for name, (c, _, _) in at_start.items()} == start_captures(runner)
    assert start_captures(runner)["thinker_decode"] > len(sizes)  # the test covers several windows

    assert_same(converse(runner, ["a", "b", "c"]), eager_three)

    after = graph_stats(runner)
    for name in STAGES:
        captures, replays, refused = after[name]
        assert captures == at_start[name][0] and refused == 0, (name, after[name])  # none per tick
        assert replays > at_start[name][1] + 5, name
        # Graph replays per bucket (less capture_all's one): the 3-row ticks ran bucket 4.
        replayed = {size: 0 for size in sizes}  # summed over a bucket's key windows
        for key, c in runner.graphing.pools[name]._state.graphs.items():
            replayed[key[0][0][0]] += c.graph.replays - 1
        assert replayed[4] >= 5 and replayed[8] == 0, (name, replayed)
    for name in PREFILLS:  # the three end-of-turn prefills ran as one 3-row (bucket 4) call
        captures, replays, refused = after[name]
        assert captures == at_start[name][0] and refused == 0 and replays > at_start[name][1], (name, after[name])
        graphs = runner.graphing.pools[name]._state.graphs.items()
        assert sum(c.graph.replays - 1 for key, c in graphs if key[0][0][0] == 4) >= 1, name


def test_two_slots_keep_no_pad_row_in_their_caches_and_equal_eager(eager_loaded, graph_loaded):
    """One or two slots: every batch is a bucket, so the KV caches hold no scratch row (a whole
    session's KV on a 24 GiB card); the start-up captures write into slot 0 before a session
    takes it, and that session's replies are unchanged."""
    two = {**OPTIONS, "max_sessions": 2}
    want = converse(StreamingRunner(eager_loaded, SYSTEM, graphs="off", **two), ["a", "b"], turns=2)
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, **two)
    assert runner.graphing.batch_sizes == (1, 2) and runner.thinker.pad_slot == runner.talker.pad_slot == 0
    assert runner.thinker.kv.keys[0].shape[0] == runner.talker.kv.keys[0].shape[0] == 2
    assert runner.frames.code2wav.kv.keys[0].shape[0] == 3  # code2wav's few MB keep their scratch row
    assert_same(converse(runner, ["a", "b"], turns=2), want)
    assert all(s.replays > 4 and s.refused == 0 and s.eager == 0 for s in runner.graphing.stats().values())
    three = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, **{**OPTIONS, "max_sessions": 3})
    assert three.thinker.kv.keys[0].shape[0] == 4 and three.thinker.pad_slot == 3  # 3 rows pad to 4


def test_sampled_replies_graphed_equal_eager(eager_loaded, graph_loaded):
    sampled = Decoding(Sampling(True, 0.6, 20, 0.95, 1.05), QWEN_TALKER, QWEN_CODE_PREDICTOR, seed=3)
    want = converse(StreamingRunner(eager_loaded, SYSTEM, graphs="off", decoding=sampled, **OPTIONS), ["a", "b", "c"])
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, decoding=sampled, **OPTIONS)
    assert_same(converse(runner, ["a", "b", "c"]), want)
    stats = runner.graphing.stats()
    assert set(stats) == set(STAGES + PREFILLS + ("thinker_pick", "talker_pick"))
    assert all(s.replays > 4 and s.refused == 0 and s.eager == 0 for s in stats.values()), stats


def test_longer_contexts_get_one_graph_per_attention_length(graph_loaded, eager_three):
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=replace(FAKE, min_key_len=32), **OPTIONS)
    assert_same(converse(runner, ["a", "b", "c"]), eager_three)
    backend: FakeCaptureBackend = runner.graphing.backend
    for name in ("thinker_decode", "talker_step"):
        pool = runner.graphing.pools[name]
        keys = list(pool._state.graphs)
        assert len(keys) == pool.stats.captures == len(set(keys))  # each (batch, length) once
        lengths = {key[-1][0][1] for key in keys}  # the mask is the last input: [B, key_len]
        assert len(lengths) >= 2 and min(lengths) == 32, (name, lengths)
    assert sum(g.replays for g in backend.graphs) > 0


def test_batches_above_the_largest_bucket_run_eagerly(graph_loaded, eager_three):
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=replace(FAKE, batch_sizes=(1, 2)), **OPTIONS)
    assert runner.graphing.batch_sizes == (1, 2)
    assert_same(converse(runner, ["a", "b", "c"]), eager_three)
    want = start_captures(runner)
    for name, (captures, _replays, refused) in graph_stats(runner).items():
        assert captures == want[name] and refused > 0, name  # the 3-row calls ran eagerly


def test_no_cuda_graphs_never_captures_nor_fuses(tiny):
    loaded = load_model(tiny, device="cpu")
    off = StreamingRunner.from_config(loaded, Config(cuda_graphs=False, max_sessions=2), graphs=FAKE)
    assert off.graphing.mode == "off" and off.graphing.backend is None and not off.graphing.pools
    assert not any(isinstance(m, FusedSparseMoeBlock) for m in loaded.model.modules())
    assert off.thinker.kv.capacity == 0  # grown on demand, not reserved
    on = StreamingRunner.from_config(loaded, Config(cuda_graphs=True, max_sessions=2), graphs=FAKE)
    assert on.graphing.mode == "fake" and on.graphing.batch_sizes == (1, 2)
    assert {n: s.captures for n, s in on.graphing.stats().items()} == start_captures(on)
    # Without explicit settings the mode follows the device: eager on CPU.
    assert StreamingRunner.from_config(loaded, Config(max_sessions=1)).graphing.mode == "off"


def test_graphed_steps_only_run_on_the_thread_that_built_the_runner(graph_loaded):
    runner = StreamingRunner(graph_loaded, SYSTEM, graphs=FAKE, max_sessions=1, **OPTIONS)
    runner.open_session("a")
    runner.append_audio("a", AUDIO["a"])
    runner.begin_reply("a", [])
    errors: list[BaseException] = []

    def tick() -> None:
        try:
            runner.step()
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=tick)
    worker.start()
    worker.join()
    assert errors and "thread" in str(errors[0])


# ---- the fake backend's own strictness (what lets the tests above stand in for CUDA) ---------


def test_fake_capture_refuses_host_syncs_and_executes_nothing():
    state = torch.zeros(4)

    def step(x):
        state.add_(x)  # in-place state, as a KV cache write
        return x * 2

    graphed = CUDAGraphed(step, warmup_iters=0, backend=FakeCaptureBackend())
    out = graphed(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 2.0)) and torch.equal(state, torch.ones(4))  # one replay's worth

    for inference in (False, True):  # `.item()` reaches the dispatcher differently in each
        syncing = CUDAGraphed(lambda x: x * x.sum().item(), warmup_iters=0, backend=FakeCaptureBackend())
        with torch.inference_mode(inference), pytest.raises(RuntimeError, match="host sync"):
            syncing(torch.ones(4))
    masked = CUDAGraphed(lambda x: x[x > 0].sum().expand(2), warmup_iters=0, backend=FakeCaptureBackend())
    with pytest.raises(RuntimeError, match="host sync"):
        masked(torch.ones(4))


def test_fake_replay_refuses_a_changed_python_path_or_moved_memory():
    box = {"scale": 2.0, "cache": torch.zeros(2, 3)}

    def step(x):
        box["cache"][:, 0] = x
        return x * box["scale"]

    pool = GraphPool(step, (2,), warmup_iters=0, backend=FakeCaptureBackend())
    pool(torch.ones(2))
    pool(torch.ones(2))
    box["scale"] = 3.0  # a real graph would still multiply by 2
    with pytest.raises(RuntimeError, match="diverges"):
        pool(torch.ones(2))
    box["scale"], box["cache"] = 2.0, torch.zeros(2, 3)  # reallocated: the graph writes the old one
    with pytest.raises(RuntimeError, match="diverges"):
        pool(torch.ones(2))


# ---- real CUDA graphs (skipped without a GPU) ------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def exact_cuda():
    """fp32 without TF32 (cuDNN convolutions allow it by default): padded and unpadded batches
    may take different kernels, and TF32's rounding would then show in the waveform."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@cuda
def test_gpu_graphed_runner_equals_eager_fp32(tiny, exact_cuda):
    # In fp32 the rounding differences between padded and unpadded batches stay far below
    # what could flip a greedy pick.
    eager_runner = StreamingRunner(load_model(tiny, "cuda", "float32"), SYSTEM, graphs="off", **OPTIONS)
    eager = converse(eager_runner, ["a", "b", "c"])
    runner = StreamingRunner(load_model(tiny, "cuda", "float32"), SYSTEM, **OPTIONS)  # auto: graphs on CUDA
    assert runner.graphing.mode == "cuda"
    assert_same(converse(runner, ["a", "b", "c"]), eager)
    sizes = len(runner.graphing.batch_sizes)
    for name, (captures, replays, refused) in graph_stats(runner).items():
        if name in PREFILLS:  # one graph per (batch, token) bucket; prefills are few per reply
            assert captures == sizes * len(PREFILL_BUCKETS) and replays > captures and refused == 0, name
            continue
        assert captures == sizes and replays > sizes + 5 and refused == 0, name  # none per tick
    # One session over two turns (bucket 1, the history kept between the turns).
    want = converse(StreamingRunner(load_model(tiny, "cuda", "float32"), SYSTEM, graphs="off", **OPTIONS), ["a"], 2)
    got = converse(StreamingRunner(load_model(tiny, "cuda", "float32"), SYSTEM, **OPTIONS), ["a"], 2)
    assert_same(got, want)


@pytest.mark.gpu
@cuda
def test_gpu_graphed_bf16_reply_runs_to_its_end(tiny):
    loaded = load_model(tiny, "cuda", "bfloat16")
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    records = converse(runner, ["a", "b"])
    for sid, (record,) in records.items():
        assert record.codes.shape[1] > 0 and np.isfinite(record.wav).all() and np.abs(record.wav).max() > 0, sid
    stats = runner.graphing.stats()
    assert all(s.captures >= len(runner.graphing.batch_sizes) and s.replays > 0 for s in stats.values()), stats
