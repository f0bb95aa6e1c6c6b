"""One peer: drains its tracks, decides turns, talks to the engine, speaks and captions.

Everything here runs on the asyncio loop. Engine output arrives through the ReplySink
methods (scheduled with call_soon_threadsafe by the engine thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from . import metrics
from .bridge import FrameRing
from .config import Config
from .engine import Engine, EngineBusy
from .engine.api import AudioOut, ReplyDone, TextDelta
from .ingest import AudioIn, VideoSample, VideoSampler
from .jitter import lower_audio_jitter_hold
from .ladder import LEVEL_NAMES, Admission
from .peer import close_peer
from .playout import AgentAudioTrack
from .vad import Endpointer, SpeechAudio, SpeechStarted, SpeechStopped

log = logging.getLogger(__name__)

_MAX_PENDING_EVENTS = 64  # events held until the data channel opens
_SSE_QUEUE = 256  # per SSE subscriber; a subscriber that falls this far behind is dropped


@dataclass
class _Reply:
    response_id: str
    end_of_turn: float  # time.monotonic() when the endpointer ended the turn
    text: str = ""
    ttft: Optional[float] = None
    ttfa: Optional[float] = None
    engine_open: bool = True  # no ReplyDone received yet
    text_only: bool = False


class Session:
    def __init__(self, config: Config, engine: Engine, pc: RTCPeerConnection, admission: Admission,
                 on_closed: Callable[["Session"], None]) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.config = config
        self.engine = engine
        self.pc = pc
        self._on_closed = on_closed
        self.admission = admission
        self._unlisten: Optional[Callable[[], None]] = None
        self.track = AgentAudioTrack(upsample_to_48k=True)
        self.audio_in = AudioIn()
        self.video = VideoSampler(fps=config.video_fps, max_side=config.video_max_side)
        self.frames: FrameRing[VideoSample] = FrameRing(config.ingest_buffer_frames, kind="video")
        self.endpointer = Endpointer(
            silence_ms=config.vad_silence_ms,
            min_speech_ms=config.vad_min_speech_ms,
            aggressiveness=config.vad_aggressiveness,
            max_turn_s=config.max_turn_seconds,
        )
        self.text_only = False
        self._channel: Optional[RTCDataChannel] = None
        self._pending: list[str] = []
        self._sse: list[asyncio.Queue] = []
        self._tasks: list[asyncio.Task] = []
        self._reply: Optional[_Reply] = None
        self._stale_done = 0  # ReplyDone events still owed by cancelled replies
        self._history: deque[tuple[str, str]] = deque(maxlen=8)  # for the text-only fallback model
        self._closed = False
        self._closing: Optional[asyncio.Future] = None
        self._deadline: Optional[asyncio.TimerHandle] = None
        self.turns = 0

        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self.engine.open_session(self.id, self)
        self._unlisten = self.admission.listen(self._on_level)
        self.emit({"type": "session.created", "session_id": self.id,
                   "mode": LEVEL_NAMES[self.admission.ladder.level]})
        # A peer that takes its answer and never connects would hold a session slot forever.
        self._deadline = asyncio.get_running_loop().call_later(self.config.connect_timeout_s, self._connect_deadline)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The timer and the ladder hold our bound methods; drop them so that the session
        # (its peer, tracks and resampler threads) is freed when the call ends (issue 14).
        if self._deadline is not None:
            self._deadline.cancel()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        for task in self._tasks:
            task.cancel()
        # A cancelled task's traceback holds its coroutine's frame, and so this session.
        self._tasks.clear()
        try:
            self.engine.close_session(self.id)
        except EngineBusy:
            log.warning("session %s: engine inbox full on close", self.id)
        for q in self._sse:
            if not q.full():
                q.put_nowait(None)
        self.frames.clear()  # the ring's gauge is a sum over sessions
        self.track.stop()
        self.audio_in.close()
        await close_peer(self.pc)
        self._on_closed(self)

    def _connect_deadline(self) -> None:
        if not self._closed and self.pc.connectionState != "connected":
            log.info("session %s: not connected after %.0f s, closing", self.id, self.config.connect_timeout_s)
            metrics.OFFERS_REJECTED.labels(reason="connect_timeout").inc()
            # Not in _tasks: close() cancels those, and must not cancel itself.
            self._closing = asyncio.ensure_future(self.close())

    async def _on_connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            await self.close()

    # ---- tracks ----------------------------------------------------------------------
    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            for transceiver in self.pc.getTransceivers():
                if transceiver.receiver.track is track:
                    lower_audio_jitter_hold(transceiver.receiver, self.config.jitter_prefetch)
            self._tasks.append(asyncio.ensure_future(self._read_audio(track)))
        elif track.kind == "video":
            self._tasks.append(asyncio.ensure_future(self._read_video(track)))

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        # Drained continuously: aiortc's receive queue is unbounded.
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            for chunk in self.audio_in.push(frame):
                for event in self.endpointer.push(chunk):
                    self._on_turn_event(event)
            for event in self.endpointer.peek(*self.audio_in.partial):
                self._on_turn_event(event)

    async def _read_video(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            sample = self.video.push(frame, self.audio_in.clock)
            if sample is not None:
                self.frames.put(sample)

    # ---- turns -----------------------------------------------------------------------
    def _on_turn_event(self, event: object) -> None:
        try:
            if isinstance(event, SpeechStarted):
                self._barge_in()
                self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": int(event.at * 1000)})
            elif isinstance(event, SpeechAudio):
                self.engine.append_audio(self.id, event.chunk.pcm)
            elif isinstance(event, SpeechStopped):
                self.emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": int(event.end_of_speech * 1000)})
                self._begin_reply()
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            self.emit_error("engine is overloaded; this turn was dropped", "engine_busy")

    def _begin_reply(self) -> None:
        now = time.monotonic()
        if not self.admission.turns.allow():
            metrics.TURNS_REJECTED.inc()
            self.engine.discard_turn(self.id)
            self.emit_error("too many turns on this engine right now; please repeat", "rate_limited")
            return
        images = [s.image for s in self.frames.latest(self.config.video_frames_per_turn)]
        # The ladder's level applies to new replies; a reply keeps its mode to the end.
        level = self.admission.ladder.level
        mode = "audio"
        if level >= 2 and self.engine.has_fallback:
            mode = "fallback"
        elif level >= 1 or self.text_only:
            mode = "text"
        self.engine.begin_reply(self.id, images, mode=mode, history=tuple(self._history))
        self.turns += 1
        metrics.TURNS.inc()
        self._reply = _Reply(response_id="resp_" + uuid.uuid4().hex[:10], end_of_turn=now,
                             text_only=mode != "audio")
        self.track.begin_reply()
        self.emit({"type": "response.created", "response_id": self._reply.response_id, "mode": mode})

    def _barge_in(self) -> None:
        """The user speaks over the reply: stop generating and drop queued audio at once."""
        reply = self._reply
        dropped = self.track.flush()  # also ends the track's reply
        if reply is None:
            return
        if reply.engine_open:
            self.engine.cancel_reply(self.id)
            self._stale_done += 1
            self._finish(reply, "cancelled", {"dropped_audio_s": round(dropped, 3)})
        elif dropped > 0:
            self.emit({"type": "response.audio.cancelled", "response_id": reply.response_id,
                       "dropped_audio_ms": int(dropped * 1000)})
        self._reply = None

    # ---- engine output (ReplySink) -----------------------------------------------------
    def on_text(self, delta: TextDelta) -> None:
        reply = self._live_reply()
        if reply is None:
            return
        if reply.ttft is None:
            reply.ttft = time.monotonic() - reply.end_of_turn
            metrics.TTFT.observe(reply.ttft)
        reply.text += delta.text
        self.emit({"type": "response.text.delta", "response_id": reply.response_id, "delta": delta.text})

    def on_audio(self, audio: AudioOut) -> None:
        reply = self._live_reply()
        if reply is None:
            return
        if reply.ttfa is None:
            # TTFA: end of turn -> first audio handed to the outbound track.
            reply.ttfa = time.monotonic() - reply.end_of_turn
            metrics.TTFA.observe(reply.ttfa)
            self.emit({"type": "response.audio.started", "response_id": reply.response_id,
                       "ttfa_ms": round(reply.ttfa * 1000, 1)})
        self.track.push(audio.pcm)

    def on_done(self, done: ReplyDone) -> None:
        if self._stale_done:
            self._stale_done -= 1
            return
        reply = self._reply
        if reply is None or not reply.engine_open:
            return
        reply.engine_open = False
        if done.reason == "error":
            metrics.ERRORS.labels(where="engine").inc()
            self.emit_error(f"reply failed: {done.stats.get('error', 'engine error')}", "engine_error")
        self.track.end_reply()
        if reply.text:
            self._history.append(("assistant", reply.text))
        first_response = reply.ttft if reply.text_only else reply.ttfa
        if first_response is not None:
            self.admission.observe(first_response)
        self._finish(reply, {"stop": "completed", "length": "incomplete"}.get(done.reason, done.reason), done.stats)

    def _on_level(self, level: int) -> None:
        p95 = self.admission.ladder.current_p95()
        self.emit({"type": "response.mode", "mode": LEVEL_NAMES[level],
                   "reason": f"p95 first-response latency {p95 * 1000:.0f} ms" if p95 is not None else "recovered"})

    def _live_reply(self) -> Optional[_Reply]:
        if self._stale_done or self._reply is None or not self._reply.engine_open:
            return None
        return self._reply

    def _finish(self, reply: _Reply, status: str, stats: dict) -> None:
        def ms(v: Optional[float]) -> Optional[float]:
            return None if v is None else round(v * 1000, 1)

        self.emit({"type": "response.done", "response_id": reply.response_id, "status": status,
                   "text": reply.text, "ttft_ms": ms(reply.ttft), "ttfa_ms": ms(reply.ttfa),
                   "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}})

    # ---- events out (data channel + SSE) ---------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        text = json.dumps(event)
        if self._channel is not None and self._channel.readyState == "open":
            self._channel.send(text)
        elif len(self._pending) < _MAX_PENDING_EVENTS:
            self._pending.append(text)
        for q in list(self._sse):
            try:
                q.put_nowait(text)
            except asyncio.QueueFull:
                # A stalled reader loses its stream, not our memory; its handler sees
                # it is no longer subscribed at its next keep-alive and ends the response.
                self._sse.remove(q)

    def emit_error(self, message: str, code: str) -> None:
        self.emit({"type": "error", "error": {"message": message, "code": code}})

    def subscribed(self, q: asyncio.Queue) -> bool:
        return q in self._sse and not self._closed

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=_SSE_QUEUE)
        self._sse.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        if q in self._sse:
            self._sse.remove(q)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != "events":
            return
        self._channel = channel

        def flush_pending() -> None:
            pending, self._pending = self._pending, []
            for text in pending:
                channel.send(text)

        if channel.readyState == "open":
            flush_pending()
        else:
            channel.on("open", flush_pending)
        channel.on("message", self._on_client_message)

    def _on_client_message(self, message: str | bytes) -> None:
        try:
            event = json.loads(message)
            kind = event["type"]
            if not isinstance(kind, str):
                raise TypeError
        except (ValueError, TypeError, KeyError, IndexError):
            self.emit_error("client events must be JSON objects with a 'type'", "invalid_event")
            return
        if kind == "response.cancel":
            self._barge_in()
        elif kind == "session.update":
            body = event.get("session")
            modalities = body.get("modalities") if isinstance(body, dict) else None
            if not isinstance(modalities, list) or not set(modalities) <= {"text", "audio"} or not modalities:
                self.emit_error("session.update needs session.modalities: a list of 'text'/'audio'", "invalid_event")
                return
            self.text_only = "audio" not in modalities
            self.emit({"type": "session.updated", "session": {"modalities": sorted(modalities)}})
        else:
            self.emit_error(f"unknown event type {kind!r}", "unknown_event")
