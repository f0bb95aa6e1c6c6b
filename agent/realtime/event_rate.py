"""A session's client events per second (agent/realtime/client_events.py counts them): a token
bucket, and the drops it reports. Its own module so the Session that owns one need not import
the event handlers that use it (they see the session only as a type)."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

from agent.gate.token_bucket import TokenBucket


class EventRate:
    """A session's client events per second: a token bucket of `rate` tokens a second holding
    at most a second's worth (50 at least). Owned by the Session, taken by client_events."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._bucket = TokenBucket(rate, max(rate, 50.0), clock)
        self._clock = clock
        self.dropped = 0  # since the last report
        self._reported_at = -math.inf

    def take(self) -> bool:
        if self.rate <= 0 or self._bucket.allow():
            return True
        self.dropped += 1
        return False

    def report_due(self) -> Optional[int]:
        """Events dropped since the last report, when a report is due (one a second at most)."""
        now = self._clock()
        if not self.dropped or now - self._reported_at < 1.0:
            return None
        dropped, self.dropped, self._reported_at = self.dropped, 0, now
        return dropped
