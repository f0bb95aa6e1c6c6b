"""Shared by the back-pressure tests: an engine whose thread a test can stall (imported, not a test).

`HeldEngine(config)` builds the real engine (the streaming runner for `config`), which also takes
a `Hold()` command (`engine.send(session_id, Hold())`): it blocks the engine thread until
`release()`, the way a slow GPU step would, so the tests can watch what ingest and the sender do
while the engine is behind.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from agent.config import Config
from agent.engine.commands import SessionCommand
from agent.engine.factory import build_engine
from agent.engine.loop import Engine


@dataclass(frozen=True)
class Hold(SessionCommand):
    """Block the engine thread until the HeldEngine is released (its runner's `hold`)."""


class _Holdable:
    """The real runner, plus a `hold` that blocks the engine thread until released."""

    def __init__(self, inner: Any, released: threading.Event) -> None:
        self._inner = inner
        self._released = released

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def hold(self, session_id: str) -> None:
        self._released.wait(60)  # bounded: a test that forgets to release still ends


class HeldEngine:
    """An engine builder (start_agent's `engine=`) that remembers how to release its hold.
    `wrap`: applied to the real runner first (e.g. realtime_helpers.talker_never_ends)."""

    def __init__(self, wrap: Callable[[Any], Any] = lambda runner: runner) -> None:
        self._released = threading.Event()
        self._wrap = wrap

    def __call__(self, config: Config) -> Engine:
        engine = build_engine(config, wrap=lambda runner: _Holdable(self._wrap(runner), self._released))
        engine.register(Hold, lambda runner, sid, _cmd: runner.hold(sid))
        return engine

    def release(self) -> None:
        self._released.set()
