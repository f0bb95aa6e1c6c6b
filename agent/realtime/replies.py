"""A session's responses: the one in progress, the one whose audio plays, the latest one, and
the turns held for later (interpreter mode), from response.create to response.done.

A `Session` owns one `Replies`; it alone changes that state. It starts replies on the engine,
turns the engine's output (the session's ReplySink calls) into GA server events, the
outbound audio (its part `audio`, agent/realtime/reply_audio.py) and output items in the
conversation (its part `_items`, agent/realtime/reply_items.py), cancels on barge-in or
response.cancel (a barge-in's cut of the model's context to what was heard is
agent/realtime/edits.py's), and runs work that must wait until every cancelled reply has ended
in the engine. It is given the ports it needs (the session's engine port, outbox, conversation,
settings, admission) and plain values, never the Session; the outbound track is set on `audio`
by the session once made (it calls back there), and `close()` drops what refers back (the
track's hooks into it are the session's to drop).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional

from agent import metrics
from agent.config import CODEC_FRAME_SAMPLES, OUTPUT_RATE, Config
from agent.engine.api import AudioOut, CallDelta, EngineBusy, ReplyDone, ReplyInput, TextDelta
from agent.engine.commands import HoldTurn, SetVoice, TruncateReply
from agent.gate.ladder import Admission
from agent.realtime import response_plan, session_checks, session_config
from agent.realtime.conversation import Conversation
from agent.realtime.engine_port import EnginePort
from agent.realtime.known_calls import KnownCalls
from agent.realtime.mcp_port import McpPort
from agent.realtime.outbox import Outbox
from agent.realtime.reply_audio import ReplyAudio
from agent.realtime.reply_items import ReplyItems
from agent.realtime.response import STATUS_BY_REASON, Response


class Replies:
    def __init__(
        self,
        engine: EnginePort,
        outbox: Outbox,
        conversation: Conversation,
        settings: Callable[[], dict[str, Any]],
        admission: Admission,
        config: Config,
        *,
        conversation_id: str,
        priority: str,
        transcription_only: bool,
        flush_video: Callable[[], None],
        mcp: McpPort,
    ) -> None:
        self._engine, self._outbox, self._conversation = engine, outbox, conversation
        self._settings, self._admission, self._config = settings, admission, config
        self._conversation_id, self._priority = conversation_id, priority
        self._transcription_only = transcription_only
        self._flush_video = flush_video  # the newest camera frames to the engine, ahead of a reply
        self.turns = 0  # replies begun
        self.current: Optional[Response] = None  # the response in progress
        self.audio = ReplyAudio(outbox)  # where the speech goes, and whose audio the track plays
        self.last: Optional[Response] = None  # the latest response (what a truncation may cut)
        self._stale_done = 0  # ReplyDone events still owed by cancelled replies
        # Interpreter mode: the user items of ended turns the engine holds, answered in order after `current`.
        self._held: deque[str] = deque()
        self._when_engine_idle: list[Callable[[], None]] = []
        self.history: deque[tuple[str, str]] = deque(maxlen=8)  # for the text-only fallback model
        # The calls a function_call_output may answer (the model's, and the client's replayed).
        self.calls = KnownCalls()
        self._mcp = mcp  # the session's MCP servers and the calls run on them
        # Where the outputs go in the list (a call of an MCP tool is routed, then run).
        self._items = ReplyItems(conversation, outbox, self.calls, mcp.route, mcp.ready)
        # The response a truncate or delete of its item cancelled (the engine cuts only an ended
        # reply), until the next begins: the one response.cancel for it then is answered by nothing.
        self._cancelled_by_edit: Optional[str] = None

    @property
    def in_flight(self) -> bool:
        """A response is being made, a cancelled one's engine work is still winding down, or a
        turn waits to be answered."""
        return self.current is not None or bool(self._stale_done) or bool(self._held)

    @property
    def active(self) -> bool:
        """A reply is being made or its audio is still playing out (what a shutdown waits for)."""
        return self.current is not None or self.audio.playing is not None

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

    def reply_mode(self, modalities: list[str]) -> str:
        """audio | text | fallback, by the degradation ladder's level and the modalities asked."""
        return response_plan.reply_mode(self._admission.ladder.level, self._engine.has_fallback, modalities)

    def respond_to_turn(self, item_id: str) -> bool:
        """Server VAD ended a turn that asks for a response. In interpreter mode a turn that ends
        while the previous translation is still being made does not wait for an error: the engine
        holds it apart (the next utterance's audio does not join it) and it is answered as soon
        as that translation ends, in order; its audio plays after the previous one's. Returns
        False when no response was begun (refused, or one in progress): the item stays in the
        conversation unanswered, its audio in the model's context, and the next response
        answers it with what follows, as after a commit that asks none."""
        if (self.current is not None or self._held) and session_config.interpret_to(self._settings()):
            if not self._admission.turns.allow():
                self._refuse_turn(None)
                return False
            self._engine.send(HoldTurn())  # (EngineBusy: the turn is dropped, nothing is held)
            self._held.append(item_id)
            return True
        return self.create_response({}, None)

    def _refuse_turn(self, event_id: Optional[str]) -> None:
        """Admission refused a response (too many turns on the engine). The conversation keeps
        what the client was told it holds (its committed items, their audio in the model's
        context), so nothing is rolled back; only a speculation on the turn's pause goes."""
        metrics.TURNS_REJECTED.inc()
        self._engine.drop_speculation()
        self._outbox.error(
            "too many turns on this engine right now: no response was made (the conversation keeps "
            "the turn; the next response answers it)",
            "rate_limited",
            kind="server_error",
            event_id=event_id,
        )

    def _answer_held(self) -> None:
        """The reply before a held turn has ended: answer the held turn now."""
        if self._engine.closed or not self._held or self.current is not None:
            return
        item_id = self._held.popleft()
        try:
            self.create_response({}, None, held=item_id)
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            self._outbox.error("engine is overloaded; this turn was dropped", "engine_busy", kind="server_error")

    def create_response(self, params: dict[str, Any], event_id: Optional[str], held: Optional[str] = None) -> bool:
        """held: the user item of a turn the engine held (respond_to_turn), already admitted:
        its answer follows that item, and its audio queues behind the previous reply's. Returns
        whether the response was begun (False: refused with an error event)."""
        settings = self._settings()
        if self._transcription_only:
            self._outbox.error(
                "a transcription session does not respond", "unsupported", param="type", event_id=event_id
            )
            return False
        if self.current is not None:
            self._outbox.error(
                f"a response is in progress ({self.current.id})",
                "conversation_already_has_active_response",
                event_id=event_id,
            )
            return False
        if not held and not self._admission.turns.allow():
            self._refuse_turn(event_id)
            return False
        if self.audio.playing is not None and not held:
            self.clear_output()  # a new reply does not queue behind the old one's audio
        ladder = self._admission.ladder
        level, cap, mcp = ladder.level, self._config.max_reply_tokens, self._mcp.offered()
        plan = response_plan.plan_response(params, settings, cap, level, self._engine.has_fallback, bool(held), mcp)
        for command, param in plan.commands:  # its own instructions and tools
            self._engine.send(command, param=param)
        self._flush_video()  # the newest frames reach the engine ahead of the reply
        own_voice = plan.voice != plan.session_voice  # a reply keeps the voice it began with
        if own_voice:
            self._engine.send(SetVoice(session_checks.speaker(plan.voice)), param="response.audio.output.voice")
        self._engine.begin_reply(plan.mode, tuple(self.history))
        if own_voice:
            self._engine.send(SetVoice(session_checks.speaker(plan.session_voice)))
        self.turns += 1
        metrics.TURNS.inc()
        reply = Response(
            audio=plan.mode == "audio",
            mode=plan.mode,
            end_of_turn=time.monotonic(),
            conversation_id=self._conversation_id,
            voice=plan.voice,
            max_tokens=plan.max_tokens,
            metadata=params.get("metadata"),
            tools=plan.tools,
        )
        self.current = self.last = reply
        self._cancelled_by_edit = None
        self._items.begin(held or self._conversation.last_id())
        self.audio.begin(reply)
        for event in reply.started():
            self._outbox.emit(event)
        if not plan.tools:  # without tools the message is announced at once, as it always was
            self._items.open_message(reply)
        return True

    def cancel_response(self, event_id: Optional[str], response_id: Optional[str] = None) -> None:
        """response.cancel: the current response, or only the one named by `response_id`."""
        if (
            self.current is None
            and self._cancelled_by_edit is not None
            and response_id in (None, self._cancelled_by_edit)
        ):
            # A client that interrupts by a truncate, then a cancel (the Agents SDK without
            # server VAD, or on a guardrail trip), finds the response already ended by the
            # truncate: its cancel has what it asked for, not an error. (Once: a second is one.)
            self._cancelled_by_edit = None
            return
        if self.current is None or response_id not in (None, self.current.id):
            # OpenAI's own wording and code: clients match on them.
            self._outbox.error(
                "Cancellation failed: no active response found", "response_cancel_not_active", event_id=event_id
            )
            return
        self.interrupt("client_cancelled")

    def cancel_for_edit(self) -> None:
        """A truncate or delete of the running response's item: it ends now (cancelled), as the
        engine cuts only an ended reply."""
        if self.current is not None:
            self._cancelled_by_edit = self.current.id
            self.interrupt("client_cancelled")

    def interrupt(self, reason: str) -> Optional[tuple[Response, int]]:
        """Barge-in or response.cancel: stop generating and drop queued audio at once. For a
        barge-in ("turn_detected") whose reply was the latest one playing, returns it and the
        samples the user heard of it (WebRTC: the agent knows what was played), for the caller
        to cut the reply in the model's context to those words (agent/realtime/edits.py)."""
        playing, heard = self.audio.playing, 0
        if playing is not None:
            heard = playing.samples - round(self.clear_output() * OUTPUT_RATE)
        reply = self.current
        heard_cut = reason == "turn_detected" and playing is not None and playing is self.last
        if reply is not None and playing is reply and reason == "turn_detected":
            reply.heard_ms = round(max(0, heard) * 1000 / OUTPUT_RATE)
        if reply is not None and reply.engine_open:
            # (a barge-in heard on WebRTC is cut to what was heard right after: no cut here)
            self._cancel_in_engine(reply, cut=not heard_cut)
            # Its usage: what the client was sent of it (the engine's own count comes too late).
            sent = {"text_tokens": reply.tokens, "audio_frames": reply.samples // CODEC_FRAME_SAMPLES}
            self._finish(reply, "cancelled", reason, sent)
        if heard_cut:
            return playing, max(0, heard)
        return None

    def shut_down(self) -> None:
        """The server is going away and this session's reply (being made or played) is cut off:
        it ends now as failed (`server_shutting_down`), and an error event says why, before the
        connection closes (a client could not tell it from an ordinary close)."""
        if not self.active:
            return
        reply = self.current
        self.clear_output()
        if reply is not None and reply.engine_open:
            self._cancel_in_engine(reply)
            sent = {"text_tokens": reply.tokens, "audio_frames": reply.samples // CODEC_FRAME_SAMPLES}
            self._finish(reply, "failed", None, sent, "the server is shutting down", "server_shutting_down")
        self._outbox.error(
            "the server is shutting down: the reply was cut off", "server_shutting_down", kind="server_error"
        )

    def _cancel_in_engine(self, reply: Response, cut: bool = True) -> None:
        """Stop the reply in the engine, and keep in the model only the tokens the client was
        sent of it: by the time the cancel reaches the engine thread it may have made a token
        or two more, which the item never shows (a barge-in's cut to what was heard follows,
        behind this, in order). A reply the model does not hold (cancelled before its prefill
        ended, the fallback's) has nothing to cut."""
        self._engine.cancel_reply()
        self._stale_done += 1
        if cut:
            self._engine.send(TruncateReply(reply.tokens, missing_ok=True))

    def playing_level(self) -> Optional[float]:
        """For the echo guard (agent/media/vad.py): the level the agent plays now, None while silent."""
        return self.audio.level(self.current)

    def clear_output(self) -> float:
        """output_audio_buffer.clear (WebRTC): the track drops what it has not played; returns
        the seconds dropped."""
        return self.audio.clear(self.last)

    # ---- engine output (the session's ReplySink calls) ---------------------------------
    def _live(self) -> Optional[Response]:
        if self._stale_done or self.current is None or not self.current.engine_open:
            return None
        return self.current

    def _since_end_of_turn(self, reply: Response, histogram: Any) -> float:
        """TTFT / TTFA: the reply's end of turn -> its first text / audio handed to the transport
        (recorded once per reply, by the caller), observed in `histogram` by priority."""
        elapsed = time.monotonic() - reply.end_of_turn
        histogram.labels(priority=self._priority).observe(elapsed)
        return elapsed

    def on_input(self, out: ReplyInput) -> None:
        reply = self._live()
        if reply is not None:
            reply.input = dict(out.stats)
            reply.prefilled = time.monotonic() - reply.end_of_turn

    def on_text(self, delta: TextDelta) -> None:
        reply = self._live()
        if reply is None:
            return
        if reply.ttft is None:
            reply.ttft = self._since_end_of_turn(reply, metrics.TTFT)
        self._items.open_message(reply)
        self._outbox.emit(reply.text_delta(delta.text, len(delta.token_ids)))
        if reply.max_tokens is not None and reply.tokens >= reply.max_tokens:
            # The client's max_output_tokens, under the server's own cap: end the reply here.
            self._cancel_in_engine(reply)
            self._finish(reply, "incomplete", "max_output_tokens", {"text_tokens": reply.tokens})

    def on_audio(self, audio: AudioOut) -> None:
        reply = self._live()
        if reply is None:
            return
        if reply.ttfa is None:
            reply.ttfa = self._since_end_of_turn(reply, metrics.TTFA)
        self._items.open_message(reply)
        self.audio.push(reply, audio.pcm)

    def on_call(self, delta: CallDelta) -> None:
        """The model's tool call grew or ended (its items: agent/realtime/reply_items.py)."""
        reply = self._live()
        if reply is None:
            return
        if reply.ttft is None:
            reply.ttft = self._since_end_of_turn(reply, metrics.TTFT)
        self._items.advance_call(reply, delta)

    def on_done(self, done: ReplyDone) -> None:
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
            self._outbox.error(error, "engine_error", kind="server_error")
        self.audio.end(reply)
        first_response = reply.ttfa if reply.audio else reply.ttft
        if first_response is not None:
            self._admission.observe(first_response)
        reason = {"length": "max_output_tokens"}.get(done.reason)
        self._finish(reply, STATUS_BY_REASON.get(done.reason, "failed"), reason, done.stats, error)

    def _finish(
        self,
        reply: Response,
        status: str,
        reason: Optional[str],
        stats: dict,
        error: Optional[str] = None,
        error_code: str = "engine_error",
    ) -> None:
        reply.engine_open = False
        if self.current is reply:
            self.current = None
        if reply.text:
            self.remember("assistant", reply.text)
        # A reply ended here (cancelled, capped by the client) has no engine stats: what it
        # played is still audio made (the load benchmark's underrun share divides by it).
        stats = {**stats, "audio_samples": stats.get("audio_samples", reply.samples)}
        events = reply.finished(status, reason, stats, error, error_code)
        message = reply.message_item()
        if message is not None:
            self._conversation.update(reply.item_id, message)
        for call in reply.calls:
            if call.announced:
                self._conversation.update(call.item_id, call.item())
        for event in events:
            self._outbox.emit(event)
        self._mcp.response_done(reply.id)  # its MCP calls' results may follow now
        if self._held:  # once the engine has ended this reply (a cancelled one's done comes later)
            self.after_engine_idle(self._answer_held)

    def after_engine_idle(self, fn: Callable[[], None]) -> None:
        """Run fn once every cancelled reply's end has come back from the engine (a held turn's
        answer waits for that: until then the engine's output still belongs to the old reply)."""
        if self._stale_done:
            self._when_engine_idle.append(fn)
        else:
            fn()
