"""Talker and code-predictor operations for the streaming engine, one codec frame at a time.

Mirrors what transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` does between the
thinker and code2wav, step by step instead of all at once:
- talker prefix: the user turns (text_projection of the thinker's input embeddings at text
  positions, hidden_projection of its `accept_hidden_layer` at media positions), then the
  assistant part (3 header tokens, 4 x tts_pad, tts_bos, the first reply token on the text
  side; zeros, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos on the codec side);
- per frame: codebook 0 from the talker (repetition penalty over earlier codebook-0 tokens,
  the top 1024 ids suppressed except codec EOS), the 15 residual codebooks from the code
  predictor (greedy), and the next talker input = sum of the 16 codebook embeddings plus the
  next text-side entry (the projection of the next fed reply token, then tts_eos, then tts_pad).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from agent.engine.model import LoadedModel
from agent.engine.session_state import KVState, four_row_positions, mrope_positions


class TalkerOps:
    def __init__(self, loaded: LoadedModel, repetition_penalty: float = 1.05) -> None:
        model = loaded.model
        self.loaded = loaded
        self.talker = model.talker
        self.predictor = model.talker.code_predictor
        cfg = model.config
        tcfg = cfg.talker_config
        self.num_groups = tcfg.num_code_groups
        self.codec_eos = tcfg.codec_eos_token_id
        self.tts_pad_id = cfg.tts_pad_token_id
        self.image_pad = cfg.thinker_config.image_token_id
        self.merge = cfg.thinker_config.vision_config.spatial_merge_size
        self.position_id_per_seconds = tcfg.position_id_per_seconds
        self.repetition_penalty = repetition_penalty
        speaker_id = (tcfg.speaker_id or {}).get(loaded.speaker.lower())
        if speaker_id is None:
            raise ValueError(f"speaker {loaded.speaker!r} is not in the talker config")
        vocab = tcfg.text_config.vocab_size
        # generate(): every id in the top 1024 of the talker vocab except codec EOS is suppressed.
        self.suppress = torch.zeros(vocab, dtype=torch.bool, device=loaded.device)
        self.suppress[vocab - 1024 :] = True
        self.suppress[self.codec_eos] = False
        with torch.no_grad():
            special = torch.tensor(
                [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=loaded.device
            )
            # One call on the three rows, as generate() does, so the values match to the bit.
            projected = self.talker.text_projection(model.thinker.get_input_embeddings()(special))
            self.tts_bos, self.tts_eos, self.tts_pad = projected.chunk(3, dim=1)
            codec_prefix = torch.tensor(
                [[tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id, speaker_id,
                  tcfg.codec_pad_id, tcfg.codec_bos_id]],
                device=loaded.device,
            )
            hidden = tcfg.text_config.hidden_size
            zeros = torch.zeros(1, 3, hidden, device=loaded.device, dtype=projected.dtype)
            self.codec_prefix = torch.cat([zeros, self.talker.get_input_embeddings()(codec_prefix)], dim=1)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.talker.config.text_config)

    @torch.no_grad()
    def user_embeds(
        self, is_media: torch.Tensor, embeds: torch.Tensor, accept_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Talker inputs for user-turn tokens: [1, n, talker_hidden]."""
        out = torch.empty(
            (1, embeds.shape[1], self.talker.config.text_config.hidden_size),
            device=embeds.device,
            dtype=self.talker.dtype,
        )
        mask = is_media.view(1, -1)
        if mask.any():
            out[mask] = self.talker.hidden_projection(accept_hidden[mask])
        if (~mask).any():
            out[~mask] = self.talker.text_projection(embeds[~mask])
        return out

    @torch.no_grad()
    def assistant_prefix(self, header_embeds: torch.Tensor, first_token_embed: torch.Tensor) -> torch.Tensor:
        """[1, 9, hidden]: text side (header, 4 x tts_pad, tts_bos, first reply token) plus
        codec side (3 zeros, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos)."""
        projected = self.talker.text_projection(torch.cat([header_embeds, first_token_embed], dim=1))
        text_side = torch.cat(
            [projected[:, :3], self.tts_pad.expand(1, 4, -1), self.tts_bos, projected[:, 3:4]], dim=1
        )
        return text_side + self.codec_prefix

    @torch.no_grad()
    def text_side(self, token_embed: torch.Tensor | None, ended: bool) -> torch.Tensor:
        """The text-side entry of one talker step: a fed reply token's projection, else tts_eos
        once (right after the last fed token), else tts_pad."""
        if token_embed is not None:
            return self.talker.text_projection(token_embed)
        return self.tts_eos if not ended else self.tts_pad

    @torch.no_grad()
    def forward(
        self, state: KVState, embeds: torch.Tensor, ids: Sequence[int], grids: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append talker inputs; return (float32 logits [vocab], last hidden [1, 1, hidden])."""
        rope, next_pos = mrope_positions(
            ids, state.next_pos, iter(grids), self.image_pad, self.merge, self.position_id_per_seconds
        )
        out = self.talker.model(
            inputs_embeds=embeds,
            position_ids=four_row_positions(rope, state.length).to(embeds.device),
            cache=state.cache,
            use_cache=True,
        )
        state.length += embeds.shape[1]
        state.next_pos = next_pos
        last = out.last_hidden_state[:, -1:]
        return self.talker.codec_head(last)[0, -1].float(), last

    def pick_code0(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """Greedy codebook 0 with generate()'s repetition penalty and special-token suppression."""
        scores = logits.clone()
        if history:
            seen = torch.tensor(sorted(set(history)), device=scores.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * self.repetition_penalty, picked / self.repetition_penalty)
        scores = scores.masked_fill(self.suppress, float("-inf"))
        return int(scores.argmax())

    @torch.no_grad()
    def residual_codes(self, last_hidden: torch.Tensor, code0: int) -> tuple[list[int], torch.Tensor]:
        """The 15 residual codes for one frame, and the next talker input's codec side (the
        sum of all 16 codebook embeddings) [1, 1, hidden]."""
        device = last_hidden.device
        c0 = torch.tensor([[code0]], device=device)
        c0_embed = self.talker.get_input_embeddings()(c0)
        cache = DynamicCache(config=self.predictor.config)
        out = self.predictor(inputs_embeds=torch.cat([last_hidden, c0_embed], dim=1), cache=cache, use_cache=True)
        codes: list[int] = []
        pieces = [c0_embed]
        table = self.predictor.get_input_embeddings()
        for step in range(1, self.num_groups):
            code = int(out.logits[0, -1].float().argmax())
            codes.append(code)
            token = torch.tensor([[code]], device=device)
            pieces.append(table[step - 1](token))
            if step < self.num_groups - 1:
                out = self.predictor(input_ids=token, generation_steps=step, cache=cache, use_cache=True)
        return codes, torch.cat(pieces, dim=1).sum(1, keepdim=True)
