"""Smart Turn v3.2 as the sessions' completeness judge (agent/media/semantic_turn.py).

The model (agent/media/turn_model.py) reads the last 8 s of a turn as Whisper's 80-bin log-mel
features (left-padded with silence) and answers P(complete). One inference is ~10-60 ms of one
core: on the event loop it would stall every session's media, so it runs on one worker thread
that every session shares, one onnxruntime thread, so a burst of pauses queues instead of
taking the cores the engine and the loop need. A failed inference answers nothing: the pause
then waits for the long silence, as without a judge.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from agent import metrics
from agent.config import INPUT_RATE
from agent.media.semantic_turn import MAX_AUDIO_S

log = logging.getLogger(__name__)

SAMPLES = int(MAX_AUDIO_S * INPUT_RATE)


class SmartTurn:
    """The ONNX model and its feature extractor; probability() runs in the caller's thread."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort
        from transformers import WhisperFeatureExtractor

        options = ort.SessionOptions()
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        # The features Smart Turn was trained on: Whisper's, over an 8 s window.
        self._features = WhisperFeatureExtractor(
            feature_size=80, sampling_rate=INPUT_RATE, hop_length=160, chunk_length=int(MAX_AUDIO_S), n_fft=400
        )

    def probability(self, audio: np.ndarray) -> float:
        """P(the utterance in `audio`, 16 kHz float, is complete), from its last 8 s."""
        audio = audio[-SAMPLES:]
        if len(audio) < SAMPLES:  # silence before it, as the model was trained
            audio = np.concatenate([np.zeros(SAMPLES - len(audio), np.float32), audio])
        features = self._features(
            audio.astype(np.float32), sampling_rate=INPUT_RATE, return_tensors="np", do_normalize=True
        ).input_features
        (out,) = self._session.run(None, {"input_features": features.astype(np.float32)})
        return float(np.asarray(out).reshape(-1)[0])


class _Asked:
    """A question in flight on the worker (a Pending)."""

    def __init__(self, future: "Future[float]") -> None:
        self._future = future

    def probability_at(self, t: float) -> Optional[float]:
        # Live audio arrives in real time, so an answer that is in is in by now.
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()


class SmartTurnJudge:
    """The shared judge: questions from every session, answered in order on one thread. The
    model loads on that thread too (about a second: onnxruntime and the feature extractor), so
    the agent starts without waiting for it and the first questions queue behind the load."""

    def __init__(self, path: Path) -> None:
        self._model: Optional[SmartTurn] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="turn-judge")
        self.loaded = self._pool.submit(self._load, path)

    def _load(self, path: Path) -> None:
        from agent.media.turn_model import present

        if not present(path):
            raise RuntimeError(f"{path} is not the published Smart Turn v3.2 file")
        self._model = SmartTurn(path)

    def ask(self, audio: np.ndarray, at: float) -> _Asked:
        return _Asked(self._pool.submit(self._judge, audio))

    def _judge(self, audio: np.ndarray) -> float:
        started = time.perf_counter()
        try:
            if self._model is None:
                raise RuntimeError("the end-of-turn model did not load")
            p = self._model.probability(audio)
        except Exception:
            log.exception("end-of-turn judge failed; the pause waits for the long silence")
            metrics.TURN_JUDGMENTS.labels("failed").inc()
            raise
        metrics.TURN_JUDGE_SECONDS.observe(time.perf_counter() - started)
        metrics.TURN_JUDGMENTS.labels("complete" if p >= 0.5 else "incomplete").inc()
        return p

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_judge(path: Path) -> Optional[SmartTurnJudge]:
    """The judge for the model at `path`, loading in the background; None (logged) when there
    is no such file, and semantic_vad then ends turns by silence alone. A file that does not
    load answers no question (logged once): every pause then waits for the long silence."""
    if not path.is_file():
        log.warning(
            "no end-of-turn model at %s (omni-agent fetch-turn-model): semantic_vad ends turns by silence alone", path
        )
        return None
    judge = SmartTurnJudge(path)
    judge.loaded.add_done_callback(
        lambda f: f.exception() and log.error("the end-of-turn model at %s does not load: %s", path, f.exception())
    )
    return judge
