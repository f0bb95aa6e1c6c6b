"""The parts of a user turn's prefill that both of its sides use (agent/engine/stages/turn_prefill.py:
the audio while the user speaks; agent/engine/stages/reply_prefill.py: the end of the turn):
a new turn, the system prompt (agent/engine/stages/system_prefill.py), the incremental audio encode, the turn's opening tokens, and
one part of the turn started, run in chunks (batched with other sessions' parts) and finished
(the user's tokens recorded for the talker), or replayed over a dropped history when the
context is full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agent.engine.checkpoints.model import LoadedModel
from agent.engine.stages.audio_stream import AudioStream
from agent.engine.stages.system_prefill import SystemPrefill
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.thinker import ImageFeatures, PrefillJob, ThinkerOps
from agent.engine.stages.tool_grammar import CALL_RESERVE_TOKENS
from agent.engine.stages.video_clock import VideoPolicy
from agent.engine.stages.video_prefill import VideoPrefill, join_features
from agent.engine.state.kv import KVState
from agent.engine.state.session import SessionState, TalkerHistory, TalkerTurn, TurnState, timed, timed_all
from agent.engine.state.video import GridPlace

# Room kept free in the context for the reply and its closing tokens.
CLOSING_MARGIN = 8


@dataclass
class TurnJob:
    """Part of a user turn being prefilled: the thinker job and which of its tokens are the
    user's (the previous reply's closing before, a per-response system message and the
    assistant header after, are not)."""

    job: PrefillJob
    n_closing: int
    assistant_tail: int
    images: ImageFeatures | None
    videos: ImageFeatures | None = None
    history_reset: bool = False  # the context was full: the history went, this replays the turn


class SpeculationRefused(RuntimeError):
    """A speculative reply's prefill would drop the history (full context): a rollback could not
    bring it back, so the reply waits for the end of the turn instead."""


class TurnParts:
    """A turn's prefill machinery, shared by TurnPrefill and its EndOfTurn part."""

    def __init__(
        self,
        loaded: LoadedModel,
        thinker: ThinkerOps,
        talker: TalkerOps,
        system_prompt: str,
        max_reply_tokens: int,
        context_limit: int,
        n_window_infer: int | None,
        video: VideoPolicy | None = None,
        prefill_chunk_tokens: int = 256,
    ) -> None:
        self.loaded, self.thinker, self.talker = loaded, thinker, talker
        self.ids = loaded.ids
        self.max_reply_tokens = max_reply_tokens
        self.context_limit = context_limit
        self.chunk_tokens = prefill_chunk_tokens
        self.n_window_infer = n_window_infer
        self.video = VideoPrefill(loaded, thinker, video)  # the camera as video, prefilled as it comes
        self.system = SystemPrefill(loaded, thinker, system_prompt, prefill_chunk_tokens)  # first, in chunks

    def new_turn(self) -> TurnState:
        tower = self.loaded.model.thinker.model.audio_tower
        stream = AudioStream(tower, extractor=self.loaded.feature_extractor, n_window_infer=self.n_window_infer)
        return TurnState(audio=stream)

    def check_system(self, ids: list[int]) -> None:
        """Raise ValueError when a system prompt of `ids` leaves no room for a reply in the
        context (the session checks a byte bound first: this is the token count)."""
        if len(ids) + self.max_reply_tokens + CLOSING_MARGIN > self.context_limit:
            raise ValueError(
                f"the instructions and tools take {len(ids)} tokens: the context holds {self.context_limit}"
            )

    @staticmethod
    def encode(state: SessionState, turn: TurnState) -> None:
        if not turn.pcm:
            return
        pcm = np.concatenate(turn.pcm) if len(turn.pcm) > 1 else turn.pcm[0]
        with timed(state, "audio_encoder"):  # one push: the same tokens as piece by piece
            tokens = turn.audio.push(pcm)
        turn.samples += len(pcm)
        if tokens.shape[0]:
            turn.pending_audio.append(tokens)
        turn.pcm.clear()

    @classmethod
    def finish_audio(cls, state: SessionState, turn: TurnState) -> None:
        """The turn's audio encoded to its end: what is queued, then the encoder's tail (waiting
        in pending_audio, as every final token does)."""
        cls.encode(state, turn)
        with timed(state, "audio_encoder"):
            tail = turn.audio.finish()
        if tail.shape[0]:
            turn.pending_audio.append(tail)

    def open_turn_ids(self, state: SessionState, turn: TurnState, user: bool = True) -> list[int]:
        """The previous reply's closing and this turn's header, the first time the turn prefills
        (`user` false: a reply to a turn with nothing in it, the closing alone)."""
        if turn.header_done:
            return []
        turn.header_done = True
        turn.start_length, turn.start_pos = state.thinker.length, state.thinker.next_pos
        return [*state.closing, *((self.ids.im_start, *self.ids.user, *self.ids.newline) if user else ())]

    # ---- one part of the turn: start, run in chunks, finish -------------------------------------

    def start(
        self,
        state: SessionState,
        turn: TurnState,
        ids: list[int],
        audio: torch.Tensor | None = None,
        images: ImageFeatures | None = None,
        assistant_tail: int = 0,
        may_reset: bool = True,
        videos: ImageFeatures | None = None,
        places: Sequence[GridPlace] = (),
    ) -> TurnJob:
        # Only a path that cannot wait gets here before these are in (sealing items, a reset).
        self.system.finish(state)
        self.finish_flushing(state, turn)
        n_closing = len(state.closing) if not turn.ids else 0
        full = state.thinker.length + len(ids) + self._reserve(state, turn) > self.context_limit
        # A bounded context (interpreter mode): a turn after `max_turns` answered ones starts the
        # history over, as a full context does, so a long stream neither grows nor slows.
        bounded = 0 < state.choices.max_turns <= state.context_turns and not turn.ids and not turn.history_reset
        if full or bounded:
            if not may_reset:
                raise SpeculationRefused("the context is full: the history would be dropped")
            return self._reset_history(state, turn, ids[n_closing:], images, assistant_tail)
        rope = None
        if turn.video.grids is not None:  # an audio-in-video block: positions by time
            rope = self.video.positions(turn, ids, state.thinker.next_pos, images, places)
        job = self.thinker.start_prefill(state.thinker, ids, audio=audio, images=images, videos=videos, rope=rope)
        return TurnJob(job, n_closing, assistant_tail, images, videos)

    def _reserve(self, state: SessionState, turn: TurnState) -> int:
        """Room the turn's reply needs after it: its text cap, a call's where it may call a tool
        (a soak at a 2,048-token context overflowed the slot in a call), and the closing."""
        tools = turn.reply_tools if turn.reply_tools is not None else state.choices.tools
        calls = CALL_RESERVE_TOKENS if tools is not None and tools.calls else 0
        return self.max_reply_tokens + calls + CLOSING_MARGIN

    def run_parts(
        self, parts: Sequence[tuple[SessionState, TurnState, TurnJob]], max_tokens: Sequence[int | None]
    ) -> list[int]:
        """The next chunk of every part in one batched thinker forward; tokens done per part."""
        if not parts:
            return []
        items = [(state.thinker, part.job, n) for (state, _, part), n in zip(parts, max_tokens)]
        with timed_all([state for state, _, _ in parts], "thinker_prefill"):
            done = self.thinker.run_prefills(items)
        for _, turn, part in parts:
            if part.job.finished:
                self._finish(turn, part)
        return done

    def finish_flushing(self, state: SessionState, turn: TurnState) -> None:
        """The rest of the turn's part begun while the user spoke (TurnState.flushing), now."""
        part, turn.flushing = turn.flushing, None
        if part is not None:
            self.run_parts([(state, turn, part)], [None])

    def _finish(self, turn: TurnState, part: TurnJob) -> None:
        """Record the user's tokens of a finished part for the talker (and for a replay)."""
        ids = part.job.ids
        out = part.job.result()
        turn.prefill_tokens += len(ids)
        user = slice(part.n_closing, len(ids) - part.assistant_tail)
        turn.ids += ids[user]
        is_media = self.thinker.is_media(torch.tensor([ids[user]], device=self.loaded.device))
        turn.talker.ids += ids[user]
        turn.talker.embeds.append(self.talker.user_embeds(is_media, out.embeds[:, user], out.accept_hidden[:, user]))
        if part.images is not None:
            turn.talker.image_grids += part.images.grids

    def _reset_history(
        self, state: SessionState, turn: TurnState, new_ids: list[int], images, assistant_tail: int
    ) -> TurnJob:
        """The context is full: drop the history, keep the system prompt and replay this turn, after
        the whole turns added since the last reply (system and assistant items: the conversation
        lists them before this turn; a reset used to drop them). The system prompt and those
        turns are the part's closing: they go in with the replay, in its chunks (a long prompt in
        one forward held the engine at every reset), and they wait in `state.closing` until its
        reply's prefill ends, so a turn dropped before then (discard, abandon) has the cache
        cropped to empty and the next turn puts them in again."""
        items = _without(state.closing[state.closing_tail :], state.instruction_turns)
        system = self.system.ids(state)
        replay = items + turn.ids + new_ids
        audio = torch.cat(turn.audio_feats, dim=0) if turn.audio_feats else None
        state.thinker = KVState(state.slot)
        state.talker = KVState(state.slot)
        state.talker_history = TalkerHistory()
        state.closing_prefilled()
        state.context_turns = 0
        if len(system) + len(replay) + self._reserve(state, turn) > self.context_limit:
            raise RuntimeError("one turn is longer than the context limit")
        turn.ids, turn.talker, turn.prefill_tokens, turn.history_reset = [], TalkerTurn(), 0, True
        turn.start_length = turn.start_pos = 0  # (the cache is empty: the turn's part holds it all)
        turn.video.block = None  # the replay opens the turn's block again
        # Prefilled first, and not the user's (start counts them as closing); a later reset
        # replays the items (closing_tail on), not the prompt.
        state.closing, state.closing_tail = system + items, len(system)
        part = self.start(
            state,
            turn,
            system + replay,
            audio=audio,
            images=images,
            assistant_tail=assistant_tail,
            videos=join_features(turn.video.feats),
            places=list(turn.video.places),
        )
        part.history_reset = True
        return part


def _without(ids: list[int], turns: Sequence[list[int]]) -> list[int]:
    """`ids` less the first occurrence of each of `turns` (whole turns within it)."""
    ids = list(ids)
    for turn in turns:
        for i in range(len(ids) - len(turn) + 1):
            if ids[i : i + len(turn)] == turn:
                del ids[i : i + len(turn)]
                break
    return ids
