"""A loopback client peer: sends a WAV (then silence) and synthetic video, measures replies.

Used by the integration tests and by scripts/bench_rtc.py. It speaks the Realtime API's GA
WebRTC form like a browser client: POST /v1/realtime/calls with the raw SDP offer, events on
the `oai-events` data channel it creates itself. It measures what a user would:
voice-to-voice is the time from the real end of speech in the sent audio to the first
audible sample received back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.client.media import PatternVideoTrack, ThrottledVideoTrack, WavTrack, load_wav_mono, speech_end_sample
from agent.transport.consent import install_consent_freshness
from agent.transport.jitter import lower_audio_jitter_hold
from agent.transport.peer import close_peer

AUDIBLE_RMS = 10 ** (-50 / 20) * 32768  # int16 RMS above -50 dBFS counts as sound


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
    call_id: str = ""  # rtc_…, from the Location header
    location: str = ""

    @property
    def session_id(self) -> str:  # the call id names the session in every /v1/realtime/calls route
        return self.call_id

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]


class AgentClient:
    """One aiortc peer talking to the agent at base_url (loopback in tests; `omni-agent call`
    anywhere). Its video obeys the agent's input_video.throttle events."""

    def __init__(
        self,
        base_url: str,
        wav: Optional[Path] = None,
        video: bool = True,
        repeat_after_s: Optional[float] = None,
        receive_prefetch: Optional[int] = 1,
        video_fps: int = 10,
        api_key: Optional[str] = None,
        session: Optional[dict[str, Any]] = None,
        audio_source: Optional[MediaStreamTrack] = None,
        video_source: Optional[MediaStreamTrack] = None,
        on_event: Optional[Callable[[dict[str, Any]], None]] = None,
        on_audio: Optional[Callable[[av.AudioFrame], None]] = None,
        video_max_fps: Optional[float] = None,
    ) -> None:
        """base_url: the agent's root (http://host:port). wav: speech to send (then silence);
        audio_source instead sends any audio track (a device or file through MediaPlayer).
        video: send the test pattern at video_fps, unless video_source names the camera track.
        receive_prefetch: frames aiortc holds before playing received audio; 1 (20 ms) is
        browser-like, None keeps aiortc's default of 4 (80 ms). api_key: sent as Bearer (the API
        key or an ek_ key). session: a GA session config sent with the offer (multipart); None
        sends the raw SDP only. on_event: called with every server event; on_audio with every
        received audio frame (the agent's voice: to a WAV file, a speaker). video_max_fps: the
        client's own cap on its camera rate (a throttle event can only lower it)."""
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.session_config = session
        self.audio: MediaStreamTrack
        if audio_source is not None:
            self.pcm, self.speech_end = np.zeros(0, np.int16), 0
            self.audio = audio_source
        else:
            assert wav is not None, "a WAV or an audio source is needed"
            self.pcm = load_wav_mono(wav)
            self.speech_end = speech_end_sample(self.pcm)
            self.audio = WavTrack(self.pcm, repeat_after_s, self.speech_end)
        source = video_source if video_source is not None else PatternVideoTrack(fps=video_fps) if video else None
        self.video = ThrottledVideoTrack(source, video_max_fps) if source is not None else None
        self._on_event = on_event
        self._on_audio = on_audio
        install_consent_freshness()  # as the agent's side: consent lasts 30 s past the last answer
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.result = ClientResult()
        self._prefetch = receive_prefetch
        self._tasks: list[asyncio.Task] = []
        self._event_waiters: list[tuple[str, asyncio.Future]] = []
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", self._on_message)

    def send(self, event: dict[str, Any]) -> None:
        """A client event on the data channel (it must be open: see wait_open)."""
        self.channel.send(json.dumps(event))

    async def wait_open(self, timeout: float = 10.0) -> None:
        for _ in range(int(timeout / 0.05)):
            if self.channel.readyState == "open":
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("the oai-events data channel did not open")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        event["_t"] = time.monotonic()
        self.result.events.append(event)
        if event.get("type") == "input_video.throttle" and self.video is not None:
            self.video.apply(event)
        if self._on_event is not None:
            self._on_event(event)
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

    async def connect(self, signal: Optional[Callable[[str], Awaitable[tuple[str, str]]]] = None) -> None:
        """Offer, POST it, apply the answer: ICE and DTLS then connect the call."""
        await self.pc.setRemoteDescription(await self.offer(signal))

    async def offer(
        self, signal: Optional[Callable[[str], Awaitable[tuple[str, str]]]] = None
    ) -> RTCSessionDescription:
        """Add the tracks, send the offer and return the agent's answer, not yet applied (a client
        that stops here is one whose call never connects). signal(offer_sdp) -> (answer_sdp,
        location) replaces the built-in POST (e.g. the openai SDK's realtime.calls.create)."""
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
        offer = self.pc.localDescription.sdp
        if signal is not None:
            answer, self.result.location = await signal(offer)
        else:
            answer = await self._post_offer(offer)
        self.result.call_id = self.result.location.rsplit("/", 1)[-1]
        return RTCSessionDescription(sdp=answer, type="answer")

    async def _post_offer(self, offer: str) -> str:
        async with aiohttp.ClientSession() as http:
            if self.session_config is None:
                data: Any = offer
                headers = {**self._headers(), "Content-Type": "application/sdp"}
            else:
                data = aiohttp.FormData()
                data.add_field("sdp", offer, content_type="application/sdp")
                data.add_field("session", json.dumps(self.session_config), content_type="application/json")
                headers = self._headers()
            async with http.post(f"{self.base_url}/v1/realtime/calls", data=data, headers=headers) as resp:
                body = await resp.text()
                if resp.status != 201:
                    raise RuntimeError(f"offer refused: {resp.status} {body}")
                self.result.location = resp.headers.get("Location", "")
                return body

    async def hangup(self) -> int:
        """DELETE the call; returns the HTTP status (204 when the agent ended it)."""
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{self.base_url}{self.result.location}", headers=self._headers()) as resp:
                return resp.status

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if self._on_audio is not None:
                self._on_audio(frame)
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
        speech_ends = self.audio.speech_ends if isinstance(self.audio, WavTrack) else []
        return latencies(speech_ends, self.result.audible_onsets)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # A cancelled task's traceback holds _read_audio's frame, and so this client; an
        # offer that never connected leaves the channel (with our listener) in aiortc's queue.
        self._tasks.clear()
        self.channel.remove_all_listeners()
        await close_peer(self.pc)


