"""The prefill side of a session: system prompt, the user's audio as it becomes final, the end of
the turn (audio tail, frames, assistant header) in bounded chunks, and the talker's prefix
(those last two in agent/engine/stages/reply_prefill.py, a part of TurnPrefill).

Prompt policies that keep the stream equal to generate() (tests/unit/test_streaming_exact.py):
the user turn is `<|im_start|>user\\n<|audio_start|>[audio]<|audio_end|>[images]<|im_end|>\\n`
then `<|im_start|>assistant\\n`; an earlier reply stays in the history as its text tokens then
`<|im_end|>\\n` (its "closing", prefilled with the next turn); the talker gets every user turn.
A full context drops the history: the system prompt is prefilled again and the turn replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agent.engine.checkpoints.model import LoadedModel, system_turn_ids
from agent.engine.runner.transcriber import PARTIAL_EVERY_FRAMES
from agent.engine.stages.audio_stream import AudioStream
from agent.engine.stages.reply_prefill import EndOfTurn, ReplyPrefill
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.thinker import ImageFeatures, PrefillJob, ThinkerOps
from agent.engine.stages.video_clock import VideoPolicy
from agent.engine.stages.video_grid import GridPlace
from agent.engine.stages.video_prefill import VideoPrefill, join_features
from agent.engine.state.session import KVState, SessionState, TalkerTurn, TurnState, timed, timed_all

# Room kept free in the context for the reply and its closing tokens.
CLOSING_MARGIN = 8
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


@dataclass
class PrefillStage:
    """A reply's end-of-turn prefill, advanced by TurnPrefill: the job while it runs in chunks."""

    job: ReplyPrefill | None = None
    done: bool = False  # the prompt is in the thinker cache; the reply's first token can be taken


