"""A reply's lifecycle, the only code that moves a reply's phase (agent/engine/state/phase.py,
through ReplyState.move): a reply begins (at the end of a turn, or speculatively on a pause),
a speculation is committed or discarded, a reply is cancelled, makes its first frame (it
streams, or a speculation parks with it held), finishes or fails. The runner's step() and the
speculation component (agent/engine/runner/speculation.py) ask it; it also keeps what a
speculation holds back (`hold`) and what its commit releases (`take_ready`), and each session's
last reply when recording (`records`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from agent import metrics
from agent.engine.api import Output, ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.model import LoadedModel
from agent.engine.codecs.detok import IncrementalDecoder
from agent.engine.runner.sessions import SessionTable
from agent.engine.stages.frame_batch import FrameBatcher
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.tool_grammar import ToolGrammars
from agent.engine.stages.turn_prefill import TurnPrefill
from agent.engine.state.phase import ReplyPhase
from agent.engine.state.reply import CallStage, PlayoutClock, PrefillStage, TextStage, VoiceStage
from agent.engine.state.session import LastReply, ReplyRecord, ReplyState, Rollback, SessionState, TurnState

# A reply's input counts (Replies.input_stats), in its ReplyInput and its ReplyDone's stats.
INPUT_STATS = ("prefill_tokens", "input_audio_tokens", "input_image_tokens", "input_video_tokens")


class Replies:
    def __init__(
        self,
        sessions: SessionTable,
        loaded: LoadedModel,
        turns: TurnPrefill,
        frames: FrameBatcher,
        talker: TalkerOps,
        clock: Callable[[], float],
        talker_max_tokens: int,
        seeds: random.Random,
        record: bool,
        grammars: ToolGrammars | None = None,
    ) -> None:
        """seeds: where each reply's sampling seed is drawn from. record: keep each session's
        last reply (codes, float waveform) in `records`. grammars: the tool-call grammars a
        reply starts with (its response's tools, else its session's; None: no tools at all)."""
        self.sessions, self.loaded, self.turns, self.frames, self.talker = sessions, loaded, turns, frames, talker
        self.clock = clock
        self.talker_max_tokens = talker_max_tokens
        self.seeds = seeds
        self.eos = set(loaded.thinker_eos_ids)
        self.record = record
        self.grammars = grammars
        self.records: dict[str, ReplyRecord] = {}
        self.ready: list[Output] = []  # released outside a step (take_ready)

    # ---- what the scheduler and the commands read ------------------------------------------

    def busy(self) -> bool:
        """A reply needs engine work (a held speculation does not: it waits for its commit)."""
        return any(s.reply is not None and s.reply.phase is not ReplyPhase.HELD for s in self.sessions.values())

    def take_ready(self) -> list[Output]:
        ready, self.ready = self.ready, []
        return ready

    # ---- a reply begins ----------------------------------------------------------------------

    def _new(
        self, state: SessionState, phase: ReplyPhase, turn: TurnState, images: list[np.ndarray], text_only: bool
    ) -> ReplyState:
        return ReplyState(
            phase=phase,
            text_only=text_only,
            turn=turn,
            started=self.clock(),
            prefill=PrefillStage(),
            text=TextStage(IncrementalDecoder(self.loaded.tokenizer)),
            voice=VoiceStage(self.talker_max_tokens),
            images=list(images),
            seed=self.seeds.getrandbits(32),
            calls=self._calls(state, turn),
        )

    def _calls(self, state: SessionState, turn: TurnState) -> CallStage:
        """A reply's tool calls: its response's tools, else its session's."""
        tools = turn.reply_tools if turn.reply_tools is not None else state.choices.tools
        if self.grammars is None or tools is None or not tools.tools:
            return CallStage()
        if not tools.calls:  # tool choice none
            return CallStage(banned=True)
        return CallStage(matcher=self.grammars.start(tools))

    def begin(self, state: SessionState, images: list[np.ndarray], text_only: bool) -> None:
        """The end of a turn: a speculation on it is committed (same kind) or discarded, else
        the reply to the oldest held turn, or to the turn being spoken, begins (PREFILLING)."""
        held = state.reply
        if held is not None and held.phase.speculative:
            if held.text_only == text_only:
                self.commit(state)
                return
            self.discard(state)
        if state.held_turns:  # an utterance that ended during the last reply comes first
            turn = state.held_turns.pop(0)
        else:  # the turn is answered from now on: audio that comes later belongs to the next one
            turn, state.turn = state.turn, self.turns.new_turn()
            self.turns.video.seed(state, self.clock())
        state.reply = self._new(state, ReplyPhase.PREFILLING, turn, images, text_only)
        state.last_reply = None  # the previous reply can no longer be truncated
        if not text_only:
            self.frames.start_reply(state)

    def speculate(self, state: SessionState, images: list[np.ndarray], text_only: bool) -> None:
        """A speculative reply (SPECULATING) to a fork of the turn so far, undone by its Rollback."""
        rollback = Rollback.of(state)
        state.reply = self._new(state, ReplyPhase.SPECULATING, state.turn.fork(), images, text_only)
        state.reply.rollback = rollback
        if not text_only:
            self.frames.start_reply(state)

    # ---- a speculation ends: committed or discarded ------------------------------------------

    def discard(self, state: SessionState) -> None:
        reply = state.reply
        reply.move(ReplyPhase.DISCARDED)
        assert reply.rollback is not None
        reply.rollback.restore(state)
        state.reply = None
        metrics.SPECULATIONS.labels(outcome="discarded").inc()

    def commit(self, state: SessionState) -> None:
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
        if reply.prefill_done is not None:  # prefilled on the pause: none of it is left at the commit
            reply.prefill_done = 0.0
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
            self.ready += reply.held
        reply.held = []
        metrics.SPECULATIONS.labels(outcome=outcome).inc()

    def hold(self, outputs: list[Output]) -> list[Output]:
        """Keep a speculative reply's output in its hold: until its commit, nothing of it goes out."""
        out: list[Output] = []
        for item in outputs:
            state = self.sessions.get(item.session_id) if not isinstance(item, StageTime) else None
            if state is not None and state.reply is not None and state.reply.phase.speculative:
                state.reply.held.append(item)
            else:
                out.append(item)
        return out

    # ---- a reply in flight ---------------------------------------------------------------------

    def cancel(self, session_id: str, state: SessionState) -> None:
        """Cancel asked: a speculation is discarded (nothing of it was seen: nothing to end); a
        reply being prefilled or streamed ends now, its ReplyDone released at once (take_ready).
        Not at the next tick: the commands queued behind the cancel (the truncation of this
        reply, the next reply's begin) are applied in the same drain of the inbox when the
        engine is behind, and must find it ended (a begin used to replace it unended)."""
        if state.reply.phase.speculative:
            self.discard(state)
        elif state.reply.phase in (ReplyPhase.PREFILLING, ReplyPhase.STREAMING):
            state.reply.move(ReplyPhase.CANCELLING)
            self.ready += self.finish(session_id, state, "cancelled")

    def first_frame(self, state: SessionState) -> None:
        """Its first frame (or token) is made: it streams; a speculation parks, its output held."""
        reply = state.reply
        reply.move(ReplyPhase.HELD if reply.phase is ReplyPhase.SPECULATING else ReplyPhase.STREAMING)

    def fail(self, session_id: str, state: SessionState, exc: Exception) -> list[Output]:
        """End a reply whose own work raised (its half-started prefill is abandoned); a
        speculation is discarded instead, unseen. The caller drops a spoken reply's turn."""
        if isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed allocation left cached is no one's
        if state.reply.phase.speculative:
            self.discard(state)  # unseen, like any dropped speculation; the turn goes on
            return []
        if state.reply.phase is not ReplyPhase.CANCELLING:
            state.reply.move(ReplyPhase.CANCELLING)  # its work is abandoned, then it ends
        outputs = self.finish(session_id, state, "error")
        done = outputs[-1]
        assert isinstance(done, ReplyDone)
        return outputs[:-1] + [replace(done, stats={**done.stats, "error": f"{type(exc).__name__}: {exc}"})]

    def input_stats(self, turn: TurnState) -> dict[str, int]:
        """What the turn's prefill put in the model (its usage in): tokens in all, and of them
        audio, image and video tokens."""
        pads = (self.loaded.ids.audio_pad, self.loaded.ids.image_pad, self.turns.video.kinds.video_pad)
        counts = [turn.prefill_tokens, *(turn.ids.count(pad) for pad in pads)]
        return dict(zip(INPUT_STATS, counts))

    def finish(self, session_id: str, state: SessionState, reason: str) -> list[Output]:
        """The reply ends (ENDED): it stays in the history as text, and its ReplyDone goes out."""
        reply, turn = state.reply, state.reply.turn
        reply.move(ReplyPhase.ENDED)
        if not reason:
            capped = "length" in (reply.text.reason, reply.voice.reason)
            reason = "length" if capped else "stop"
        text_ids = [t for t in reply.text.tokens if t not in self.eos]
        if reply.prefill.done:
            # The history keeps this reply as text: what the thinker has not fed yet, then the end.
            state.closing = [t for t in reply.text.tokens[reply.text.fed :] if t not in self.eos]
            state.closing += [self.loaded.ids.im_end, *self.loaded.ids.newline]
            state.closing_tail = len(state.closing)
            fed = min(reply.text.fed, len(text_ids))
            state.last_reply = LastReply(
                state.thinker.length - fed, state.thinker.next_pos - fed, tuple(text_ids), fed, reply.text.voice_end
            )
            state.closing += state.after_reply  # items and instructions added during the reply
            state.after_reply = []
            if not reply.voice.started:  # its user turn is not in the talker cache yet
                state.talker_history.backlog.append(turn.talker)
        else:
            self.turns.abandon_reply(state)
            # Nothing of the reply stays to follow: what was added during it goes before the
            # turn it gave back, after that turn's text when it holds nothing but text (the
            # conversation lists those items before the reply, and the reply before the added).
            added, state.after_reply = state.after_reply, []
            if added:
                spoken = state.turn.header_done or state.turn.pending_audio or state.turn.pcm
                text = [] if spoken else self.turns.user_text_turn(state.turn)
                self.turns.append_turns(state, [*text, *added])
        stats = {
            **(self.input_stats(turn) if reply.prefill.done else dict.fromkeys(INPUT_STATS, 0)),
            **self.turns.video.stats(turn, reply.frames_encoded_at_end),
            "history_reset": turn.history_reset if reply.prefill.done else False,
            "text_tokens": len(text_ids),
            "audio_frames": len(reply.voice.frame_codes),
            "audio_samples": reply.voice.samples_out,
            "context_tokens": state.thinker.length,
            "first_audio_seconds": reply.first_audio,
            "prefill_seconds": reply.prefill_done,
            "reply_seconds": self.clock() - reply.started,
            "stage_seconds": dict(reply.stage_seconds),
            "speculative": reply.from_speculation,  # committed from a speculative start
            "seed": reply.seed,  # its sampling stream: the same seed and input give the same reply
        }
        if self.record:
            codes = np.array(reply.voice.frame_codes, dtype=np.int64).T.reshape(self.talker.num_groups, -1)
            wav = np.concatenate(reply.voice.wav) if reply.voice.wav else np.zeros(0, dtype=np.float32)
            self.records[session_id] = ReplyRecord(tuple(text_ids), codes, wav, stats["prefill_tokens"])
        state.reply = None
        assert reply.text.decoder is not None
        tail = reply.text.decoder.finish()  # a split character held back at the very end
        outputs: list[Output] = [TextDelta(session_id, tail, ())] if tail else []
        return outputs + [ReplyDone(session_id, reason, text=reply.text.decoder.text, stats=stats)]
