"""Thinker operations for the streaming engine: chunked prefill and batched one-token decode.

The thinker's language model is driven layer by layer on a static slot cache (agent/engine/
slots.py) instead of through `thinker.forward`, so that the audio tokens can come from the
incremental encoder, each prefill chunk continues a session's cache with explicit positions,
and the decode step of every session that needs a token is one batched forward. What goes in
is what generate() builds: token embeddings with the audio, image and video features
scattered over their placeholders, DeepStack visual features added at the early layers,
multimodal RoPE positions (for the camera's audio-in-video block, agent/engine/stages/video_grid.py's).

A prefill is a `PrefillJob`: its input embeddings and positions are made once, then it runs in
chunks of at most `max_tokens` so that the scheduler can put decode steps of other sessions
between the chunks of a long prefill.

Prefill chunks of several sessions run in one forward, padded to a token bucket
(agent/engine/stages/bucketed_prefill.py). With graphs on (agent/engine/compile/wiring.py), the decode step runs as a
captured graph per batch and attention-length bucket, its inputs all device tensors, and the
prefill as a graph per batch and token bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agent.engine.checkpoints.model import LoadedModel
from agent.engine.compile.wiring import DecodeRows, Graphing, slot_cache_with_graph
from agent.engine.ops.gemv import check_norm, normed_gemv
from agent.engine.ops.slots import Rows, check_fused_decoder, decoder_forward
from agent.engine.stages.bucketed_prefill import BucketedPrefill, PrefillRow
from agent.engine.state.kv import KVState, mrope_positions


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


@dataclass
class PrefillJob:
    """Tokens to append to one session's thinker cache, runnable in chunks."""

    ids: list[int]
    embeds: torch.Tensor  # [1, n, hidden] inputs, media features already scattered in
    rope: torch.Tensor  # [3, n] multimodal RoPE positions
    next_pos: int  # the RoPE position after the whole job
    visual: torch.Tensor | None  # [n] bool: image token positions (DeepStack)
    deepstack: list[torch.Tensor] | None  # per DeepStack layer, [n_image_tokens, hidden]
    done: int = 0  # tokens prefilled so far
    outs: list[PrefillOut] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.done >= len(self.ids)

    @property
    def left(self) -> int:
        """Tokens not prefilled yet."""
        return len(self.ids) - self.done

    def result(self) -> PrefillOut:
        """The whole job's output (after the last chunk)."""
        return PrefillOut(
            last_logits=self.outs[-1].last_logits,
            embeds=torch.cat([o.embeds for o in self.outs], dim=1),
            accept_hidden=torch.cat([o.accept_hidden for o in self.outs], dim=1),
        )


