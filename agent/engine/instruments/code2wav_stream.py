"""Exact frame-by-frame streaming of Qwen3-Omni's code2wav (codec codes -> 24 kHz waveform).

`Qwen3OmniMoeCode2Wav.forward` is: embed codes (mean over the quantizers) -> pre-transformer
(causal, sliding window 72) -> conv/upsampling stack (causal convs, transposed convs) -> clamp.
It is prefix-stable: decoding the first N frames gives exactly the first N*1920 - 555 samples of
the whole decode (each decoder transposed conv trims as much on the right as it looks ahead, so
the output simply ends where the input runs out; nothing at the end is ever revised).

Streaming therefore needs no guessing and no cross-fade:
- the pre-transformer runs only on the new frames with a sliding-window KV cache
  (transformers' `DynamicSlidingWindowLayer` keeps the last window-1 keys/values), positions
  continuing from a counter, so the cost per frame is bounded by the window;
- the conv stack is re-run on the new frames plus `left_context_frames` frames of cached
  pre-transformer output. That number is derived from the modules' kernels, dilations and strides
  (`conv_receptive_field`): 10 frames for Qwen3-Omni's (8,5,4,3)x(2,2) stack. Re-running a few
  frames keeps the HF modules untouched (no per-conv state to mirror) at a fixed cost per push.

Everything here runs on the engine thread; the state lives in the instance (no globals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
)


@dataclass(frozen=True)
class ReceptiveField:
    """What the conv stack of code2wav needs, in codec frames and output samples."""

    samples_per_frame: int  # 1920 for Qwen3-Omni (24 kHz, 12.5 Hz codec)
    delay_samples: int  # N frames decode to N*samples_per_frame - delay_samples samples (555)
    left_context_frames: int  # earlier frames the first not-yet-final sample depends on (10)


# One op of the conv stack, for dependency arithmetic: ("conv", span) is a stride-1 causal conv
# whose output j reads inputs [j - span, j]; ("tconv", kernel, stride, left_trim) a transposed conv
# whose trimmed output j reads inputs ceil((j + left_trim - kernel + 1) / stride) .. floor((j + left_trim) / stride).
_Op = tuple[str, int, int, int]


def _conv_stack_ops(code2wav: nn.Module) -> list[_Op]:
    ops: list[_Op] = []
    # modules() walks in registration order, which is the execution order of the upsample and
    # decoder stacks (residual branches add identity, already inside each conv's span).
    for stack in (code2wav.upsample, code2wav.decoder):
        for module in stack.modules():
            if isinstance(module, Qwen3OmniMoeCausalConvNet):
                if module.stride != 1:
                    raise ValueError("strided causal convs are not supported by Code2WavStream")
                ops.append(("conv", module.kernel_size - 1, 1, 0))
            elif isinstance(module, Qwen3OmniMoeCausalTransConvNet):
                conv = module.conv
                ops.append(("tconv", conv.kernel_size[0], conv.stride[0], module.left_pad))
    return ops


def _input_index(ops: list[_Op], sample: int, *, earliest: bool) -> int:
    """The earliest (or latest) codec frame that output `sample` depends on."""
    j = sample
    for kind, a, stride, left_trim in reversed(ops):
        if kind == "conv":
            j = j - a if earliest else j
        elif earliest:
            j = -((-(j + left_trim - a + 1)) // stride)  # ceil division
        else:
            j = (j + left_trim) // stride
    return j


def conv_receptive_field(code2wav: nn.Module) -> ReceptiveField:
    """Derive the streaming constants from the modules instead of hard-coding 1920/555/10.

    Every stage's rate divides samples_per_frame, so the dependencies are shift-invariant by one
    frame: it is enough to look at one frame boundary.
    """
    ops = _conv_stack_ops(code2wav)
    spf = int(code2wav.total_upsample)
    frames = 1000  # frames 0..999 pushed; far from the start so index 0 clips nothing
    # First sample that needs frame `frames` (dependency is monotone in the sample index).
    lo, hi = 0, (frames + 1) * spf
    while lo < hi:
        mid = (lo + hi) // 2
        if _input_index(ops, mid, earliest=False) >= frames:
            hi = mid
        else:
            lo = mid + 1
    first_pending = lo
    delay = frames * spf - first_pending
    left = frames - _input_index(ops, first_pending, earliest=True)
    return ReceptiveField(samples_per_frame=spf, delay_samples=delay, left_context_frames=left)


class Code2WavStream:
    """Incremental `code2wav`: push codec frames, get back only waveform samples that are final.

    The concatenation of every push() and finish() equals `code2wav(codes_all)` for any chunking
    (up to float rounding: the streamed attention sees the same keys through a cache).
    State tensors carry a leading batch dimension; push() with 2-D codes means a batch of one.
    A batch shares one frame counter: its sessions must start together and push equal counts
    (per-row resets and lengths are future work when sessions get batched).
    """

    def __init__(self, code2wav: nn.Module, left_context_frames: int | None = None) -> None:
        self.code2wav = code2wav
        self.field = conv_receptive_field(code2wav)
        self.samples_per_frame = self.field.samples_per_frame
        self.delay_samples = self.field.delay_samples
        # Below the derived value the output is inexact (accepted for experiments only); at least
        # ceil(delay / spf) frames are needed just to index the first pending sample.
        minimum = -(-self.delay_samples // self.samples_per_frame)
        if left_context_frames is None:
            left_context_frames = self.field.left_context_frames
        if left_context_frames < minimum:
            raise ValueError(f"left_context_frames must be >= {minimum}")
        self.left_context_frames = left_context_frames
        self.reset()

    def reset(self) -> None:
        """Start a new reply: forget the KV cache, the hidden history and the counters."""
        self.cache = DynamicCache(config=self.code2wav.config)
        self.frames_in = 0  # codec frames pushed so far
        self.samples_out = 0  # waveform samples returned so far
        self.history: torch.Tensor | None = None  # (batch, hidden, frames) pre-transformer output
        self.history_start = 0  # frame index of history[..., 0]
        self.frames_rerun = 0  # frames the conv stack ran on in the last call (cost per push)
        self.batch_size = 1

    def _final_samples(self, frames: int) -> int:
        return max(0, frames * self.samples_per_frame - self.delay_samples)

    @torch.no_grad()
    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [num_quantizers, n] (or [batch, num_quantizers, n]) -> new final samples.

        Returns a 1-D float tensor for 2-D codes, [batch, samples] for 3-D codes.
        """
        squeeze = codes.dim() == 2
        if squeeze:
            codes = codes.unsqueeze(0)
        model = self.code2wav
        batch, quantizers, n_new = codes.shape
        if quantizers != model.config.num_quantizers:
            raise ValueError(f"expected {model.config.num_quantizers} quantizers, got {quantizers}")
        self.batch_size = batch
        if n_new == 0:
            empty = self._empty()
            return empty[0] if squeeze else empty

        # Pre-transformer on the new frames only; explicit positions because one-shot decoding
        # numbers frames from 0 for the whole reply.
        embeds = model.code_embedding(codes + model.code_offset).mean(1)
        positions = torch.arange(self.frames_in, self.frames_in + n_new, device=codes.device)
        hidden = model.pre_transformer(
            inputs_embeds=embeds,
            position_ids=positions.unsqueeze(0).expand(batch, -1),
            cache=self.cache,
            use_cache=True,
        ).last_hidden_state.transpose(1, 2)
        self.history = hidden if self.history is None else torch.cat([self.history, hidden], dim=-1)

        previous = self.frames_in
        self.frames_in += n_new
        wav = self._emit(first_frame=max(0, previous - self.left_context_frames))
        return wav[0] if squeeze else wav

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """The tail of the reply. code2wav is prefix-stable and trims its own lookahead, so every
        sample the whole decode has is already returned by push(): this is empty for Qwen3-Omni,
        and kept so callers need not know that. 1-D for a batch of one, [batch, 0] otherwise."""
        empty = self._empty()
        return empty[0] if self.batch_size == 1 else empty

    def _empty(self) -> torch.Tensor:
        weight = self.code2wav.code_embedding.weight
        return torch.zeros(self.batch_size, 0, dtype=weight.dtype, device=weight.device)

    def _emit(self, first_frame: int) -> torch.Tensor:
        assert self.history is not None
        window = self.history[..., first_frame - self.history_start :]
        self.frames_rerun = window.shape[-1]
        wav = self._conv_stack(window)[:, 0, :]  # covers samples [first_frame*spf, final)
        final = self._final_samples(self.frames_in)
        start = self.samples_out - first_frame * self.samples_per_frame
        new = wav[:, start : final - first_frame * self.samples_per_frame]
        self.samples_out = final
        # Keep only what the next push re-runs: left_context_frames before the current end.
        keep_from = max(0, self.frames_in - self.left_context_frames)
        self.history = self.history[..., keep_from - self.history_start :]
        self.history_start = keep_from
        return new

    def _conv_stack(self, hidden: torch.Tensor) -> torch.Tensor:
        # Mirrors Qwen3OmniMoeCode2Wav.forward after the pre-transformer (the tests pin equality).
        for blocks in self.code2wav.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.code2wav.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)
