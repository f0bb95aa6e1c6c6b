"""Free device memory for the memory plan, read without making a CUDA context in this process.

The server sizes its sessions and context (agent/engine/memory_plan.py) before the engine's child
process starts. `torch.cuda.mem_get_info` would make a CUDA context here, several hundred MiB the
engine can then never use, while the engine's own context, still to come, would go uncounted.
NVML (the `gpu` extra, nvidia-ml-py) reads the driver's figure instead, and the engine's context
is subtracted as an estimate (ENGINE_CONTEXT_BYTES).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent.engine.model_memory import CUDA_CONTEXT_BYTES, GiB

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Device memory the engine's own CUDA context takes once it starts (the context, cuBLAS/cuDNN
# handles, the kernels' modules): the plan reads free memory through NVML before any context
# exists, in a process that never makes one. An estimate, the same one the named cards are counted
# with (model_memory.CUDA_CONTEXT_BYTES, 0.5 GiB for CUDA 12 on H100/H200); no bench result
# measures it yet. check_after_load, once the context exists, says when it was short.
ENGINE_CONTEXT_BYTES = CUDA_CONTEXT_BYTES


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def nvml_device(device: torch.device, environ: Mapping[str, str]) -> int | str:
    """NVML's name for `device` (cuda, cuda:N): NVML indexes the physical GPUs, CUDA the ones
    CUDA_VISIBLE_DEVICES lists, in its order. Returns the physical index, or the uuid an entry
    gives (GPU-..., MIG-...). Index entries are taken in NVML's (PCI bus) order, which is CUDA's
    unless CUDA_DEVICE_ORDER is left at FASTEST_FIRST on a host of mixed GPUs. Raises ValueError
    when the device is not among the visible ones."""
    index = 0 if device.index is None else device.index  # "cuda" is device 0 until set otherwise
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [entry.strip() for entry in visible.split(",")]
    if index >= len(entries) or not entries[index]:
        raise ValueError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry


def nvml_free(device: torch.device, environ: Mapping[str, str]) -> tuple[int, str]:
    """Free bytes on `device` and its name, read through NVML (the `gpu` extra): no CUDA context
    is made. Raises ImportError without the package, and NVML's errors without a driver."""
    import pynvml

    gpu = nvml_device(device, environ)
    pynvml.nvmlInit()
    try:
        if isinstance(gpu, int):
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
        free = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        name = pynvml.nvmlDeviceGetName(handle)
    finally:
        pynvml.nvmlShutdown()
    return free, f"{name.decode() if isinstance(name, bytes) else name} (NVML device {gpu})"


def engine_free(device: torch.device, engine_process: bool, environ: Mapping[str, str] | None = None) -> int:
    """Device memory the engine can allocate before its load: NVML's free memory less the
    engine's CUDA context still to come (ENGINE_CONTEXT_BYTES). Without NVML, torch's
    mem_get_info: that makes a CUDA context in this process (its memory, counted in the figure,
    stays taken while the server runs); the engine's own is then still to come only where the
    engine runs in a child process (`engine_process`)."""
    try:
        free, name = nvml_free(device, os.environ if environ is None else environ)
    except Exception as exc:  # no package, no driver, no such device; pynvml's errors share no base we could import
        import torch

        log.warning(
            "NVML could not read the free memory of %s (%s: %s): reading it through torch.cuda.mem_get_info, "
            "which creates a CUDA context in this process (~%s of the GPU the engine cannot use); install the "
            "`gpu` extra (nvidia-ml-py)",
            device,
            type(exc).__name__,
            exc,
            _gib(ENGINE_CONTEXT_BYTES),
        )
        free = torch.cuda.mem_get_info(device)[0]
        return free - (ENGINE_CONTEXT_BYTES if engine_process else 0)
    log.info(
        "%s on %s: %s free, less %s for the engine's CUDA context (an estimate)",
        device,
        name,
        _gib(free),
        _gib(ENGINE_CONTEXT_BYTES),
    )
    return free - ENGINE_CONTEXT_BYTES
