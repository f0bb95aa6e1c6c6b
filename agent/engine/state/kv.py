"""Where a session stands in a decoder's static KV cache: a leaf module (torch only), so the
graph wiring, the decoders and the per-session state can all name these types without importing
each other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass
class KVState:
    """A session's row of a decoder's slot cache and where the next token goes.

    `length` is the physical cache length (the text-position row and the causal mask);
    `next_pos` the next multimodal-RoPE position, which runs ahead of `length` after images
    (an image's tokens share positions, the text after it continues from their max + 1).
    """

    slot: int
    length: int = 0
    next_pos: int = 0

    def crop(self, length: int, next_pos: int) -> None:
        """Forget everything after the first `length` tokens: a static cache masks keys by
        index, so what lies beyond is never read again and is overwritten by the next tokens."""
        self.length, self.next_pos = min(length, self.length), next_pos


def mrope_positions(
    ids: Sequence[int],
    start: int,
    grids: Iterator[tuple[int, int, int]],
    image_pad: int,
    merge: int,
    position_id_per_seconds: float,
) -> tuple[torch.Tensor, int]:
    """[3, n] multimodal RoPE positions of `ids`, continuing from `start`; and the next position.

    Equal to transformers' get_rope_index on a prompt holding text, audio and images (no
    video): text and audio advance by one per token; an image's tokens take (t, h, w) offsets
    from the position after <|vision_start|>, and what follows continues from their max + 1.
    """
    out = torch.empty(3, len(ids), dtype=torch.long)
    pos, i = start, 0
    while i < len(ids):
        if ids[i] != image_pad:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        t, h, w = next(grids)
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if any(tok != image_pad for tok in ids[i : i + count]):
            raise ValueError("image placeholder run does not match its grid")
        t_idx = (torch.arange(t).float() * position_id_per_seconds).long().view(-1, 1, 1).expand(t, gh, gw)
        h_idx = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
        w_idx = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
        block = torch.stack([t_idx.flatten(), h_idx.flatten(), w_idx.flatten()]) + pos
        out[:, i : i + count] = block
        pos = int(block.max()) + 1
        i += count
    return out, pos
