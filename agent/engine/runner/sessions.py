"""The sessions table the StreamingRunner's components share (on the engine thread): every open
session's state, the slot pool of the static caches, the sessions' scheduling priorities, and
slot allocation. It is the one owner of which session holds which slot: a session's own slot
(taken at open) and a conversation's transcription slot (agent/engine/runner/transcription.py)
both come from here and go back here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from agent.engine.api import SlotsExhausted
from agent.engine.ops.slots import SlotPool
from agent.engine.runner.transcriber import Transcriber
from agent.engine.state.session import SessionState

log = logging.getLogger(__name__)


class SessionTable(Mapping[str, SessionState]):
    """session id -> SessionState (a read-only mapping; `add` and `remove` change it)."""

    def __init__(self, max_sessions: int, transcriber: Transcriber) -> None:
        self.slots = SlotPool(max_sessions)
        self.transcriber = transcriber  # a conversation's transcription slot can be taken back
        self._states: dict[str, SessionState] = {}
        self._priority: dict[str, int] = {}  # session -> scheduler priority (set_priority); default 0

    # ---- the mapping -----------------------------------------------------------------------

    def __getitem__(self, session_id: str) -> SessionState:
        return self._states[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def add(self, session_id: str, state: SessionState) -> None:
        self._states[session_id] = state

    def remove(self, session_id: str) -> None:
        """The session is gone: its slot, its transcription's slot and its priority go back."""
        state = self._states.pop(session_id, None)
        if state is not None:
            self.slots.give(state.slot)
        self.give(self.transcriber.close(session_id))
        self._priority.pop(session_id, None)

    # ---- slots -----------------------------------------------------------------------------

    def take_session_slot(self) -> int:
        """A slot for a new session. Sessions come first: when none is free, a conversation's
        transcription gives back the slot it took (that session's transcription stops)."""
        try:
            return self.slots.take()
        except SlotsExhausted:
            for session_id, tr in list(self.transcriber.sessions.items()):
                if tr.own_slot is not None:
                    log.warning("session %s: transcription stopped, its slot went to a new session", session_id)
                    self.slots.give(self.transcriber.close(session_id))
                    return self.slots.take()
            raise

    def take_slot(self) -> int:
        """A slot for a conversation's transcription (none is taken back for it)."""
        return self.slots.take()

    def give(self, slot: int | None) -> None:
        """A slot back to the pool (None: nothing was taken)."""
        if slot is not None:
            self.slots.give(slot)

    # ---- priorities ------------------------------------------------------------------------

    def priority(self, session_id: str) -> int:
        return self._priority.get(session_id, 0)

    def set_priority(self, session_id: str, priority: int) -> int:
        if session_id not in self._states:
            raise KeyError(session_id)
        self._priority[session_id] = priority
        return priority
