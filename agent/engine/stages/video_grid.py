"""Camera frames as Qwen3-Omni *video*: frame-pair patches, the audio-in-video token layout and
its multimodal RoPE positions (pure functions, torch and numpy only).

Qwen3-Omni's processor turns a clip with its soundtrack into one block

    <|vision_start|><|audio_start|> g0 a a a a a a a g1 a a a ... a <|audio_end|><|vision_end|>

where each video grid g_j (temporal_patch_size = 2 frames, `second_per_grid` seconds) sits at
its start time, followed by the audio tokens up to the next grid; time is counted in position
ids, `position_id_per_seconds` per second, one per audio token (processor
`replace_video_with_audio_token`, modeling `get_rope_index` with `use_audio_in_video`). A
grid's tokens take (t, h, w) positions (block start + its time, + row, + column), audio token
k takes block start + k, and what follows the block continues after the last audio token.

The processor's video path needs torchvision (absent beside the CPU torch wheel), so the patches
are made here with its math: frames resized to one size (a multiple of patch * merge), rescaled,
normalized, and cut into [grid_t, h/merge, w/merge, merge, merge] rows of
[channel, temporal, patch, patch] pixels. A still image is the pair (f, f): the image processor's
own output, which tests/unit/test_video_grid.py compares against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from agent.engine.state.video import AVBlock, GridPlace


@dataclass(frozen=True)
class PatchSpec:
    """The vision tower's patching, read from the image processor."""

    patch: int = 16
    merge: int = 2
    temporal: int = 2
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    @property
    def factor(self) -> int:
        """Pixels per merged token side: a frame's sides are multiples of it."""
        return self.patch * self.merge

    @classmethod
    def from_processor(cls, processor) -> "PatchSpec":
        return cls(
            patch=int(processor.patch_size),
            merge=int(processor.merge_size),
            temporal=int(processor.temporal_patch_size),
            mean=tuple(float(x) for x in processor.image_mean),
            std=tuple(float(x) for x in processor.image_std),
            rescale=float(processor.rescale_factor),
        )


def grid_size(height: int, width: int, max_tokens: int, spec: PatchSpec) -> tuple[int, int]:
    """The (height, width) in pixels a frame is resized to so that one grid makes at most
    `max_tokens` tokens: the aspect ratio kept, both sides multiples of patch * merge, never
    upscaled past the frame's own size rounded to that multiple (smart_resize's rule)."""
    f = spec.factor
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    budget = max(1, max_tokens) * f * f
    if h * w > budget:
        beta = math.sqrt(height * width / budget)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    return h, w


