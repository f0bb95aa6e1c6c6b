"""Where a turn's video sits in the token stream: plain data the video stages (agent/engine/stages/
video_grid.py, video_prefill.py) compute and the turn's state keeps (agent/engine/state/session.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AVBlock:
    """An open audio-in-video block while it is prefilled part by part: where its positions
    start and how many audio tokens it holds so far."""

    start: int  # position of audio token 0 (after <|vision_start|><|audio_start|>)
    audio: int = 0


@dataclass(frozen=True)
class GridPlace:
    """A video grid in the token stream: its time in the turn and its merged size."""

    start_s: float
    gh: int  # merged rows (grid_h // merge)
    gw: int
