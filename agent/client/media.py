"""The client's media: what it sends (a WAV or a media source, a camera or a test pattern,
throttled on the server's request) and where the agent's voice goes (a WAV file, a speaker).

Used by agent/client/client.py (tests, benchmarks) and by `omni-agent call` (agent/client/call.py).
aiortc's RTCRtpSender has no setParameters, so a throttle event is applied at the source:
ThrottledVideoTrack drops frames down to the asked rate, scales them down, or sends none.
"""

from __future__ import annotations

import asyncio
import fractions
import threading
import time
import wave
from collections import deque
from pathlib import Path
from typing import Any, Optional

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.media.resample import resample

SEND_RATE = 48_000
SEND_FRAME = 960  # 20 ms


def load_wav_mono(path: Path, rate: int = SEND_RATE) -> np.ndarray:
    """int16 mono at `rate`, resampled with a low-pass (agent/media/resample.py): a 44.1 kHz WAV
    sent as 16 kHz must not alias, since the agent would hear the folded highs as voice."""
    with wave.open(str(path)) as w:
        src_rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32)
    pcm = pcm.reshape(-1, channels).mean(axis=1) / 32768.0
    out = resample(pcm, src_rate, rate) * 32768.0
    return np.clip(np.rint(out), -32768, 32767).astype(np.int16)


def speech_end_sample(pcm: np.ndarray, rate: int = SEND_RATE, threshold_db: float = -40.0) -> int:
    """Index just past the last 10 ms window louder than threshold_db."""
    win = rate // 100
    n = len(pcm) // win
    rms = np.sqrt((pcm[: n * win].astype(np.float64).reshape(n, win) ** 2).mean(axis=1))
    loud = np.nonzero(rms > 10 ** (threshold_db / 20) * 32768)[0]
    return int((loud[-1] + 1) * win) if len(loud) else 0


