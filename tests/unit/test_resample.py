"""Audio items are resampled to 16 kHz with a low-pass, whole and time-aligned.

Pins, for `conversation.item.create` audio (agent/realtime/audio_codec.py::to_16k) and the
client's WAV loader (agent/client/media.py::load_wav_mono), both on agent/media/resample.py:
- a 10 kHz tone in 24 kHz pcm16 is removed (RMS under 1% of the input's), where linear
  interpolation keeps it at full strength as a 6 kHz alias;
- a 1 kHz tone survives: amplitude within 3%, spectrum peak at 1 kHz;
- 8 kHz G.711 (µ-law, A-law) comes out at 16 kHz with its tone at the right frequency;
- the output has exactly round(n * 16000 / rate) samples for any n (short items included: a
  one-shot FFmpeg flush drops the tail of short buffers), and an impulse comes out where it
  went in (no shift by the filter's delay).
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

from agent.client.media import load_wav_mono
from agent.media.resample import resample, resampled_length
from agent.realtime.audio_codec import RATES, to_16k


def _tone(freq: float, rate: int, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return amplitude * np.sin(2 * np.pi * freq * t)


def _pcm16(x: np.ndarray) -> bytes:
    return np.rint(x * 32767).astype("<i2").tobytes()


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[np.argmax(spectrum)])


def _middle(x: np.ndarray, rate: int) -> np.ndarray:
    # The edges hold the filter's ramp in and out (a tone starting abruptly): judge the steady part.
    return x[rate // 10 : -rate // 10]


def test_a_10khz_tone_at_24khz_is_filtered_out_not_aliased_to_6khz() -> None:
    tone = _tone(10_000, 24_000)
    out = to_16k("audio/pcm", _pcm16(tone))
    assert _rms(_middle(out, 16_000)) < 0.01 * _rms(tone)
    # What the old linear interpolation did with it: the same tone folded to 6 kHz, kept whole.
    linear = np.interp(np.linspace(0, len(tone) - 1, len(out)), np.arange(len(tone)), tone)
    assert _rms(linear) > 0.5 * _rms(tone) and abs(_peak_hz(linear, 16_000) - 6_000) < 5


def test_a_1khz_tone_survives_at_its_frequency_and_amplitude() -> None:
    tone = _tone(1_000, 24_000)
    out = _middle(to_16k("audio/pcm", _pcm16(tone)), 16_000)
    assert abs(_peak_hz(out, 16_000) - 1_000) < 2
    assert _rms(out) == pytest.approx(_rms(tone), rel=0.03)


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_at_8khz_comes_out_at_16khz(fmt: str) -> None:
    # Encode a 1 kHz tone to G.711 by picking, per sample, the code that decodes nearest to it.
    from agent.realtime.audio_codec import to_pcm16

    table = to_pcm16(fmt, bytes(range(256))).astype(np.int32)
    order = np.argsort(table)
    target = np.rint(_tone(1_000, 8_000) * 32767).astype(np.int32)
    idx = np.clip(np.searchsorted(table[order], target), 0, 255)
    codes = order[idx].astype(np.uint8).tobytes()
    out = to_16k(fmt, codes)
    assert len(out) == 2 * len(codes)
    mid = _middle(out, 16_000)
    assert abs(_peak_hz(mid, 16_000) - 1_000) < 2
    assert _rms(mid) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)  # G.711 quantisation: a few %


@pytest.mark.parametrize("fmt", sorted(RATES))
def test_every_item_comes_out_whole(fmt: str) -> None:
    width = 2 if fmt == "audio/pcm" else 1
    for n in (0, 1, 2, 3, 5, 20, 33, 47, 160, 479, 480, 2401, 24_001):
        assert len(to_16k(fmt, bytes(n * width))) == resampled_length(n, RATES[fmt], 16_000), n


@pytest.mark.parametrize(("src", "dst"), [(24_000, 16_000), (8_000, 16_000), (44_100, 16_000), (16_000, 48_000)])
def test_an_impulse_comes_out_where_it_went_in(src: int, dst: int) -> None:
    x = np.zeros(src // 5, dtype=np.float32)
    x[src // 10] = 1.0
    out = resample(x, src, dst)
    assert len(out) == resampled_length(len(x), src, dst)
    assert abs(int(np.argmax(np.abs(out))) - (src // 10) * dst / src) <= 1


def test_the_clients_wav_loader_filters_too(tmp_path: Path) -> None:
    path = tmp_path / "mix.wav"
    rate = 44_100
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(_pcm16(_tone(1_000, rate, amplitude=0.3) + _tone(12_000, rate, amplitude=0.3)))
    raw = load_wav_mono(path, rate=16_000)
    assert raw.dtype == np.int16 and len(raw) == resampled_length(rate, rate, 16_000)
    out = raw.astype(np.float64) / 32767
    mid = _middle(out, 16_000)
    assert abs(_peak_hz(mid, 16_000) - 1_000) < 2
    assert _rms(mid) == pytest.approx(0.3 / np.sqrt(2), rel=0.03)  # the 12 kHz half is gone, not folded to 4 kHz
