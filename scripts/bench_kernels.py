"""The kernel run of scripts/bench_engine.py (`--kernels`): kernels and bytes per engine tick at
real structure, and the H200 time they predict (a model, not a measurement).

For each depth in --layers (e.g. 1 and 2 layers per stack, every width, head count and expert
count real), a random-weight model is built in bf16 and driven through the engine's own
StreamingRunner, built from the same Config and graph settings as on CUDA (graphs "fake": the
CUDA wiring on CPU, fused MoE, batch buckets; compilation as --compile says). Its own step
functions get stage labels and agent/engine/instruments/kernel_count.py counts what each stage launches:
- one steady tick at batch 1, 4, 10 (thinker decode + talker step + code-predictor loop +
  code2wav step, with the glue between them), once every session has its first frame;
- the end-of-turn critical path at batch 1: begin_reply to the first AudioOut (audio
  encoder's open block, thinker prefill of the tail + assistant header, talker prefix, first
  code-predictor loop, first code2wav step).
Each stage's count is differenced between the two depths (kernels per layer of its stack) and
extrapolated to the published depth. Bytes come from agent/engine/instruments/roofline.py at full depth.
"""

from __future__ import annotations

import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from agent.config import INPUT_FRAME_SAMPLES, Config
from agent.engine.api import AudioOut
from agent.engine.instruments.kernel_count import UNSTAGED, KernelCounter

# Which stack's depth each stage's per-layer difference scales with (None: depth-free glue).
STACKS = {
    "thinker_decode": "thinker",
    "thinker_prefill": "thinker",
    "talker_step": "talker",
    "talker_prefill": "talker",
    "code_predictor": "code_predictor",
    "code2wav": "code2wav",
    "audio_tail": "audio_encoder",
    UNSTAGED: None,
}
TICK_STAGES = ("thinker_decode", "talker_step", "code_predictor", "code2wav", UNSTAGED)
TURN_STAGES = ("audio_tail", "thinker_prefill", "talker_prefill", "code_predictor", "code2wav", UNSTAGED)


@dataclass
class Phase:
    kernels: Counter[str]
    compiled: Counter[str]
    scheduled: Counter[str]  # compiled graphs by their fused nodes (kernel_count.py)
    calls: dict[str, list[int]]  # stage -> batch rows (or prefill tokens) per call
    ops: Counter[str] = field(default_factory=Counter)  # eager aten op -> count


@dataclass
class Probe:
    """Stage labels on a runner's own step functions, and what each call was given."""

    counter: KernelCounter = field(default_factory=KernelCounter)
    calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def wrap(self, obj: object, name: str, stage: str, size: Callable[..., int | None] | None = None) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            raise RuntimeError(f"the engine has no {type(obj).__name__}.{name}: update the stage labels in {__file__}")

        def labelled(*args, **kwargs):
            with self.counter.stage(stage):
                out = fn(*args, **kwargs)
            n = size(out, *args, **kwargs) if size is not None else None
            if n is not None:
                self.calls[stage].append(int(n))
            return out

        setattr(obj, name, labelled)

    @contextmanager
    def counting(self) -> Iterator[Phase]:
        self.counter.reset()
        self.calls.clear()
        phase = Phase(Counter(), Counter(), Counter(), {})
        with self.counter:
            yield phase
        phase.kernels.update(self.counter.kernels)
        phase.compiled.update(self.counter.compiled)
        phase.scheduled.update(self.counter.scheduled)
        if self.counter.unmarked_graphs:
            raise RuntimeError(
                f"{self.counter.unmarked_graphs} compiled graph calls carry no scheduler marks "
                "(compiled before marking_scheduled_kernels was on)"
            )
        phase.ops.update(self.counter.ops)
        phase.calls.update({k: list(v) for k, v in self.calls.items()})


def probe_runner(runner) -> Probe:
    probe = Probe()
    rows = lambda out, states, *a, **k: len(states)  # noqa: E731
    probe.wrap(runner.frames, "_thinker", "thinker_decode")
    probe.wrap(runner.thinker, "decode", "thinker_decode", rows)
    probe.wrap(runner.frames, "_talker", "talker_step")
    probe.wrap(runner.talker, "step", "talker_step", rows)
    probe.wrap(runner.frames.predictor, "run", "code_predictor", lambda out, hidden, *a, **k: hidden.shape[0])
    probe.wrap(runner.frames.code2wav, "push", "code2wav", lambda out, slots, *a, **k: len(slots))
    probe.wrap(runner.turns.end, "start_reply", "audio_tail")
    # End-of-turn prefills are batched over the sessions whose turns end in the same tick.
    probe.wrap(runner.thinker, "run_prefills", "thinker_prefill", lambda out, *a, **k: sum(out))
    probe.wrap(runner.turns, "talker_prefills", "talker_prefill")
    probe.wrap(
        runner.talker, "prefills", "talker_prefill", lambda out, items, *a, **k: sum(e.shape[1] for _, e, _, _ in items)
    )
    return probe