def tokens_per_grid(size: tuple[int, int], spec: PatchSpec) -> int:
    return (size[0] // spec.factor) * (size[1] // spec.factor)


def resize(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """RGB uint8 HxWx3 to `size` (bicubic, as the processors resample)."""
    if frame.shape[:2] == size:
        return frame
    return np.asarray(Image.fromarray(np.ascontiguousarray(frame)).resize((size[1], size[0]), Image.BICUBIC))


def patch_frames(frames: Sequence[np.ndarray], spec: PatchSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pixel rows and grid (t, h, w) of frames of one size (RGB uint8 HxWx3), temporal_patch_size
    frames per grid; an odd last frame is repeated (the video processor's padding)."""
    video = np.stack([np.asarray(f, dtype=np.float32) for f in frames]).transpose(0, 3, 1, 2)  # T, C, H, W
    if pad := -len(video) % spec.temporal:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1)
    video = (video * np.float32(spec.rescale) - mean) / std
    n, c, height, width = video.shape
    gt, gh, gw = n // spec.temporal, height // spec.patch, width // spec.patch
    p, m = spec.patch, spec.merge
    patches = video.reshape(gt, spec.temporal, c, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m, C, temporal, p, p
    rows = patches.reshape(gt * gh * gw, c * spec.temporal * p * p)
    return torch.from_numpy(np.ascontiguousarray(rows)), (gt, gh, gw)


def grid_threshold(start_s: float, position_id_per_seconds: float) -> int:
    """Index of the first audio token a grid starting at `start_s` goes before (the processor
    puts video token index t*second_per_grid*pps before audio token k when it is <= k)."""
    return math.ceil(start_s * position_id_per_seconds - 1e-9)


def interleave(
    n_audio: int,
    grid_starts: Sequence[float],
    grid_tokens: int,
    position_id_per_seconds: float,
    audio_token: int,
    video_token: int,
) -> list[int]:
    """The block's inner tokens (between <|audio_start|> and <|audio_end|>) as the processor
    lays them out: each grid at its start time among the audio tokens; grids past the audio's end last."""
    out: list[int] = []
    k = 0
    for start in grid_starts:
        at = grid_threshold(start, position_id_per_seconds)
        while k < n_audio and k < at:
            out.append(audio_token)
            k += 1
        out += [video_token] * grid_tokens
    out += [audio_token] * (n_audio - k)
    return out


@dataclass(frozen=True)
class TokenKinds:
    """The token ids the position rule tells apart."""

    vision_start: int
    vision_end: int
    audio_start: int
    audio_end: int
    audio_pad: int
    image_pad: int
    video_pad: int


def av_positions(
    ids: Sequence[int],
    start: int,
    kinds: TokenKinds,
    images: Sequence[tuple[int, int, int]],
    grids: Sequence[GridPlace],
    merge: int,
    position_id_per_seconds: float,
    block: AVBlock | None,
) -> tuple[torch.Tensor, int, AVBlock | None]:
    """[3, n] float RoPE positions of `ids` continuing from `start`, the next position, and the
    audio-in-video block still open at the end (None when closed or never opened).

    Equal to get_rope_index(use_audio_in_video=True) on a prompt with such a block, when every
    grid precedes the block's last audio token (the engine drops a grid that would not, so that
    what follows the block continues from an integer position). Text, plain audio blocks and
    still images (`images`: their grids (t, h, w) in order) follow kv.mrope_positions' rule.
    `block` carries an open block across calls (a turn prefilled part by part)."""
    out = torch.empty(3, len(ids), dtype=torch.float32)
    pos, i = start, 0
    images_it, grids_it = iter(images), iter(grids)
    while i < len(ids):
        tok = ids[i]
        if tok == kinds.audio_start and i > 0 and ids[i - 1] == kinds.vision_start:
            out[:, i] = pos
            block = AVBlock(start=pos + 1)
            pos += 1
            i += 1
            continue
        if block is not None and tok == kinds.audio_pad:
            out[:, i] = block.start + block.audio
            block.audio += 1
            pos = block.start + block.audio
            i += 1
            continue
        if block is not None and tok == kinds.video_pad:
            g = next(grids_it)
            count = g.gh * g.gw
            if any(t != kinds.video_pad for t in ids[i : i + count]):
                raise ValueError("video placeholder run does not match its grid")
            t = block.start + g.start_s * position_id_per_seconds
            h = torch.arange(g.gh, dtype=torch.float32).view(-1, 1).expand(g.gh, g.gw).flatten()
            w = torch.arange(g.gw, dtype=torch.float32).view(1, -1).expand(g.gh, g.gw).flatten()
            out[0, i : i + count] = t
            out[1, i : i + count] = block.start + h
            out[2, i : i + count] = block.start + w
            i += count
            continue
        if block is not None and tok == kinds.audio_end:
            block = None  # the end tokens continue after the last audio token (pos)
        if tok == kinds.image_pad:
            t, hh, ww = next(images_it)
            gh, gw = hh // merge, ww // merge
            count = t * gh * gw
            t_idx = (torch.arange(t).float() * position_id_per_seconds).long().view(-1, 1, 1).expand(t, gh, gw)
            h_idx = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
            w_idx = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
            part = torch.stack([t_idx.flatten(), h_idx.flatten(), w_idx.flatten()]).float() + pos
            out[:, i : i + count] = part
            pos = int(part.max()) + 1
            i += count
            continue
        out[:, i] = pos
        pos += 1
        i += 1
    return out, pos, block
