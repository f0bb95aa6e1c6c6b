"""One user turn's camera, as video grids on the turn's audio clock (engine thread only).

A frame is placed at the turn's audio time when the engine takes it (the audio the engine has
of this turn so far: frames and audio reach it through one inbox, in arrival order). Times are
cut into slots of 1/fps s; `temporal_patch_size` (2) consecutive slots make one grid, so at
4 fps a grid is 0.5 s. The newest frame of a slot wins; a grid with one frame repeats it (the
video processor's padding). A grid closes when a frame of a later grid comes, when the turn's
audio is half a grid past its end (the camera stalled), or at the end of the turn, and is
encoded as soon as it is closed and the engine is free (agent/engine/stages/turn_prefill.py prefills it, in
time order among the audio tokens, while the user speaks).

A frame belongs to the nearest slot (frames come near the 1/fps marks, a little early or late).

Budget (docs/video.md): all grids of a turn have one size, chosen at its first frame so that one
grid makes at most cap / (2 * window grids) tokens (resolution scaled down first). One grid of
the cap is kept for the end of the turn (the latest view); of the rest, the first half takes
every grid (at least `window_s` of video at the full rate), then the grid rate halves each time
half of what is left is used, so a turn of any length stays under the cap and ends with a view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from agent.engine.stages.video_grid import (
    GridPlace,
    PatchSpec,
    grid_size,
    grid_threshold,
    patch_frames,
    resize,
    tokens_per_grid,
)


@dataclass(frozen=True)
class VideoPolicy:
    """The camera-as-video settings (from Config)."""

    fps: float = 4.0
    window_s: float = 2.0  # the span of a turn every grid of which is kept at the full rate
    max_tokens: int = 768  # visual tokens per turn at most

    @property
    def window_grids(self) -> int:
        return max(1, round(self.window_s * self.fps / 2))


class GridBudget:
    """Which lattice grids a turn admits: every one until half the cap is used, then every 2nd
    until half of the rest is, then every 4th, ...; never more than `max_grids`."""

    def __init__(self, max_grids: int) -> None:
        self.max_grids = max(0, max_grids)
        self.count = 0
        self.stride = 1
        self._mark = self.max_grids - self.max_grids // 2

    def copy(self) -> "GridBudget":
        twin = GridBudget(self.max_grids)
        twin.count, twin.stride, twin._mark = self.count, self.stride, self._mark
        return twin

    def admit(self, index: int) -> bool:
        if self.count >= self.max_grids or index % self.stride:
            return False
        self.count += 1
        while self.count >= self._mark and self.count < self.max_grids:
            self.stride *= 2
            self._mark = self.max_grids - (self.max_grids - self._mark) // 2
        return True


@dataclass
class Grid:
    index: int  # on the turn's lattice: starts at index * temporal / fps seconds
    start_s: float
    threshold: int  # the audio token it goes before (video_grid.grid_threshold)
    frames: list[np.ndarray | None]
    closed: bool = False
    features: object | None = None  # ImageFeatures once encoded
    state: str = "waiting"  # waiting | placed | dropped


@dataclass
class TurnVideoStats:
    frames_taken: int = 0
    frames_thinned: int = 0  # in a grid the budget left out
    frames_late: int = 0  # for a grid already prefilled or dropped
    grids_encoded: int = 0
    grids_encoded_at_end: int = 0
    grids_placed_at_end: int = 0
    grids_dropped: int = 0


@dataclass
class TurnVideo:
    policy: VideoPolicy
    spec: PatchSpec
    position_id_per_seconds: float
    size: tuple[int, int] | None = None  # (height, width) of every grid of the turn
    grids: list[Grid] = field(default_factory=list)
    budget: GridBudget | None = None
    tail: Grid | None = None  # the newest grid the budget left out: the turn's last view if it ends there
    stats: TurnVideoStats = field(default_factory=TurnVideoStats)

    @property
    def grid_s(self) -> float:
        return self.spec.temporal / self.policy.fps

    @property
    def tokens(self) -> int:
        """Tokens of one grid of this turn."""
        return tokens_per_grid(self.size, self.spec) if self.size else 0

    def add(self, frame: np.ndarray, at_s: float) -> None:
        """A frame taken at `at_s` seconds of the turn's audio."""
        self.stats.frames_taken += 1
        if self.size is None:
            per_grid = max(1, self.policy.max_tokens // (2 * self.policy.window_grids))
            self.size = grid_size(frame.shape[0], frame.shape[1], per_grid, self.spec)
            # One grid of the cap is the reserve for the turn's last view (close_all).
            self.budget = GridBudget(self.policy.max_tokens // self.tokens - 1)
        slot = int(math.floor(max(0.0, at_s) * self.policy.fps + 0.5))
        index, part = divmod(slot, self.spec.temporal)
        last = self.grids[-1] if self.grids else None
        if last is not None and index <= last.index:
            if index == last.index and not last.closed:
                last.frames[part] = frame  # the newest frame of the slot wins
            else:
                self.stats.frames_late += 1
            return
        if last is not None and not last.closed:
            self._close(last)
        start = index * self.grid_s
        if self.tail is not None and self.tail.index == index:
            self.tail.frames[part] = frame
            return
        grid = Grid(index, start, grid_threshold(start, self.position_id_per_seconds), [None] * self.spec.temporal)
        grid.frames[part] = frame
        if self.budget.max_grids > 0 and self.budget.admit(index):
            self.grids.append(grid)
            self.tail = None
        else:
            if self.tail is not None:
                self.stats.frames_thinned += sum(f is not None for f in self.tail.frames)
            self.tail = grid

    def close_stale(self, now_s: float) -> None:
        """The turn's audio is half a grid past the open grid's end: no more frames are waited for."""
        last = self.grids[-1] if self.grids else None
        if last is not None and not last.closed and now_s >= last.start_s + 1.5 * self.grid_s:
            self._close(last)

    def close_all(self) -> None:
        """The end of the turn: the last view (a grid the budget left out) takes the reserve."""
        if self.tail is not None:
            self.grids.append(self.tail)
            self.tail = None
        for grid in self.grids:
            if not grid.closed:
                self._close(grid)

    @staticmethod
    def _close(grid: Grid) -> None:
        # A missing slot repeats its neighbour: an odd last frame is padded by repetition.
        known = [f for f in grid.frames if f is not None]
        grid.frames = [f if f is not None else known[min(i, len(known) - 1)] for i, f in enumerate(grid.frames)]
        grid.closed = True

    def pending(self, before: int | None = None) -> list[Grid]:
        """Closed grids waiting without features (those going before audio token `before`)."""
        return [
            g
            for g in self.grids
            if g.closed and g.features is None and g.state == "waiting" and (before is None or g.threshold < before)
        ]

    def clip(self, grid: Grid) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A closed grid's pixels as the tower takes them."""
        # Resized only now (idle time): taking a frame stays cheap on the engine thread.
        return patch_frames([resize(f, self.size) for f in grid.frames], self.spec)

    def store(self, grids: Sequence[Grid], features: Sequence[object], at_end: bool = False) -> None:
        """The features of grids clip() gave (in that order)."""
        for grid, feats in zip(grids, features, strict=True):
            grid.features = feats
            grid.frames = []  # the pixels are not needed any more
        self.stats.grids_encoded += len(grids)
        if at_end:
            self.stats.grids_encoded_at_end += len(grids)

    def fork(self) -> "TurnVideo":
        """An independent copy (a speculative reply closes and places grids on its own copy)."""
        budget = self.budget.copy() if self.budget is not None else None
        grids = [replace(g, frames=list(g.frames)) for g in self.grids]
        tail = replace(self.tail, frames=list(self.tail.frames)) if self.tail is not None else None
        return replace(self, grids=grids, budget=budget, tail=tail, stats=replace(self.stats))

    def place(self, grid: Grid) -> GridPlace:
        grid.state = "placed"
        merged = self.size[0] // self.spec.factor, self.size[1] // self.spec.factor
        return GridPlace(grid.start_s, *merged)

    def unplace(self, count: int) -> None:
        """Forget all but the first `count` placed grids (their prefill was taken back)."""
        placed = [g for g in self.grids if g.state == "placed"]
        for grid in placed[count:]:
            grid.state = "waiting"

    def drop_from(self, threshold: int) -> None:
        """The turn's audio from token `threshold` on was discarded: the grids of that time go
        (none is placed: the turn was taken out of the cache first), and the budget is what the
        grids left took of it, as if the others had never come."""
        self.grids = [g for g in self.grids if g.threshold < threshold]
        self.tail = None
        if self.budget is not None:
            self.budget = GridBudget(self.budget.max_grids)
            for grid in self.grids:
                self.budget.admit(grid.index)

    def placed(self) -> int:
        return sum(g.state == "placed" for g in self.grids)

    def layout(self, audio_done: int, audio_ready: int, final: bool) -> tuple[list[tuple[str, object]], bool]:
        """What to prefill next, in order: ("audio", n) and ("grid", Grid) parts, taking at most
        `audio_ready` audio tokens after the `audio_done` ones already in; and whether the audio
        stopped early to wait for an open grid. A grid goes before audio token `threshold`; while
        the turn goes on it is placed only once an audio token after it exists (so a block never
        ends with video); at the end one past the turn's last audio token is dropped."""
        parts: list[tuple[str, object]] = []
        k, limit = audio_done, audio_done + audio_ready
        for grid in self.grids:
            if grid.state != "waiting":
                continue
            if grid.threshold < k:  # its frames came after the audio went past its time
                grid.state = "dropped"
                self.stats.grids_dropped += 1
                continue
            if grid.threshold >= limit:
                if final:
                    grid.state = "dropped"
                    self.stats.grids_dropped += 1
                    continue
                break
            if grid.threshold > k:
                parts.append(("audio", grid.threshold - k))
                k = grid.threshold
            if not grid.closed:
                return parts, True
            parts.append(("grid", grid))
        if limit > k:
            parts.append(("audio", limit - k))
        return parts, False