def speak(runner, sids: list[str], audio: np.ndarray) -> None:
    """Open sessions and stream the utterance into each; the idle engine encodes and prefills it."""
    for sid in sids:
        runner.open_session(sid)
        for i in range(0, len(audio), INPUT_FRAME_SAMPLES):
            runner.append_audio(sid, audio[i : i + INPUT_FRAME_SAMPLES])
    for _ in range(1000):
        if not runner.step():
            break


def until_first_audio(runner, sids: list[str], limit: int = 300) -> None:
    pending = set(sids)
    for _ in range(limit):
        for out in runner.step():
            if isinstance(out, AudioOut):
                pending.discard(out.session_id)
        if not pending:
            return
    raise RuntimeError(f"no first audio after {limit} ticks for {sorted(pending)}")


STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"# {time.perf_counter() - STARTED:6.0f} s  {message}", flush=True)


def measure(runner, probe: Probe, batches: list[int], audio: np.ndarray) -> dict[str, Phase]:
    phases: dict[str, Phase] = {}
    for batch in batches:
        log(f"batch {batch}: sessions speak, replies start")
        sids = [f"b{batch}_{i}" for i in range(batch)]
        speak(runner, sids, audio)
        for sid in sids:
            runner.begin_reply(sid, [])
        until_first_audio(runner, sids)
        runner.step()  # one uncounted steady tick
        for _ in range(4):  # a tick where every stage ran all rows once
            with probe.counting() as phase:
                runner.step()
            if all(
                phase.calls.get(s) == [batch] for s in ("thinker_decode", "talker_step", "code_predictor", "code2wav")
            ):
                break
        else:
            raise RuntimeError(f"no steady tick at batch {batch}: {phase.calls}")
        phases[f"tick_b{batch}"] = phase
        log(f"batch {batch}: counted a steady tick, {phase.kernels.total()} kernels")
        for sid in sids:
            runner.close_session(sid)
    sid = "turn"
    log("end of turn")
    speak(runner, [sid], audio)
    with probe.counting() as phase:
        runner.begin_reply(sid, [])
        until_first_audio(runner, [sid])
    missing = [s for s in ("thinker_prefill", "talker_prefill", "code_predictor", "code2wav") if not phase.calls.get(s)]
    if missing:
        raise RuntimeError(f"the end-of-turn path ran no labelled {missing}: update the stage labels in {__file__}")
    phases["end_of_turn"] = phase
    runner.close_session(sid)
    return phases


def full_depths(config) -> dict[str, int]:
    t, tk = config.thinker_config, config.talker_config
    return {
        "thinker": t.text_config.num_hidden_layers,
        "audio_encoder": t.audio_config.encoder_layers,
        "talker": tk.text_config.num_hidden_layers,
        "code_predictor": tk.code_predictor_config.num_hidden_layers,
        "code2wav": config.code2wav_config.num_hidden_layers,
    }


def extrapolate(low: int, high: int, a: int, b: int, depth: int | None) -> int:
    """Count at `depth` layers from counts a (at `low`) and b (at `high` layers)."""
    if depth is None:
        return b
    return round(a + (depth - low) * (b - a) / (high - low))


def engine_config(args, batches: list[int]) -> Config:
    cfg = Config(
        max_reply_tokens=args.kernel_reply_tokens,
        max_reply_seconds=60.0,
        audio_window_s=1.0,
        max_sessions=max(batches),
        context_limit=2048,  # KV bytes are modelled at --context; the slots only need the run
    )
    if args.compile is not None:
        if "compile" not in {f.name for f in fields(Config)}:
            raise SystemExit("--compile: this engine's Config has no compile option yet")
        cfg = replace(cfg, compile=args.compile)
    return cfg


