"""Count what would be device kernel launches, by stage, without a device.

`KernelCounter` is a `TorchDispatchMode`: every aten op that reaches the dispatcher while it is
active counts as one kernel, except ops that launch nothing on a GPU:
- views (the op returns an alias of an input and writes nothing: `view`, `transpose`,
  `expand`, `slice`, `select`, `unsqueeze`, ...), which only make new tensor metadata;
- bare allocations (`empty`, `empty_strided`, ...), which the caching allocator serves
  without a kernel.
Everything else counts: pointwise ops, matmuls, reductions, copies (`copy_`, `_to_copy`,
`index_put_`) and in-place updates. Eager CUDA code launches (about) one kernel per such op;
some launch two (a split-K matmul) or none (an op a library fuses), so treat the counts as
±20 %.

Code run under `torch.compile` is counted from the code inductor generated for each compiled
graph (`CompiledFxGraph.source_code`, kept with the graph even when it came from inductor's
cache): every statement of its `call()` body that launches something, i.e. a call of a generated
kernel (`cpp_fused_*(...)` on CPU, `triton_*.run(...)` on CUDA), of an extern library kernel
(`extern_kernels.mm(...)`) or of a fallback aten op (`torch.ops.aten.topk.default(...)`);
buffer bookkeeping (`empty_strided_*`, `reinterpret_tensor`, asserts, `del`) launches nothing.
Inductor's own counters (`generated_kernel_count` + `extern_calls`, `inductor_counters()`) are
kept for comparison: on CPU they count each fused node group before the C++ backend merges
groups into one function (one launch), about twice the launches. While the counter is active,
every call of a compiled graph adds its launches, and the aten ops the graph dispatches at run
time (its extern calls) are not counted a second time. The mode declares
`ignore_compile_internals`, so that Dynamo still compiles and runs compiled code while it is on
the stack (it refuses other dispatch modes).

Stages: `with counter.stage("thinker_decode"): ...` attributes the kernels issued inside to
that label (the innermost label wins); kernels outside any stage go to `UNSTAGED`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

UNSTAGED = "other"

_aten = torch.ops.aten
# Allocation only: served by the caching allocator, no kernel.
_NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.lift_fresh.default,
    _aten.detach.default,
    # A view that its schema does not declare as one (matmul and reshape use it).
    _aten._unsafe_view.default,
}


def is_view(func: torch._ops.OpOverload) -> bool:
    """Whether an op only makes an alias of an input (a view: metadata, no kernel)."""
    schema = func._schema
    if not schema.returns:
        return False
    for ret in schema.returns:
        alias = ret.alias_info
        if alias is None or alias.is_write:
            return False
    return True


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    return func not in _NO_KERNEL and not is_view(func)


class KernelCounter(TorchDispatchMode):
    """Counts kernels per stage (see the module docstring). One may be active at a time."""

    _active: "KernelCounter | None" = None

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()  # stage -> kernels
        self.compiled: Counter[str] = Counter()  # stage -> of which from compiled graphs
        self.inductor: Counter[str] = Counter()  # stage -> inductor's own counts for those graphs
        self.ops: Counter[str] = Counter()  # aten op name -> count (eager only)
        self._stages: list[str] = []
        self._in_compiled = 0
        self._original_call: Any = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo skips frames while a dispatch mode is on the stack unless it says this; the
        # compiled code it then runs is counted through inductor's numbers (_compiled_call).
        return True

    @property
    def total(self) -> int:
        return sum(self.kernels.values())

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._stages.append(name)
        try:
            yield
        finally:
            self._stages.pop()

    def reset(self) -> None:
        self.kernels.clear()
        self.compiled.clear()
        self.inductor.clear()
        self.ops.clear()

    def __enter__(self) -> "KernelCounter":
        if KernelCounter._active is not None:
            raise RuntimeError("a KernelCounter is already counting")
        self._patch_compiled_graphs()
        KernelCounter._active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            KernelCounter._active = None
            self._unpatch_compiled_graphs()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_compiled and launches_kernel(func):
            self.kernels[self._label()] += 1
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def _label(self) -> str:
        return self._stages[-1] if self._stages else UNSTAGED

    # ---- compiled code ---------------------------------------------------------------------

    def add_compiled(self, kernels: int, inductor: int = 0) -> None:
        label = self._label()
        self.kernels[label] += kernels
        self.compiled[label] += kernels
        self.inductor[label] += inductor

    def _patch_compiled_graphs(self) -> None:
        try:
            from torch._inductor.output_code import CompiledFxGraph
        except ImportError:  # no inductor in this build: nothing compiled to count
            return
        original = CompiledFxGraph.__call__
        self._original_call = original
        counter = self

        def counted_call(graph, inputs):
            counter.add_compiled(compiled_graph_kernels(graph), inductor_counters(graph))
            counter._in_compiled += 1
            try:
                return original(graph, inputs)
            finally:
                counter._in_compiled -= 1

        CompiledFxGraph.__call__ = counted_call

    def _unpatch_compiled_graphs(self) -> None:
        if self._original_call is not None:
            from torch._inductor.output_code import CompiledFxGraph

            CompiledFxGraph.__call__ = self._original_call
            self._original_call = None


def compiled_graph_kernels(graph: Any) -> int:
    """Kernels one call of an inductor-compiled graph launches: the launching statements of its
    generated `call()` (see the module docstring). Cached per graph."""
    cached = getattr(graph, "_omni_launches", None)
    if cached is None:
        cached = sum(wrapper_launches(graph.source_code).values())
        graph._omni_launches = cached
    return cached


def inductor_counters(graph: Any) -> int:
    """Inductor's own per-graph numbers: generated kernels plus extern (library) calls."""
    generated = graph.metrics_deltas.generated_kernel_count
    extern = graph.counter_deltas.get("extern_calls", 0)
    return int(generated) + int(extern)


# Statements of a generated call() that launch nothing: allocation, views, checks, bookkeeping.
_NOT_LAUNCHES = re.compile(
    r"(empty_strided\w*|_empty_strided\w*|reinterpret_tensor|assert_\w+|as_strided|"
    r"args\.clear|len|get_raw_stream|torch\.cuda\._DeviceGuard|torch\.cuda\.set_device|"
    r"\w+\.run_to_completion|alloc_from_pool|torch\._C\._dynamo\.guards\.\w+)$"
)
_CALL = re.compile(r"^(?:[\w, \[\]]+ = )?([A-Za-z_][\w\.]*)\(")


def wrapper_launches(source: str) -> Counter[str]:
    """Launching statements of the `call()` in inductor's generated wrapper `source`, by callee
    (trailing kernel numbers dropped: `cpp_fused_add_3` -> `cpp_fused_add`)."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line)), None)
    if start is None:
        raise ValueError("no call() in the generated code")
    indent = len(lines[start]) - len(lines[start].lstrip())
    launches: Counter[str] = Counter()
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break  # the end of call()'s body
        match = _CALL.match(stripped)
        if match is None:
            continue
        callee = match.group(1)
        if callee.endswith(".run"):
            callee = callee[: -len(".run")]  # a Triton kernel's launch
        if _NOT_LAUNCHES.match(callee) or callee in ("del", "print"):
            continue
        launches[re.sub(r"_\d+$", "", callee)] += 1
    return launches
