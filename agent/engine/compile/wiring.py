"""How the streaming engine uses CUDA graphs (agent/engine/compile/capture.py): mode, buckets, pools.

The per-frame step functions are graphed, each by a `GraphPool` (one graph per batch bucket, rows
padded up to it, all of a pool's graphs in one memory pool): the thinker's decode step, the
talker's step, the whole code-predictor loop (15 residual codebooks, each chosen by argmax or a
seeded draw, and the embedding sums), code2wav's per-frame step and, when a stage samples, the
thinker's and the talker's token choice (agent/engine/stages/token_choice.py).

What makes a step graphable here:
- every per-call value is a device tensor input (slots, cache index, RoPE position, mask),
  copied into the graph's static buffers; nothing is read on the host inside the step;
- pad rows write into a scratch row of every slot cache (`pad_slot`, one row past the
  sessions' rows), so they can never touch a session's state. When every batch size up to the
  slots is a bucket (one or two slots: a 24 GiB card's plan), no batch is ever padded and the
  KV caches get no scratch row (`kv_rows`, `kv_pad_slot`): a whole session's KV saved, the
  start-up captures writing into slot 0 before any session holds it;
- caches are reserved at their limit before capture: a graph holds their addresses;
- with sdpa (CPU, or a GPU without flex), attention reads a fixed number of keys, the mask
  says which are valid. Reading the whole context limit (32k keys) every step would cost more
  than the graph saves, so the read length is bucketed: 256, 512, ... up to the cache capacity,
  a graph per (batch, length) bucket. flex and flash-attn read each row's own length from the
  cache index, so their graphs are not keyed by a length at all (the mask is one column wide,
  never read): one graph per batch bucket. Either way every graph a call can need is captured
  at start-up: a capture inside a live tick stops every session on the engine.

Modes: "cuda" (real graphs), "cpu" (the same wiring on CPU, each step traced with TorchScript
per bucket and replayed off the GIL: agent/engine/compile/cpu_traces.py; what `omni-agent serve` runs on
CPU), "fake" (the same wiring on CPU through a capture backend the caller injects as
`GraphConfig.capture`: tests and the CPU benchmarks pass agent/engine/instruments/fake_graphs.py's), "off"
(the eager path: exact-length attention, no padding), "auto" (cuda on a CUDA device, else off).
`--no-cuda-graphs` makes it "off".

Compilation (agent/engine/compile/inductor.py; `compile`: "auto" = on CUDA only, `--compile on|off`)
wraps each step function in one torch.compile before its pool is made: by default one compile
for every batch bucket (the batch symbolic; graphs are still captured per bucket) with each
decoder layer a nested compile region on CUDA, so a step's cold compile grows neither with the
buckets nor with the depth (`--compile-per-bucket` specialises each bucket instead). It needs the
static wiring too (bucket shapes, reserved caches), so with graphs "off" and compile on the
pools still pad, through a backend that captures nothing (CPU). Buckets: 1, 2, 4, 8, 16; a
bucket costs one capture per step function at start-up and its memory pool, and a batch of
9-16 sessions would otherwise run eagerly, i.e. thousands of launches per tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from agent.engine.compile.cache import ArtifactFile, CacheState, software_key
from agent.engine.compile.capture import CaptureBackend, CudaBackend, GraphPool, GraphStats, StepFn
from agent.engine.compile.cpu_traces import TracedBackend
from agent.engine.compile.inductor import (
    CompileMode,
    CompileSettings,
    CudaGraphImpl,
    PaddedBackend,
    StepCompiler,
    resolve_compile,
)
from agent.engine.ops.attention import Backend
from agent.engine.ops.slots import SlotKV
from agent.engine.state.kv import KVState

GraphMode = Literal["auto", "off", "cuda", "cpu", "fake"]


@dataclass(frozen=True)
class GraphConfig:
    mode: GraphMode = "auto"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    compile: CompileMode = "auto"  # torch.compile the step functions ("auto": on CUDA only)
    compile_cache: Path | None = None  # inductor's on-disk cache (None: the environment's)
    cudagraphs: CudaGraphImpl = "own"  # with compile on CUDA: our capture, or inductor's
    # One compile for all buckets, the batch symbolic (None: yes; False: one per bucket, each
    # specialised to its batch: `--compile-per-bucket`, 4-5x the cold start).
    compile_dynamic_batch: bool | None = None
    # Each decoder layer a nested compile region (agent/engine/ops/slots.py decoder_forward):
    # one layer's code generated and reused for all of them, so the cold compile of a step does
    # not grow with depth (48 thinker layers). None: on CUDA, where the inlined compile of every
    # step at real depth took longer than a GPU session; off on CPU, where compiling is opt-in.
    compile_regions: bool | None = None
    # The slot caches' attention kernel (agent/engine/ops/attention.py); None: the device's best.
    # Forcing "flex" on CPU runs the kernel CUDA uses through the same wiring (tests, benches).
    attention: Backend | None = None
    # Compile seconds a start-up may spend; steps not compiled by then run eagerly, graphed (and a
    # step whose compile fails does so anyway). None: no limit.
    compile_budget_s: float | None = None
    # Compiled code-predictor projections as reductions with the norms and residual adds fused
    # in (agent/engine/ops/gemv.py), or library matmuls. None: on CUDA only (compiled for all batches
    # at once, as CPU compiles, inductor's C++ loops for them are slow: the loop 5x slower at
    # batch 1, 100x at 4; scripts/bench_code_predictor.py, bench/results/code-predictor-cpu.txt).
    fused_gemv: bool | None = None
    min_key_len: int = 256  # shortest attention read of a graphed decode step
    warmup_iters: int = 1  # eager calls per graph before its capture (lazy CUDA init)
    check_replays: bool = True  # fake mode: compare every replay's ops with the capture's
    # Fake mode's capture backend, made from this config. Injected (fake_graphs.fake_graph_config)
    # so that production code never imports the CPU stand-in.
    capture: Callable[["GraphConfig"], CaptureBackend] | None = None


@dataclass
class DecodeRows:
    """Static-shape inputs of one graphed decode step for B sessions (all [B] long but mask)."""

    slots: Tensor
    index: Tensor  # where each row's new key/value goes (its cache length)
    positions: Tensor  # RoPE position of each row's new token
    mask: Tensor  # [B, key_len] bool: key j visible iff j <= index
    tokens: Tensor | None = None


def resolve_mode(mode: GraphMode, device: torch.device) -> Literal["off", "cuda", "cpu", "fake"]:
    if mode == "auto":
        return "cuda" if device.type == "cuda" else "off"
    if mode == "cuda" and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
    if mode in ("fake", "cpu") and device.type != "cpu":
        raise ValueError(f"{mode} graphs run on CPU tensors, the model is on {device}")
    if mode not in ("off", "cuda", "cpu", "fake"):
        raise ValueError(f"unknown graph mode {mode!r}")
    return mode


class Graphing:
    """One runner's graph setup: the resolved mode, its backend and the pools it made."""

    def __init__(self, config: GraphConfig, device: torch.device, max_sessions: int) -> None:
        self.config = config
        self.device = device
        self.mode = resolve_mode(config.mode, device)
        self.artifacts: ArtifactFile | None = None
        self.artifacts_state: CacheState = "off"
        self.batch_sizes = batch_buckets(config.batch_sizes, max_sessions)
        self.compiler: StepCompiler | None = None
        self.fused_gemv = device.type == "cuda" if config.fused_gemv is None else config.fused_gemv
        regions = config.compile_regions
        self.regions = device.type == "cuda" if regions is None else regions
        if resolve_compile(config.compile, device):
            if self.mode == "fake":
                raise ValueError("fake graphs trace the eager ops: run them with compile off")
            dynamic = True if config.compile_dynamic_batch is None else config.compile_dynamic_batch
            # Unbacked only where it was shown to trace (CompiledStep._mark_batch says why).
            unbacked = device.type == "cpu" and not self.fused_gemv
            settings = CompileSettings(
                config.compile_cache, config.cudagraphs, device.type, dynamic, unbacked, config.compile_budget_s
            )
            self.compiler = StepCompiler(settings, self.batch_sizes)
        self.backend: CaptureBackend | None = None
        self.warmup_iters = config.warmup_iters
        if self.mode == "cuda" and not (self.compiler is not None and config.cudagraphs == "inductor"):
            self.backend = CudaBackend()
        elif self.mode == "cpu" and self.compiler is None:
            self.backend, self.warmup_iters = TracedBackend(), 0
        elif self.mode == "fake":
            if config.capture is None:
                raise ValueError(
                    "graph mode 'fake' needs an injected capture backend "
                    "(agent.engine.instruments.fake_graphs.fake_graph_config())"
                )
            self.backend = config.capture(config)
        elif self.compiler is not None:
            self.backend, self.warmup_iters = PaddedBackend(), 0
        self.pools: dict[str, GraphPool] = {}

    @property
    def fuses_projections(self) -> bool:
        """Whether compiled decode steps take the fused projections (agent/engine/ops/gemv.py)."""
        return self.compiler is not None and self.fused_gemv

    @property
    def compiles_regions(self) -> bool:
        """Whether compiled steps run each decoder layer as a nested compile region."""
        return self.compiler is not None and self.regions

    @property
    def enabled(self) -> bool:
        """Whether the steps run the static wiring (padded buckets, reserved caches, pools)."""
        return self.backend is not None

    def cache_rows(self, slots: int) -> int:
        """Rows of a small per-slot state (code2wav's) for `slots` sessions: one more (row
        `slots`) for pad rows and the start-up captures, whether or not a batch is ever padded."""
        return slots + 1 if self.enabled else slots

    def kv_rows(self, slots: int) -> int:
        """Rows of a KV slot cache: the scratch row only where some batch is padded."""
        return slots + 1 if self.enabled and needs_pad_row(self.batch_sizes, slots) else slots

    def kv_pad_slot(self, slots: int) -> int:
        """The KV row pad rows and start-up captures write into: the scratch row, or slot 0
        where there is none (no batch is padded then, and captures run before any session)."""
        return slots if self.kv_rows(slots) > slots else 0

    def pool(
        self,
        name: str,
        fn: StepFn,
        pad_values: Sequence[float | int],
        *,
        clone_outputs: bool,
        variants: int = 1,
        compiled: bool = False,
        dynamic_dims: Sequence[tuple[int, int]] = (),
        dynamic_batch: bool | None = None,
        unbacked: bool | None = None,
    ) -> GraphPool | None:
        """A pool for `fn`, or None when graphs are off. `variants`: how many values another
        input dimension takes (attention length buckets): graphs allowed per batch bucket.
        `compiled`: compile `fn` first when compiling; `dynamic_dims` names the varying
        dimensions, (arg, dim); `dynamic_batch` overrides the compiler's choice of one compile
        for every batch bucket (None: the compiler's setting), `unbacked` how its batch is marked."""
        if not self.enabled:
            return None
        if self.compiler is not None and compiled:
            fn = self.compiler.wrap(name, fn, dynamic_dims, dynamic_batch=dynamic_batch, unbacked=unbacked)
        pool = GraphPool(
            fn,
            self.batch_sizes,
            pad_values=pad_values,
            warmup_iters=self.warmup_iters,
            clone_outputs=clone_outputs,
            max_graphs=len(self.batch_sizes) * variants,
            backend=self.backend,
        )
        self.pools[name] = pool
        return pool

    def stats(self) -> dict[str, GraphStats]:
        return {name: pool.stats for name, pool in self.pools.items()}

    def load_compile_cache(self, shapes: Mapping[str, Any]) -> CacheState:
        """Before the first compile: load the artifacts of an earlier start with the same
        software, card and `shapes` (agent/engine/compile/cache.py); "off" when not compiling."""
        if self.compiler is None or self.config.compile_cache is None:
            return "off"
        c = self.config
        key = {
            **software_key(self.device),
            **shapes,
            "buckets": self.batch_sizes,
            "graphs": (self.mode, c.cudagraphs, c.min_key_len, c.warmup_iters),
            "compile": (self.compiler.settings.dynamic_batch, self.compiler.settings.unbacked_batch),
            "regions": self.regions,
            "fused_gemv": self.fused_gemv,
        }
        self.artifacts = ArtifactFile(c.compile_cache / "artifacts", key)
        self.artifacts_state = self.artifacts.load()
        return self.artifacts_state

    def finish_start_up(self) -> int:
        """Every graph is captured: the compiled steps serve from now on (a failure is no longer a
        compile's), and what this start compiled is written to the cache file, unless every step
        came from the loaded file (it holds them already); the bytes written."""
        if self.compiler is not None:
            self.compiler.finish_start_up()
        if self.artifacts is None or self.compiler is None:
            return 0
        report = self.compiler.cache_report()
        if self.artifacts_state == "hit" and "miss" not in report.values():
            return 0
        return self.artifacts.save()

    def key_lens(self, kv: SlotKV) -> list[int]:
        """Attention read lengths of a graphed step on `kv`: min_key_len doubling, capped by (and
        ending at) the capacity where the kernel reads a window (sdpa); one dummy length of 1
        where it reads each row's own length from the cache index (flex, flash)."""
        if not kv.windowed:
            return [1]
        lens, n = [], self.config.min_key_len
        while n < kv.capacity:
            lens.append(n)
            n *= 2
        return lens + [kv.capacity]

    def key_len(self, needed: int, kv: SlotKV) -> int:
        if needed > kv.capacity:
            raise RuntimeError(f"KV slot overflow: {needed} keys > capacity {kv.capacity}")
        if not kv.windowed:
            return 1  # the kernel reads each row's own length; the 1-wide mask is never read
        return next(n for n in self.key_lens(kv) if n >= needed)

    def decode_rows(
        self, states: Sequence[KVState], kv: SlotKV, device: torch.device, tokens: Sequence[int] | None = None
    ) -> DecodeRows:
        """The per-call inputs of a graphed decode step for these sessions: one host-to-device
        copy for the integers, the mask made on the device from the cache index."""
        rows = [[s.slot for s in states], [s.length for s in states], [s.next_pos for s in states]]
        if tokens is not None:
            rows.append(list(tokens))
        meta = torch.tensor(rows, dtype=torch.long).to(device)
        key_len = self.key_len(max(s.length for s in states) + 1, kv)
        mask = torch.arange(key_len, device=device).view(1, -1) <= meta[1].view(-1, 1)
        return DecodeRows(meta[0], meta[1], meta[2], mask, meta[3] if tokens is not None else None)

    def example_rows(self, batch: int, pad_slot: int, key_len: int, device: torch.device) -> DecodeRows:
        """Harmless decode inputs for capture at start-up: every row is a pad row."""
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        slots = torch.full((batch,), pad_slot, dtype=torch.long, device=device)
        mask = torch.ones(batch, key_len, dtype=torch.bool, device=device)
        return DecodeRows(slots, zeros, zeros.clone(), mask, zeros.clone())


