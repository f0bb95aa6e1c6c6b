"""The engine thread: one busy loop that owns the model and every torch object.

asyncio side → engine: typed commands (agent/engine/commands.py) through one bounded queue.Queue
(never blocks the loop: a full inbox is an error reported to the session, not a stall), each in
an envelope with its session id and, where it is answered, its future. The thread dispatches on
the command's type through one table; a session command reaches the runner only through the
capability Protocol (agent/engine/api.py) that names its method.
engine → asyncio side: loop.call_soon_threadsafe with plain data (text, int16 PCM, stats).

The loop is vLLM's EngineCore shape: drain inbox → apply commands → runner.step() → emit.
The runner is built *inside* the thread because CUDA graphs and compiled functions are
bound to the thread that made them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from agent import metrics
from agent.engine.api import (
    AudioOut,
    ConversationEditing,
    EngineBusy,
    Output,
    ReplyDone,
    ReplySink,
    Runner,
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
    HoldTurn,
    OpenSession,
    SessionCommand,
    SetContextTurns,
    SetInstructions,
    SetPriority,
    SetReplyInstructions,
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
from agent.engine.state.latest_frames import LatestFrames

log = logging.getLogger(__name__)


MODES = ("audio", "text", "fallback")
IDLE_WAIT_S = 0.05  # the longest the engine sleeps between looks at its runners without a command


# A session command's handler: (runner, session id, command) -> the caller's result, on the
# engine thread. `needs`: the capability Protocol the runner must have (None: any runner).
Handler = Callable[[Any, str, Any], Any]

SESSION_COMMANDS: dict[type, tuple[Optional[type], Handler]] = {
    SetTranscription: (Transcribing, lambda r, sid, c: r.set_transcription(sid, c.mode)),
    SetTranscriptItem: (Transcribing, lambda r, sid, c: r.set_transcript_item(sid, c.item_id)),
    EndTurn: (Transcribing, lambda r, sid, c: r.end_turn(sid)),
    SetVideo: (VideoIntake, lambda r, sid, c: r.set_video(sid, c.on)),
    SetPriority: (TurnControl, lambda r, sid, c: r.set_priority(sid, c.priority)),
    HoldTurn: (TurnControl, lambda r, sid, c: r.hold_turn(sid)),
    SetInstructions: (ConversationEditing, lambda r, sid, c: r.set_instructions(sid, c.text)),
    SetContextTurns: (ConversationEditing, lambda r, sid, c: r.set_context_turns(sid, c.turns)),
    AddUserText: (ConversationEditing, lambda r, sid, c: r.add_user_text(sid, c.text)),
    SetVoice: (ConversationEditing, lambda r, sid, c: r.set_voice(sid, c.voice)),
    SetReplyInstructions: (ConversationEditing, lambda r, sid, c: r.set_reply_instructions(sid, c.text)),
    TruncateReply: (ConversationEditing, lambda r, sid, c: r.truncate_reply(sid, c.audio_frames)),
    Context: (ConversationEditing, lambda r, sid, c: r.context(sid)),
}

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
class _Envelope:
    """One command in the inbox: for which session, and the future its answer settles (on the loop)."""

    session_id: str
    command: Union[StreamCommand, SessionCommand]
    future: Optional[asyncio.Future] = None


@dataclass
class _Stats:
    steps: int = 0
    step_seconds: float = 0.0
    last_error: str = ""
    sessions: dict = field(default_factory=dict)


class Engine:
    """Facade used by the asyncio side. Thread-safe methods; none of them touch torch."""

    def __init__(
        self,
        runner_factory: Callable[[], Runner],
        inbox_size: int = 256,
        fallback_factory: Optional[Callable[[], Runner]] = None,
        frames_per_turn: int = 2,
    ) -> None:
        """runner_factory builds the Omni runner; fallback_factory, when given, a text-only
        runner that serves "fallback" replies (degradation level 2). Both run in the thread.
        frames_per_turn: the newest camera frames a reply is shown."""
        self._factory = runner_factory
        self._fallback_factory = fallback_factory
        self._inbox: "queue.Queue[_Envelope]" = queue.Queue(maxsize=inbox_size)
        self._handlers = dict(SESSION_COMMANDS)  # session command type -> (needs, handler)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready: Optional[asyncio.Future] = None
        self._sinks: dict[str, ReplySink] = {}  # engine thread only
        self._replying: dict[str, Runner] = {}  # session → runner its reply is on (engine thread)
        self._frames = LatestFrames(frames_per_turn)  # engine thread
        self.stats = _Stats()
        # Why the engine thread ended while it should be serving (None while it serves): set by
        # the thread itself on its way out, read by /healthz and admission.
        self.failed: Optional[str] = None

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the thread and wait until the model is loaded (raises if loading failed)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        await self._ready

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    async def stop(self) -> None:
        if self._thread is None:
            return
        # Stop must get through even when the inbox is full.
        while True:
            try:
                self._inbox.put_nowait(_Envelope("", Stop()))
                break
            except queue.Full:
                await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._thread = None

    # ---- commands (asyncio side) -----------------------------------------------------
    def _stills(self, runner: Runner, sid: str) -> list[np.ndarray]:
        """The newest frames as still images, for a runner that does not take the camera as
        video itself (one with append_video puts the frames in the turn as video)."""
        return [] if supports(runner, VideoIntake) else self._frames.latest(sid)

    def _put(
        self, session_id: str, command: Union[StreamCommand, SessionCommand], future: Optional[asyncio.Future] = None
    ) -> None:
        try:
            self._inbox.put_nowait(_Envelope(session_id, command, future))
        except queue.Full:
            raise EngineBusy("engine inbox full") from None
        metrics.ENGINE_INBOX.set(self._inbox.qsize())

    def open_session(self, session_id: str, sink: ReplySink) -> asyncio.Future:
        """Queue the session's open. The future is settled once the engine thread has opened
        it (None), or could not (the error: the sink's on_open_failed is told as well); a caller
        that does not wait for it loses nothing."""
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may await it
        self._put(session_id, OpenSession(sink), future)
        return future

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        self._put(session_id, AppendAudio(pcm))

    def append_video(self, session_id: str, image: np.ndarray, at: float) -> asyncio.Future:
        """One sampled camera frame (RGB uint8 HxWx3, `at` on the audio clock). The future is
        settled once the engine thread has taken it: the sender's back-pressure signal."""
        future = asyncio.get_running_loop().create_future()
        self._put(session_id, AppendVideo(image, at), future)
        return future

    def discard_turn(self, session_id: str) -> None:
        self._put(session_id, DiscardTurn())

    @property
    def has_fallback(self) -> bool:
        return self._fallback_factory is not None

    def begin_reply(
        self, session_id: str, images: list[np.ndarray], mode: str = "audio", history: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """End of turn. images: the frames to show; empty: the newest taken by append_video."""
        if mode not in MODES or (mode == "fallback" and not self.has_fallback):
            raise ValueError(f"reply mode {mode!r} not available")
        self._put(session_id, BeginReply(tuple(images), mode, tuple(history)))

    def cancel_reply(self, session_id: str) -> None:
        self._put(session_id, CancelReply())

    def speculate(self, session_id: str, images: list[np.ndarray], mode: str = "audio") -> None:
        """The user paused: start the reply to the turn so far, its output held (the primary
        runner only, and only a runner that can; a no-op otherwise). begin_reply commits it."""
        self._put(session_id, Speculate(tuple(images), mode))

    def drop_speculation(self, session_id: str) -> None:
        """The user went on speaking: discard the held reply, if any (invisibly)."""
        self._put(session_id, DropSpeculation())

    def close_session(self, session_id: str) -> None:
        self._put(session_id, CloseSession())

    def send(self, session_id: str, command: SessionCommand) -> asyncio.Future:
        """Run a session command (agent/engine/commands.py) on the primary runner, on the engine
        thread, in order with this session's other commands. The future gets the runner method's
        return value, or its exception: NotImplementedError when the runner lacks the capability
        the command needs, KeyError when the session is closed. A command type the engine has no
        handler for is refused here (TypeError); EngineBusy when the inbox is full."""
        if type(command) not in self._handlers:
            raise TypeError(f"the engine has no command {type(command).__name__}")
        future = asyncio.get_running_loop().create_future()
        self._put(session_id, command, future)
        return future

    def register(self, command: type, handler: Handler, needs: Optional[type] = None) -> None:
        """Give this engine one more session command: `handler(runner, session_id, command)` runs
        on the engine thread for each sent, where the runner has `needs` (a capability Protocol).
        For tests that stall or probe the runner; the served commands are SESSION_COMMANDS."""
        self._handlers[command] = (needs, handler)

    # ---- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None and self._ready is not None
        try:
            runners = [self._factory()]
            if self._fallback_factory is not None:
                runners.append(self._fallback_factory())
        except Exception as exc:  # loading failed: report it to start(), end the thread
            log.exception("engine: model load failed")
            self._loop.call_soon_threadsafe(self._ready.set_exception, exc)
            return
        self._loop.call_soon_threadsafe(self._ready.set_result, None)
        try:
            self._serve(runners)
        except BaseException as exc:
            # Not a model error (those end replies in _step/_apply): the loop itself broke.
            # Say so, so that health checks fail and no new call waits on a dead thread.
            self.failed = f"engine thread died: {exc!r}"
            log.critical("engine: thread died", exc_info=True)
            try:  # replies in flight would otherwise wait for ever
                self._emit([ReplyDone(sid, "error", stats={"error": self.failed}) for sid in list(self._replying)])
            except Exception:
                log.exception("engine: could not report the failure")

    @property
    def alive(self) -> bool:
        """The engine thread is running (loaded or loading) and has not died."""
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    def _serve(self, runners: list[Runner]) -> None:
        while True:
            # Block only when no step is due (nothing to step, or replies far enough ahead of
            # real time: runner.idle_s); otherwise just drain what is there. A command wakes it.
            wait = min((_idle(r) for r in runners), default=IDLE_WAIT_S)
            try:
                cmd = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if isinstance(cmd.command, Stop):
                    for sid in list(self._sinks):
                        for runner in runners:
                            runner.close_session(sid)
                    return
                self._apply(runners, cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            metrics.ENGINE_INBOX.set(self._inbox.qsize())
            for runner in runners:
                if _idle(runner) == 0.0:
                    self._step(runner)

    def _step(self, runner: Runner) -> None:
        t0 = time.perf_counter()
        try:
            outputs = runner.step()
        except Exception as exc:
            # A model error must end the replies in flight, not the engine or the process.
            log.exception("engine: step failed")
            self.stats.last_error = repr(exc)
            outputs = []
            for sid, owner in list(self._replying.items()):
                if owner is not runner:
                    continue
                try:
                    runner.cancel_reply(sid)
                except Exception:
                    log.exception("engine: cancel after failure failed")
                # The runner's own "cancelled" done comes later and is dropped by _emit.
                outputs.append(ReplyDone(sid, "error", stats={"error": str(exc)}))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self._emit(outputs)

    def _call(self, runner: Runner, env: _Envelope) -> None:
        assert self._loop is not None and env.future is not None
        result: Any = None
        error: Optional[BaseException] = None
        try:
            needs, handler = self._handlers[type(env.command)]  # send() refused any other type
            if needs is not None and not supports(runner, needs):
                raise NotImplementedError(f"the {type(runner).__name__} cannot {describe(env.command)}")
            if env.session_id not in self._sinks:
                raise KeyError(f"session {env.session_id} is closed")
            result = handler(runner, env.session_id, env.command)
        except Exception as exc:  # the caller's error, not the engine's
            error = exc
        self._loop.call_soon_threadsafe(_settle, env.future, result, error)

    def _open(self, runners: list[Runner], sid: str, sink: ReplySink, future: Optional[asyncio.Future]) -> None:
        """On every runner, or on none (a runner that cannot, e.g. no slot left, undoes the
        others); a failed open is told to the sink (`on_open_failed`) and to the future."""
        opened: list[Runner] = []
        try:
            for runner in runners:
                runner.open_session(sid)
                opened.append(runner)
        except Exception as exc:
            log.exception("engine: open for %s failed", sid)
            for runner in opened:
                try:
                    runner.close_session(sid)
                except Exception:  # noqa: BLE001 (the open's failure is the one reported)
                    log.exception("engine: undoing the open of %s failed", sid)
            assert self._loop is not None
            on_open_failed = getattr(sink, "on_open_failed", None)
            if on_open_failed is not None:
                self._loop.call_soon_threadsafe(on_open_failed, str(exc))
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, None, exc)
            return
        self._sinks[sid] = sink
        if future is not None:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_settle, future, None, None)

    def _apply(self, runners: list[Runner], env: _Envelope) -> None:
        sid, cmd = env.session_id, env.command
        primary = runners[0]
        if isinstance(cmd, SessionCommand):
            self._call(primary, env)
            return
        if isinstance(cmd, OpenSession):
            self._open(runners, sid, cmd.sink, env.future)
            return
        if isinstance(cmd, AppendVideo):
            # Settled even for a closed session: the sender's feed only counts it.
            try:
                if sid in self._sinks:
                    self._frames.add(sid, cmd.image, cmd.at)
                    if supports(primary, VideoIntake):  # a runner that encodes on arrival
                        primary.append_video(sid, cmd.image, cmd.at)
                assert env.future is not None and self._loop is not None
                self._loop.call_soon_threadsafe(_settle, env.future, None, None)
            except Exception as exc:
                self._failed(sid, "video", exc)
            return
        if sid not in self._sinks:
            return  # session already closed: late audio is harmless
        handle = _STREAM.get(type(cmd))
        if handle is None:  # only Engine's own methods queue these: a bug, not worth the thread
            log.error("engine: no handler for %s (session %s)", type(cmd).__name__, sid)
            return
        try:
            handle(self, runners, sid, cmd)
        except Exception as exc:
            if isinstance(cmd, BeginReply):
                self._replying[sid] = primary  # so the error below reaches the session
            self._failed(sid, _LABELS[type(cmd)], exc)

    def _failed(self, sid: str, label: str, exc: Exception) -> None:
        """Bad input from one session (e.g. an image the processor rejects) is that session's
        error only."""
        log.exception("engine: %s for %s failed", label, sid, exc_info=exc)
        self._emit([ReplyDone(sid, "error", stats={"error": f"{label}: {exc}"})])

    # ---- the stream commands, by type (_STREAM; engine thread; the session is open) -------
    def _append_audio(self, runners: list[Runner], sid: str, cmd: AppendAudio) -> None:
        for runner in runners:  # the fallback only counts it
            runner.append_audio(sid, cmd.pcm)

    def _discard_turn(self, runners: list[Runner], sid: str, cmd: DiscardTurn) -> None:
        for runner in runners:
            runner.discard_turn(sid)

    def _begin_reply(self, runners: list[Runner], sid: str, cmd: BeginReply) -> None:
        primary = runners[0]
        if cmd.mode == "fallback":
            # The Omni model skips this turn entirely: that is the point of level 2.
            primary.discard_turn(sid)
            fallback = runners[1]
            if supports(fallback, TakesHistory):
                fallback.set_history(sid, list(cmd.history))
            fallback.begin_reply(sid, list(cmd.images) or self._frames.latest(sid), True)
            self._replying[sid] = fallback
            return
        for runner in runners[1:]:
            runner.discard_turn(sid)
        primary.begin_reply(sid, list(cmd.images) or self._stills(primary, sid), cmd.mode == "text")
        self._replying[sid] = primary
        # A committed speculation's held output (its first frame) goes out now.
        if supports(primary, Speculating):
            self._emit(primary.take_ready())

    def _speculate(self, runners: list[Runner], sid: str, cmd: Speculate) -> None:
        primary = runners[0]
        if supports(primary, Speculating) and cmd.mode in ("audio", "text"):
            primary.speculate(sid, list(cmd.images) or self._stills(primary, sid), cmd.mode == "text")

    def _drop_speculation(self, runners: list[Runner], sid: str, cmd: DropSpeculation) -> None:
        primary = runners[0]
        if supports(primary, Speculating):
            primary.drop_speculation(sid)

    def _cancel_reply(self, runners: list[Runner], sid: str, cmd: CancelReply) -> None:
        for runner in runners:  # only the one with a reply in flight answers
            runner.cancel_reply(sid)

    def _close_session(self, runners: list[Runner], sid: str, cmd: CloseSession) -> None:
        # The session is forgotten here whatever a runner's close does: a sink left in
        # _sinks would hold the Session (and its call) for the life of the process.
        self._sinks.pop(sid, None)
        self._replying.pop(sid, None)
        self._frames.drop(sid)
        failed = None
        for runner in runners:  # every runner frees its slot, even after another failed
            try:
                runner.close_session(sid)
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the others)
                failed = failed or exc
        if failed is not None:
            raise failed

    def _emit(self, outputs: list[Output]) -> None:
        assert self._loop is not None
        for out in outputs:
            if isinstance(out, StageTime):
                metrics.STAGE.labels(stage=out.stage).observe(out.seconds)
                # A batched call is reported once per session in it: each takes its share, so
                # the counter sums to the engine thread's real time in the stage.
                metrics.ENGINE_SECONDS.labels(stage=out.stage).inc(out.seconds / max(out.batch, 1))
                metrics.ENGINE_CALLS.labels(stage=out.stage).inc(1 / max(out.batch, 1))
                continue
            sink = self._sinks.get(out.session_id)
            if sink is None:
                continue
            if isinstance(out, TextDelta):
                self._loop.call_soon_threadsafe(sink.on_text, out)
            elif isinstance(out, AudioOut):
                self._loop.call_soon_threadsafe(sink.on_audio, out)
            elif isinstance(out, TranscriptOut):
                on_transcript = getattr(sink, "on_transcript", None)  # a sink that asked for them
                if on_transcript is not None:
                    self._loop.call_soon_threadsafe(on_transcript, out)
            elif isinstance(out, ReplyDone):
                # Exactly one done per reply: a runner's late "cancelled" after an error
                # (or for a session with nothing in flight) has no reply left to end.
                if self._replying.pop(out.session_id, None) is not None:
                    self._loop.call_soon_threadsafe(sink.on_done, out)


# The stream commands' handlers on the engine thread, by command type (OpenSession, AppendVideo
# and the session commands have their own paths in Engine._apply).
_STREAM: dict[type, Callable[[Engine, list[Runner], str, Any], None]] = {
    AppendAudio: Engine._append_audio,
    DiscardTurn: Engine._discard_turn,
    BeginReply: Engine._begin_reply,
    Speculate: Engine._speculate,
    DropSpeculation: Engine._drop_speculation,
    CancelReply: Engine._cancel_reply,
    CloseSession: Engine._close_session,
}


def _idle(runner: Runner) -> float:
    """Seconds the engine may sleep for this runner: its idle_s() while it has work, capped at
    IDLE_WAIT_S (a wait that long costs a reply nothing: idle_s counts to the high-water mark,
    a second of audio ahead); IDLE_WAIT_S with no work."""
    if not runner.has_work():
        return IDLE_WAIT_S
    return min(IDLE_WAIT_S, runner.idle_s())


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
