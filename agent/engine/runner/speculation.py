"""Speculative start, the StreamingRunner's component for it (on the engine thread): when a
speculation may start and when it must go. The reply's lifecycle itself (its phases, its hold,
its commit) is agent/engine/runner/replies.py's.

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

import numpy as np
import torch

from agent import metrics
from agent.engine.runner.replies import Replies
from agent.engine.runner.sessions import SessionTable


class Speculation:
    def __init__(self, sessions: SessionTable, replies: Replies) -> None:
        self.sessions, self.replies = sessions, replies

    @torch.inference_mode()
    def speculate(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> bool:
        """The user paused: start the reply to the turn so far, invisibly. Its prefill and first
        frame run at the scheduler's lowest priority and its output is held; begin_reply commits
        it (the held output goes out at once), drop_speculation or more speech discards it. The
        turn itself keeps listening: the speculation answers a fork of it. Returns whether one
        started (not while a reply is in flight or a held turn waits for one, nor while the
        system prompt or a part of the turn is still going into the cache, nor before the turn
        has any audio)."""
        state = self.sessions[session_id]
        turn = state.turn
        if state.reply is not None or state.held_turns or state.system is not None or turn.flushing is not None:
            return False  # (a rollback would lose the progress of those prefills with the reply's)
        if not (turn.header_done or turn.pcm or turn.samples):
            return False
        self.replies.speculate(state, images, text_only)
        metrics.SPECULATIONS.labels(outcome="started").inc()
        return True

    def drop_speculation(self, session_id: str) -> bool:
        """The user spoke again: discard the session's speculative reply, if any (no output, the
        KV rows back to their lengths before it). Returns whether there was one."""
        state = self.sessions.get(session_id)
        if state is None or state.reply is None or not state.reply.phase.speculative:
            return False
        self.replies.discard(state)
        return True
