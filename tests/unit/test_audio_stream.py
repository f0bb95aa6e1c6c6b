"""Audio preprocessing for prefill-while-speaking matches the one-shot processor and encoder.

Pins:
- StreamingLogMel equals WhisperFeatureExtractor(128 mels, hop 160) as the Qwen3-Omni processor
  calls it (padding="longest"), frame for frame, for any piece sizes, emitting a frame as soon as
  40 samples past its hop exist (frames_for says how many), and n // 160 frames in all. The
  extractor's clamp at utterance_max - 8 is replaced by a clamp at the running max (optionally floored): equal
  wherever the running max already is the utterance max; before that, streamed values are lower
  by at most (utterance_max - running_max_then) / 4 and only in near-silent bins; with the floor
  at the utterance max everything is equal, so the clamp is the only difference.
- AudioBlockEncoder, fed mel in 80 ms pieces, returns exactly the one-shot
  Qwen3OmniMoeAudioEncoder tokens (1e-5) for 0.5, 1, 2.3 and 9 s with n_window_infer 100 and
  800; tokens arrive as soon as their block is complete (13 per second with 100, 104 per 8 s
  with 800) and finish() returns only the open block.
- provisional() gives the open block's tokens as one-shot would for the mel pushed so far
  (1e-5), without changing the stream: the final tokens and finish() are the same as without it;
  provisional_batch gives several streams' in one pass, each stream's own.
- num_audio_tokens agrees with the processor's feature_attention_mask lengths and the encoder's
  output; a full second is 13 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine_drive import PIECE
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    _get_feat_extract_output_lengths,
)

from agent.engine.stages.audio_stream import (
    AudioBlockEncoder,
    AudioStream,
    StreamingLogMel,
    default_feature_extractor,
    num_audio_tokens,
)

RATE = 16000
TOL = 1e-5


@pytest.fixture(scope="module")
def extractor():
    return default_feature_extractor()


@pytest.fixture(scope="module")
def encoder() -> Qwen3OmniMoeAudioEncoder:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3OmniMoeAudioEncoderConfig(
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=48,
        downsample_hidden_size=8,
    )
    model = Qwen3OmniMoeAudioEncoder(config).eval()
    with torch.no_grad():
        # Default init gives near-constant outputs; unit-gain random weights make every token
        # depend visibly on its inputs and its block.
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            else:
                param.normal_(1.0 if "layer_norm" in name or "ln_post" in name else 0.0, 0.1)
    return model


def speech_like(n: int, seed: int, loud_at: float | None = None) -> np.ndarray:
    """Voiced harmonics under a syllable-rate envelope plus noise; optional burst at `loud_at` s."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / RATE
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
    pcm = 0.05 * voiced * envelope + 0.003 * rng.standard_normal(n)
    if loud_at is not None:
        start = int(loud_at * RATE)
        pcm[start : start + 800] += 0.8 * np.sin(2 * np.pi * 1000 * t[:800])
    return pcm.astype(np.float32)


def one_shot_mel(extractor, pcm: np.ndarray) -> tuple[torch.Tensor, int]:
    out = extractor(pcm, sampling_rate=RATE, padding="longest", return_attention_mask=True, return_tensors="pt")
    return out["input_features"][0], int(out["attention_mask"][0].sum())


def stream_mel(mel: StreamingLogMel, pcm: np.ndarray, sizes: list[int]) -> tuple[torch.Tensor, list[float]]:
    """All frames, and for each frame the clamp reference (log10) it was emitted with."""
    frames, references, start, i = [], [], 0, 0
    while start < len(pcm):
        piece = mel.push(pcm[start : start + sizes[i % len(sizes)]])
        frames.append(piece)
        references += [mel.running_max] * piece.shape[1]
        start, i = start + sizes[i % len(sizes)], i + 1
    tail = mel.finish()
    frames.append(tail)
    references += [mel.running_max] * tail.shape[1]
    return torch.cat(frames, dim=1), references


