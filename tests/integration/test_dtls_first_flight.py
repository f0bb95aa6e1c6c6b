"""A WebRTC peer that drops the agent's first DTLS flight gets it again early
(agent/transport/dtls_flight.py).

The agent is the DTLS client of every call (it answers `a=setup:active`) and sends its ClientHello
as soon as its ICE check succeeds. werift's DTLS server starts listening a little after its ICE
does and drops that datagram; OpenSSL's own retransmission comes 1 s later, and such calls
connected 1.1 s after ICE. Real aiortc peers over loopback against a real agent (tiny model); the
test's peer drops the first DTLS datagram it receives, as werift does. Pins:
- the datagram that replaces the lost one is the agent's early resend: byte for byte the first
  flight (OpenSSL's retransmission carries a new record sequence number, so it differs), and
  `agent_dtls_first_flight_resends_total` counts it; the call then opens its data channel and
  gets `session.created`;
- with the early resends switched off, the replacement is OpenSSL's retransmission (it differs
  from the first flight) and nothing is counted: the first check can only pass by the resend;
- on a path slower than the first resend (the peer reads every DTLS datagram 250 ms late), the
  peer gets the first flight and then its copy, and the handshake completes all the same.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import aiohttp
import pytest
from aiortc import AudioStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from support.realtime_helpers import module_agent

from agent import metrics
from agent.transport import dtls_flight

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent()


def _is_dtls(datagram: bytes) -> bool:
    return bool(datagram) and 19 < datagram[0] < 64  # RFC 7983's range for DTLS records


class DropFirstFlight:
    """Wraps a peer's ICE receive: the first DTLS datagram is dropped (a DTLS server that was not
    listening yet), the ones after it are recorded and passed on."""

    def __init__(self) -> None:
        self.dropped: bytes | None = None
        self.after: list[bytes] = []

    def wrap(self, recv: Callable[[], Awaitable[bytes]]) -> Callable[[], Awaitable[bytes]]:
        async def dropping_recv() -> bytes:
            while True:
                datagram = await recv()
                if not _is_dtls(datagram):
                    return datagram
                if self.dropped is None:
                    self.dropped = datagram
                    continue
                self.after.append(datagram)
                return datagram

        return dropping_recv


class SlowPath:
    """Wraps a peer's ICE receive: every DTLS datagram reaches it `delay_s` late (in order), as
    over a path slower than the agent's first resend; counts the ClientHellos among them."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.client_hellos = 0

    def wrap(self, recv: Callable[[], Awaitable[bytes]]) -> Callable[[], Awaitable[bytes]]:
        async def slow_recv() -> bytes:
            datagram = await recv()
            if _is_dtls(datagram):
                # content type 22 (handshake), epoch 0, handshake type 1 (ClientHello) after the
                # 13-byte record header and at the start of the 12-byte handshake header
                if datagram[0] == 22 and len(datagram) > 13 and datagram[13] == 1:
                    self.client_hellos += 1
                await asyncio.sleep(self.delay_s)
            return datagram

        return slow_recv


def _resends() -> float:
    return metrics.REGISTRY.get_sample_value("agent_dtls_first_flight_resends_total") or 0.0


async def _call(url: str, path: DropFirstFlight | SlowPath) -> None:
    """One call from a peer whose DTLS datagrams come through `path`, up to session.created."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    channel = pc.createDataChannel("oai-events")
    pc.addTrack(AudioStreamTrack())
    ices = {t.sender.transport.transport for t in pc.getTransceivers()} | {pc.sctp.transport.transport}
    for ice in ices:  # bundled, one of them carries the call
        ice._recv = path.wrap(ice._recv)
    events: asyncio.Queue[dict] = asyncio.Queue()
    channel.on("message", lambda message: events.put_nowait(json.loads(message)))
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{url}/v1/realtime/calls",
                data=pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp"},
            ) as resp:
                assert resp.status == 201, await resp.text()
                answer = await resp.text()
        await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        first = await asyncio.wait_for(events.get(), timeout=30)
        assert first["type"] == "session.created", first
    finally:
        await pc.close()


async def _call_dropping_first_flight(url: str) -> DropFirstFlight:
    drops = DropFirstFlight()
    await _call(url, drops)
    assert drops.dropped is not None and drops.after, "no DTLS datagram was dropped and replaced"
    return drops


async def test_a_dropped_first_flight_is_replaced_by_the_early_resend(agent) -> None:
    before = _resends()
    drops = await _call_dropping_first_flight(agent.url)
    assert drops.after[0] == drops.dropped, "the replacement was not the first flight sent again"
    assert _resends() >= before + 1


async def test_without_early_resends_openssl_retransmits_a_new_record(agent, monkeypatch) -> None:
    monkeypatch.setattr(dtls_flight, "RESEND_AFTER_S", ())
    before = _resends()
    drops = await _call_dropping_first_flight(agent.url)
    assert drops.after[0] != drops.dropped, "OpenSSL's retransmission should carry a new record sequence number"
    assert _resends() == before


async def test_on_a_slow_path_the_copy_reaches_a_peer_that_has_the_first_and_the_call_connects(agent) -> None:
    before = _resends()
    path = SlowPath(delay_s=0.25)
    await _call(agent.url, path)  # session.created came: the handshake completed
    assert _resends() >= before + 1
    assert path.client_hellos >= 2, "the peer should have had the first flight and its early copy"
