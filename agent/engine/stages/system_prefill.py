"""A session's system prompt goes into the thinker cache a chunk per tick, between other sessions' frames.

The system prompt (the runner's, or the instructions a client sets before its first turn) is
the first thing in a session's cache. A client may make it nearly as long as the context:
instructions of tens of thousands of tokens are allowed. One forward over all of it held the
engine thread for as long as that took, and meanwhile every other session's audio ran dry. On
this project's 2-core CPU with the tiny model, 7.9k tokens took 1.6 s in one forward and 16.5k
took 6.9 s.

So it is a job that runs in chunks of at most prefill_chunk_tokens, as a turn's prefill does
(agent/engine/runner/scheduler.py):
- The first chunk at once, when the prompt is set (the session opens, or its instructions
  replace the prompt). A prompt that fits in one chunk, as most do, is in the cache before the
  next tick, as it always was.
- The rest in the ticks that prefill microphone audio (nothing more urgent waits). Sessions, in
  the order they opened, share one budget there.
- Once the session's reply waits on it, in that reply's share of the first-audio budget. The
  reply's own prefill starts in the same tick with what the budget has left.
Nothing else of the session goes into the cache before it is done, because the job's positions
start at 0:
- its microphone audio waits (TurnPrefill._flushable);
- no speculation starts (Speculation.speculate);
- a path that must prefill at once finishes it first (`finish`): sealing committed items.
A history reset (a full context) does not start a job: the prompt goes in as the closing of the
turn it replays, in that turn's chunks (TurnParts._reset_history).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.engine.checkpoints.model import LoadedModel, system_turn_ids
from agent.engine.stages.thinker import PrefillJob, ThinkerOps
from agent.engine.state.session import SessionState, timed_all


class SystemPrefill:
    def __init__(self, loaded: LoadedModel, thinker: ThinkerOps, system_prompt: str, chunk_tokens: int) -> None:
        """system_prompt: the runner's, for sessions that set no instructions of their own.
        chunk_tokens: what `start` prefills at once (the scheduler's prefill_chunk_tokens)."""
        self.loaded, self.thinker, self.system_prompt = loaded, thinker, system_prompt
        self.chunk_tokens = chunk_tokens

    def start(self, state: SessionState) -> None:
        """The session's system prompt (its instructions, else the runner's) as the job that
        fills its cache from the start, whatever the cache held; its first chunk now."""
        state.thinker.crop(0, 0)
        state.system = self.thinker.start_prefill(state.thinker, self.ids(state))
        self.run([(state, self.chunk_tokens)])

    def ids(self, state: SessionState) -> list[int]:
        """The session's system turn: its instructions, else the runner's prompt."""
        prompt = self.system_prompt if state.choices.system_prompt is None else state.choices.system_prompt
        return system_turn_ids(self.loaded.ids, self.loaded.tokenizer, prompt)

    @staticmethod
    def waiting(state: SessionState) -> bool:
        """The session's system prompt is not all in the cache, and the session prefills
        (a transcription-only session never does: its job waits until it is one no more)."""
        return state.system is not None and not state.choices.captions_only

    @staticmethod
    def left(state: SessionState) -> int:
        job: PrefillJob | None = state.system
        return 0 if job is None else job.left

    def run(self, chunks: Sequence[tuple[SessionState, int | None]]) -> None:
        """The next chunk of each session's job (at most that many tokens; None: to its end),
        all in one batched forward."""
        if not chunks:
            return
        items = [(state.thinker, state.system, n) for state, n in chunks]
        with timed_all([state for state, _ in chunks], "thinker_prefill"):
            self.thinker.run_prefills(items)
        for state, _ in chunks:
            # Its outputs are never read (the reply's prefill ends with its own): a chunk's
            # logits alone are a vocabulary of floats, 0.6 MB at real size.
            state.system.outs.clear()
            if state.system.finished:
                state.system = None

    def run_waiting(self, states: Sequence[SessionState], budget: int) -> int:
        """The waiting jobs of `states`, in order, sharing `budget` tokens; returns those taken."""
        chunks: list[tuple[SessionState, int | None]] = []
        taken = 0
        for state in states:
            if taken >= budget:
                break
            if self.waiting(state):
                take = min(budget - taken, self.left(state))
                chunks.append((state, take))
                taken += take
        self.run(chunks)
        return taken

    def finish(self, state: SessionState) -> None:
        """The whole job now, for a path that prefills at once."""
        if state.system is not None:
            self.run([(state, None)])
