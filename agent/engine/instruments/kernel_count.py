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
While the counter is active, every call of a compiled graph adds its launches, and the aten ops
the graph dispatches at run time (its extern calls) are not counted a second time. The mode
declares `ignore_compile_internals`, so that Dynamo still compiles and runs compiled code while
it is on the stack (it refuses other dispatch modes).

On CPU those launches undercount what the same graph would launch on CUDA: the C++ backend
merges every run of generated kernels between two library calls into one C++ function (one
launch), where Triton launches one kernel per node its scheduler fused. So a second count,
`scheduled`, is kept beside it: with `marking_scheduled_kernels()` on while graphs compile, the
C++ backend writes a marker into `call()` for each fused node it generates (each inner node of
a CPU-only outer-loop fusion counted apart; a template kernel, flex attention's, is one), and a
graph's scheduled count is its markers plus its library and fallback calls. It overcounts
Triton where the CPU scheduler leaves apart what Triton fuses (a norm's reduction and its
pointwise tail, say): launches and scheduled bound a CUDA count from below and above. Eager
ops count the same in both.

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
        self.scheduled: Counter[str] = Counter()  # stage -> kernels, compiled graphs by their fused nodes
        self.graph_calls: Counter[str] = Counter()  # stage -> calls of compiled graphs
        self.unmarked_graphs = 0  # calls of compiled CPU graphs without scheduler marks (scheduled unknown)
        self.ops: Counter[str] = Counter()  # aten op name -> count (eager only)
        self.sources: dict[int, str] = {}  # id of each compiled graph called -> its generated wrapper
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
        self.scheduled.clear()
        self.graph_calls.clear()
        self.unmarked_graphs = 0
        self.ops.clear()
        self.sources.clear()

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
            self.scheduled[self._label()] += 1
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def _label(self) -> str:
        return self._stages[-1] if self._stages else UNSTAGED

    # ---- compiled code ---------------------------------------------------------------------

    def add_compiled(self, kernels: int, scheduled: int | None) -> None:
        label = self._label()
        self.kernels[label] += kernels
        self.compiled[label] += kernels
        self.graph_calls[label] += 1
        if scheduled is None:
            self.unmarked_graphs += 1
            scheduled = kernels
        self.scheduled[label] += scheduled

    def _patch_compiled_graphs(self) -> None:
        try:
            from torch._inductor.output_code import CompiledFxGraph
        except ImportError:  # no inductor in this build: nothing compiled to count
            return
        original = CompiledFxGraph.__call__
        self._original_call = original
        counter = self

        def counted_call(graph, inputs):
            counter.sources.setdefault(id(graph), graph.source_code)
            counter.add_compiled(compiled_graph_kernels(graph), compiled_graph_scheduled(graph))
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


def compiled_graph_scheduled(graph: Any) -> int | None:
    """The graph's fused nodes plus library calls (`scheduled_kernels`); None if unmarked."""
    if not hasattr(graph, "_omni_scheduled"):
        graph._omni_scheduled = scheduled_kernels(graph.source_code)
    return graph._omni_scheduled


SCHEDULED_MARK = "# omni-agent: scheduled kernel"


@contextmanager
def marking_scheduled_kernels() -> Iterator[None]:
    """Mark each fused node in the `call()` of every graph compiled meanwhile (C++ backend; see
    the module docstring). torch's compile caches are off meanwhile (`force_disable_caches`): a
    cached graph was generated without marks, and a marked one must not be served to a later
    run. Turning off only inductor's FX graph cache is not enough: the engine turns it back on
    as it starts (agent/engine/compile/inductor.py `use_cache_dir`)."""
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.virtualized import V

    original, original_template = CppScheduling.codegen_node, CppScheduling.codegen_template

    def codegen_node(self, node):
        outer = getattr(node, "get_outer_nodes", None)  # a CPU-only outer-loop fusion
        for _ in range(len(outer()) if outer is not None else 1):
            V.graph.wrapper_code.writeline(SCHEDULED_MARK)
        return original(self, node)

    def codegen_template(self, *args, **kwargs):  # a template kernel (flex attention): one launch
        V.graph.wrapper_code.writeline(SCHEDULED_MARK)
        return original_template(self, *args, **kwargs)

    CppScheduling.codegen_node, CppScheduling.codegen_template = codegen_node, codegen_template
    try:
        with torch.compiler.config.patch(force_disable_caches=True):
            yield
    finally:
        CppScheduling.codegen_node, CppScheduling.codegen_template = original, original_template


# Statements of a generated call() that launch nothing: allocation, views, checks, bookkeeping.
_NOT_LAUNCHES = re.compile(
    r"(empty_strided\w*|_empty_strided\w*|reinterpret_tensor|assert_\w+|as_strided|"
    r"args\.clear|len|get_raw_stream|torch\.cuda\._DeviceGuard|torch\.cuda\.set_device|"
    r"\w+\.run_to_completion|alloc_from_pool|torch\._C\._dynamo\.guards\.\w+)$"
)
_CALL = re.compile(r"^(?:[\w, \[\]]+ = )?([A-Za-z_][\w\.]*)\(")


def _function_body(source: str, name: str) -> Iterator[str]:
    """The stripped, non-empty lines of function `name` in inductor's generated wrapper `source`."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*def {name}\(", line)), None)
    if start is None:
        raise ValueError(f"no {name}() in the generated code")
    indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if not stripped:
            continue
        if len(line) - len(line.lstrip()) <= indent:
            return  # the end of the function's body
        yield stripped


# A nested compile region (`torch.compiler.nested_compile_region`, one per decoder layer with
# `GraphConfig(compile_regions=True)`) is generated once as a top-level function of the wrapper
# (`repeated_subgraph0`, or `auto_functionalized_subgraph_0` when it writes its inputs, as the
# KV cache writes do) and called per layer: each call launches what its body launches.
def region_functions(source: str) -> set[str]:
    """Names of the nested regions' functions defined in a generated wrapper `source`."""
    return set(re.findall(r"^def (\w*subgraph\w*)\(args\):", source, re.MULTILINE))


def _launches_and_marks(source: str, name: str = "call") -> tuple[Counter[str], int]:
    """Launching statements by callee and scheduler marks of function `name`, the bodies of the
    nested regions it calls counted at every call."""
    launches: Counter[str] = Counter()
    marks = 0
    regions: dict[str, tuple[Counter[str], int]] = {}
    defined = region_functions(source)
    for stripped in _function_body(source, name):
        if stripped == SCHEDULED_MARK:
            marks += 1
            continue
        if stripped.startswith("#"):
            continue
        match = _CALL.match(stripped)
        if match is None:
            continue
        callee = match.group(1)
        if callee.endswith(".run"):
            callee = callee[: -len(".run")]  # a Triton kernel's launch
        if _NOT_LAUNCHES.match(callee) or callee in ("del", "print"):
            continue
        if callee in defined:
            if callee not in regions:
                regions[callee] = _launches_and_marks(source, callee)
            launches.update(regions[callee][0])
            marks += regions[callee][1]
            continue
        launches[re.sub(r"_\d+$", "", callee)] += 1
    return launches, marks


def wrapper_launches(source: str) -> Counter[str]:
    """Launching statements of the `call()` in inductor's generated wrapper `source`, by callee
    (trailing kernel numbers dropped: `cpp_fused_add_3` -> `cpp_fused_add`), a nested region's
    counted at each of its calls."""
    return _launches_and_marks(source)[0]


def scheduled_kernels(source: str) -> int | None:
    """Fused nodes (scheduler marks) plus library and fallback calls of a generated `call()`;
    its launches where no C++ kernel is called (Triton's launches already are its fused nodes);
    None for C++ kernels generated without marks."""
    launches, marks = _launches_and_marks(source)
    cpp = sum(n for callee, n in launches.items() if callee.startswith("cpp_"))
    if cpp and not marks:
        return None
    return marks + sum(launches.values()) - cpp


_ALLOCATION = re.compile(r"empty_strided_\w+\(\(([^()]*)\), \([^()]*\), torch\.(\w+)\)")


def largest_buffer_bytes(source: str) -> int:
    """The largest buffer inductor's generated wrapper `source` allocates with a static shape
    (0 if none): a step that writes its KV cache in place allocates nothing near a cache's size,
    one whose compile functionalized the writes copies the cache into a buffer as large as it."""
    largest = 0
    for dims, dtype in _ALLOCATION.findall(source):
        sizes = [d.strip() for d in dims.split(",") if d.strip()]
        if not all(d.isdigit() for d in sizes):
            continue  # a symbolic size (the batch): never a cache's
        numel = 1
        for d in sizes:
            numel *= int(d)
        largest = max(largest, numel * getattr(torch, dtype).itemsize)
    return largest
