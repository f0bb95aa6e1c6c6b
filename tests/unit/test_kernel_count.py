"""The kernel counter (agent/engine/instruments/kernel_count.py) counts what a GPU would launch.

Pins: in eager code every non-view aten op is one kernel and views / bare allocations are none
(3 pointwise ops + 1 matmul, around transposes, reshapes and slices, count 4); kernels go to
the innermost stage label; a function compiled by torch.compile is counted by the launches in
its generated wrapper (a matmul and one fused pointwise+reduction kernel: 2 per call), its
run-time extern ops are not counted again, and eager ops around it are still counted; the
wrapper parser counts generated, extern and fallback calls (CPU and Triton style) and nothing
else; with scheduler marks on, a graph whose two reductions the C++ backend merges into one
launch counts 1 launch and 2 scheduled kernels, and a graph generated without marks has no
scheduled count; a nested compile region (generated once, called per layer) counts its body's
launches and scheduled kernels at every call, as many as the same layers inlined give up to one
per layer (what fuses across a region's boundary when inlined); only one counter may be active.
"""

from __future__ import annotations

import pytest
import torch

from agent.engine.instruments.kernel_count import (
    SCHEDULED_MARK,
    KernelCounter,
    is_view,
    marking_scheduled_kernels,
    region_functions,
    scheduled_kernels,
    wrapper_launches,
)

torch.set_num_threads(1)


def three_pointwise_one_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.t().contiguous().t()  # a copy of x (1 kernel) behind two views
    h = y.view(2, 4, 8)[1:].reshape(-1, 8)  # views only (the slice stays contiguous)
    return torch.relu(h @ w.t()).mul(2.0)[None]  # mm + relu + mul; t() and [None] are views


def test_eager_ops_count_one_kernel_each_and_views_none():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with KernelCounter() as counter:
        three_pointwise_one_matmul(x, w)
    assert counter.total == 4, counter.ops
    assert sum(n for op, n in counter.ops.items() if "mm" in op) == 1
    assert not any(
        is_view(getattr(torch.ops.aten, op.split(".")[1]).default) for op in counter.ops if op.endswith("default")
    )


def test_kernels_go_to_the_innermost_stage():
    x = torch.randn(4)
    with KernelCounter() as counter:
        x.sin()
        with counter.stage("outer"):
            x.cos()
            with counter.stage("inner"):
                x.exp()
                x.neg()
            x.abs()
    assert counter.kernels == {"other": 1, "outer": 2, "inner": 2}


def test_compiled_code_counts_its_launches_and_eager_code_around_it():
    from torch._dynamo.utils import counters

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x @ w) * 2 + 1).sum(-1)

    compiled = torch.compile(body, fullgraph=True, dynamic=False)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    torch._dynamo.reset()
    counters.clear()
    expected = compiled(x, w)  # compiles
    assert counters["inductor"]["extern_calls"] >= 1  # the matmul is a library call

    with KernelCounter() as counter:
        x2 = x.add(0.0)  # eager: 1
        with counter.stage("compiled"):
            out = compiled(x2, w)
            out = compiled(x2, w)
        out = out.neg()  # eager: 1
    torch.testing.assert_close(out, -expected)
    # One mm, then relu, *2, +1 and the sum fused into one kernel: 2 launches a call.
    assert counter.kernels["compiled"] == 4
    assert counter.compiled["compiled"] == 4
    assert counter.kernels["other"] == 2
    assert not any("mm" in op for op in counter.ops), counter.ops  # extern mm not counted twice


GENERATED = """
def call(self, args):
    arg0_1, arg1_1 = args
    args.clear()
    assert_size_stride(arg0_1, (8, 16), (16, 1))
    buf0 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
    extern_kernels.mm(arg0_1, arg1_1, out=buf0)
    cpp_fused_add_mul_relu_sum_0(buf0, buf1)
    # a comment
    buf2 = torch.ops.aten.topk.default(buf1, 2)
    buf3 = buf2[0]
    triton_poi_fused_add_1.run(buf3, buf4, 16, stream=stream0)
    del buf0
    return (reinterpret_tensor(buf4, (8,), (1,), 0), )

def benchmark_compiled_module(times=10, repeat=10):
    cpp_fused_not_in_call_2(x)
"""


def test_wrapper_parser_counts_launching_statements_only():
    launches = wrapper_launches(GENERATED)
    assert launches == {
        "extern_kernels.mm": 1,
        "cpp_fused_add_mul_relu_sum": 1,
        "torch.ops.aten.topk.default": 1,
        "triton_poi_fused_add": 1,
    }, launches


def test_scheduled_count_is_marks_plus_library_calls():
    marked = GENERATED.replace("    cpp_fused_add", f"    {SCHEDULED_MARK}\n    {SCHEDULED_MARK}\n    cpp_fused_add")
    assert scheduled_kernels(marked) == 2 + 3  # two fused nodes; mm, topk, the Triton kernel
    assert scheduled_kernels(GENERATED) is None  # a C++ kernel generated without marks
    triton_only = "\n".join(line for line in GENERATED.splitlines() if "cpp_fused" not in line)
    assert scheduled_kernels(triton_only) == 3


def _count_marked(fn, *args: torch.Tensor) -> KernelCounter:
    """Compile `fn` afresh with its scheduled kernels marked, warm it once, and count one call."""
    torch._dynamo.reset()
    with marking_scheduled_kernels():
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        compiled(*args)
    with KernelCounter() as counter:
        compiled(*args)
    return counter


def test_merged_cpu_kernels_count_one_launch_and_their_scheduled_nodes():
    def two_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin().sum(0), x.cos().sum(1)  # reductions over different dims: two nodes

    x = torch.randn(8, 16)
    counter = _count_marked(two_sums, x)
    assert counter.kernels["other"] == 1  # one C++ function
    assert counter.scheduled["other"] == 2
    assert counter.unmarked_graphs == 0

    torch._dynamo.reset()
    plain = torch.compile(two_sums, fullgraph=True, dynamic=False)
    plain(x)  # compiled without marks (may come from inductor's cache)
    with KernelCounter() as counter:
        plain(x)
    assert counter.unmarked_graphs == 1 and counter.scheduled["other"] == counter.kernels["other"] == 1


def test_a_nested_region_counts_its_body_at_every_call():
    def layer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) * 2 + x  # a matmul and a fused pointwise kernel

    region = torch.compiler.nested_compile_region(layer)
    weights, x = [torch.randn(8, 8) for _ in range(3)], torch.randn(2, 8)
    counts = {}
    for name, fn in (("inlined", layer), ("regions", region)):

        def stack(x: torch.Tensor, fn=fn) -> torch.Tensor:
            for w in weights:
                x = fn(w, x)
            return x.sum()

        counter = _count_marked(stack, x)
        (source,) = counter.sources.values()
        counts[name] = (counter.kernels["other"], counter.scheduled["other"])
    (region,) = region_functions(source)  # the regions' one body, generated once
    assert source.count(f"= {region}(") == 3  # and called per layer
    for i in (0, 1):  # launches, scheduled
        assert counts["inlined"][i] <= counts["regions"][i] <= counts["inlined"][i] + len(weights), counts


def test_one_counter_at_a_time():
    with KernelCounter():
        with pytest.raises(RuntimeError):
            with KernelCounter():
                pass
    with KernelCounter() as again:  # the first one's exit released it
        torch.ones(2).neg()
    assert again.total == 2  # ones (a fill) + neg
