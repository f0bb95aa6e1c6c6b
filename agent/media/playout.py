"""The agent's voice: an outbound audio track paced to the wall clock.

aiortc's sender does no pacing of its own: it calls ``recv()`` again as soon as the last
frame is encoded, so the track sleeps until ``start + pts / rate`` like aiortc's
AudioStreamTrack. It never waits for audio: when nothing is queued it sends silence, so
RTP timestamps keep advancing with real time and the browser's jitter buffer stays small.

Barge-in pause: ``pause()`` sends silence while holding the queue (nothing is dropped) until
``resume()`` plays on from the same sample, ``flush()`` drops it (the barge-in was confirmed), or
the bound passes and it resumes by itself: a likely interruption silences the agent at once, a
false alarm costs only the pause. Frames held are not sent, so they are not "heard"
(Replies.interrupt, agent/realtime/replies.py, counts heard audio as pushed minus flushed).

All methods run on the asyncio thread; the engine thread hands PCM over with
``loop.call_soon_threadsafe(track.push, pcm)``.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Optional

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.config import OUTPUT_FRAME_SAMPLES, OUTPUT_RATE
from agent.media.echo import PlayoutLevel
from agent.metrics import BARGE_IN_PAUSES, PLAYOUT_BUFFER, PLAYOUT_UNDERRUNS

logger = logging.getLogger(__name__)

TIME_BASE = fractions.Fraction(1, OUTPUT_RATE)
TIME_BASE_48K = fractions.Fraction(1, 2 * OUTPUT_RATE)


class Upsampler2x:
    """Stateful x2 interpolator: windowed-sinc FIR, 47 taps at the output rate (0.5 ms delay).

    Why the track upsamples at all: aiortc's Opus encoder resamples anything that is not
    48 kHz with a filter whose delay makes it emit each packet one frame late (20 ms on
    every reply's first sound); 960-sample 48 kHz frames pass straight through.
    Even output samples are the input samples themselves (the filter's even phase is a unit
    impulse), odd ones are interpolated; streaming in any chunking equals one-shot.
    """

    def __init__(self, half_width: int = 12) -> None:
        n = np.arange(-2 * half_width + 1, 2 * half_width)
        window = np.hanning(len(n) + 2)[1:-1]
        self._taps = np.sinc(n / 2.0) * window
        self._history = np.zeros(len(self._taps) - 1)

    def reset(self) -> None:
        self._history[:] = 0.0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        if not pcm.any() and not self._history.any():
            # Silence in, silence out (between replies, 50 frames a second per call): no filter.
            return np.zeros(2 * len(pcm), dtype=np.int16)
        stuffed = np.zeros(2 * len(pcm))
        stuffed[0::2] = pcm
        signal = np.concatenate([self._history, stuffed])
        out = np.convolve(signal, self._taps, mode="valid")
        self._history = signal[len(signal) - len(self._history) :]
        return np.clip(np.round(out), -32768, 32767).astype(np.int16)


_IDLE = "idle"
_PLAYING = "playing"  # between begin_reply() and end_reply()
_ENDING = "ending"  # end_reply() called, queued audio still playing


class AgentAudioTrack(MediaStreamTrack):
    """20 ms s16 mono 24 kHz frames: queued reply audio, or silence.

    A reply is bracketed by ``begin_reply()`` and ``end_reply()``. Within it:
    ``on_first_audio(wall_time)`` fires when its first frame carrying audio is returned to
    the sender; a frame that runs short of audio after that (the engine fell behind real
    time) counts as an underrun; ``on_drained(wall_time)`` fires once end_reply() was called
    and everything queued has been sent. ``flush()`` (barge-in) drops the queue and ends the
    reply without on_drained. Audio pushed outside a reply plays but fires no hooks.
    Hooks run inside recv(): keep them short, and they must not raise.
    """

    kind = "audio"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        max_buffer_s: float = 30.0,
        stall_s: float = 0.1,
        on_first_audio: Optional[Callable[[float], None]] = None,
        on_drained: Optional[Callable[[float], None]] = None,
        upsample_to_48k: bool = False,
    ) -> None:
        """upsample_to_48k: send 960-sample 48 kHz frames (what the Opus encoder takes
        without delay) instead of 480-sample 24 kHz ones; pacing and push() stay at 24 kHz."""
        super().__init__()
        self._upsampler = Upsampler2x() if upsample_to_48k else None
        self._clock = clock
        self._sleep = sleep
        self._max_samples = int(max_buffer_s * OUTPUT_RATE)
        self._stall_s = stall_s
        self.on_first_audio = on_first_audio
        self.on_drained = on_drained

        self._chunks: deque[np.ndarray] = deque()
        self._head = 0  # samples of _chunks[0] already sent
        self._buffered = 0
        self._reported_s = 0.0  # this track's share of the PLAYOUT_BUFFER gauge

        self._start: Optional[float] = None
        self._pts = 0

        self._reply = _IDLE
        self._first_audio_pending = False
        self._overflowing = False
        self._pause_left: Optional[int] = None  # paused: silent frames still allowed; None: playing

        # The level of what was sent lately: the endpointer's echo guard reads it.
        self.level = PlayoutLevel(clock=clock)
        self._first_audio = asyncio.Event()
        self.early_starts = 0  # frames sent ahead of their slot because a reply began
        self.frames_sent = 0
        self.underruns = 0
        self.reanchors = 0
        self.overflow_s = 0.0

    # -- producer side -----------------------------------------------------------------

    @property
    def buffered_seconds(self) -> float:
        return self._buffered / OUTPUT_RATE

    @property
    def in_reply(self) -> bool:
        return self._reply != _IDLE

    def push(self, pcm: np.ndarray) -> None:
        """Queue int16 mono 24 kHz samples (any length). Past max_buffer_s the excess is dropped."""
        if pcm.dtype != np.int16:
            raise TypeError(f"expected int16 PCM, got {pcm.dtype}")
        if self.readyState != "live":
            return
        pcm = pcm.reshape(-1)
        room = self._max_samples - self._buffered
        if len(pcm) > room:
            # A 30 s backlog means the producer ignores real time; keep what is queued
            # (it plays in order) and drop the newest rather than cut the reply's middle.
            self.overflow_s += (len(pcm) - room) / OUTPUT_RATE
            if not self._overflowing:
                logger.warning("playout buffer full (%.1f s): dropping audio", self.buffered_seconds)
            self._overflowing = True
            pcm = pcm[:room]
        if len(pcm):
            # Copy: the caller may reuse its buffer (code2wav output, a test's array).
            self._chunks.append(pcm.copy())
            self._buffered += len(pcm)
            self._update_gauge()
            if self._first_audio_pending:
                self._first_audio.set()  # a reply's first audio: don't wait out the frame slot

    @property
    def paused(self) -> bool:
        return self._pause_left is not None

    def pause(self, max_s: float) -> None:
        """Send silence and hold what is queued (a possible barge-in), for at most max_s; then
        play resumes by itself. Pausing while paused keeps the first bound."""
        if self._pause_left is None:
            self._pause_left = max(1, round(max_s * OUTPUT_RATE / OUTPUT_FRAME_SAMPLES))

    def resume(self) -> None:
        """Play on from where pause() held (a false alarm); nothing when not paused."""
        if self._pause_left is not None:
            self._pause_left = None
            BARGE_IN_PAUSES.labels(outcome="resumed").inc()

    def flush(self) -> float:
        """Drop everything queued at once (barge-in) and end the reply; return the seconds dropped.
        Ends a pause: the held audio is dropped with the rest."""
        if self._pause_left is not None:
            self._pause_left = None
            BARGE_IN_PAUSES.labels(outcome="flushed").inc()
        dropped = self.buffered_seconds
        self._chunks.clear()
        self._head = 0
        self._buffered = 0
        self._overflowing = False
        self._reply = _IDLE
        self._first_audio_pending = False
        if self._upsampler is not None:
            self._upsampler.reset()  # no ringing of the dropped audio into the silence
        self._update_gauge()
        return dropped

    def begin_reply(self) -> None:
        """A reply starts: arm on_first_audio and underrun counting."""
        self._reply = _PLAYING
        self._first_audio_pending = True

    def end_reply(self) -> None:
        """The producer has pushed the reply's last audio; on_drained fires once it is all sent."""
        if self._reply == _PLAYING:
            self._reply = _ENDING
            if self._buffered == 0:
                self._finish_reply(self._clock())

    def stop(self) -> None:
        self.flush()
        super().stop()

    # -- sender side -------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError

        if self._start is None:
            self._start = self._clock()
            self._pts = 0
        else:
            self._pts += OUTPUT_FRAME_SAMPLES
            wait = self._start + self._pts / OUTPUT_RATE - self._clock()
            if wait < -self._stall_s:
                # The loop stalled: catching up would send a burst the browser's jitter
                # buffer turns into delay. Re-anchor so this frame is due now.
                self._start -= wait
                self.reanchors += 1
                wait = 0.0
            if self._first_audio_pending and not self._buffered and wait > 0 and self._pause_left is None:
                await self._sleep_or_first_audio(wait)
            else:
                await self._sleep(max(wait, 0.0))

        # Read the queue after the sleep, so a flush() or pause() during it silences this frame.
        if self._pause_left is not None:
            pcm, real = np.zeros(OUTPUT_FRAME_SAMPLES, dtype=np.int16), 0
            self._pause_left -= 1
            if self._pause_left == 0:  # the bound: no confirmation came, play on
                self._pause_left = None
                BARGE_IN_PAUSES.labels(outcome="expired").inc()
            now = self._clock()
        else:
            pcm, real = self._take(OUTPUT_FRAME_SAMPLES)
            now = self._clock()
            self._account(real, now)
        if real:
            self.level.record(pcm)

        if self._upsampler is not None:
            pcm = self._upsampler.process(pcm)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        if self._upsampler is not None:
            frame.sample_rate = 2 * OUTPUT_RATE
            frame.pts = 2 * self._pts
            frame.time_base = TIME_BASE_48K
        else:
            frame.sample_rate = OUTPUT_RATE
            frame.pts = self._pts
            frame.time_base = TIME_BASE
        self.frames_sent += 1
        return frame

    async def _sleep_or_first_audio(self, wait: float) -> None:
        """Sleep to the frame's slot, but go at once when a reply's first audio arrives.

        Waiting out the current 20 ms slot would add 10 ms on average to every reply's
        first sound. Going early shifts the schedule (start) so later frames keep their
        20 ms spacing from this one; RTP timestamps still advance by one frame.
        """
        self._first_audio.clear()
        sleep = asyncio.ensure_future(self._sleep(wait))
        woken = asyncio.ensure_future(self._first_audio.wait())
        try:
            await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            woken.cancel()
        assert self._start is not None
        early = self._start + self._pts / OUTPUT_RATE - self._clock()
        if early > 0:
            self._start -= early
            self.early_starts += 1

    def _take(self, n: int) -> tuple[np.ndarray, int]:
        """The next n samples, zero-padded; and how many of them were queued audio."""
        out = np.zeros(n, dtype=np.int16)
        filled = 0
        while filled < n and self._chunks:
            head = self._chunks[0]
            count = min(n - filled, len(head) - self._head)
            out[filled : filled + count] = head[self._head : self._head + count]
            filled += count
            self._head += count
            if self._head == len(head):
                self._chunks.popleft()
                self._head = 0
        if filled:
            self._buffered -= filled
            if self._buffered < self._max_samples:
                self._overflowing = False
            self._update_gauge()
        return out, filled

    def _account(self, real: int, now: float) -> None:
        """Reply bookkeeping for the frame about to be returned."""
        if self._reply == _IDLE:
            return
        if real and self._first_audio_pending:
            self._first_audio_pending = False
            if self.on_first_audio is not None:
                self.on_first_audio(now)
        elif self._reply == _PLAYING and not self._first_audio_pending and real < OUTPUT_FRAME_SAMPLES:
            # Audio has started and the producer has not said it is done, yet the queue
            # ran dry: the listener hears a gap.
            self.underruns += 1
            PLAYOUT_UNDERRUNS.inc()
        if self._reply == _ENDING and self._buffered == 0:
            self._finish_reply(now)

    def _finish_reply(self, now: float) -> None:
        self._reply = _IDLE
        self._first_audio_pending = False
        if self.on_drained is not None:
            self.on_drained(now)

    def _update_gauge(self) -> None:
        seconds = self._buffered / OUTPUT_RATE
        # Deltas, not set(): the gauge is the sum over every session's track.
        PLAYOUT_BUFFER.inc(seconds - self._reported_s)
        self._reported_s = seconds
