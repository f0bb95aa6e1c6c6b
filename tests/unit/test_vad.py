"""The Endpointer (with either voice detector: Silero, the default, and webrtcvad) never starts a turn on silence, low noise or faint sound below its level
floor; it starts one on real (espeak-ng) speech with ~300 ms of pre-roll, streams every chunk
of the turn, and ends it 300 ms after the last voiced sub-frame (end_of_speech near the real
end), not at a 0.18 s pause inside a sentence; max_turn_s cuts a turn by force; skipped
chunks count as silence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import speech as speech_io

from agent.media.ingest import AudioChunk
from agent.media.turn_events import SpeechAudio, SpeechStarted, SpeechStopped, TurnEvent
from agent.media.vad import Endpointer

RATE = 16000


def read_wav(path: Path) -> np.ndarray:
    """A WAV file at 16 kHz (espeak-ng writes 22.05 kHz), float32 in [-1, 1]."""
    pcm, rate = speech_io.read_wav(path)
    return (speech_io.resample(pcm, rate, RATE) / 32768).astype(np.float32)


@pytest.fixture(scope="module")
def say(tmp_path_factory):
    """Speak a phrase with espeak-ng; return it at 16 kHz, trimmed to its audible part."""
    cache: dict[str, np.ndarray] = {}
    folder = tmp_path_factory.mktemp("say")

    def speak(text: str) -> np.ndarray:
        if text not in cache:
            out = folder / f"{len(cache)}.wav"
            cache[text] = speech_io.audible(read_wav(speech_io.espeak(text, out)))
        return cache[text]

    return speak


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def to_chunks(pcm: np.ndarray, first_index: int = 0) -> list[AudioChunk]:
    n = -(-len(pcm) // 1280) * 1280
    pcm = np.concatenate([pcm, np.zeros(n - len(pcm), dtype=np.float32)])
    return [
        AudioChunk(pcm=pcm[i * 1280 : (i + 1) * 1280], index=first_index + i, start=(first_index + i) * 0.08)
        for i in range(n // 1280)
    ]


def run(pcm: np.ndarray, **kwargs) -> list[TurnEvent]:
    ep = Endpointer(**kwargs)
    events: list[TurnEvent] = []
    for c in to_chunks(pcm):
        events += ep.push(c)
    return events


def marks(events: list[TurnEvent]) -> list[TurnEvent]:
    return [e for e in events if not isinstance(e, SpeechAudio)]


def audible_span(pcm: np.ndarray, offset: float) -> tuple[float, float]:
    """First and last 20 ms windows above -40 dBFS RMS: where the speech really is."""
    rms = np.sqrt(np.mean(pcm[: len(pcm) // 320 * 320].reshape(-1, 320) ** 2, axis=1))
    loud = np.flatnonzero(rms > 0.01)
    return offset + loud[0] * 0.02, offset + (loud[-1] + 1) * 0.02


def white_noise(seconds: float, dbfs: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * RATE)) * 10 ** (dbfs / 20)).astype(np.float32)


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
@pytest.mark.parametrize(
    "pcm",
    [silence(5.0), white_noise(5.0, -60.0), white_noise(5.0, -50.0, seed=1), white_noise(5.0, -40.0, seed=2)],
    ids=["zeros", "noise-60dBFS", "noise-50dBFS", "noise-40dBFS"],
)
def test_silence_and_low_noise_never_start_a_turn(pcm, vad):
    assert run(pcm, vad=vad) == []


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
def test_speech_then_silence_is_one_turn(speech_wav, vad):
    speech = read_wav(speech_wav)  # 0.3 s lead-in, then "Hello agent, what do you see?"
    pcm = np.concatenate([speech, silence(1.0)])
    events = run(pcm, vad=vad)
    kinds = [type(e) for e in events]
    assert kinds[0] is SpeechStarted and kinds[-1] is SpeechStopped
    assert kinds.count(SpeechStarted) == 1 and kinds.count(SpeechStopped) == 1
    start, stop = events[0], events[-1]
    assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
    real_start, real_end = audible_span(speech, 0.0)

    assert abs(start.onset - real_start) < 0.1
    # Pre-roll: the turn's audio starts ~300 ms before the onset (or at the clock's origin).
    assert start.at == pytest.approx(max(0.0, start.onset - 0.3), abs=0.081)
    audio = [e.chunk for e in events if isinstance(e, SpeechAudio)]
    assert audio[0].start == start.at
    assert [c.index for c in audio] == list(range(audio[0].index, audio[0].index + len(audio)))

    assert abs(stop.end_of_speech - real_end) < 0.1
    assert stop.at == pytest.approx(stop.end_of_speech + 0.3, abs=1e-6)
    assert not stop.forced
    # The turn's audio runs through the chunk in which the silence completed.
    assert audio[-1].start <= stop.at <= audio[-1].end


def test_turn_with_lead_in_gets_preroll_chunks(say):
    pcm = np.concatenate([silence(1.0), say("Hello there"), silence(0.8)])
    events = run(pcm)
    start = events[0]
    assert isinstance(start, SpeechStarted)
    assert 0.95 <= start.onset <= 1.1
    assert 0.2 <= start.onset - start.at <= 0.38  # ~300 ms of pre-roll, in whole chunks


def test_short_pause_inside_a_sentence_does_not_end_the_turn(say):
    a, b = say("Hello agent"), say("what do you see in the picture")
    one = run(np.concatenate([silence(0.5), a, silence(0.18), b, silence(1.0)]))
    assert [type(e) for e in marks(one)] == [SpeechStarted, SpeechStopped]
    # The same sentences with a 0.5 s pause are two turns: the rule really is 300 ms.
    two = run(np.concatenate([silence(0.5), a, silence(0.5), b, silence(1.0)]))
    assert [type(e) for e in marks(two)] == [SpeechStarted, SpeechStopped] * 2


def test_max_turn_length_forces_the_end(say):
    long = say("one two three four five six seven eight nine ten eleven twelve")
    assert len(long) / RATE > 3.0
    events = marks(run(np.concatenate([silence(0.4), long, silence(1.0)]), max_turn_s=1.0))
    start, stop = events[0], events[1]
    assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
    assert stop.forced
    assert 1.0 <= stop.at - start.at < 1.08  # cut at the first chunk boundary past 1 s
    # The speaker goes on: a new turn follows, without repeating the cut turn's audio.
    assert isinstance(events[2], SpeechStarted)
    assert events[2].at >= stop.at


def test_clock_gap_during_a_turn_counts_as_silence(say):
    ep = Endpointer()
    events: list[TurnEvent] = []
    chunks = to_chunks(np.concatenate([silence(0.3), say("Hello agent, how are you")]))
    for c in chunks:
        events += ep.push(c)
    assert ep.in_turn
    # The audio clock skips 20 chunks (a long network hole), then silence resumes.
    resume = chunks[-1].index + 21
    events += ep.push(to_chunks(silence(0.08), first_index=resume)[0])
    stop = events[-1]
    assert isinstance(stop, SpeechStopped) and not ep.in_turn
    assert stop.at == pytest.approx(stop.end_of_speech + 0.3)


def test_events_are_a_pure_function_of_the_audio(speech_wav):
    pcm = np.concatenate([read_wav(speech_wav), silence(0.6)])
    first, second = marks(run(pcm)), marks(run(pcm))
    assert first == second and len(first) == 2


def test_aggressiveness_and_silence_are_configurable(speech_wav):
    pcm = np.concatenate([read_wav(speech_wav), silence(1.0)])
    short = marks(run(pcm, silence_ms=500, aggressiveness=3, vad="webrtc"))
    stop = short[-1]
    assert isinstance(stop, SpeechStopped)
    assert stop.at == pytest.approx(stop.end_of_speech + 0.5, abs=1e-6)


def test_level_floor_ignores_faint_speech_that_webrtcvad_alone_would_take(speech_wav):
    speech = read_wav(speech_wav)  # about -21 dBFS RMS
    faint = np.concatenate([speech * 10 ** (-40 / 20), silence(1.0)])  # ~ -61 dBFS
    assert run(faint) == [] and run(faint, vad="webrtc") == []
    assert len(marks(run(faint, min_level_dbfs=-200.0, vad="webrtc"))) >= 2  # webrtcvad is level-blind
    quieter = np.concatenate([speech * 10 ** (-20 / 20), silence(1.0)])
    assert [type(e) for e in marks(run(quieter))] == [SpeechStarted, SpeechStopped]


def test_peek_ends_the_turn_on_the_20ms_that_completes_the_silence(say) -> None:
    """Fed 20 ms at a time (as audio arrives), the stop comes on the sub-frame that
    completes the silence, not when its 80 ms chunk is full; the events are otherwise the
    same as chunk-only feeding, and the VAD sees every sub-frame once."""
    pcm = np.concatenate([silence(0.5), say("hello there, how are you"), silence(1.0)])
    chunks = to_chunks(pcm)

    plain = Endpointer()
    plain_events = [e for c in chunks for e in plain.push(c)]

    live = Endpointer()
    live_events: list[tuple[int, TurnEvent]] = []  # (20 ms steps fed so far, event)
    fed = 0
    for c in chunks:
        for k in range(1, 4):  # the first three sub-frames arrive before the chunk is whole
            fed += 1
            live_events += [(fed, e) for e in live.peek(c.index, c.pcm[: k * 320])]
        fed += 1
        live_events += [(fed, e) for e in live.push(c)]

    plain_stop = [e for e in plain_events if isinstance(e, SpeechStopped)]
    live_stop = [(n, e) for n, e in live_events if isinstance(e, SpeechStopped)]
    assert len(plain_stop) == len(live_stop) == 1
    n, stop = live_stop[0]
    assert stop == plain_stop[0]  # same times: same decision, same sub-frames
    assert abs(n * 0.02 - stop.at) < 1e-9, "decided on the very sub-frame that completed the silence"
    starts = [e for _, e in live_events if isinstance(e, SpeechStarted)]
    assert starts == [e for e in plain_events if isinstance(e, SpeechStarted)]
    live_audio = [e.chunk.index for _, e in live_events if isinstance(e, SpeechAudio)]
    plain_audio = [e.chunk.index for e in plain_events if isinstance(e, SpeechAudio)]
    # The chunk still filling when the turn ended is not part of it (unless it was complete).
    assert plain_audio[: len(live_audio)] == live_audio and len(plain_audio) - len(live_audio) <= 1
    assert live._subframes == plain._subframes == len(chunks) * 4
