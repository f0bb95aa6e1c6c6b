"""The engine thread: one busy loop that owns the model and every torch object.

asyncio side → engine: commands through one bounded queue.Queue (never blocks the loop:
a full inbox is an error reported to the session, not a stall).
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
from typing import Callable, Optional, Protocol

import numpy as np

from .. import metrics
from .api import AudioOut, Output, ReplyDone, Runner, StageTime, TextDelta

log = logging.getLogger(__name__)


class ReplySink(Protocol):
    """Per-session receiver of engine output. Called on the asyncio loop only."""

    def on_text(self, delta: TextDelta) -> None: ...

    def on_audio(self, audio: AudioOut) -> None: ...

    def on_done(self, done: ReplyDone) -> None: ...


@dataclass(frozen=True)
class _Cmd:
    op: str  # open | audio | discard | reply | cancel | close | stop
    session_id: str = ""
    pcm: Optional[np.ndarray] = None
    images: tuple = ()
    text_only: bool = False
    sink: Optional[ReplySink] = None


class EngineBusy(RuntimeError):
    """The inbox is full: the engine is not keeping up with this many sessions."""


@dataclass
class _Stats:
    steps: int = 0
    step_seconds: float = 0.0
    last_error: str = ""
    sessions: dict = field(default_factory=dict)


class Engine:
    """Facade used by the asyncio side. Thread-safe methods; none of them touch torch."""

    def __init__(self, runner_factory: Callable[[], Runner], inbox_size: int = 256) -> None:
        self._factory = runner_factory
        self._inbox: "queue.Queue[_Cmd]" = queue.Queue(maxsize=inbox_size)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready: Optional[asyncio.Future] = None
        self._sinks: dict[str, ReplySink] = {}  # engine thread only
        self.stats = _Stats()

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
                self._inbox.put_nowait(_Cmd("stop"))
                break
            except queue.Full:
                await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._thread = None

    # ---- commands (asyncio side) -----------------------------------------------------
    def _put(self, cmd: _Cmd) -> None:
        try:
            self._inbox.put_nowait(cmd)
        except queue.Full:
            raise EngineBusy("engine inbox full") from None
        metrics.ENGINE_INBOX.set(self._inbox.qsize())

    def open_session(self, session_id: str, sink: ReplySink) -> None:
        self._put(_Cmd("open", session_id, sink=sink))

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        self._put(_Cmd("audio", session_id, pcm=pcm))

    def discard_turn(self, session_id: str) -> None:
        self._put(_Cmd("discard", session_id))

    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> None:
        self._put(_Cmd("reply", session_id, images=tuple(images), text_only=text_only))

    def cancel_reply(self, session_id: str) -> None:
        self._put(_Cmd("cancel", session_id))

    def close_session(self, session_id: str) -> None:
        self._put(_Cmd("close", session_id))

    # ---- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None and self._ready is not None
        try:
            runner = self._factory()
        except Exception as exc:  # loading failed: report it to start(), end the thread
            log.exception("engine: model load failed")
            self._loop.call_soon_threadsafe(self._ready.set_exception, exc)
            return
        self._loop.call_soon_threadsafe(self._ready.set_result, None)
        while True:
            # Block only when there is nothing to step; otherwise just drain what is there.
            block = not runner.has_work()
            try:
                cmd = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd.op == "stop":
                    for sid in list(self._sinks):
                        runner.close_session(sid)
                    return
                self._apply(runner, cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            metrics.ENGINE_INBOX.set(self._inbox.qsize())
            if not runner.has_work():
                continue
            t0 = time.perf_counter()
            try:
                outputs = runner.step()
            except Exception as exc:
                # A model error must end the replies in flight, not the engine or the process.
                log.exception("engine: step failed")
                self.stats.last_error = repr(exc)
                outputs = []
                for sid in list(self._sinks):
                    try:
                        runner.cancel_reply(sid)
                    except Exception:
                        log.exception("engine: cancel after failure failed")
                    outputs.append(ReplyDone(sid, "error", stats={"error": str(exc)}))
            self.stats.steps += 1
            self.stats.step_seconds += time.perf_counter() - t0
            self._emit(outputs)

    def _apply(self, runner: Runner, cmd: _Cmd) -> None:
        sid = cmd.session_id
        try:
            if cmd.op == "open":
                assert cmd.sink is not None
                self._sinks[sid] = cmd.sink
                runner.open_session(sid)
            elif sid not in self._sinks:
                return  # session already closed: late audio is harmless
            elif cmd.op == "audio":
                assert cmd.pcm is not None
                runner.append_audio(sid, cmd.pcm)
            elif cmd.op == "discard":
                runner.discard_turn(sid)
            elif cmd.op == "reply":
                runner.begin_reply(sid, list(cmd.images), cmd.text_only)
            elif cmd.op == "cancel":
                runner.cancel_reply(sid)
            elif cmd.op == "close":
                runner.close_session(sid)
                del self._sinks[sid]
        except Exception as exc:
            # Bad input from one session (e.g. an image the processor rejects) is that
            # session's error only.
            log.exception("engine: %s for %s failed", cmd.op, sid)
            self._emit([ReplyDone(sid, "error", stats={"error": f"{cmd.op}: {exc}"})])

    def _emit(self, outputs: list[Output]) -> None:
        assert self._loop is not None
        for out in outputs:
            if isinstance(out, StageTime):
                metrics.STAGE.labels(stage=out.stage).observe(out.seconds)
                continue
            sink = self._sinks.get(out.session_id)
            if sink is None:
                continue
            if isinstance(out, TextDelta):
                self._loop.call_soon_threadsafe(sink.on_text, out)
            elif isinstance(out, AudioOut):
                self._loop.call_soon_threadsafe(sink.on_audio, out)
            elif isinstance(out, ReplyDone):
                self._loop.call_soon_threadsafe(sink.on_done, out)
