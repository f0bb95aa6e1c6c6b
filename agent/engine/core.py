"""The engine thread's side: the runners, the sessions' sinks, and the loop that serves them.

vLLM's EngineCore shape: drain the inbox → apply each command → step the runners that have a
step due → emit what they made. Built by the engine thread once its runners are loaded
(agent/engine/loop.py's Engine is the asyncio side's handle), and used by that thread only, so
nothing here locks: `sinks`, `replying` and the camera's latest frames have this one owner.

Commands are dispatched on their type (agent/engine/commands.py): the session commands through
SESSION_COMMANDS (the runner method each one runs, and the capability Protocol of
agent/engine/api.py the runner needs for it), the turn's stream commands through STREAM.
engine → asyncio side: through the narrow port `Outside` (agent/engine/outside.py), plain data
(text, int16 PCM, stats) handed to the loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from agent import metrics
from agent.engine.api import (
    AudioOut,
    CallDelta,
    CallsTools,
    ConversationEditing,
    Output,
    ReplyDone,
    ReplyInput,
    ReplySink,
    Runner,
    SlotsExhausted,
    Speculating,
    StageTime,
    TakesHistory,
    TextDelta,
    Transcribing,
    TranscriptOut,
    TurnControl,
    VideoIntake,
    supports,
)
from agent.engine.commands import (
    AddAssistantText,
    AddSystemText,
    AddUserImage,
    AddUserText,
    AppendAudio,
    AppendVideo,
    BeginReply,
    CancelReply,
    CloseSession,
    Context,
    DiscardTurn,
    DropSpeculation,
    EndTurn,
    EndUserItem,
    HoldTurn,
    OpenSession,
    SessionCommand,
    SetContextTurns,
    SetInstructions,
    SetPriority,
    SetReplyInstructions,
    SetReplyTools,
    SetTools,
    SetTranscription,
    SetTranscriptItem,
    SetVideo,
    SetVoice,
    Speculate,
    Stop,
    StreamCommand,
    TruncateReply,
    describe,
)
from agent.engine.outside import Outside
from agent.engine.state.latest_frames import LatestFrames

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # the longest the engine sleeps between looks at its runners without a command

# A session command's handler: (runner, session id, command) -> the caller's result, on the
# engine thread. `needs`: the capability Protocol the runner must have (None: any runner).
Handler = Callable[[Any, str, Any], Any]

SESSION_COMMANDS: dict[type, tuple[Optional[type], Handler]] = {
    SetTranscription: (Transcribing, lambda r, sid, c: r.set_transcription(sid, c.mode)),
    SetTranscriptItem: (Transcribing, lambda r, sid, c: r.set_transcript_item(sid, c.item_id)),
    EndTurn: (Transcribing, lambda r, sid, c: r.end_turn(sid)),
    # A runner that keeps no conversation (--runner reference) has no item's end to mark.
    EndUserItem: (None, lambda r, sid, c: r.end_user_item(sid, c.transcript) if supports(r, Transcribing) else None),
    SetVideo: (VideoIntake, lambda r, sid, c: r.set_video(sid, c.on)),
    SetPriority: (TurnControl, lambda r, sid, c: r.set_priority(sid, c.priority)),
    HoldTurn: (TurnControl, lambda r, sid, c: r.hold_turn(sid)),
    SetInstructions: (ConversationEditing, lambda r, sid, c: r.set_instructions(sid, c.text)),
    SetContextTurns: (ConversationEditing, lambda r, sid, c: r.set_context_turns(sid, c.turns)),
    AddUserText: (ConversationEditing, lambda r, sid, c: r.add_user_text(sid, c.text)),
    AddUserImage: (ConversationEditing, lambda r, sid, c: r.add_user_image(sid, c.image)),
    AddSystemText: (ConversationEditing, lambda r, sid, c: r.add_system_text(sid, c.text)),
    AddAssistantText: (ConversationEditing, lambda r, sid, c: r.add_assistant_text(sid, c.text, c.joins)),
    SetVoice: (ConversationEditing, lambda r, sid, c: r.set_voice(sid, c.voice)),
    SetReplyInstructions: (ConversationEditing, lambda r, sid, c: r.set_reply_instructions(sid, c.text)),
    TruncateReply: (None, lambda r, sid, c: _truncate(r, sid, c)),
    SetTools: (CallsTools, lambda r, sid, c: r.set_tools(sid, c.tools)),
    SetReplyTools: (CallsTools, lambda r, sid, c: r.set_reply_tools(sid, c.tools)),
    Context: (ConversationEditing, lambda r, sid, c: r.context(sid)),
}


def _truncate(runner: Any, sid: str, cmd: TruncateReply) -> dict:
    """A runner that keeps no conversation holds no reply to cut: with missing_ok (the cut that
    follows a cancel) that is nothing to do, else the client's truncation is refused."""
    if not supports(runner, ConversationEditing):
        if cmd.missing_ok:
            return {"kept_tokens": 0, "dropped_tokens": 0, "absent": True}
        raise NotImplementedError(f"the {type(runner).__name__} cannot {describe(cmd)}")
    return runner.truncate_reply(sid, cmd.audio_frames, cmd.missing_ok)


