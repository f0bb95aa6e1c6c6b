"""The prefill side of a session: system prompt, the user's audio as it becomes final, the end of
the turn (audio tail, frames, assistant header) in bounded chunks, and the talker's prefix.
TurnPrefill is composed of two parts it holds: the machinery both sides share (TurnParts,
agent/engine/stages/turn_parts.py) and the end of the turn (EndOfTurn,
agent/engine/stages/reply_prefill.py); what it does itself is the audio while the user speaks.

Prompt policies that keep the stream equal to generate() (tests/unit/test_streaming_exact.py):
the user turn is `<|im_start|>user\\n<|audio_start|>[audio]<|audio_end|>[images]<|im_end|>\\n`
then `<|im_start|>assistant\\n`; an earlier reply stays in the history as its text tokens then
`<|im_end|>\\n` (its "closing", prefilled with the next turn); the talker gets every user turn.
The system prompt goes in first, in chunks (agent/engine/stages/system_prefill.py). A full
context drops the history: the system prompt is prefilled again and the turn replayed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from agent.engine.checkpoints.model import system_turn_ids
from agent.engine.runner.transcriber import PARTIAL_EVERY_FRAMES
from agent.engine.stages.reply_prefill import EndOfTurn
from agent.engine.stages.system_prefill import SystemPrefill
from agent.engine.stages.thinker import PrefillOut
from agent.engine.stages.turn_parts import TurnJob, TurnParts
from agent.engine.stages.video_prefill import join_features
from agent.engine.state.session import SessionState, TalkerTurn, TurnState

# A transcription-only session's microphone audio is encoded once this much is queued (80 ms at
# 16 kHz), not per 20 ms frame: the encoder gives the same tokens for any piece sizes and a
# quarter of the calls costs a quarter of their overhead. It is encoded at once, though, when
# the audio crosses a partial's half-second mark, so partials come on time.
CAPTION_ENCODE_SAMPLES = 1280


def caption_audio_due(turn: TurnState) -> bool:
    """A transcription-only turn's queued audio is to be encoded now (CAPTION_ENCODE_SAMPLES)."""
    queued = sum(len(p) for p in turn.pcm)
    if queued >= CAPTION_ENCODE_SAMPLES:
        return True
    mel = turn.audio.mel
    now, then = mel.frames_for(mel.n_samples), mel.frames_for(mel.n_samples + queued)
    return then // PARTIAL_EVERY_FRAMES > now // PARTIAL_EVERY_FRAMES


