"""The echo guard and the voice-detector choice.

Pins, over the real objects (AgentAudioTrack paced by a fake clock, InputBuffer = AudioIn +
Endpointer with the real Silero / webrtcvad detector): the agent's own spoken reply fed back into
its microphone 120 ms later at -10 dB never starts a turn (so never barges in), while the same
echo does start one when the guard is not told the agent is playing (the echo really is speech to
the VAD); a person talking over the reply at the reply's level does start a turn, near their onset.
The policy, with a detector that calls any non-silent sub-frame voiced: while the agent plays a
turn needs barge_in_ms (not min_speech_ms) of voiced audio above played level + margin, without
an unvoiced gap over barge_in_gap_ms (voiced sub-frames under that level neither count nor break
it; margin None: duration rule only); silent agent: as before. The defaults let a backchannel
(under 600 ms of voice) pass and hold a phrase with pauses at its commas together.
Selection: --vad picks the detector, Silero's threshold is range-checked, unknown kinds are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.echo import FakeClock, LoudIsVoiced, gap, speakerphone, tone

from agent.config import Config
from agent.flags import add_serve_arguments, config_from_args
from agent.media.echo import PlayoutLevel
from agent.media.ingest import AudioChunk
from agent.media.turn_events import SpeechStarted, TurnEvent
from agent.media.vad import Endpointer
from agent.media.voice import SileroDetector, WebrtcDetector, make_detector
from agent.realtime import session_config
from agent.realtime.input_buffer import InputBuffer


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


def starts(pcm: np.ndarray, playing: float | None, **kwargs) -> list[SpeechStarted]:
    """The policy's mechanics at a 200 ms barge-in and a 100 ms gap, unless told otherwise."""
    kwargs.setdefault("barge_in_ms", 200)
    kwargs.setdefault("barge_in_gap_ms", 100)
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


def test_by_default_a_backchannel_does_not_barge_in_and_a_phrase_with_commas_does():
    defaults = {"barge_in_ms": Config().barge_in_ms, "barge_in_gap_ms": Config().barge_in_gap_ms}
    assert starts(tone(440, -20.0), playing=0.01, **defaults) == []  # "yeah", "I see"
    uh_huh = np.concatenate([tone(200, -20.0), gap(120), tone(240, -20.0)])
    assert starts(uh_huh, playing=0.01, **defaults) == []
    # "wait, stop, that's not it": three phrases, 200 ms apart, one barge-in from the first word.
    phrase = np.concatenate([tone(240, -20.0), gap(200), tone(240, -20.0), gap(200), tone(400, -20.0)])
    (start,) = starts(phrase, playing=0.01, **defaults)
    assert start.onset == pytest.approx(0.16, abs=0.021)
    # The same "yeah" at the old 200 ms did interrupt.
    assert len(starts(tone(440, -20.0), playing=0.01)) == 1


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
    add_serve_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert default.vad == "silero" and default.barge_in_ms == 600 and default.echo_guard
    assert default.barge_in_gap_ms == 300
    chosen = config_from_args(parser.parse_args(["--vad", "webrtc", "--barge-in-ms", "300", "--no-echo-guard"]))
    assert (chosen.vad, chosen.barge_in_ms, chosen.echo_guard) == ("webrtc", 300, False)
    td = session_config.turn_detection(session_config.default_session(chosen), 300)
    assert InputBuffer(chosen, td).endpointer._vad.name == "webrtc"
    assert InputBuffer(default, td).endpointer._vad.name == "silero"
