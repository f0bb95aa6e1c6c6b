"""Speculative start, the StreamingRunner's part of it (a mixin: these methods run on the
runner, on the engine thread).

On a short pause of the user (agent/media/vad.py SpeechPaused) the session asks for `speculate`: the
reply to the turn so far begins in phase SPECULATING (agent/engine/state/phase.py) on a fork of the
turn, while the turn itself keeps listening. The scheduler prefills it last (Plan.speculate);
its first frame is made and held, and it parks (HELD). At the end of the turn `begin_reply`
commits it: the held output is released at once (`take_ready`). If the user speaks again
(`drop_speculation`) or anything edits the conversation first, it is discarded: the session's
state goes back to its Rollback, i.e. the KV rows to their lengths before it, and nothing it
made ever left the runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from agent import metrics
from agent.engine.api import Output, StageTime
from agent.engine.runner.scheduler import PlayoutClock
from agent.engine.state.phase import ReplyPhase
from agent.engine.state.session import Rollback, SessionState

if TYPE_CHECKING:
    from agent.engine.runner.streaming import StreamingRunner


class Speculation:
    @torch.inference_mode()
    def speculate(self: StreamingRunner, session_id: str, images: list[np.ndarray], text_only: bool = False) -> bool:
        """The user paused: start the reply to the turn so far, invisibly. Its prefill and first
        frame run at the scheduler's lowest priority and its output is held; begin_reply commits
        it (the held output goes out at once), drop_speculation or more speech discards it. The
        turn itself keeps listening: the speculation answers a fork of it. Returns whether one
        started (not while a reply is in flight or a held turn waits for one, nor before the
        turn has any audio)."""
        state = self._sessions[session_id]
        turn = state.turn
        if state.reply is not None or state.held_turns or not (turn.header_done or turn.pcm or turn.samples):
            return False
        rollback = Rollback.of(state)
        state.reply = self._new_reply(ReplyPhase.SPECULATING, turn.fork(), images, text_only)
        state.reply.rollback = rollback
        if not text_only:
            self.frames.start_reply(state)
        metrics.SPECULATIONS.labels(outcome="started").inc()
        return True

    def drop_speculation(self: StreamingRunner, session_id: str) -> bool:
        """The user spoke again: discard the session's speculative reply, if any (no output, the
        KV rows back to their lengths before it). Returns whether there was one."""
        state = self._sessions.get(session_id)
        if state is None or state.reply is None or not state.reply.phase.speculative:
            return False
        self._discard(state)
        return True

    def take_ready(self: StreamingRunner) -> list[Output]:
        """Output ready outside a step (a committed speculation's held frame): the engine loop
        emits it right after the command that released it."""
        ready, self._ready = self._ready, []
        return ready

    def _discard(self: StreamingRunner, state: SessionState) -> None:
        reply = state.reply
        reply.move(ReplyPhase.DISCARDED)
        assert reply.rollback is not None
        reply.rollback.restore(state)
        state.reply = None
        metrics.SPECULATIONS.labels(outcome="discarded").inc()

    def _commit(self: StreamingRunner, state: SessionState) -> None:
        reply = state.reply
        # The audio that came after the pause (the end-of-turn silence) is not part of the
        # answered turn: the next turn starts fresh, as after any begin_reply.
        state.turn = self.turns.new_turn()
        self.turns.video.seed(state, self.clock())
        state.last_reply = None
        reply.rollback = None
        reply.from_speculation = True
        now = self.clock()
        reply.started = now
        outcome = "committed_held" if reply.phase is ReplyPhase.HELD else "committed_prefilling"
        if reply.phase is ReplyPhase.SPECULATING:
            reply.move(ReplyPhase.PREFILLING)  # the rest of its prefill runs as for any reply
        else:
            reply.move(ReplyPhase.STREAMING)
            reply.first_audio = 0.0 if reply.voice.samples_out else None
            # The held audio starts playing now, not when it was made.
            reply.playout = PlayoutClock()
            if reply.voice.samples_out:
                reply.playout.add(now, reply.voice.samples_out / self.loaded.output_rate)
            self._ready += reply.held
        reply.held = []
        metrics.SPECULATIONS.labels(outcome=outcome).inc()

    def _hold(self: StreamingRunner, outputs: list[Output]) -> list[Output]:
        """Keep a speculative reply's output in its hold: until its commit, nothing of it goes out."""
        out: list[Output] = []
        for item in outputs:
            state = self._sessions.get(item.session_id) if not isinstance(item, StageTime) else None
            if state is not None and state.reply is not None and state.reply.phase.speculative:
                state.reply.held.append(item)
            else:
                out.append(item)
        return out
