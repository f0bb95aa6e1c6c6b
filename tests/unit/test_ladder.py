"""The degradation ladder and the turn rate limit, on a fake clock.

Pins: P95 above 300 ms moves new replies to text-only, above 500 ms to the fallback
model; stepping back needs P95 under threshold minus margin for the whole recovery time
(hysteresis: a value between the two does not step back); one level at a time; the
gauge follows; the token bucket admits its rate and refuses the excess.
"""

from __future__ import annotations

from agent import metrics
from agent.gate.ladder import DegradationLadder, LadderSettings, TurnRateLimiter, p95


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _gauge() -> float:
    return metrics.REGISTRY.get_sample_value("agent_degradation_level")


def test_p95_nearest_rank() -> None:
    assert p95([0.1] * 19 + [1.0]) == 0.1
    assert p95([0.1] * 18 + [1.0, 1.0]) == 1.0


def test_rises_to_text_then_fallback_and_recovers_with_hysteresis() -> None:
    clock = Clock()
    ladder = DegradationLadder(LadderSettings(window=20, min_samples=5, recover_s=10.0), clock=clock)
    for _ in range(5):
        ladder.observe(0.2)
    assert ladder.level == 0
    changes = [ladder.observe(0.35) for _ in range(5)]
    assert ladder.level == 1 and 1 in changes and _gauge() == 1
    for _ in range(10):
        ladder.observe(0.6)
    assert ladder.level == 2 and _gauge() == 2

    # Fast replies again: P95 stays high until the slow ones leave the 20-sample window.
    for _ in range(20):
        clock.t += 0.5
        ladder.observe(0.28)  # under 0.5 - 0.05, but above 0.3 - 0.05
    assert ladder.level == 2
    clock.t += 10.0
    ladder.evaluate()
    assert ladder.level == 1, "one step down after recover_s below fallback threshold - margin"
    # 0.28 s is under 0.3 but not under 0.3 - margin: hysteresis keeps text-only.
    for _ in range(30):
        clock.t += 1.0
        ladder.observe(0.28)
    assert ladder.level == 1
    for _ in range(20):
        clock.t += 1.0
        ladder.observe(0.1)
    clock.t += 10.0
    ladder.evaluate()
    assert ladder.level == 0 and _gauge() == 0


def test_a_brief_dip_does_not_step_down() -> None:
    clock = Clock()
    ladder = DegradationLadder(LadderSettings(window=10, min_samples=5, recover_s=10.0), clock=clock)
    for _ in range(10):
        ladder.observe(0.4)
    assert ladder.level == 1
    for _ in range(10):
        clock.t += 0.5
        ladder.observe(0.1)
    clock.t += 5.0
    ladder.evaluate()
    ladder.observe(0.4)  # slow again before recover_s elapsed: timer restarts
    clock.t += 6.0
    ladder.evaluate()
    assert ladder.level == 1


def test_old_samples_age_out_and_idle_engine_recovers() -> None:
    clock = Clock()
    ladder = DegradationLadder(LadderSettings(window_s=30.0, recover_s=5.0), clock=clock)
    for _ in range(10):
        ladder.observe(0.9)
    assert ladder.level == 2
    clock.t += 31.0  # nobody spoke for a while: the window is empty
    ladder.evaluate()
    clock.t += 5.0
    ladder.evaluate()
    assert ladder.level == 1
    clock.t += 5.0
    ladder.evaluate()
    assert ladder.level == 0


def test_turn_rate_limiter_admits_rate_and_refuses_excess() -> None:
    clock = Clock()
    limiter = TurnRateLimiter(rate_per_s=20.0, clock=clock)
    assert sum(limiter.allow() for _ in range(30)) == 20  # the burst
    clock.t += 0.5
    assert sum(limiter.allow() for _ in range(30)) == 10  # half a second refills 10
