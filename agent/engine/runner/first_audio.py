"""The first-audio part of a tick: end-of-turn prefills in chunks, then each finished reply's
first text token and talker prefix (its first frame is rendered with the tick's other rows).

First-audio replies share the tick's prefill budget (prefill_chunk_tokens) in the scheduler's
order (agent/engine/runner/scheduler.py: priority, then deadline), speculative ones last. A
reply whose session's system prompt is not all in the cache yet spends its share on the prompt
first (agent/engine/stages/system_prefill.py), then on the part of its turn that began going
in while the user spoke, if that is not all in (a long closing: TurnPrefill.flush_audios), and
its own prefill starts with what is left.
The replies' chunks run in one batched forward, as do the talker prefixes of those that finish.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from agent.engine.api import Output, ReplyInput
from agent.engine.runner.replies import Replies
from agent.engine.stages.frame_batch import FrameBatcher, Row
from agent.engine.stages.thinker import PrefillOut
from agent.engine.stages.turn_parts import SpeculationRefused
from agent.engine.stages.turn_prefill import TurnPrefill
from agent.engine.state.session import SessionState


class FirstAudio:
    def __init__(
        self, turns: TurnPrefill, replies: Replies, frames: FrameBatcher, discard_turn: Callable[[str], None]
    ) -> None:
        """discard_turn: drops a session's turn being spoken (Intake's), after its reply failed."""
        self.turns, self.replies, self.frames, self.discard_turn = turns, replies, frames, discard_turn

    def advance(
        self, session_ids: Sequence[str], replies: Mapping[str, SessionState], budget: int
    ) -> tuple[list[Output], list[Row]]:
        """Prefill the replies of `session_ids` (in order) within `budget` tokens; returns the
        outputs and the rows whose prefill finished, whose first frame the tick renders."""
        outputs: list[Output] = []
        chunks: list[tuple[str, SessionState, int]] = []
        for session_id in session_ids:
            state = replies[session_id]
            if budget > 0 and self.turns.ahead(state):  # never a speculation's (Speculation.speculate)
                budget -= self.turns.run_ahead(state, budget)
            if budget <= 0:
                break
            if self.turns.ahead(state):
                continue
            try:
                take = self.turns.reply_chunk(state, budget)
            except SpeculationRefused:  # it would drop the history: that cannot be undone
                self.replies.discard(state)
                continue
            except Exception as exc:
                # This session's own end-of-turn work (its audio tail, its frames) failed, e.g.
                # out of memory on a huge image: its reply ends with an error, the others go on.
                outputs += self._fail(session_id, state, exc)
                continue
            chunks.append((session_id, state, take))
            budget -= take
        done = self.turns.run_replies([(state, take) for _, state, take in chunks]) if chunks else []
        finished = [(sid, state, out) for (sid, state, _), out in zip(chunks, done) if out is not None]
        now = self.replies.clock()
        for _, state, _ in finished:  # (a speculation's: before its commit, which restarts the clock)
            state.reply.prefill_done = max(0.0, now - state.reply.started)
        outputs += [ReplyInput(sid, self.replies.input_stats(state.reply.turn)) for sid, state, _ in finished]
        outputs += self._first_tokens(finished)
        return outputs, [(sid, state) for sid, state, _ in finished]

    def _fail(self, session_id: str, state: SessionState, exc: Exception) -> list[Output]:
        """A reply whose own work raised ends with an error (a speculation is discarded) and a
        spoken one's turn is dropped, so the session's next turn starts clean."""
        spoken = not state.reply.phase.speculative
        outputs = self.replies.fail(session_id, state, exc)
        if spoken:
            self.discard_turn(session_id)
        return outputs

    def _first_tokens(self, finished: list[tuple[str, SessionState, PrefillOut]]) -> list[Output]:
        """First text token of every reply whose prefill just finished, then the talker prefixes
        of the spoken ones in one batched forward and their first codebook-0 tokens."""
        outputs: list[Output] = []
        if finished:
            # A reply has at least one text token: the end is held back for the first step.
            logits = torch.stack([out.last_logits for _, _, out in finished])
            tokens = self.frames.pick_tokens([state for _, state, _ in finished], logits, first=True)
            for (session_id, state, _), token in zip(finished, tokens):
                outputs += self.frames.take_token(session_id, state, token)
        # (A reply that opens with a tool call never starts its talker: nothing of it is spoken.)
        spoken = [state for _, state, _ in finished if not (state.reply.text_only or state.reply.voice.done)]
        if spoken:
            self.frames.take_code0(spoken, self.turns.talker_prefills(spoken))
        return outputs
