"""The engine in a process of its own (`--engine-process`): the same EngineCore and runners, with
the interpreter lock of neither side in the other's way.

Why: on CPU with a small model, one engine step is thousands of small torch calls dispatched
from Python, and aiortc handles every packet in Python; in one process both need the one
interpreter lock most of the time and queue on it (docs/load.md), so a second core sits idle
while replies fall behind. In a child process the engine has its own lock (and core).

How: the parent's `ProcessEngine` is an `Engine` (the asyncio side's API is unchanged) whose
inbox is a bounded multiprocessing queue: each command goes over pickled, with the session id
and, where it is answered, a number standing for its future. The child (`serve_child`, started
with "spawn": torch and threads do not survive a fork) builds the runners from the Config, as
the engine thread would, and serves the inbox with an EngineCore whose Outside (ChildOutside)
sends every answer and output back over one queue: ("settle", number, result, error),
("deliver", session id, sink method, payload), ("stage", StageTime), ("startup", PhaseBegun or
PhaseDone: agent/engine/startup.py), ("ready", Voices) or ("failed", reason).
A reader thread in the parent turns them into call_soon_threadsafe calls on the sinks (the
Sessions stay in the parent; the child knows their ids), records stage metrics and keeps the
engine's StartupLog (the phases are timed in the child, logged and exported by the parent). If the child
dies, every session with a reply gets its error (ReplyDone "error") and health checks fail.

Limits: session commands are SESSION_COMMANDS only (Engine.register's test handlers need the
runner in this process); `engine.core` is None here. Counters the runners keep themselves
(speculation outcomes) are forwarded with the stage times (FORWARDED).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable, Optional, Union

from agent import metrics
from agent.config import Config
from agent.engine.api import EngineBusy, ReplyDone, ReplySink, Runner, voices_of
from agent.engine.commands import CloseSession, OpenSession, SessionCommand, StreamCommand
from agent.engine.core import SESSION_COMMANDS, EngineCore, Envelope
from agent.engine.loop import Engine
from agent.engine.outside import record_stage, settle
from agent.engine.startup import FALLBACK, PhaseTimer, StartupLog

log = logging.getLogger(__name__)

_SPAWN = multiprocessing.get_context("spawn")
# (runner_factory, fallback_factory): Config (and the runner's PhaseTimer) -> the callable that
# builds a runner (or None).
Builders = tuple[
    Callable[[Config, Optional[PhaseTimer]], Callable[[], Runner]], Callable[[Config], Optional[Callable[[], Runner]]]
]


class ProcessEngine(Engine):
    def __init__(
        self,
        config: Config,
        builders: Builders,
        inbox_size: int,
        fallback: bool,
        frames_per_turn: int,
        startup: Optional[StartupLog] = None,
    ) -> None:
        """builders: (runner_factory, fallback_factory) of agent/engine/factory.py, module-level
        functions the child calls with the config (spawn pickles them by name). startup: the log
        the child's phases go to (a fresh one when not given)."""
        super().__init__(_unused_factory, inbox_size, None, frames_per_turn, startup)
        self._config, self._builders = config, builders
        self._fallback, self._inbox_size = fallback, inbox_size
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._reader: Optional[threading.Thread] = None
        self._outbox: Any = None
        self._sinks: dict[str, ReplySink] = {}  # the sessions, by id (the child knows the ids)
        self._futures: dict[int, asyncio.Future] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()  # _sinks and _futures: the loop writes, the reader reads

    @property
    def has_fallback(self) -> bool:
        return self._fallback

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._inbox = _SPAWN.Queue(maxsize=self._inbox_size)
        self._outbox = _SPAWN.Queue()
        self._startup.start()
        self._process = _SPAWN.Process(
            target=serve_child,
            args=(self._config, self._builders, self._fallback, self._frames_per_turn, self._inbox, self._outbox),
            name="engine",
            daemon=True,
        )
        self._process.start()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        await self._ready

    async def stop(self) -> None:
        if self._process is None:
            return
        await self._put_stop()
        process = self._process
        await asyncio.get_running_loop().run_in_executor(None, process.join, 10.0)
        if process.is_alive():
            process.kill()
        self._outbox.put(("stopped",))  # the reader's last message
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._reader.join, 5.0)
        self._process = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and self.failed is None

    def register(self, command: type, handler: Any, needs: Optional[type] = None) -> None:
        raise NotImplementedError("an engine process serves SESSION_COMMANDS only")

    # ---- commands (asyncio side) ---------------------------------------------------------
    def _put(
        self, session_id: str, command: Union[StreamCommand, SessionCommand], future: Optional[asyncio.Future] = None
    ) -> None:
        number = None
        with self._lock:
            if isinstance(command, OpenSession):
                self._sinks[session_id] = command.sink
                command = OpenSession(session_id)  # type: ignore[arg-type]  (the child's sink: the id)
            if future is not None:
                number = next(self._numbers)
                self._futures[number] = future
        try:
            self._inbox.put_nowait(Envelope(session_id, command, number))  # type: ignore[arg-type]
        except queue.Full:
            with self._lock:
                self._futures.pop(number, None)  # type: ignore[arg-type]
            raise EngineBusy("engine inbox full") from None
        if isinstance(command, CloseSession):
            with self._lock:
                self._sinks.pop(session_id, None)
        metrics.ENGINE_INBOX.set(self._inbox.qsize())

    # ---- the reader thread ---------------------------------------------------------------
    def _read(self) -> None:
        assert self._loop is not None and self._ready is not None
        loop, ready = self._loop, self._ready
        while True:
            try:
                message = self._outbox.get(timeout=1.0)
            except queue.Empty:
                process = self._process
                if process is None or process.is_alive():
                    continue
                message = ("died", f"exit code {process.exitcode}")  # killed, or crashed in native code
            except (EOFError, OSError):
                message = ("died", "the engine process's pipe closed")
            kind = message[0]
            if kind == "stopped":
                return
            if kind == "deliver":
                _, session_id, method, payload = message
                with self._lock:
                    sink = self._sinks.get(session_id)
                fn = getattr(sink, method, None) if sink is not None else None
                if fn is not None:
                    loop.call_soon_threadsafe(fn, payload)
            elif kind == "settle":
                _, number, result, error = message
                with self._lock:
                    future = self._futures.pop(number, None)
                if future is not None:
                    loop.call_soon_threadsafe(settle, future, result, error)
            elif kind == "stage":
                record_stage(message[1])
            elif kind == "startup":  # a phase began or ended in the child
                self._startup.apply(message[1])
            elif kind == "count" and message[1] in FORWARDED:
                _, name, labels, delta = message
                getattr(metrics, name).labels(**labels).inc(delta)
            elif kind == "ready":  # the runners are loaded; what the parent must know of them
                self.voices = message[1]
                self._startup.ready()
                loop.call_soon_threadsafe(settle, ready, None, None)
            elif kind == "failed":  # the model did not load
                loop.call_soon_threadsafe(settle, ready, None, RuntimeError(message[1]))
                return
            elif kind == "died":
                self._died(message[1])
                return

    def _died(self, reason: str) -> None:
        """The child ended while serving: say so, and end every reply in flight."""
        assert self._loop is not None
        self.failed = f"engine process died: {reason}"
        log.critical("engine: %s", self.failed)
        with self._lock:
            sinks, futures = dict(self._sinks), dict(self._futures)
            self._futures.clear()
        for future in futures.values():
            self._loop.call_soon_threadsafe(settle, future, None, RuntimeError(self.failed))
        for session_id, sink in sinks.items():
            self._loop.call_soon_threadsafe(sink.on_done, ReplyDone(session_id, "error", stats={"error": self.failed}))