class TurnPrefill(EndOfTurn):
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
    ) -> None:
        self.loaded, self.thinker, self.talker = loaded, thinker, talker
        self.ids = loaded.ids
        self.system_prompt = system_prompt
        self.max_reply_tokens = max_reply_tokens
        self.context_limit = context_limit
        self.n_window_infer = n_window_infer
        self.video = VideoPrefill(loaded, thinker, video)  # the camera as video, prefilled as it comes

    def new_turn(self) -> TurnState:
        tower = self.loaded.model.thinker.model.audio_tower
        stream = AudioStream(tower, extractor=self.loaded.feature_extractor, n_window_infer=self.n_window_infer)
        return TurnState(audio=stream)

    def prefill_system(self, state: SessionState) -> None:
        prompt = self.system_prompt if state.system_prompt is None else state.system_prompt
        ids = system_turn_ids(self.ids, self.loaded.tokenizer, prompt)
        with timed(state, "thinker_prefill"):
            self.thinker.prefill(state.thinker, ids)

    # ---- audio while the user speaks ---------------------------------------------------------

    def close_turn(self, state: SessionState) -> TurnState:
        """The turn being spoken ends without a reply starting now: its audio is encoded to the
        end (the tail waits in pending_audio) and a new turn begins. Returns the ended turn."""
        turn = state.turn
        self._encode(state, turn)
        with timed(state, "audio_encoder"):
            tail = turn.audio.finish()
        if tail.shape[0]:
            turn.pending_audio.append(tail)
        state.turn = self.new_turn()
        return turn

    def encode_audio(self, state: SessionState) -> None:
        """Run the queued microphone audio of the turn being spoken through the incremental encoder."""
        if state.captions_only and not caption_audio_due(state.turn):
            return  # (the end of the turn encodes what is left: close_turn)
        self._encode(state, state.turn)

    @staticmethod
    def _encode(state: SessionState, turn: TurnState) -> None:
        if not turn.pcm:
            return
        pcm = np.concatenate(turn.pcm) if len(turn.pcm) > 1 else turn.pcm[0]
        with timed(state, "audio_encoder"):  # one push: the same tokens as piece by piece
            tokens = turn.audio.push(pcm)
        turn.samples += len(pcm)
        if tokens.shape[0]:
            turn.pending_audio.append(tokens)
        turn.pcm.clear()

    def flush_audio(self, state: SessionState, max_tokens: int | None = None) -> int:
        """Prefill final audio tokens (at most max_tokens); returns how many. Only while no
        reply runs: during a reply the thinker cache is busy and they wait for the next turn."""
        return self.flush_audios([state], max_tokens)

    def flush_audios(self, states: Sequence[SessionState], budget: int | None = None) -> int:
        """flush_audio for several sessions, sharing `budget` audio tokens in order (None: no
        bound), all their prefills in one batched forward; returns the audio tokens taken."""
        parts, taken = [], 0
        for state in states:
            if budget is not None and budget - taken <= 0:
                break
            part, take = self._flush_part(state, None if budget is None else budget - taken)
            if part is not None:
                parts.append((state, state.turn, part))
                taken += take
        self._run_parts(parts, [None] * len(parts))
        return taken

    def _flush_part(self, state: SessionState, max_tokens: int | None) -> tuple[TurnJob | None, int]:
        turn = state.turn
        if not turn.pending_audio or state.reply is not None or state.captions_only or state.held_turns:
            return None, 0  # (a held turn goes into the cache before this one, with its reply)
        audio = torch.cat(turn.pending_audio, dim=0)
        take = audio.shape[0] if max_tokens is None else min(max_tokens, audio.shape[0])
        turn.pending_audio = [audio[take:]] if take < audio.shape[0] else []
        audio = audio[:take]
        ids = self._open_turn_ids(state, turn)
        if turn.video is not None:  # audio and the grids before it, in time order
            part = self.video.part(state, turn, audio, final=False)
            if part.left is not None:  # audio after a grid still open waits for it
                turn.pending_audio = [part.left, *turn.pending_audio]
            taken = 0 if part.audio is None else part.audio.shape[0]
            if not ids and not part.ids:
                return None, 0
            return self._start(
                state, turn, ids + part.ids, audio=part.audio, videos=join_features(part.feats), places=part.places
            ), taken
        if not turn.audio_open:
            ids.append(self.ids.audio_start)
            turn.audio_open = True
        ids += [self.ids.audio_pad] * take
        turn.audio_feats.append(audio)
        return self._start(state, turn, ids, audio=audio), take

    def _open_turn_ids(self, state: SessionState, turn: TurnState) -> list[int]:
        """The previous reply's closing and this turn's header, the first time the turn prefills."""
        if turn.header_done:
            return []
        turn.header_done = True
        turn.start_length, turn.start_pos = state.thinker.length, state.thinker.next_pos
        return [*state.closing, self.ids.im_start, *self.ids.user, *self.ids.newline]

    # ---- one part of the turn: start, run in chunks, finish -------------------------------------

    def _start(
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
        n_closing = len(state.closing) if not turn.ids else 0
        full = state.thinker.length + len(ids) + self.max_reply_tokens + CLOSING_MARGIN > self.context_limit
        # A bounded context (interpreter mode): a turn after `max_turns` answered ones starts the
        # history over, as a full context does, so a long stream neither grows nor slows.
        bounded = 0 < state.max_turns <= state.context_turns and not turn.ids and not turn.history_reset
        if full or bounded:
            if not may_reset:
                raise SpeculationRefused("the context is full: the history would be dropped")
            return self._reset_history(state, turn, ids[n_closing:], images, assistant_tail)
        rope = None
        if turn.video is not None:  # an audio-in-video block: positions by time
            rope = self.video.positions(turn, ids, state.thinker.next_pos, images, places)
        job = self.thinker.start_prefill(state.thinker, ids, audio=audio, images=images, videos=videos, rope=rope)
        return TurnJob(job, n_closing, assistant_tail, images, videos)

    def _run_parts(
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
        """The context is full: drop the history, keep the system prompt and replay this turn."""
        replay = turn.ids + new_ids
        audio = torch.cat(turn.audio_feats, dim=0) if turn.audio_feats else None
        state.thinker = KVState(state.slot)
        state.talker = KVState(state.slot)
        state.talker_backlog, state.closing = [], []
        state.talker_history_length = state.talker_history_pos = 0
        state.context_turns = 0
        self.prefill_system(state)
        if state.thinker.length + len(replay) + self.max_reply_tokens + CLOSING_MARGIN > self.context_limit:
            raise RuntimeError("one turn is longer than the context limit")
        turn.ids, turn.talker, turn.prefill_tokens, turn.history_reset = [], TalkerTurn(), 0, True
        turn.start_length, turn.start_pos = state.thinker.length, state.thinker.next_pos
        turn.av_block = None  # the replay opens the turn's block again
        part = self._start(
            state,
            turn,
            replay,
            audio=audio,
            images=images,
            assistant_tail=assistant_tail,
            videos=join_features(turn.video_feats),
            places=list(turn.video_places),
        )
        part.history_reset = True
        return part

    def text_ids(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text, add_special_tokens=False)

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
        turn.pending_audio = [*turn.audio_feats, *turn.pending_audio]
        turn.audio_feats, turn.ids, turn.talker, turn.prefill_tokens = [], [], TalkerTurn(), 0
        turn.header_done = turn.audio_open = False
        self.video.restore(turn, (0, None))

    def pcm_queued(self, state: SessionState) -> bool:
        # Captions: agent/engine/runner/transcriber.py reads them; held turns: this turn's audio waits behind theirs.
        prefills = state.reply is None and not state.captions_only and not state.held_turns
        if state.captions_only:
            return caption_audio_due(state.turn)
        return bool(state.turn.pcm) or (prefills and bool(state.turn.pending_audio))

    @staticmethod
    def queue_pcm(state: SessionState, pcm: np.ndarray) -> None:
        state.turn.pcm.append(np.asarray(pcm, dtype=np.float32).reshape(-1))
