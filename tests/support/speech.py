"""Speech for the tests: espeak-ng phrases, and WAV files read, resampled and written.

Samples stay float64 in int16 units from reading to writing (divide by 32768 for [-1, 1]); the
resampling is linear interpolation, plenty for VAD, the echo guard and the tiny model.
"""

from __future__ import annotations

import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest


def espeak(text: str, out: Path, voice: str = "en-us", speed: int = 170) -> Path:
    """Speak `text` into the WAV file `out` (espeak-ng writes 22.05 kHz mono int16)."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is missing: `make test` installs it (apt-get install espeak-ng)")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(out), text], check=True)
    return out


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """A mono int16 WAV file's samples (float64, int16 units) and its rate."""
    with wave.open(str(path)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float64), w.getframerate()


def resample(pcm: np.ndarray, rate: int, to: int) -> np.ndarray:
    """Linear interpolation from `rate` to `to` samples a second (float64)."""
    n = int(len(pcm) * to / rate)
    return np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm)


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> Path:
    """Write mono int16 samples (cast with astype, so int16 units) at `rate`."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(pcm).astype(np.int16).tobytes())
    return path


def espeak_at(text: str, out: Path, rate: int, voice: str = "en-us", speed: int = 170) -> np.ndarray:
    """`text` spoken by espeak-ng (its WAV left at `out`) at `rate`: float64, int16 units."""
    pcm, source = read_wav(espeak(text, out, voice, speed))
    return resample(pcm, source, rate)


def audible(pcm: np.ndarray, floor_db: float = -50.0) -> np.ndarray:
    """`pcm` (in [-1, 1]) trimmed to its audible part: from the first to the last sample above the floor."""
    loud = np.flatnonzero(np.abs(pcm) > 10 ** (floor_db / 20))
    return pcm[loud[0] : loud[-1] + 1]