def _unused_factory() -> Any:
    raise RuntimeError("a process engine builds its runners in the child")


# Counters the runners keep themselves (in the child): their increments go to the parent's
# /metrics with the stage times, at most every half second.
FORWARDED = ("SPECULATIONS",)


class ChildOutside:
    """The child's way back to the parent: one queue, plain picklable tuples."""

    def __init__(self, outbox: Any) -> None:
        self._outbox = outbox
        self._counted: dict[tuple, float] = {}  # (metric, labels) -> value sent so far
        self._forwarded_at = 0.0

    def settle(self, future: Any, result: Any, error: Optional[BaseException]) -> None:
        if future is None:
            return
        if error is not None and not _picklable(error):
            error = RuntimeError(f"{type(error).__name__}: {error}")
        if not _picklable(result):
            result, error = None, RuntimeError(f"an answer of type {type(result).__name__} cannot leave the engine")
        self._outbox.put(("settle", future, result, error))

    def deliver(self, sink: Any, method: str, payload: Any) -> None:
        self._outbox.put(("deliver", sink, method, payload))

    def stage(self, out: Any) -> None:
        self._outbox.put(("stage", out))
        now = time.monotonic()
        if now - self._forwarded_at >= 0.5:
            self._forwarded_at = now
            self._forward_counters()

    def _forward_counters(self) -> None:
        for name in FORWARDED:
            for family in getattr(metrics, name).collect():
                for sample in family.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    key = (name, tuple(sorted(sample.labels.items())))
                    delta = sample.value - self._counted.get(key, 0.0)
                    if delta > 0:
                        self._counted[key] = sample.value
                        self._outbox.put(("count", name, dict(sample.labels), delta))


def _picklable(value: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001 (anything that does not survive the trip)
        return False
    return True


def _exit_with_parent() -> None:
    """The parent was killed (no Stop came): an engine with no one to serve ends too, rather than
    hold the model's memory (a daemon child is only ended by a parent that exits normally)."""
    parent = multiprocessing.parent_process()
    while parent is not None and parent.is_alive():
        time.sleep(1.0)
    os._exit(1)


def serve_child(
    config: Config, builders: Builders, fallback: bool, frames_per_turn: int, inbox: Any, outbox: Any
) -> None:
    """The child process: build the runners as the engine thread would, then serve the inbox."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    runner_factory, fallback_factory = builders
    phases = PhaseTimer(lambda event: outbox.put(("startup", event)))  # the parent keeps the log
    try:
        runners = [runner_factory(config, phases)()]
        if fallback:
            build = fallback_factory(config)
            assert build is not None
            phases.begin(FALLBACK)
            runners.append(build())
            phases.end(FALLBACK)
    except Exception as exc:  # noqa: BLE001 (told to the parent, whatever it is)
        log.exception("engine process: model load failed")
        outbox.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    core = EngineCore(runners, ChildOutside(outbox), dict(SESSION_COMMANDS), frames_per_turn)
    threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    outbox.put(("ready", voices_of(runners[0])))
    try:
        core.serve(inbox)
    except BaseException as exc:  # the loop itself broke: the parent fails every reply
        log.critical("engine process: serve failed", exc_info=True)
        outbox.put(("died", repr(exc)))
        raise