class WsAgentClient:
    """AgentClient's counterpart on the WebSocket transport (GET /v1/realtime): streams the WAV
    as 24 kHz pcm16 input_audio_buffer.append events paced like a microphone (then silence),
    collects server events, and times the first audible response.output_audio.delta after each
    end of speech (the WebSocket's voice-to-voice, without a playout buffer)."""

    CHUNK = 480  # 20 ms at 24 kHz

    def __init__(
        self,
        base_url: str,
        wav: Path,
        api_key: Optional[str] = None,
        model: str = "qwen3-omni",
        repeat_after_s: Optional[float] = None,
        session: Optional[dict[str, Any]] = None,
    ) -> None:
        self.url = base_url.rstrip("/").replace("http", "ws", 1) + f"/v1/realtime?model={model}"
        self.api_key = api_key
        self.session_config = session
        self.pcm = load_wav_mono(wav, rate=24_000)
        self.speech_end = speech_end_sample(self.pcm, rate=24_000)
        self.repeat_after_s = repeat_after_s
        self.result = ClientResult()
        self.speech_ends: list[float] = []  # wall time each play's speech ended
        self._http: Optional[aiohttp.ClientSession] = None
        self._ws: Optional[aiohttp.ClientWebSocketResponse] = None
        self._tasks: list[asyncio.Task] = []

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(
            self.url, headers=headers, protocols=("realtime",), max_msg_size=16 * 1024 * 1024
        )
        self._tasks.append(asyncio.ensure_future(self._read()))
        if self.session_config is not None:
            await self.send({"type": "session.update", "session": self.session_config})
        self._tasks.append(asyncio.ensure_future(self._speak()))

    async def send(self, event: dict[str, Any]) -> None:
        assert self._ws is not None
        await self._ws.send_str(json.dumps(event))

    async def _speak(self) -> None:
        start, sent = time.monotonic(), 0
        pos = 0
        silence = np.zeros(self.CHUNK, np.int16)
        while True:
            chunk = self.pcm[pos : pos + self.CHUNK] if pos < len(self.pcm) else silence
            if pos <= self.speech_end - 1 < pos + self.CHUNK:
                self.speech_ends.append(time.monotonic() + (self.speech_end - 1 - pos) / 24_000)
            if len(chunk) < self.CHUNK:
                chunk = np.concatenate([chunk, np.zeros(self.CHUNK - len(chunk), np.int16)])
            await self.send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk.astype("<i2").tobytes()).decode()}
            )
            pos += self.CHUNK
            sent += 1
            if self.repeat_after_s is not None and pos >= len(self.pcm) + self.repeat_after_s * 24_000:
                pos = 0
            wait = start + sent * self.CHUNK / 24_000 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            event = json.loads(msg.data)
            now = time.monotonic()
            if event.get("type") == "response.output_audio.delta":
                pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2").astype(np.float64)
                r = self.result
                r.received_samples += len(pcm)
                if pcm.size and float(np.sqrt((pcm**2).mean())) > AUDIBLE_RMS:
                    r.audible_samples += len(pcm)
                    if r.first_audible_at is None:
                        r.first_audible_at = now
                    if r._last_audible is None or now - r._last_audible >= 0.3:
                        r.audible_onsets.append(now)
                    r._last_audible = now
                event["delta"] = ""  # the audio is counted; keep the event list small
            event["_t"] = now
            self.result.events.append(event)

    async def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.result.events:
                if event.get("type") == kind:
                    return event
            await asyncio.sleep(0.02)
        raise asyncio.TimeoutError(kind)

    def turn_latencies(self) -> list[Optional[float]]:
        """End of speech → first audible audio delta received, per play of the WAV."""
        return latencies(self.speech_ends, self.result.audible_onsets)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()


