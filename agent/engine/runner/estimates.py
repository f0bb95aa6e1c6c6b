"""What the scheduler sees of the StreamingRunner's replies (a mixin: these methods run on the
runner, on the engine thread): each reply's playout clock as a PlayoutEstimate (the metrics'
buffer per session) and as the ReplyView that agent/engine/runner/scheduler.py plans a tick from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.engine.runner.scheduler import PlayoutEstimate, ReplyView
from agent.engine.state.session import SessionState

if TYPE_CHECKING:
    from agent.engine.runner.streaming import StreamingRunner


class Estimates:
    def playout(self: StreamingRunner) -> list[PlayoutEstimate]:
        """Every reply in flight as the scheduler sees it (for metrics: buffer per session)."""
        now = self.clock()
        estimates = []
        for session_id, state in self._sessions.items():
            reply = state.reply
            if reply is None or reply.phase.speculative:
                continue
            clock = reply.playout
            phase = "first_audio" if reply.phase.prefilling else ("text" if reply.text_only else "speaking")
            since = reply.started if clock.first_audio_at is None else clock.first_audio_at
            estimates.append(PlayoutEstimate(session_id, phase, clock.buffer_s(now), clock.produced_s, now - since))
        return estimates

    def _view(self: StreamingRunner, session_id: str, state: SessionState, now: float) -> ReplyView:
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
            self._priority.get(session_id, 0),
            speculative=reply.phase.speculative,
        )
