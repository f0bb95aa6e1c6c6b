"""Voice detectors: is this 20 ms of 16 kHz audio speech? Two interchangeable models.

- ``silero`` (the default): Silero VAD, a small recurrent network, run with onnxruntime on one
  thread. It reads 32 ms windows (512 samples plus 64 of context), so each 20 ms sub-frame is
  judged by the newest window that ends inside it, and windows are fed exactly once, in order
  (the network keeps state). Voiced from ``threshold`` up, unvoiced again only below
  ``threshold - 0.15`` (Silero's own hysteresis), so a word's quiet consonants do not flicker.
- ``webrtc``: webrtcvad (GMM over sub-band energies), nearly level-blind and fooled by music
  and babble; kept as an option (``--vad webrtc``).

scripts/bench_vad.py compares them on speech over noise, babble and music
(bench/results/vad-*.txt): Silero starts far fewer false turns at a fraction of a millisecond
per 20 ms here, which is why it is the default.

Each detector is stateful and belongs to one endpointer (one session): feed every sub-frame
once, in order.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Protocol

import numpy as np
import webrtcvad

from agent.config import INPUT_RATE

SUBFRAME_SAMPLES = INPUT_RATE * 20 // 1000  # 320
VAD_KINDS = ("silero", "webrtc")


class VoiceDetector(Protocol):
    name: str

    def voiced(self, sub: np.ndarray) -> bool:
        """sub: int16 mono 16 kHz, exactly 320 samples (20 ms)."""


class WebrtcDetector:
    name = "webrtc"

    def __init__(self, aggressiveness: int = 2) -> None:
        self._vad = webrtcvad.Vad(aggressiveness)

    def voiced(self, sub: np.ndarray) -> bool:
        return self._vad.is_speech(sub.tobytes(), INPUT_RATE)


_WINDOW = 512  # Silero at 16 kHz: exactly 512 new samples per call ...
_CONTEXT = 64  # ... behind the last 64 samples of the previous window
_HYSTERESIS = 0.15


def silero_model_path() -> Path:
    """The ONNX model shipped inside the `silero-vad` wheel, found without importing the package
    (its Python code imports torch; only the model file is needed here)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero VAD needs the `silero-vad` package (pip install --no-deps silero-vad)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise RuntimeError(f"silero-vad is installed but has no model at {path}")
    return path


@functools.lru_cache(maxsize=None)
def _inference_session(path: str):  # type: ignore[no-untyped-def]
    """One onnxruntime session per model file for the whole process: it is read-only and
    thread-safe (each detector passes its own state), and loading costs ~40 ms, too much to
    pay on the event loop for every call."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # One thread: the detector runs on the asyncio thread, and a thread pool per call would
    # fight the engine thread for the cores.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


class SileroDetector:
    name = "silero"

    def __init__(self, threshold: float = 0.5) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError("silero threshold must be in (0, 1)")
        self._session = _inference_session(str(silero_model_path()))
        self.threshold = threshold
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._sr = np.array(INPUT_RATE, dtype=np.int64)
        self._context = np.zeros(_CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._speech = False
        self.probability = 0.0  # of the newest window
        self.windows = 0

    def voiced(self, sub: np.ndarray) -> bool:
        self._pending = np.concatenate([self._pending, sub.astype(np.float32) / 32768.0])
        while len(self._pending) >= _WINDOW:
            window, self._pending = self._pending[:_WINDOW], self._pending[_WINDOW:]
            x = np.concatenate([self._context, window])[None, :]
            out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
            self._context = window[-_CONTEXT:]
            self.probability = float(out[0, 0])
            self.windows += 1
            if self.probability >= self.threshold:
                self._speech = True
            elif self.probability < self.threshold - _HYSTERESIS:
                self._speech = False
        return self._speech


def make_detector(kind: str, aggressiveness: int = 2, threshold: float = 0.5) -> VoiceDetector:
    """kind: "silero" or "webrtc" (aggressiveness is webrtcvad's mode, threshold Silero's)."""
    if kind == "silero":
        return SileroDetector(threshold)
    if kind == "webrtc":
        return WebrtcDetector(aggressiveness)
    raise ValueError(f"unknown VAD {kind!r}: one of {', '.join(VAD_KINDS)}")
