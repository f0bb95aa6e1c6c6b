"""What the scheduler sees of the StreamingRunner's replies (a component on the engine thread,
reading the sessions table): each reply's playout clock as a PlayoutEstimate (the metrics'
buffer per session) and as the ReplyView that agent/engine/runner/scheduler.py plans a tick from.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.engine.runner.scheduler import PlayoutEstimate, ReplyView
from agent.engine.runner.sessions import SessionTable
from agent.engine.state.phase import ReplyPhase
from agent.engine.state.session import SessionState


class Estimates:
    def __init__(self, sessions: SessionTable, clock: Callable[[], float]) -> None:
        self.sessions, self.clock = sessions, clock

    def playout(self) -> list[PlayoutEstimate]:
        """Every reply in flight as the scheduler sees it (for metrics: buffer per session)."""
        now = self.clock()
        estimates = []
        for session_id, state in self.sessions.items():
            reply = state.reply
            if reply is None or reply.phase.speculative:
                continue
            clock = reply.playout
            phase = "first_audio" if reply.phase.prefilling else ("text" if reply.text_only else "speaking")
            since = reply.started if clock.first_audio_at is None else clock.first_audio_at
            estimates.append(PlayoutEstimate(session_id, phase, clock.buffer_s(now), clock.produced_s, now - since))
        return estimates

    def scheduled(self) -> dict[str, SessionState]:
        """The sessions whose replies the scheduler plans (a held speculation is parked: it waits
        for its commit, not for the scheduler)."""
        return {
            sid: st
            for sid, st in self.sessions.items()
            if st.reply is not None and st.reply.phase is not ReplyPhase.HELD
        }

    def views(self, replies: dict[str, SessionState], now: float) -> list[ReplyView]:
        return [self.view(sid, st, now) for sid, st in replies.items()]

    def view(self, session_id: str, state: SessionState, now: float) -> ReplyView:
        reply = state.reply
        if reply.text_only or reply.voice.done:
            buffer = None  # only text left to make: no playout deadline
        else:
            buffer = reply.playout.buffer_s(now)
            buffer = 0.0 if buffer is None else buffer  # no audio out yet: nothing buffered
        return ReplyView(
            session_id,
            reply.started,
            reply.phase.prefilling,
            buffer,
            self.sessions.priority(session_id),
            speculative=reply.phase.speculative,
        )
