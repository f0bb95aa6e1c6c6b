"""One session's way to the engine: its id bound, its commands typed, its answers tracked.

The session's parts (agent/realtime/replies.py, server_turn.py, input_transcription.py, edits.py)
are given this port, not the Session or the Engine. It sends the turn's stream (audio, replies,
cancels) as the Engine's typed methods do, and session commands (agent/engine/commands.py) with
`send`, whose failure becomes an error event on the session's outbox. Every answer not yet
come is tracked and cancelled at `close()`, so that nothing chained on one (a truncation's
announcement, an error report) runs after the session has gone: its callbacks see a cancelled
future and leave. EngineBusy (the engine's inbox is full) is raised to the caller, as the Engine
raises it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import numpy as np

from agent.engine.api import EngineBusy, ReplySink, SlotsExhausted, Voices
from agent.engine.commands import SessionCommand, describe
from agent.engine.loop import Engine
from agent.realtime.outbox import Outbox

log = logging.getLogger(__name__)


class EnginePort:
    def __init__(self, engine: Engine, session_id: str, outbox: Outbox) -> None:
        self._engine, self.session_id, self._outbox = engine, session_id, outbox
        self._pending: set[asyncio.Future] = set()  # answers not come yet: cancelled at close
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def has_fallback(self) -> bool:
        return self._engine.has_fallback

    @property
    def voices(self) -> Voices:
        """The loaded model's speakers (none known before it is ready)."""
        return self._engine.voices

    # ---- the turn's stream -----------------------------------------------------------------
    def open(self, sink: ReplySink) -> asyncio.Future:
        """Settled once the engine has opened the session (or with why it could not)."""
        return self._engine.open_session(self.session_id, sink)

    def append_audio(self, pcm: np.ndarray) -> None:
        self._engine.append_audio(self.session_id, pcm)

    def discard_turn(self) -> None:
        self._engine.discard_turn(self.session_id)

    def begin_reply(self, mode: str, history: tuple[tuple[str, str], ...]) -> None:
        self._engine.begin_reply(self.session_id, [], mode=mode, history=history)

    def cancel_reply(self) -> None:
        self._engine.cancel_reply(self.session_id)

    def speculate(self, mode: str) -> None:
        self._engine.speculate(self.session_id, [], mode=mode)

    def drop_speculation(self) -> None:
        self._engine.drop_speculation(self.session_id)

    # ---- session commands ------------------------------------------------------------------
    def send(
        self, command: SessionCommand, *, event_id: Optional[str] = None, param: Optional[str] = None
    ) -> asyncio.Future:
        """A runner method in order with the session's other commands; a failure becomes an error
        event (naming `param` when the client's value for it was refused: a ValueError)."""
        future = self.ask(command)

        def report(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is None or self._closed:
                return
            exc = f.exception()
            if param is not None and isinstance(exc, ValueError):
                self._outbox.error(str(exc), "invalid_value", param=param, event_id=event_id)
                return
            code = (
                "unsupported"
                if isinstance(exc, NotImplementedError)
                else "capacity"
                if isinstance(exc, SlotsExhausted)
                else "engine_error"
            )
            self._outbox.error(f"{describe(command)}: {exc}", code, event_id=event_id, param=param)

        future.add_done_callback(report)
        return future

    def ask(self, command: SessionCommand) -> asyncio.Future:
        """As `send`, but a failure is the caller's to look at (nothing is reported). After close:
        an already cancelled future, and nothing is sent."""
        if self._closed:
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            return future
        future = self._engine.send(self.session_id, command)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    # ---- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel every unanswered command (their callbacks see that and leave), then close the
        session in the engine (a full inbox is logged: the engine forgets it on stop)."""
        if self._closed:
            return
        self._closed = True
        for future in list(self._pending):
            future.cancel()
        self._pending.clear()
        try:
            self._engine.close_session(self.session_id)
        except EngineBusy:
            log.warning("session %s: engine inbox full on close", self.session_id)