def run(args, utterance: Callable[[float], np.ndarray]) -> None:
    from agent.engine.checkpoints.presets import REAL, depth_overrides, merge_overrides, meta_model, preset_config
    from agent.engine.checkpoints.random_weights import load_random
    from agent.engine.checkpoints.tiny import ensure_model
    from agent.engine.compile.wiring import GraphConfig
    from agent.engine.instruments.fake_graphs import fake_graph_config
    from agent.engine.instruments.kernel_count import marking_scheduled_kernels
    from agent.engine.instruments.roofline import CODEC_FRAME_S, H200, ByteModel
    from agent.engine.runner.streaming import StreamingRunner

    if args.preset != REAL:
        raise SystemExit(f"--kernels needs --preset {REAL}")
    low, high = sorted(args.layers)
    batches = sorted(set(args.kernel_batches) | {1, 4})
    cfg = engine_config(args, batches)
    # "fake": the CPU capture backend is injected here (production never imports it).
    graphs = fake_graph_config(check_replays=False) if args.graphs == "fake" else GraphConfig(mode=args.graphs)
    # What a CUDA run compiles (fused projections), unless --no-fused-gemv.
    graphs = replace(graphs, fused_gemv=args.fused_gemv is not False, compile_regions=args.compile_regions)
    audio = utterance(args.kernel_utterance_s)
    counts: dict[int, dict[str, Phase]] = {}
    graph_mode = ""
    for layers in (low, high):
        log(f"building {REAL} with {layers} layer(s) per stack, bf16")
        overrides = merge_overrides(
            depth_overrides(layers), {"thinker_config": {"text_config": {"vocab_size": args.count_vocab}}}
        )
        loaded = load_random(REAL, "cpu", ensure_model(Config()), dtype=torch.bfloat16, overrides=overrides)
        log("built; starting the runner (graph captures)")
        # The runner compiles its steps as it starts, the prefills at their first buckets.
        with marking_scheduled_kernels():
            runner = StreamingRunner.from_config(loaded, cfg, graphs=graphs)
            graph_mode = runner.graphing.mode
            counts[layers] = measure(runner, probe_runner(runner), batches, audio)
        log(f"counted {layers} layer(s) per stack")
        del runner, loaded
        gc.collect()

    full = full_depths(preset_config(REAL))
    table: dict[str, Counter[str]] = {}
    scheduled: dict[str, Counter[str]] = {}
    print(
        f"\nKERNELS (counted on CPU at {low} and {high} layers per stack, real widths, heads and experts, thinker "
        f"vocabulary {args.count_vocab} (a matmul is one kernel at any width; bytes use the real 152064); "
        f"extrapolated per stack to {full}); graphs={graph_mode} compile={getattr(cfg, 'compile', 'n/a')} "
        f"fused_gemv={graphs.fused_gemv}"
    )
    print(
        "(launches: what runs here, the C++ backend's merged kernels; sched: compiled graphs counted by the fused "
        "nodes inductor's scheduler formed, ~one Triton kernel each, an upper bound for CUDA; eager ops count 1 in both)"
    )
    print(
        f"{'run':<12} {'stage':<16} {f'{low}L':>7} {f'{high}L':>7} {'/layer':>7} {'depth':>5} {'full':>7} "
        f"{'compiled':>8} {f'sched {low}L':>8} {f'sched {high}L':>8} {'sched full':>10}  calls at {high}L"
    )
    for name in counts[low]:
        a, b = counts[low][name], counts[high][name]
        stages = TURN_STAGES if name == "end_of_turn" else TICK_STAGES
        row: Counter[str] = Counter()
        sched: Counter[str] = Counter()
        for stage in stages:
            depth = full.get(STACKS[stage] or "")
            row[stage] = extrapolate(low, high, a.kernels[stage], b.kernels[stage], depth)
            sched[stage] = extrapolate(low, high, a.scheduled[stage], b.scheduled[stage], depth)
            per = (b.kernels[stage] - a.kernels[stage]) / (high - low)
            print(
                f"{name:<12} {stage:<16} {a.kernels[stage]:>7} {b.kernels[stage]:>7} {per:>7.0f} "
                f"{depth or '-':>5} {row[stage]:>7} {b.compiled[stage]:>8} {a.scheduled[stage]:>8} "
                f"{b.scheduled[stage]:>8} {sched[stage]:>10}  {b.calls.get(stage, '')}"
            )
        if a.kernels[UNSTAGED] != b.kernels[UNSTAGED]:
            # Depth-dependent work outside every label would be left out of the extrapolation.
            raise RuntimeError(
                f"{name}: unlabelled kernels change with depth ({a.kernels[UNSTAGED]} -> "
                f"{b.kernels[UNSTAGED]}): a step function lacks a stage label in {__file__}"
            )
        print(
            f"{name:<12} {'total':<16} {a.kernels.total():>7} {b.kernels.total():>7} {'':>7} {'':>5} {row.total():>7} "
            f"{'':>8} {a.scheduled.total():>8} {b.scheduled.total():>8} {sched.total():>10}"
        )
        table[name], scheduled[name] = row, sched

    if args.kernel_ops:
        for name in ("tick_b1", "end_of_turn"):
            top = counts[high][name].ops.most_common(args.kernel_ops)
            print(f"eager ops, {name} at {high}L: " + ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in top))

    model = ByteModel.of(meta_model(preset_config(REAL)))
    turn = counts[high]["end_of_turn"]
    thinker_tokens = sum(turn.calls.get("thinker_prefill", [])) or 1
    talker_tokens = sum(turn.calls.get("talker_prefill", [])) or 1
    print(
        f"\nPREDICTED {H200.name} time: MODEL, NOT A MEASUREMENT. time = bytes / ({H200.efficiency} x "
        f"{H200.bandwidth / 1e12:.1f} TB/s) + kernels x {H200.per_kernel_s * 1e6:.0f} us; bf16 weights at full "
        f"depth, MoE experts at their expected spread, KV at {args.context} tokens of context per session; "
        f"RTF = tick / {CODEC_FRAME_S * 1000:.0f} ms"
    )
    print(
        "(kernels: the launches counted here; the sched columns put the scheduled count in the same formula: "
        "a CUDA run lies between the two)"
    )
    print(
        f"{'run':<22} {'kernels':>8} {'GB read':>8} {'bytes ms':>9} {'kernel ms':>9} {'total ms':>9} {'RTF':>6} "
        f"{'sched':>7} {'sched ms':>9} {'sched RTF':>9}"
    )
    predicted: dict[str, float] = {}

    def show(name: str, kernels: int, nbytes: float, rtf: bool, sched: int) -> None:
        total, upper = H200.seconds(nbytes, kernels), H200.seconds(nbytes, sched)
        predicted[name], predicted[name + " sched"] = total, upper
        rtf_s = f"{total / CODEC_FRAME_S:6.2f}" if rtf else "     -"
        upper_rtf = f"{upper / CODEC_FRAME_S:9.2f}" if rtf else "        -"
        print(
            f"{name:<22} {kernels:>8} {nbytes / 1e9:>8.2f} {H200.seconds(nbytes, 0) * 1e3:>9.2f} "
            f"{H200.seconds(0, kernels) * 1e3:>9.2f} {total * 1e3:>9.2f} {rtf_s} {sched:>7} {upper * 1e3:>9.2f} {upper_rtf}"
        )

    for batch in batches:
        show(
            f"tick b{batch}",
            table[f"tick_b{batch}"].total(),
            sum(model.tick(batch, args.context).values()),
            True,
            scheduled[f"tick_b{batch}"].total(),
        )
    show(
        "code predictor (b1)",
        table["tick_b1"]["code_predictor"],
        model.tick(1, args.context)["code_predictor"],
        False,
        scheduled["tick_b1"]["code_predictor"],
    )
    eot = model.end_of_turn(thinker_tokens, talker_tokens, args.context)
    show(
        "end of turn b1 (TTFA)",
        table["end_of_turn"].total(),
        sum(eot.values()),
        False,
        scheduled["end_of_turn"].total(),
    )
    print(
        f"(end of turn: thinker prefill {thinker_tokens} tokens, talker prefix {talker_tokens} tokens, "
        f"{args.kernel_utterance_s:g} s utterance; network and playout not included)"
    )
    print(
        f"kernels_per_tick_b1={table['tick_b1'].total()} kernels_per_tick_b4={table['tick_b4'].total()} "
        f"kernels_code_predictor={table['tick_b1']['code_predictor']} kernels_end_of_turn={table['end_of_turn'].total()} "
        f"predicted_rtf_b4={predicted['tick b4'] / CODEC_FRAME_S:.2f} "
        f"predicted_ttfa_b1_ms={predicted['end of turn b1 (TTFA)'] * 1000:.0f} "
        f"scheduled_per_tick_b1={scheduled['tick_b1'].total()} scheduled_code_predictor={scheduled['tick_b1']['code_predictor']} "
        f"scheduled_end_of_turn={scheduled['end_of_turn'].total()} "
        f"predicted_rtf_b4_scheduled={predicted['tick b4 sched'] / CODEC_FRAME_S:.2f} "
        f"predicted_ttfa_b1_ms_scheduled={predicted['end of turn b1 (TTFA) sched'] * 1000:.0f}"
    )
