"""AgentAudioTrack sends 20 ms s16 mono 24 kHz frames paced to start + pts/rate (checked with a
fake clock), silence when nothing is queued, queued PCM in exact order across frame
boundaries; flush() empties at once; underruns count only inside a reply after its first
audio; on_first_audio fires once per reply, on_drained once the ended reply is all sent; a
stall of more than 100 ms re-anchors the clock instead of bursting."""

from __future__ import annotations

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from agent.media.playout import AgentAudioTrack
from agent.metrics import REGISTRY

RATE = 24000
N = 480


class FakeClock:
    """Wall clock and sleep for the track: sleeping advances time by exactly the request."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += max(0.0, seconds)


def make_track(clock: FakeClock, **kwargs) -> AgentAudioTrack:
    return AgentAudioTrack(clock=clock, sleep=clock.sleep, **kwargs)


def pcm_of(frame) -> np.ndarray:
    return frame.to_ndarray().reshape(-1)


def underruns() -> float:
    return REGISTRY.get_sample_value("agent_playout_underruns_total") or 0.0


def playout_buffer() -> float:
    return REGISTRY.get_sample_value("agent_playout_buffer_seconds") or 0.0


async def test_frames_are_paced_to_start_plus_pts():
    clock = FakeClock()
    track = make_track(clock)
    for i in range(10):
        frame = await track.recv()
        assert frame.pts == i * N
        assert frame.samples == N and frame.sample_rate == RATE
        assert frame.format.name == "s16" and frame.layout.name == "mono"
        assert frame.time_base.numerator == 1 and frame.time_base.denominator == RATE
        # Returned no earlier than its due time start + pts / rate.
        assert clock.t == pytest.approx(1000.0 + i * N / RATE)
    assert len(clock.sleeps) == 9  # the first frame goes at once, like aiortc's tracks
    assert all(s == pytest.approx(0.02) for s in clock.sleeps)


async def test_silence_when_nothing_is_queued_and_never_blocks():
    clock = FakeClock()
    track = make_track(clock)
    for _ in range(5):
        assert not pcm_of(await track.recv()).any()
    assert track.buffered_seconds == 0.0


async def test_exact_pcm_order_across_frame_boundaries():
    clock = FakeClock()
    track = make_track(clock)
    ramp = (np.arange(1, 3001) % 30000).astype(np.int16)
    pos = 0
    for size in (7, 1000, 333, 1, 480, 1179):  # odd sizes, 3000 samples in all
        track.push(ramp[pos : pos + size])
        pos += size
    assert track.buffered_seconds == pytest.approx(3000 / RATE)
    out = np.concatenate([pcm_of(await track.recv()) for _ in range(7)])  # 3360 samples
    assert np.array_equal(out[:3000], ramp)
    assert not out[3000:].any()
    assert track.buffered_seconds == 0.0


async def test_push_copies_and_checks_dtype():
    track = make_track(FakeClock())
    pcm = np.full(N, 7, dtype=np.int16)
    track.push(pcm)
    pcm[:] = 0  # the producer reuses its buffer
    assert (pcm_of(await track.recv()) == 7).all()
    with pytest.raises(TypeError):
        track.push(np.zeros(N, dtype=np.float32))


async def test_flush_drops_everything_at_once():
    clock = FakeClock()
    g0 = playout_buffer()
    track = make_track(clock)
    track.begin_reply()
    track.push(np.ones(RATE, dtype=np.int16))  # 1 s
    assert playout_buffer() - g0 == pytest.approx(1.0)
    await track.recv()
    dropped = track.flush()
    assert dropped == pytest.approx(1.0 - N / RATE)
    assert track.buffered_seconds == 0.0 and not track.in_reply
    assert playout_buffer() - g0 == pytest.approx(0.0, abs=1e-9)
    assert not pcm_of(await track.recv()).any()  # the very next frame is silent


async def test_underruns_count_only_inside_a_reply_after_its_first_audio():
    clock = FakeClock()
    u0 = underruns()
    track = make_track(clock)
    # Outside a reply: silence is just idle, not an underrun.
    track.push(np.ones(N, dtype=np.int16))
    for _ in range(3):
        await track.recv()
    assert track.underruns == 0 and underruns() == u0

    track.begin_reply()
    for _ in range(3):  # waiting for the engine's first audio: that is TTFA, not an underrun
        await track.recv()
    assert track.underruns == 0
    track.push(np.ones(2 * N, dtype=np.int16))
    for _ in range(4):  # 2 frames of audio, then 2 silent frames while the reply is playing
        await track.recv()
    assert track.underruns == 2 and underruns() - u0 == 2
    track.push(np.ones(N + 100, dtype=np.int16))
    await track.recv()
    await track.recv()  # 100 samples then padding: the listener hears a gap
    assert track.underruns == 3

    track.end_reply()  # the buffer is empty: the reply is over
    for _ in range(3):
        await track.recv()
    assert track.underruns == 3 and underruns() - u0 == 3


async def test_last_partial_frame_after_end_reply_is_not_an_underrun():
    track = make_track(FakeClock())
    track.begin_reply()
    track.push(np.ones(N + 100, dtype=np.int16))
    track.end_reply()
    for _ in range(4):
        await track.recv()
    assert track.underruns == 0


async def test_first_audio_hook_fires_once_per_reply_with_the_send_time():
    clock = FakeClock()
    firsts: list[float] = []
    track = make_track(clock, on_first_audio=firsts.append)
    track.begin_reply()
    await track.recv()
    await track.recv()
    assert firsts == []  # silent frames are not the first audio
    track.push(np.ones(3 * N, dtype=np.int16))
    await track.recv()
    assert firsts == [pytest.approx(1000.04)]
    await track.recv()
    await track.recv()
    assert len(firsts) == 1
    track.end_reply()

    track.begin_reply()  # the next reply fires again
    track.push(np.ones(N, dtype=np.int16))
    await track.recv()
    assert len(firsts) == 2 and firsts[1] == pytest.approx(1000.1)


async def test_on_drained_fires_when_the_ended_reply_is_all_sent():
    clock = FakeClock()
    drained: list[float] = []
    track = make_track(clock, on_drained=drained.append)
    track.begin_reply()
    track.push(np.ones(3 * N, dtype=np.int16))
    track.end_reply()  # producer done, 60 ms still queued
    await track.recv()
    await track.recv()
    assert drained == []
    await track.recv()  # the last queued samples leave now
    assert drained == [pytest.approx(1000.04)]
    await track.recv()
    assert len(drained) == 1

    # An empty reply ends at once; a flushed one never "drains".
    track.begin_reply()
    track.end_reply()
    assert len(drained) == 2
    track.begin_reply()
    track.push(np.ones(3 * N, dtype=np.int16))
    track.flush()
    track.end_reply()
    await track.recv()
    assert len(drained) == 2


async def test_stall_reanchors_instead_of_bursting():
    clock = FakeClock()
    track = make_track(clock)
    for _ in range(3):
        await track.recv()
    clock.t += 0.5  # the event loop stalled for half a second
    stalled = await track.recv()
    assert stalled.pts == 3 * N  # the RTP clock stays continuous
    assert track.reanchors == 1
    resumed_at = clock.t
    # The next frames are paced 20 ms apart from the new anchor: no catch-up burst.
    for k in range(1, 4):
        frame = await track.recv()
        assert frame.pts == (3 + k) * N
        assert clock.t == pytest.approx(resumed_at + k * 0.02)
    assert clock.sleeps[-1] == pytest.approx(0.02)


async def test_small_lateness_catches_up_without_reanchor():
    clock = FakeClock()
    track = make_track(clock)
    await track.recv()
    clock.t += 0.05  # 50 ms late: under the 100 ms stall threshold
    await track.recv()
    await track.recv()
    await track.recv()
    assert track.reanchors == 0
    # Frames 1 and 2 (due +20, +40 ms) went at once; frame 3 was on time again (+60 ms).
    assert clock.sleeps[:2] == [0.0, 0.0]
    assert clock.t == pytest.approx(1000.06)
    frame = await track.recv()
    assert clock.t == pytest.approx(1000.08) and frame.pts == 4 * N


async def test_overflow_drops_the_newest_and_counts_it():
    track = make_track(FakeClock(), max_buffer_s=0.1)
    track.push(np.ones(int(0.06 * RATE), dtype=np.int16))
    track.push(np.full(int(0.1 * RATE), 2, dtype=np.int16))
    assert track.buffered_seconds == pytest.approx(0.1)
    assert track.overflow_s == pytest.approx(0.06)
    out = np.concatenate([pcm_of(await track.recv()) for _ in range(5)])
    assert (out[: int(0.06 * RATE)] == 1).all() and (out[int(0.06 * RATE) :] == 2).all()


async def test_stopped_track_raises_and_gives_its_buffer_back():
    g0 = playout_buffer()
    track = make_track(FakeClock())
    track.push(np.ones(RATE, dtype=np.int16))
    track.stop()
    assert playout_buffer() - g0 == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_first_audio_of_a_reply_goes_without_waiting_for_its_slot():
    """A reply's first audio wakes the track mid-slot; the next frame keeps 20 ms spacing."""
    import asyncio

    clock = FakeClock()
    release = asyncio.Event()

    async def held_sleep(seconds: float) -> None:  # time stands still until released
        clock.sleeps.append(seconds)
        await release.wait()

    track = AgentAudioTrack(clock=clock, sleep=held_sleep)
    await track.recv()  # the first frame goes at once and anchors the schedule
    track.begin_reply()
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not pending.done() and clock.sleeps == [pytest.approx(0.02)]
    track.push(np.full(N, 1000, np.int16))
    frame = await asyncio.wait_for(pending, 1.0)
    assert (pcm_of(frame) == 1000).all() and frame.pts == N
    assert track.early_starts == 1
    release.set()
    track.push(np.full(N, 7, np.int16))
    frame = await track.recv()
    assert clock.sleeps[-1] == pytest.approx(0.02)  # 20 ms after the early frame, not after its slot
    assert frame.pts == 2 * N and (pcm_of(frame) == 7).all()


