"""lower_audio_jitter_hold swaps aiortc's private audio JitterBuffer(capacity=16, prefetch=4) for
one with prefetch=1 only when that is safe, and refuses (False, receiver untouched) otherwise.
These tests fail when an aiortc upgrade renames the attribute, changes the JitterBuffer
constructor or its prefetch meaning; two real aiortc peers over loopback show frames still
flow with the lowered hold, which holds 1 packet where the default holds 4 (~60 ms); prefetch=0
releases each in-order audio packet at once (holds none: another 20 ms), waits a packet or two for a
hole and then skips it, and drops packets that come after their turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtcdtlstransport import RTCCertificate, RTCDtlsTransport
from aiortc.rtcicetransport import RTCIceGatherer, RTCIceTransport
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtp import RtpPacket

from agent.media.playout import AgentAudioTrack
from agent.transport.jitter import ImmediateAudioJitterBuffer, lower_audio_jitter_hold

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


@pytest.mark.parametrize("prefetch", [16, -1])
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


async def receive_holds(lower: bool, frames: int = 60, prefetch: int = 1) -> tuple[list[int], int | None]:
    """Run two loopback peers; after each packet the receiver's jitter buffer takes, how many
    packets it holds unreleased (added minus released): the hold, counted, not timed."""
    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    sender.addTrack(AgentAudioTrack())  # silence, paced like the agent's voice
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    receiver.on("track", lambda t: got.done() or got.set_result(t))
    try:
        await sender.setLocalDescription(await sender.createOffer())
        await receiver.setRemoteDescription(sender.localDescription)
        (rtp_receiver,) = receiver.getReceivers()
        if lower:
            assert lower_audio_jitter_hold(rtp_receiver, prefetch=prefetch)
        buffer = getattr(rtp_receiver, ATTR)
        held = buffer._prefetch
        counts = {"added": 0, "released": 0}
        holds: list[int] = []
        add = buffer.add

        def counted_add(packet):  # type: ignore[no-untyped-def]
            result = add(packet)
            counts["added"] += 1
            counts["released"] += result[1] is not None
            holds.append(counts["added"] - counts["released"])
            return result

        buffer.add = counted_add
        await receiver.setLocalDescription(await receiver.createAnswer())
        await sender.setRemoteDescription(receiver.localDescription)
        remote = await asyncio.wait_for(got, 5.0)
        for _ in range(frames):
            await asyncio.wait_for(remote.recv(), 5.0)
        return holds, held
    finally:
        await sender.close()
        await receiver.close()


async def test_two_loopback_peers_flow_and_lowered_hold_releases_sooner():
    default, prefetch_default = await receive_holds(lower=False)
    lowered, prefetch_lowered = await receive_holds(lower=True)
    assert prefetch_default == 4 and prefetch_lowered == 1
    # Frames flowed in both; in steady state aiortc's buffer holds 4 packets, the lowered one 1
    # (3 x 20 ms less). Loopback neither loses nor reorders, so the counts are exact; the
    # median only steps over the first packets, before the hold has filled.
    assert float(np.median(default)) == 4 and float(np.median(lowered)) == 1, (default, lowered)


def test_immediate_buffer_releases_in_order_packets_at_once():
    buffer = ImmediateAudioJitterBuffer()
    for seq in range(5):
        _, frame = buffer.add(packet(seq))
        assert frame is not None and frame.timestamp == seq * 960


def test_immediate_buffer_waits_briefly_for_a_hole_then_skips_it():
    buffer = ImmediateAudioJitterBuffer(patience=2)
    assert buffer.add(packet(0))[1].timestamp == 0
    assert buffer.add(packet(2))[1] is None  # 1 is missing: maybe just late
    late = buffer.add(packet(1))[1]  # it came: both flow in order
    assert late.timestamp == 960
    assert buffer.add(packet(3))[1].timestamp == 2 * 960
    assert buffer.add(packet(5))[1].timestamp == 3 * 960  # 4 is missing: 5 waits
    assert buffer.add(packet(6))[1].timestamp == 5 * 960  # two newer than the hole: 4 given up
    assert buffer.add(packet(7))[1].timestamp == 6 * 960
    assert buffer.add(packet(4))[1] is None  # too late now: dropped, not replayed
    assert buffer.add(packet(8))[1].timestamp == 7 * 960


async def test_lowering_to_zero_installs_the_immediate_buffer():
    receiver = make_receiver("audio")
    assert lower_audio_jitter_hold(receiver, prefetch=0) is True
    assert type(getattr(receiver, ATTR)) is ImmediateAudioJitterBuffer
    assert lower_audio_jitter_hold(receiver, prefetch=0) is True  # idempotent
    assert released_after(getattr(receiver, ATTR)) == 1


async def test_immediate_buffer_over_loopback_beats_prefetch_1():
    one, _ = await receive_holds(lower=True)
    zero, prefetch = await receive_holds(lower=True, prefetch=0)
    assert prefetch == 0
    # Each in-order packet is released the moment it arrives: nothing held (one frame less).
    assert float(np.median(one)) == 1 and max(zero) == 0, (one, zero)
