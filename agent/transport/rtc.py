"""A WebRTC call: one aiortc peer bound to a Session.

The client (the offerer) creates the `oai-events` data channel; the agent takes it in
`datachannel` and never opens its own. Audio stays on the media tracks: the microphone track
is drained into the session, the agent's voice is the session's AgentAudioTrack. Server
events emitted before the channel opens wait (bounded) and go out in order once it does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Executor
from typing import Any, Callable, Optional

from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from opentelemetry.trace import Tracer

from agent import metrics
from agent.config import Config
from agent.engine.loop import Engine
from agent.gate.ladder import Admission
from agent.media.semantic_turn import CompletenessJudge
from agent.realtime import client_events
from agent.realtime.events import error_event, new_id
from agent.realtime.session import Session
from agent.serve.ownership import call_id
from agent.transport.jitter import lower_audio_jitter_hold
from agent.transport.peer import close_peer

log = logging.getLogger(__name__)

EVENTS_LABEL = "oai-events"
_MAX_PENDING_EVENTS = 256  # events held until the data channel opens


class RtcCall:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        admission: Admission,
        pc: RTCPeerConnection,
        settings: dict[str, Any],
        on_closed: Callable[["RtcCall"], None],
        decode_pool: Optional[Executor] = None,
        turn_judge: Optional[CompletenessJudge] = None,
        tracer: Optional[Tracer] = None,
    ) -> None:
        self.id = call_id(config.call_id_prefix, new_id("rtc"))
        # Set when the offer's answer is returned: until then a replica counts the call as an
        # offer in flight (agent/serve/replica.py), not as a session as well.
        self.answered = False
        self.config = config
        self.pc = pc
        self._channel: Optional[RTCDataChannel] = None
        self._pending: list[str] = []
        self._tasks: list[asyncio.Task] = []
        self._closing: Optional[asyncio.Future] = None
        self._deadline: Optional[asyncio.TimerHandle] = None
        self.session = Session(
            config,
            engine,
            admission,
            send=self._send,
            on_closed=lambda _s: on_closed(self),
            webrtc=True,
            settings=settings,
            decode_pool=decode_pool,
            turn_judge=turn_judge,
            tracer=tracer,
        )
        self.session.on_close.append(self._teardown)
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    @property
    def track(self) -> MediaStreamTrack:
        assert self.session.track is not None
        return self.session.track

    def start(self) -> None:
        self.session.start()

    def answer_sent(self) -> None:
        """The SDP answer is on its way. A peer that takes it and never connects would hold a
        session slot forever, so the connect deadline starts now: not at the offer, since the
        answer waits for the engine to open the session (up to connect_timeout_s as well), and a
        slow open must not eat the peer's time to connect (a call answered after 17 s on a
        loaded replica was closed before its peer had the answer)."""
        self.answered = True
        self._deadline = asyncio.get_running_loop().call_later(self.config.connect_timeout_s, self._connect_deadline)

    async def close(self) -> None:
        await self.session.close()

    async def _teardown(self) -> None:
        # The timer holds our bound method and a cancelled task's traceback holds its frame:
        # both would keep the call (peer, tracks, session, resampler threads) alive until a
        # rare full GC; close_peer breaks the cycles aiortc itself leaves (agent/transport/peer.py).
        if self._deadline is not None:
            self._deadline.cancel()
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self._channel is not None:
            self._channel.remove_all_listeners()  # its message handler refers to this call
        self._channel = None
        await close_peer(self.pc)

    def _connect_deadline(self) -> None:
        if not self.session.closed and self.pc.connectionState != "connected":
            log.info("call %s: not connected after %.0f s, closing", self.id, self.config.connect_timeout_s)
            metrics.OFFERS_REJECTED.labels(reason="connect_timeout").inc()
            self._closing = asyncio.ensure_future(self.close())

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "failed" and not self.session.closed:
            # The peer stopped answering (ICE consent lost, DTLS failed): the call ends without a
            # word from the client, so say it where an operator looks.
            log.warning("call %s: connection failed (ICE %s), ending the call", self.id, self.pc.iceConnectionState)
        if state in ("failed", "closed"):
            await self.close()

    # ---- media ----------------------------------------------------------------------------
    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            for transceiver in self.pc.getTransceivers():
                if transceiver.receiver.track is track:
                    lower_audio_jitter_hold(transceiver.receiver, self.config.jitter_prefetch)
            self._tasks.append(asyncio.ensure_future(self._read(track, self.session.push_audio)))
        elif track.kind == "video":
            self._tasks.append(asyncio.ensure_future(self._read(track, self.session.push_video)))

    async def _read(self, track: MediaStreamTrack, push: Callable[[Any], None]) -> None:
        # Drained continuously: aiortc's receive queue is unbounded. A track that ends leaves
        # the session running (the peer may still talk on the data channel).
        failures = 0
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            try:
                push(frame)
            except Exception as exc:
                # A frame the ingest cannot take must not silently stop this track's reader:
                # drop it, and tell the client (once, then every 100th) instead.
                if failures % 100 == 0:
                    log.exception("call %s: %s frame dropped", self.id, track.kind)
                    self.session.emit_error(
                        f"{track.kind} frame dropped: {type(exc).__name__}: {exc}", "invalid_media", kind="server_error"
                    )
                failures += 1

    # ---- events ---------------------------------------------------------------------------
    def _send(self, text: str) -> None:
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            _send_event(channel, text, self.id)
        elif len(self._pending) < _MAX_PENDING_EVENTS:
            self._pending.append(text)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_LABEL:
            return
        self._channel = channel

        def flush_pending() -> None:
            pending, self._pending = self._pending, []
            for text in pending:
                _send_event(channel, text, self.id)

        if channel.readyState == "open":
            flush_pending()
        else:
            channel.on("open", flush_pending)
        channel.on("message", lambda message: client_events.handle(self.session, message))


def _send_event(channel: RTCDataChannel, text: str, call: str) -> None:
    """One server event on the data channel. One larger than the peer takes (its SDP's
    a=max-message-size; 64 KiB where it names none, RFC 8841: Pion's) cannot go: the client gets
    an `error` naming the event it missed. The send used to raise inside the event's handler,
    after its change was made, and the client was told the change had failed."""
    try:
        channel.send(text)
    except ValueError as exc:  # aiortc: larger than the remote's maximum message size
        metrics.ERRORS.labels(where="event_too_large").inc()
        try:
            kind = json.loads(text).get("type", "?")
        except ValueError:
            kind = "?"
        log.warning("call %s: a %s event not sent: %s", call, kind, exc)
        notice = error_event(f"a {kind} event was not sent: {exc}", "event_too_large", kind="server_error")
        channel.send(json.dumps({**notice, "event_id": new_id("event")}))
