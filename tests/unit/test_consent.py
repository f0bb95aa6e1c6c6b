"""ICE consent freshness (agent/transport/consent.py): consent expires once no check has been
answered for the consent timeout, not after a run of checks answered later than 0.5 s.

Two aioice connections on loopback, the consent interval shortened to 0.5 s (the timeout to
0.5 s x 6 = 3 s, as test_call_leaks shortens it). Pins:
- a peer that answers every consent check 1 s late keeps the connection for four times the
  timeout; aioice's own rule (one 0.5 s try per check, six misses in a row) closes it within that time,
  which is how a loaded replica lost a live call;
- a peer that then stops answering altogether is given up, after the timeout and not before its
  answers stop;
- checks that are never answered leave no transaction or task behind once the connection closed.
"""

from __future__ import annotations

import asyncio

import aioice.ice
import pytest
from aioice import Connection, stun

from agent.transport.consent import AIOICE_QUERY_CONSENT, install_consent_freshness

INTERVAL, FAILURES = 0.5, 6
TIMEOUT = INTERVAL * FAILURES
LATE_S = 1.0
# How long both rules are watched under late answers. aioice's checks run one after another, each
# failing 0.5 s after a 0.4-0.6 s sleep, so its six misses take 5.4-6.6 s (more on a busy loop).
WATCH_S = 4 * TIMEOUT


@pytest.fixture
def quick_consent(monkeypatch):
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", INTERVAL)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", FAILURES)


async def _connected() -> tuple[Connection, Connection]:
    a, b = Connection(ice_controlling=True), Connection(ice_controlling=False)
    await asyncio.gather(a.gather_candidates(), b.gather_candidates())
    for this, other in ((a, b), (b, a)):
        for candidate in other.local_candidates:
            await this.add_remote_candidate(candidate)
        await this.add_remote_candidate(None)
        this.remote_username, this.remote_password = other.local_username, other.local_password
    await asyncio.wait_for(asyncio.gather(a.connect(), b.connect()), 10)
    return a, b


def _answer(peer: Connection, how: str) -> None:
    """The peer's STUN answers from now on: 'late' (held back LATE_S) or 'never'."""
    loop = asyncio.get_running_loop()
    for protocol in peer._protocols:
        send = protocol.__class__.send_stun.__get__(protocol)

        def send_stun(message, addr, send=send):
            if message.message_class != stun.Class.RESPONSE:
                send(message, addr)
            elif how == "late":
                loop.call_later(LATE_S, send, message, addr)

        protocol.send_stun = send_stun


async def _open_for(connection: Connection, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end and not connection._closing:
        await asyncio.sleep(0.05)
    return not connection._closing


async def test_late_answers_keep_consent_and_silence_expires_it(quick_consent) -> None:
    install_consent_freshness()
    a, b = await _connected()
    try:
        _answer(b, "late")
        assert await _open_for(a, WATCH_S), "consent expired although every check was answered"
        _answer(b, "never")
        silent_since = asyncio.get_running_loop().time()
        assert not await _open_for(a, TIMEOUT + 2 * INTERVAL + 5), "a peer that never answers kept consent"
        assert asyncio.get_running_loop().time() - silent_since >= TIMEOUT - LATE_S - 1.2 * INTERVAL
        await asyncio.sleep(2 * LATE_S)
        assert all(not p.transactions for p in a._protocols), "a consent check outlived the connection"
    finally:
        await a.close()
        await b.close()


async def test_aioice_rule_gives_up_on_late_answers(quick_consent, monkeypatch) -> None:
    # The fault the rule above fixes: with aioice's own checks, late answers count as none.
    monkeypatch.setattr(Connection, "query_consent", AIOICE_QUERY_CONSENT)
    a, b = await _connected()
    try:
        _answer(b, "late")
        assert not await _open_for(a, WATCH_S)
    finally:
        await a.close()
        await b.close()
