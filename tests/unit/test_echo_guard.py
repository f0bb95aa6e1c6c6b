"""The echo guard and the voice-detector choice.

Pins, over the real objects (AgentAudioTrack paced by a fake clock, InputBuffer = AudioIn +
Endpointer with the real Silero / webrtcvad detector): the agent's own spoken reply fed back into
its microphone 120 ms later at -10 dB never starts a turn (so never barges in), while the same
echo does start one when the guard is not told the agent is playing (the echo really is speech to
the VAD); a person talking over the reply at the reply's level does start a turn, near their onset.
The policy, with a detector that calls any non-silent sub-frame voiced: while the agent plays a
turn needs barge_in_ms (not min_speech_ms) of voiced audio above played level + margin, without
an unvoiced gap over 100 ms (voiced sub-frames under that level neither count nor break it;
margin None: duration rule only); silent agent: as before.
Selection: --vad picks the detector, Silero's threshold is range-checked, unknown kinds are refused.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import numpy as np
import pytest
from support.speech import audible, espeak_at

from agent.__main__ import _serve_parser, config_from_args
from agent.config import Config
from agent.media.echo import PlayoutLevel
from agent.media.ingest import AudioChunk
from agent.media.playout import AgentAudioTrack
from agent.media.turn_events import SpeechStarted, TurnEvent
from agent.media.vad import Endpointer
from agent.media.voice import SileroDetector, WebrtcDetector, make_detector
from agent.realtime import session_config
from agent.realtime.input_buffer import InputBuffer

DELAY_FRAMES = 6  # 120 ms from the track's send to the microphone
ECHO_DB = -10.0


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def espeak(folder: Path, text: str, voice: str, rate: int) -> np.ndarray:
    """espeak-ng speech resampled to `rate`, trimmed, float in [-1, 1]."""
    out = folder / f"{voice}-{abs(hash(text))}.wav"
    return audible(espeak_at(text, out, rate, voice, speed=165) / 32768)


def at_dbfs(x: np.ndarray, dbfs: float) -> np.ndarray:
    return x * 10 ** (dbfs / 20) / np.sqrt(np.mean(x * x))


@pytest.fixture(scope="module")
def voices(tmp_path_factory) -> dict[str, np.ndarray]:
    folder = tmp_path_factory.mktemp("echo")
    reply = espeak(
        folder, "Sure. The weather tomorrow will be sunny in the morning and rainy later on.", "en-gb", 24000
    )
    user = espeak(folder, "No wait, stop, I asked about Sunday instead.", "en-us+f3", 16000)
    return {"reply": at_dbfs(reply, -18.0), "user": at_dbfs(user, -18.0)}


def mic_frame(pcm16k: np.ndarray, index: int) -> av.AudioFrame:
    samples = np.clip(np.round(pcm16k * 32768), -32768, 32767).astype(np.int16)
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 16000
    frame.pts = index * 320
    frame.time_base = Fraction(1, 16000)
    return frame


async def speakerphone(
    voices,
    *,
    config: Config,
    tell_playing: bool = True,
    user_at_s: float | None = None,
    on_event: Callable[[AgentAudioTrack, TurnEvent], None] | None = None,
) -> tuple[list[tuple[int, TurnEvent]], list[bool]]:
    """The reply on a real track, its echo DELAY_FRAMES later at ECHO_DB into a real InputBuffer
    (plus the user from `user_at_s`). Returns each turn event with its 20 ms frame index, and
    whether each played frame was audible; `on_event` lets the caller drive the track on the
    events (pause / resume / flush, as Session does)."""
    clock = FakeClock()
    track = AgentAudioTrack(clock=clock, sleep=clock.sleep)
    td = session_config.turn_detection(session_config.default_session(config), config.vad_silence_ms)
    buf = InputBuffer(config, td, echo=track.level.level if tell_playing else None)
    track.begin_reply()
    track.push(np.round(voices["reply"] * 32768).astype(np.int16))
    track.end_reply()
    frames = int(len(voices["reply"]) / 24000 / 0.02) + 25
    user = np.zeros(frames * 320)
    if user_at_s is not None:
        start = int(user_at_s * 16000)
        part = voices["user"][: len(user) - start]
        user[start : start + len(part)] = part
    played: list[np.ndarray] = []
    audible: list[bool] = []
    events: list[tuple[int, TurnEvent]] = []
    for i in range(frames):
        sent = (await track.recv()).to_ndarray().reshape(-1).astype(np.float64) / 32768  # 480 @ 24 kHz
        audible.append(bool(sent.any()))
        played.append(np.interp(np.arange(320) * 1.5, np.arange(480), sent))  # to 16 kHz
        echo = played[i - DELAY_FRAMES] * 10 ** (ECHO_DB / 20) if i >= DELAY_FRAMES else np.zeros(320)
        for event in buf.push(mic_frame(echo + user[i * 320 : (i + 1) * 320], i)):
            events.append((i, event))
            if on_event is not None:
                on_event(track, event)
    track.stop()
    return events, audible


async def call(voices, *, config: Config, tell_playing: bool = True, user_at_s: float | None = None) -> list[TurnEvent]:
    """The speech starts the VAD reports on the speakerphone (the track left alone)."""
    events, _ = await speakerphone(voices, config=config, tell_playing=tell_playing, user_at_s=user_at_s)
    return [e for _, e in events if isinstance(e, SpeechStarted)]


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
async def test_own_voice_at_minus_10_db_does_not_barge_in(voices, vad):
    config = Config(vad=vad)
    assert await call(voices, config=config) == []
    # Control: the same microphone audio starts a turn when the guard does not know the agent
    # plays, so the echo is speech to this VAD and the guard is what holds it back.
    assert await call(voices, config=config, tell_playing=False) != []


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
async def test_a_real_interruption_over_the_echo_barges_in(voices, vad):
    starts = await call(voices, config=Config(vad=vad), user_at_s=1.0)
    assert len(starts) >= 1
    # It starts on the user's speech (with the pre-roll before it), not before.
    assert 1.0 - 0.05 <= starts[0].onset <= 1.5


# ---- the policy, with a detector that calls anything not silent voiced -----------------------


class LoudIsVoiced:
    name = "test"

    def voiced(self, sub: np.ndarray) -> bool:
        return bool(np.any(sub))


def tone(ms: int, dbfs: float) -> np.ndarray:
    t = np.arange(16 * ms) / 16000
    return np.sin(2 * np.pi * 300 * t) * 10 ** (dbfs / 20) * np.sqrt(2)


def gap(ms: int) -> np.ndarray:
    return np.zeros(16 * ms)


def starts(pcm: np.ndarray, playing: float | None, **kwargs) -> list[SpeechStarted]:
    ep = Endpointer(detector=LoudIsVoiced(), echo=lambda: playing, **kwargs)
    pcm = np.concatenate([gap(160), pcm, gap(800)]).astype(np.float32)  # past the warm-up
    n = len(pcm) // 1280
    events = [e for i in range(n) for e in ep.push(AudioChunk(pcm[i * 1280 : (i + 1) * 1280], i, i * 0.08))]
    return [e for e in events if isinstance(e, SpeechStarted)]


def test_while_playing_a_turn_needs_barge_in_ms_of_voice():
    burst = tone(160, -20.0)  # more than min_speech_ms (120), less than barge_in_ms (200)
    assert len(starts(burst, playing=None)) == 1
    assert starts(burst, playing=0.01) == []
    assert len(starts(tone(240, -20.0), playing=0.01)) == 1
    assert len(starts(tone(240, -20.0), playing=0.01, barge_in_ms=300)) == 0


def test_while_playing_a_gap_over_100_ms_resets_the_barge_in():
    broken = np.concatenate([tone(120, -20.0), gap(160), tone(120, -20.0)])
    assert starts(broken, playing=0.01) == []
    assert len(starts(broken, playing=None)) == 1  # silent agent: gaps up to silence_ms are fine
    stutter = np.concatenate([tone(120, -20.0), gap(60), tone(120, -20.0)])
    assert len(starts(stutter, playing=0.01)) == 1


def test_onset_threshold_rises_with_the_played_level():
    voice = tone(400, -20.0)  # RMS 0.1
    assert len(starts(voice, playing=0.1)) == 1  # at the played level: above -6 dB of it
    assert starts(voice, playing=0.25) == []  # 0.1 < 0.25 * 0.5
    assert len(starts(voice, playing=0.25, echo_margin_db=-10.0)) == 1  # 0.1 >= 0.25 * 0.316
    assert len(starts(voice, playing=0.25, echo_margin_db=None)) == 1  # guard off: duration only


def test_voice_under_the_echo_level_neither_counts_nor_breaks_a_barge_in():
    loud, quiet = tone(120, -20.0), tone(200, -40.0)  # RMS 0.1 and 0.01; threshold 0.1 * 0.5
    assert len(starts(np.concatenate([loud, quiet, tone(100, -20.0)]), playing=0.1)) == 1
    assert starts(np.concatenate([loud, quiet]), playing=0.1) == []  # 120 ms above it: not enough
    assert starts(tone(2000, -40.0), playing=0.1) == []  # an echo-level voice alone: never


def test_playout_level_is_the_loudest_recent_frame_and_expires():
    clock = FakeClock()
    level = PlayoutLevel(window_s=0.5, clock=clock)
    assert level.level() is None
    level.record(np.zeros(480, dtype=np.int16))  # silence is not playing
    assert level.level() is None
    level.record(np.full(480, 3277, dtype=np.int16))
    clock.t += 0.2
    level.record(np.full(480, 1000, dtype=np.int16))
    assert level.level() == pytest.approx(0.1, rel=1e-3)
    clock.t += 0.4  # the loud frame is 0.6 s old now
    assert level.level() == pytest.approx(1000 / 32768, rel=1e-3)
    clock.t += 0.2
    assert level.level() is None


def test_vad_selection():
    assert isinstance(make_detector("silero"), SileroDetector)
    assert isinstance(make_detector("webrtc"), WebrtcDetector)
    with pytest.raises(ValueError, match="unknown VAD"):
        make_detector("energy")
    with pytest.raises(ValueError):
        SileroDetector(threshold=1.5)
    import argparse

    parser = argparse.ArgumentParser()
    _serve_parser(parser)
    default = config_from_args(parser.parse_args([]))
    assert default.vad == "silero" and default.barge_in_ms == 200 and default.echo_guard
    chosen = config_from_args(parser.parse_args(["--vad", "webrtc", "--barge-in-ms", "300", "--no-echo-guard"]))
    assert (chosen.vad, chosen.barge_in_ms, chosen.echo_guard) == ("webrtc", 300, False)
    td = session_config.turn_detection(session_config.default_session(chosen), 300)
    assert InputBuffer(chosen, td).endpointer._vad.name == "webrtc"
    assert InputBuffer(default, td).endpointer._vad.name == "silero"
