"""The engine: one thread that owns the model and every torch object; `Engine` is the asyncio
side's handle on it.

asyncio side → engine: typed commands (agent/engine/commands.py) through one bounded queue.Queue
(never blocks the loop: a full inbox is an error reported to the session, not a stall), each in
an envelope with its session id and, where it is answered, its future. The thread builds its
runners (model loading, compiling and CUDA graph capture happen inside it: graphs and compiled
functions are bound to the thread that made them), then hands them to an EngineCore
(agent/engine/core.py), which serves the inbox until a Stop.
engine → asyncio side: loop.call_soon_threadsafe with plain data (text, int16 PCM, stats).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable, Optional, Union

import numpy as np

from agent import metrics
from agent.engine.api import EngineBusy, ReplySink, Runner, Voices, voices_of
from agent.engine.commands import (
    AppendAudio,
    AppendVideo,
    BeginReply,
    CancelReply,
    CloseSession,
    DiscardTurn,
    DropSpeculation,
    OpenSession,
    SessionCommand,
    Speculate,
    Stop,
    StreamCommand,
)
from agent.engine.core import SESSION_COMMANDS, EngineCore, Envelope, Handler
from agent.engine.outside import ThreadOutside
from agent.engine.startup import FALLBACK, PhaseTimer, StartupLog, StartupView

log = logging.getLogger(__name__)


MODES = ("audio", "text", "fallback")


class Engine:
    """Facade used by the asyncio side. Thread-safe methods; none of them touch torch."""

    def __init__(
        self,
        runner_factory: Callable[[], Runner],
        inbox_size: int = 256,
        fallback_factory: Optional[Callable[[], Runner]] = None,
        frames_per_turn: int = 2,
        startup: Optional[StartupLog] = None,
    ) -> None:
        """runner_factory builds the Omni runner; fallback_factory, when given, a text-only
        runner that serves "fallback" replies (degradation level 2). Both run in the thread.
        frames_per_turn: the newest camera frames a reply is shown. startup: the log this engine's
        start-up phases go to (the factory's PhaseTimer reports to the same one); a fresh one
        when not given."""
        self._factory = runner_factory
        self._fallback_factory = fallback_factory
        self._inbox: "queue.Queue[Envelope]" = queue.Queue(maxsize=inbox_size)
        self._handlers = dict(SESSION_COMMANDS)  # session command type -> (needs, handler)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready: Optional[asyncio.Future] = None
        self._frames_per_turn = frames_per_turn
        # The engine thread's side, once its runners are loaded (None before, and in tests that
        # never start the thread).
        self.core: Optional[EngineCore] = None
        # Why the engine thread ended while it should be serving (None while it serves): set by
        # the thread itself on its way out, read by /healthz and admission.
        self.failed: Optional[str] = None
        # The talker speakers sessions may choose, known once the model is loaded (GET
        # /v1/omni/config lists them for the page's voice picker).
        self.voices = Voices()
        self._startup = startup if startup is not None else StartupLog()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the thread and wait until the model is loaded (raises if loading failed)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._startup.start()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        await self._ready

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    @property
    def startup(self) -> StartupView:
        """Where the start-up is (its running phase) and what it took so far (agent/engine/startup.py)."""
        return self._startup.view()

    async def stop(self) -> None:
        if self._thread is None:
            return
        await self._put_stop()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._thread = None

    async def _put_stop(self) -> None:
        """Queue the Stop; it must get through even when the inbox is full."""
        while True:
            try:
                self._inbox.put_nowait(Envelope("", Stop()))
                return
            except queue.Full:
                await asyncio.sleep(0.01)

    # ---- commands (asyncio side) -----------------------------------------------------
    def _put(
        self, session_id: str, command: Union[StreamCommand, SessionCommand], future: Optional[asyncio.Future] = None
    ) -> None:
        try:
            self._inbox.put_nowait(Envelope(session_id, command, future))
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
                phases = PhaseTimer(self._startup.apply)
                phases.begin(FALLBACK)
                runners.append(self._fallback_factory())
                phases.end(FALLBACK)
        except Exception as exc:  # loading failed: report it to start(), end the thread
            log.exception("engine: model load failed")
            self._loop.call_soon_threadsafe(self._ready.set_exception, exc)
            return
        self.core = EngineCore(runners, ThreadOutside(self._loop), self._handlers, self._frames_per_turn)
        self.voices = voices_of(runners[0])
        self._startup.ready()
        self._loop.call_soon_threadsafe(self._ready.set_result, None)
        try:
            self.core.serve(self._inbox)
        except BaseException as exc:
            # Not a model error (those end replies in EngineCore.step/apply): the loop itself
            # broke. Say so, so that health checks fail and no new call waits on a dead thread.
            self.failed = f"engine thread died: {exc!r}"
            log.critical("engine: thread died", exc_info=True)
            try:
                self.core.fail_all(self.failed)
            except Exception:
                log.exception("engine: could not report the failure")

    @property
    def alive(self) -> bool:
        """The engine thread is running (loaded or loading) and has not died."""
        return self._thread is not None and self._thread.is_alive() and self.failed is None
