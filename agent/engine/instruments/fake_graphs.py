"""A CPU stand-in for CUDA graph capture, strict enough to catch what would break a real graph.

`FakeCaptureBackend` plugs into `CUDAGraphed` / `GraphPool` (agent/engine/compile/capture.py) in place
of `CudaBackend`, so that tests without a GPU run the engine's graph wiring for real: static
input buffers, copy-in, replay, copy-out, batch padding, one graph per bucket. A fake graph
"replays" by calling the step function again on its static inputs and copying the results into
its static outputs. Where a plain re-run would be kinder than CUDA, it is made as strict:

- capture executes nothing: everything the function writes that existed before the call (KV
  caches, conv states) is restored afterwards, and outputs are poisoned (NaN / -12345) until the
  first replay, so a wrapper that forgot to copy in or replay returns garbage, as on a GPU;
- host syncs raise during capture (`.item()`, `int(t)`, `bool(t)`, `nonzero`, boolean-mask
  indexing, ...): CUDA refuses them while capturing;
- every replay must issue the capture's exact operations: same ops, same non-tensor arguments,
  same shapes, and the same storage for every tensor that outlives the call (weights, caches,
  static buffers). A real graph bakes in the Python decisions and addresses of capture time, so
  a step that branches on Python state, or a cache reallocated after capture (grown instead of
  reserved), would silently compute the wrong thing on a GPU; here it raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from agent.engine.compile.capture import Outputs, StepFn, storage_of, tensors_in
from agent.engine.compile.wiring import GraphConfig

_aten = torch.ops.aten
# Ops that wait for the device (a value read on the host or a data-dependent output size).
# (`int(t)` / `.item()` reach the dispatcher as `item` under inference mode, else as
# `_local_scalar_dense`; `.tolist()` of a CPU tensor never does, so that one slips through.)
SYNCING = {
    _aten.item.default,
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
}
INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}

OpRecord = tuple[str, tuple[Any, ...]]


class _Tracer(TorchDispatchMode):
    """Records the ops a step issues; optionally snapshots pre-existing tensors before their
    first write (to undo them) and refuses host syncs."""

    def __init__(self, undo_writes: bool, refuse_syncs: bool) -> None:
        super().__init__()
        self.undo_writes, self.refuse_syncs = undo_writes, refuse_syncs
        self.ops: list[OpRecord] = []
        self.fresh: set[int] = set()  # storages allocated during the call
        self.saved: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refuse_syncs:
            self._check_sync(func, args)
        schema = func._schema
        flat = list(args) + list(kwargs.values())
        if self.undo_writes:
            for arg, value in zip(schema.arguments, args):
                written = arg.alias_info is not None and arg.alias_info.is_write
                if written and isinstance(value, Tensor) and storage_of(value) not in self.fresh:
                    self.saved.append((value, value.clone()))
        self.ops.append((str(func), tuple(self._describe(a) for a in flat)))
        out = func(*args, **kwargs)
        # A result is new memory unless it shares an input's storage (views, `to` a same dtype,
        # in-place ops): then it is classified as that input is.
        inputs = {storage_of(t) for t in tensors_in(flat)}
        for value in tensors_in(out if isinstance(out, (tuple, list)) else (out,)):
            if storage_of(value) not in inputs:
                self.fresh.add(storage_of(value))
        return out

    def _check_sync(self, func, args) -> None:
        if func in SYNCING:
            raise RuntimeError(f"host sync during graph capture: {func}")
        if func in INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices or ()):
                raise RuntimeError(f"boolean-mask indexing (a host sync) during graph capture: {func}")

    def _describe(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            # Tensors made during the call may sit anywhere; those that outlive it may not move.
            where = None if storage_of(value) in self.fresh else storage_of(value)
            return ("tensor", tuple(value.shape), value.dtype, where)
        if isinstance(value, (list, tuple)):
            return tuple(self._describe(v) for v in value)
        return value

    def undo(self) -> None:
        for tensor, saved in reversed(self.saved):
            tensor.copy_(saved)


@dataclass
class FakeGraph:
    fn: StepFn
    static_in: tuple[Tensor, ...]
    static_out: tuple[Tensor, ...]
    ops: list[OpRecord]
    check_replays: bool
    replays: int = 0

    @property
    def batch(self) -> int:
        return self.static_in[0].shape[0] if self.static_in and self.static_in[0].dim() else 0

    def replay(self) -> None:
        tracer = _Tracer(undo_writes=False, refuse_syncs=False) if self.check_replays else None
        if tracer is None:
            out = self.fn(*self.static_in)
        else:
            with tracer:
                out = self.fn(*self.static_in)
            _compare(self.ops, tracer.ops)
        for static, new in zip(self.static_out, _as_tuple(out), strict=True):
            if static.shape != new.shape or static.dtype != new.dtype:
                raise RuntimeError(f"replay output {tuple(new.shape)} does not fit the captured {tuple(static.shape)}")
            static.copy_(new)
        self.replays += 1


@dataclass
class FakeCaptureBackend:
    """CaptureBackend for CPU tensors (see the module docstring). `check_replays=False` skips
    the per-replay op comparison (faster; capture is still checked)."""

    check_replays: bool = True
    warmups: int = 0
    graphs: list[FakeGraph] = field(default_factory=list)

    def accepts(self, tensors: Sequence[Tensor]) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    def new_pool(self) -> Any:
        return object()

    def warmup(self, fn: StepFn, args: Sequence[Tensor]) -> Outputs:
        self.warmups += 1
        return fn(*args)

    def capture(self, fn: StepFn, static_args: Sequence[Tensor], pool: Any) -> tuple[FakeGraph, Outputs]:
        tracer = _Tracer(undo_writes=True, refuse_syncs=True)
        try:
            with tracer:
                out = fn(*static_args)
        finally:
            tracer.undo()  # a capture records work, it does not do it
        outs = _as_tuple(out)
        for o in outs:
            if storage_of(o) in tracer.fresh:  # never poison a view of a weight or a cache
                o.fill_(float("nan") if o.is_floating_point() else -12345)
        graph = FakeGraph(fn, tuple(static_args), outs, tracer.ops, self.check_replays)
        self.graphs.append(graph)
        return graph, out


def _compare(captured: list[OpRecord], replayed: list[OpRecord]) -> None:
    for i, (a, b) in enumerate(zip(captured, replayed)):
        if a != b:
            raise RuntimeError(f"replay diverges from the captured graph at op {i}: captured {a}, replayed {b}")
    if len(captured) != len(replayed):
        raise RuntimeError(f"replay issued {len(replayed)} ops, the captured graph has {len(captured)}")


def _as_tuple(out: Outputs) -> tuple[Tensor, ...]:
    return (out,) if isinstance(out, Tensor) else tuple(out)


def fake_graph_config(**settings: Any) -> GraphConfig:
    """Graph settings that run the CUDA-graph wiring on CPU with this backend (tests, CPU benchmarks)."""
    return GraphConfig(
        mode="fake", capture=lambda config: FakeCaptureBackend(check_replays=config.check_replays), **settings
    )
