"""The DTLS client's first flight, sent again early while the peer has answered nothing.

On a WebRTC call the agent answers `a=setup:active`: it is the DTLS client and speaks first,
sending its ClientHello the moment its own ICE check succeeds. A peer whose DTLS server starts
listening a little after its ICE reports success (werift does) drops that datagram, and OpenSSL
sends it again only when its RFC 6347 initial timer of 1 s runs out: such calls connected 1.1 s
after ICE, where other stacks take tens of milliseconds.

This sends the first flight's datagrams again `RESEND_AFTER_S` after it (100 ms, then 300 ms and
700 ms) for as long as nothing at all has come back on the DTLS transport; from the first
datagram received on, or past 700 ms, OpenSSL's own timers alone decide. A server that did get
the first copy (a path slower than 100 ms a round trip) takes a second for a retransmission, as
it must take OpenSSL's own (RFC 6347, 4.2.4: it repeats its flight, and the client drops the
copy of a message it has handled); a server that checks record numbers for replays drops it,
and OpenSSL's retransmission follows as before. The handshake itself never changes, only how
soon a lost first flight is replaced. Each early resend is counted
(`agent_dtls_first_flight_resends_total`).

aiortc (1.16) has no hook for this: `install_dtls_resend` wraps `RTCDtlsTransport.start`
(process-wide and idempotent, as consent.py's rule), and for the handshake only, replaces the ICE
transport's `_send` on that one instance to record what the first flight was.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiortc import RTCDtlsParameters, RTCDtlsTransport

from agent import metrics

log = logging.getLogger(__name__)

# Delays between early resends (cumulative 0.1, 0.3, 0.7 s after the first flight), all before
# OpenSSL's own first retransmission at 1 s. On loopback and LAN paths an answer comes back in
# well under 100 ms, so a peer that got the first copy is rarely sent a second.
RESEND_AFTER_S = (0.1, 0.2, 0.4)

Send = Callable[[bytes], Awaitable[None]]

_AIORTC_START = RTCDtlsTransport.start


def _heard_from_peer(dtls: RTCDtlsTransport) -> bool:
    """Whether any datagram (a DTLS record, or early media) has reached the DTLS transport."""
    return dtls._RTCDtlsTransport__rx_packets > 0  # type: ignore[attr-defined]


async def _resend_first_flight(dtls: RTCDtlsTransport, send: Send, flight: list[bytes]) -> None:
    waited = 0.0
    for delay in RESEND_AFTER_S:
        await asyncio.sleep(delay)
        waited += delay
        if dtls.state != "connecting" or _heard_from_peer(dtls) or not flight:
            return
        try:
            await send(flight[0])
        except OSError:  # ICE closed under the handshake (ConnectionError): aiortc's own loop reports it
            return
        metrics.DTLS_FIRST_FLIGHT_RESENDS.inc()
        log.debug("DTLS first flight sent again: nothing heard %.1f s after it", waited)


async def _start(self: RTCDtlsTransport, remoteParameters: RTCDtlsParameters) -> None:
    """RTCDtlsTransport.start, with the client's first flight resent early (module docstring)."""
    if self._role != "client":  # a server answers; the peer's client retransmits its own flight
        await _AIORTC_START(self, remoteParameters)
        return
    ice = self.transport
    send: Send = ice._send  # aiortc binds it per instance: the ICE connection's send
    flight: list[bytes] = []  # the first datagram: OpenSSL writes a ClientHello as one

    async def recording_send(data: bytes) -> None:
        if not flight and not _heard_from_peer(self):
            flight.append(data)
        await send(data)

    # Replaced before the handshake starts: aiortc sends the ClientHello without yielding first.
    ice._send = recording_send  # type: ignore[method-assign]
    resender = asyncio.ensure_future(_resend_first_flight(self, send, flight))
    try:
        await _AIORTC_START(self, remoteParameters)
    finally:
        resender.cancel()
        if ice._send is recording_send:
            ice._send = send  # type: ignore[method-assign]


def install_dtls_resend() -> None:
    """Resend the agent's first DTLS flight early while the peer is silent (idempotent, process-wide)."""
    RTCDtlsTransport.start = _start  # type: ignore[method-assign]
