"""The end of a user turn, a part TurnPrefill holds (agent/engine/stages/turn_prefill.py; on the
engine thread), on the prefill machinery it shares with it (TurnParts): the answered turn's audio tail, its last video grids or
still images, `<|im_end|>` and the assistant header, prefilled in bounded chunks that share
batched forwards; a reply cancelled before its prefill finished gives its turn back; and the
talker's prefix of every reply whose prefill finished, in one batched forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent.engine.checkpoints.model import assistant_start_ids, encode_images
from agent.engine.stages.thinker import PrefillOut
from agent.engine.stages.turn_parts import TurnJob, TurnParts
from agent.engine.stages.video_prefill import join_features
from agent.engine.state.session import SessionState, TurnState, join_text, timed, timed_all
from agent.engine.state.video import GridPlace


@dataclass
class ReplyPrefill:
    """An end-of-turn prefill in progress, and what to restore if its reply is cancelled first."""

    part: TurnJob
    start_length: int
    start_pos: int
    header_done: bool
    audio_open: bool
    audio: torch.Tensor | None  # the audio tokens this prefill took from the turn
    video_mark: tuple = (0, None)  # the turn's video before it (VideoPrefill.mark)


@dataclass
class TurnEnd:
    """The tokens that end a user message, and the features that fill their placeholders."""

    ids: list[int]
    audio: torch.Tensor | None
    images: object | None  # ImageFeatures
    videos: object | None
    places: list[GridPlace]


class EndOfTurn:
    def __init__(self, parts: TurnParts) -> None:
        self.parts = parts
        self.loaded, self.thinker, self.talker, self.ids = parts.loaded, parts.thinker, parts.talker, parts.ids
        self.video = parts.video

    def start_reply(self, state: SessionState) -> ReplyPrefill:
        """End of turn: the audio tail, the frames, <|im_end|>\n<|im_start|>assistant\n.
        The answered turn is reply.turn (begin_reply moved it out of state.turn)."""
        reply, turn = state.reply, state.reply.turn
        before = (state.thinker.length, state.thinker.next_pos, turn.header_done, turn.audio_open)
        mark = self.video.mark(turn)
        end = self._turn_end(state, turn, reply.images)
        reply.frames_encoded_at_end = len(reply.images) if end.images is not None else 0
        header = assistant_start_ids(self.ids)
        # The tail is not the user's: generate() gives the talker only the user-role tokens, so a
        # per-response system message stays out of the talker's view of the turn, as the header does.
        tail = len(turn.reply_system_ids) + len(header)
        part = self.parts.start(
            state,
            turn,
            [*end.ids, *turn.reply_system_ids, *header],
            audio=end.audio,
            images=end.images,
            assistant_tail=tail,
            may_reset=not reply.phase.speculative,
            videos=end.videos,
            places=end.places,
        )
        return ReplyPrefill(part, *before, audio=end.audio, video_mark=mark)

    def seal(self, state: SessionState) -> None:
        """The turn being spoken, made only of committed user items (no speech after the last
        one), becomes a closed user message now, with no reply: a system or assistant item
        added after them then follows them in the context, as the conversation lists it. Its
        prefill runs here, to the end; the talker hears it with the next reply."""
        turn = state.turn
        end = self._turn_end(state, turn, [])
        part = self.parts.start(
            state, turn, end.ids, audio=end.audio, images=end.images, videos=end.videos, places=end.places
        )
        while not part.job.finished:
            self.parts.run_parts([(state, turn, part)], [None])
        state.closing_prefilled()
        state.talker_history.backlog.append(turn.talker)
        state.turn = self.parts.new_turn()

    def _turn_end(self, state: SessionState, turn: TurnState, stills: list) -> "TurnEnd":
        """The rest of the user message: the audio tail, the last video grids or still images
        (`stills`: the camera's, handed to a reply, before the user's image items), the user's
        text items, <|im_end|>\n; after the previous reply's closing and the turn's header if
        the turn has not prefilled yet. Nothing of the user's since the conversation's last turn
        (a response asked after an assistant or system item): the closing alone, no empty user
        message."""
        if turn.audio.finished:  # a held turn's tail was encoded when it ended (close_turn)
            self.parts.encode(state, turn)
        else:
            self.parts.finish_audio(state, turn)
        audio = torch.cat(turn.pending_audio, dim=0) if turn.pending_audio else None
        turn.pending_audio = []
        images = videos = None
        places: list[GridPlace] = []
        stills = [*stills, *turn.images]
        if stills:
            with timed(state, "vision_encoder"):
                pixels = encode_images(self.loaded, stills)
                images = self.thinker.encode_images(pixels["pixel_values"], pixels["image_grid_thw"])
        empty = audio is None and not turn.header_done and not stills and not turn.text_ids
        ids = self.parts.open_turn_ids(state, turn, user=not empty)
        if empty:
            return TurnEnd(ids, None, None, None, [])
        if turn.video.grids is not None:  # the audio tail and the last grids, then the block's end
            part = self.video.part(state, turn, audio, final=True)
            ids += part.ids + [self.ids.audio_end, self.ids.vision_end]
            audio, videos, places = part.audio, join_features(part.feats), part.places
        else:
            if audio is not None:
                if not turn.audio_open:
                    ids.append(self.ids.audio_start)
                    turn.audio_open = True
                ids += [self.ids.audio_pad] * audio.shape[0]
                turn.audio_feats.append(audio)
            if turn.audio_open:
                ids.append(self.ids.audio_end)
        for t, h, w in images.grids if images is not None else ():
            n_tokens = t * h * w // self.thinker.merge**2
            ids += [self.ids.vision_start, *([self.ids.image_pad] * n_tokens), self.ids.vision_end]
        # User text items close the user message, after the audio and frames.
        ids += [*turn.text_ids, self.ids.im_end, *self.ids.newline]
        return TurnEnd(ids, audio, images, videos, places)

    def reply_chunk(self, state: SessionState, budget: int) -> int:
        """Tokens the end-of-turn prefill of `state` takes next within `budget` (starting it
        on first call: audio tail, frames, header)."""
        stage = state.reply.prefill
        if stage.job is None:
            stage.job = self.start_reply(state)
        job = stage.job.part.job
        return min(budget, job.left)

    def run_replies(self, chunks: Sequence[tuple[SessionState, int]]) -> list[PrefillOut | None]:
        """Advance the end-of-turn prefills (state, tokens from reply_chunk) in one batched
        forward; per reply its output when its prefill finished, else None."""
        parts = [(state, state.reply.turn, state.reply.prefill.job.part) for state, _ in chunks]
        self.parts.run_parts(parts, [n for _, n in chunks])
        outs: list[PrefillOut | None] = []
        for state, _, part in parts:
            if not part.job.finished:
                outs.append(None)
                continue
            state.closing_prefilled()
            state.context_turns += 1
            state.reply.prefill.done, state.reply.prefill.job = True, None
            outs.append(part.job.result())
        return outs

    def abandon_reply(self, state: SessionState) -> None:
        """A reply cancelled before its prefill finished: its turn was not answered, so it is the
        turn being spoken again (with the audio that came since), as if the reply never began."""
        reply, turn = state.reply, state.reply.turn
        prefill: ReplyPrefill | None = reply.prefill.job
        if state.held_turns:
            # Turns wait behind this one (interpreter mode): it cannot go back to being spoken
            # without reordering them, so the cancelled turn is dropped from the cache.
            if prefill is not None:  # (a reset's: all of the cache; its closing waits to go in again)
                state.thinker.crop(
                    *((0, 0) if prefill.part.history_reset else (prefill.start_length, prefill.start_pos))
                )
            return
        if prefill is not None:
            if prefill.part.history_reset:
                # The history went with the context reset: so did the turn. The cache held only
                # the reset's part; its closing (the system prompt, the items) waits to go in again.
                state.thinker.crop(0, 0)
                turn = self.parts.new_turn()
            else:
                state.thinker.crop(prefill.start_length, prefill.start_pos)
                turn.header_done, turn.audio_open = prefill.header_done, prefill.audio_open
                if prefill.audio is not None:
                    turn.audio_feats.pop()
                    turn.pending_audio = [prefill.audio]
                self.video.restore(turn, prefill.video_mark)
                # Its encoder was finished: later audio is encoded from a fresh stream.
                turn.audio = self.parts.new_turn().audio
        turn.pcm += state.turn.pcm
        turn.text_ids = join_text(turn.text_ids, state.turn.text_ids, self.ids.newline)
        turn.images += state.turn.images
        turn.reply_system_ids = []  # a per-response override ends with its response
        turn.reply_tools = None
        state.turn = turn

    def talker_prefills(self, states: Sequence[SessionState]) -> torch.Tensor:
        """The talker's prefix of each reply, one batched forward: every user turn not in its
        cache yet, then the assistant part; returns codebook-0 logits [B, vocab] (sets each
        reply.voice.last_hidden)."""
        items = []
        header = self.thinker.token_embeds(assistant_start_ids(self.ids))
        for state in states:
            reply, turn = state.reply, state.reply.turn
            # Drop the previous reply's part; the earlier user turns stay, the new ones are added.
            history = state.talker_history
            state.talker.crop(history.length, history.pos)
            turns = [*history.backlog, turn.talker]
            user_ids = [i for t in turns for i in t.ids]
            grids = [g for t in turns for g in t.image_grids]
            first = self.thinker.token_embeds([reply.text.tokens[0]])
            prefix = self.talker.assistant_prefix(header, first, state.choices.voice)
            embeds = torch.cat([*(e for t in turns for e in t.embeds), prefix], dim=1)
            items.append((state.talker, embeds, user_ids + [self.talker.tts_pad_id] * 9, grids))
        with timed_all(states, "talker_step"):
            logits, last_hidden = self.talker.prefills(items)
        for i, (state, (_, _, ids, _)) in enumerate(zip(states, items)):
            reply = state.reply
            reply.voice.last_hidden = last_hidden[i : i + 1]
            # From now on the cache holds every user turn: the next turn crops back to here.
            history = state.talker_history
            history.length += len(ids) - 9
            history.pos = state.talker.next_pos - 9
            history.backlog = []
            reply.voice.started, reply.voice.read = True, 1
        return logits
