"""What a replica adds to the agent's own admission: a drain switch and an offer rate.

The call limit stays where it is (the offer handler answers 503 + Retry-After past
--max-sessions); this gate refuses earlier, for reasons that exist only with replicas: the
replica is being removed (it finishes its calls but takes no new one), or offers arrive
faster than one GPU can set calls up (the design's 20 new calls/s per GPU).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from agent.gate.token_bucket import TokenBucket
from agent.serve.relay import Refusal


class OfferGate:
    def __init__(self, max_offers_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._bucket = TokenBucket(max_offers_per_s, burst=max(1.0, max_offers_per_s), clock=clock)
        self.draining = False
        self.offers = 0  # offers seen, refused or not: the router compares it with what it sent

    def __call__(self) -> Optional[Refusal]:
        self.offers += 1
        if self.draining:
            return Refusal(
                503,
                "this replica is shutting down; retry (another replica takes the call)",
                "draining",
                retry_after_s=1,
            )
        if not self._bucket.allow():
            return Refusal(503, "too many new calls per second on this replica", "rate_limited", retry_after_s=1)
        return None
