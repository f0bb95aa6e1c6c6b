"""Hostile media at the ingest: odd rates, layouts, sizes and timestamps never break a session's input.

Pins, with real PyAV frames through the session's own input objects (InputBuffer: resampler,
audio clock, endpointer; VideoSampler): 8 kHz mono, 96 kHz 6-channel planar float, 44.1 kHz
stereo and 48 kHz frames, zero-length frames, the rate and layout changing mid-stream, pts
jumping backwards and forwards (up to 10 s: a peer that went quiet), frames without pts ->
no exception, the audio clock follows the audio (a wide ratio), and real speech sent as 8 kHz
mono and then as 96 kHz 5.1 is found as a turn in each. Video: 4K, 1921x1079, 1x1, portrait 1080x1920, yuv420p/rgb24/nv12,
resolution changing every frame -> every kept image is RGB uint8 with its longer side at
most the configured size and the source's aspect kept. Each test prints what it fed.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from support.speech import read_wav

from agent.config import Config
from agent.media.ingest import VideoSampler
from agent.media.resample import resample
from agent.media.turn_events import SpeechStarted, SpeechStopped
from agent.realtime.input_buffer import InputBuffer
from agent.realtime.session_config import TurnDetection


def _audio(
    rate: int, layout: str, fmt: str, samples: int, pts: int | None, tone: float = 0.0, wave: np.ndarray | None = None
) -> av.AudioFrame:
    """A frame of `wave` (float32 mono in [-1, 1]) or, without one, of a modulated 220 Hz tone,
    in every channel of `layout`."""
    channels = av.AudioLayout(layout).nb_channels
    if wave is None:
        t = np.arange(samples) / rate
        wave = (tone * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    if fmt == "s16":
        data = np.tile((wave * 32767).astype(np.int16), (channels, 1)).T.reshape(1, -1)
    else:  # fltp: one plane per channel
        data = np.tile(wave.astype(np.float32), (channels, 1))
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=fmt, layout=layout)
    frame.sample_rate = rate
    if pts is not None:
        frame.pts = pts
        frame.time_base = Fraction(1, rate)
    return frame


def _buffer() -> InputBuffer:
    return InputBuffer(
        Config(), TurnDetection(silence_ms=300, prefix_padding_ms=300, create_response=True, interrupt_response=True)
    )


SOURCES = [
    (8_000, "mono", "s16"),
    (96_000, "5.1", "fltp"),
    (44_100, "stereo", "s16"),
    (48_000, "stereo", "fltp"),
    (16_000, "mono", "s16"),
]


def test_any_rate_layout_and_zero_length_frames_keep_the_clock() -> None:
    buf = _buffer()
    fed_s = 0.0
    frames = 0
    for rate, layout, fmt in SOURCES:  # the source changes mid-stream: each a new resampler
        samples = rate // 50  # 20 ms
        pts = 0
        for i in range(50):  # 1 s of each
            buf.push(_audio(rate, layout, fmt, samples, pts))
            pts += samples
            fed_s += 0.02
            frames += 1
            if i % 10 == 0:
                buf.push(_audio(rate, layout, fmt, 0, pts))  # zero-length, same pts
                frames += 1
    clock = buf.audio_in.clock
    print(f"\naudio: {frames} frames from {len(SOURCES)} sources ({fed_s:.1f} s), clock {clock:.2f} s")
    # Each source restarts its pts at 0 (a resync, not a gap): the clock counts the audio.
    assert 0.9 * fed_s <= clock <= 1.1 * fed_s + 0.2


def test_pts_jumps_and_missing_pts() -> None:
    buf = _buffer()
    rate, samples = 48_000, 960
    pts = 0
    fed = 0
    for step in range(300):
        frame = _audio(rate, "stereo", "s16", samples, pts if step % 37 else None)
        buf.push(frame)
        fed += 1
        pts += samples
        if step == 50:
            pts -= rate * 3  # backwards 3 s (source restarted)
        elif step == 100:
            pts += rate // 2  # forwards 0.5 s: filled with silence
        elif step == 150:
            pts += rate * 10  # forwards 10 s: a peer that stopped sending
    a = buf.audio_in
    print(
        f"\npts: {fed} frames, resyncs {a.resyncs}, gaps filled {a.gaps_filled}, clock jumps {a.clock_jumps}, "
        f"clock {a.clock:.2f} s"
    )
    assert a.resyncs >= 1 and a.gaps_filled >= 1 and a.clock_jumps >= 1
    # 6 s of audio, 0.5 s of filled silence, 10 s skipped (by whole chunks, never allocated).
    assert 6.0 <= a.clock <= 17.5


def test_speech_is_still_found_after_hostile_audio(speech_wav) -> None:
    """Real speech (espeak) sent as 8 kHz mono s16, then as 96 kHz 5.1 planar float (the rate,
    layout and pts restarting mid-stream): each is heard as a turn."""
    pcm, rate16 = read_wav(speech_wav)
    buf = _buffer()
    events = []
    for rate, layout, fmt in SOURCES[:2]:  # 8 kHz, then 96 kHz 6-channel
        samples = rate // 50
        speech = resample((pcm / 32768.0).astype(np.float32), rate16, rate)
        quiet = np.zeros(rate, np.float32)
        wave = np.concatenate([quiet, speech, quiet])  # 1 s quiet, the sentence, 1 s quiet
        for pts in range(0, len(wave) - samples + 1, samples):
            events += buf.push(_audio(rate, layout, fmt, samples, pts, wave=wave[pts : pts + samples]))
    kinds = [type(e).__name__ for e in events if isinstance(e, (SpeechStarted, SpeechStopped))]
    print(f"\nturns through odd sources: {kinds}")
    assert kinds.count("SpeechStarted") >= 2 and kinds.count("SpeechStopped") >= 2, kinds


def _video(width: int, height: int, fmt: str, t: float) -> av.VideoFrame:
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[:, : max(1, width // 2)] = (200, 30, 30)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    if fmt != "rgb24":
        frame = frame.reformat(format=fmt)
    frame.pts = int(t * 90_000)
    frame.time_base = Fraction(1, 90_000)
    return frame


def test_any_video_size_and_format_becomes_a_bounded_rgb_image() -> None:
    sampler = VideoSampler(fps=4.0, max_side=448)
    sizes = [(3840, 2160), (1921, 1079), (1, 1), (1080, 1920), (640, 480), (2, 3000), (1921, 1079)]
    formats = ["yuv420p", "rgb24", "nv12"]
    kept = []
    t = 0.0
    for i in range(60):  # the resolution (and format) changes every frame
        width, height = sizes[i % len(sizes)]
        fmt = formats[i % len(formats)]
        if fmt != "rgb24" and (width < 2 or height < 2):
            fmt = "rgb24"  # 4:2:0 needs two pixels a side
        sample = sampler.push(_video(width, height, fmt, t), audio_clock=t)
        t += 0.26  # every frame crosses a 4 fps mark: each one is kept and converted
        if sample is not None:
            kept.append(sample)
            image = sample.image
            assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
            h, w = image.shape[:2]
            assert max(h, w) <= 448 and min(h, w) >= 1
            if min(width, height) >= 100:  # aspect kept (rounding aside)
                assert abs(w / h - width / height) / (width / height) < 0.02, (width, height, w, h)
    print(f"\nvideo: 60 frames, {len(sizes)} sizes x {len(formats)} formats, {len(kept)} kept, all <= 448 px")
    assert len(kept) >= 50