class PacedAudioTrack(MediaStreamTrack):
    """A microphone-like track: 20 ms s16 mono frames at SEND_RATE, paced to the wall clock
    (pts = samples sent). Subclasses say what each frame holds (`chunk`)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._start: Optional[float] = None
        self._pts = 0

    def chunk(self, now: float) -> np.ndarray:
        """The next SEND_FRAME samples (int16), sent at wall time `now`."""
        raise NotImplementedError

    async def recv(self) -> av.AudioFrame:
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._pts / SEND_RATE - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        frame = av.AudioFrame.from_ndarray(self.chunk(time.monotonic()).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = SEND_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, SEND_RATE)
        self._pts += SEND_FRAME
        return frame


class WavTrack(PacedAudioTrack):
    """Plays pcm once (then silence forever), paced to the wall clock like a microphone."""

    def __init__(
        self, pcm: np.ndarray, repeat_after_s: Optional[float] = None, speech_end: Optional[int] = None
    ) -> None:
        super().__init__()
        self._pcm = pcm
        self._speech_end = speech_end_sample(pcm) if speech_end is None else speech_end
        self.speech_ends: list[float] = []  # wall time the speech ended, one per play
        self._pos = 0
        self._repeat_after = repeat_after_s
        self.plays = 0

    def play(self) -> None:
        """Speak the WAV again from its start, now (e.g. over the agent: barge-in)."""
        self._pos = 0
        self.plays += 1

    def chunk(self, now: float) -> np.ndarray:
        chunk = self._pcm[self._pos : self._pos + SEND_FRAME]
        if len(chunk) and self._pos < len(self._pcm):
            last = self._speech_end - 1
            if self._pos <= last < self._pos + SEND_FRAME:
                # The frame holding the last speech sample leaves now; speech ends inside it.
                self.speech_ends.append(now + (last - self._pos) / SEND_RATE)
        self._pos += SEND_FRAME
        if len(chunk) < SEND_FRAME:
            chunk = np.concatenate([chunk, np.zeros(SEND_FRAME - len(chunk), np.int16)])
        if self._repeat_after is not None and self._pos >= len(self._pcm) + self._repeat_after * SEND_RATE:
            self.play()
        return chunk


class PatternVideoTrack(MediaStreamTrack):
    """A moving colour pattern, like a camera, at `fps`."""

    kind = "video"

    def __init__(self, width: int = 320, height: int = 240, fps: int = 10) -> None:
        super().__init__()
        self._w, self._h, self._fps = width, height, fps
        self._n = 0
        self._start: Optional[float] = None

    async def recv(self) -> av.VideoFrame:
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._n / self._fps - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        x = np.arange(self._w, dtype=np.uint16)[None, :]
        y = np.arange(self._h, dtype=np.uint16)[:, None]
        img = np.stack(
            [(x + 4 * self._n) % 256 + 0 * y, (y + 2 * self._n) % 256 + 0 * x, ((x + y) // 2) % 256], axis=-1
        ).astype(np.uint8)
        # In the encoder's own format: aiortc would convert an RGB frame in whichever executor
        # thread encodes it, and PyAV (18.1.1) keeps a scaler per calling thread, with a pool of
        # native threads each (threads=0, auto) that lives as long as that thread.
        frame = av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p", threads=1)
        frame.pts = int(self._n * 90_000 / self._fps)
        frame.time_base = fractions.Fraction(1, 90_000)
        self._n += 1
        return frame


class LoopedVideoFile(MediaStreamTrack):
    """A video file played over and over like a camera: frames at the file's own rate, paced
    to the wall clock across every pass, with pts that keep rising.

    Not aiortc's MediaPlayer(loop=True): it paces a file by the file's timestamps, which
    restart at every pass, so from the second pass on its thread decodes as fast as the CPU
    allows into an unbounded queue, and each frame it posts writes to the event loop's wake-up
    pipe. A full pipe drops signals: Ctrl-C was lost that way (the call never hung up).
    Frames are decoded on an executor thread, one per recv: decoding is never ahead of use.
    """

    kind = "video"
    CLOCK = 90_000

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._container = av.open(str(path))
        if not self._container.streams.video:
            self._container.close()
            raise ValueError(f"no video stream in {path}")
        self._stream = self._container.streams.video[0]
        rate = self._stream.average_rate or self._stream.guessed_rate or 15
        self.period = 1 / float(rate)
        self._frames = self._container.decode(self._stream)
        self._lock = threading.Lock()  # decode (executor) vs close (stop, on the loop)
        self._closed = False
        self._n = 0  # frames sent
        self._start: Optional[float] = None
        self.passes = 1  # times the file was started

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._n * self.period - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        frame = await asyncio.get_running_loop().run_in_executor(None, self._decode_next)
        frame.pts, frame.time_base = round(self._n * self.period * self.CLOCK), fractions.Fraction(1, self.CLOCK)
        self._n += 1
        return frame

    def _decode_next(self) -> av.VideoFrame:
        with self._lock:
            for _ in range(2):  # the rest of this pass, else the start of the next
                if self._closed:
                    raise MediaStreamError
                try:
                    return next(self._frames)
                except StopIteration:
                    self._container.seek(0)
                    self._frames = self._container.decode(self._stream)
                    self.passes += 1
            raise MediaStreamError  # a file whose every pass is empty

    def stop(self) -> None:
        super().stop()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._container.close()


class ThrottledVideoTrack(MediaStreamTrack):
    """A video source as the agent asked for it: `input_video.throttle` events (max_fps,
    scale_resolution_down_by, paused) take effect on the next frame. While paused, source
    frames are read and dropped (a live camera must be drained) and none is sent."""

    kind = "video"

    def __init__(self, source: MediaStreamTrack, max_fps: Optional[float] = None) -> None:
        super().__init__()
        self._source = source
        self._base_fps = max_fps
        self.max_fps: Optional[float] = max_fps
        self.scale = 1.0
        self.paused = False
        self._last_sent: Optional[float] = None  # wall time of the last frame sent
        self._start: Optional[float] = None
        self.sent_at: deque[float] = deque(maxlen=512)  # wall time of each frame sent
        self.throttles: list[dict[str, Any]] = []  # the events applied, in order

    def apply(self, event: dict[str, Any]) -> None:
        """Obey an input_video.throttle event; bad fields leave that setting as it was."""
        self.throttles.append(event)
        fps = event.get("max_fps")
        if isinstance(fps, (int, float)) and fps > 0:
            self.max_fps = float(fps) if self._base_fps is None else min(float(fps), self._base_fps)
        scale = event.get("scale_resolution_down_by")
        if isinstance(scale, (int, float)) and scale >= 1:
            self.scale = float(scale)
        self.paused = bool(event.get("paused", False))

    def fps(self, window_s: float = 2.0) -> float:
        """Frames sent per second over the last window_s seconds."""
        now = time.monotonic()
        return sum(1 for t in self.sent_at if now - t <= window_s) / window_s

    async def recv(self) -> av.VideoFrame:
        # Sources are live or paced to real time (a camera, LoopedVideoFile), so the arrival
        # time is the frame's time. The pts is restamped from it: a looping file's pts
        # jumps back at every loop, and the VP8 encoder refuses a pts that goes backwards.
        while True:
            frame = await self._source.recv()
            now = time.monotonic()
            if self.paused:
                continue
            # A little slack (10 %) so a source at exactly max_fps is not halved by jitter.
            if self.max_fps and self._last_sent is not None and now - self._last_sent < 0.9 / self.max_fps:
                continue
            self._last_sent = now
            if self._start is None:
                self._start = now
            if self.scale > 1:
                frame = _scaled(frame, self.scale)
            frame.pts, frame.time_base = round((now - self._start) * 90_000), fractions.Fraction(1, 90_000)
            self.sent_at.append(now)
            return frame

    def stop(self) -> None:
        super().stop()
        self._source.stop()


def _scaled(frame: av.VideoFrame, scale: float) -> av.VideoFrame:
    width = max(2, int(frame.width / scale) // 2 * 2)  # even: the encoder's 4:2:0 wants it
    height = max(2, int(frame.height / scale) // 2 * 2)
    return frame.reformat(width=width, height=height, threads=1)


class SilenceAfterEnd(MediaStreamTrack):
    """An audio source (e.g. a file through aiortc's MediaPlayer) followed by silence forever:
    the agent only ends a turn after hearing silence, and a file that stops sending is heard as
    nothing at all. The silence has the source's own format, layout and rate (the encoder's
    resampler accepts no change mid-stream), in 20 ms frames paced to the wall clock, its pts
    continuing the source's."""

    kind = "audio"

    def __init__(self, source: MediaStreamTrack) -> None:
        super().__init__()
        self._source: Optional[MediaStreamTrack] = source
        self._shape = ("s16", "mono", SEND_RATE)  # format, layout, rate of the source
        self._pts = 0
        self._time_base = fractions.Fraction(1, SEND_RATE)
        self._next: Optional[float] = None
        self.ended_at: Optional[float] = None  # wall time the source ended

    async def recv(self) -> av.AudioFrame:
        if self._source is not None:
            try:
                frame = await self._source.recv()
                self._shape = (frame.format.name, frame.layout.name, frame.sample_rate)
                if frame.pts is not None and frame.time_base is not None:
                    self._time_base = frame.time_base
                    self._pts = frame.pts + int(frame.samples / frame.sample_rate / frame.time_base)
                return frame
            except MediaStreamError:
                self._source = None
                self.ended_at = self._next = time.monotonic()
        assert self._next is not None
        wait = self._next - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._next += 0.02
        frame = _silence(*self._shape)
        frame.pts, frame.time_base = self._pts, self._time_base
        self._pts += int(frame.samples / frame.sample_rate / self._time_base)
        return frame

    def stop(self) -> None:
        super().stop()
        if self._source is not None:
            self._source.stop()


