"""Thinker operations for the streaming engine: chunked prefill and one-token decode.

The thinker's language model is driven directly (not through `thinker.forward`) so that the
audio tokens can come from the incremental encoder and each prefill chunk can continue a
session's KV cache with explicit positions. What goes in is what generate() builds: token
embeddings with the audio features and image features scattered over their placeholders,
DeepStack image features added at the early layers, multimodal RoPE positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent.engine.model import LoadedModel
from agent.engine.session_state import KVState, four_row_positions, mrope_positions


@dataclass
class ImageFeatures:
    """Vision encoder output for one turn's images: merged tokens and DeepStack features."""

    embeds: torch.Tensor  # [n_tokens, hidden]
    deepstack: list[torch.Tensor]  # one [n_tokens, hidden] per DeepStack layer
    grids: list[tuple[int, int, int]]


@dataclass
class PrefillOut:
    last_logits: torch.Tensor  # [vocab] float32, at the chunk's last token
    embeds: torch.Tensor  # [1, n, hidden]: hidden_states[0], the decoder's input
    accept_hidden: torch.Tensor  # [1, n, hidden]: hidden_states[accept_hidden_layer]


class ThinkerOps:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        thinker = loaded.model.thinker
        self.thinker = thinker
        self.lm = thinker.model.language_model
        self.embed = self.lm.get_input_embeddings()
        cfg = loaded.model.config
        self.accept_layer = cfg.talker_config.accept_hidden_layer
        self.merge = cfg.thinker_config.vision_config.spatial_merge_size
        self.position_id_per_seconds = cfg.thinker_config.position_id_per_seconds
        self.media_ids = (
            cfg.thinker_config.audio_token_id,
            cfg.thinker_config.image_token_id,
            cfg.thinker_config.video_token_id,
        )

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.lm.config)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageFeatures:
        out = self.thinker.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        return ImageFeatures(
            embeds=torch.cat(out.pooler_output, dim=0),
            deepstack=[torch.cat(feat, dim=0) for feat in out.deepstack_features],
            grids=[tuple(int(x) for x in g) for g in image_grid_thw.tolist()],
        )

    @torch.no_grad()
    def prefill(
        self,
        state: KVState,
        ids: Sequence[int],
        audio: torch.Tensor | None = None,
        images: ImageFeatures | None = None,
    ) -> PrefillOut:
        """Append `ids` to the cache. `audio` fills the chunk's <|audio_pad|> tokens in order,
        `images` its <|image_pad|> tokens."""
        device, dtype = self.loaded.device, self.loaded.dtype
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        embeds = self.embed(input_ids)
        if audio is not None and audio.shape[0] > 0:
            mask = (input_ids == self.media_ids[0]).unsqueeze(-1)
            if int(mask.sum()) != audio.shape[0]:
                raise ValueError(f"{int(mask.sum())} audio placeholders for {audio.shape[0]} audio tokens")
            embeds = embeds.masked_scatter(mask.to(device), audio.to(device, dtype))
        deepstack = visual_mask = None
        grids = iter(images.grids if images is not None else ())
        if images is not None:
            visual_mask = input_ids == self.media_ids[1]
            if int(visual_mask.sum()) != images.embeds.shape[0]:
                raise ValueError("image placeholders do not match the image features")
            embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1), images.embeds.to(device, dtype))
            deepstack = [d.to(device, dtype) for d in images.deepstack]
        rope, next_pos = mrope_positions(
            ids, state.next_pos, grids, self.media_ids[1], self.merge, self.position_id_per_seconds
        )
        out = self.lm(
            inputs_embeds=embeds,
            position_ids=four_row_positions(rope, state.length).to(device),
            cache=state.cache,
            use_cache=True,
            output_hidden_states=True,
            deepstack_visual_embeds=deepstack,
            visual_pos_masks=visual_mask,
        )
        state.length += len(ids)
        state.next_pos = next_pos
        logits = self.thinker.lm_head(out.last_hidden_state[:, -1:])
        return PrefillOut(
            last_logits=logits[0, -1].float(),
            embeds=out.hidden_states[0],
            accept_hidden=out.hidden_states[self.accept_layer],
        )

    @torch.no_grad()
    def decode(self, state: KVState, token: int) -> torch.Tensor:
        """Feed one token; return the next token's logits [vocab] (float32)."""
        device = self.loaded.device
        embeds = self.embed(torch.tensor([[token]], dtype=torch.long, device=device))
        rope = torch.full((3, 1), state.next_pos, dtype=torch.long)
        out = self.lm(
            inputs_embeds=embeds,
            position_ids=four_row_positions(rope, state.length).to(device),
            cache=state.cache,
            use_cache=True,
        )
        state.length += 1
        state.next_pos += 1
        return self.thinker.lm_head(out.last_hidden_state)[0, -1].float()

    def is_media(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids == self.media_ids[0]) | (ids == self.media_ids[1]) | (ids == self.media_ids[2])

    @torch.no_grad()
    def token_embeds(self, ids: Sequence[int]) -> torch.Tensor:
        """[1, n, hidden] input embeddings of text tokens (hidden_states[0] for text)."""
        return self.embed(torch.tensor([list(ids)], dtype=torch.long, device=self.loaded.device))
