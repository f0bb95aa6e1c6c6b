"""The token bucket and the two per-client rate limits, on a fake clock.

Pins: TokenBucket starts full (`burst` at once), refills at `rate` a second up to `burst` and
never lends a token it has not got. CallRate admits `per_minute` calls per address in any 60 s window, tells a refused
address how long until its oldest call leaves the window, counts addresses apart, forgets
idle addresses (its table stays bounded) and is off at 0. EventRate passes a second's worth
of events at once, then `rate` a second; it reports what it dropped at most once a second,
and a report still comes after the flood has stopped (with the next event).
"""

from __future__ import annotations

from agent.gate.access import CallRate
from agent.gate.token_bucket import TokenBucket
from agent.realtime.event_rate import EventRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_burst_refill_and_cap() -> None:
    clock = Clock()  # steps in binary fractions of a second: exact in floats
    bucket = TokenBucket(rate=4.0, burst=3.0, clock=clock)
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]  # starts full: the burst
    clock.now += 0.125
    assert bucket.allow() is False  # half a token is not one
    clock.now += 0.125
    assert bucket.allow() is True and bucket.allow() is False  # 0.25 s at 4 a second: one
    clock.now += 60.0
    assert sum(bucket.allow() for _ in range(10)) == 3  # a long pause refills only up to the burst
    clock.now += 0.625
    assert sum(bucket.allow() for _ in range(10)) == 2  # 2.5 tokens: two whole ones
    clock.now += 0.125
    assert bucket.allow() is True  # the half left over counts with the next
    still = TokenBucket(rate=0.0, burst=2.0, clock=clock)
    clock.now += 100.0
    assert sum(still.allow() for _ in range(5)) == 2  # rate 0: the burst, then nothing


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
