"""The semantic end of turn in the Endpointer (agent/media/semantic_turn.py), with a scripted judge
on real espeak-ng speech: each pause is asked about once, after ask_after_ms of unvoiced audio,
with the turn's audio up to then; the policy's tiers map the verdict to the silence that ends the
turn (the surer, the shorter; no sooner than the verdict arrives, on the audio clock); below every
tier the turn waits for the long silence, and voice in the pause withdraws the question (the next
pause asks again). Without a judge the events are those of the acoustic endpointer. Session
wiring: semantic_vad's eagerness picks the policy (the higher, the sooner for the same verdict),
server_vad has none, and with no judge semantic_vad falls back to a silence alone."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
from support.speech import audible, espeak_at

from agent.config import Config
from agent.media.ingest import AudioChunk
from agent.media.semantic_turn import SemanticEnd, SemanticPolicy
from agent.media.turn_events import SpeechStarted, SpeechStopped
from agent.media.vad import Endpointer
from agent.realtime.input_buffer import InputBuffer
from agent.realtime.session_config import TurnDetection, turn_detection

RATE = 16000


class Answer:
    def __init__(self, p: float, ready_at: float) -> None:
        self.p, self.ready_at = p, ready_at

    def probability_at(self, t: float) -> Optional[float]:
        return self.p if t >= self.ready_at - 1e-9 else None


class Scripted:
    """Answers each question with the next probability, `delay_s` of audio time after it."""

    def __init__(self, answers: list[float], delay_s: float = 0.0) -> None:
        self.answers, self.delay_s = list(answers), delay_s
        self.asked: list[tuple[float, int]] = []  # (audio time, samples heard)

    def ask(self, audio: np.ndarray, at: float) -> Answer:
        self.asked.append((at, len(audio)))
        return Answer(self.answers.pop(0) if self.answers else 0.0, at + self.delay_s)


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> np.ndarray:
    out = tmp_path_factory.mktemp("say") / "w.wav"
    return audible(espeak_at("hello there agent", out, RATE) / 32768).astype(np.float32)


def silence(s: float) -> np.ndarray:
    return np.zeros(int(s * RATE), np.float32)


def run(endpointer: Endpointer, pcm: np.ndarray) -> list:
    pcm = np.concatenate([silence(0.16), pcm])
    pcm = np.concatenate([pcm, silence((-len(pcm) % 1280) / RATE)])
    events = []
    for i in range(len(pcm) // 1280):
        events += endpointer.push(AudioChunk(pcm=pcm[i * 1280 : (i + 1) * 1280], index=i, start=i * 0.08))
    return [e for e in events if isinstance(e, (SpeechStarted, SpeechStopped))]


TIERS = SemanticPolicy(tiers=((0.9, 100), (0.5, 400)))


def endpointer(judge: Optional[Scripted], policy: SemanticPolicy = TIERS, silence_ms: int = 800):
    return Endpointer(silence_ms=silence_ms, semantic=SemanticEnd(judge, policy) if judge else None)


def test_a_turn_judged_complete_ends_at_the_short_silence(words: np.ndarray) -> None:
    judge = Scripted([0.9])
    events = run(endpointer(judge), np.concatenate([words, silence(1.2)]))
    started, stopped = events
    assert isinstance(stopped, SpeechStopped)
    assert stopped.at - stopped.end_of_speech == pytest.approx(0.1, abs=1e-6)  # the surest tier, not 800
    ((at, heard),) = judge.asked
    assert at - stopped.end_of_speech == pytest.approx(0.06, abs=1e-6)  # asked at ask_after_ms
    # It heard the turn from its pre-roll up to the question.
    assert heard == round((at - started.at) * RATE)


def test_a_late_verdict_ends_the_turn_when_it_arrives(words: np.ndarray) -> None:
    judge = Scripted([0.9], delay_s=0.1)  # 60 ms + 100 ms of compute: in at 160 ms
    (_, stopped) = run(endpointer(judge), np.concatenate([words, silence(1.2)]))
    assert stopped.at - stopped.end_of_speech == pytest.approx(0.16, abs=1e-6)


def test_a_less_sure_verdict_waits_for_its_tier(words: np.ndarray) -> None:
    (_, stopped) = run(endpointer(Scripted([0.6])), np.concatenate([words, silence(1.2)]))
    assert stopped.at - stopped.end_of_speech == pytest.approx(0.4, abs=1e-6)


def test_a_turn_judged_unfinished_waits_for_the_long_silence(words: np.ndarray) -> None:
    judge = Scripted([0.2])
    (_, stopped) = run(endpointer(judge, silence_ms=800), np.concatenate([words, silence(1.2)]))
    assert stopped.at - stopped.end_of_speech == pytest.approx(0.8, abs=1e-6)
    assert len(judge.asked) == 1  # one question per pause, however long it lasts


def test_a_mid_sentence_pause_is_not_cut_and_the_next_pause_asks_again(words: np.ndarray) -> None:
    # A 400 ms pause judged unfinished, then more words, then a pause judged complete.
    judge = Scripted([0.1, 0.95])
    audio = np.concatenate([words, silence(0.4), words, silence(1.2)])
    events = run(endpointer(judge), audio)
    assert [type(e).__name__ for e in events] == ["SpeechStarted", "SpeechStopped"]
    stopped = events[-1]
    assert stopped.at - stopped.end_of_speech == pytest.approx(0.1, abs=1e-6)
    # Asked in the 400 ms pause and again at the end (syllable gaps under 60 ms ask nothing);
    # the second question heard more of the turn than the first.
    assert len(judge.asked) >= 2 and judge.asked[-1][1] > judge.asked[0][1]
    assert judge.asked[-1][0] - stopped.end_of_speech == pytest.approx(0.06, abs=1e-6)


def test_voice_before_the_verdict_withdraws_the_question(words: np.ndarray) -> None:
    # The verdict ("complete") would come 300 ms into a 200 ms pause: the speaker went on first.
    judge = Scripted([0.99, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], delay_s=0.24)
    audio = np.concatenate([words, silence(0.2), words, silence(1.2)])
    events = run(endpointer(judge), audio)
    assert [type(e).__name__ for e in events] == ["SpeechStarted", "SpeechStopped"]
    assert events[-1].at - events[-1].end_of_speech == pytest.approx(0.8, abs=1e-6)


def test_without_a_judge_the_endpointer_is_acoustic(words: np.ndarray) -> None:
    audio = np.concatenate([words, silence(0.4), words, silence(1.2)])
    plain = run(Endpointer(silence_ms=300), audio)
    # A judge that never answers changes nothing either.
    silent = run(endpointer(Scripted([0.9] * 9, delay_s=99.0), silence_ms=300), audio)
    assert plain == silent


def _session(td: dict) -> dict:
    return {"audio": {"input": {"turn_detection": td}}}


def test_eagerness_picks_the_policy_and_server_vad_has_none() -> None:
    low = turn_detection(_session({"type": "semantic_vad", "eagerness": "low"}), 300)
    high = turn_detection(_session({"type": "semantic_vad", "eagerness": "high"}), 300)
    auto = turn_detection(_session({"type": "semantic_vad"}), 300)
    server = turn_detection(_session({"type": "server_vad", "silence_duration_ms": 450}), 300)
    # For the same verdict the more eager ends the turn no later; every tier waits 100 ms at least.
    for p in (0.3, 0.6, 0.85, 0.99):
        waits = [td.semantic.silence_ms(p) or td.silence_ms for td in (low, auto, high)]
        assert waits == sorted(waits, reverse=True), (p, waits)
    assert min(ms for td in (low, auto, high) for _, ms in td.semantic.tiers) >= 100
    # A turn judged unfinished waits past the 150-700 ms pauses people make mid-sentence (high
    # eagerness a little less), and longer than the same eagerness with no judge at all.
    assert low.silence_ms > auto.silence_ms > 700 and auto.silence_ms > high.silence_ms
    assert all(td.silence_ms > td.unjudged_silence_ms for td in (low, auto, high))
    assert server.semantic is None and server.silence_ms == 450


def test_semantic_vad_without_a_judge_ends_turns_by_silence_alone() -> None:
    td = turn_detection(_session({"type": "semantic_vad", "eagerness": "high"}), 300)
    assert isinstance(td, TurnDetection)
    judged = InputBuffer(Config(), td, judge=Scripted([]))
    alone = InputBuffer(Config(), td, judge=None)
    assert judged.endpointer.semantic is not None and alone.endpointer.semantic is None
    assert judged.endpointer._silence_ms == td.silence_ms
    assert alone.endpointer._silence_ms == td.unjudged_silence_ms