class ThinkerOps:
    def __init__(
        self,
        loaded: LoadedModel,
        slots: int,
        context_limit: int,
        graphing: Graphing | None = None,
        track_ids: bool = False,
    ) -> None:
        """track_ids: keep every slot's token ids in cache order (`seen`: what a repetition
        penalty over the whole context, as generate() applies it to its input_ids, needs)."""
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
        self.graphing = graphing
        self.context_limit = context_limit  # tokens a session's slot holds
        # Where pad rows (and start-up captures) write: the scratch row, or slot 0 where no
        # batch is ever padded (agent/engine/compile/wiring.py kv_rows).
        self.pad_slot = graphing.kv_pad_slot(slots) if graphing is not None else slots
        # Pad rows: token 0 into the scratch row at index 0, seeing one key (no empty softmax).
        self.kv, self._graph = slot_cache_with_graph(
            graphing,
            self.lm,
            slots,
            context_limit,
            loaded.device,
            loaded.dtype,
            "thinker_decode",
            self._decode_step,
            (0, self.pad_slot, 0, 0, 1),
            clone_outputs=False,
        )
        # Compiled, the decode step's projections are reductions with the norms folded in
        # (agent/engine/ops/gemv.py), the final norm in the LM head's.
        self.fused_gemv = graphing is not None and graphing.fuses_projections
        self.regions = graphing is not None and graphing.compiles_regions
        if self.fused_gemv:
            check_fused_decoder(self.lm)
            check_norm(self.lm.norm, thinker.lm_head.weight)
            if thinker.lm_head.bias is not None:
                raise ValueError("fused projections assume a bias-free LM head")
        # The ids in each slot's cache, by cache index (one row more: the pad slot), on the
        # device: a crop needs no update, a row's ids past its length are never read.
        self.vocab = thinker.lm_head.out_features
        self.ids = (
            torch.full((slots + 1, context_limit), self.vocab, dtype=torch.long, device=loaded.device)
            if track_ids
            else None
        )
        # Prefill chunks of many sessions in one forward, padded to token buckets (graphed too).
        self.prefiller = BucketedPrefill(
            self.lm,
            self.kv,
            thinker.lm_head,
            capture_layer=self.accept_layer,
            graphing=graphing,
            pad_slot=self.pad_slot,
            name="thinker_prefill",
        )

    def capture_graphs(self) -> None:
        """Capture the decode step for every batch bucket at the start-up attention lengths
        (Graphing.key_lens: every one), and the prefill for every (batch, token) bucket."""
        self.prefiller.capture_graphs()
        if self._graph is None:
            return

        for key_len in self.graphing.key_lens(self.kv):

            def example(batch: int, key_len: int = key_len) -> tuple[torch.Tensor, ...]:
                rows = self.graphing.example_rows(batch, self.pad_slot, key_len, self.loaded.device)
                return rows.tokens, rows.slots, rows.index, rows.positions, rows.mask

            self._graph.capture_all(example)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageFeatures:
        out = self.thinker.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        return ImageFeatures(
            embeds=torch.cat(out.pooler_output, dim=0),
            deepstack=[torch.cat(feat, dim=0) for feat in out.deepstack_features],
            grids=[tuple(int(x) for x in g) for g in image_grid_thw.tolist()],
        )

    def encode_video(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> ImageFeatures:
        """One video grid (or clip) through the vision tower, as generate() encodes videos."""
        (features,) = self.encode_videos([(pixel_values, grid_thw)])
        return features

    def encode_videos(self, clips: Sequence[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[ImageFeatures]:
        """Several grids (of one turn or of several sessions) in one forward of the tower, one
        ImageFeatures each: the tower attends within each grid's temporal patches only, so a
        grid's features do not depend on what it is batched with."""
        device, dtype = self.loaded.device, self.loaded.dtype
        grids = torch.tensor([list(thw) for _, thw in clips], device=device)
        pixels = torch.cat([p for p, _ in clips]).to(device, dtype)
        out = self.thinker.model.get_video_features(pixels, grids, return_dict=True)
        return [
            ImageFeatures(
                embeds=out.pooler_output[i],
                deepstack=[feat[i] for feat in out.deepstack_features],
                grids=[tuple(int(x) for x in thw)],
            )
            for i, (_, thw) in enumerate(clips)
        ]

    def start_prefill(
        self,
        state: KVState,
        ids: Sequence[int],
        audio: torch.Tensor | None = None,
        images: ImageFeatures | None = None,
        videos: ImageFeatures | None = None,
        rope: tuple[torch.Tensor, int] | None = None,
    ) -> PrefillJob:
        """A job appending `ids` to the session's cache. `audio` fills its <|audio_pad|> tokens
        in order, `images` its <|image_pad|> tokens, `videos` its <|video_pad|> tokens.
        Positions continue from `state` (kv.mrope_positions), or are `rope` ([3, n] and the next
        position: an audio-in-video block, agent/engine/stages/video_grid.py); no other prefill may run
        on this session until the job is finished."""
        device, dtype = self.loaded.device, self.loaded.dtype
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        embeds = self.embed(input_ids)
        if audio is not None and audio.shape[0] > 0:
            mask = (input_ids == self.media_ids[0]).unsqueeze(-1)
            if int(mask.sum()) != audio.shape[0]:
                raise ValueError(f"{int(mask.sum())} audio placeholders for {audio.shape[0]} audio tokens")
            embeds = embeds.masked_scatter(mask, audio.to(device, dtype))
        image_mask, video_mask = input_ids[0] == self.media_ids[1], input_ids[0] == self.media_ids[2]
        visual = deepstack = None
        parts = []  # (mask, features) of each visual kind present
        for mask, feats, kind in ((image_mask, images, "image"), (video_mask, videos, "video")):
            if feats is None:
                continue
            if int(mask.sum()) != feats.embeds.shape[0]:
                raise ValueError(f"{kind} placeholders do not match the {kind} features")
            embeds = embeds.masked_scatter(mask.view(1, -1, 1), feats.embeds.to(device, dtype))
            parts.append((mask, feats))
        if parts:
            # DeepStack rows in token order, images and video frames interleaved as they come
            # (transformers' joint image/video mask).
            visual = image_mask | video_mask if len(parts) > 1 else parts[0][0]
            n_visual, hidden = int(visual.sum()), parts[0][1].embeds.shape[-1]
            deepstack = []
            for layer in range(len(parts[0][1].deepstack)):
                joint = torch.zeros(n_visual, hidden, device=device, dtype=dtype)
                for mask, feats in parts:
                    joint[mask[visual]] = feats.deepstack[layer].to(device, dtype)
                deepstack.append(joint)
        if rope is not None:
            positions, next_pos = rope
        else:
            grids = iter(images.grids if images is not None else ())
            positions, next_pos = mrope_positions(
                ids, state.next_pos, grids, self.media_ids[1], self.merge, self.position_id_per_seconds
            )
        return PrefillJob(list(ids), embeds, positions.to(device), next_pos, visual, deepstack)

    def run_prefills(self, items: Sequence[tuple[KVState, PrefillJob, int | None]]) -> list[int]:
        """The next chunk of several sessions' jobs (each at most its max_tokens) in one batched
        forward (agent/engine/stages/bucketed_prefill.py); returns the tokens done per job."""
        rows, spans = [], []
        for state, job, max_tokens in items:
            start = job.done
            end = len(job.ids) if max_tokens is None else min(len(job.ids), start + max_tokens)
            if end <= start:
                raise ValueError("a prefill chunk needs at least one token")
            visual = deepstack = None
            if job.visual is not None:
                visual = job.visual[start:end]
                before, count = int(job.visual[:start].sum()), int(visual.sum())
                if count:
                    deepstack = [d[before : before + count] for d in job.deepstack]
            embeds, rope = job.embeds[0, start:end], job.rope[:, start:end]
            rows.append(PrefillRow(state.slot, state.length, embeds, rope, visual, deepstack))
            spans.append((start, end))
        out = self.prefiller.run(rows)
        for i, ((state, job, _), (start, end)) in enumerate(zip(items, spans)):
            self._record([state], [job.ids[start:end]])
            state.length += end - start
            job.done = end
            if job.finished:
                state.next_pos = job.next_pos
            job.outs.append(PrefillOut(out.logits[i], job.embeds[:, start:end], out.captured[i].unsqueeze(0)))
        return [end - start for start, end in spans]

    def prefill(
        self,
        state: KVState,
        ids: Sequence[int],
        audio: torch.Tensor | None = None,
        images: ImageFeatures | None = None,
    ) -> PrefillOut:
        """Append `ids` in one forward (see start_prefill)."""
        job = self.start_prefill(state, ids, audio, images)
        self.run_prefills([(state, job, None)])
        return job.result()

    def decode(self, states: Sequence[KVState], tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per session, all in one forward; return next-token logits [B, vocab]
        (float32). Sessions may have any cache lengths and RoPE positions. Graphed: the logits
        are the graph's output buffer, valid until the next decode."""
        device = self.loaded.device
        if self.ids is not None:  # one write for the batch: each row's token at its length
            self.ids[[s.slot for s in states], [s.length for s in states]] = torch.as_tensor(
                list(tokens), device=device
            )
        if self._graph is not None:
            rows: DecodeRows = self.graphing.decode_rows(states, self.kv, device, tokens)
            logits = self._graph(rows.tokens, rows.slots, rows.index, rows.positions, rows.mask)
            for s in states:
                s.length += 1
                s.next_pos += 1
            return logits
        embeds = self.embed(torch.tensor(list(tokens), dtype=torch.long, device=device).view(-1, 1))
        rows = Rows.make([s.slot for s in states], [s.length for s in states], 1, device)
        rope = torch.tensor([s.next_pos for s in states], dtype=torch.long, device=device).view(1, -1, 1)
        hidden, _ = decoder_forward(self.lm, self.kv, rows, embeds, rope.expand(3, -1, -1))
        for s in states:
            s.length += 1
            s.next_pos += 1
        return self.thinker.lm_head(hidden[:, -1]).float()

    def _record(self, states: Sequence[KVState], ids: Sequence[Sequence[int]]) -> None:
        """Note the ids about to be appended at each state's length (before it advances)."""
        if self.ids is None:
            return
        for state, row in zip(states, ids):
            if row:
                self.ids[state.slot, state.length : state.length + len(row)] = torch.as_tensor(
                    list(row), dtype=torch.long
                )

    def seen(self, states: Sequence[KVState]) -> torch.Tensor:
        """[B, vocab] bool: the ids each session's cache holds (its whole context, the reply's
        tokens fed so far included): what generate()'s repetition penalty sees as input_ids."""
        if self.ids is None:
            raise RuntimeError("token ids are not tracked (track_ids=False)")
        longest = max(s.length for s in states)
        slots = torch.tensor([s.slot for s in states], device=self.ids.device)
        lengths = torch.tensor([s.length for s in states], device=self.ids.device)
        ids = self.ids.index_select(0, slots)[:, :longest]
        ids = ids.masked_fill(torch.arange(longest, device=ids.device) >= lengths.unsqueeze(1), self.vocab)
        seen = torch.zeros(len(states), self.vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids, True)[:, : self.vocab]

    def _decode_step(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        index: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The graphed decode step: all [B] long but mask [B, key_len] bool -> logits [B, vocab]."""
        embeds = self.embed(tokens.view(-1, 1))
        rope = positions.view(1, -1, 1).expand(3, -1, -1)
        fused = self.fused_gemv and torch.compiler.is_compiling()
        rows = Rows.static(slots, index, mask)
        hidden, _ = decoder_forward(self.lm, self.kv, rows, embeds, rope, fused=fused, regions=self.regions)
        if fused:  # the final norm folded into the head's reduction
            return normed_gemv(hidden[:, -1], self.lm.norm, self.thinker.lm_head.weight).float()
        return self.thinker.lm_head(hidden[:, -1]).float()

    def is_media(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids == self.media_ids[0]) | (ids == self.media_ids[1]) | (ids == self.media_ids[2])

    def token_embeds(self, ids: Sequence[int]) -> torch.Tensor:
        """[1, n, hidden] input embeddings of text tokens (hidden_states[0] for text)."""
        return self.embed(torch.tensor([list(ids)], dtype=torch.long, device=self.loaded.device))
