"""Ending a peer connection so that a finished call frees what it held at once.

aiortc's RTCPeerConnection.close() stops every transceiver (the receivers join their
decoder threads) and the transports, but leaves each RTCDtlsTransport holding the peer's
own bound methods as "statechange" listeners, and the peer holds its transports: a
reference cycle. Everything the peer owned (transceivers, tracks, jitter buffers, DTLS and
SRTP state) then waits for the cycle collector, whose full collections are rare in a
process with a large long-lived heap such as a loaded model. Removing those listeners
after close() breaks the cycle, so reference counting frees the peer as soon as its last
owner (the Session) lets go.

Likewise, messages a data channel could not deliver (the far end vanished, or the call
never connected) stay queued in the SCTP transport, and each queued item points back at
its channel, whose transport is that SCTP transport: close() does not drop them.
"""

from __future__ import annotations

import logging

from aiortc import RTCDtlsTransport, RTCPeerConnection

log = logging.getLogger(__name__)


def _dtls_transports(pc: RTCPeerConnection) -> set[RTCDtlsTransport]:
    transports = {t.receiver.transport for t in pc.getTransceivers()}
    transports |= {t.sender.transport for t in pc.getTransceivers()}
    if pc.sctp is not None and pc.sctp.transport is not None:
        transports.add(pc.sctp.transport)
    return transports - {None}


async def close_peer(pc: RTCPeerConnection) -> None:
    """Close `pc`, then drop what aiortc leaves referring back to the peer or its channels.

    Safe to call more than once and on a peer that never connected.
    """
    try:
        await pc.close()
    except Exception:
        # A peer built from a hostile offer can be half set up (aiortc then trips over its own
        # missing transports); what could be stopped is stopped, the rest is dropped below.
        log.warning("closing a half-set-up peer failed", exc_info=True)
    # Nothing is emitted after close(): these listeners can only keep the peer alive.
    for transport in _dtls_transports(pc):
        transport.remove_all_listeners()
    # aiortc 1.16 has no public way to drop undelivered data channel messages.
    undelivered = getattr(pc.sctp, "_data_channel_queue", None)
    if undelivered is not None:
        undelivered.clear()
