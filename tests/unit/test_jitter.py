"""lower_audio_jitter_hold swaps aiortc's private audio JitterBuffer(capacity=16, prefetch=4) for
one with prefetch=1 only when that is safe, and refuses (False, receiver untouched) otherwise.
These tests fail when an aiortc upgrade renames the attribute, changes the JitterBuffer
constructor or its prefetch meaning; two real aiortc peers over loopback show frames still
flow with the lowered hold and arrive ~60 ms sooner than with the default."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtp import RtpPacket

from agent.jitter import lower_audio_jitter_hold
from agent.playout import AgentAudioTrack

ATTR = "_RTCRtpReceiver__jitter_buffer"


def make_receiver(kind: str) -> RTCRtpReceiver:
    gatherer = RTCIceGatherer(iceServers=[])  # no STUN: nothing may leave loopback
    transport = RTCDtlsTransport(RTCIceTransport(gatherer), [RTCCertificate.generateCertificate()])
    return RTCRtpReceiver(kind, transport)


def packet(seq: int) -> RtpPacket:
    p = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * 960, payload=b"x")
    p._data = b"x"  # type: ignore[attr-defined]  # what the receiver's depayload sets
    return p


def released_after(buffer: JitterBuffer, n: int = 8) -> int:
    """How many packets went in before the first frame came out."""
    for seq in range(n):
        _, frame = buffer.add(packet(seq))
        if frame is not None:
            assert frame.timestamp == 0
            return seq + 1
    return -1


async def test_aiortc_still_holds_audio_where_we_expect():
    # If these fail, aiortc changed the thing we patch: re-read RTCRtpReceiver.__init__.
    receiver = make_receiver("audio")
    buffer = getattr(receiver, ATTR)
    assert type(buffer) is JitterBuffer
    assert buffer.capacity == 16 and buffer._prefetch == 4 and buffer._origin is None
    assert released_after(buffer) == 5  # a frame waits for 4 more: 80 ms


async def test_lowering_replaces_the_buffer_with_prefetch_1():
    receiver = make_receiver("audio")
    old = getattr(receiver, ATTR)
    assert lower_audio_jitter_hold(receiver, prefetch=1) is True
    new = getattr(receiver, ATTR)
    assert new is not old and type(new) is JitterBuffer
    assert new.capacity == 16 and new._prefetch == 1
    assert released_after(new) == 2  # released by the next packet: 20 ms
    assert lower_audio_jitter_hold(receiver, prefetch=1) is True  # idempotent
    assert getattr(receiver, ATTR) is new


async def test_video_receiver_is_left_alone(caplog):
    receiver = make_receiver("video")
    old = getattr(receiver, ATTR)
    assert lower_audio_jitter_hold(receiver) is False
    assert getattr(receiver, ATTR) is old
    assert "not 'audio'" in caplog.text


async def test_buffer_in_use_is_left_alone():
    receiver = make_receiver("audio")
    old = getattr(receiver, ATTR)
    old.add(packet(0))
    assert lower_audio_jitter_hold(receiver) is False
    assert getattr(receiver, ATTR) is old


@pytest.mark.parametrize("prefetch", [0, 16, -1])
async def test_prefetch_out_of_range_is_refused(prefetch):
    receiver = make_receiver("audio")
    old = getattr(receiver, ATTR)
    assert lower_audio_jitter_hold(receiver, prefetch=prefetch) is False
    assert getattr(receiver, ATTR) is old


async def test_unexpected_shapes_never_crash(caplog):
    class Renamed:  # as if aiortc renamed its private attributes
        pass

    assert lower_audio_jitter_hold(Renamed()) is False  # type: ignore[arg-type]

    receiver = make_receiver("audio")
    setattr(receiver, ATTR, object())  # as if it became another class
    assert lower_audio_jitter_hold(receiver) is False
    assert "audio jitter hold left at aiortc's default" in caplog.text


class StampedTrack(AgentAudioTrack):
    """Our outbound track (silence), noting the wall time its clock started."""

    def __init__(self) -> None:
        super().__init__(stall_s=10.0)  # never re-anchor: keep pts tied to t0
        self.t0: float | None = None

    async def recv(self):  # type: ignore[override]
        if self.t0 is None:
            self.t0 = time.time()
        return await super().recv()


async def receive_delays(lower: bool, frames: int = 60) -> tuple[list[float], int | None]:
    """Run two loopback peers; per received frame, arrival minus its send schedule."""
    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    track = StampedTrack()
    sender.addTrack(track)
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    receiver.on("track", lambda t: got.done() or got.set_result(t))
    try:
        await sender.setLocalDescription(await sender.createOffer())
        await receiver.setRemoteDescription(sender.localDescription)
        (rtp_receiver,) = receiver.getReceivers()
        if lower:
            assert lower_audio_jitter_hold(rtp_receiver, prefetch=1)
        prefetch = getattr(rtp_receiver, ATTR)._prefetch
        await receiver.setLocalDescription(await receiver.createAnswer())
        await sender.setRemoteDescription(receiver.localDescription)
        remote = await asyncio.wait_for(got, 5.0)
        delays = []
        for _ in range(frames):
            frame = await asyncio.wait_for(remote.recv(), 5.0)
            assert track.t0 is not None
            delays.append(time.time() - (track.t0 + frame.pts / frame.sample_rate))
        return delays, prefetch
    finally:
        await sender.close()
        await receiver.close()


async def test_two_loopback_peers_flow_and_lowered_hold_arrives_sooner():
    default, prefetch_default = await receive_delays(lower=False)
    lowered, prefetch_lowered = await receive_delays(lower=True)
    assert prefetch_default == 4 and prefetch_lowered == 1
    # Frames flowed in both; compare a low percentile (scheduling hiccups only add delay).
    d, lo = float(np.percentile(default, 25)), float(np.percentile(lowered, 25))
    # Expected gap: 3 frames x 20 ms. Half of it is a generous margin on a busy machine.
    assert d - lo > 0.03, f"default {d * 1000:.0f} ms vs lowered {lo * 1000:.0f} ms"
