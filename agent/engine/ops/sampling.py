"""Seeded token choice for the thinker, the talker and the code predictor, per row of a batch.

The scores are filtered exactly as transformers' logits processors do in `generate()` (the
same operations in the same order, so the same logits give the same filtered scores to the
bit: tests/unit/test_sampling.py): repetition penalty, suppressed tokens, then, when sampling,
temperature, top-k and top-p. The draw from the resulting distribution is an exponential race,
`argmax(probs / E)` with E ~ Exp(1) per token, which picks token i with probability p_i, as
`torch.multinomial` does, but from noise that is a pure function of (reply seed, stage, draw
index, token id):

- no generator state: a batched tick draws for every row at once, each row from its own
  reply's stream, so a reply's tokens do not depend on which other replies share the tick;
- no host sync and no RNG op: the noise is integer hashing and a log, made on the device
  inside the compiled and captured code-predictor loop from two small graph inputs (the rows'
  seeds and frame indices);
- reproducible: the same seed gives the same reply, and `generate(do_sample=True)` with its
  `torch.multinomial` drawing from the same noise gives the same tokens
  (tests/unit/test_sampling_exact.py).

The hash is Wellons' `lowbias32` on 32-bit values kept in int64 tensors, each multiply split so
that no intermediate passes 2**63 (int64 overflow is not defined in the kernels torch compiles).
"""

from __future__ import annotations

import torch

from agent.decoding import Sampling

# Stage salts: a reply's thinker, talker and code-predictor draws are independent streams.
THINKER, TALKER, CODE_PREDICTOR = 1, 2, 3
RESIDUAL_GROUPS = 15  # code-predictor draws per frame: codebooks 1..15

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for x in [0, 2**32): the high half of m multiplies into a 16-bit window."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a 32-bit integer hash with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


# Each step of the hash reads its input two or three times, and inductor inlines an unrealised
# elementwise input at every read while it generates code: four hashes in a row were ~32**4
# calls of the first one's code, and compiling race_noise alone took 133 s on this CPU (a sampled
# stage's pick ~105 s, against ~0.1 s to run it). As a nested compile region each hash is traced
# once and its output is a buffer the next one reads: 16 s, the same bits. Outside a compile
# this is a plain call.
_mix = torch.compiler.nested_compile_region(_lowbias32)


def race_noise(seeds: torch.Tensor, draws: torch.Tensor, stage: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab] float32 for draw `draws[b]` of stage `stage` of the reply seeded
    `seeds[b]` (both [B] int64; seeds are taken mod 2**32). `draws` may be [B, S]: the noise of
    S draws per row at once, [B, S, vocab] (the code predictor makes a frame's 15 in one
    kernel: drawn inside its loop, the hash was 15 kernels to generate and to compile)."""
    seeds = seeds.view(-1, *([1] * (draws.dim() - 1)))
    key = _mix((seeds & _M32) ^ _mul32(torch.full_like(seeds, stage), 0x9E3779B9))
    key = _mix(key ^ (draws & _M32))
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix(_mix(key.unsqueeze(-1) ^ _mul32(tokens, 0x85EBCA6B)))
    # 23 random bits plus one half: a float32 strictly inside (0, 1), exactly representable.
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(uniform)


def penalize(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """RepetitionPenaltyLogitsProcessor: scores of seen ids ([B, vocab] bool) divided by the
    penalty when positive, multiplied when negative."""
    if penalty == 1.0:
        return scores
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def warp(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, top-k and top-p, as TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper (min_tokens_to_keep 1) apply them, in that order."""
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k:
        top_k = min(sampling.top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, top_k)[0][..., -1, None], float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # The most likely token always stays (min_tokens_to_keep=1); a mask, not an assignment
        # of a Python constant, so that no fresh host tensor enters a captured graph.
        vocab = scores.shape[-1]
        drop = (cumulative <= (1 - sampling.top_p)) & (torch.arange(vocab, device=scores.device) < vocab - 1)
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def choose(
    scores: torch.Tensor,
    sampling: Sampling,
    seeds: torch.Tensor | None,
    draws: torch.Tensor | None,
    stage: int,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token per row [B] from processed scores [B, vocab] (penalty and suppression already
    applied): argmax when greedy, else the race over the warped distribution. `noise`: the
    draw's race_noise made beforehand (else made here from seeds and draws)."""
    if not sampling.do_sample:
        return scores.argmax(-1)
    if noise is None:
        if seeds is None or draws is None:
            raise ValueError("sampling needs the rows' seeds and draw indices")
        noise = race_noise(seeds, draws, stage, scores.shape[-1])
    probs = torch.softmax(warp(scores, sampling), dim=-1)
    return (probs / noise).argmax(-1)


def row_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
