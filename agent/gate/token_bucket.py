"""A token bucket: `rate` tokens a second, at most `burst` held, one taken per thing admitted.

The one bucket behind every rate limit that counts events (not addresses): turns sent to the
engine (agent/gate/ladder.py), offers on a replica (agent/serve/admission.py) and a session's
client events (agent/realtime/client_events.py), and the image pixels a session's messages may
have decoded (agent/realtime/message_content.py). It starts full; the clock is injectable.
"""

from __future__ import annotations

import time
from typing import Callable


class TokenBucket:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def allow(self, cost: float = 1.0) -> bool:
        """Take `cost` tokens if there are that many (refilled for the time since the last call)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= cost:
            self._tokens -= cost
            return True
        return False
