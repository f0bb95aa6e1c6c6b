"""CPU "graphs": each step function traced once per bucket with TorchScript, replayed off the GIL.

On CUDA the per-frame steps are CUDA graphs (agent/engine/compile/capture.py): captured once per batch
bucket, replayed with one call. On CPU the same wiring (static buffers, padded buckets, reserved
caches) can replay a TorchScript trace instead: `torch.jit.trace` records the step's aten ops on
the bucket's static inputs, and a replay runs them in the TorchScript interpreter, which does not
hold the GIL while it runs. That is what matters on CPU: the engine thread and the asyncio thread
(ICE, SRTP, RTP, voice detection, pacing) share one interpreter lock, and an eager step holds it
for every one of its thousands of small ops (at the tiny size a step is dispatch, not
arithmetic). With four calls on two cores the two threads together wanted about as much of the
lock as there is, and the latency grew with the queue (docs/load.md). Measured on the tiny
model's code-predictor loop (15 codebooks, batch 4): 8.3 ms a replay against 12.0 ms eager, and
beside a thread spinning in Python 73 replays in 2 s against 32 eager calls, while that thread
lost 8% of its pace (docs/load.md). Opt-in (`--cpu-graphs`): the decode steps are traced for
every batch bucket and attention length at start-up (tens of seconds on two cores), and a
prefill's longer key windows are still traced on first use, in a reply (a one-time stall).

The ops are the step's own, in the same order, so a replay computes what the eager step computes
(tests/unit/test_cpu_graphs.py: graphed replies equal eager ones). What a trace cannot follow is
what a CUDA graph cannot either (Python decisions on values, host syncs, caches reallocated after
capture): the fake capture backend's checks (agent/engine/instruments/fake_graphs.py) keep the steps free of
those. Tensors a step reads or writes without taking them as inputs (weights, slot caches, conv
states) are recorded by reference, so in-place writes reach the live caches.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from agent.engine.compile.capture import Outputs, StepFn, storage_of, tensors_in
from agent.engine.compile.inductor import RerunGraph


class _Writes(TorchDispatchMode):
    """Which tensors that existed before a call the call writes (caches, conv states), undoing
    each write afterwards: a trace drops in-place writes to tensors it does not return (it takes
    them for constants nobody can observe), so the traced step returns them too."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[int] = set()  # storages made during the call
        self.saved: list[tuple[Tensor, Tensor]] = []
        self.bases: dict[int, Tensor] = {}  # storage -> the tensor owning it (a view's base)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg, value in zip(func._schema.arguments, args):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and isinstance(value, Tensor) and storage_of(value) not in self.fresh:
                self.saved.append((value, value.clone()))
                self.bases.setdefault(storage_of(value), value._base if value._base is not None else value)
        out = func(*args, **kwargs)
        inputs = {storage_of(t) for t in tensors_in([*args, *kwargs.values()])}
        for value in tensors_in(out if isinstance(out, (tuple, list)) else (out,)):
            if storage_of(value) not in inputs:
                self.fresh.add(storage_of(value))
        return out

    def undo(self) -> None:
        for tensor, saved in reversed(self.saved):
            tensor.copy_(saved)


def _reachabletensors_in(fn: Any, depth: int = 4) -> dict[int, Tensor]:
    """Storage -> the largest tensor on it among those the step's owner holds (its attributes,
    and theirs, through lists, tuples and dicts): the whole cache a written slice belongs to.
    (Under inference mode a view does not know its base, so the trace's outputs name the owner's
    tensor instead.)"""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def visit(value: Any, left: int) -> None:
        if isinstance(value, Tensor):
            ptr = storage_of(value)
            if ptr not in found or value.numel() > found[ptr].numel():
                found[ptr] = value
            return
        if left == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple, set)):
            items = list(value)
        elif isinstance(value, torch.nn.Module):
            return  # weights are read, never written
        elif hasattr(value, "__dict__"):
            items = list(vars(value).values())
        else:
            return
        for item in items:
            visit(item, left - 1)

    visit(getattr(fn, "__self__", None), depth)
    for cell in getattr(fn, "__closure__", None) or ():
        visit(cell.cell_contents, depth)
    return found


class TracedBackend:
    """CaptureBackend (agent/engine/compile/capture.py) for CPU tensors: capture = torch.jit.trace."""

    def accepts(self, tensors: Sequence[Tensor]) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    def new_pool(self) -> Any:
        return None

    def warmup(self, fn: StepFn, args: Sequence[Tensor]) -> Outputs:
        return fn(*args)

    def capture(self, fn: StepFn, static_args: Sequence[Tensor], pool: Any) -> tuple[RerunGraph, Outputs]:
        # A dry run finds the state the step writes (and is undone), then the traced run is the call.
        with _Writes() as writes:
            fn(*static_args)
        writes.undo()
        owners = _reachabletensors_in(fn)
        state = tuple(owners.get(ptr, view) for ptr, view in writes.bases.items())
        made: list[Outputs] = []

        def step(*args: Tensor) -> tuple[Tensor, ...]:
            out = fn(*args)
            made.append(out)
            return (*((out,) if isinstance(out, Tensor) else out), *state)

        with warnings.catch_warnings():
            # Sizes read as Python numbers are baked into the trace: intended, one trace per bucket.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(step, tuple(static_args), check_trace=False)
        out = made[0]
        # Fresh buffers for the replays to fill: the traced call's outputs are its own.
        outs = tuple(o.clone() for o in ((out,) if isinstance(out, Tensor) else out))
        n = len(outs)
        # Replays run the trace (its first replay is the call the trace already made: skipped);
        # the state it returns after the outputs is not copied anywhere.
        graph = RerunGraph(lambda *args: traced(*args)[:n], tuple(static_args), outs)
        return graph, outs[0] if isinstance(out, Tensor) else outs
