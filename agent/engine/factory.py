"""Building the engine a Config describes: which runners, from which checkpoint.

`runner_factory(config)` returns the callable the engine thread runs to build its runner,
so that model loading (and, on CUDA, graph capture) happens inside that thread. Its start-up
phases (load, build, compile:<step>) go to the PhaseTimer it is given (agent/engine/startup.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

from agent.config import Config
from agent.decoding import is_tiny
from agent.engine.api import Runner
from agent.engine.checkpoints.tiny import ensure_model
from agent.engine.loop import Engine
from agent.engine.startup import BUILD, LOAD, PhaseDone, PhaseTimer, StartupLog, compile_phases

log = logging.getLogger(__name__)


def runner_factory(config: Config, timer: Optional[PhaseTimer] = None) -> Callable[[], Runner]:
    """Build (inside the engine thread) the runner the config asks for; `timer`, when given,
    hears of its phases."""
    phases = timer if timer is not None else PhaseTimer(lambda event: None)

    def build() -> Runner:
        import torch

        if config.threads:
            torch.set_num_threads(config.threads)
        elif not (config.device in ("auto", "cuda") and torch.cuda.is_available()):
            # On CPU leave a core to the asyncio thread: SRTP, Opus and pacing stall when
            # torch's intra-op threads take every core (measured: TTFA x10 on 2 cores).
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        from agent.engine.checkpoints.model import load_model

        phases.begin(LOAD)
        loaded = load_model(ensure_model(config), device=config.device, dtype=config.dtype, quantize=config.quantize)
        # The limits were planned before the load (memory_plan.size_limits): say if the GPU now has less.
        from agent.engine.memory_plan import check_after_load

        check_after_load(loaded, config)
        phases.end(LOAD, f"{loaded.device}, {config.dtype}" + (f", {config.quantize}" if config.quantize else ""))
        log_decoding(config)
        phases.begin(BUILD)
        if config.runner == "reference":
            from agent.engine.runner.reference import GenerateRunner

            reference = GenerateRunner(
                loaded,
                system_prompt=config.system_prompt,
                max_reply_tokens=config.max_reply_tokens,
                max_reply_seconds=config.max_reply_seconds,
                decoding=config.sampling,
            )
            phases.end(BUILD, "reference runner")
            return reference
        from agent.engine.runner.streaming import StreamingRunner

        # from_config reads config.cuda_graphs (--no-cuda-graphs): graphs on CUDA unless off.
        runner = StreamingRunner.from_config(loaded, config)
        graphing = runner.graphing
        log.info("streaming runner on %s, graphs %s %s", loaded.device, graphing.mode, graphing.batch_sizes)
        compiler = getattr(graphing, "compiler", None)
        phases.end(BUILD, f"graphs {graphing.mode}, compile {'on' if compiler is not None else 'off'}")
        for step in compile_phases(compiler):  # known once built: inside build's seconds
            phases.record(step)
        return runner

    return build


def log_decoding(config: Config) -> None:
    """Say how replies are decoded and capped (they depend on the model: agent/decoding.py)."""
    d = config.sampling
    assert d is not None
    log.info(
        "replies: at most %d tokens / %.0f s; thinker %s, talker %s, code predictor %s; seeds %s",
        config.max_reply_tokens,
        config.max_reply_seconds,
        d.thinker,
        d.talker,
        d.code_predictor,
        "fresh per reply" if d.seed is None else f"from {d.seed}",
    )
    if not d.talker.do_sample and not is_tiny(config.model):
        # vllm-omni warns the same: greedy talkers were seen to run to the length limit.
        log.warning("the talker decodes greedily: real talkers then tend to run on to the reply cap")


def fallback_factory(config: Config) -> Optional[Callable[[], Runner]]:
    """The text-only fallback runner for degradation level 2, or None: disabled, or a real model
    with no --fallback-model (a random tiny Qwen3 would answer its users with noise: level 2
    then stays text-only on the same model)."""
    if config.fallback_model == "none" or (not config.fallback_model and not is_tiny(config.model)):
        return None

    def build() -> Runner:
        from agent.engine.runner.fallback import FallbackRunner, make_tiny_text

        path = config.fallback_model
        if not path:
            # Shares the Omni checkpoint's tokenizer when it is a local folder, so ids agree.
            omni = Path(ensure_model(config))
            tokenizer_dir = omni if (omni / "tokenizer_config.json").is_file() else None
            path = str(make_tiny_text(config.cache_dir / "tiny-qwen3-text", tokenizer_dir))
        device = "cuda" if config.device == "cuda" else "cpu"
        return FallbackRunner(
            path, device=device, max_reply_tokens=config.max_reply_tokens, system_prompt=config.system_prompt
        )

    return build


def inbox_size(config: Config) -> int:
    """The engine inbox's bound: config.engine_inbox, and room for every session's audio."""
    return config.engine_inbox + config.engine_inbox_per_session * config.engine_slots


def build_engine(
    config: Config, wrap: Optional[Callable[[Runner], Runner]] = None, planned: Optional[PhaseDone] = None
) -> Engine:
    """The engine `config` describes: in a child process (config.engine_process, the default) or
    a thread of this one. `wrap`, when given, receives the primary runner once the engine thread
    has built it and returns the runner to use (a test's fault or stall around the real one), so
    that a wrapped engine is configured like the served one in everything else; it runs in a
    thread of this process. `planned`: how long the memory plan took (startup.timed_plan), the
    first phase of the engine's start-up log."""
    startup = StartupLog()
    if planned is not None:
        startup.apply(planned)
    if config.engine_process and wrap is None:  # (a test's wrapped runner needs this process)
        from agent.engine.process import ProcessEngine

        fallback = fallback_factory(config) is not None
        builders = (runner_factory, fallback_factory)
        return ProcessEngine(
            config, builders, inbox_size(config), fallback, config.video_frames_per_turn, startup=startup
        )
    build = runner_factory(config, PhaseTimer(startup.apply))
    factory = build if wrap is None else lambda: wrap(build())
    return Engine(
        factory,
        inbox_size=inbox_size(config),
        fallback_factory=fallback_factory(config),
        frames_per_turn=config.video_frames_per_turn,
        startup=startup,
    )