def _silence(fmt: str, layout: str, rate: int) -> av.AudioFrame:
    """20 ms of silence in exactly this sample format, layout and rate."""
    samples = rate // 50
    channels = len(av.AudioLayout(layout).channels)
    dtype = {"s16": np.int16, "s32": np.int32, "flt": np.float32, "dbl": np.float64, "u8": np.uint8}[fmt.rstrip("p")]
    planar = fmt.endswith("p")
    pcm = np.zeros((channels, samples) if planar else (1, samples * channels), dtype)
    if dtype is np.uint8:
        pcm += 128
    frame = av.AudioFrame.from_ndarray(pcm, format=fmt, layout=layout)
    frame.sample_rate = rate
    return frame


class WavSink:
    """Writes received audio frames to a WAV file (int16 at the frames' rate and channels).
    The header is rewritten on close, so a run stopped with Ctrl-C leaves a valid file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._wav: Optional[wave.Wave_write] = None
        self.samples = 0
        self.peak = 0

    def write(self, frame: av.AudioFrame) -> None:
        pcm = frame.to_ndarray()
        if pcm.dtype != np.int16:  # aiortc decodes Opus to s16; anything else is converted
            frame = av.AudioResampler(format="s16", layout=frame.layout.name, rate=frame.sample_rate).resample(frame)[0]
            pcm = frame.to_ndarray()
        channels = len(frame.layout.channels)
        if self._wav is None:
            self._wav = wave.open(str(self.path), "wb")
            self._wav.setnchannels(channels)
            self._wav.setsampwidth(2)
            self._wav.setframerate(frame.sample_rate)
        self._wav.writeframes(pcm.astype("<i2").tobytes())
        self.samples += frame.samples
        if pcm.size:
            self.peak = max(self.peak, int(np.abs(pcm.astype(np.int32)).max()))

    def close(self) -> None:
        if self._wav is not None:
            self._wav.close()
            self._wav = None


class DeviceSink:
    """Plays received audio on a sound device through FFmpeg's output devices (PyAV):
    e.g. format "pulse" (device "default") or "alsa" (device "default" or "hw:0")."""

    def __init__(self, device: str, fmt: str) -> None:
        self._container = av.open(device, mode="w", format=fmt)
        self._stream: Any = None

    def write(self, frame: av.AudioFrame) -> None:
        if self._stream is None:
            self._stream = self._container.add_stream("pcm_s16le", rate=frame.sample_rate, layout=frame.layout.name)
        frame.pts = None  # the device paces itself
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        try:
            self._container.close()
        except Exception:  # a device that went away: nothing left to flush
            pass
