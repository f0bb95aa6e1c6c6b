"""Inbound media: microphone audio onto the session's audio clock, camera frames sampled to a few FPS.

Both run on the asyncio thread inside the track readers, so they must stay cheap: audio is
one resample and a copy per 20 ms, and a video frame that is not kept is never converted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import av
import cv2
import numpy as np

from agent.config import INPUT_FRAME_SAMPLES, INPUT_RATE
from agent.media.resample import resampled_length
from agent.metrics import INGEST_DROPPED

logger = logging.getLogger(__name__)

CHUNK_SECONDS = INPUT_FRAME_SAMPLES / INPUT_RATE  # 0.08
MAX_RESAMPLER_DELAY = INPUT_RATE // 200  # 5 ms: more than any swresample filter holds back


@dataclass(frozen=True)
class AudioChunk:
    """80 ms of microphone audio: float32 mono 16 kHz in [-1, 1], exactly 1280 samples."""

    pcm: np.ndarray
    index: int  # chunk number on the session's audio clock
    start: float  # seconds on the session's audio clock (index * 0.08)

    @property
    def end(self) -> float:
        return self.start + CHUNK_SECONDS


class AudioIn:
    """Resample received audio to 16 kHz mono and cut it into 80 ms chunks on the session clock.

    The clock counts samples, not arrival times, so it cannot drift from the audio itself.
    When the source pts jumps forward (packet loss, or the jitter buffer skipped), the gap
    is filled with silence so the clock stays true to wall time; a gap longer than
    ``max_gap_s`` moves the clock forward by whole chunks instead of allocating silence
    (the skipped chunk indices are never emitted: consumers see a jump in ``index``).
    """

    def __init__(self, max_gap_s: float = 1.0) -> None:
        self._max_gap_s = max_gap_s
        self._resampler: Optional[av.AudioResampler] = None
        self._source_key: Optional[tuple[str, str, int]] = None
        self._pending = np.zeros(0, dtype=np.float32)
        self._next_index = 0
        # Where the next source frame should start, in seconds of source time; None before
        # the first frame or when the source carries no pts.
        self._expected: Optional[Fraction] = None
        self.gaps_filled = 0  # gaps (≤ max_gap_s) filled with silence
        self.silence_filled_s = 0.0
        self.clock_jumps = 0  # gaps > max_gap_s that moved the clock by whole chunks
        self.resyncs = 0  # pts went backwards: source restarted, clock just continues

    def close(self) -> None:
        """Free the resampler now. Its FFmpeg filter graph owns a pool of worker threads
        (one per CPU core) that lives exactly as long as the graph."""
        self._resampler = None
        self._source_key = None

    @property
    def clock(self) -> float:
        """Seconds of audio cut so far: the start of the next chunk on the session clock."""
        return self._next_index * CHUNK_SECONDS

    @property
    def partial(self) -> tuple[int, np.ndarray]:
        """The chunk still being filled: its index and the samples it has so far.

        Lets the endpointer decide end of turn on each 20 ms as it arrives instead of
        waiting for the whole 80 ms chunk (up to 60 ms sooner).
        """
        return self._next_index, self._pending

    def push(self, frame: av.AudioFrame) -> list[AudioChunk]:
        """Feed one received frame; return the chunks it completed (often none, sometimes two)."""
        if frame.samples == 0 or frame.sample_rate <= 0:
            return []  # nothing to hear; FFmpeg's resampler fails on an empty frame (ENOMEM)
        chunks: list[AudioChunk] = []
        gap_s = self._gap(frame)
        if gap_s > 0.0:
            # Flush what the resampler holds first so the silence lands after it, in order.
            self._append(self._flush_resampler())
            chunks += self._fill_gap(gap_s)
        self._append(self._resample(frame))
        chunks += self._cut()
        return chunks

    # -- timing ------------------------------------------------------------------------

    def _gap(self, frame: av.AudioFrame) -> float:
        """Seconds of source audio missing before this frame (0 when contiguous or unknown)."""
        if frame.pts is None or frame.time_base is None or frame.sample_rate <= 0:
            self._expected = None
            return 0.0
        start = Fraction(frame.pts) * Fraction(frame.time_base.numerator, frame.time_base.denominator)
        duration = Fraction(frame.samples, frame.sample_rate)
        expected, self._expected = self._expected, start + duration
        if expected is None:
            return 0.0
        delta = start - expected
        # Tolerate rounding of pts (RTP clocks vs time_base): half a frame either way.
        if abs(delta) <= duration / 2:
            return 0.0
        if delta < 0:
            self.resyncs += 1
            logger.info("audio pts went back %.3f s: resync", float(-delta))
            return 0.0
        return float(delta)

    def _fill_gap(self, gap_s: float) -> list[AudioChunk]:
        gap = round(gap_s * INPUT_RATE)
        if gap_s <= self._max_gap_s:
            self.gaps_filled += 1
            self.silence_filled_s += gap / INPUT_RATE
            self._append(np.zeros(gap, dtype=np.float32))
            return self._cut()
        # Too long to materialise: complete the chunk in progress with silence, then move
        # the clock to where the source now is, keeping only the sub-chunk remainder.
        chunks: list[AudioChunk] = []
        position = self._next_index * INPUT_FRAME_SAMPLES + len(self._pending) + gap
        if len(self._pending):
            self._append(np.zeros(INPUT_FRAME_SAMPLES - len(self._pending), dtype=np.float32))
            chunks += self._cut()
        new_index, remainder = divmod(position, INPUT_FRAME_SAMPLES)
        skipped = new_index - self._next_index
        self.clock_jumps += 1
        INGEST_DROPPED.labels(kind="audio", reason="gap").inc(skipped)
        logger.warning("audio gap of %.2f s: clock skips %d chunks", gap_s, skipped)
        self._next_index = new_index
        self._pending = np.zeros(remainder, dtype=np.float32)
        return chunks

    # -- samples -----------------------------------------------------------------------

    def _resample(self, frame: av.AudioFrame) -> np.ndarray:
        key = (frame.format.name, frame.layout.name, frame.sample_rate)
        if key != self._source_key:
            # PyAV's resampler refuses a frame whose format differs from its first one;
            # drain the old one (its last few ms) and start a new one for the new source.
            tail = self._flush_resampler()
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=INPUT_RATE)
            self._source_key = key
            out = self._to_float(self._resampler.resample(frame))
            # The filter holds back a few samples (16 of the first 20 ms from 48 kHz). Put that
            # delay in front as silence, once per resampler: otherwise every 20 ms sub-frame is
            # completed only by the *next* frame, and each end-of-turn, onset and barge-in
            # decision waits 20 ms for audio that has in fact arrived.
            held = resampled_length(frame.samples, frame.sample_rate, INPUT_RATE) - len(out)
            lead = np.zeros(held if 0 < held <= MAX_RESAMPLER_DELAY else 0, dtype=np.float32)
            return np.concatenate([tail, lead, out])
        assert self._resampler is not None
        return self._to_float(self._resampler.resample(frame))

    def _flush_resampler(self) -> np.ndarray:
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        tail = self._to_float(self._resampler.resample(None))
        # A flushed filter graph is finished: the next frame needs a fresh resampler.
        self._resampler = None
        self._source_key = None
        return tail

    @staticmethod
    def _to_float(frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return np.zeros(0, dtype=np.float32)
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
        return pcm.astype(np.float32) / 32768.0

    def _append(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self._pending = np.concatenate([self._pending, pcm])

    def _cut(self) -> list[AudioChunk]:
        chunks: list[AudioChunk] = []
        while len(self._pending) >= INPUT_FRAME_SAMPLES:
            pcm = self._pending[:INPUT_FRAME_SAMPLES].copy()
            self._pending = self._pending[INPUT_FRAME_SAMPLES:]
            index = self._next_index
            chunks.append(AudioChunk(pcm=pcm, index=index, start=index * CHUNK_SECONDS))
            self._next_index += 1
        return chunks


@dataclass(frozen=True)
class VideoSample:
    """One kept camera frame, converted and resized for the vision encoder."""

    image: np.ndarray  # RGB uint8, H x W x 3, longer side <= max_side
    pts_s: float  # source time of the frame (seconds)
    audio_clock: float  # the session's audio clock when the frame was taken
    source_size: tuple[int, int]  # (width, height) as received


class VideoSampler:
    """Keep a frame each time its pts crosses the next 1/fps mark; drop the rest unconverted.

    Marks advance by exactly 1/fps, so the kept rate does not drift with the input rate.
    A frame within half an input interval before the mark counts as on it, so jittered
    input keeps the frame nearest each mark and the output stays evenly spaced. After a gap
    (the mark fell more than one period behind) the marks are re-anchored on the new frame
    rather than catching up in a burst.
    """

    def __init__(self, fps: float = 4.0, max_side: int = 448, max_source_height: int = 1080) -> None:
        assert fps > 0 and max_side > 0 and max_source_height > 0
        self._period = 1.0 / fps
        self._max_side = max_side
        self._max_source_height = max_source_height
        self._next_mark: Optional[float] = None
        self._last_t: Optional[float] = None
        self._interval = 0.0  # recent input frame interval (EMA), for the mark tolerance
        self._rate_drops = INGEST_DROPPED.labels(kind="video", reason="rate")
        self.kept = 0
        self.dropped = 0
        self.reanchors = 0

    def push(self, frame: av.VideoFrame, audio_clock: float) -> Optional[VideoSample]:
        """Return a VideoSample when this frame is kept, None when it is dropped."""
        # Without pts (never the case for aiortc tracks) the audio clock is the only time.
        t = frame.time if frame.time is not None else audio_clock
        if not self._keep(t):
            self.dropped += 1
            self._rate_drops.inc()
            return None
        self.kept += 1
        return VideoSample(
            image=self._convert(frame),
            pts_s=t,
            audio_clock=audio_clock,
            source_size=(frame.width, frame.height),
        )

    def _keep(self, t: float) -> bool:
        last, self._last_t = self._last_t, t
        if last is not None and 0.0 < t - last < self._period:
            dt = t - last
            self._interval = dt if self._interval == 0.0 else 0.8 * self._interval + 0.2 * dt
        if self._next_mark is None or (last is not None and t < last - self._period):
            # First frame, or the source clock went backwards (stream restarted).
            return self._anchor(t, first=self._next_mark is None)
        tolerance = min(self._interval / 2, self._period / 4)
        if t < self._next_mark - tolerance:
            return False
        self._next_mark += self._period
        if t >= self._next_mark - tolerance:
            # A gap: the next mark is already due. Start the grid again from this frame.
            return self._anchor(t, first=False)
        return True

    def _anchor(self, t: float, first: bool) -> bool:
        if not first:
            self.reanchors += 1
        self._next_mark = t + self._period
        return True

    def _convert(self, frame: av.VideoFrame) -> np.ndarray:
        width, height = frame.width, frame.height
        # Cap at 1080p on the shorter side (portrait phones send 1080x1920): the one scale
        # swscale does while converting to RGB anyway, so a 4K frame is never converted at full size.
        short = min(width, height)
        if short > self._max_source_height:
            scale = self._max_source_height / short
            width, height = max(1, round(width * scale)), max(1, round(height * scale))
            rgb = frame.to_ndarray(format="rgb24", width=width, height=height, interpolation="AREA", threads=1)
        else:
            # One thread: PyAV keeps a scaler per calling thread, and with threads=0 (its default)
            # each holds a pool of native threads for good; a frame of the camera is small work.
            rgb = frame.to_ndarray(format="rgb24", threads=1)
        longer = max(width, height)
        if longer <= self._max_side:
            return np.ascontiguousarray(rgb)
        # The longer side becomes exactly max_side; the other keeps the aspect (rounded).
        if width >= height:
            size = (self._max_side, max(1, round(height * self._max_side / width)))
        else:
            size = (max(1, round(width * self._max_side / height)), self._max_side)
        return cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
