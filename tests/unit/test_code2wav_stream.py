"""Code2WavStream decodes codec frames incrementally and exactly.

Pins: the concatenation of push()/finish() equals the one-shot `Qwen3OmniMoeCode2Wav` decode
(which is also what `generate()` uses for replies up to 300 frames) within 1e-5 for chunkings
of 1, 2, 7 frames and a ragged mix, over a reply longer than the 72-frame attention window;
the first push of one frame already yields 1920 - 555 = 1365 samples; reset() makes a stream
behave like a fresh one; the work per push is bounded (frames re-run, KV cache, history) however
long the reply; and the left context of 10 frames derived from the conv stack is exactly the
receptive field (gradients: the first pending sample reads frame N-10 and nothing earlier).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.code2wav import QUANTIZERS, small_code2wav
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2Wav,
)

from agent.engine.instruments.code2wav_stream import Code2WavStream, conv_receptive_field

N_FRAMES = 90  # > sliding window (72): the cache must evict
TOL = 1e-5


@pytest.fixture(scope="module")
def code2wav() -> Qwen3OmniMoeCode2Wav:
    torch.set_num_threads(1)
    return small_code2wav(zero_output_bias=True)


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (QUANTIZERS, N_FRAMES), generator=generator)


@pytest.fixture(scope="module")
def reference(code2wav: Qwen3OmniMoeCode2Wav, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return code2wav(codes.unsqueeze(0))[0, 0]


def stream_all(stream: Code2WavStream, codes: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    pieces, start, i = [], 0, 0
    while start < codes.shape[1]:
        n = sizes[i % len(sizes)]
        pieces.append(stream.push(codes[:, start : start + n]))
        start, i = start + n, i + 1
    pieces.append(stream.finish())
    return pieces


def test_receptive_field_is_derived_from_the_modules(code2wav: Qwen3OmniMoeCode2Wav) -> None:
    # Qwen3-Omni's real code2wav has the same (8,5,4,3) x (2,2) stack and kernels.
    field = conv_receptive_field(code2wav)
    assert (field.samples_per_frame, field.delay_samples, field.left_context_frames) == (1920, 555, 10)


def test_one_shot_is_prefix_stable(code2wav, codes, reference) -> None:
    assert reference.shape[0] == N_FRAMES * 1920 - 555
    assert 0.01 < float(reference.std()) < 0.1 and float(reference.abs().max()) < 1.0
    with torch.no_grad():
        prefix = code2wav(codes[:, :13].unsqueeze(0))[0, 0]
    assert prefix.shape[0] == 13 * 1920 - 555
    torch.testing.assert_close(prefix, reference[: prefix.shape[0]], rtol=0, atol=1e-6)


def test_reference_is_what_generate_decodes(code2wav, codes, reference) -> None:
    # generate() decodes with chunked_decode(300, 25): one chunk, hence forward(), up to 300 frames.
    with torch.no_grad():
        generated = code2wav.chunked_decode(codes.unsqueeze(0), chunk_size=300, left_context_size=25)[0, 0]
    assert torch.equal(generated, reference)


@pytest.mark.parametrize("sizes", [[1], [2], [7], [3, 1, 5, 2, 8, 1, 13, 4]], ids=["1", "2", "7", "ragged"])
def test_streamed_equals_one_shot(code2wav, codes, reference, sizes) -> None:
    pieces = stream_all(Code2WavStream(code2wav), codes, sizes)
    streamed = torch.cat(pieces)
    assert streamed.dim() == 1 and streamed.shape == reference.shape
    assert pieces[-1].numel() == 0  # prefix-stable: nothing is left for finish()
    torch.testing.assert_close(streamed, reference, rtol=0, atol=TOL)


def test_first_frame_yields_audio(code2wav, codes) -> None:
    stream = Code2WavStream(code2wav)
    first = stream.push(codes[:, :1])
    assert first.shape == (1920 - 555,)
    assert float(first.abs().max()) > 0
    assert stream.push(codes[:, 1:2]).shape == (1920,)


def test_reset_between_replies_equals_a_fresh_stream(code2wav, codes) -> None:
    reused = Code2WavStream(code2wav)
    stream_all(reused, codes[:, 40:], [3])
    reused.reset()
    again = torch.cat(stream_all(reused, codes[:, :50], [2]))
    fresh = torch.cat(stream_all(Code2WavStream(code2wav), codes[:, :50], [2]))
    assert torch.equal(again, fresh)


def test_cost_per_push_does_not_grow_with_history(code2wav, codes) -> None:
    stream = Code2WavStream(code2wav)
    window = code2wav.config.sliding_window
    for start in range(N_FRAMES):
        stream.push(codes[:, start : start + 1])
        assert stream.frames_rerun == min(start + 1, 1 + stream.left_context_frames)
        assert stream.history.shape[-1] <= stream.left_context_frames
        for layer in stream.cache.layers:
            assert layer.keys.shape[-2] <= window - 1
    stream.push(codes[:, :7])
    assert stream.frames_rerun == 7 + stream.left_context_frames


def test_batch_of_sessions_streams_like_one_shot(code2wav, codes) -> None:
    batch = torch.stack([codes[:, :30], codes[:, 60:90]])
    with torch.no_grad():
        expected = code2wav(batch)[:, 0]
    stream = Code2WavStream(code2wav)
    streamed = torch.cat([stream.push(batch[..., i : i + 4]) for i in range(0, 30, 4)], dim=-1)
    torch.testing.assert_close(streamed, expected, rtol=0, atol=TOL)


def test_left_context_is_exactly_the_receptive_field(code2wav) -> None:
    # Gradients of the conv stack in float64 show structurally which frames a sample reads.
    model = copy.deepcopy(code2wav).double()
    with torch.no_grad():
        model.decoder[-1].conv.weight.mul_(1e-3)  # stay clear of the output clamp (zero gradient)
    stream = Code2WavStream(model)
    pushed = 30  # frames 0..29 are in; frame 30 is the next push
    hidden = torch.randn(1, model.config.hidden_size, pushed + 1, dtype=torch.float64, requires_grad=True)
    wav = stream._conv_stack(hidden)[0, 0]
    first_pending = pushed * 1920 - 555

    def frames_read(sample: int) -> list[int]:
        (grad,) = torch.autograd.grad(wav[sample], hidden, retain_graph=True)
        return grad[0].abs().sum(0).nonzero().flatten().tolist()

    read = frames_read(first_pending)
    assert read[0] == pushed - stream.left_context_frames == pushed - 10
    assert read[-1] == pushed  # needs the new frame: it was not final before
    assert frames_read(first_pending - 1)[-1] == pushed - 1  # final once frame 29 was in
