"""The engine's steps compiled as CUDA compiles them, on CPU, and what the compiled code calls
(tests/unit/test_gemv.py, test_quantized.py)."""

from __future__ import annotations

from agent.engine.instruments.kernel_count import KernelCounter


def generated_code(counter: KernelCounter) -> list[str]:
    """The statements (comments left out) of every compiled graph's wrapper the counter saw run."""
    lines = [line.strip() for source in counter.sources.values() for line in source.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def fused_per_batch(loaded, compiled_options, regions: bool = False):
    """The engine's graphing as CUDA sets it up, on CPU: one compile per batch bucket (4 only,
    so one compile each) with fused projections; `regions`: each decoder layer a nested region."""
    from agent.engine.compile.wiring import GraphConfig, Graphing

    config = GraphConfig(
        mode="off",
        compile="on",
        compile_cache=compiled_options["graphs"].compile_cache,
        batch_sizes=(4,),
        compile_dynamic_batch=False,
        fused_gemv=True,
        compile_regions=regions,
    )
    return Graphing(config, loaded.device, 4)
