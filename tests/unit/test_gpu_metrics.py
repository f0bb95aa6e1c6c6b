"""The GPU gauges read the GPU this process uses, through a fake NVML with two GPUs.

Pins: with CUDA_VISIBLE_DEVICES=1 (Ray's form: an NVML index) the sampler reports GPU 1's
utilisation and memory, and labels its uuid and index in `agent_gpu_info` (replicas reporting the
same uuid share a GPU); with a uuid there (GPU-…) the same GPU is found by uuid; unset, GPU 0;
a failing NVML (no library, no driver) says why and never raises. `agent_gpu_utilization_ratio`
is what a Serve replica reports to the autoscaler (agent/serve/replica.py `gpu_util`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent import metrics


class FakeNvml:
    """Two GPUs: index 0 idle, index 1 at 73 % with 5 GiB in use."""

    GPUS = [
        {"uuid": b"GPU-aaaa", "util": 0, "used": 1 << 30},
        {"uuid": b"GPU-bbbb", "util": 73, "used": 5 << 30},
    ]

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return next(i for i, g in enumerate(self.GPUS) if g["uuid"].decode() == uuid)

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.GPUS[handle]["uuid"]

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.GPUS[handle]["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=self.GPUS[handle]["used"], total=80 << 30)


def _value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


@pytest.mark.parametrize("visible", ["1", "GPU-bbbb", "1,0"])
def test_the_visible_gpu_is_the_one_reported(visible: str) -> None:
    sampler = metrics.GpuSampler(FakeNvml(), {"CUDA_VISIBLE_DEVICES": visible})
    sampler.sample()
    assert (sampler.uuid, sampler.index) == ("GPU-bbbb", 1)
    assert _value("agent_gpu_utilization_ratio") == pytest.approx(0.73)
    assert _value("agent_gpu_memory_used_bytes") == 5 << 30
    assert _value("agent_gpu_info", uuid="GPU-bbbb", index="1") == 1


def test_unset_means_the_first_gpu() -> None:
    sampler = metrics.GpuSampler(FakeNvml(), {})
    sampler.sample()
    assert sampler.uuid == "GPU-aaaa" and _value("agent_gpu_utilization_ratio") == 0.0


def test_no_nvml_is_not_an_error() -> None:
    sampler = metrics.GpuSampler(FakeNvml(fail=True), {"CUDA_VISIBLE_DEVICES": "1"})
    sampler.sample()  # nothing to read, nothing raised
    assert "NVML" in sampler.unavailable
    assert metrics.visible_gpu({"CUDA_VISIBLE_DEVICES": "MIG-1234,2"}) == "MIG-1234"
