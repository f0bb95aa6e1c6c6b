"""The echo guard over a real call: a loopback aiortc client whose microphone hears the agent.

The agent runs the real engine (tiny model), but its reply audio is replaced by espeak-ng speech
(the tiny model's random voice is not speech to a VAD, so its echo would prove nothing). The
client's microphone sends its question, then everything it receives back, 100 ms later at -10 dB
(a speakerphone), plus the user when they speak again (the reply plays 6 dB under the user's
voice). Pins: with the guard on, the agent's own
voice never starts a turn: one speech_started (the question), the reply completes; with the
guard off (duration rule only) the same echo barges in, so the echo really reaches the endpointer
as speech; and a user talking over the reply (at the reply's level) does barge in: a second
speech_started, the reply is cut (cancelled with turn_detected, or its queued audio cleared). (The reply ends "incomplete" when it
reaches its token cap: a random tiny model rarely stops by itself.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any

import av
import numpy as np
from aiohttp import web
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from support.loopback import LADDER_NEVER_MS, free_port
from support.realtime_helpers import talker_never_ends
from support.speech import espeak_at

from agent.client.client import AgentClient
from agent.client.media import SEND_FRAME
from agent.config import Config
from agent.engine.api import AudioOut
from agent.engine.factory import build_engine
from agent.server import create_app

ECHO_GAIN = 10 ** (-10 / 20)
ECHO_DELAY_S = 0.1


def espeak_24k(folder: Path, text: str) -> np.ndarray:
    pcm = espeak_at(text, folder / "reply.wav", 24000, voice="en-gb", speed=160)
    # 6 dB under the question (about -21 dBFS): the user is nearer their microphone than the
    # loudspeaker's output is loud; the echo comes back 10 dB under this again.
    pcm *= 10 ** (-27 / 20) * 32768 / np.sqrt(np.mean(pcm**2))
    return np.clip(pcm, -32768, 32767).astype(np.int16)


class SpeaksSpeech:
    """The real runner, but each reply's audio is the given speech (same frame sizes), then silence."""

    def __init__(self, inner: Any, speech: np.ndarray) -> None:
        self._inner = inner
        self._speech = speech
        self._pos: dict[str, int] = {}
        talker_never_ends(inner)  # a reply the random talker ended early would leave nothing to talk over

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def begin_reply(self, session_id: str, images: list, text_only: bool = False) -> None:
        self._pos[session_id] = 0
        self._inner.begin_reply(session_id, images, text_only)

    def step(self) -> list:
        return self._speak(self._inner.step())

    def take_ready(self) -> list:
        # A committed speculation's held output leaves through here, outside a step.
        return self._speak(self._inner.take_ready())

    def _speak(self, inner_outputs: list) -> list:
        outputs = []
        for out in inner_outputs:
            if isinstance(out, AudioOut):
                pos = self._pos.get(out.session_id, 0)
                pcm = np.zeros(len(out.pcm), dtype=np.int16)
                part = self._speech[pos : pos + len(pcm)]
                pcm[: len(part)] = part
                self._pos[out.session_id] = pos + len(pcm)
                out = AudioOut(out.session_id, pcm)
            outputs.append(out)
        return outputs


