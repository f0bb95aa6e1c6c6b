"""A session's responses: the one in progress, the one whose audio plays, the latest one, and
the turns held for later (interpreter mode), from response.create to response.done.

A `Session` owns one `Replies`; it alone changes that state. It starts replies on the engine,
turns the engine's output (the session's ReplySink calls) into GA server events and the
outbound track's audio, cancels on barge-in or response.cancel (cutting the model's context to
what was heard, agent/realtime/edits.py), and runs work that must wait until every cancelled
reply has ended in the engine. It holds its session weakly: the session holds it, and a cycle
would outlive the call until a full collection (see Session.close).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent import metrics
from agent.config import OUTPUT_RATE
from agent.engine.api import AudioOut, EngineBusy, ReplyDone, TextDelta
from agent.realtime import edits, session_config
from agent.realtime.response import STATUS_BY_REASON, Response

if TYPE_CHECKING:
    from agent.realtime.session import Session


class Replies:
    def __init__(self, session: "Session") -> None:
        self._session = weakref.proxy(session)
        self.current: Optional[Response] = None  # the response in progress
        self.playing: Optional[Response] = None  # the response whose audio the track plays (WebRTC)
        self.last: Optional[Response] = None  # the latest response (what a truncation may cut)
        self._stale_done = 0  # ReplyDone events still owed by cancelled replies
        # Interpreter mode: the user items of ended turns the engine holds, answered in order after `current`.
        self._held: deque[str] = deque()
        self._when_engine_idle: list[Callable[[], None]] = []
        self.history: deque[tuple[str, str]] = deque(maxlen=8)  # for the text-only fallback model

    @property
    def in_flight(self) -> bool:
        """A response is being made, a cancelled one's engine work is still winding down, or a
        turn waits to be answered."""
        return self.current is not None or bool(self._stale_done) or bool(self._held)

    @property
    def active(self) -> bool:
        """A reply is being made or its audio is still playing out (what a shutdown waits for)."""
        return self.current is not None or self.playing is not None

    def forget_last(self) -> None:
        """The latest reply's item was deleted: nothing is left to truncate."""
        self.last = None

    def remember(self, role: str, text: str) -> None:
        """A user text message, for the fallback model's short history (it has no KV context)."""
        self.history.append((role, text))

    def close(self) -> None:
        """The session closed: pending engine-idle work refers back to it; drop it."""
        self._when_engine_idle.clear()
        self._held.clear()

    def respond_to_turn(self, item_id: str) -> None:
        """Server VAD ended a turn that asks for a response. In interpreter mode a turn that ends
        while the previous translation is still being made does not wait for an error: the engine
        holds it apart (the next utterance's audio does not join it) and it is answered as soon
        as that translation ends, in order; its audio plays after the previous one's."""
        s = self._session
        if (self.current is not None or self._held) and session_config.interpret_to(s.settings):
            if not s.admission.turns.allow():
                metrics.TURNS_REJECTED.inc()
                s.engine.discard_turn(s.id)
                s.emit_error(
                    "too many turns on this engine right now; please repeat", "rate_limited", kind="server_error"
                )
                return
            s.engine_call("hold_turn")  # (EngineBusy: the turn is dropped, nothing is held)
            self._held.append(item_id)
            return
        self.create_response({}, None)

    def _answer_held(self) -> None:
        """The reply before a held turn has ended: answer the held turn now."""
        s = self._session
        if s.closed or not self._held or self.current is not None:
            return
        item_id = self._held.popleft()
        try:
            self.create_response({}, None, held=item_id)
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            s.emit_error("engine is overloaded; this turn was dropped", "engine_busy", kind="server_error")

    def create_response(self, params: dict[str, Any], event_id: Optional[str], held: Optional[str] = None) -> None:
        """held: the user item of a turn the engine held (respond_to_turn), already admitted:
        its answer follows that item, and its audio queues behind the previous reply's."""
        s = self._session
        if s.transcription_only:
            s.emit_error("a transcription session does not respond", "unsupported", param="type", event_id=event_id)
            return
        if self.current is not None:
            s.emit_error(
                f"a response is in progress ({self.current.id})",
                "conversation_already_has_active_response",
                event_id=event_id,
            )
            return
        if not held and not s.admission.turns.allow():
            metrics.TURNS_REJECTED.inc()
            s.engine.discard_turn(s.id)
            s.emit_error(
                "too many turns on this engine right now; please repeat",
                "rate_limited",
                kind="server_error",
                event_id=event_id,
            )
            return
        if self.playing is not None and not held:
            self.clear_output()  # a new reply does not queue behind the old one's audio
        mode = s.reply_mode(params.get("output_modalities") or s.settings["output_modalities"])
        if held and mode == "fallback":
            mode = "text"  # the held turn is in the Omni model's hands (the fallback would drop it)
        limit = session_config.max_output_tokens(params.get("max_output_tokens", s.settings["max_output_tokens"]))
        if limit is not None and limit >= s.config.max_reply_tokens:
            limit = None  # the engine's own cap ends the reply there (as "incomplete", with its stats)
        if params.get("instructions"):
            s.engine_call("set_reply_instructions", params["instructions"])
        s.video.flush_for_turn()  # the newest frames reach the engine ahead of the reply
        s.engine.begin_reply(s.id, [], mode=mode, history=tuple(self.history))
        s.turns += 1
        metrics.TURNS.inc()
        voice = s.settings["audio"]["output"].get("voice") or "default"
        reply = Response(
            audio=mode == "audio",
            mode=mode,
            end_of_turn=time.monotonic(),
            conversation_id=s.conversation_id,
            voice=voice if isinstance(voice, str) else "default",
            max_tokens=limit,
            metadata=params.get("metadata"),
        )
        self.current = self.last = reply
        if s.track is not None and reply.audio:
            s.track.begin_reply()
            self.playing = reply
        previous = s.conversation.add(reply.item("in_progress", ""), after=held)
        for event in reply.started(previous):
            s.emit(event)

    def cancel_response(self, event_id: Optional[str]) -> None:
        s = self._session
        if self.current is None:
            s.emit_error("there is no response to cancel", "response_cancel_not_active", event_id=event_id)
            return
        self.interrupt("client_cancelled")

    def interrupt(self, reason: str) -> None:
        """Barge-in or response.cancel: stop generating and drop queued audio at once. A barge-in
        also cuts the reply in the model's context to the words the user heard (WebRTC: the
        agent knows what was played)."""
        s = self._session
        playing, heard = self.playing, 0
        if playing is not None:
            heard = playing.samples - round(self.clear_output() * OUTPUT_RATE)
        reply = self.current
        if reply is not None and reply.engine_open:
            s.engine.cancel_reply(s.id)
            self._stale_done += 1
            self._finish(reply, "cancelled", reason, {})
        if reason == "turn_detected" and playing is not None and playing is self.last:
            edits.truncate_to_heard(s, playing, max(0, heard))

    def clear_output(self) -> float:
        """output_audio_buffer.clear (WebRTC): the track drops what it has not played; returns
        the seconds dropped."""
        s = self._session
        playing, self.playing = self.playing, None
        if s.track is None:
            return 0.0
        dropped = s.track.flush()
        response_id = playing.id if playing is not None else (self.last.id if self.last else None)
        if response_id is not None:
            s.emit({"type": "output_audio_buffer.cleared", "response_id": response_id})
        return dropped

    def on_first_audio(self, _wall: float) -> None:
        s = self._session
        if self.playing is not None:
            s.emit(
                {
                    "type": "output_audio_buffer.started",
                    "response_id": self.playing.id,
                    "omni": {"ttfa_ms": None if self.playing.ttfa is None else round(self.playing.ttfa * 1000, 1)},
                }
            )

    def on_drained(self, _wall: float) -> None:
        s = self._session
        playing, self.playing = self.playing, None
        if playing is not None:
            s.emit({"type": "output_audio_buffer.stopped", "response_id": playing.id})

    # ---- engine output (the session's ReplySink calls) ---------------------------------
    def _live(self) -> Optional[Response]:
        if self._stale_done or self.current is None or not self.current.engine_open:
            return None
        return self.current

    def _since_end_of_turn(self, reply: Response, histogram: Any) -> float:
        """TTFT / TTFA: the reply's end of turn -> its first text / audio handed to the transport
        (recorded once per reply, by the caller), observed in `histogram` by priority."""
        elapsed = time.monotonic() - reply.end_of_turn
        histogram.labels(priority=self._session.priority).observe(elapsed)
        return elapsed

    def on_text(self, delta: TextDelta) -> None:
        s = self._session
        reply = self._live()
        if reply is None:
            return
        if reply.ttft is None:
            reply.ttft = self._since_end_of_turn(reply, metrics.TTFT)
        s.emit(reply.text_delta(delta.text, len(delta.token_ids)))
        if reply.max_tokens is not None and reply.tokens >= reply.max_tokens:
            # The client's max_output_tokens, under the server's own cap: end the reply here.
            s.engine.cancel_reply(s.id)
            self._stale_done += 1
            self._finish(reply, "incomplete", "max_output_tokens", {"text_tokens": reply.tokens})

    def on_audio(self, audio: AudioOut) -> None:
        s = self._session
        reply = self._live()
        if reply is None:
            return
        if reply.ttfa is None:
            reply.ttfa = self._since_end_of_turn(reply, metrics.TTFA)
        if s.track is not None:
            reply.samples += len(audio.pcm)
            s.track.push(audio.pcm)
        else:
            s.emit(reply.audio_delta(audio.pcm))

    def on_done(self, done: ReplyDone) -> None:
        s = self._session
        if self._stale_done:
            self._stale_done -= 1
            if not self._stale_done:
                waiting, self._when_engine_idle = self._when_engine_idle, []
                for fn in waiting:
                    fn()
            return
        reply = self.current
        if reply is None or not reply.engine_open:
            return
        error = None
        if done.reason == "error":
            metrics.ERRORS.labels(where="engine").inc()
            error = f"reply failed: {done.stats.get('error', 'engine error')}"
            s.emit_error(error, "engine_error", kind="server_error")
        if s.track is not None and self.playing is reply:
            s.track.end_reply()
        first_response = reply.ttfa if reply.audio else reply.ttft
        if first_response is not None:
            s.admission.observe(first_response)
        reason = {"length": "max_output_tokens"}.get(done.reason)
        self._finish(reply, STATUS_BY_REASON.get(done.reason, "failed"), reason, done.stats, error)

    def _finish(
        self, reply: Response, status: str, reason: Optional[str], stats: dict, error: Optional[str] = None
    ) -> None:
        s = self._session
        reply.engine_open = False
        if self.current is reply:
            self.current = None
        if reply.text:
            self.remember("assistant", reply.text)
        events = reply.finished(status, reason, stats, error)
        s.conversation.update(reply.item_id, events[-2]["item"])
        for event in events:
            s.emit(event)
        if self._held:  # once the engine has ended this reply (a cancelled one's done comes later)
            self.after_engine_idle(self._answer_held)

    def after_engine_idle(self, fn: Callable[[], None]) -> None:
        """Run fn once the engine has ended every cancelled reply (a truncation needs that)."""
        if self._stale_done:
            self._when_engine_idle.append(fn)
        else:
            fn()
