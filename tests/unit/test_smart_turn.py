"""The end-of-turn judge (agent/media/smart_turn.py) over the real Smart Turn v3.2 file that
`omni-agent fetch-turn-model` keeps (agent/media/turn_model.py): the file is the published one
(SHA-256), a truncated copy is not; the model hears a finished question as complete and a clause
cut off mid-way as not (the features are wired as it was trained); shorter audio is the same as
that audio left-padded with silence to 8 s; the shared judge answers on its own thread, once
loaded, with the model's probability, and counts and times each verdict; a file that does not
load answers nothing (the pause then waits for the long silence) and a missing one gives no
judge at all."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support.speech import audible, espeak_at

from agent import metrics
from agent.config import Config
from agent.media.smart_turn import SAMPLES, SmartTurn, SmartTurnJudge, load_judge
from agent.media.turn_model import default_path, fetch, present

MODEL = default_path(Config().cache_dir)


@pytest.fixture(scope="module")
def model() -> SmartTurn:
    if not MODEL.is_file():
        missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        missing(f"no {MODEL}: run `omni-agent fetch-turn-model` (make install does)")
    return SmartTurn(MODEL)


def speech(text: str, tmp_path: Path) -> np.ndarray:
    pcm = audible(espeak_at(text, tmp_path / "say.wav", 16000) / 32768).astype(np.float32)
    return np.concatenate([pcm, np.zeros(960, np.float32)])  # 60 ms into the pause: when it is asked


def test_the_kept_file_is_the_published_one_and_a_truncated_copy_is_not(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert present(MODEL)

    def no_download(*args, **kwargs):
        raise AssertionError(f"fetch ran {args[0]!r} for a file already there")

    monkeypatch.setattr("agent.media.turn_model.subprocess.run", no_download)
    assert fetch(MODEL) == MODEL  # already there: nothing downloaded
    cut = tmp_path / MODEL.name
    cut.write_bytes(MODEL.read_bytes()[:100_000])
    assert not present(cut)


def test_a_finished_question_is_complete_and_a_cut_clause_is_not(model, tmp_path: Path) -> None:
    done = model.probability(speech("What's the weather like in Paris tomorrow?", tmp_path))
    cut = model.probability(speech("I want to go to the", tmp_path))
    assert 0.0 <= cut < 0.5 < done <= 1.0
    assert model.probability(speech("I want to go to the", tmp_path)) == cut  # deterministic


def test_short_audio_is_left_padded_with_silence(model, tmp_path: Path) -> None:
    pcm = speech("Please call me back", tmp_path)
    padded = np.concatenate([np.zeros(SAMPLES - len(pcm), np.float32), pcm])
    assert model.probability(pcm) == pytest.approx(model.probability(padded), abs=1e-6)
    # Only the last 8 s count.
    longer = np.concatenate([np.random.default_rng(0).normal(0, 0.1, 3 * SAMPLES).astype(np.float32), padded])
    assert model.probability(longer) == pytest.approx(model.probability(padded), abs=1e-6)


def test_the_shared_judge_answers_on_its_own_thread(model, tmp_path: Path) -> None:
    judge = load_judge(MODEL)
    assert isinstance(judge, SmartTurnJudge)
    try:
        pcm = speech("What's the weather like in Paris tomorrow?", tmp_path)
        seen = metrics.REGISTRY.get_sample_value("agent_turn_judge_seconds_count") or 0.0
        threads: list[str] = []
        original = judge._judge
        judge._judge = lambda audio: (threads.append(threading.current_thread().name), original(audio))[1]
        asked = judge.ask(pcm, at=1.0)
        deadline = time.monotonic() + 60
        while asked.probability_at(1.0) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked.probability_at(1.0) == pytest.approx(model.probability(pcm), abs=1e-6)
        assert threads and threads[0].startswith("turn-judge") and threads[0] != threading.current_thread().name
        assert metrics.REGISTRY.get_sample_value("agent_turn_judge_seconds_count") == seen + 1
    finally:
        judge.close()


def test_a_file_that_does_not_load_answers_nothing_and_a_missing_one_gives_no_judge(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    failed = metrics.REGISTRY.get_sample_value("agent_turn_judgments_total", {"verdict": "failed"})
    judge = load_judge(bad)
    assert judge is not None
    try:
        with pytest.raises(RuntimeError):
            judge.loaded.result(timeout=30)
        asked = judge.ask(np.zeros(16000, np.float32), at=1.0)
        deadline = time.monotonic() + 30
        while not asked._future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked.probability_at(99.0) is None
        assert metrics.REGISTRY.get_sample_value("agent_turn_judgments_total", {"verdict": "failed"}) == failed + 1
    finally:
        judge.close()
    assert load_judge(tmp_path / "missing.onnx") is None


def test_a_copy_elsewhere_loads_through_the_same_path(model, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.onnx"
    shutil.copy(MODEL, copy)
    judge = load_judge(copy)
    assert judge is not None
    try:
        judge.loaded.result(timeout=60)
    finally:
        judge.close()
