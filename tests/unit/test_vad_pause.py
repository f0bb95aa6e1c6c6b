"""The Endpointer's pause events (speculative start): with pause_ms set, an unvoiced run inside a
turn reports SpeechPaused once when it reaches pause_ms and SpeechResumed when voice comes back
before the end of turn; a pause that becomes the end of turn is SpeechPaused then SpeechStopped;
pause_ms 0 reports none; the turn's other events are those of an endpointer without pauses."""

from __future__ import annotations

import numpy as np
import pytest
from support.speech import audible, espeak_at

from agent.media.ingest import AudioChunk
from agent.media.turn_events import SpeechPaused, SpeechResumed, SpeechStarted, SpeechStopped
from agent.media.vad import Endpointer

RATE = 16000


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> np.ndarray:
    out = tmp_path_factory.mktemp("say") / "w.wav"
    return audible(espeak_at("hello there agent", out, RATE) / 32768).astype(np.float32)


def run(endpointer: Endpointer, pcm: np.ndarray) -> list:
    n = -(-len(pcm) // 1280) * 1280
    pcm = np.concatenate([np.zeros(1280 * 2, np.float32), pcm, np.zeros(n - len(pcm), np.float32)])
    events = []
    for i in range(len(pcm) // 1280):
        events += endpointer.push(AudioChunk(pcm=pcm[i * 1280 : (i + 1) * 1280], index=i, start=i * 0.08))
    return [e for e in events if isinstance(e, (SpeechStarted, SpeechPaused, SpeechResumed, SpeechStopped))]


def kinds(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


def test_mid_sentence_pause_then_end_of_turn(words: np.ndarray) -> None:
    gap = np.zeros(int(0.2 * RATE), np.float32)
    audio = np.concatenate([words, gap, words, np.zeros(int(0.6 * RATE), np.float32)])
    events = run(Endpointer(silence_ms=300, pause_ms=120), audio)
    names = kinds(events)
    assert names[0] == "SpeechStarted" and names[-2:] == ["SpeechPaused", "SpeechStopped"]
    assert names.count("SpeechStarted") == names.count("SpeechStopped") == 1
    # Every pause is followed by a resume or by the end of turn; the 200 ms gap is one of them.
    for i, name in enumerate(names):
        if name == "SpeechPaused":
            assert names[i + 1] in ("SpeechResumed", "SpeechStopped")
    assert "SpeechResumed" in names
    paused, stopped = events[-2], events[-1]
    assert paused.end_of_speech == stopped.end_of_speech
    assert 0.12 - 1e-6 <= paused.at - paused.end_of_speech < stopped.at - stopped.end_of_speech


def test_no_pause_events_without_pause_ms(words: np.ndarray) -> None:
    audio = np.concatenate([words, np.zeros(int(0.2 * RATE), np.float32), words, np.zeros(int(0.6 * RATE), np.float32)])
    plain = run(Endpointer(silence_ms=300), audio)
    paused = run(Endpointer(silence_ms=300, pause_ms=120), audio)
    assert kinds(plain) == ["SpeechStarted", "SpeechStopped"]
    assert [e for e in paused if isinstance(e, (SpeechStarted, SpeechStopped))] == plain
