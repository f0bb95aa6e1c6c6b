"""The camera's part of a turn's prefill: grids encoded as they close, and laid out in time order
among the audio tokens of one audio-in-video block while the user speaks (engine thread only).

TurnPrefill (agent/engine/stages/turn_prefill.py) asks this module, each time it prefills a part of a turn,
which tokens go in: the block's opener, the audio tokens now final, and every encoded grid
whose time comes before one of them, each before the audio token at its time. So at the end of
the turn only the grid still open (the last ~0.5 s) is encoded and prefilled with the audio
tail. A turn is a video turn when the session has video on and the camera gave a frame in the
last second when the turn began (or when one comes before its audio block opened); otherwise
its audio is a plain audio block, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agent.engine.checkpoints.model import LoadedModel
from agent.engine.stages.thinker import ImageFeatures, ThinkerOps
from agent.engine.stages.video_clock import Grid, TurnVideo, VideoPolicy
from agent.engine.stages.video_grid import PatchSpec, TokenKinds, av_positions
from agent.engine.state.session import SessionState, TurnState, timed_all
from agent.engine.state.video import AVBlock, GridPlace

FRESH_S = 1.0  # a frame older than this (engine clock) does not start a video turn


@dataclass
class VideoPart:
    """What a part of a video turn adds: its ids, the audio tokens it takes, its grids."""

    ids: list[int]
    audio: torch.Tensor | None
    left: torch.Tensor | None  # the audio tokens not taken (they come after a grid still open)
    feats: list[ImageFeatures]
    places: list[GridPlace]


def join_features(parts: Sequence[ImageFeatures]) -> ImageFeatures | None:
    """Several grids' features as one clip's (the tower attends within each temporal patch)."""
    if not parts:
        return None
    return ImageFeatures(
        embeds=torch.cat([p.embeds for p in parts]),
        deepstack=[torch.cat(layer) for layer in zip(*(p.deepstack for p in parts))],
        grids=[g for p in parts for g in p.grids],
    )


class VideoPrefill:
    def __init__(self, loaded: LoadedModel, thinker: ThinkerOps, policy: VideoPolicy | None) -> None:
        self.thinker = thinker
        self.policy = policy  # None: the runner never looks at the camera
        self.spec = PatchSpec.from_processor(loaded.image_processor)
        ids, cfg = loaded.ids, loaded.model.config.thinker_config
        self.ids = ids
        self.kinds = TokenKinds(
            ids.vision_start,
            ids.vision_end,
            ids.audio_start,
            ids.audio_end,
            ids.audio_pad,
            ids.image_pad,
            cfg.video_token_id,
        )
        self.pps = cfg.position_id_per_seconds

    # ---- frames in ------------------------------------------------------------------------------

    def new_video(self) -> TurnVideo:
        assert self.policy is not None
        return TurnVideo(self.policy, self.spec, self.pps)

    def seed(self, state: SessionState, now: float) -> None:
        """A new turn begins: the camera's newest frame, when fresh, is its first grid's first frame."""
        if self.policy is None or not state.choices.video or state.last_frame is None:
            return
        at, frame = state.last_frame
        if now - at <= FRESH_S and state.turn.video.grids is None and not state.turn.audio_open:
            state.turn.video.grids = self.new_video()
            state.turn.video.grids.add(frame, 0.0)

    def add_frame(self, state: SessionState, frame: np.ndarray, now: float) -> None:
        """A camera frame taken by the engine, placed at the turn's audio time (the grids it
        closes are encoded by encode_waiting, when the engine has time)."""
        state.last_frame = (now, frame)
        turn = state.turn
        if self.policy is None or not state.choices.video or state.choices.captions_only:
            return
        if turn.video.grids is None:
            if turn.audio_open:
                return  # the turn's audio block is open as plain audio: its frames cannot join it
            turn.video.grids = self.new_video()
        turn.video.grids.add(frame, turn.queued_seconds)

    def encode(self, state: SessionState, turn: TurnState, at_end: bool, before: int | None = None) -> int:
        """Encode the turn's closed grids that wait without features (at the end of the turn it
        closes them all first, and encodes only those before audio token `before`: the others are
        dropped); returns how many."""
        video = turn.video.grids
        if video is None:
            return 0
        if at_end:
            video.close_all()
        else:
            video.close_stale(turn.queued_seconds)
        todo = video.pending(before)
        self._encode([(state, video, todo)] if todo else [], at_end)
        return len(todo)

    def encode_waiting(self, states: Sequence[SessionState]) -> None:
        """Every closed grid the turns being spoken in these sessions wait on, in one forward of
        the vision tower (grids of several sessions close around the same time, and those of a
        reply's length pile up while it plays)."""
        work = []
        for state in states:
            video = state.turn.video.grids
            if video is None:
                continue
            video.close_stale(state.turn.queued_seconds)
            todo = video.pending()
            if todo:
                work.append((state, video, todo))
        self._encode(work)

    def _encode(self, work: Sequence[tuple[SessionState, TurnVideo, list[Grid]]], at_end: bool = False) -> None:
        # One forward for all of them: the tower attends within each temporal patch, so a grid's
        # features are the same encoded alone, as part of its clip, or beside other sessions' grids.
        if not work:
            return
        with timed_all([state for state, _, _ in work], "vision_encoder"):
            feats = iter(self.thinker.encode_videos([video.clip(grid) for _, video, todo in work for grid in todo]))
            for _, video, todo in work:
                video.store(todo, [next(feats) for _ in todo], at_end)

    # ---- the turn's tokens ----------------------------------------------------------------------

    def part(self, state: SessionState, turn: TurnState, audio: torch.Tensor | None, final: bool) -> VideoPart:
        """The block's next tokens: its opener (first time), then audio and grids in time order.
        `audio`: the final audio tokens not yet prefilled (at the end: all of them are taken)."""
        video = turn.video.grids
        ready = 0 if audio is None else audio.shape[0]
        done = sum(a.shape[0] for a in turn.audio_feats)
        self.encode(state, turn, at_end=final, before=done + ready if final else None)
        ids: list[int] = []
        if not turn.audio_open:
            ids += [self.ids.vision_start, self.ids.audio_start]
            turn.audio_open = True
        layout, _ = video.layout(done, ready, final)
        feats, places, taken = [], [], 0
        for kind, item in layout:
            if kind == "audio":
                ids += [self.ids.audio_pad] * item
                taken += item
            else:
                ids += [self.kinds.video_pad] * video.tokens
                feats.append(item.features)
                places.append(video.place(item))
        if final:
            video.stats.grids_placed_at_end += len(places)
        left = audio[taken:] if audio is not None and taken < ready else None
        used = audio[:taken] if audio is not None and taken else None
        if used is not None:
            turn.audio_feats.append(used)
        turn.video.feats += feats
        turn.video.places += places
        return VideoPart(ids, used, left, feats, places)

    def positions(
        self, turn: TurnState, ids: Sequence[int], start: int, images: ImageFeatures | None, places: Sequence[GridPlace]
    ) -> tuple[torch.Tensor, int]:
        """RoPE positions of a video turn's part (the open block carried in turn.video.block);
        whole numbers stay integer so that a part without frames runs as a captured graph."""
        rope, next_pos, turn.video.block = av_positions(
            ids,
            start,
            self.kinds,
            images.grids if images is not None else (),
            places,
            self.thinker.merge,
            self.pps,
            turn.video.block,
        )
        if torch.equal(rope, rope.round()):
            rope = rope.long()
        return rope, next_pos

    @staticmethod
    def stats(turn: TurnState, images_at_end: int) -> dict[str, int]:
        """A reply's camera counters for ReplyDone.stats: what the end of its turn had to do."""
        v = turn.video.grids.stats if turn.video.grids is not None else None
        return {
            "frames_encoded_at_end_of_turn": images_at_end + (2 * v.grids_encoded_at_end if v else 0),
            "video_grids": len(turn.video.places),
            "video_grids_encoded_at_end_of_turn": v.grids_encoded_at_end if v else 0,
            "video_grids_prefilled_at_end_of_turn": v.grids_placed_at_end if v else 0,
            "video_grids_dropped": v.grids_dropped if v else 0,
            "video_frames_thinned": v.frames_thinned if v else 0,
        }

    @staticmethod
    def mark(turn: TurnState) -> tuple[int, AVBlock | None]:
        """What to restore if the part about to start is taken back (see restore)."""
        block = None if turn.video.block is None else AVBlock(turn.video.block.start, turn.video.block.audio)
        return len(turn.video.places), block

    @staticmethod
    def restore(turn: TurnState, mark: tuple[int, AVBlock | None]) -> None:
        count, block = mark
        if turn.video.grids is not None:
            turn.video.grids.unplace(count)
        del turn.video.feats[count:], turn.video.places[count:]
        turn.video.block = block
