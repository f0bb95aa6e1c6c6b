"""CallsAndGpuPolicy: how many agent replicas the calls need (Serve's custom autoscaling policy).

Replicas report `active_calls` and `gpu_util` (record_autoscaling_stats); Serve averages
each over its look-back window and calls the policy with them. The wanted count is the
larger of:
- enough replicas for the calls at `target_calls_per_replica` each (rounded up);
- one more than now while the replicas' mean GPU utilisation is above `gpu_util_high`
  (the design's rule: past 90 %, scale out or limit the rate; the offer gate limits the rate);
- every replica that holds calls: a call cannot move, and Serve chooses which replica to
  stop without looking at calls, so the policy never asks for fewer replicas than carry calls.
  A replica that is stopped anyway drains (agent/serve/replica.py: no new calls, the current
  ones finish within graceful_shutdown_timeout_s, longer than a call).
Serve then applies its own delays (a long downscale delay) and the min/max bounds.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

CALLS = "active_calls"
GPU = "gpu_util"


class CallsAndGpuPolicy:
    def __init__(self, target_calls_per_replica: float = 4.0, gpu_util_high: float = 0.9) -> None:
        if target_calls_per_replica <= 0:
            raise ValueError("target_calls_per_replica must be positive")
        self.target = target_calls_per_replica
        self.gpu_high = gpu_util_high

    def desired(self, current: int, calls: Mapping[Any, float], gpu: Mapping[Any, float]) -> int:
        total = sum(calls.values())
        want = math.ceil(total / self.target - 1e-9)
        if gpu and sum(gpu.values()) / len(gpu) > self.gpu_high:
            want = max(want, current + 1)
        holding = sum(1 for v in calls.values() if v > 0)
        return max(want, holding)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        want = self.desired(ctx.current_num_replicas, metrics.get(CALLS, {}), metrics.get(GPU, {}))
        return want, {}