# The stream commands' names in the engine's log and in a failed reply's error.
_LABELS: dict[type, str] = {
    AppendAudio: "audio",
    DiscardTurn: "discard",
    BeginReply: "reply",
    CancelReply: "cancel",
    Speculate: "speculate",
    DropSpeculation: "unspeculate",
    CloseSession: "close",
}


@dataclass(frozen=True)
class Envelope:
    """One command in the inbox: for which session, and the future its answer settles (on the loop)."""

    session_id: str
    command: Union[StreamCommand, SessionCommand]
    future: Optional[asyncio.Future] = None


# The ReplySink method each kind of output is delivered to.
DELIVER: dict[type, str] = {
    TextDelta: "on_text",
    AudioOut: "on_audio",
    CallDelta: "on_call",
    TranscriptOut: "on_transcript",
    ReplyInput: "on_input",
    ReplyDone: "on_done",
}


class EngineCore:
    """The runners and everything the engine thread keeps per session. Engine thread only."""

    def __init__(
        self,
        runners: list[Runner],
        outside: Outside,
        handlers: dict[type, tuple[Optional[type], Handler]],
        frames_per_turn: int,
    ) -> None:
        """runners: the Omni runner first, then the text fallback (degradation level 2), if any.
        handlers: the session commands this engine answers (SESSION_COMMANDS and any a test
        registered). frames_per_turn: the newest camera frames a reply is shown."""
        self.runners = runners
        self._outside = outside
        self._handlers = handlers
        self.sinks: dict[str, ReplySink] = {}
        self.replying: dict[str, Runner] = {}  # session → the runner its reply is on
        self._frames = LatestFrames(frames_per_turn)

    def serve(self, inbox: queue.Queue[Envelope]) -> None:
        """Until a Stop: the commands that came, then a step of every runner that has one due."""
        runners = self.runners
        while True:
            # Block only when no step is due (nothing to step, or replies far enough ahead of
            # real time: runner.idle_s); otherwise just drain what is there. A command wakes it.
            wait = min((_idle(r) for r in runners), default=IDLE_WAIT_S)
            try:
                env = inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait()
            except queue.Empty:
                env = None
            while env is not None:
                if isinstance(env.command, Stop):
                    for sid in list(self.sinks):
                        for runner in runners:
                            runner.close_session(sid)
                    return
                self.apply(env)
                try:
                    env = inbox.get_nowait()
                except queue.Empty:
                    env = None
            metrics.ENGINE_INBOX.set(inbox.qsize())
            for runner in runners:
                if _idle(runner) == 0.0:
                    self.step(runner)

    def step(self, runner: Runner) -> None:
        try:
            outputs = runner.step()
        except Exception as exc:
            # A model error must end the replies in flight, not the engine or the process.
            log.exception("engine: step failed")
            outputs = []
            for sid, owner in list(self.replying.items()):
                if owner is not runner:
                    continue
                try:
                    runner.cancel_reply(sid)
                except Exception:
                    log.exception("engine: cancel after failure failed")
                outputs.append(ReplyDone(sid, "error", stats={"error": str(exc)}))
            if supports(runner, Speculating):
                # The cancels ended those replies at once: their own "cancelled" ends (and text
                # tails) are replaced by the errors. Left for a later step, a "cancelled" done
                # would end the session's next reply instead. (A runner that ends a cancelled
                # reply at its next step has that done dropped by emit: nothing is in flight.)
                ended = {o.session_id for o in outputs}
                outputs += [o for o in runner.take_ready() if getattr(o, "session_id", None) not in ended]
        self.emit(outputs)

    def fail_all(self, reason: str) -> None:
        """The thread is dying: end every reply in flight (they would otherwise wait for ever)."""
        self.emit([ReplyDone(sid, "error", stats={"error": reason}) for sid in list(self.replying)])

    def apply(self, env: Envelope) -> None:
        sid, cmd = env.session_id, env.command
        primary = self.runners[0]
        if isinstance(cmd, SessionCommand):
            self._call(primary, env)
            return
        if isinstance(cmd, OpenSession):
            self._open(sid, cmd.sink, env.future)
            return
        if isinstance(cmd, AppendVideo):
            # Settled even for a closed session: the sender's feed only counts it.
            try:
                if sid in self.sinks:
                    self._frames.add(sid, cmd.image, cmd.at)
                    if supports(primary, VideoIntake):  # a runner that encodes on arrival
                        primary.append_video(sid, cmd.image, cmd.at)
                assert env.future is not None
                self._outside.settle(env.future, None, None)
            except Exception as exc:
                self._failed(sid, "video", exc)
            return
        if sid not in self.sinks:
            return  # session already closed: late audio is harmless
        handle = STREAM.get(type(cmd))
        if handle is None:  # only Engine's own methods queue these: a bug, not worth the thread
            log.error("engine: no handler for %s (session %s)", type(cmd).__name__, sid)
            return
        try:
            handle(self, sid, cmd)
        except Exception as exc:
            if isinstance(cmd, BeginReply):
                self.replying[sid] = primary  # so the error below reaches the session
            self._failed(sid, _LABELS[type(cmd)], exc)

    def _call(self, runner: Runner, env: Envelope) -> None:
        assert env.future is not None
        result: Any = None
        error: Optional[BaseException] = None
        try:
            needs, handler = self._handlers[type(env.command)]  # Engine.send refused any other type
            if needs is not None and not supports(runner, needs):
                raise NotImplementedError(f"the {type(runner).__name__} cannot {describe(env.command)}")
            if env.session_id not in self.sinks:
                raise KeyError(f"session {env.session_id} is closed")
            result = handler(runner, env.session_id, env.command)
        except Exception as exc:  # the caller's error, not the engine's
            error = exc
        self._outside.settle(env.future, result, error)

    def _open(self, sid: str, sink: ReplySink, future: Optional[asyncio.Future]) -> None:
        """On every runner, or on none (a runner that cannot, e.g. no slot left, undoes the
        others); a failed open is told to the sink (`on_open_failed`) and to the future."""
        opened: list[Runner] = []
        try:
            for runner in self.runners:
                runner.open_session(sid)
                opened.append(runner)
        except Exception as exc:
            if isinstance(exc, SlotsExhausted):
                # A full engine is admission, not a fault: the offer is answered 503 and the
                # client retries. One line, no traceback (a burst of offers logs one each).
                log.warning("engine: no slot for %s: %s", sid, exc)
            else:
                log.exception("engine: open for %s failed", sid)
            for runner in opened:
                try:
                    runner.close_session(sid)
                except Exception:  # noqa: BLE001 (the open's failure is the one reported)
                    log.exception("engine: undoing the open of %s failed", sid)
            self._outside.deliver(sink, "on_open_failed", str(exc))
            if future is not None:
                self._outside.settle(future, None, exc)
            return
        self.sinks[sid] = sink
        if future is not None:
            self._outside.settle(future, None, None)

    def _failed(self, sid: str, label: str, exc: Exception) -> None:
        """Bad input from one session (e.g. an image the processor rejects) is that session's
        error only."""
        log.exception("engine: %s for %s failed", label, sid, exc_info=exc)
        self.emit([ReplyDone(sid, "error", stats={"error": f"{label}: {exc}"})])

    def _stills(self, runner: Runner, sid: str) -> list[np.ndarray]:
        """The newest frames as still images, for a runner that does not take the camera as
        video itself (one with append_video puts the frames in the turn as video)."""
        return [] if supports(runner, VideoIntake) else self._frames.latest(sid)

    # ---- the stream commands, by type (STREAM; the session is open) ----------------------------
    def _append_audio(self, sid: str, cmd: AppendAudio) -> None:
        for runner in self.runners:  # the fallback only counts it
            runner.append_audio(sid, cmd.pcm)

    def _discard_turn(self, sid: str, cmd: DiscardTurn) -> None:
        for runner in self.runners:
            runner.discard_turn(sid)

    def _begin_reply(self, sid: str, cmd: BeginReply) -> None:
        primary = self.runners[0]
        if cmd.mode == "fallback":
            # The Omni model skips this turn entirely: that is the point of level 2. Its text and
            # image items go too (a dropped turn keeps them): the fallback answered them.
            primary.discard_turn(sid)
            if supports(primary, ConversationEditing):
                primary.drop_turn_items(sid)
            fallback = self.runners[1]
            if supports(fallback, TakesHistory):
                fallback.set_history(sid, list(cmd.history))
            fallback.begin_reply(sid, list(cmd.images) or self._frames.latest(sid), True)
            self.replying[sid] = fallback
            return
        for runner in self.runners[1:]:
            runner.discard_turn(sid)
        primary.begin_reply(sid, list(cmd.images) or self._stills(primary, sid), cmd.mode == "text")
        self.replying[sid] = primary
        # A committed speculation's held output (its first frame) goes out now.
        if supports(primary, Speculating):
            self.emit(primary.take_ready())

    def _speculate(self, sid: str, cmd: Speculate) -> None:
        primary = self.runners[0]
        if supports(primary, Speculating) and cmd.mode in ("audio", "text"):
            primary.speculate(sid, list(cmd.images) or self._stills(primary, sid), cmd.mode == "text")

    def _drop_speculation(self, sid: str, cmd: DropSpeculation) -> None:
        primary = self.runners[0]
        if supports(primary, Speculating):
            primary.drop_speculation(sid)

    def _cancel_reply(self, sid: str, cmd: CancelReply) -> None:
        for runner in self.runners:  # only the one with a reply in flight answers
            runner.cancel_reply(sid)
            if supports(runner, Speculating):  # its ReplyDone, made by the cancel itself, goes out now
                self.emit(runner.take_ready())

    def _close_session(self, sid: str, cmd: CloseSession) -> None:
        # The session is forgotten here whatever a runner's close does: a sink left in
        # `sinks` would hold the Session (and its call) for the life of the process.
        self.sinks.pop(sid, None)
        self.replying.pop(sid, None)
        self._frames.drop(sid)
        failed = None
        for runner in self.runners:  # every runner frees its slot, even after another failed
            try:
                runner.close_session(sid)
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the others)
                failed = failed or exc
        if failed is not None:
            raise failed

    def emit(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, StageTime):
                self._outside.stage(out)
                continue
            sink = self.sinks.get(out.session_id)
            if sink is None:
                continue
            # Exactly one done per reply: a runner's late "cancelled" after an error (or for a
            # session with nothing in flight) has no reply left to end.
            if isinstance(out, ReplyDone) and self.replying.pop(out.session_id, None) is None:
                continue
            self._outside.deliver(sink, DELIVER[type(out)], out)


# The stream commands' handlers, by command type (OpenSession, AppendVideo and the session
# commands have their own paths in EngineCore.apply).
STREAM: dict[type, Callable[[EngineCore, str, Any], None]] = {
    AppendAudio: EngineCore._append_audio,
    DiscardTurn: EngineCore._discard_turn,
    BeginReply: EngineCore._begin_reply,
    Speculate: EngineCore._speculate,
    DropSpeculation: EngineCore._drop_speculation,
    CancelReply: EngineCore._cancel_reply,
    CloseSession: EngineCore._close_session,
}


def _idle(runner: Runner) -> float:
    """Seconds the engine may sleep for this runner: its idle_s() while it has work, capped at
    IDLE_WAIT_S (a wait that long costs a reply nothing: idle_s counts to the high-water mark,
    a second of audio ahead); IDLE_WAIT_S with no work."""
    if not runner.has_work():
        return IDLE_WAIT_S
    return min(IDLE_WAIT_S, runner.idle_s())
