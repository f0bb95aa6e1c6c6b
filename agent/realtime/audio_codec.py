"""The WebSocket's input audio formats: 24 kHz pcm16, and G.711 µ-law / A-law at 8 kHz.

Decoded into av.AudioFrames for the session's AudioIn (which resamples to the model's 16 kHz).
Frames carry no pts: WebSocket audio has no timestamps, so it is contiguous by definition.
"""

from __future__ import annotations

import av
import numpy as np

from agent.config import INPUT_RATE
from agent.media.resample import resample

RATES = {"audio/pcm": 24_000, "audio/pcmu": 8_000, "audio/pcma": 8_000}


def _ulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << np.maximum(seg - 1, 0)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ULAW, _ALAW = _ulaw_table(), _alaw_table()


def to_pcm16(fmt: str, data: bytes) -> np.ndarray:
    """int16 mono samples at RATES[fmt]."""
    if fmt == "audio/pcmu":
        return _ULAW[np.frombuffer(data, dtype=np.uint8)]
    if fmt == "audio/pcma":
        return _ALAW[np.frombuffer(data, dtype=np.uint8)]
    return np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.int16)


def to_frame(fmt: str, data: bytes) -> av.AudioFrame:
    pcm = to_pcm16(fmt, data)
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = RATES[fmt]
    return frame


def to_16k(fmt: str, data: bytes) -> np.ndarray:
    """float32 mono 16 kHz in [-1, 1]: a whole audio item, resampled at once with a low-pass
    (agent/media/resample.py: nothing above 8 kHz folds back into the voice band), exactly
    round(len * 16000 / rate) samples."""
    pcm = to_pcm16(fmt, data).astype(np.float32) / 32768.0
    return resample(pcm, RATES[fmt], INPUT_RATE)