async def test_outside_a_reply_audio_waits_for_its_slot():
    import asyncio

    clock = FakeClock()
    release = asyncio.Event()

    async def held_sleep(seconds: float) -> None:
        clock.sleeps.append(seconds)
        await release.wait()

    track = AgentAudioTrack(clock=clock, sleep=held_sleep)
    await track.recv()
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)
    track.push(np.full(N, 5, np.int16))
    await asyncio.sleep(0.01)
    assert not pending.done() and track.early_starts == 0
    release.set()
    assert (pcm_of(await pending) == 5).all()


def test_upsampler_streams_exactly_and_keeps_voice_band() -> None:
    """Upsampler2x: any chunking equals one-shot; input samples pass through on even
    outputs; a 1 kHz tone keeps its level and its image near 23 kHz is suppressed."""
    from agent.media.playout import Upsampler2x

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(2400) * 3000).astype(np.int16)
    whole = Upsampler2x().process(x)
    up = Upsampler2x()
    cuts = [0, 1, 480, 481, 1000, 2400]
    pieces = np.concatenate([up.process(x[a:b]) for a, b in zip(cuts, cuts[1:])])
    assert np.array_equal(pieces, whole) and len(whole) == 4800
    delay = 23  # (47 - 1) / 2 output samples
    assert np.array_equal(whole[delay::2], x[: len(whole[delay::2])])

    t = np.arange(24000) / 24000
    tone = (np.sin(2 * np.pi * 1000 * t) * 10000).astype(np.int16)
    y = Upsampler2x().process(tone)[1000:-1000].astype(np.float64)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    freqs = np.fft.rfftfreq(len(y), 1 / 48000)
    peak = spectrum[np.argmin(np.abs(freqs - 1000))]
    image = spectrum[np.argmin(np.abs(freqs - 23000))]
    assert 20 * np.log10(image / peak) < -40
    assert np.sqrt(np.mean(y**2)) == pytest.approx(10000 / np.sqrt(2), rel=0.02)


async def test_48k_frames_reach_the_opus_encoder_without_a_frame_of_delay():
    """The reason for 48 kHz output: aiortc's Opus encoder packs a 48 kHz frame at once,
    while a 24 kHz one comes out a frame (20 ms) later."""
    from aiortc.codecs import get_encoder
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    opus = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
    first_packet_at = {}
    for upsample in (False, True):
        track = make_track(FakeClock(), upsample_to_48k=upsample)
        track.push(np.full(10 * N, 3000, np.int16))
        encoder = get_encoder(opus)
        for i in range(3):
            frame = await track.recv()
            assert frame.sample_rate == (48000 if upsample else 24000)
            assert frame.samples == (2 * N if upsample else N) and frame.pts == i * frame.samples
            payloads, _ = encoder.encode(frame)
            if payloads and upsample not in first_packet_at:
                first_packet_at[upsample] = i
    assert first_packet_at == {False: 1, True: 0}
