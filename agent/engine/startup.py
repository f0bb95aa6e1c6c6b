"""The engine's start-up, phase by phase: what it is doing now, and how long each part took.

On a GPU a start-up takes minutes (docs/ray-serve.md "Start-up: how long, and how to watch it"):
  plan             the memory plan (agent/engine/memory_plan.py size_limits), before the engine
                   is built, in the process that serves HTTP;
  load             the checkpoint's load, where the engine runs (its thread or its process);
  build            the runner's construction: it compiles every step and captures CUDA graphs;
  compile:<step>   one per compiled step, from the runner's own timings once it is built (their
                   seconds are inside build's), with the compile cache's answer (hit/miss/off);
  fallback         the text-only fallback runner, where there is one;
  ready            from the engine's start to its first command served (plan excluded).

Two sides, so that the state has one owner while the work happens elsewhere:
- `PhaseTimer` runs where the work runs and only reports: `PhaseBegun` / `PhaseDone` messages
  (typed, picklable: the engine process sends them over its outbox to the parent);
- `StartupLog` lives with the HTTP side and owns what is known: the running phase and the
  finished ones. It logs each finished phase (one INFO line) and sets `agent_startup_seconds`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from agent import metrics

if TYPE_CHECKING:
    from agent.config import Config
    from agent.engine.memory_plan import MemoryPlan

log = logging.getLogger(__name__)

PLAN, LOAD, BUILD, FALLBACK, READY = "plan", "load", "build", "fallback", "ready"
COMPILE = "compile:"  # + the step's name
STARTING = "starting"  # the phase before the first one begins (a child process importing torch)

# A cold start of the real model on one GPU: weights loaded from the node's disk, every step
# compiled for every batch bucket with an empty inductor cache, graphs captured. Budgeted, not
# yet measured at real size: docs/ray-serve.md "Start-up: how long, and how to watch it" says
# how the figure is made up. The Serve replica's start timeout and the KubeRay startupProbe are
# sized from it (agent/serve/options.py, deploy/kuberay/rayservice.yaml).
COLD_START_S = 1800.0


@dataclass(frozen=True)
class PhaseBegun:
    """A phase started (where the engine runs)."""

    phase: str


@dataclass(frozen=True)
class PhaseDone:
    """A phase finished, `seconds` after it began; `detail` says what it did, for people."""

    phase: str
    seconds: float
    detail: str = ""


StartupEvent = Union[PhaseBegun, PhaseDone]


@dataclass(frozen=True)
class StartupView:
    """What is known of a start-up at one moment: the running phase (STARTING before the first,
    READY once ready) and the finished phases' seconds, in the order they finished."""

    phase: str
    finished: tuple[tuple[str, float], ...]

    @property
    def phases(self) -> dict[str, float]:
        return dict(self.finished)


class PhaseTimer:
    """Times phases where they run and reports each begin and end to `report` (a StartupLog's
    `apply` in the same process; the outbox to the parent in an engine process)."""

    def __init__(self, report: Callable[[StartupEvent], None]) -> None:
        self._report = report
        self._began: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        self._began[phase] = time.monotonic()
        self._report(PhaseBegun(phase))

    def end(self, phase: str, detail: str = "") -> PhaseDone:
        done = PhaseDone(phase, time.monotonic() - self._began.pop(phase), detail)
        self._report(done)
        return done

    def record(self, done: PhaseDone) -> None:
        """A phase timed by someone else (a compiled step, by the runner's compiler)."""
        self._report(done)


class StartupLog:
    """The owner of one engine's start-up state. Thread-safe: the engine thread (or the reader of
    the engine process's outbox) writes, the asyncio side reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = STARTING
        self._finished: list[tuple[str, float]] = []
        self._started = time.monotonic()

    def start(self) -> None:
        """The engine starts now: READY's seconds count from here."""
        with self._lock:
            self._started = time.monotonic()

    def apply(self, event: StartupEvent) -> None:
        """A phase began or ended (in this process or the engine's)."""
        if isinstance(event, PhaseBegun):
            with self._lock:
                self._phase = event.phase
            return
        with self._lock:  # the running phase stays the last begun until the next begins
            self._finished.append((event.phase, event.seconds))
        metrics.STARTUP_SECONDS.labels(phase=event.phase).set(event.seconds)
        log.info("start-up: %s took %.1f s%s", event.phase, event.seconds, f" ({event.detail})" if event.detail else "")

    def ready(self, detail: str = "") -> PhaseDone:
        """The engine serves: the last phase, timed from `start`."""
        with self._lock:
            done = PhaseDone(READY, time.monotonic() - self._started, detail)
        self.apply(done)
        with self._lock:
            self._phase = READY
        return done

    @property
    def phase(self) -> str:
        with self._lock:
            return self._phase

    def view(self) -> StartupView:
        with self._lock:
            return StartupView(self._phase, tuple(self._finished))


def timed_plan(
    plan: Callable[[Config], tuple[Config, MemoryPlan]], config: Config
) -> tuple[Config, MemoryPlan, PhaseDone]:
    """Run the memory plan (`memory_plan.size_limits`) on `config`, timed: (config, plan, PLAN's
    PhaseDone) for the engine's StartupLog, which does not exist yet when the plan is made."""
    began = time.monotonic()
    sized, made = plan(config)
    return sized, made, PhaseDone(PLAN, time.monotonic() - began)


def compile_phases(compiler: Optional[Any]) -> list[PhaseDone]:
    """One COMPILE phase per step a runner's StepCompiler compiled (none without a compiler):
    its seconds over every batch bucket, and in the detail the cache's answer where the compiler
    reports one (`cache_report`: step -> hit/miss/off) and each bucket's seconds."""
    if compiler is None:
        return []
    seconds: Mapping[str, Mapping[int, float]] = compiler.compile_seconds()
    report = getattr(compiler, "cache_report", None)
    cache: Mapping[str, str] = report() if callable(report) else {}
    phases = []
    for step, buckets in seconds.items():
        per_bucket = ", ".join(f"{bucket}: {s:.1f} s" for bucket, s in sorted(buckets.items()))
        detail = f"cache {cache[step]}; " if step in cache else ""
        phases.append(PhaseDone(COMPILE + step, sum(buckets.values()), f"{detail}buckets {per_bucket or 'none'}"))
    return phases
