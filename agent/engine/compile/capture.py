"""Hand-captured CUDA graphs around the engine's step functions.

`CUDAGraphed` follows moshi's `utils/compile.py` wrapper: the first calls of a step function run
eagerly (warm-up, on a side stream), then one call captures a `torch.cuda.CUDAGraph` reading
from static input buffers, and every later call copies its inputs into those buffers and
replays. `GraphPool` is nano-vllm's per-batch-size capture: one graph per batch bucket
(1, 2, 4, 8, ...), inputs padded up to the bucket, all graphs sharing one memory pool.

Contract for the wrapped function: `fn(*tensors) -> Tensor | tuple[Tensor, ...]`, no host syncs
(`.item()`, data-dependent shapes) and no allocation it relies on outside its outputs. State it
mutates in place (a static KV cache indexed by a position tensor) is fine: the graph replays
those writes.

**Outputs are static buffers.** A replay returns tensors that the next replay overwrites (and,
since all graphs of one wrapper share one memory pool, the next replay of *any* of its graphs:
a later capture may place its outputs in an earlier graph's scratch memory). Consume them before
the next call or pass `clone_outputs=True`. Keep `warmup_iters >= 1` on CUDA: capturing cold
(cuBLAS handles, lazy module state) can fail or record one-time work.

A graph is never replayed for inputs it was not captured for: graphs are keyed by every input's
shape, dtype and device; a new signature gets its own graph (up to `max_graphs`) or runs
eagerly. `disabled=True` (the `--no-cuda-graphs` flag) or inputs not on a CUDA device always
run eagerly, which is the path CPU tests and CI exercise. Graphs are bound to the thread that
captured them (CUDA graph capture/replay and the caching allocator's pools are per-stream and the
engine owns one thread), so a graphed call from any other thread raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

Outputs = Tensor | tuple[Tensor, ...]
StepFn = Callable[..., Outputs]
Signature = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


class Replayable(Protocol):
    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    """What the wrappers need from CUDA; tests inject a CPU fake so the buffer logic really runs."""

    def accepts(self, tensors: Sequence[Tensor]) -> bool: ...

    def new_pool(self) -> Any: ...

    def warmup(self, fn: StepFn, args: Sequence[Tensor]) -> Outputs: ...

    def capture(self, fn: StepFn, static_args: Sequence[Tensor], pool: Any) -> tuple[Replayable, Outputs]: ...


class CudaBackend:
    """The real thing: side-stream warm-up, `torch.cuda.graph` capture into a shared pool."""

    def accepts(self, tensors: Sequence[Tensor]) -> bool:
        if not torch.cuda.is_available() or not all(t.is_cuda for t in tensors):
            return False
        # A call made while an outer graph is being captured must be recorded into that graph.
        return not torch.cuda.is_current_stream_capturing()

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warmup(self, fn: StepFn, args: Sequence[Tensor]) -> Outputs:
        # Side stream as in PyTorch's capture recipe: lazy inits (cuBLAS workspaces, autotuning)
        # happen outside the default stream the graph will later be captured against.
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = fn(*args)
        current.wait_stream(side)
        for t in _as_tuple(out):
            # Allocated on `side`, used on `current`: keep the allocator from reusing it early.
            t.record_stream(current)
        return out

    def capture(self, fn: StepFn, static_args: Sequence[Tensor], pool: Any) -> tuple[Replayable, Outputs]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(*static_args)
        return graph, out


@dataclass
class GraphStats:
    eager: int = 0  # disabled, non-CUDA inputs, or a signature refused (see `refused`)
    warmup: int = 0
    captures: int = 0
    replays: int = 0
    refused: int = 0  # eager because no graph may be captured for this signature


@dataclass
class _Captured:
    graph: Replayable
    static_in: tuple[Tensor, ...]
    static_out: tuple[Tensor, ...]
    single: bool  # fn returned a bare tensor, not a tuple


@dataclass
class _State:
    graphs: dict[Signature, _Captured] = field(default_factory=dict)
    warm: dict[Signature, int] = field(default_factory=dict)
    pool: Any = None
    owner: int | None = None


class CUDAGraphed:
    """Graph-replayed `fn`, one graph per input signature (shape, dtype, device of every arg)."""

    def __init__(
        self,
        fn: StepFn,
        *,
        warmup_iters: int = 2,
        disabled: bool = False,
        clone_outputs: bool = False,
        max_graphs: int = 4,
        backend: CaptureBackend | None = None,
    ) -> None:
        if warmup_iters < 0 or max_graphs < 1:
            raise ValueError("warmup_iters must be >= 0 and max_graphs >= 1")
        self.fn = fn
        self.warmup_iters = warmup_iters
        self.disabled = disabled
        self.clone_outputs = clone_outputs
        self.max_graphs = max_graphs
        self.backend: CaptureBackend = backend if backend is not None else CudaBackend()
        self.stats = GraphStats()
        self._state = _State()

    @property
    def num_graphs(self) -> int:
        return len(self._state.graphs)

    def reset(self) -> None:
        """Drop every graph and its pool, e.g. after the buffers `fn` closes over were reallocated."""
        owner = self._state.owner
        self._state = _State(owner=owner)

    def __call__(self, *args: Tensor) -> Outputs:
        _check_args(args)
        if self.disabled or not self.backend.accepts(args):
            self.stats.eager += 1
            return self.fn(*args)
        self._check_thread()
        key = self._key(args)
        captured = self._state.graphs.get(key) if key is not None else None
        if captured is None:
            if key is None or self.num_graphs >= self.max_graphs:
                # Never stretch a graph over inputs it was not captured for: run eagerly.
                self.stats.refused += 1
                self.stats.eager += 1
                return self.fn(*args)
            seen = self._state.warm.get(key, 0)
            if seen < self.warmup_iters:
                self._state.warm[key] = seen + 1
                self.stats.warmup += 1
                return self._warmup(key, args)
            captured = self._capture(key, args)
        self._copy_in(captured, args)
        captured.graph.replay()
        self.stats.replays += 1
        return self._outputs(captured, args)

    # Hooks GraphPool overrides: how a call maps to a graph, and how buffers are filled/read.

    def _key(self, args: Sequence[Tensor]) -> Signature | None:
        return _signature(args)

    def _make_static(self, key: Signature, args: Sequence[Tensor]) -> tuple[Tensor, ...]:
        # Clones (not empties) so that capture-time code reading values sees real inputs.
        return tuple(a.detach().clone() for a in args)

    def _copy_in(self, captured: _Captured, args: Sequence[Tensor]) -> None:
        for static, arg in zip(captured.static_in, args, strict=True):
            if static.shape != arg.shape or static.dtype != arg.dtype:
                raise RuntimeError(
                    f"graph input {tuple(static.shape)} {static.dtype} cannot take {tuple(arg.shape)} {arg.dtype}"
                )
            static.copy_(arg)

    def _check_outputs(self, key: Signature, outputs: tuple[Tensor, ...]) -> None:
        pass

    def _warmup(self, key: Signature, args: Sequence[Tensor]) -> Outputs:
        return self.backend.warmup(self.fn, args)

    def _read_out(self, static: Tensor, args: Sequence[Tensor]) -> Tensor:
        return static

    # Internals.

    def _capture(self, key: Signature, args: Sequence[Tensor]) -> _Captured:
        if self._state.pool is None:
            self._state.pool = self.backend.new_pool()
        static_in = self._make_static(key, args)
        graph, out = self.backend.capture(self.fn, static_in, self._state.pool)
        single = isinstance(out, Tensor)
        static_out = _as_tuple(out)
        self._check_outputs(key, static_out)
        captured = _Captured(graph=graph, static_in=static_in, static_out=static_out, single=single)
        self._state.graphs[key] = captured
        self.stats.captures += 1
        return captured

    def _outputs(self, captured: _Captured, args: Sequence[Tensor]) -> Outputs:
        outs = tuple(self._read_out(s, args) for s in captured.static_out)
        if self.clone_outputs:
            outs = tuple(o.clone() for o in outs)
        return outs[0] if captured.single else outs

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._state.owner is None:
            self._state.owner = me
        elif self._state.owner != me:
            raise RuntimeError(
                "CUDA graphs are bound to the thread that first called this wrapper "
                f"(thread {self._state.owner}); called from thread {me}"
            )


class GraphPool(CUDAGraphed):
    """nano-vllm style: one graph per batch bucket, inputs padded along dim 0 to the bucket.

    Every argument and every output has the batch on dim 0. A call with batch `b` runs the graph
    of the smallest bucket >= b with rows b.. filled with `pad_values[i]` (0 by default; pick
    values that are harmless for `fn`, e.g. a scratch cache slot), and returns rows :b of the
    outputs. A batch larger than every bucket runs eagerly. All graphs share one memory pool.
    """

    def __init__(
        self,
        fn: StepFn,
        batch_sizes: Sequence[int] = (1, 2, 4, 8),
        *,
        pad_values: Sequence[float | int] | None = None,
        warmup_iters: int = 1,
        disabled: bool = False,
        clone_outputs: bool = False,
        max_graphs: int | None = None,
        backend: CaptureBackend | None = None,
    ) -> None:
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
        # One graph per bucket by default; more when another input dimension also varies
        # (e.g. the attention length bucket of a decode step): each value gets its own graphs.
        super().__init__(
            fn,
            warmup_iters=warmup_iters,
            disabled=disabled,
            clone_outputs=clone_outputs,
            max_graphs=max_graphs if max_graphs is not None else len(sizes),
            backend=backend,
        )
        self.batch_sizes = tuple(sizes)
        self.pad_values = tuple(pad_values) if pad_values is not None else None

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def capture_all(self, make_args: Callable[[int], Sequence[Tensor]]) -> None:
        """Capture every bucket now, largest first so smaller graphs reuse its pool memory.

        `make_args(batch)` returns example inputs of that batch; `fn` really runs on them
        (warm-up), so they must be as harmless as the pad values.
        """
        for batch in reversed(self.batch_sizes):
            args = tuple(make_args(batch))
            if self.disabled or not self.backend.accepts(args):
                return
            # Warm-up calls, then the capturing one; bounded so a refused signature cannot spin.
            for _ in range(self.warmup_iters + 1):
                if self.captured_for(args):
                    break
                self(*args)

    def captured_for(self, args: Sequence[Tensor]) -> bool:
        """Whether a call with these arguments would replay a graph (not warm up or run eagerly)."""
        key = self._key(args)
        return key is not None and key in self._state.graphs

    def _key(self, args: Sequence[Tensor]) -> Signature | None:
        batch = _batch_of(args)
        bucket = self.bucket(batch)
        if bucket is None:
            return None
        return tuple(((bucket, *shape[1:]), dtype, device) for shape, dtype, device in _signature(args))

    def _warmup(self, key: Signature, args: Sequence[Tensor]) -> Outputs:
        # On inputs padded to the bucket, as the capture and replays will be: a compiled `fn`
        # (agent/engine/compile/inductor.py) then only ever sees bucket shapes (no compile per batch).
        out = self.backend.warmup(self.fn, self._make_static(key, args))
        batch = args[0].shape[0]
        return out[:batch] if isinstance(out, Tensor) else tuple(o[:batch] for o in _as_tuple(out))

    def _pad_value(self, i: int) -> float | int:
        return 0 if self.pad_values is None else self.pad_values[i]

    def _make_static(self, key: Signature, args: Sequence[Tensor]) -> tuple[Tensor, ...]:
        statics = []
        for i, ((shape, dtype, device), arg) in enumerate(zip(key, args, strict=True)):
            static = torch.empty(shape, dtype=dtype, device=device)
            static[arg.shape[0] :].fill_(self._pad_value(i))
            static[: arg.shape[0]].copy_(arg)
            statics.append(static)
        return tuple(statics)

    def _copy_in(self, captured: _Captured, args: Sequence[Tensor]) -> None:
        batch = args[0].shape[0]
        for i, (static, arg) in enumerate(zip(captured.static_in, args, strict=True)):
            if static.shape[1:] != arg.shape[1:] or static.dtype != arg.dtype or static.shape[0] < batch:
                raise RuntimeError(
                    f"graph input {tuple(static.shape)} {static.dtype} cannot take {tuple(arg.shape)} {arg.dtype}"
                )
            static[:batch].copy_(arg)
            # Rows left by a larger earlier batch must not leak into this call's pad rows.
            static[batch:].fill_(self._pad_value(i))

    def _check_outputs(self, key: Signature, outputs: tuple[Tensor, ...]) -> None:
        bucket = key[0][0][0]
        for out in outputs:
            if out.dim() == 0 or out.shape[0] != bucket:
                raise ValueError(
                    f"GraphPool outputs need the batch on dim 0: got {tuple(out.shape)} for batch {bucket}"
                )

    def _read_out(self, static: Tensor, args: Sequence[Tensor]) -> Tensor:
        return static[: args[0].shape[0]]


def _check_args(args: Sequence[Any]) -> None:
    for a in args:
        if not isinstance(a, Tensor):
            raise TypeError(f"graphed step functions take tensors only, got {type(a).__name__}")


def _signature(args: Sequence[Tensor]) -> Signature:
    return tuple((tuple(a.shape), a.dtype, a.device) for a in args)


def _batch_of(args: Sequence[Tensor]) -> int:
    if not args or any(a.dim() == 0 for a in args):
        raise ValueError("GraphPool needs at least one argument, each with the batch on dim 0")
    batch = args[0].shape[0]
    if any(a.shape[0] != batch for a in args):
        raise ValueError(f"arguments disagree on the batch size: {[tuple(a.shape) for a in args]}")
    return batch


def _as_tuple(out: Any) -> tuple[Tensor, ...]:
    outs = (out,) if isinstance(out, Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
    if outs is None or not all(isinstance(o, Tensor) for o in outs):
        raise TypeError(f"a graphed step function must return a tensor or a tuple of tensors, got {type(out).__name__}")
    return outs


def storage_of(t: Tensor) -> int:
    """The address of a tensor's storage: views and in-place results share their base's."""
    return t.untyped_storage().data_ptr()


def tensors_in(values: Sequence[Any]) -> list[Tensor]:
    """The tensors among `values`, lists and tuples flattened."""
    out: list[Tensor] = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += tensors_in(v)
    return out