class TurnPrefill:
    def __init__(self, parts: TurnParts) -> None:
        """parts: the turn's prefill machinery, shared with its EndOfTurn part."""
        self.parts = parts
        self.end = EndOfTurn(parts)  # the end of the turn and the talker's prefix
        self.loaded, self.thinker, self.talker, self.ids = parts.loaded, parts.thinker, parts.talker, parts.loaded.ids
        self.video = parts.video  # the camera as video, prefilled as it comes

    def new_turn(self) -> TurnState:
        return self.parts.new_turn()

    @property
    def system(self) -> SystemPrefill:
        return self.parts.system

    def ahead(self, state: SessionState) -> int:
        """Tokens that go into the cache before the session's reply's own prefill: the rest of its
        system prompt, then the rest of its turn's part begun while the user spoke."""
        part = state.reply.turn.flushing
        return self.system.left(state) + (0 if part is None else part.job.left)

    def run_ahead(self, state: SessionState, budget: int) -> int:
        """At most `budget` of those tokens, in that order; returns how many went in."""
        taken = min(budget, self.system.left(state))
        if taken:
            self.system.run([(state, taken)])
        turn = state.reply.turn
        part = turn.flushing
        if state.system is None and part is not None and budget > taken:
            take = min(budget - taken, part.job.left)
            self.parts.run_parts([(state, turn, part)], [take])
            if part.job.finished:
                turn.flushing = None
            taken += take
        return taken

    # ---- the end of the turn (EndOfTurn) -------------------------------------------------------

    def reply_chunk(self, state: SessionState, budget: int) -> int:
        return self.end.reply_chunk(state, budget)

    def run_replies(self, chunks: Sequence[tuple[SessionState, int]]) -> list[PrefillOut | None]:
        return self.end.run_replies(chunks)

    def abandon_reply(self, state: SessionState) -> None:
        self.end.abandon_reply(state)

    @torch.inference_mode()
    def seal_items(self, state: SessionState) -> bool:
        """A whole turn is about to be added while the turn being spoken holds committed user
        items and nothing after them: that turn is closed first (EndOfTurn.seal), so the added
        turn follows the items, as the conversation lists it. False (nothing done): no such
        items, speech after them (it is not an item yet: the added turn goes before the turn),
        or turns held for a reply."""
        turn = state.turn
        if (
            not turn.kept_tokens
            or turn.audio_token_count != turn.kept_tokens
            or turn.pcm
            or turn.samples != turn.kept_samples
            or state.reply is not None
            or state.held_turns
            or state.choices.captions_only
        ):
            return False
        self.end.seal(state)
        return True

    def talker_prefills(self, states: Sequence[SessionState]) -> torch.Tensor:
        return self.end.talker_prefills(states)

    # ---- audio while the user speaks ---------------------------------------------------------

    def close_turn(self, state: SessionState) -> TurnState:
        """The turn being spoken ends without a reply starting now: its audio is encoded to the
        end (the tail waits in pending_audio) and a new turn begins. Returns the ended turn."""
        turn = state.turn
        self.parts.finish_audio(state, turn)
        state.turn = self.new_turn()
        return turn

    def cut_audio(self, state: SessionState) -> None:
        """A user item ends inside the turn being spoken (committed with no reply asked; the
        model answers the turn's items together): its audio is encoded to the end, as at a turn's
        end (the tail waits in pending_audio), and the turn's later audio is encoded from a fresh
        stream, as after a reply given back (EndOfTurn.abandon_reply)."""
        turn = state.turn
        self.parts.finish_audio(state, turn)
        turn.audio = self.new_turn().audio
        turn.kept_tokens = turn.audio_token_count
        turn.kept_samples = turn.samples

    def drop_speech(self, state: SessionState) -> bool:
        """The turn being spoken loses its speech after its committed user items (a discard:
        input_audio_buffer.clear, new turn detection rules), and only that: the items' audio
        comes back out of the cache (unprefill_turn) and waits to be prefilled again as the turn
        goes on; the camera's grids after it go too. False, and nothing changed: no item was
        committed in the turn, or its prefill replaced the history (it cannot be taken back
        out): the caller drops the whole turn."""
        turn = state.turn
        if not turn.kept_tokens or turn.history_reset:
            return False
        self.unprefill_turn(state)
        audio = torch.cat([*turn.audio_feats, *turn.pending_audio], dim=0)
        turn.audio_feats, turn.pending_audio = [], [audio[: turn.kept_tokens]]
        turn.pcm.clear()
        turn.samples = turn.kept_samples
        turn.audio = self.new_turn().audio
        if turn.video.grids is not None:
            turn.video.grids.drop_from(turn.kept_tokens)
        return True

    def encode_audio(self, state: SessionState) -> None:
        """Run the queued microphone audio of the turn being spoken through the incremental encoder."""
        if state.choices.captions_only and not caption_audio_due(state.turn):
            return  # (the end of the turn encodes what is left: close_turn)
        self.parts.encode(state, state.turn)

    def flush_audio(self, state: SessionState, max_tokens: int | None = None) -> int:
        """Prefill final audio tokens (at most max_tokens); returns how many. Only while no
        reply runs: during a reply the thinker cache is busy and they wait for the next turn."""
        return self.flush_audios([state], max_tokens)

    def flush_audios(self, states: Sequence[SessionState], budget: int | None = None) -> int:
        """flush_audio for several sessions, sharing `budget` audio tokens in order (None: no
        bound), all their prefills in one batched forward; returns the tokens taken. A part with
        more than a chunk of other tokens (a long closing: instructions or items added since the
        last reply; a history reset's replay) runs a chunk at a time (the rest of the budget, or
        one chunk when there is none), the rest in the next calls (TurnState.flushing)."""
        parts, limits, taken = [], [], 0
        chunk = self.parts.chunk_tokens
        # Their grids first, all in one forward of the vision tower (part() then finds them encoded).
        self.video.encode_waiting([state for state in states if self._flushable(state)])
        for state in states:
            left = None if budget is None else budget - taken
            if left is not None and left <= 0:
                break
            part = state.turn.flushing if self._prefills(state) else None
            if part is not None:  # begun in an earlier tick: it goes on first
                limit = min(left or chunk, part.job.left)
                taken += limit
            else:
                part, take = self._flush_part(state, left)
                if part is None:
                    continue
                # Its tokens besides audio: the turn's header, and the closing (the last reply's
                # end, instructions and items added since). Past a chunk, a chunk per tick.
                limit = None if len(part.job.ids) - take <= chunk else (left or chunk)
                taken += take if limit is None else limit
            parts.append((state, state.turn, part))
            limits.append(limit)
        self.parts.run_parts(parts, limits)
        for _, turn, part in parts:
            turn.flushing = None if part.job.finished else part
        return taken

    @classmethod
    def _flushable(cls, state: SessionState) -> bool:
        """Audio of the turn being spoken waits and may go into the cache now."""
        return bool(state.turn.pending_audio) and state.turn.flushing is None and cls._prefills(state)

    @staticmethod
    def _prefills(state: SessionState) -> bool:
        """The turn being spoken may go into the cache now: not before the system prompt
        (SystemPrefill), nor during the session's reply; a held turn goes in before this one,
        with its reply."""
        return state.system is None and state.reply is None and not state.choices.captions_only and not state.held_turns

    def _flush_part(self, state: SessionState, max_tokens: int | None) -> tuple[TurnJob | None, int]:
        turn = state.turn
        if not self._flushable(state):
            return None, 0
        audio = torch.cat(turn.pending_audio, dim=0)
        take = audio.shape[0] if max_tokens is None else min(max_tokens, audio.shape[0])
        turn.pending_audio = [audio[take:]] if take < audio.shape[0] else []
        audio = audio[:take]
        ids = self.parts.open_turn_ids(state, turn)
        if turn.video.grids is not None:  # audio and the grids before it, in time order
            part = self.video.part(state, turn, audio, final=False)
            if part.left is not None:  # audio after a grid still open waits for it
                turn.pending_audio = [part.left, *turn.pending_audio]
            taken = 0 if part.audio is None else part.audio.shape[0]
            if not ids and not part.ids:
                return None, 0
            return self.parts.start(
                state, turn, ids + part.ids, audio=part.audio, videos=join_features(part.feats), places=part.places
            ), taken
        if not turn.audio_open:
            ids.append(self.ids.audio_start)
            turn.audio_open = True
        ids += [self.ids.audio_pad] * take
        turn.audio_feats.append(audio)
        return self.parts.start(state, turn, ids, audio=audio), take

    def user_text_turn(self, turn: TurnState) -> list[int]:
        """The turn's user text items as a user message of their own, taken out of the turn: a
        whole turn added after them (a system or assistant item) follows them, rather than going
        in front of the turn they wait in. [] when there are none, or images wait with them
        (those are shown with the turn's end)."""
        if not turn.text_ids or turn.images:
            return []
        ids = [self.ids.im_start, *self.ids.user, *self.ids.newline, *turn.text_ids, self.ids.im_end, *self.ids.newline]
        turn.text_ids = []
        return ids

    def text_ids(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text, add_special_tokens=False)

    def check_system(self, ids: list[int]) -> None:
        """Raise ValueError when a system prompt of `ids` leaves no room for a reply in the context."""
        self.parts.check_system(ids)

    def system_message_ids(self, text: str) -> list[int]:
        return system_turn_ids(self.ids, self.loaded.tokenizer, text)

    def unprefill_turn(self, state: SessionState) -> None:
        """Take the turn being spoken back out of the thinker cache (its audio tokens wait to be
        prefilled again), so that something can change before it: a truncated reply's end."""
        turn = state.turn
        if not turn.header_done:
            return
        if turn.history_reset:
            raise RuntimeError("the turn being spoken replaced the history: nothing before it to change")
        state.thinker.crop(turn.start_length, turn.start_pos)
        turn.flushing = None  # (its audio is in audio_feats: it waits again with the rest)
        turn.pending_audio = [*turn.audio_feats, *turn.pending_audio]
        turn.audio_feats, turn.ids, turn.talker, turn.prefill_tokens = [], [], TalkerTurn(), 0
        turn.header_done = turn.audio_open = False
        self.video.restore(turn, (0, None))

    @torch.inference_mode()
    def append_turns(self, state: SessionState, ids: list[int]) -> None:
        """Whole turns (system or assistant messages) at the end of the conversation, with no
        reply in flight: in front of the turn being spoken, prefilled with its start. The
        client's audio so far is not an item yet, so a turn already in the cache is taken back
        out and prefilled again after them (one whose prefill replaced the history cannot be:
        they wait for the next turn)."""
        if state.turn.header_done and not state.turn.history_reset:
            self.unprefill_turn(state)
        if state.turn.header_done:
            state.after_reply += ids
        else:
            state.closing += ids

    def pcm_queued(self, state: SessionState) -> bool:
        # Captions: agent/engine/runner/transcriber.py reads them; held turns: this turn's audio waits behind theirs.
        if state.choices.captions_only:
            return caption_audio_due(state.turn)
        return bool(state.turn.pcm) or (self._prefills(state) and bool(state.turn.pending_audio or state.turn.flushing))

    @staticmethod
    def queue_pcm(state: SessionState, pcm: np.ndarray) -> None:
        state.turn.pcm.append(np.asarray(pcm, dtype=np.float32).reshape(-1))
