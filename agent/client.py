"""A loopback client peer: sends a WAV (then silence) and synthetic video, measures replies.

Used by the integration tests and by scripts/bench_rtc.py. It measures what a user would:
voice-to-voice is the time from the real end of speech in the sent audio to the first
audible sample received back.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from .jitter import lower_audio_jitter_hold
from .peer import close_peer

SEND_RATE = 48_000
SEND_FRAME = 960  # 20 ms
AUDIBLE_RMS = 10 ** (-50 / 20) * 32768  # int16 RMS above -50 dBFS counts as sound


def load_wav_mono(path: Path, rate: int = SEND_RATE) -> np.ndarray:
    """int16 mono at `rate` (linear interpolation; good enough for speech probes)."""
    with wave.open(str(path)) as w:
        src_rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32)
    pcm = pcm.reshape(-1, channels).mean(axis=1)
    n = int(len(pcm) * rate / src_rate)
    return np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm).astype(np.int16)


def speech_end_sample(pcm: np.ndarray, rate: int = SEND_RATE, threshold_db: float = -40.0) -> int:
    """Index just past the last 10 ms window louder than threshold_db."""
    win = rate // 100
    n = len(pcm) // win
    rms = np.sqrt((pcm[: n * win].astype(np.float64).reshape(n, win) ** 2).mean(axis=1))
    loud = np.nonzero(rms > 10 ** (threshold_db / 20) * 32768)[0]
    return int((loud[-1] + 1) * win) if len(loud) else 0


class WavTrack(MediaStreamTrack):
    """Plays pcm once (then silence forever), paced to the wall clock like a microphone."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray, repeat_after_s: Optional[float] = None, speech_end: Optional[int] = None) -> None:
        super().__init__()
        self._pcm = pcm
        self._speech_end = speech_end_sample(pcm) if speech_end is None else speech_end
        self.speech_ends: list[float] = []  # wall time the speech ended, one per play
        self._pos = 0
        self._start: Optional[float] = None
        self._pts = 0
        self._repeat_after = repeat_after_s
        self.plays = 0

    def play(self) -> None:
        """Speak the WAV again from its start, now (e.g. over the agent: barge-in)."""
        self._pos = 0
        self.plays += 1

    async def recv(self) -> av.AudioFrame:
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._pts / SEND_RATE - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        chunk = self._pcm[self._pos : self._pos + SEND_FRAME]
        if len(chunk) and self._pos < len(self._pcm):
            now = time.monotonic()
            last = self._speech_end - 1
            if self._pos <= last < self._pos + SEND_FRAME:
                # The frame holding the last speech sample leaves now; speech ends inside it.
                self.speech_ends.append(now + (last - self._pos) / SEND_RATE)
        self._pos += SEND_FRAME
        if len(chunk) < SEND_FRAME:
            chunk = np.concatenate([chunk, np.zeros(SEND_FRAME - len(chunk), np.int16)])
        if self._repeat_after is not None and self._pos >= len(self._pcm) + self._repeat_after * SEND_RATE:
            self.play()
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = SEND_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, SEND_RATE)
        self._pts += SEND_FRAME
        return frame


