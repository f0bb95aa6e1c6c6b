"""A speakerphone for the echo-guard tests: the agent's reply played on a real track (paced by a
fake clock) and fed back, delayed and attenuated, into a real InputBuffer, with or without a user
talking over it; and a detector that calls anything not silent voiced, with tones and gaps."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import numpy as np

from agent.config import Config
from agent.media.playout import AgentAudioTrack
from agent.media.turn_events import TurnEvent
from agent.realtime import session_config
from agent.realtime.input_buffer import InputBuffer
from support.speech import audible, espeak_at

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


def make_voices(folder: Path) -> dict[str, np.ndarray]:
    """The agent's reply (24 kHz) and a user's interruption (16 kHz), both at -18 dBFS."""
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


class LoudIsVoiced:
    name = "test"

    def voiced(self, sub: np.ndarray) -> bool:
        return bool(np.any(sub))


def tone(ms: int, dbfs: float) -> np.ndarray:
    t = np.arange(16 * ms) / 16000
    return np.sin(2 * np.pi * 300 * t) * 10 ** (dbfs / 20) * np.sqrt(2)


def gap(ms: int) -> np.ndarray:
    return np.zeros(16 * ms)
