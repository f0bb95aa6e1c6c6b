"""The Endpointer's pause events (speculative start): with pause_ms set, an unvoiced run inside a
turn reports SpeechPaused once when it reaches pause_ms and SpeechResumed when voice comes back
before the end of turn; a pause that becomes the end of turn is SpeechPaused then SpeechStopped;
pause_ms 0 reports none; the turn's other events are those of an endpointer without pauses. With a
pause model (agent/media/pauses.py) the length is learned from the speaker's own mid-turn pauses:
a habitual mid-sentence pause stops being reported after the first turns, the end of turn is
still reported before its stop, and the learned length stays between the floor and the ceiling."""

from __future__ import annotations

import numpy as np
import pytest
from support.speech import audible, espeak_at

from agent.media.ingest import AudioChunk
from agent.media.pauses import MARGIN_MS, MEMORY, PauseModel, pause_model
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


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> np.ndarray:
    """A sentence with a comma: espeak pauses 160-180 ms there (as the load benchmark's speech)."""
    out = tmp_path_factory.mktemp("say") / "s.wav"
    return audible(espeak_at("hello agent, what do you see", out, RATE) / 32768).astype(np.float32)


def turns_of(sentence: np.ndarray, count: int) -> np.ndarray:
    """`count` turns of the sentence, each followed by end-of-turn silence."""
    return np.concatenate([np.concatenate([sentence, np.zeros(int(0.6 * RATE), np.float32)])] * count)


def per_turn(names: list[str]) -> list[list[str]]:
    turns: list[list[str]] = []
    for name in names:
        if name == "SpeechStarted":
            turns.append([])
        turns[-1].append(name)
    return turns


def test_learned_pause_stops_speculating_on_a_speakers_usual_mid_sentence_pause(sentence: np.ndarray) -> None:
    """A speaker who pauses at the same comma every turn: with the pause learned, only the first
    turn speculates on it (SpeechPaused then SpeechResumed); later turns pause-report only at
    their end, still before SpeechStopped (the end-of-turn speculation keeps its head start).
    With a fixed pause length every turn speculates on it."""
    audio = turns_of(sentence, 5)
    fixed = per_turn(kinds(run(Endpointer(silence_ms=300, pause_ms=120), audio)))
    learned = per_turn(kinds(run(Endpointer(silence_ms=300, pause_ms=120, pauses=pause_model(120, 300)), audio)))
    assert len(fixed) == len(learned) == 5
    assert all("SpeechResumed" in turn for turn in fixed), fixed
    assert "SpeechResumed" in learned[0]
    assert all(turn == ["SpeechStarted", "SpeechPaused", "SpeechStopped"] for turn in learned[2:]), learned
    # The turns themselves are the same: pauses only decide when speculation starts.
    assert [t[0] for t in fixed] == [t[0] for t in learned] and all(t[-1] == "SpeechStopped" for t in learned)


def test_pause_model_floor_quantile_and_ceiling() -> None:
    model = PauseModel(floor_ms=120, ceiling_ms=200)
    assert model.threshold_ms == 120  # nothing seen: the floor
    model.resumed_after(60)  # a gap between syllables is not a pause
    model.resumed_after(140)
    assert model.threshold_ms == 120  # one pause is not a habit
    model.resumed_after(100)
    assert model.threshold_ms == 140 + MARGIN_MS  # past the longest of two
    for _ in range(20):
        model.resumed_after(90)
    assert model.threshold_ms == 90 + MARGIN_MS  # the odd long pause is the one in ten let through
    for _ in range(MEMORY):
        model.resumed_after(400)  # a slow speaker now (the old habit is forgotten): capped
    assert model.threshold_ms == 200