class PatternVideoTrack(MediaStreamTrack):
    """A moving colour pattern, like a camera, at `fps`."""

    kind = "video"

    def __init__(self, width: int = 320, height: int = 240, fps: int = 10) -> None:
        super().__init__()
        self._w, self._h, self._fps = width, height, fps
        self._n = 0
        self._start: Optional[float] = None

    async def recv(self) -> av.VideoFrame:
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._n / self._fps - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        x = np.arange(self._w, dtype=np.uint16)[None, :]
        y = np.arange(self._h, dtype=np.uint16)[:, None]
        img = np.stack([(x + 4 * self._n) % 256 + 0 * y, (y + 2 * self._n) % 256 + 0 * x,
                        ((x + y) // 2) % 256], axis=-1).astype(np.uint8)
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = int(self._n * 90_000 / self._fps)
        frame.time_base = fractions.Fraction(1, 90_000)
        self._n += 1
        return frame


@dataclass
class ClientResult:
    events: list[dict[str, Any]] = field(default_factory=list)
    received_samples: int = 0
    audible_samples: int = 0
    first_audible_at: Optional[float] = None  # wall time of the first audible received frame
    audible_onsets: list[float] = field(default_factory=list)  # audible after >= 0.3 s of quiet
    glitches: int = 0  # quiet 20 ms frames between audible ones inside a reply (underruns heard)
    audible_log: list[tuple[float, int]] = field(default_factory=list)  # (wall time, samples) per audible frame
    _last_audible: Optional[float] = None
    peak_rms: float = 0.0
    session_id: str = ""

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]


class AgentClient:
    """One aiortc peer talking to the agent at base_url over loopback."""

    def __init__(self, base_url: str, wav: Path, video: bool = True, repeat_after_s: Optional[float] = None,
                 receive_prefetch: Optional[int] = 1, video_fps: int = 10) -> None:
        """receive_prefetch: frames aiortc holds before playing received audio; 1 (20 ms)
        is browser-like, None keeps aiortc's default of 4 (80 ms)."""
        self.base_url = base_url
        self.pcm = load_wav_mono(wav)
        self.speech_end = speech_end_sample(self.pcm)
        self.audio = WavTrack(self.pcm, repeat_after_s, self.speech_end)
        self.video = PatternVideoTrack(fps=video_fps) if video else None
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.result = ClientResult()
        self._prefetch = receive_prefetch
        self._tasks: list[asyncio.Task] = []
        self._event_waiters: list[tuple[str, asyncio.Future]] = []
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        event["_t"] = time.monotonic()
        self.result.events.append(event)
        for kind, fut in list(self._event_waiters):
            if kind == event.get("type") and not fut.done():
                fut.set_result(event)
                self._event_waiters.remove((kind, fut))

    async def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        for event in self.result.events:
            if event.get("type") == kind:
                return event
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._event_waiters.append((kind, fut))
        return await asyncio.wait_for(fut, timeout)

    async def connect(self) -> None:
        """Offer, and apply the agent's answer: ICE and DTLS then connect the call."""
        await self.pc.setRemoteDescription(await self.offer())

    async def offer(self) -> RTCSessionDescription:
        """Add the tracks, send the offer and return the agent's answer, not yet applied
        (a client that stops here is one whose call never connects)."""
        self.pc.addTrack(self.audio)
        if self.video is not None:
            self.pc.addTrack(self.video)

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                if self._prefetch is not None:
                    for t in self.pc.getTransceivers():
                        if t.receiver.track is track:
                            lower_audio_jitter_hold(t.receiver, self._prefetch)
                self._tasks.append(asyncio.ensure_future(self._read_audio(track)))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.base_url}/offer", json={
                "sdp": self.pc.localDescription.sdp, "type": self.pc.localDescription.type}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"offer refused: {resp.status} {body}")
        self.result.session_id = body["session_id"]
        return RTCSessionDescription(sdp=body["sdp"], type=body["type"])

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            pcm = frame.to_ndarray().astype(np.float64)
            rms = float(np.sqrt((pcm**2).mean())) if pcm.size else 0.0
            self.result.received_samples += frame.samples
            r = self.result
            if rms > AUDIBLE_RMS:
                now = time.monotonic()
                r.audible_samples += frame.samples
                if len(r.audible_log) < 100_000:  # bounded: ~30 min of audio
                    r.audible_log.append((now, frame.samples))
                r.peak_rms = max(r.peak_rms, rms)
                if r.first_audible_at is None:
                    r.first_audible_at = now
                if r._last_audible is None or now - r._last_audible >= 0.3:
                    r.audible_onsets.append(now)
                elif now - r._last_audible > 0.03:
                    r.glitches += 1  # a short hole inside a reply: heard as a click/gap
                r._last_audible = now

    def voice_to_voice(self) -> Optional[float]:
        """End of speech in the sent audio → first audible received sample (seconds)."""
        turns = self.turn_latencies()
        return turns[0] if turns else None

    def turn_latencies(self) -> list[Optional[float]]:
        """Voice-to-voice for each play of the WAV (None: no reply heard before the next play)."""
        ends = self.audio.speech_ends
        out: list[Optional[float]] = []
        for i, end in enumerate(ends):
            nxt = ends[i + 1] if i + 1 < len(ends) else float("inf")
            onset = next((t for t in self.result.audible_onsets if end < t < nxt), None)
            out.append(None if onset is None else onset - end)
        return out

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # A cancelled task's traceback holds _read_audio's frame, and so this client; an
        # offer that never connected leaves the channel (with our listener) in aiortc's queue.
        self._tasks.clear()
        self.channel.remove_all_listeners()
        await close_peer(self.pc)
