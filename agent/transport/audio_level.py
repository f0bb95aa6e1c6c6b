"""The RFC 6465 audio level of outbound frames, in numpy instead of aiortc's Python loop.

aiortc's RTCRtpSender computes the level of every audio frame it sends (the RTP header
extension browsers read for "who is speaking") with `aiortc.rtp.compute_audio_level_dbov`, a
Python loop over the frame's samples: 960 per 20 ms frame at 48 kHz, 50 frames a second per
call. Profiled under four calls (scripts/bench_rtc.py, py-spy --gil) it was the largest single
item on the asyncio thread, about a tenth of that thread's time holding the GIL, which the
engine thread then waits for. `install()` puts the same computation, vectorized, in its place:
the same integer for every frame (tests/unit/test_audio_level.py), at a small fraction of the cost.
"""

from __future__ import annotations

import math

import av
import numpy as np
from aiortc.rtp import compute_audio_level_dbov as aiortc_audio_level  # noqa: F401  (the library's, for tests)

MAX_SAMPLE_VALUE = 32767
MIN_AUDIO_LEVEL = -127
MAX_AUDIO_LEVEL = 0


def audio_level_dbov(frame: av.AudioFrame) -> int:
    """RFC 6465 Appendix A, as aiortc computes it: over the first plane's s16 samples, divided
    by the frame's sample count (interleaved stereo counts twice in the sum, once in the count,
    exactly as aiortc does)."""
    samples = np.frombuffer(bytes(frame.planes[0]), dtype=np.int16).astype(np.float64)
    energy = float(np.dot(samples, samples))
    rms = math.sqrt(energy / (frame.samples * MAX_SAMPLE_VALUE * MAX_SAMPLE_VALUE))
    if rms > 0:
        db = min(max(20 * math.log10(rms), MIN_AUDIO_LEVEL), MAX_AUDIO_LEVEL)
    else:
        db = MIN_AUDIO_LEVEL
    return round(db)


def install() -> None:
    """Route aiortc's senders to audio_level_dbov (they look the function up on aiortc.rtp at
    every frame). Idempotent."""
    from aiortc import rtp

    rtp.compute_audio_level_dbov = audio_level_dbov