# ---- log-mel -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8000, 16000, 16123, 36800, 144000])
@pytest.mark.parametrize("sizes", [[PIECE], [1, 37, 160, 999, 2000, 5]], ids=["80ms", "ragged"])
def test_mel_equals_extractor_when_the_max_comes_first(extractor, n, sizes) -> None:
    pcm = speech_like(n, seed=n, loud_at=0.0)  # loudest frames inside the first push
    expected, mask_frames = one_shot_mel(extractor, pcm)
    streamed, _ = stream_mel(StreamingLogMel(extractor), pcm, sizes)
    assert streamed.shape == expected.shape == (128, n // 160) and mask_frames == n // 160
    torch.testing.assert_close(streamed, expected, rtol=0, atol=TOL)


def test_mel_frame_is_emitted_40_samples_past_its_hop(extractor) -> None:
    mel = StreamingLogMel(extractor)
    total = 0
    for n in [200, 1, 39, 1, 119, 1, 500]:
        mel.push(np.zeros(n, dtype=np.float32) + 0.01)
        total += n
        expected = max(0, (total - 200) // 160 + 1) if total > 200 else 0
        assert mel.frames_out == expected == mel.frames_for(total)


def test_mel_running_max_clamp_consequence(extractor) -> None:
    # Half a second of near-silence, then speech with a loud burst at 1.5 s: the worst case.
    pcm = speech_like(3 * RATE, seed=7, loud_at=1.5)
    pcm[: RATE // 2] *= 1e-3
    expected, _ = one_shot_mel(extractor, pcm)
    utterance_max = float(expected.max()) * 4 - 4
    streamed, references = stream_mel(StreamingLogMel(extractor), pcm, [PIECE])
    gap = expected - streamed
    bound = (utterance_max - torch.tensor(references)) / 4
    assert float(gap.min()) >= -TOL  # never higher than the extractor's
    assert bool((gap <= bound.unsqueeze(0) + TOL).all())
    # Only bins below utterance_max - 8 can differ, and they do, in the near-silent lead-in.
    loud_enough = expected > (utterance_max - 8 + 4) / 4 + TOL
    assert float(gap[loud_enough].abs().max()) <= TOL
    assert float(gap[:, :50].max()) > 0.1
    # Exact from the frame where the running max reached the utterance max.
    reached = next(i for i, r in enumerate(references) if r >= utterance_max - 1e-6)
    torch.testing.assert_close(streamed[:, reached:], expected[:, reached:], rtol=0, atol=TOL)
    # A floor at the utterance max makes the whole log-mel equal: the clamp is the only difference.
    floored, _ = stream_mel(StreamingLogMel(extractor, running_max_floor=utterance_max), pcm, [PIECE])
    torch.testing.assert_close(floored, expected, rtol=0, atol=TOL)


# ---- block encoder -------------------------------------------------------------------------


def one_shot_tokens(encoder, mel: torch.Tensor, n_window_infer: int) -> torch.Tensor:
    saved = encoder.n_window_infer
    encoder.n_window_infer = n_window_infer
    try:
        with torch.no_grad():
            return encoder(mel, feature_lens=torch.tensor([mel.shape[1]])).last_hidden_state
    finally:
        encoder.n_window_infer = saved


@pytest.mark.parametrize("seconds", [0.5, 1.0, 2.3, 9.0])
@pytest.mark.parametrize("n_window_infer", [100, 800])
def test_block_encoder_equals_one_shot(extractor, encoder, seconds, n_window_infer) -> None:
    n = int(seconds * RATE)
    mel, _ = one_shot_mel(extractor, speech_like(n, seed=3))
    expected = one_shot_tokens(encoder, mel, n_window_infer)
    assert expected.shape[0] == num_audio_tokens(n)

    blocks = AudioBlockEncoder(encoder, n_window_infer)
    final = []
    for start in range(0, mel.shape[1], 8):  # 8 mel frames = 80 ms
        tokens = blocks.push(mel[:, start : start + 8])
        seen = min(start + 8, mel.shape[1])
        # A block is final as soon as its last frame is in, and not before.
        assert blocks.tokens_out == 13 * n_window_infer // 100 * (seen // n_window_infer)
        final.append(tokens)
    tail = blocks.finish()
    full_blocks = mel.shape[1] // n_window_infer
    assert tail.shape[0] == expected.shape[0] - 13 * (n_window_infer // 100) * full_blocks
    torch.testing.assert_close(torch.cat(final + [tail]), expected, rtol=0, atol=TOL)


def test_window_setting_changes_tokens(extractor, encoder) -> None:
    # Why the reference must use the same n_window_infer: attention blocks differ.
    mel, _ = one_shot_mel(extractor, speech_like(int(2.3 * RATE), seed=3))
    diff = one_shot_tokens(encoder, mel, 100) - one_shot_tokens(encoder, mel, 800)
    assert float(diff.abs().max()) > 1e-2


@pytest.mark.parametrize("n_window_infer", [100, 800])
def test_audio_stream_end_to_end(extractor, encoder, n_window_infer) -> None:
    pcm = speech_like(9 * RATE, seed=11, loud_at=0.0)
    mel, _ = one_shot_mel(extractor, pcm)
    expected = one_shot_tokens(encoder, mel, n_window_infer)
    stream = AudioStream(encoder, extractor, n_window_infer=n_window_infer)
    during = torch.cat([stream.push(pcm[i : i + PIECE]) for i in range(0, len(pcm), PIECE)])
    after = stream.finish()
    # Only the open block waits for end of turn (the 9th second, or with 1 s blocks the last one,
    # whose final frames need the right reflect padding).
    assert after.shape[0] == 13
    torch.testing.assert_close(torch.cat([during, after]), expected, rtol=0, atol=TOL)
    stream.reset()
    again = torch.cat([stream.push(pcm[: PIECE * 20]), stream.finish()])
    assert again.shape[0] == num_audio_tokens(PIECE * 20)


@pytest.mark.parametrize("n_window_infer", [100, 800])
def test_provisional_tokens_are_the_open_block_as_if_it_ended(extractor, encoder, n_window_infer) -> None:
    mel, _ = one_shot_mel(extractor, speech_like(int(2.6 * RATE), seed=5))
    expected = one_shot_tokens(encoder, mel, n_window_infer)
    plain, peeked = AudioBlockEncoder(encoder, n_window_infer), AudioBlockEncoder(encoder, n_window_infer)
    finals, peeked_finals, checked = [], [], 0
    for start in range(0, mel.shape[1], 8):
        piece = mel[:, start : start + 8]
        finals.append(plain.push(piece))
        peeked_finals.append(peeked.push(piece))
        seen = min(start + 8, mel.shape[1])
        prov = peeked.provisional()
        assert peeked.open_frames == seen - n_window_infer * (seen // n_window_infer)
        if peeked.open_frames == 0:
            assert prov.shape[0] == 0
            continue
        # What one-shot makes of exactly the frames seen so far, its open block's part.
        upto = one_shot_tokens(encoder, mel[:, :seen], n_window_infer)
        torch.testing.assert_close(prov, upto[peeked.tokens_out :], rtol=0, atol=TOL)
        checked += 1
    assert checked > 10
    # Peeking changed nothing: the same final tokens, the same tail.
    torch.testing.assert_close(
        torch.cat(peeked_finals + [peeked.finish()]), torch.cat(finals + [plain.finish()]), rtol=0, atol=0
    )
    n_final = sum(f.shape[0] for f in finals)
    torch.testing.assert_close(torch.cat(finals), expected[:n_final], rtol=0, atol=TOL)
    assert peeked.provisional().shape[0] == 0  # a finished stream has nothing open


def test_token_counts(extractor, encoder) -> None:
    for k in range(1, 11):
        assert num_audio_tokens(k * RATE) == 13 * k
    for n in [1280, 8000, 16000, 16123, 20480, 36800, 144000, 160 * 1234 + 17]:
        _, mask_frames = one_shot_mel(extractor, np.zeros(n, dtype=np.float32) + 1e-3)
        assert num_audio_tokens(n) == int(_get_feat_extract_output_lengths(torch.tensor(mask_frames), 50))
    mel, _ = one_shot_mel(extractor, speech_like(20480, seed=1))
    assert one_shot_tokens(encoder, mel, 800).shape[0] == num_audio_tokens(20480) == 13 + 4


def test_provisional_batch_equals_one_by_one(extractor, encoder) -> None:
    """Several streams' provisional tokens in one pass (tails of different widths, a finished
    stream, one with nothing open) are each stream's own."""
    streams = []
    for seconds, seed in [(0.37, 1), (0.62, 2), (1.45, 3), (2.0, 4), (1.3, 5)]:
        mel, _ = one_shot_mel(extractor, speech_like(int(seconds * RATE), seed=seed))
        blocks = AudioBlockEncoder(encoder, 100)
        blocks.push(mel)
        streams.append(blocks)
    streams[-1].finish()
    batch = AudioBlockEncoder.provisional_batch(streams)
    assert batch[-1].shape[0] == 0  # finished: nothing open
    assert sum(t.shape[0] > 0 for t in batch) >= 3
    for blocks, tokens in zip(streams, batch):
        torch.testing.assert_close(tokens, blocks.provisional(), rtol=0, atol=TOL)
        if blocks.open_frames and not blocks._finished:
            alone = blocks._transform(torch.cat([*blocks.open_chunks, blocks._conv_tail()]))
            torch.testing.assert_close(tokens, alone, rtol=0, atol=TOL)