def latencies(speech_ends: list[float], onsets: list[float]) -> list[Optional[float]]:
    """For each end of speech, the delay to the first audible onset before the next one (None:
    no reply heard in between)."""
    out: list[Optional[float]] = []
    for i, end in enumerate(speech_ends):
        nxt = speech_ends[i + 1] if i + 1 < len(speech_ends) else float("inf")
        onset = next((t for t in onsets if end < t < nxt), None)
        out.append(None if onset is None else onset - end)
    return out


class NotReady(RuntimeError):
    """The agent did not become ready: its last /healthz answer, or how its process ended."""


async def wait_ready(
    url: str, timeout_s: float = 180.0, proc: Optional[subprocess.Popen] = None, step_s: float = 0.1
) -> None:
    """Until GET url/healthz answers 200 (the agent loads its model first). Raises NotReady
    once timeout_s has passed, at once when the engine reports "failed", or when `proc` (the
    agent's process, when it is a child) has exited: a caller never goes on against an agent
    that is not there."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise NotReady(f"the agent exited with status {proc.returncode}")
            try:
                async with http.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
                    last = f"{resp.status} {await resp.text()}"
                    if '"failed"' in last:
                        raise NotReady(f"the agent's engine failed: /healthz said {last}")
            except aiohttp.ClientError as exc:
                last = f"no answer ({exc.__class__.__name__})"
            if time.monotonic() >= deadline:
                raise NotReady(f"the agent was not ready in {timeout_s:.0f} s: /healthz said {last}")
            await asyncio.sleep(step_s)
