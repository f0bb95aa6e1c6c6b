"""Batched prefill in fixed token buckets: many sessions' new tokens in one decoder forward.

A prefill appends `n_b` tokens to row b of a slot cache (agent/engine/ops/slots.py). Rows of one
call are *ragged*: each has its own start and count. The call pads every row to one length
T, the smallest bucket (16, 32, 64, 128, 256) holding the longest row, so a decoder sees a
handful of shapes (compiled once each, captured as CUDA graphs like the decode step):

- a row's pad tokens are written to the cache right after its real ones (start + n_b ...
  start + T - 1) and then ignored: the row's length counter only advances by n_b, so no query
  ever sees them (keys past a row's length are masked, as after a crop) and its next tokens
  overwrite them. Real queries cannot see them either: they lie at higher indices.
- a row's logits and last hidden state are read at its last *real* token (`last`, [B]).
- a call with more than the largest bucket per row runs in several forwards; one whose pad
  writes would pass the cache's limit runs at its exact length instead.

With graphs on, a `GraphPool` keyed by (batch bucket, T) replays the step: batch pad rows go
to the scratch row (`pad_slot`), their tokens at its indices 0..T-1. The attention mask is an
input for the sdpa backend (its key window bucketed like decode's); flex and flash-attn read
each row's length from the cache index, so their graphs do not depend on the context length
and every (batch, T) bucket is captured at start-up. A chunk with image tokens (DeepStack adds
features at data-dependent positions) runs eagerly, as does one with fractional positions (video
frames at their time: agent/engine/stages/video_grid.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.engine.compile.capture import GraphPool
from agent.engine.compile.wiring import Graphing
from agent.engine.ops.slots import Rows, SlotKV, decoder_forward

PREFILL_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256)


@dataclass
class PrefillRow:
    """New tokens for one cache row."""

    slot: int
    start: int  # cache index of the first new token (the row's length)
    embeds: torch.Tensor  # [n, hidden] decoder inputs
    rope: torch.Tensor  # [3, n] long multimodal RoPE positions
    visual: torch.Tensor | None = None  # [n] bool: image positions (DeepStack)
    deepstack: list[torch.Tensor] | None = None  # per DeepStack layer, this row's image features in order

    @property
    def n(self) -> int:
        return self.embeds.shape[0]


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [B, vocab] float32 at each row's last token
    last_hidden: torch.Tensor  # [B, 1, hidden] final-normed hidden state at the last token
    captured: list[torch.Tensor] | None  # per row [n_b, hidden]: hidden_states[capture_layer]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class BucketedPrefill:
    """One decoder's prefill: rows padded to a token bucket, one forward (or graph) per call."""

    def __init__(
        self,
        body: nn.Module,
        kv: SlotKV,
        head: Callable[[torch.Tensor], torch.Tensor],
        *,
        capture_layer: int | None = None,
        graphing: Graphing | None = None,
        pad_slot: int = 0,
        buckets: Sequence[int] = PREFILL_BUCKETS,
        name: str = "prefill",
    ) -> None:
        self.body, self.kv, self.head = body, kv, head
        self.capture_layer = capture_layer
        self.buckets = tuple(sorted(set(buckets)))
        if self.buckets and self.buckets[0] < 1:
            raise ValueError(f"prefill buckets must be >= 1, got {buckets}")
        self.graphing = graphing
        self.pad_slot = pad_slot
        self.pool: GraphPool | None = None
        if graphing is not None and graphing.enabled and self.buckets:
            variants = len(self.buckets) * len(graphing.key_lens(kv))
            # Pads: zero inputs into the scratch row at 0..T-1, every key visible (never empty).
            pads = (0.0, pad_slot, 0, 0, 0, 1)
            # Compiled like the per-frame steps, with the batch, the token count (embeds,
            # positions, mask) and the key window symbolic: one compile serves every (batch,
            # token, window) bucket, so start-up pays for one, not dozens. Except with flex
            # attention, whose prefill kernels need a static query length (on CUDA a symbolic
            # one sends chunks to the flex-decoding lowering, which has no kernel for them:
            # agent/engine/ops/attention.py): one compile per token bucket, the batch symbolic.
            # That compile failed once on an H200 (2026-12-04, torch 2.11: "CantSplit: 32768 not
            # divisible by 16*s55"), not reproduced on CPU at the real head counts and a
            # 32,768-key cache; should it fail again, the step runs its eager function, graphed
            # (agent/engine/compile/inductor.py), which is what ran there since.
            static_tokens = self.kv.backend == "flex"
            dynamic = (() if static_tokens else ((0, 1), (3, 2), (5, 1))) + (((5, 2),) if self._windowed else ())
            self.pool = graphing.pool(
                name,
                self._step,
                pads,
                clone_outputs=True,
                variants=variants,
                compiled=True,
                dynamic_dims=dynamic,
                dynamic_batch=True,
                unbacked=None if self._windowed else True,  # (CompiledStep._mark_batch)
            )

    @property
    def _windowed(self) -> bool:
        """Whether attention reads a fixed key window (sdpa) that the graphs must be keyed by."""
        return self.kv.windowed

    def capture_graphs(self) -> None:
        """Capture every (batch, token) bucket at every key window a chunk of it can need: a
        capture in a live tick would stop every session on the engine."""
        if self.pool is None:
            return
        device, dtype = self.kv.device, self.kv.dtype
        hidden = self.body.config.hidden_size
        windows = self.graphing.key_lens(self.kv) if self._windowed and self.graphing is not None else [1]
        for n_tokens, key_len in ((n, k) for n in self.buckets for k in windows if k >= self._key_len(n)):

            def example(batch: int, n_tokens: int = n_tokens, key_len: int = key_len) -> tuple[torch.Tensor, ...]:
                zeros = torch.zeros(batch, dtype=torch.long, device=device)
                return (
                    torch.zeros(batch, n_tokens, hidden, device=device, dtype=dtype),
                    torch.full((batch,), self.pad_slot, dtype=torch.long, device=device),
                    zeros,
                    torch.zeros(batch, 3, n_tokens, dtype=torch.long, device=device),
                    zeros.clone(),
                    torch.ones(batch, n_tokens, key_len, dtype=torch.bool, device=device),
                )

            self.pool.capture_all(example)

    def run(self, rows: Sequence[PrefillRow]) -> PrefillResult:
        """Append every row's tokens; rows longer than the largest bucket take several passes."""
        if not rows:
            raise ValueError("a prefill needs at least one row")
        if any(r.n < 1 for r in rows):
            raise ValueError("every prefill row needs at least one token")
        most = self.buckets[-1] if self.buckets else max(r.n for r in rows)
        done = [0] * len(rows)
        logits: list[torch.Tensor | None] = [None] * len(rows)
        last: list[torch.Tensor | None] = [None] * len(rows)
        captured: list[list[torch.Tensor]] = [[] for _ in rows]
        while active := [i for i, r in enumerate(rows) if done[i] < r.n]:
            part = [_slice(rows[i], done[i], min(rows[i].n, done[i] + most)) for i in active]
            out = self._forward(part)
            for j, i in enumerate(active):
                done[i] += part[j].n
                if done[i] == rows[i].n:
                    logits[i], last[i] = out.logits[j], out.last_hidden[j]
                if out.captured is not None:
                    captured[i].append(out.captured[j])
        return PrefillResult(
            logits=torch.stack(logits),
            last_hidden=torch.stack(last),
            captured=[torch.cat(c, dim=0) for c in captured] if self.capture_layer is not None else None,
        )

    # ---- one forward ---------------------------------------------------------------------------

    def _forward(self, rows: list[PrefillRow]) -> PrefillResult:
        longest = max(r.n for r in rows)
        n_tokens = bucket_for(longest, self.buckets) or longest
        if max(r.start for r in rows) + n_tokens > self.kv.limit:
            n_tokens = longest  # pad writes would pass the cache's end
        device = self.kv.device
        batch = len(rows)
        hidden = rows[0].embeds.shape[-1]
        embeds = torch.zeros(batch, n_tokens, hidden, device=device, dtype=rows[0].embeds.dtype)
        # Video frames sit at fractional times (agent/engine/stages/video_grid.py): float positions then.
        fractional = any(r.rope.is_floating_point() for r in rows)
        positions = torch.zeros(batch, 3, n_tokens, dtype=torch.float32 if fractional else torch.long, device=device)
        ahead = torch.arange(1, n_tokens + 1, device=device)
        for b, r in enumerate(rows):
            embeds[b, : r.n] = r.embeds
            positions[b, :, : r.n] = r.rope
            # Pad tokens continue the row's positions (any value would do: nobody reads them).
            positions[b, :, r.n :] = r.rope[:, -1:] + ahead[: n_tokens - r.n]
        meta = torch.tensor([[r.slot for r in rows], [r.start for r in rows], [r.n - 1 for r in rows]])
        slots, start, last = meta.to(device)
        images = any(r.deepstack is not None for r in rows)
        graphed = self.pool is not None and not images and not fractional and n_tokens in self.buckets
        if graphed:
            key_len = self._key_len(max(r.start for r in rows) + n_tokens)
            index = start.view(-1, 1) + torch.arange(n_tokens, device=device).view(1, -1)
            mask = torch.arange(key_len, device=device).view(1, 1, -1) <= index.unsqueeze(-1)
            outs = self.pool(embeds, slots, start, positions, last, mask)
            return self._result(outs, rows)
        cache_rows = Rows.make([r.slot for r in rows], [r.start for r in rows], n_tokens, device)
        visual = deepstack = None
        if images:
            visual = torch.zeros(batch, n_tokens, dtype=torch.bool, device=device)
            for b, r in enumerate(rows):
                if r.visual is not None:
                    visual[b, : r.n] = r.visual
            parts = [r.deepstack for r in rows if r.deepstack is not None]
            deepstack = [torch.cat(layer, dim=0) for layer in zip(*parts)]
        outs = self._decode(cache_rows, embeds, positions, last, deepstack, visual)
        return self._result(outs, rows)

    def _result(self, outs: tuple[torch.Tensor, ...], rows: list[PrefillRow]) -> PrefillResult:
        captured = None
        if self.capture_layer is not None:
            captured = [outs[2][b, : r.n] for b, r in enumerate(rows)]
        return PrefillResult(outs[0], outs[1], captured)

    def _key_len(self, needed: int) -> int:
        # sdpa reads a key window (bucketed like decode's); flex / flash-attn read each row's
        # own length from the cache index, so the mask is a 1-wide dummy their graphs ignore.
        if not self._windowed or self.graphing is None:
            return 1
        return self.graphing.key_len(needed, self.kv)

    def _step(
        self,
        embeds: torch.Tensor,
        slots: torch.Tensor,
        start: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """The graphed step: embeds [B, T, hidden], slots / start / last [B] long, positions
        [B, 3, T] long, mask [B, T, key_len] bool."""
        n_tokens = embeds.shape[1]
        index = start.view(-1, 1) + torch.arange(n_tokens, device=embeds.device).view(1, -1)
        rows = Rows(
            slots=[],
            index=index,
            key_len=mask.shape[-1],
            mask=mask.unsqueeze(1),
            slot_range=None,
            slot_tensor=slots,
            causal=True,
        )
        return self._decode(rows, embeds, positions, last, None, None)

    def _decode(
        self,
        rows: Rows,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        deepstack: list[torch.Tensor] | None,
        visual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        hidden, captured = decoder_forward(
            self.body,
            self.kv,
            rows,
            embeds,
            positions.transpose(0, 1),
            capture_layer=self.capture_layer,
            deepstack=deepstack,
            visual_mask=visual,
            regions=self.graphing is not None and self.graphing.compiles_regions,
        )
        pick = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        last_hidden = hidden.gather(1, pick)
        logits = self.head(last_hidden)[:, -1].float()
        if self.capture_layer is None:
            return logits, last_hidden
        return logits, last_hidden, captured


def _slice(row: PrefillRow, start: int, end: int) -> PrefillRow:
    """Tokens [start, end) of a row as a row of their own."""
    visual = deepstack = None
    if row.visual is not None:
        visual = row.visual[start:end]
        before, count = int(row.visual[:start].sum()), int(visual.sum())
        if count and row.deepstack is not None:
            deepstack = [d[before : before + count] for d in row.deepstack]
    return PrefillRow(row.slot, row.start + start, row.embeds[start:end], row.rope[:, start:end], visual, deepstack)
