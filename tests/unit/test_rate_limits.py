"""The two per-client rate limits, on a fake clock.

Pins: CallRate admits `per_minute` calls per address in any 60 s window, tells a refused
address how long until its oldest call leaves the window, counts addresses apart, forgets
idle addresses (its table stays bounded) and is off at 0. EventRate passes a second's worth
of events at once, then `rate` a second; it reports what it dropped at most once a second,
and a report still comes after the flood has stopped (with the next event).
"""

from __future__ import annotations

from agent.gate.access import CallRate
from agent.realtime.client_events import EventRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_call_rate_sliding_window_per_address() -> None:
    clock = Clock()
    rate = CallRate(3, clock=clock)
    for _ in range(3):  # calls at 1000, 1010, 1020
        assert rate.admit("a") is None
        clock.now += 10
    assert rate.admit("a") == 30.0  # at 1030: the first call leaves the window in 30 s
    assert rate.admit("b") is None  # another address has its own budget
    clock.now += 30
    assert rate.admit("a") is None  # at 1060: one slot free again
    assert rate.admit("a") == 10.0  # and taken: the next frees at 1070
    clock.now += 600
    rate.admit("c")
    assert set(rate._calls) == {"c"}, "idle addresses are forgotten"
    off = CallRate(0, clock=clock)
    assert all(off.admit("a") is None for _ in range(1000))


def test_event_rate_bucket_and_reports() -> None:
    clock = Clock()
    rate = EventRate(100.0, clock=clock)
    passed = sum(rate.take() for _ in range(500))
    assert passed == 100  # a second's worth at once
    assert rate.report_due() == 400  # the first report: at once
    assert rate.take() is False and rate.report_due() is None  # the next only a second later
    clock.now += 0.5
    assert sum(rate.take() for _ in range(100)) == 50  # refilled at 100 a second
    clock.now += 0.6
    assert rate.report_due() == 51  # after the flood, the next event brings the count
    assert rate.report_due() is None
    assert sum(EventRate(0, clock=clock).take() for _ in range(10_000)) == 10_000  # 0: no limit