def batch_buckets(sizes: Sequence[int], slots: int) -> tuple[int, ...]:
    """The graph buckets for `slots` sessions: the configured sizes up to the first that holds
    every session (larger ones would never be used)."""
    ordered = sorted(set(sizes))
    if not ordered or ordered[0] < 1:
        raise ValueError(f"graph batch sizes must be >= 1, got {tuple(sizes)}")
    fits = [b for b in ordered if b >= slots]
    return tuple(b for b in ordered if b < slots) + tuple(fits[:1])


def needs_pad_row(buckets: Sequence[int], slots: int) -> bool:
    """Whether some batch of 1..slots sessions is padded up to a larger bucket (and so needs a
    scratch row of every KV cache; one above every bucket runs eagerly, unpadded): the memory
    plan counts the row by the same rule."""
    return any(n not in buckets and n < max(buckets) for n in range(1, slots + 1))


def slot_cache_with_graph(
    graphing: Graphing | None,
    decoder: torch.nn.Module,
    slots: int,
    limit: int,
    device: torch.device,
    dtype: torch.dtype,
    name: str,
    step: StepFn,
    pad_values: Sequence[float | int],
    *,
    clone_outputs: bool,
    mask_arg: int = 4,
) -> tuple[SlotKV, GraphPool | None]:
    """A decoder's KV slots and, when graphs are on, the pool of its decode step (whose
    argument `mask_arg` is the [B, key_len] attention mask).

    Graphs hold the cache's addresses, so it is reserved at its limit up front and never
    moves; its extra row (index `slots`), where some batch is padded, takes pad rows' writes.
    """
    rows = graphing.kv_rows(slots) if graphing is not None else slots
    kv = SlotKV(decoder, rows, limit, device, dtype, graphing.config.attention if graphing is not None else None)
    if graphing is None or not graphing.enabled:
        return kv, None
    kv.reserve(limit)
    variants = len(graphing.key_lens(kv))
    # A windowed kernel's mask length is the attention length bucket: dynamic for the compiler.
    return kv, graphing.pool(
        name,
        step,
        pad_values,
        clone_outputs=clone_outputs,
        variants=variants,
        compiled=True,
        dynamic_dims=((mask_arg, 1),) if kv.windowed else (),
        # No sdpa over the slots (flex, flash): one graph for every batch (CompiledStep._mark_batch).
        unbacked=None if kv.windowed else True,
    )
