"""ICE consent freshness that expires 30 s after the last answered check (RFC 7675).

aioice (0.13) checks a connected pair every 4-6 s but gives each check one 0.5 s try
(`retransmissions=0`) and closes the connection after six unanswered checks in a row. An answer
that comes back after 0.5 s therefore counts as no answer: a peer whose event loop, host or
path runs half a second behind for about 30 s loses a call that is alive, media and all. That
is what ended a quiet call on a loaded replica in the loaded test series.

RFC 7675 words it differently: consent expires when no check has been *answered* for 30 s
(the consent timeout); checks go out every 5 s, randomised by +-20 %, each a STUN transaction
that may be retransmitted. This module installs that rule in place of aioice's:

- a check every `CONSENT_INTERVAL` x (0.8-1.2), each retransmitted (0.5 s, then 1 s later) and
  given until 3.5 s to be answered; checks overlap rather than queue, so a late answer to an
  earlier check still counts;
- consent expires, and the connection closes as aioice's does, once no check has been answered
  for `CONSENT_INTERVAL` x `CONSENT_FAILURES` (5 s x 6 = 30 s, aioice's own constants, read at
  each tick, so that a test that shortens them shortens this timeout the same way).

A peer that really vanished is still given up within the timeout plus one interval. The rule is
process-wide, as aioice's is (a class method); `install_consent_freshness` is idempotent and is
called wherever this project makes a peer connection.
"""

from __future__ import annotations

import asyncio
import logging
import random

import aioice.ice
from aioice import stun

log = logging.getLogger(__name__)

# Retransmissions of one check: sent at 0 s, again at 0.5 s and 1.5 s; no answer by 3.5 s fails
# it (aioice's RTO of 0.5 s, doubled each time). Less than the next check's earliest start (4 s).
CHECK_RETRANSMISSIONS = 2


async def _query_consent(self: aioice.ice.Connection) -> None:
    """Connection.query_consent with RFC 7675's timeout: see the module docstring."""
    assert self.remote_password is not None  # checks start once connect() has the password
    key = self.remote_password.encode("utf8")
    loop = asyncio.get_running_loop()
    last_answer = loop.time()  # connect() just succeeded: consent was granted now
    checks: set[asyncio.Task] = set()

    def answered(task: asyncio.Task) -> None:
        nonlocal last_answer
        checks.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved either way, so that asyncio does not log it
        if error is None:
            last_answer = loop.time()
        elif not isinstance(error, stun.TransactionError):
            log.debug("consent check could not be sent: %r", error)

    try:
        while True:
            interval = aioice.ice.CONSENT_INTERVAL
            await asyncio.sleep(interval * (0.8 + 0.4 * random.random()))
            if loop.time() - last_answer >= interval * aioice.ice.CONSENT_FAILURES:
                log.info("ICE consent expired: no check answered for %.1f s", loop.time() - last_answer)
                break
            for pair in self._nominated.values():
                check = asyncio.ensure_future(
                    pair.protocol.request(
                        self.build_request(pair, nominate=False),
                        pair.remote_addr,
                        integrity_key=key,
                        retransmissions=CHECK_RETRANSMISSIONS,
                    )
                )
                checks.add(check)
                check.add_done_callback(answered)
    finally:  # expired or cancelled (close()): no check outlives the loop
        for task in list(checks):
            task.cancel()
    self._query_consent_task = None  # close() must not cancel the task running it
    await self.close()


AIOICE_QUERY_CONSENT = aioice.ice.Connection.query_consent  # aioice's own rule, for comparison


def install_consent_freshness() -> None:
    """Replace aioice's consent check with the RFC 7675 timeout (idempotent, process-wide)."""
    aioice.ice.Connection.query_consent = _query_consent  # type: ignore[method-assign]
