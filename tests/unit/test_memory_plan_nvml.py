"""The memory plan reads free memory without a CUDA context in the server process.

Pins, with a stand-in NVML module of four GPUs that each report a different free figure and torch
told a GPU exists (every call that would initialise CUDA raises):
- `size_limits` plans with NVML's free bytes less the engine's CUDA context still to come
  (ENGINE_CONTEXT_BYTES), never calling torch.cuda.mem_get_info or initialising CUDA, and shuts
  NVML down again;
- the GPU read is the one the config names, through CUDA_VISIBLE_DEVICES: with "3,1", cuda:1 is
  physical GPU 1 and cuda:0 (and "cuda", "auto") physical GPU 3; unset, cuda:N is GPU N; a uuid
  entry is looked up by uuid;
- without NVML (no package, or its init fails) the plan falls back to torch's figure with a
  warning that a CUDA context is made in this process; that context is counted in the figure, so
  the engine's own is subtracted only where the engine runs in a child process.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent.config import Config
from agent.engine import free_memory, memory_plan
from agent.engine.free_memory import ENGINE_CONTEXT_BYTES
from agent.engine.memory_plan import LIMITS
from agent.engine.model_memory import GiB


class FakeNvml:
    """Four physical GPUs; GPU i has (40 + i) GiB free, so the figure says which one was read."""

    UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.read: list[int] = []
        self.opened = 0

    @staticmethod
    def free(index: int) -> int:
        return (40 + index) * GiB

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")
        self.opened += 1

    def nvmlShutdown(self) -> None:
        self.opened -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.UUIDS):
            raise RuntimeError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self.read.append(handle)
        return SimpleNamespace(free=self.free(handle), used=80 * GiB - self.free(handle), total=80 * GiB)


def _no_cuda_init(*args: object, **kwargs: object) -> None:
    raise AssertionError("CUDA was initialised in the planning process")


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A host torch believes has a GPU, whose every CUDA-initialising call fails the test, with
    the fake NVML installed as `pynvml`."""
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("mem_get_info", "init", "_lazy_init", "current_device", "set_device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda_init)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return nvml


@pytest.mark.parametrize(
    ("visible", "device", "physical"),
    [
        ("3,1", "cuda:1", 1),
        ("3,1", "cuda:0", 3),
        ("3,1", "cuda", 3),
        ("3,1", "auto", 3),
        (None, "cuda:2", 2),
        ("GPU-cccc,GPU-aaaa", "cuda:1", 0),
    ],
)
def test_the_plan_reads_the_named_gpu_through_nvml(
    gpu_host: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    visible: str | None,
    device: str,
    physical: int,
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = Config(model=str(tiny_model_dir), device=device, sized_from_memory=LIMITS, fallback_model="none")
    sized, p = memory_plan.size_limits(config)
    assert gpu_host.read == [physical]
    assert p.free == FakeNvml.free(physical) - ENGINE_CONTEXT_BYTES
    assert gpu_host.opened == 0  # nvmlShutdown after the read
    assert p.derived == LIMITS and (sized.max_sessions, sized.context_limit) == (p.sessions, p.context)


def test_a_device_cuda_visible_devices_hides_is_not_read_by_nvml(gpu_host: FakeNvml) -> None:
    with pytest.raises(ValueError, match="not among CUDA_VISIBLE_DEVICES"):
        free_memory.nvml_free(torch.device("cuda:1"), {"CUDA_VISIBLE_DEVICES": "3"})
    assert gpu_host.read == []


@pytest.mark.parametrize("engine_process", [True, False])
@pytest.mark.parametrize("nvml", [None, FakeNvml(fail=True)], ids=["no-package", "init-fails"])
def test_without_nvml_torch_is_read_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, nvml: FakeNvml | None, engine_process: bool
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # None: `import pynvml` raises ImportError
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (asked.append(device), (50 * GiB, 80 * GiB))[1])
    with caplog.at_level(logging.WARNING, logger="agent.engine.memory_plan"):
        free = free_memory.engine_free(torch.device("cuda:1"), engine_process, {})
    assert asked == [torch.device("cuda:1")]
    # This process's context is in torch's figure; the engine's is still to come in a child only.
    assert free == 50 * GiB - (ENGINE_CONTEXT_BYTES if engine_process else 0)
    assert "creates a CUDA context in this process" in caplog.text
