"""The outbound audio level (RFC 6465) aiortc puts on every RTP packet, vectorized.

Pins: agent.transport.audio_level.audio_level_dbov gives aiortc's own compute_audio_level_dbov integer for
mono and stereo s16 frames at 24 and 48 kHz, silence, full scale and quiet noise; install()
makes aiortc's sender path (which looks the function up on aiortc.rtp per frame) use it; and
the track's 2x upsampler passes silence through as zeros without filtering, yet still filters
the tail of a sound that ended (its history) exactly as the one-shot filter does.
"""

from __future__ import annotations

import av
import numpy as np
import pytest

from agent.media.playout import Upsampler2x
from agent.transport import audio_level


def _frame(samples: np.ndarray, layout: str, rate: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout=layout)
    frame.sample_rate = rate
    return frame


@pytest.mark.parametrize("layout,rate,n", [("mono", 48000, 960), ("mono", 24000, 480), ("stereo", 48000, 1920)])
def test_same_level_as_aiortc(layout: str, rate: int, n: int) -> None:
    original = audio_level.aiortc_audio_level
    rng = np.random.default_rng(7)
    cases = [
        np.zeros(n),
        np.full(n, 32767),
        np.full(n, -32768),
        rng.normal(0, 3, n),
        rng.normal(0, 3000, n),
        rng.integers(-32768, 32768, n),
    ]
    for samples in cases:
        frame = _frame(np.asarray(samples).round().clip(-32768, 32767).astype(np.int16), layout, rate)
        assert audio_level.audio_level_dbov(frame) == original(frame)
    levels = {
        audio_level.audio_level_dbov(_frame(np.asarray(c).round().clip(-32768, 32767).astype(np.int16), layout, rate))
        for c in cases
    }
    assert len(levels) >= 4  # the cases really span the scale


def test_install_routes_aiortc_to_it() -> None:
    import aiortc.rtp

    assert audio_level.aiortc_audio_level.__module__ == "aiortc.rtp"
    audio_level.install()
    assert aiortc.rtp.compute_audio_level_dbov is audio_level.audio_level_dbov


def test_upsampler_skips_silence_but_not_a_tail() -> None:
    rng = np.random.default_rng(3)
    sound = rng.normal(0, 4000, 480).round().astype(np.int16)
    silence = np.zeros(480, dtype=np.int16)
    chunks = [silence, sound, silence, silence, silence]
    streamed = Upsampler2x()
    out = np.concatenate([streamed.process(c) for c in chunks])
    oneshot = Upsampler2x().process(np.concatenate(chunks))
    np.testing.assert_array_equal(out, oneshot)
    assert not out[:960].any() and out[960 + 960 : 960 + 960 + 24].any()  # the sound's tail rings on
    assert not streamed.process(silence).any()  # once the history is silent, so is the output
