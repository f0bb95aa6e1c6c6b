"""Resampling a whole buffer of mono audio at once, with a low-pass: FFmpeg's swresample via PyAV.

Linear interpolation (np.interp) has no anti-aliasing filter: downsampling 24 kHz to 16 kHz
folds a 10 kHz tone back to 6 kHz, where the model hears it as part of the voice. swresample's
windowed-sinc filter removes what lies above the lower Nyquist frequency before decimating
(the live path, agent/media/ingest.py, resamples with the same filter, frame by frame).

Two things a one-shot use of PyAV's resampler gets wrong unless handled here:
- its flush (`resample(None)`) does not return the whole tail: below ~30-90 input samples
  nothing comes out at all, and longer buffers can come out a few samples short. So the input
  gets 10 ms of zeros appended (the filter's reach is far shorter) and the output is cut to
  length;
- the output length is exactly round(len * dst / src) (half up), as FFmpeg counts it, and the
  output is time-aligned with the input (swresample compensates its filter's delay: an
  impulse at input sample i comes out at i * dst / src), so nothing shifts by the delay.
"""

from __future__ import annotations

import av
import numpy as np


def resampled_length(n: int, src_rate: int, dst_rate: int) -> int:
    """Samples `n` input samples make at dst_rate: round(n * dst / src), halves up."""
    return (n * dst_rate + src_rate // 2) // src_rate


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """float32 mono samples (in [-1, 1]) at src_rate -> float32 at dst_rate, low-passed,
    resampled_length(len(samples), src_rate, dst_rate) of them, time-aligned with the input."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    if src_rate == dst_rate:
        return x.copy()
    n_out = resampled_length(len(x), src_rate, dst_rate)
    if n_out == 0:
        return np.zeros(0, dtype=np.float32)
    # Float in and out: a filtered full-scale signal overshoots a little, and s16 would clip it.
    padded = np.concatenate([x, np.zeros(max(64, src_rate // 100), dtype=np.float32)])
    frame = av.AudioFrame.from_ndarray(padded.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = src_rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=dst_rate)
    chunks = [f.to_ndarray().reshape(-1) for f in (*resampler.resample(frame), *resampler.resample(None))]
    del resampler  # its filter graph holds worker threads: free them now, not at a later GC
    out = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    if len(out) < n_out:  # not seen with the padding above; a shorter output must not shrink the item
        out = np.concatenate([out, np.zeros(n_out - len(out), dtype=np.float32)])
    return out[:n_out].astype(np.float32, copy=False)
