"""The vision encoder run on camera frames as they arrive (engine thread only).

Engine.append_video hands each taken frame to the runner; StreamingRunner encodes it at once
when no reply is running, so at the end of the turn the reply's frames are usually encoded
already and only the prefill of their tokens remains on the critical path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .model import LoadedModel, encode_images
from .thinker import ImageFeatures, ThinkerOps


class FrameEncoder:
    """The vision encoder run on camera frames as they arrive, off the end-of-turn path.

    Each frame the engine takes is encoded on its own (processor patches, then the vision
    tower) while the user is still speaking, and its features wait here, the newest `keep`
    per session. At the end of the turn the reply's frames are looked up by identity; only a
    frame not seen yet (one that arrived in the last moments, or a still image handed to
    begin_reply directly) is encoded then, and counted. The tower attends within each image
    (cu_seqlens), so one frame's features are the same whether encoded alone or in a batch.
    """

    def __init__(self, encode: Callable[[list[np.ndarray]], ImageFeatures], merge: int, keep: int = 4) -> None:
        self._encode = encode  # frames -> features, one batch (model.encode_images + the tower)
        self._merge = merge  # spatial merge: a grid (t, h, w) makes t*h*w/merge² tokens
        self._keep = keep
        self._sessions: dict[str, deque[tuple[np.ndarray, ImageFeatures | None]]] = {}
        self.encoded_on_arrival = 0
        self.encoded_at_end_of_turn = 0

    def add(self, session_id: str, image: np.ndarray, encode_now: bool) -> None:
        """A frame taken by the engine; encode it now, or leave it pending (the engine is busy
        with replies: encode_pending() later, or the end of the turn, does it)."""
        frames = self._sessions.get(session_id)
        if frames is None:
            frames = self._sessions[session_id] = deque(maxlen=self._keep)
        frames.append((image, None))
        if encode_now:
            self.encode_pending(session_id)

    def encode_pending(self, session_id: str) -> int:
        """Encode this session's frames that wait without features; returns how many."""
        frames = self._sessions.get(session_id, deque())
        todo = [i for i, (_, f) in enumerate(frames) if f is None]
        for i in todo:
            image = frames[i][0]
            frames[i] = (image, self._encode([image]))
        self.encoded_on_arrival += len(todo)
        return len(todo)

    def features(self, images: Sequence[np.ndarray]) -> tuple["ImageFeatures", int]:
        """Features for a reply's frames, in order, and how many had to be encoded now."""
        known = {id(image): features for frames in self._sessions.values() for image, features in frames
                 if features is not None}
        missing = [im for im in images if id(im) not in known]
        if missing:
            fresh = self._encode(missing)
            for im, one in zip(missing, split_features(fresh, self._merge)):
                known[id(im)] = one
        self.encoded_at_end_of_turn += len(missing)
        return join_features([known[id(im)] for im in images]), len(missing)

    def drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @classmethod
    def for_model(cls, loaded: "LoadedModel", thinker: "ThinkerOps") -> "FrameEncoder":
        def encode(images: list[np.ndarray]) -> ImageFeatures:
            pixels = encode_images(loaded, images)
            return thinker.encode_images(pixels["pixel_values"], pixels["image_grid_thw"])

        return cls(encode, merge=thinker.merge)


def split_features(features: ImageFeatures, merge: int) -> list[ImageFeatures]:
    """One ImageFeatures per image of a batch (its rows, in grid order)."""
    out, start = [], 0
    for grid in features.grids:
        n = grid[0] * grid[1] * grid[2] // merge**2
        out.append(ImageFeatures(embeds=features.embeds[start : start + n],
                                 deepstack=[d[start : start + n] for d in features.deepstack], grids=[grid]))
        start += n
    return out


def join_features(parts: Sequence[ImageFeatures]) -> ImageFeatures:
    """The features of several images as one batch would have made them."""
    return ImageFeatures(embeds=torch.cat([p.embeds for p in parts]),
                         deepstack=[torch.cat(layer) for layer in zip(*(p.deepstack for p in parts))],
                         grids=[g for p in parts for g in p.grids])
