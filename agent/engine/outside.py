"""The engine core's way out: where its answers and outputs go, from the thread that owns torch.

`Outside` is the narrow port EngineCore (agent/engine/core.py) gets instead of the loop or the
parent process: settle a caller's future, deliver one output to a session's sink, record a
stage time. ThreadOutside is it for an engine thread in this process (every call handed to the
asyncio loop with call_soon_threadsafe: sinks and futures belong to the loop); ChildOutside
(agent/engine/process.py) is it for an engine in a child process.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Protocol

from agent import metrics
from agent.engine.api import StageTime


class Outside(Protocol):
    """Where the core's answers and outputs go: the asyncio loop of this process (ThreadOutside),
    or the parent of an engine process (agent/engine/process.py). `sink` is what OpenSession
    carried (a ReplySink here; a process engine's child gets the session id)."""

    def settle(self, future: Any, result: Any, error: Optional[BaseException]) -> None: ...

    def deliver(self, sink: Any, method: str, payload: Any) -> None:
        """Call sink.<method>(payload) on the loop, if the sink has that method."""

    def stage(self, out: StageTime) -> None: ...


class ThreadOutside:
    """The engine thread's way back to the asyncio loop of its own process."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def settle(self, future: Any, result: Any, error: Optional[BaseException]) -> None:
        self._loop.call_soon_threadsafe(settle, future, result, error)

    def deliver(self, sink: Any, method: str, payload: Any) -> None:
        fn = getattr(sink, method, None)  # on_call, on_transcript, on_input, on_open_failed: optional
        if fn is not None:
            self._loop.call_soon_threadsafe(fn, payload)

    def stage(self, out: StageTime) -> None:
        record_stage(out)


def record_stage(out: StageTime) -> None:
    metrics.STAGE.labels(stage=out.stage).observe(out.seconds)
    # A batched call is reported once per session in it: each takes its share, so the counter
    # sums to the engine thread's real time in the stage.
    metrics.ENGINE_SECONDS.labels(stage=out.stage).inc(out.seconds / max(out.batch, 1))
    metrics.ENGINE_CALLS.labels(stage=out.stage).inc(1 / max(out.batch, 1))


def settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    """On the loop: the caller's future gets the engine's answer, unless it gave up waiting."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