class EchoMic(MediaStreamTrack):
    """The client's microphone: the user's own track plus the loudspeaker's echo."""

    kind = "audio"

    def __init__(self, user: MediaStreamTrack) -> None:
        super().__init__()
        self._user = user
        self._echo: deque[float] = deque([0.0] * int(ECHO_DELAY_S * 48000))

    def heard(self, pcm48k_mono: np.ndarray) -> None:
        self._echo.extend((pcm48k_mono * ECHO_GAIN).tolist())
        while len(self._echo) > 48000:  # bounded: a late reader never builds up seconds of echo
            self._echo.popleft()

    async def recv(self) -> av.AudioFrame:
        frame = await self._user.recv()  # paced like a microphone
        pcm = frame.to_ndarray().reshape(-1).astype(np.float64)
        take = min(SEND_FRAME, len(self._echo))
        echo = np.array([self._echo.popleft() for _ in range(take)] + [0.0] * (SEND_FRAME - take))
        out = av.AudioFrame.from_ndarray(
            np.clip(pcm + echo, -32768, 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        out.sample_rate, out.pts, out.time_base = frame.sample_rate, frame.pts, frame.time_base
        return out


class SpeakerphoneClient(AgentClient):
    def __init__(self, url: str, wav: Path) -> None:
        super().__init__(url, wav, video=False)
        self.user = self.audio
        self.audio = EchoMic(self.user)  # what offer() adds as the microphone

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            pcm = frame.to_ndarray().reshape(-1).astype(np.float64)
            channels = len(frame.layout.channels)
            self.audio.heard(pcm.reshape(-1, channels).mean(axis=1))
            self.result.received_samples += frame.samples


async def speakerphone_call(
    folder: Path, tiny_model_dir: Path, wav: Path, *, echo_guard: bool, interrupt_after_s: float | None
) -> list[dict[str, Any]]:
    port = free_port()
    config = Config(
        port=port,
        ice_hosts=("127.0.0.1",),
        model=str(tiny_model_dir),
        fallback_model="none",
        threads=1,
        max_reply_tokens=48,
        max_reply_seconds=4.0,
        echo_guard=echo_guard,
        text_only_p95_ms=LADDER_NEVER_MS,  # the ladder out of reach (support/loopback.py)
        fallback_p95_ms=LADDER_NEVER_MS,
        speculation_p95_ms=LADDER_NEVER_MS,
    )
    speech = espeak_24k(
        folder, "Sure. Tomorrow will be sunny in the morning, then rain comes in from the west later in the afternoon."
    )
    engine = build_engine(config, wrap=lambda runner: SpeaksSpeech(runner, speech))
    app_runner = web.AppRunner(create_app(config, engine))
    await app_runner.setup()
    await web.TCPSite(app_runner, "127.0.0.1", port).start()
    client = SpeakerphoneClient(f"http://127.0.0.1:{port}", wav)
    try:
        for _ in range(600):
            if engine.ready:
                break
            await asyncio.sleep(0.1)
        await client.connect()
        await client.wait_event("output_audio_buffer.started", timeout=60)
        if interrupt_after_s is not None:
            await asyncio.sleep(interrupt_after_s)
            client.user.play()  # the user speaks again, over the reply
        await client.wait_event("response.done", timeout=60)
        # Let the reply play out (and its echo come back) before judging.
        deadline = time.monotonic() + 8
        while (
            time.monotonic() < deadline
            and not client.result.of_type("output_audio_buffer.stopped")
            and not client.result.of_type("output_audio_buffer.cleared")
        ):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)
    finally:
        await client.close()
        await app_runner.cleanup()
    return client.result.events


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == kind]


def barged_in(events: list[dict[str, Any]]) -> bool:
    """The first reply was cut by a turn: cancelled while generating, or (the engine makes audio
    faster than real time, so it may have finished) its queued audio dropped before it played out."""
    first = kinds(events, "response.done")[0]["response"]
    cancelled = first["status"] == "cancelled" and first["status_details"]["reason"] == "turn_detected"
    cleared = [e for e in kinds(events, "output_audio_buffer.cleared") if e["response_id"] == first["id"]]
    played_out = [e for e in kinds(events, "output_audio_buffer.stopped") if e["response_id"] == first["id"]]
    return cancelled or (bool(cleared) and not played_out)


async def test_own_voice_does_not_barge_in_but_the_user_does(
    tmp_path: Path, tiny_model_dir: Path, speech_wav: Path
) -> None:
    events = await speakerphone_call(tmp_path, tiny_model_dir, speech_wav, echo_guard=True, interrupt_after_s=None)
    assert len(kinds(events, "input_audio_buffer.speech_started")) == 1, "the agent's own voice started a turn"
    done = kinds(events, "response.done")
    assert done and done[0]["response"]["status"] in ("completed", "incomplete")  # not cancelled
    assert kinds(events, "output_audio_buffer.stopped"), "the reply did not play out"

    events = await speakerphone_call(tmp_path, tiny_model_dir, speech_wav, echo_guard=True, interrupt_after_s=0.8)
    assert len(kinds(events, "input_audio_buffer.speech_started")) >= 2
    assert barged_in(events)


async def test_without_the_level_guard_the_echo_barges_in(
    tmp_path: Path, tiny_model_dir: Path, speech_wav: Path
) -> None:
    events = await speakerphone_call(tmp_path, tiny_model_dir, speech_wav, echo_guard=False, interrupt_after_s=None)
    assert len(kinds(events, "input_audio_buffer.speech_started")) >= 2
    assert barged_in(events)
