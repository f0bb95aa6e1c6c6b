"""AudioIn pins the session's audio clock: received frames of any format and rate become exact
1280-sample float32 chunks at 16 kHz whose index/start count real time, and a pts jump is
filled with silence (or, past a second, skipped by whole chunks) so the clock stays true."""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest

from agent.media.ingest import CHUNK_SECONDS, AudioChunk, AudioIn
from agent.metrics import REGISTRY


def tone(seconds: float, rate: int, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (np.sin(2 * np.pi * freq * t) * amp * 32767).astype(np.int16)


def frames(
    pcm: np.ndarray,
    rate: int,
    per_frame: int,
    channels: int = 2,
    fmt: str = "s16",
    first_pts: int = 0,
    skip: set[int] = frozenset(),
) -> list[av.AudioFrame]:
    """Split mono s16 PCM into frames like aiortc's Opus decoder makes them (pts in 1/rate)."""
    out = []
    for i in range(len(pcm) // per_frame):
        if i in skip:
            continue
        block = pcm[i * per_frame : (i + 1) * per_frame]
        layout = "stereo" if channels == 2 else "mono"
        if fmt == "s16":
            data = np.repeat(block, channels).reshape(1, -1)  # packed: interleaved
        else:  # fltp: one float plane per channel
            data = np.tile(block.astype(np.float32) / 32768.0, (channels, 1))
        f = av.AudioFrame.from_ndarray(data, format=fmt, layout=layout)
        f.sample_rate = rate
        f.pts = first_pts + i * per_frame
        f.time_base = fractions.Fraction(1, rate)
        out.append(f)
    return out


def feed(ain: AudioIn, fs: list[av.AudioFrame]) -> list[AudioChunk]:
    chunks: list[AudioChunk] = []
    for f in fs:
        chunks += ain.push(f)
    return chunks


def peak_hz(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm))
    return float(np.argmax(spectrum) * rate / len(pcm))


def test_48k_stereo_frames_become_exact_chunks_on_the_clock():
    ain = AudioIn()
    chunks = feed(ain, frames(tone(1.0, 48000), 48000, 960))
    # 1 s in, minus the resampler's 16-sample delay: 15984 samples -> 12 whole chunks.
    assert len(chunks) == 12
    for i, c in enumerate(chunks):
        assert c.pcm.dtype == np.float32 and c.pcm.shape == (1280,)
        assert c.index == i
        assert c.start == pytest.approx(i * 0.08)
        assert c.end == pytest.approx((i + 1) * 0.08)
    assert ain.clock == pytest.approx(0.96)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert abs(peak_hz(pcm, 16000) - 440) < 2
    assert 0.25 < np.abs(pcm).max() <= 0.31  # scaled to [-1, 1], not int16 range
    assert ain.gaps_filled == 0


def test_each_20ms_frame_completes_its_subframe_on_arrival():
    """The resampler holds back 16 samples of the first frame; they go in front as silence, so
    after n frames exactly n x 320 samples are on the clock (not 16 short, which made every
    end-of-turn decision wait for the next frame)."""
    ain = AudioIn()
    fs = frames(tone(0.2, 48000), 48000, 960)
    for n, frame in enumerate(fs[:3], start=1):
        assert ain.push(frame) == []
        index, partial = ain.partial
        assert index * 1280 + len(partial) == n * 320
    chunks = ain.push(fs[3])
    assert [c.index for c in chunks] == [0]
    assert len(ain.partial[1]) == 0
    assert ain.clock == pytest.approx(CHUNK_SECONDS)


def test_gap_in_pts_is_filled_with_silence_and_clock_stays_true():
    pcm = tone(1.0, 48000)
    ain = AudioIn()
    chunks = feed(ain, frames(pcm, 48000, 960, skip={10, 11, 12, 13, 14}))  # 100 ms lost
    # Same chunk count as without loss: the clock counts the missing time.
    assert len(chunks) == 12
    assert [c.index for c in chunks] == list(range(12))
    assert ain.gaps_filled == 1
    assert ain.silence_filled_s == pytest.approx(0.1)
    out = np.concatenate([c.pcm for c in chunks])
    # Frames 0-9 are 200 ms = 3200 samples at 16 kHz behind the resampler's 16-sample lead;
    # then 1600 samples of silence, and the restarted resampler's own 16-sample lead.
    assert np.all(out[3216 + 4 : 4832 - 4] == 0.0)
    assert np.abs(out[3000:3200]).max() > 0.1
    assert np.abs(out[4832 + 32 : 5200]).max() > 0.1
    # The tone after the gap is still the tone (the resampler restarted cleanly).
    assert abs(peak_hz(out[4900:], 16000) - 440) < 3


def test_huge_gap_moves_clock_by_whole_chunks_without_allocating():
    before = REGISTRY.get_sample_value("agent_ingest_dropped_frames_total", {"kind": "audio", "reason": "gap"}) or 0.0
    rate = 48000
    pcm = tone(0.4, rate)
    fs = frames(pcm[: 960 * 10], rate, 960)  # 0.0 - 0.2 s
    # The source resumes at 2.7 s (a 2.5 s hole).
    fs += frames(pcm[: 960 * 10], rate, 960, first_pts=int(2.7 * rate))
    ain = AudioIn(max_gap_s=1.0)
    chunks = feed(ain, fs)
    assert ain.clock_jumps == 1 and ain.gaps_filled == 0
    idx = [c.index for c in chunks]
    # Before the hole: 16 + 3200 samples -> chunks 0, 1 and the part-filled chunk 2 (padded).
    assert idx[:3] == [0, 1, 2]
    # 2.7 s = 43200 samples = chunk 33 + 960; then 16 + 3184 more samples: 33, 34, 35.
    assert idx[3:] == [33, 34, 35]
    for c in chunks:
        assert c.start == pytest.approx(c.index * 0.08)
    assert np.all(chunks[2].pcm[656 + 4 :] == 0.0)
    after = REGISTRY.get_sample_value("agent_ingest_dropped_frames_total", {"kind": "audio", "reason": "gap"})
    assert after - before == 30  # chunks 3..32 never existed
    # 2.7 s + 0.2 s of audio = 2.9 s of source time; the clock is within one chunk of it.
    assert 2.9 - CHUNK_SECONDS <= ain.clock <= 2.9


@pytest.mark.parametrize(
    ("rate", "per_frame", "channels", "fmt"),
    [(44100, 441, 2, "s16"), (44100, 1024, 1, "fltp"), (22050, 441, 1, "s16"), (8000, 160, 1, "s16")],
)
def test_odd_rates_and_formats(rate, per_frame, channels, fmt):
    ain = AudioIn()
    chunks = feed(ain, frames(tone(2.0, rate), rate, per_frame, channels=channels, fmt=fmt))
    seconds = (2 * rate // per_frame) * per_frame / rate
    # Every full chunk the input covers, allowing for the resampler's short delay.
    assert len(chunks) in (int(seconds / 0.08) - 1, int(seconds / 0.08))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert ain.gaps_filled == 0 and ain.resyncs == 0
    pcm = np.concatenate([c.pcm for c in chunks])
    assert abs(peak_hz(pcm, 16000) - 440) < 3


def test_source_format_change_midstream_keeps_clock_contiguous():
    ain = AudioIn()
    chunks = feed(ain, frames(tone(0.5, 48000), 48000, 960))
    # The same stream continues as 16 kHz mono (a passthrough for the resampler).
    chunks += feed(ain, frames(tone(0.5, 16000), 16000, 320, channels=1, first_pts=8000))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert len(chunks) == 12  # 1 s in total, nothing lost at the switch
    assert ain.gaps_filled == 0


def test_frames_without_pts_are_just_appended():
    ain = AudioIn()
    fs = frames(tone(0.48, 48000), 48000, 960)
    for f in fs:
        f.pts = None
    chunks = feed(ain, fs)
    assert [c.index for c in chunks] == list(range(6))  # 0.48 s = 7680 samples, exactly 6
    assert ain.gaps_filled == 0


def test_pts_going_back_resyncs_without_silence():
    ain = AudioIn()
    fs = frames(tone(0.4, 48000), 48000, 960)
    fs += frames(tone(0.4, 48000), 48000, 960)  # pts restart at 0
    chunks = feed(ain, fs)
    assert ain.resyncs == 1 and ain.gaps_filled == 0
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert len(chunks) == 10  # 0.8 s in -> 12800 samples (16 lead, 16 still held) -> 10 chunks
