"""server_vad's idle timer (agent/realtime/idle_timeout.py) on the input audio clock: it counts
from the first chunk after a reply was made and heard, fires once when the silence reaches the
timeout (returning its start and end), starts again only after the next reply, is reset by the
user speaking (counting then waits for the reply to them), and never fires before any reply or
without a timeout set."""

from __future__ import annotations

from agent.realtime.idle_timeout import IdleTimer

CHUNK = 0.08


def feed(timer: IdleTimer, start: float, seconds: float, *, replying=False, speaking=False, timeout=1.0):
    """Chunks from `start` for `seconds`; the (clock, result) of each that returned something."""
    fired = []
    n = round(seconds / CHUNK)
    for i in range(n):
        clock = round(start + (i + 1) * CHUNK, 6)
        result = timer.observe(clock, replying, speaking, timeout)
        if result is not None:
            fired.append((clock, result))
    return fired


def test_no_reply_yet_no_timeout() -> None:
    assert feed(IdleTimer(), 0.0, 5.0) == []


def test_fires_once_after_the_reply_was_heard() -> None:
    timer = IdleTimer()
    assert feed(timer, 0.0, 2.0, replying=True) == []
    fired = feed(timer, 2.0, 5.0)
    assert len(fired) == 1
    clock, (start, end) = fired[0]
    assert start == 2.08 and end == clock and end - start >= 1.0 and end - start < 1.0 + CHUNK


def test_the_next_reply_starts_the_count_again() -> None:
    timer = IdleTimer()
    feed(timer, 0.0, 1.0, replying=True)
    assert len(feed(timer, 1.0, 2.0)) == 1
    feed(timer, 3.0, 1.0, replying=True)  # the reply to the timeout
    assert [r[1][0] for r in feed(timer, 4.0, 2.0)] == [4.08]


def test_speech_resets_and_waits_for_the_reply_to_it() -> None:
    timer = IdleTimer()
    feed(timer, 0.0, 1.0, replying=True)
    assert feed(timer, 1.0, 0.5) == []
    assert feed(timer, 1.5, 0.5, speaking=True) == []
    assert feed(timer, 2.0, 3.0) == []  # no reply to the speech yet (create_response off)
    feed(timer, 5.0, 0.5, replying=True)
    assert len(feed(timer, 5.5, 1.5)) == 1


def test_no_timeout_set_never_fires() -> None:
    timer = IdleTimer()
    feed(timer, 0.0, 1.0, replying=True, timeout=None)
    assert feed(timer, 1.0, 10.0, timeout=None) == []
