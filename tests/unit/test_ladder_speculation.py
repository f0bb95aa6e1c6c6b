"""The degradation ladder's first rung, on a fake clock: speculative starts stop once the P95
first-response latency exceeds speculation_p95_s, before any level changes (replies stay
spoken); they come back only under the threshold minus the margin; at any degraded level they
stay off."""

from __future__ import annotations

from agent.gate.ladder import DegradationLadder, LadderSettings


def test_speculation_is_the_first_rung() -> None:
    ladder = DegradationLadder(
        LadderSettings(window=10, min_samples=5, speculation_p95_s=0.2, margin_s=0.05), clock=lambda: 1000.0
    )
    for _ in range(5):
        ladder.observe(0.1)
    assert ladder.speculate and ladder.level == 0
    for _ in range(10):
        ladder.observe(0.25)
    assert not ladder.speculate and ladder.level == 0  # off before anything else degrades
    for _ in range(10):
        ladder.observe(0.17)  # under the threshold, not under threshold - margin
    assert not ladder.speculate
    for _ in range(10):
        ladder.observe(0.1)
    assert ladder.speculate
    for _ in range(10):
        ladder.observe(0.35)  # text-only
    assert ladder.level == 1 and not ladder.speculate
