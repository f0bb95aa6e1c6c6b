"""Talker and code-predictor operations for the streaming engine, one codec frame at a time.

Mirrors what transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` does between the
thinker and code2wav, step by step instead of all at once:
- talker prefix: the user turns (text_projection of the thinker's input embeddings at text
  positions, hidden_projection of its `accept_hidden_layer` at media positions), then the
  assistant part (3 header tokens, 4 x tts_pad, tts_bos, the first reply token on the text
  side; zeros, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos on the codec side);
- per frame: codebook 0 from the talker (repetition penalty over earlier codebook-0 tokens,
  the top 1024 ids suppressed except codec EOS; greedy or sampled: agent/engine/ops/sampling.py),
  the 15 residual codebooks from the code predictor, and the next talker input = sum of the 16 codebook embeddings plus the
  next text-side entry (the projection of the next fed reply token, then tts_eos, then tts_pad).

The talker runs on a static slot cache (agent/engine/ops/slots.py): the prefixes of replies that
start in the same tick share one forward (agent/engine/stages/bucketed_prefill.py), and the per-frame step
of every speaking session is one batched forward (a captured graph per batch and
attention-length bucket when graphs are on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from agent.decoding import GREEDY, Sampling
from agent.engine.checkpoints.model import LoadedModel
from agent.engine.compile.wiring import Graphing, slot_cache_with_graph
from agent.engine.ops.gemv import gemv
from agent.engine.ops.sampling import TALKER
from agent.engine.ops.slots import Rows, check_fused_decoder, decoder_forward
from agent.engine.stages.bucketed_prefill import BucketedPrefill, PrefillRow
from agent.engine.stages.token_choice import TokenChoice
from agent.engine.state.kv import KVState, mrope_positions


class TalkerOps:
    def __init__(
        self,
        loaded: LoadedModel,
        slots: int,
        limit: int,
        sampling: Sampling = replace(GREEDY, repetition_penalty=1.05),
        graphing: Graphing | None = None,
    ) -> None:
        """sampling: how codebook 0 is chosen (default: greedy, generate()'s repetition penalty)."""
        model = loaded.model
        self.loaded = loaded
        self.talker = model.talker
        cfg = model.config
        tcfg = cfg.talker_config
        self.num_groups = tcfg.num_code_groups
        self.codec_eos = tcfg.codec_eos_token_id
        self.tts_pad_id = cfg.tts_pad_token_id
        self.image_pad = cfg.thinker_config.image_token_id
        self.merge = cfg.thinker_config.vision_config.spatial_merge_size
        self.position_id_per_seconds = tcfg.position_id_per_seconds
        self.sampling = sampling
        speaker_id = (tcfg.speaker_id or {}).get(loaded.speaker.lower())
        if speaker_id is None:
            raise ValueError(f"speaker {loaded.speaker!r} is not in the talker config")
        self.vocab = tcfg.text_config.vocab_size
        # generate(): every id in the top 1024 of the talker vocab except codec EOS is suppressed.
        self.suppress = torch.zeros(self.vocab, dtype=torch.bool, device=loaded.device)
        self.suppress[self.vocab - 1024 :] = True
        self.suppress[self.codec_eos] = False
        with torch.no_grad():
            special = torch.tensor(
                [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=loaded.device
            )
            # One call on the three rows, as generate() does, so the values match to the bit.
            projected = self.talker.text_projection(model.thinker.get_input_embeddings()(special))
            self.tts_bos, self.tts_eos, self.tts_pad = projected.chunk(3, dim=1)
            hidden = tcfg.text_config.hidden_size
            zeros = torch.zeros(1, 3, hidden, device=loaded.device, dtype=projected.dtype)

            def prefix(speaker: int) -> torch.Tensor:
                ids = torch.tensor(
                    [
                        [
                            tcfg.codec_nothink_id,
                            tcfg.codec_think_bos_id,
                            tcfg.codec_think_eos_id,
                            speaker,
                            tcfg.codec_pad_id,
                            tcfg.codec_bos_id,
                        ]
                    ],
                    device=loaded.device,
                )
                return torch.cat([zeros, self.talker.get_input_embeddings()(ids)], dim=1)

            # The speaker is one codec token of the reply's prefix: a session's voice (Realtime
            # `audio.output.voice`) picks which, per reply, at no other cost.
            self.codec_prefix = prefix(speaker_id)
            self.voices = {name.lower(): prefix(sid) for name, sid in (tcfg.speaker_id or {}).items()}
            self.default_voice = loaded.speaker.lower()
        self.graphing = graphing
        # Where pad rows (and start-up captures) write: the scratch row, or slot 0 where no
        # batch is ever padded (agent/engine/compile/wiring.py kv_rows).
        self.pad_slot = graphing.kv_pad_slot(slots) if graphing is not None else slots
        # Outputs cloned: the hidden rows are kept per reply until the code predictor runs.
        self.kv, self._graph = slot_cache_with_graph(
            graphing,
            self.talker.model,
            slots,
            limit,
            loaded.device,
            loaded.dtype,
            "talker_step",
            self._step,
            (0.0, self.pad_slot, 0, 0, 1),
            clone_outputs=True,
        )
        # Compiled, the step's projections are reductions with the norms folded in (gemv.py).
        self.fused_gemv = graphing is not None and graphing.fuses_projections
        self.regions = graphing is not None and graphing.compiles_regions
        if self.fused_gemv:
            check_fused_decoder(self.talker.model)
            if self.talker.codec_head.bias is not None:
                raise ValueError("fused projections assume a bias-free codec head")
        # Codebook 0 from the step's logits: a compiled, graphed step of its own when sampled.
        self.choice = TokenChoice(
            "talker_pick", sampling, TALKER, self.vocab, loaded.device, graphing, suppress=self.suppress
        )
        # Prefixes of sessions whose turns end together in one forward, in token buckets.
        self.prefiller = BucketedPrefill(
            self.talker.model,
            self.kv,
            self.talker.codec_head,
            graphing=graphing,
            pad_slot=self.pad_slot,
            name="talker_prefill",
        )

    def capture_graphs(self) -> None:
        """Capture the step for every batch bucket at the start-up attention lengths
        (Graphing.key_lens: every one), and the prefix prefill for every (batch, token) bucket."""
        self.prefiller.capture_graphs()
        self.choice.capture_graphs()
        if self._graph is None:
            return
        hidden = self.talker.config.text_config.hidden_size
        device, dtype = self.loaded.device, self.loaded.dtype

        for key_len in self.graphing.key_lens(self.kv):

            def example(batch: int, key_len: int = key_len) -> tuple[torch.Tensor, ...]:
                rows = self.graphing.example_rows(batch, self.pad_slot, key_len, device)
                embeds = torch.zeros(batch, 1, hidden, device=device, dtype=dtype)
                return embeds, rows.slots, rows.index, rows.positions, rows.mask

            self._graph.capture_all(example)

    def user_embeds(self, is_media: torch.Tensor, embeds: torch.Tensor, accept_hidden: torch.Tensor) -> torch.Tensor:
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

    def voice_name(self, voice: str) -> str:
        """The talker speaker a Realtime voice names ("default": the loaded one)."""
        name = voice.lower()
        if name == "default":
            return self.default_voice
        if name not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; this model speaks as: {', '.join(sorted(self.voices))}")
        return name

    def assistant_prefix(
        self, header_embeds: torch.Tensor, first_token_embed: torch.Tensor, voice: str = ""
    ) -> torch.Tensor:
        """[1, 9, hidden]: text side (header, 4 x tts_pad, tts_bos, first reply token) plus
        codec side (3 zeros, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos)."""
        projected = self.talker.text_projection(torch.cat([header_embeds, first_token_embed], dim=1))
        text_side = torch.cat([projected[:, :3], self.tts_pad.expand(1, 4, -1), self.tts_bos, projected[:, 3:4]], dim=1)
        return text_side + (self.voices[voice] if voice else self.codec_prefix)

    def text_sides(self, token_embeds: Sequence[torch.Tensor | None], ended: Sequence[bool]) -> torch.Tensor:
        """[B, 1, hidden]: the text-side entry of one talker step per row: a fed reply token's
        projection, else tts_eos once (right after the last fed token), else tts_pad."""
        fed = [i for i, e in enumerate(token_embeds) if e is not None]
        projected = self.talker.text_projection(torch.cat([token_embeds[i] for i in fed], dim=0)) if fed else None
        rows = [
            projected[fed.index(i) : fed.index(i) + 1] if e is not None else (self.tts_pad if end else self.tts_eos)
            for i, (e, end) in enumerate(zip(token_embeds, ended))
        ]
        return torch.cat(rows, dim=0)

    def prefills(
        self, items: Sequence[tuple[KVState, torch.Tensor, Sequence[int], Sequence[tuple[int, int, int]]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several sessions' talker inputs (state, embeds [1, n, hidden], ids, image grids) in one
        batched forward; returns (float32 logits [B, vocab], last hidden [B, 1, hidden])."""
        rows, next_pos = [], []
        for state, embeds, ids, grids in items:
            rope, pos = mrope_positions(
                ids, state.next_pos, iter(grids), self.image_pad, self.merge, self.position_id_per_seconds
            )
            rows.append(PrefillRow(state.slot, state.length, embeds[0], rope.to(embeds.device)))
            next_pos.append(pos)
        out = self.prefiller.run(rows)
        for (state, embeds, _, _), pos in zip(items, next_pos):
            state.length += embeds.shape[1]
            state.next_pos = pos
        return out.logits, out.last_hidden

    def step(self, states: Sequence[KVState], embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One talker step for B sessions at once: embeds [B, 1, hidden] (each row's last frame
        plus its text side); returns (float32 logits [B, vocab], last hidden [B, 1, hidden])."""
        device = embeds.device
        if self._graph is not None:
            rows = self.graphing.decode_rows(states, self.kv, device)
            logits, hidden = self._graph(embeds, rows.slots, rows.index, rows.positions, rows.mask)
        else:
            batch = Rows.make([s.slot for s in states], [s.length for s in states], 1, device)
            rope = torch.tensor([s.next_pos for s in states], dtype=torch.long, device=device).view(1, -1, 1)
            hidden, _ = decoder_forward(self.talker.model, self.kv, batch, embeds, rope.expand(3, -1, -1))
            logits = self.talker.codec_head(hidden)[:, -1].float()
        for s in states:
            s.length += 1
            s.next_pos += 1
        return logits, hidden

    def _step(
        self,
        embeds: torch.Tensor,
        slots: torch.Tensor,
        index: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed step: embeds [B, 1, hidden], [B] long inputs, mask [B, key_len] bool."""
        rope = positions.view(1, -1, 1).expand(3, -1, -1)
        fused = self.fused_gemv and torch.compiler.is_compiling()
        body = self.talker.model
        rows = Rows.static(slots, index, mask)
        hidden, _ = decoder_forward(body, self.kv, rows, embeds, rope, fused=fused, regions=self.regions)
        if fused:  # the normed hidden is an output (the code predictor's input): no folding
            hidden = body.norm(hidden)
            return gemv(hidden[:, -1], self.talker.codec_head.weight).float(), hidden
        return self.talker.codec_head(hidden)[:, -1].float(), hidden

    def pick_code0(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor,
        seeds: torch.Tensor | None = None,
        draws: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Codebook 0 per row [B], as generate()'s talker picks it: repetition penalty over the
        row's earlier codebook-0 tokens (`seen`, [B, vocab] bool), special tokens suppressed,
        then argmax or, sampling, draw `draws[b]` of the reply seeded `seeds[b]`."""
        if seeds is None or draws is None:
            seeds = draws = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return self.choice(logits, seen, seeds, draws)
