"""torch.compile for the per-frame step functions: one compiled function per batch bucket.

The four step functions of a tick (thinker decode, talker step, the whole code-predictor loop,
code2wav's one-frame push) are, eagerly, thousands of small kernels per frame at real size; the
launch cost of those, not the bytes they read, sets the tick time.
Inductor fuses the norms, RoPE, residual adds, casts and sampling glue into few kernels, and
the code predictor's 15 steps become one region with no Python between them.

How it plugs in: `Graphing` (agent/engine/compile/wiring.py) hands every step function to
`StepCompiler.wrap` before it builds the function's `GraphPool`. The pool pads each call's batch
up to its bucket (1, 2, 4, 8, 16), so the compiled function only ever sees bucket shapes:
`dynamic=False` and one compile per bucket, each specialised to its batch (static shapes give
inductor its best kernels and keep recompiles predictable). The one other varying input, the
attention read length of the thinker and talker steps (256, 512, ... keys), is marked dynamic,
so that a longer context does not recompile. A batch above every bucket runs the eager function.

Around the compiled code, on CUDA, either
- "own" (default): the project's capture (agent/engine/compile/capture.py `GraphPool`), which already
  owns the padding, the scratch pad slot, the shared memory pool and the thread binding; the
  compiled kernels are recorded into its graphs like any other kernels; or
- "inductor": `mode="reduce-overhead"` (inductor's CUDA-graph trees) with the pool only padding.
"own" is the default because the KV caches are module state the step writes in place: inductor's
graph trees skip graphs that mutate inputs they do not own, silently running eagerly, while the
own capture replays those writes by construction (tests/unit/test_graph_wiring.py).
On CPU the same compiled code runs through inductor's C++ backend behind a pool that pads
without capturing (`PaddedBackend`).

Compiling is slow (tens of seconds per function on a small CPU), so it happens at start-up: the
runner's constructor warms every bucket (agent/engine/runner/streaming.py), never a live reply.
Compiled artifacts go to inductor's on-disk caches under `cache_dir`, and all of them into one
file keyed by software, card and shapes (agent/engine/compile/cache.py), loaded before the first
compile: a restart, or a fresh machine given the file, re-traces (seconds) but does not
re-generate nor re-build kernels. Each step's first compile says whether inductor found its
graphs in the cache (`StepCompiler.cache_report`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch._dynamo.utils import counters

from agent.engine.compile.cache import CacheState
from agent.engine.compile.capture import Outputs, StepFn

log = logging.getLogger(__name__)

CompileMode = Literal["auto", "on", "off"]
CudaGraphImpl = Literal["own", "inductor"]


@dataclass(frozen=True)
class CompileSettings:
    """What `StepCompiler` needs (resolved from GraphConfig: mode already decided)."""

    cache_dir: Path | None = None  # inductor's on-disk cache; None leaves the environment's
    cudagraphs: CudaGraphImpl = "own"
    device_type: str = "cpu"
    # One compile for every bucket, the batch dim symbolic (size 1 included; see
    # `CompiledStep._mark_batch`), instead of one per bucket: shapes the generated code cannot
    # specialise on. Default on CPU, where a compile costs tens of seconds per function.
    dynamic_batch: bool = False
    unbacked_batch: bool = False  # how a dynamic batch is marked (CompiledStep._mark_batch)
    # Seconds of compiling a start-up may spend; a step whose first compile comes after that
    # runs its eager function instead (graphed all the same). None: no limit.
    budget_s: float | None = None


@dataclass
class CompileBudget:
    """The compile seconds one runner's steps have spent, against the settings' budget, and
    whether the runner is still starting: shared by its steps (the compiler's). While it starts,
    a step that fails is one whose compile failed (start-up calls run on harmless pad inputs);
    once it serves, a failure is the call's own."""

    limit_s: float | None = None
    spent_s: float = 0.0
    phase: Literal["start-up", "serving"] = "start-up"

    def allows(self) -> bool:
        return self.limit_s is None or self.spent_s < self.limit_s


def resolve_compile(mode: CompileMode, device: torch.device) -> bool:
    """Whether to compile: "auto" compiles on CUDA only. On this project's CPU machines the
    start-up compile (four functions x five buckets, ~15-60 s each on 2 cores) costs more than
    the eager path loses in a session, so CPU compiles only when asked (`--compile on`)."""
    if mode == "auto":
        return device.type == "cuda"
    if mode not in ("on", "off"):
        raise ValueError(f"unknown compile mode {mode!r}")
    return mode == "on"


def use_cache_dir(path: Path) -> None:
    """Point inductor's caches (FX graph cache, autotuning, Triton/C++ builds) at `path`.

    Inductor reads the directory from the environment (and pins it there on first use), so this
    is the one place that sets it; it must run before the first compile of the process."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch._inductor.config.fx_graph_cache = True


@dataclass
class CompileStats:
    compiles: dict[int, float] = field(default_factory=dict)  # bucket (0: all) -> seconds of the calls that compiled
    calls: int = 0
    eager: int = 0  # batches above every bucket
    graphs: int = 0  # graphs dynamo made for this step (its compiles)
    # Why the step runs its eager function ("" while compiled): its compile raised, or the
    # start-up's compile budget was spent before its turn.
    fallback: str = ""
    cache_hits: int = 0  # inductor FX graphs (the step's, its regions') found in the on-disk cache
    cache_misses: int = 0  # ... and generated

    @property
    def cache(self) -> CacheState:
        """ "hit" when every graph of the step came from the cache, else "miss" ("off": none
        looked up, e.g. caches disabled)."""
        if self.cache_misses:
            return "miss"
        return "hit" if self.cache_hits else "off"


def _cache_lookups() -> tuple[int, int]:
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class CompiledStep:
    """`fn` compiled once per batch bucket; callable like `fn`.

    `dynamic_dims`: (argument index, dim) pairs that vary between calls of one bucket (the
    attention read length); marked so the bucket's function is traced for them symbolically.
    """

    def __init__(
        self,
        name: str,
        fn: StepFn,
        batch_sizes: Sequence[int],
        settings: CompileSettings,
        dynamic_dims: Sequence[tuple[int, int]] = (),
        dynamic_batch: bool | None = None,
        budget: CompileBudget | None = None,
        unbacked: bool | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.budget = budget if budget is not None else CompileBudget(settings.budget_s)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.dynamic_dims = tuple(dynamic_dims)
        inductor_graphs = settings.device_type == "cuda" and settings.cudagraphs == "inductor"
        self.mode = "reduce-overhead" if inductor_graphs else None
        self.stats = CompileStats()
        self._compiled: dict[int, Any] = {}

        self.dynamic_batch = settings.dynamic_batch if dynamic_batch is None else dynamic_batch
        self.unbacked_batch = settings.unbacked_batch if unbacked is None else unbacked

    def for_batch(self, batch: int) -> Any:
        if self.dynamic_batch:
            batch = 0  # one function for every bucket
        compiled = self._compiled.get(batch)
        if compiled is None:
            # A fresh torch.compile per bucket: its own entry, specialised to this batch.
            compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, mode=self.mode)
            self._compiled[batch] = compiled
        return compiled

    def __call__(self, *args: Tensor) -> Outputs:
        batch = args[0].shape[0] if args and args[0].dim() else 0
        if batch not in self.batch_sizes:
            self.stats.eager += 1
            return self.fn(*args)
        for index, dim in self.dynamic_dims:
            torch._dynamo.maybe_mark_dynamic(args[index], dim)
        key = 0 if self.dynamic_batch else batch
        if self.stats.fallback or (key not in self.stats.compiles and not self._may_compile()):
            self.stats.eager += 1
            return self.fn(*args)
        self.stats.calls += 1
        # A call that made dynamo compile a graph: its first for the key, or one more (a dynamic
        # batch's compile may specialise batch 1 in a graph of its own): all of them counted.
        graphs = counters["stats"]["unique_graphs"]
        hits, misses = _cache_lookups()
        started = time.perf_counter()
        try:
            if self.dynamic_batch:
                self._mark_batch(args)
            out = self._call(batch, args)
        except Exception as exc:
            if self.budget.phase == "serving":
                raise  # the call's own failure: start-up compiled every shape a call meets
            # A compile that fails (an inductor error, an op dynamo cannot trace) costs this
            # step its fusion, not the engine its start: the eager function is graphed instead.
            self.stats.fallback = f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            self.budget.spent_s += time.perf_counter() - started
            log.exception("%s: %s; it runs eagerly (graphed)", self.name, self.stats.fallback)
            self.stats.eager += 1
            return self.fn(*args)
        made = counters["stats"]["unique_graphs"] - graphs
        if key in self.stats.compiles and not made:
            return out
        seconds = time.perf_counter() - started
        self.budget.spent_s += seconds
        self.stats.compiles[key] = self.stats.compiles.get(key, 0.0) + seconds
        self.stats.graphs += made
        new_hits, new_misses = _cache_lookups()
        self.stats.cache_hits += new_hits - hits
        self.stats.cache_misses += new_misses - misses
        log.info(
            "compiled %s for batch %s in %.1f s (cache %s: %d graphs found, %d generated)",
            self.name,
            "any" if key == 0 else batch,
            seconds,
            self.stats.cache,
            new_hits - hits,
            new_misses - misses,
        )
        return out

    def _may_compile(self) -> bool:
        """Whether a first compile may start now; when the budget is spent, say so once."""
        if self.budget.allows():
            return True
        self.stats.fallback = f"compile budget of {self.budget.limit_s:.0f} s spent before its turn"
        log.warning("%s: %s; it runs eagerly (graphed)", self.name, self.stats.fallback)
        return False

    def _mark_batch(self, args: Sequence[Tensor]) -> None:
        """Make every argument's first dim the one symbolic batch of the dynamic-batch compile.

        Unbacked (CPU with library projections, the default there): nothing may branch on it,
        so no batch size gets a graph of its own. A backed size does: sdpa's and conv's shape
        checks guard on batch >= 2 (and conv's CPU backend choice on >= 16), so one compile
        became three graphs per function, doubling the start-up compile. Backed elsewhere:
        - with fused projections, whose [outputs, rows] result read transposed has a unit
          stride only at batch 1, which sdpa checks (an unbacked batch cannot be traced there);
        - on CUDA for the steps that attend with sdpa (code2wav's window, the code predictor).
        The thinker's and talker's steps over flex or flash slot caches are unbacked everywhere
        (`unbacked` given per step): no sdpa check in them, one graph for every batch. Backed
        there, batch 1 got a graph of its own, and a warm start on the compile cache file once
        ran that graph for batch 4 (2026-12-07, CPU, flex, layers as regions: the prefill's
        outputs came back with a batch of 1); unbacked, there is one graph to find."""
        for arg in args:
            if self.unbacked_batch:
                _mark_unbacked(arg, self.batch_sizes[-1])
            else:
                torch._dynamo.maybe_mark_dynamic(arg, 0)

    def _call(self, batch: int, args: Sequence[Tensor]) -> Outputs:
        if not self.dynamic_batch or self.unbacked_batch:
            return self.for_batch(batch)(*args)
        # Size-oblivious: a batch of 1 traces like any other size where the code allows it.
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return self.for_batch(batch)(*args)


def _mark_unbacked(arg: Tensor, largest: int) -> None:
    """The batch dim unbacked, in 1..largest where this torch takes a range (2.13; torch 2.11,
    the GPU machines', has no `min`/`max`: the range is then left open)."""
    mark = torch._dynamo.decorators.mark_unbacked
    try:
        mark(arg, 0, shape_id="batch", min=1, max=largest)
    except TypeError:
        mark(arg, 0, shape_id="batch")


class StepCompiler:
    """Compiles the step functions of one runner (see the module docstring)."""

    def __init__(self, settings: CompileSettings, batch_sizes: Sequence[int]) -> None:
        self.settings = settings
        self.batch_sizes = tuple(batch_sizes)
        self.steps: dict[str, CompiledStep] = {}
        self.budget = CompileBudget(settings.budget_s)
        if settings.cache_dir is not None:
            use_cache_dir(settings.cache_dir)
        # Dynamo keeps compiled entries per code object, shared by every runner of the process
        # (tests build many): room for every bucket of several runners before it gives up.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def wrap(
        self,
        name: str,
        fn: StepFn,
        dynamic_dims: Sequence[tuple[int, int]] = (),
        *,
        dynamic_batch: bool | None = None,
        unbacked: bool | None = None,
    ) -> CompiledStep:
        """`unbacked`: how this step marks its symbolic batch (None: the settings'; see
        CompiledStep._mark_batch)."""
        step = CompiledStep(
            name, fn, self.batch_sizes, self.settings, dynamic_dims, dynamic_batch, self.budget, unbacked
        )
        self.steps[name] = step
        return step

    def compile_seconds(self) -> dict[str, dict[int, float]]:
        return {name: dict(step.stats.compiles) for name, step in self.steps.items()}

    def cache_report(self) -> dict[str, CacheState]:
        """Each step's on-disk cache result at its compiles: "hit" (no code generated), "miss"
        (some generated), "off" (nothing looked up)."""
        return {name: step.stats.cache for name, step in self.steps.items()}

    def finish_start_up(self) -> None:
        """The runner serves from now on: a failing step raises instead of falling back."""
        self.budget.phase = "serving"

    def fallbacks(self) -> dict[str, str]:
        """The steps that run eagerly instead of compiled, and why."""
        return {name: step.stats.fallback for name, step in self.steps.items() if step.stats.fallback}

    def graph_counts(self) -> dict[str, int]:
        """Graphs dynamo made for each step: 1 where one compile serves every bucket."""
        return {name: step.stats.graphs for name, step in self.steps.items()}


class RerunGraph:
    """A 'graph' that re-runs the function on the pool's static inputs. Its capture already ran
    the call it was made for, so its first replay is skipped: a step with state that is not
    idempotent (code2wav's conv states) must run exactly once per call."""

    def __init__(self, fn: StepFn, static_in: tuple[Tensor, ...], static_out: tuple[Tensor, ...]) -> None:
        self.fn, self.static_in, self.static_out = fn, static_in, static_out
        self.ran = True

    def replay(self) -> None:
        if self.ran:
            self.ran = False
            return
        out = self.fn(*self.static_in)
        for static, new in zip(self.static_out, (out,) if isinstance(out, Tensor) else out, strict=True):
            static.copy_(new)


class PaddedBackend:
    """CaptureBackend that captures nothing: the pool still pads to buckets and keeps static
    buffers, so compiled code sees bucket shapes only (CPU, or CUDA with inductor's graphs)."""

    def accepts(self, tensors: Sequence[Tensor]) -> bool:
        return True

    def new_pool(self) -> Any:
        return None

    def warmup(self, fn: StepFn, args: Sequence[Tensor]) -> Outputs:
        return fn(*args)

    def capture(self, fn: StepFn, static_args: Sequence[Tensor], pool: Any) -> tuple[RerunGraph, Outputs]:
        out = fn(*static_args)
        # Fresh buffers: the compiled function's outputs may alias its internal scratch.
        outs = tuple(o.clone() for o in ((out,) if isinstance(out, Tensor) else out))
        return RerunGraph(fn, tuple(static_args), outs), outs[0] if isinstance(out, Tensor) else outs
