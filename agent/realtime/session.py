"""One Realtime session: audio in, turns, the engine's replies out as GA server events.

Transport-neutral: a WebRTC call (agent/transport/rtc.py) or a WebSocket (agent/transport/ws.py)
feeds it audio frames and client events and gives it a `send` for serialized server events.
Spoken replies go to `track` on WebRTC (paced media) or out as response.output_audio.delta on
a WebSocket. Everything here runs on the asyncio loop; engine output arrives through the
ReplySink methods (scheduled with call_soon_threadsafe by the engine thread).

The Session owns its parts and wires them together; they never see it. Each is given only the
ports and plain values it needs: the engine port (agent/realtime/engine_port.py: the session id
bound, typed commands, unanswered ones cancelled at close), the outbox (server events), the
conversation and the items port, the settings (SessionSettings: called for the current ones),
and the callbacks it is handed. With no part referring back here, a closed session is freed by
reference counting once close() has dropped the few hooks that point both ways (the outbound
track's, the transport's).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable, Optional

import av
from opentelemetry.trace import Tracer

from agent import metrics
from agent.config import Config
from agent.engine.api import AudioOut, CallDelta, ReplyDone, ReplyInput, TextDelta, TranscriptOut
from agent.engine.commands import (
    SetContextTurns,
    SetInstructions,
    SetPriority,
    SetTools,
    SetVideo,
    SetVoice,
)
from agent.engine.loop import Engine
from agent.gate import priority
from agent.gate.ladder import LEVEL_NAMES, Admission
from agent.media.playout import AgentAudioTrack
from agent.media.semantic_turn import CompletenessJudge
from agent.media.video_feed import VideoFeed
from agent.realtime import session_checks, session_config, tool_config
from agent.realtime.call_outputs import CallOutputs
from agent.realtime.conversation import Conversation
from agent.realtime.edits import Edits
from agent.realtime.engine_port import EnginePort
from agent.realtime.event_rate import EventRate
from agent.realtime.events import new_id
from agent.realtime.inbox import Inbox
from agent.realtime.input_buffer import InputBuffer
from agent.realtime.input_transcription import InputTranscription
from agent.realtime.items import Items
from agent.realtime.mcp import Mcp
from agent.realtime.messages import Messages
from agent.realtime.outbox import Outbox
from agent.realtime.replies import Replies
from agent.realtime.server_turn import ServerTurn
from agent.realtime.turn_timing import TurnTiming
from agent.telemetry.call_trace import CallTrace
from agent.tools.spec import ToolSet

log = logging.getLogger(__name__)


class Session:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        admission: Admission,
        send: Callable[[str], None],
        on_closed: Callable[["Session"], None],
        webrtc: bool,
        settings: Optional[dict[str, Any]] = None,
        decode_pool: Optional[Executor] = None,
        turn_judge: Optional[CompletenessJudge] = None,
        tracer: Optional[Tracer] = None,
    ) -> None:
        self.id = new_id("sess")
        self.config, self.admission = config, admission
        self.outbox = Outbox(send)  # server events: the transport, and SSE subscribers
        self.engine = EnginePort(engine, self.id, self.outbox)  # this session's commands to the engine
        self._on_closed = on_closed
        self.webrtc = webrtc
        self._settings = session_config.SessionSettings(settings or session_config.default_session(config))
        self.settings["id"] = self.id
        self.priority = session_config.priority_of(self.settings)  # fixed for the session's life
        self.outbox.extras = session_config.extra_events(self.settings, webrtc)
        # A transcription session (GA type "transcription"): the user's speech is transcribed,
        # nothing is answered, nothing is sent back on the audio track. Fixed for its life.
        self.transcription_only = self.settings["type"] == "transcription"
        # Where each turn's time went (omni.turn_timing), read from the events as they go out;
        # with a tracer, the call's trace too (agent/telemetry/call_trace.py).
        self.trace = CallTrace(tracer, self.id, "webrtc" if webrtc else "websocket", config.model) if tracer else None
        self.timing = TurnTiming(
            self.outbox.emit,
            webrtc and not self.transcription_only,
            on_turn=self.trace.turn if self.trace else None,
            on_call=self.trace.call if self.trace else None,
        )
        self.outbox.taps.append(self.timing.see)
        self.conversation = Conversation()
        self.conversation_id = new_id("conv")
        self.items = Items(self.conversation, self.outbox)  # user items, announced
        self.transcription = InputTranscription(self.engine, self.outbox, self.conversation, self.transcription_only)
        self.video = VideoFeed(config, engine, self.id, self.outbox.emit)  # camera → engine, throttle → sender
        # MCP servers (their tools' listing) and the calls the agent runs on them.
        self.mcp = Mcp(self.engine, self.outbox, self.conversation, config, self._send_tools, self._settings)
        self._sent_tools: tuple[str, Optional[ToolSet]] = (config.system_prompt, None)  # what the engine has
        self.replies = Replies(  # responses, from response.create to response.done
            self.engine,
            self.outbox,
            self.conversation,
            self._settings,
            admission,
            config,
            conversation_id=self.conversation_id,
            priority=self.priority,
            transcription_only=self.transcription_only,
            flush_video=self.video.flush_for_turn,
            mcp=self.mcp,
        )
        # Spoken replies: paced media on WebRTC, audio deltas on a WebSocket.
        self.track: Optional[AgentAudioTrack] = (
            AgentAudioTrack(
                upsample_to_48k=True,
                on_first_audio=self.replies.audio.on_first_audio,
                on_drained=self.replies.audio.on_drained,
            )
            if webrtc and not self.transcription_only
            else None
        )
        self.replies.audio.track = self.track
        self.edits = Edits(self.replies, self.engine, self.conversation, self.outbox)
        self.call_outputs = CallOutputs(self.engine, self.items, self.replies)  # results of the model's calls
        self.input = InputBuffer(
            config,
            session_config.turn_detection(self.settings, config.vad_silence_ms),
            echo=self.replies.playing_level,  # (a method of the replies, not the session: no cycle)
            judge=turn_judge,
        )
        speech = self.input  # (the buffer, not the session, in the closure: no cycle)
        self.messages = Messages(  # user and system messages
            self.engine, self.items, self.replies.remember, speaking=lambda: speech.in_turn
        )
        self.turn = ServerTurn(  # the turn server VAD follows (agent/realtime/server_turn.py)
            self.engine,
            self.outbox,
            self.input,
            self.replies,
            self.edits,
            self.transcription,
            self.items,
            self.track,
            self._settings,
            admission,
            config,
            transcription_only=self.transcription_only,
        )
        self._unlisten: Optional[Callable[[], None]] = None
        self._closed = False
        self.on_close: list[Callable[[], Awaitable[None]]] = []  # the transport's own teardown
        self.events_in = EventRate(config.max_events_per_s)  # client events' rate limit
        self.inbox = Inbox(decode_pool)  # client events in order; heavy ones sliced or pooled
        self.opened: Optional[asyncio.Future] = None  # start(): the engine's open of this session

    @property
    def settings(self) -> dict[str, Any]:
        """The session's settings now (the parts read them through the same SessionSettings)."""
        return self._settings.value

    @settings.setter
    def settings(self, value: dict[str, Any]) -> None:
        self._settings.value = value

    @property
    def turns(self) -> int:
        """Replies begun in this session."""
        return self.replies.turns

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self.opened = self.engine.open(self)  # settled once the engine has it
        self._unlisten = self.admission.listen(self._on_level)
        self.transcription.apply(self.settings)
        if self.trace is not None:
            self.trace.name(self.settings.get("tracing"))
        if self.transcription_only:
            self.video.set_enabled(False)  # captions look at no camera: its sender may stop
            self.emit({"type": "session.created", "session": self.settings})
            return
        self._send_tools()
        if session_config.interpret_to(self.settings):  # interpreter mode: a bounded context
            self.engine.send(SetContextTurns(session_config.INTERPRET_TURNS))
        if not session_config.video_on(self.settings):
            self.engine.send(SetVideo(False), param="session.omni.video")
            self.video.set_enabled(False)
        if self.priority != priority.NORMAL:
            # A runner without a scheduler (--runner reference) has nothing to order: not an error
            # the client could act on, so the future's failure is only retrieved, never reported.
            self.engine.ask(SetPriority(priority.RANK[self.priority])).add_done_callback(
                lambda f: f.cancelled() or f.exception()
            )
        if self.settings["audio"]["output"].get("voice") not in (None, "default", self.config.speaker):
            self._set_voice(self.settings["audio"]["output"]["voice"])  # from the offer's session
        self.emit(
            {
                "type": "session.created",
                "session": self.settings,
                "omni": {"mode": LEVEL_NAMES[self.admission.ladder.level], **self._trace_id()},
            }
        )
        try:
            self.mcp.configure(self.settings["tools"], "session.tools")  # (checked when the call was made)
        except session_config.ConfigError as exc:
            self.emit_error(str(exc), "invalid_value", param=exc.param)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.inbox.close()
        self.mcp.close()
        self.timing.close()
        if self.trace is not None:
            self.trace.close()
        # Unanswered engine commands are cancelled (their callbacks see that and leave), then the
        # engine closes the session.
        self.engine.close()
        # The ladder's listener holds our bound method: drop it so nothing refers back here.
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self.outbox.close()
        self.video.close()
        if self.track is not None:
            self.track.stop()
        # Its FFmpeg filter graph owns one worker thread per core: free it now, not at a GC.
        self.input.audio_in.close()
        for hook in list(self.on_close):  # (a hook's own connection may take itself off)
            await hook()
        self._on_closed(self)
        # Drop every callback that refers back to this session or its transport (track hooks,
        # the transport's teardown, pending engine-idle work): with no cycle left, reference
        # counting frees the call now instead of at a rare full GC (issue 14).
        self.on_close.clear()
        self.replies.close()
        self._on_closed = _closed_already
        if self.track is not None:
            self.track.on_first_audio = self.track.on_drained = None

    # ---- audio and video in ------------------------------------------------------------
    def push_audio(self, frame: av.AudioFrame) -> None:
        """Microphone audio, any rate and layout (a WebRTC track's frames, decoded WebSocket appends)."""
        for event in self.input.push(frame):
            self.turn.on_event(event)
        self.turn.check_idle()

    def push_video(self, frame: av.VideoFrame) -> None:
        self.video.push(frame, self.input.audio_in.clock)

    def reply_mode(self, modalities: list[str]) -> str:
        return self.replies.reply_mode(modalities)

    def commit_audio(self, event_id: Optional[str]) -> None:
        """input_audio_buffer.commit (agent/realtime/server_turn.py)."""
        self.turn.commit_buffer(event_id)

    def clear_audio(self) -> None:
        """input_audio_buffer.clear (agent/realtime/server_turn.py)."""
        self.turn.clear_buffer()

    def apply_settings(self, merged: dict[str, Any]) -> None:
        """A validated session.update: act on what changed, then answer session.updated."""
        old, self.settings = self.settings, merged
        self.outbox.extras = session_config.extra_events(merged, self.webrtc)
        self.transcription.apply(merged)
        if self.transcription_only:
            pass  # no instructions, no voice: nothing is answered
        else:
            self.mcp.configure(merged["tools"], "session.tools")  # (checked by the update's handler)
            self._send_tools()
        if session_config.interpret_to(merged) != session_config.interpret_to(old):
            on = bool(session_config.interpret_to(merged))
            self.engine.send(SetContextTurns(session_config.INTERPRET_TURNS if on else 0))
        if not self.transcription_only and session_config.video_on(merged) != session_config.video_on(old):
            self.engine.send(SetVideo(session_config.video_on(merged)), param="session.omni.video")
            self.video.set_enabled(session_config.video_on(merged))  # and the sender stops or resumes
        voice = None if self.transcription_only else merged["audio"]["output"].get("voice")
        if not self.transcription_only and voice != old["audio"]["output"].get("voice"):
            self._set_voice(voice)
        td = session_config.turn_detection(merged, self.config.vad_silence_ms)
        if td != self.input.turn_detection:
            if self.input.in_turn:  # the turn so far cannot be judged by new rules
                self.engine.discard_turn()
            self.input.set_turn_detection(td)
            self.turn.reset()
        if self.trace is not None and merged.get("tracing") != old.get("tracing"):
            self.trace.name(merged.get("tracing"))
        self.emit({"type": "session.updated", "session": merged, **({"omni": self._trace_id()} if self.trace else {})})

    # ---- engine output (ReplySink) -----------------------------------------------------
    def on_text(self, delta: TextDelta) -> None:
        self.replies.on_text(delta)

    def on_audio(self, audio: AudioOut) -> None:
        self.replies.on_audio(audio)

    def on_transcript(self, out: TranscriptOut) -> None:
        self.transcription.on_transcript(out)

    def on_call(self, delta: CallDelta) -> None:
        self.replies.on_call(delta)

    def on_input(self, out: ReplyInput) -> None:
        self.replies.on_input(out)

    def on_done(self, done: ReplyDone) -> None:
        self.replies.on_done(done)

    def on_open_failed(self, message: str) -> None:
        """The engine could not open this session (no slot left: two offers passed admission
        at once): say so, then end it, rather than live on with nothing behind it."""
        if self._closed:
            return
        metrics.ERRORS.labels(where="engine").inc()
        self.emit_error(f"the engine could not open this session: {message}", "session_failed", kind="server_error")
        asyncio.ensure_future(self.close())

    # ---- conversation items ------------------------------------------------------------
    def add_call_output(self, item_id: str, call_id: str, output: str, event_id: Optional[str]) -> None:
        """A function_call_output item (agent/realtime/call_outputs.py)."""
        self.call_outputs.add(item_id, call_id, output, event_id)

    def truncate(self, item_id: str, audio_end_ms: int, event_id: Optional[str]) -> None:
        """conversation.item.truncate (agent/realtime/edits.py)."""
        self.edits.truncate(item_id, audio_end_ms, event_id)

    def delete_item(self, item_id: str, event_id: Optional[str]) -> None:
        """conversation.item.delete (agent/realtime/edits.py)."""
        self.edits.delete_item(item_id, event_id)

    def _send_tools(self) -> None:
        """The system message (instructions, tools) and the tools' grammar, where either changed:
        after an update, and as the session's MCP servers list theirs."""
        offered = self.mcp.offered()
        # Each read once: a tool list's JSON is written for every read (~2 ms at 90 tools).
        text, tools = tool_config.system_text(self.settings, offered), tool_config.session_tools(self.settings, offered)
        if text != self._sent_tools[0]:  # the instructions, or the tools they describe
            self.engine.send(SetInstructions(text), param="session.instructions")
        if tools != self._sent_tools[1]:
            self.engine.send(SetTools(tools), param="session.tools")
        self._sent_tools = (text, tools)

    def _trace_id(self) -> dict[str, str]:
        """{"trace_id": …} of the call's trace, for a client to find its call (none untraced)."""
        return {"trace_id": self.trace.trace_id} if self.trace is not None else {}

    def _on_level(self, level: int) -> None:
        p95 = self.admission.ladder.current_p95()
        self.emit(
            {
                "type": "omni.response.mode",
                "mode": LEVEL_NAMES[level],
                "reason": f"p95 first-response latency {p95 * 1000:.0f} ms" if p95 is not None else "recovered",
            }
        )

    def _set_voice(self, voice: Any) -> None:
        """The speaker of the next replies: a name checked before the session took it
        (session_checks.check_voice; the engine refuses one unknown to it all the same)."""
        if not isinstance(voice, str):
            return
        self.engine.send(SetVoice(session_checks.speaker(voice)), param="session.audio.output.voice")

    # ---- events out --------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        self.outbox.emit(event)

    def emit_error(
        self,
        message: str,
        code: str,
        *,
        param: Optional[str] = None,
        event_id: Optional[str] = None,
        kind: str = "invalid_request_error",
    ) -> None:
        self.outbox.error(message, code, param=param, event_id=event_id, kind=kind)


def _closed_already(session: Session) -> None:
    """on_closed after close(): the owner has already been told."""
