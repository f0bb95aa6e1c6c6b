"""code2wav for many sessions at once, frame by frame, with per-session (per-slot) state.

Where `Code2WavStream` re-runs the conv stack over 10 frames of left context per push (simple,
but 11x the work of one frame, and one frame counter per instance), this keeps every causal
conv's state instead, so a push of one frame runs the stack on exactly one frame, and sessions
at different points of their replies share one batched call:

- pre-transformer: a static ring cache per slot (sliding window W = 72 frames, RoPE positions
  from the slot's own frame counter), masked by the stored key positions, so the cost per frame
  is bounded by the window however long the reply;
- causal conv (stride 1, kernel K): the last K-1 input columns per slot; the state starts at
  zero, which is exactly the one-shot decode's left zero padding;
- transposed conv with kernel == stride: no state; with kernel == 2 * stride (the decoder's
  upsampling) the previous input column, so an output sample is emitted once both of the
  input columns it reads are known (the one-shot decode trims the same samples on each side).

A slot's first push has no previous column: its transposed convs then produce `stride` leading
samples that the one-shot decode does not have ("junk", 555 output samples in all for
Qwen3-Omni, the same delay `conv_receptive_field` derives). Junk columns are zeroed before they
reach a conv with state (so the state sees what the one-shot decode's zero padding would have
been) and cut off the output: the first push of one frame yields 1920 - 555 samples, every
later one 1920, and the concatenation equals `code2wav(codes)` up to float rounding
(tests/unit/test_batching.py pins it against the one-shot decode and against Code2WavStream).

A push is host bookkeeping (frame counters, which rows are fresh) around one step function of
device tensors only (`_step`), which graphs on (agent/engine/compile/wiring.py) capture per batch
bucket; pad rows then run in a scratch slot (row `slots`) of every state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from agent.engine.compile.wiring import Graphing
from agent.engine.ops.slots import Rows, SlotKV, decoder_forward

FAR_PAST = -(2**40)  # stored position of an empty ring entry: outside every window


class _Batch:
    """The rows of one push: their slots, and which are fresh (first push since reset). All
    device tensors, so that a push can be a CUDA graph; `junk_scale` is a Python int that is
    the same at every call: the leading junk columns a fresh row has at the stack's current
    rate (0 for the others)."""

    def __init__(
        self, index: torch.Tensor, fresh: torch.Tensor, slot_range: slice | None, any_fresh: bool | None
    ) -> None:
        self.index, self.fresh, self.range = index, fresh, slot_range
        self.any_fresh = any_fresh  # known on the host when eager; None in a graph (always mask)
        self.junk_scale = 0

    def gather(self, state: torch.Tensor) -> torch.Tensor:
        return state[self.range] if self.range is not None else state.index_select(0, self.index)

    def scatter(self, state: torch.Tensor, rows: torch.Tensor) -> None:
        if self.range is not None:
            state[self.range] = rows
        else:
            state.index_copy_(0, self.index, rows)

    def zero_junk(self, x: torch.Tensor) -> torch.Tensor:
        if not self.junk_scale or self.any_fresh is False:
            return x
        # Multiplying the other rows by 1 leaves them bit for bit as they were.
        junk = (self.fresh * self.junk_scale).view(-1, 1, 1)
        return x * (torch.arange(x.shape[-1], device=x.device).view(1, 1, -1) >= junk)


class SlotCode2Wav:
    """Per-slot streaming code2wav. push(slots, codes) -> new final samples of each row."""

    def __init__(
        self, code2wav: nn.Module, slots: int, max_frames_per_push: int = 4, graphing: Graphing | None = None
    ) -> None:
        self.code2wav = code2wav
        config = code2wav.config
        weight = code2wav.code_embedding.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.window = config.sliding_window
        self.max_frames = max_frames_per_push
        # A push of n frames overwrites n ring entries while its first query still needs the
        # window before it: window + n - 1 entries keep every key a query can see.
        self.ring = self.window + max_frames_per_push - 1
        rows = graphing.cache_rows(slots) if graphing is not None else slots
        self.pad_slot = slots
        self.kv = SlotKV(code2wav.pre_transformer, rows, self.ring, self.device, self.dtype)
        self.kv.reserve(self.ring)
        self.key_pos = torch.full((rows, self.ring), FAR_PAST, dtype=torch.long, device=self.device)
        self.frames = [0] * slots  # frames pushed per slot since its reset
        self.states: dict[int, torch.Tensor] = {}  # id(conv module) -> [rows, channels, columns]
        self._make_states(rows)
        self.junk = self._junk_samples()  # leading output samples a slot's first push drops
        # Pad rows: code 0 at frame 0, not fresh, in the scratch slot. Outputs cloned: callers
        # keep the samples (numpy views of a CPU tensor would see the next replay).
        self._graph = None
        self.regions = graphing is not None and graphing.compiles_regions
        if graphing is not None:
            pads = (0, self.pad_slot, 0, 0)
            self._graph = graphing.pool("code2wav", self._step, pads, clone_outputs=True, compiled=True)

    def capture_graphs(self) -> None:
        """Capture the one-frame push for every batch bucket."""
        if self._graph is None:
            return
        quantizers = self.code2wav.config.num_quantizers

        def example(batch: int) -> tuple[torch.Tensor, ...]:
            zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
            codes = torch.zeros(batch, quantizers, 1, dtype=torch.long, device=self.device)
            return codes, torch.full_like(zeros, self.pad_slot), zeros, zeros.clone()

        self._graph.capture_all(example)

    def _junk_samples(self) -> int:
        """A fresh row's junk at the output rate: the recurrence `_trans_conv` follows, walked
        over the transposed convs in the order a push runs them."""
        scale = 0
        blocks = [block for group in self.code2wav.upsample for block in group] + list(self.code2wav.decoder)
        for block in blocks:
            for module in block.modules():
                if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
                    stride = module.conv.stride[0]
                    scale = (scale + 1) * stride if id(module) in self.states else scale * stride
        return scale

    def _make_states(self, slots: int) -> None:
        for module in self.code2wav.modules():
            if isinstance(module, Qwen3OmniMoeCausalConvNet):
                if module.stride != 1:
                    raise ValueError("strided causal convs are not supported")
                columns = module.kernel_size - 1
                channels = module.conv.in_channels
            elif isinstance(module, Qwen3OmniMoeCausalTransConvNet):
                kernel, stride = module.conv.kernel_size[0], module.conv.stride[0]
                if kernel not in (stride, 2 * stride) or module.left_pad != kernel - stride:
                    raise ValueError(f"transposed conv kernel {kernel} / stride {stride} is not supported")
                columns, channels = (1 if kernel == 2 * stride else 0), module.conv.in_channels
            else:
                continue
            if columns:
                self.states[id(module)] = torch.zeros(slots, channels, columns, device=self.device, dtype=self.dtype)

    def reset(self, slot: int) -> None:
        """Start a new reply on `slot`."""
        self.frames[slot] = 0
        self.key_pos[slot] = FAR_PAST
        for state in self.states.values():
            state[slot] = 0

    def push(self, slots: Sequence[int], codes: torch.Tensor) -> list[torch.Tensor]:
        """codes [B, num_quantizers, n] (n equal for all rows, <= max_frames_per_push) for the
        given slots -> each row's new final samples (1-D float), in row order."""
        batch, quantizers, n_new = codes.shape
        if quantizers != self.code2wav.config.num_quantizers:
            raise ValueError(f"expected {self.code2wav.config.num_quantizers} quantizers, got {quantizers}")
        if not 1 <= n_new <= self.max_frames:
            raise ValueError(f"push 1..{self.max_frames} frames at a time, got {n_new}")
        slots = list(slots)
        fresh = [self.frames[s] == 0 for s in slots]
        meta = torch.tensor([slots, [self.frames[s] for s in slots], fresh], dtype=torch.long).to(self.device)
        if self._graph is not None:
            wav = self._graph(codes, meta[0], meta[1], meta[2])
        else:
            consecutive = slots == list(range(slots[0], slots[0] + batch))
            slot_range = slice(slots[0], slots[0] + batch) if consecutive else None
            wav = self._step(codes, meta[0], meta[1], meta[2], slot_range, any(fresh))
        for s in slots:
            self.frames[s] += n_new
        return [wav[i, self.junk if fresh[i] else 0 :] for i in range(batch)]

    def _step(
        self,
        codes: torch.Tensor,
        slots: torch.Tensor,
        frames: torch.Tensor,
        fresh: torch.Tensor,
        slot_range: slice | None = None,
        any_fresh: bool | None = None,
    ) -> torch.Tensor:
        """One push on device tensors: codes [B, Q, n], slots / frames pushed so far / fresh
        [B] long -> samples [B, n * 1920] (a fresh row's first `junk` are to be dropped).
        Eager callers may pass `slot_range` (the slots as a slice when consecutive: views, not
        gathers) and `any_fresh` (skip the junk masks when False)."""
        model = self.code2wav
        rows = _Batch(slots, fresh, slot_range, any_fresh)
        embeds = model.code_embedding(codes + model.code_offset).mean(1)
        hidden = self._pre_transformer(rows, embeds, frames).transpose(1, 2)
        for blocks in model.upsample:
            for block in blocks:
                hidden = self._run(block, hidden, rows)
        for block in model.decoder:
            hidden = self._run(block, hidden, rows)
        if rows.junk_scale != self.junk:  # Python-only check: the walk and the run must agree
            raise RuntimeError(f"code2wav junk {rows.junk_scale} != {self.junk} derived at init")
        return hidden.clamp(min=-1, max=1)[:, 0]

    def _pre_transformer(self, rows: _Batch, embeds: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        batch, n_new, _ = embeds.shape
        positions = frames.view(-1, 1) + torch.arange(n_new, device=self.device).view(1, -1)
        index = positions % self.ring
        key_pos = rows.gather(self.key_pos)
        key_pos.scatter_(1, index, positions)
        rows.scatter(self.key_pos, key_pos)
        # Sliding window: a query at p sees the stored keys at positions (p - W, p].
        seen = key_pos.unsqueeze(1)
        query = positions.unsqueeze(-1)
        mask = ((seen <= query) & (seen > query - self.window)).unsqueeze(1)
        kv_rows = Rows([], index, self.ring, mask, rows.range, rows.index)
        body = self.code2wav.pre_transformer
        hidden, _ = decoder_forward(body, self.kv, kv_rows, embeds, positions, regions=self.regions)
        return hidden

    def _run(self, module: nn.Module, x: torch.Tensor, rows: _Batch) -> torch.Tensor:
        """One module of the conv stack on the new columns, mirroring its transformers forward."""
        if isinstance(module, Qwen3OmniMoeCausalConvNet):
            return self._causal_conv(module, x, rows)
        if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
            return self._trans_conv(module, x, rows)
        if isinstance(module, Qwen3OmniMoeConvNeXtBlock):
            h = self._causal_conv(module.dwconv, x, rows).permute(0, 2, 1)
            h = module.pwconv2(module.act(module.pwconv1(module.norm(h))))
            return x + (module.gamma * h).permute(0, 2, 1)
        if isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
            for part in module.block:
                x = self._run(part, x, rows)
            return x
        if isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            h = self._causal_conv(module.conv1, module.act1(x), rows)
            return self._causal_conv(module.conv2, module.act2(h), rows) + x
        if isinstance(module, Qwen3OmniMoeSnakeBeta):
            return module(x)
        raise TypeError(f"code2wav module {type(module).__name__} has no streaming rule")

    def _causal_conv(self, module: nn.Module, x: torch.Tensor, rows: _Batch) -> torch.Tensor:
        state = self.states.get(id(module))
        if state is None:  # kernel 1: no memory
            return module.conv(x)
        full = torch.cat([rows.gather(state), rows.zero_junk(x)], dim=-1)
        rows.scatter(state, full[..., -state.shape[-1] :])
        return module.conv(full)

    def _trans_conv(self, module: nn.Module, x: torch.Tensor, rows: _Batch) -> torch.Tensor:
        stride = module.conv.stride[0]
        state = self.states.get(id(module))
        if state is None:  # kernel == stride: every input column has its own output samples
            rows.junk_scale *= stride
            return module.conv(x)
        x = rows.zero_junk(x)
        full = torch.cat([rows.gather(state), x], dim=-1)
        rows.scatter(state, x[..., -1:])
        # Output samples [stride, stride + n * stride) read the previous column and the new ones.
        out = module.conv(full)[..., stride : stride * (x.shape[-1] + 1)]
        rows.junk_scale = (rows.junk_scale + 1) * stride  # only fresh rows have junk
        return out
