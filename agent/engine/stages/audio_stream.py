"""Incremental audio-side preprocessing, so the Thinker can prefill while the user speaks.

Two stages, each matching its one-shot counterpart in transformers:

- `StreamingLogMel` reproduces `WhisperFeatureExtractor(feature_size=128, hop_length=160)` as the
  Qwen3-Omni processor calls it (padding="longest": no padding for one utterance, `n // 160`
  frames, reflect padding of n_fft/2 at both ends). Frame t reads samples [160t-200, 160t+200),
  so it is emitted as soon as those exist (40 samples of lookahead past its hop); the right
  reflect padding is applied at finish(), when the utterance length is known.
  The one non-local step is the extractor's clamp `max(x, utterance_max - 8)`: the utterance max
  is not known until the end. Our choice (parameter `running_max_floor`): clamp with the running
  max of the frames emitted so far, raised to `running_max_floor` when given. Consequences
  (pinned by tests): frames emitted after the utterance max has been seen are exact; earlier
  frames are only ever lower than the extractor's, by at most (utterance_max - reference_then)/4,
  and only in bins more than 8 (log10 power) below the utterance max, i.e. near-silence.
  A leading digital silence is the visible case; a floor near the speaker's usual level (e.g.
  the previous turn's `running_max`) removes most of it.

- `AudioBlockEncoder` runs `Qwen3OmniMoeAudioEncoder` block by block. The encoder convolves
  independent chunks of 100 mel frames (1 s -> 13 tokens; a trailing partial chunk is zero-padded
  to 100 frames when a full chunk exists) and then attends non-causally within blocks of
  `n_window_infer` frames. A block's tokens are therefore final exactly when the block is full;
  each full chunk is convolved as soon as it is complete so that end of turn only pays for the
  tail chunk and the open block's transformer pass.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
    get_max_seqlen,
)


def default_feature_extractor() -> WhisperFeatureExtractor:
    """Qwen3-Omni's audio front end (no download: the mel filter bank is computed)."""
    return WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160)


