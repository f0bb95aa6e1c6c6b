"""CPU graphs: the engine's steps replayed as TorchScript traces compute what the eager steps do.

Pins, on the tiny model: three sessions replying at once (batched ticks, a prefill while others
speak) with GraphConfig(mode="cpu") give the same text ids and codec codes as the eager runner
and the same waveform to float rounding (1e-4: the graphed attention reads padded key lengths
under a mask); every per-frame pool replays traces (captured once per bucket, then replayed),
the decode steps' traces all made at start-up (every batch bucket and attention length);
state a step writes without taking it as an input (code2wav's conv states and window positions)
survives replays: consecutive pushes equal the eager ones exactly (a trace drops writes to
tensors it does not return, which agent/engine/compile/cpu_traces.py guards against); and `--cpu-graphs` is how
serve turns them on.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from support.engine_drive import SYSTEM, make_audio, run_until_idle, speak

from agent.engine.codecs.code2wav import SlotCode2Wav
from agent.engine.compile.wiring import GraphConfig, Graphing
from agent.engine.runner.streaming import StreamingRunner
from agent.flags import add_serve_arguments, config_from_args


def _replies(loaded, graphs: GraphConfig) -> tuple[StreamingRunner, dict]:
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=16,
        max_reply_seconds=1.6,
        record=True,
        graphs=graphs,
        max_sessions=4,
        context_limit=2048,
    )
    for i, sid in enumerate(["a", "b", "c"]):
        runner.open_session(sid)
        speak(runner, sid, make_audio(0.8 + 0.3 * i, 200 + 50 * i, 10 + i))
        runner.begin_reply(sid, [])
        runner.step()  # the others' replies are under way when the next one starts
    run_until_idle(runner, 400)
    return runner, dict(runner.records)


def test_graphed_replies_equal_eager(loaded) -> None:
    _, eager = _replies(loaded, GraphConfig(mode="off"))
    runner, graphed = _replies(loaded, GraphConfig(mode="cpu"))
    for sid in "abc":
        assert graphed[sid].text_ids == eager[sid].text_ids
        np.testing.assert_array_equal(graphed[sid].codes, eager[sid].codes)
        assert graphed[sid].wav.shape == eager[sid].wav.shape
        np.testing.assert_allclose(graphed[sid].wav, eager[sid].wav, atol=1e-4)
    stats = runner.graphing.stats()
    for name in ("code_predictor", "code2wav"):
        assert stats[name].captures >= 1 and stats[name].replays > stats[name].captures and stats[name].eager == 0
    # Decode steps: traced at start-up for every batch bucket (1, 2, 4) and attention length
    # (256 .. 2048), so none is traced in a reply.
    lengths = len(runner.graphing.key_lens(runner.thinker.kv))
    assert stats["thinker_decode"].captures == 3 * lengths and stats["thinker_decode"].refused == 0


def test_written_state_survives_replays(loaded) -> None:
    traced = SlotCode2Wav(loaded.model.code2wav, 4, graphing=Graphing(GraphConfig(mode="cpu"), loaded.device, 4))
    traced.capture_graphs()
    eager = SlotCode2Wav(loaded.model.code2wav, 4)
    quantizers = eager.code2wav.config.num_quantizers
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for _ in range(4):
            codes = torch.randint(0, 100, (2, quantizers, 1), generator=gen)
            for want, got in zip(eager.push([0, 1], codes), traced.push([0, 1], codes)):
                assert torch.equal(want, got)
    assert torch.equal(eager.key_pos[:2], traced.key_pos[:2])
    for key, state in eager.states.items():
        assert torch.equal(state[:2], traced.states[key][:2])


def test_serve_flag() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args([])).cpu_graphs is False
    assert config_from_args(parser.parse_args(["--cpu-graphs"])).cpu_graphs is True