def num_audio_tokens(n_samples: int, hop_length: int = 160, n_window: int = 50) -> int:
    """Audio-pad tokens the processor puts in the prompt for `n_samples` of 16 kHz audio.

    The processor's feature_attention_mask sums to n_samples // hop_length frames, and the
    thinker and processor both map frames to tokens with `_get_feat_extract_output_lengths`.
    """
    return int(_get_feat_extract_output_lengths(torch.tensor(n_samples // hop_length), n_window))


class StreamingLogMel:
    """Log-mel frames of a growing utterance, frame for frame equal to the extractor's."""

    def __init__(
        self, extractor: WhisperFeatureExtractor | None = None, running_max_floor: float | None = None
    ) -> None:
        extractor = extractor or default_feature_extractor()
        if extractor.dither != 0.0:
            raise ValueError("dithering is random: a streamed log-mel cannot match it")
        self.n_fft = extractor.n_fft
        self.hop = extractor.hop_length
        self.pad = self.n_fft // 2  # torch.stft(center=True) pads this much on each side
        self.window = torch.hann_window(self.n_fft)
        self.mel_filters = torch.from_numpy(extractor.mel_filters).to(torch.float32)
        self.running_max_floor = running_max_floor
        self.reset()

    def reset(self) -> None:
        self.samples: torch.Tensor = torch.zeros(0)  # the samples the next frames read
        self.buffer_start = -self.pad  # sample index of samples[0] once the left padding is in
        self.n_samples = 0  # samples received in this utterance
        self.frames_out = 0
        self.running_max = -float("inf")  # max log10 mel power emitted so far (before the floor)
        self._started = False  # left reflect padding applied
        self._finished = False

    def push(self, pcm: np.ndarray | torch.Tensor) -> torch.Tensor:
        """pcm: mono float at 16 kHz. Returns the new frames, [n_mels, n_new] (n_new may be 0)."""
        if self._finished:
            raise RuntimeError("push() after finish(): call reset() for the next utterance")
        chunk = torch.as_tensor(np.asarray(pcm, dtype=np.float32)).reshape(-1)
        self.n_samples += chunk.numel()
        self.samples = torch.cat([self.samples, chunk])
        if not self._started:
            # The left reflect padding reads samples 1..pad: wait until they exist.
            if self.samples.numel() <= self.pad:
                return self._empty()
            self.samples = torch.cat([self.samples[1 : self.pad + 1].flip(0), self.samples])
            self._started = True
        return self._frames(limit=None)

    def frames_for(self, n_samples: int) -> int:
        """Frames push() has emitted once the utterance has n_samples (finish() adds the rest)."""
        return (n_samples + self.pad - self.n_fft) // self.hop + 1 if n_samples > self.pad else 0

    def finish(self) -> torch.Tensor:
        """The last frames, which read the right reflect padding: [n_mels, n_left]."""
        if self._finished:
            raise RuntimeError("finish() called twice: call reset() for the next utterance")
        self._finished = True
        total = self.n_samples // self.hop  # the extractor drops the STFT's last frame
        if not self._started:
            if self.n_samples <= self.pad:
                # The extractor itself cannot reflect-pad this (<= 12.5 ms); extend with zeros.
                self.samples = F.pad(self.samples, (0, self.pad + 1 - self.samples.numel()))
            self.samples = torch.cat([self.samples[1 : self.pad + 1].flip(0), self.samples])
            self._started = True
        tail = self.samples[-self.pad - 1 : -1].flip(0) if self.n_samples > self.pad else torch.zeros(self.pad)
        self.samples = torch.cat([self.samples, tail])
        return self._frames(limit=total)

    def _frames(self, limit: int | None) -> torch.Tensor:
        # Frame t reads utterance samples [hop*t - pad, hop*t - pad + n_fft) (reflect-padded ends).
        first = self.frames_out * self.hop - self.pad - self.buffer_start
        available = (self.samples.numel() - first - self.n_fft) // self.hop + 1
        if limit is not None:
            available = min(available, limit - self.frames_out)
        if available <= 0:
            return self._empty()
        span = self.samples[first : first + (available - 1) * self.hop + self.n_fft]
        stft = torch.stft(span, self.n_fft, self.hop, window=self.window, center=False, return_complex=True)
        magnitudes = (stft.abs() ** 2).contiguous()
        log_spec = torch.clamp(self.mel_filters.T @ magnitudes, min=1e-10).log10()
        self.running_max = max(self.running_max, float(log_spec.max()))
        reference = self.running_max
        if self.running_max_floor is not None:
            reference = max(reference, self.running_max_floor)
        log_spec = torch.maximum(log_spec, torch.tensor(reference - 8.0))
        self.frames_out += available
        # Drop what no later frame reads.
        next_first = first + available * self.hop
        self.samples = self.samples[next_first:]
        self.buffer_start += next_first
        return (log_spec + 4.0) / 4.0

    def _empty(self) -> torch.Tensor:
        return torch.zeros(self.mel_filters.shape[1], 0)


class AudioBlockEncoder:
    """Feed mel frames as they come; get each attention block's audio tokens once it is final.

    With `n_window_infer=800` (the checkpoint's default) a block is 8 s = 104 tokens; with 100,
    every 1 s chunk's 13 tokens are final as soon as the chunk is. The reference to match is
    the encoder run one-shot with the same `n_window_infer`.
    """

    def __init__(self, audio_tower: nn.Module, n_window_infer: int | None = None) -> None:
        self.tower = audio_tower
        self.chunk_frames = 2 * audio_tower.n_window
        self.n_window_infer = n_window_infer or audio_tower.n_window_infer
        if self.n_window_infer % self.chunk_frames:
            raise ValueError(f"n_window_infer must be a multiple of {self.chunk_frames} frames")
        self.chunks_per_block = self.n_window_infer // self.chunk_frames
        self.reset()

    def reset(self) -> None:
        self.pending = torch.zeros(self.tower.num_mel_bins, 0)  # frames of the incomplete chunk
        self.open_chunks: list[torch.Tensor] = []  # conv output of the open block's full chunks
        self.frames_in = 0
        self.tokens_out = 0
        self._finished = False

    @torch.no_grad()
    def push(self, mel: torch.Tensor) -> torch.Tensor:
        """mel: [n_mels, n]. Returns the tokens of blocks completed by it: [n_tokens, output_dim]."""
        if self._finished:
            raise RuntimeError("push() after finish(): call reset() for the next utterance")
        self.frames_in += mel.shape[1]
        self.pending = torch.cat([self.pending, mel.to(self.pending.dtype)], dim=1)
        final: list[torch.Tensor] = []
        while self.pending.shape[1] >= self.chunk_frames:
            chunk, self.pending = self.pending[:, : self.chunk_frames], self.pending[:, self.chunk_frames :]
            self.open_chunks.append(self._conv_front(chunk.unsqueeze(0))[0])
            if len(self.open_chunks) == self.chunks_per_block:
                final.append(self._encode_open_block())
        return self._concat(final)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """End of turn: the open block's tokens, the partial chunk included."""
        if self._finished:
            raise RuntimeError("finish() called twice: call reset() for the next utterance")
        self._finished = True
        if self.pending.shape[1]:
            self.open_chunks.append(self._conv_tail())
        if not self.open_chunks:
            return self._concat([])
        return self._encode_open_block()

    @property
    def open_frames(self) -> int:
        """Mel frames pushed whose tokens are not final yet (the open block's)."""
        return len(self.open_chunks) * self.chunk_frames + self.pending.shape[1]

    @torch.no_grad()
    def provisional(self) -> torch.Tensor:
        """The open block's tokens as finish() would give them if the utterance ended now,
        without changing the stream: [n_tokens, output_dim]. They are provisional: once the
        block is full its final tokens differ (the partial chunk was zero-padded, and the
        block's attention sees more). Live captions read them to show the not-yet-final audio
        (agent/engine/runner/transcriber.py, for many sessions at once: provisional_batch); the cost is
        one pass over the open block only."""
        return self.provisional_batch([self])[0]

    @staticmethod
    @torch.no_grad()
    def provisional_batch(encoders: Sequence[AudioBlockEncoder]) -> list[torch.Tensor]:
        """provisional() of several encoders of one audio tower in one pass (many captioned
        sessions at once): tails of the same width convolved together, every open block in one
        transformer call, which cu_seqlens keeps apart as the encoder's own forward keeps its
        windows apart. The same tokens as one by one, to float rounding."""
        chunks = [[] if e._finished else list(e.open_chunks) for e in encoders]
        by_width: dict[int, list[int]] = {}
        for i, e in enumerate(encoders):
            if not e._finished and e.pending.shape[1]:
                by_width.setdefault(e._tail_width(), []).append(i)
        for width, rows in by_width.items():
            first = encoders[rows[0]]
            padded = torch.stack([F.pad(encoders[i].pending, (0, width - encoders[i].pending.shape[1])) for i in rows])
            convolved = first._conv_front(padded)
            for row, i in enumerate(rows):
                chunks[i].append(convolved[row, : encoders[i]._tail_tokens()])
        out = [e._concat([]) for e in encoders]
        live = [i for i, c in enumerate(chunks) if c]
        if not live:
            return out
        parts = [torch.cat(chunks[i], dim=0) for i in live]
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + part.shape[0])
        hidden = encoders[live[0]]._transform(torch.cat(parts, dim=0), bounds)
        for n, i in enumerate(live):
            out[i] = hidden[bounds[n] : bounds[n + 1]]
        return out

    def _tail_width(self) -> int:
        # One-shot pads every chunk to the longest one: 100 frames once a full chunk exists.
        return self.chunk_frames if self.frames_in >= self.chunk_frames else self.pending.shape[1]

    def _tail_tokens(self) -> int:
        return int(_get_feat_extract_output_lengths(torch.tensor(self.pending.shape[1]), self.tower.n_window))

    def _conv_tail(self) -> torch.Tensor:
        """The convolved tokens of the incomplete chunk (`pending`), as one-shot makes them."""
        padded = F.pad(self.pending, (0, self._tail_width() - self.pending.shape[1])).unsqueeze(0)
        return self._conv_front(padded)[0, : self._tail_tokens()]

    def _conv_front(self, chunks: torch.Tensor) -> torch.Tensor:
        # Mirrors Qwen3OmniMoeAudioEncoder.forward up to the positional embedding.
        tower = self.tower
        weight = tower.conv2d1.weight
        x = chunks.unsqueeze(1).to(device=weight.device, dtype=weight.dtype)
        x = F.gelu(tower.conv2d1(x))
        x = F.gelu(tower.conv2d2(x))
        x = F.gelu(tower.conv2d3(x))
        b, c, f, t = x.size()
        x = tower.conv_out(x.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        return x + tower.positional_embedding.positional_embedding[:t].unsqueeze(0).to(x.dtype)

    def _encode_open_block(self) -> torch.Tensor:
        # Mirrors the forward's transformer part for one attention block.
        hidden = self._transform(torch.cat(self.open_chunks, dim=0))
        self.open_chunks = []
        self.tokens_out += hidden.shape[0]
        return hidden

    def _transform(self, hidden: torch.Tensor, bounds: Sequence[int] | None = None) -> torch.Tensor:
        """The encoder's transformer part over attention blocks' convolved tokens (one block, or
        several concatenated, `bounds` their offsets: attention stays within each)."""
        tower = self.tower
        bounds = [0, hidden.shape[0]] if bounds is None else bounds
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=hidden.device)
        max_seqlen = get_max_seqlen(cu_seqlens, tower.config)
        for layer in tower.layers:
            hidden = layer(hidden, cu_seqlens, max_seqlen=max_seqlen)[0]
        return tower.proj2(tower.act(tower.proj1(tower.ln_post(hidden))))

    def _concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if parts:
            return torch.cat(parts, dim=0)
        weight = self.tower.proj2.weight
        return torch.zeros(0, self.tower.config.output_dim, dtype=weight.dtype, device=weight.device)


class AudioStream:
    """PCM in, final audio tokens out: StreamingLogMel feeding an AudioBlockEncoder."""

    def __init__(
        self,
        audio_tower: nn.Module,
        extractor: WhisperFeatureExtractor | None = None,
        n_window_infer: int | None = None,
        running_max_floor: float | None = None,
    ) -> None:
        self.mel = StreamingLogMel(extractor, running_max_floor=running_max_floor)
        self.encoder = AudioBlockEncoder(audio_tower, n_window_infer)

    def reset(self) -> None:
        self.mel.reset()
        self.encoder.reset()

    def push(self, pcm: np.ndarray | torch.Tensor) -> torch.Tensor:
        return self.encoder.push(self.mel.push(pcm))

    def finish(self) -> torch.Tensor:
        final = self.encoder.push(self.mel.finish())
        return torch.cat([final, self.encoder.finish()], dim=0)

    @property
    def finished(self) -> bool:
        """finish() was called: the utterance's tokens are all out."""
        return self.encoder._finished

    def fork(self) -> AudioStream:
        """An independent copy of the stream so far (a speculative reply finishes the copy while
        this one keeps encoding). Cheap: both stages replace their tensors rather than write into
        them, so only the encoder's list of open chunks needs copying."""
        twin = copy.copy(self)
        twin.mel = copy.copy(self.mel)
        twin.encoder = copy.copy(self.encoder)
        twin.encoder.open_chunks = list(self.encoder.open_chunks)
        return twin
