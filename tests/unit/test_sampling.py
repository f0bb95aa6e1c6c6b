"""The engine's token choice (agent/engine/ops/sampling.py) against transformers' own processors.

Pins:
- on the same logits, the project's filtered scores equal transformers' logits processors
  (RepetitionPenalty, SuppressTokens, MinNewTokens' end-token ban, Temperature, TopK, TopP)
  bit for bit, for the thinker's, the talker's and the code predictor's settings;
- the race noise is a pure function of (seed, stage, draw, token): the same inputs give the
  same noise whatever rows share the batch; another seed, stage or draw gives other noise;
- the race draws each token with its probability (counts over many draws within 5 sigma);
- greedy choice is argmax after penalty and suppression, and sampling needs seeds;
- the checkpoint's generation_config.json sets the thinker's sampling, `talker_*` keys the
  talker's, and the tiny model stays greedy with its short caps (agent/decoding.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from agent.config import Config
from agent.decoding import (
    QWEN_CODE_PREDICTOR,
    QWEN_TALKER,
    QWEN_THINKER,
    Decoding,
    Sampling,
    defaults_for,
)
from agent.engine.ops.sampling import CODE_PREDICTOR, TALKER, THINKER, choose, penalize, race_noise, warp


def reference(
    sampling: Sampling, input_ids: torch.Tensor, logits: torch.Tensor, suppress=(), eos=None, first=False
) -> torch.Tensor:
    """What generate() does to the scores, in its order (_get_logits_processor)."""
    procs = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if first:
        procs.append(MinNewTokensLengthLogitsProcessor(input_ids.shape[1], 1, torch.tensor(eos)))
    if suppress:
        procs.append(SuppressTokensLogitsProcessor(list(suppress)))
    if sampling.do_sample:
        if sampling.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            procs.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            procs.append(TopPLogitsWarper(sampling.top_p))
    return procs(input_ids, logits.clone())


def ours(
    sampling: Sampling, input_ids: torch.Tensor, logits: torch.Tensor, suppress=(), eos=None, first=False
) -> torch.Tensor:
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, input_ids, True)
    scores = penalize(logits, seen, sampling.repetition_penalty)
    if first:
        scores = scores.index_fill(1, torch.tensor(eos), float("-inf"))
    if suppress:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[list(suppress)] = True
        scores = scores.masked_fill(mask, float("-inf"))
    return warp(scores, sampling) if sampling.do_sample else scores


@pytest.mark.parametrize(
    "stage,sampling,vocab,suppress,first",
    [
        ("thinker", Sampling(True, 0.6, 20, 0.95, 1.05), 1200, (), True),
        ("thinker", QWEN_THINKER, 1200, (), False),
        ("talker", QWEN_TALKER, 3072, tuple(i for i in range(2048, 3072) if i != 2150), False),
        ("code_predictor", QWEN_CODE_PREDICTOR, 2048, (), False),
        ("greedy_talker", Sampling(repetition_penalty=1.05), 3072, tuple(range(2048, 3072)), False),
    ],
)
def test_filtered_scores_equal_transformers_processors(stage, sampling, vocab, suppress, first) -> None:
    gen = torch.Generator().manual_seed(hash(stage) % 1000)
    logits = torch.randn(4, vocab, generator=gen) * 3
    input_ids = torch.randint(0, vocab, (4, 40), generator=gen)
    eos = [vocab - 3, vocab - 4]
    want = reference(sampling, input_ids, logits, suppress, eos, first)
    got = ours(sampling, input_ids, logits, suppress, eos, first)
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    assert torch.equal(want, got), f"{stage}: filtered scores differ"
    if sampling.do_sample:
        kept = torch.isfinite(got).sum(-1)
        assert (kept < vocab).all() and (kept >= 1).all()  # the filters really filtered


def test_noise_is_a_function_of_seed_stage_draw_and_token() -> None:
    seeds = torch.tensor([7, 7, 8, 2**32 + 7], dtype=torch.long)
    draws = torch.tensor([3, 4, 3, 3], dtype=torch.long)
    noise = race_noise(seeds, draws, TALKER, 3072)
    assert noise.shape == (4, 3072) and (noise > 0).all() and torch.isfinite(noise).all()
    alone = race_noise(seeds[:1], draws[:1], TALKER, 3072)
    assert torch.equal(alone[0], noise[0])  # a row's noise does not depend on its batch
    assert torch.equal(noise[3], noise[0])  # seeds are 32-bit
    assert not torch.equal(noise[1], noise[0]) and not torch.equal(noise[2], noise[0])
    for stage in (THINKER, CODE_PREDICTOR):
        assert not torch.equal(race_noise(seeds[:1], draws[:1], stage, 3072), alone)
    # Exp(1): mean 1, and no two tokens of a row share a value in practice.
    assert abs(float(noise.mean()) - 1.0) < 0.05
    assert len(torch.unique(noise[0])) > 3000


def test_the_race_draws_each_token_with_its_probability() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0])
    n = 20_000
    seeds = torch.full((n,), 12345, dtype=torch.long)
    draws = torch.arange(n, dtype=torch.long)
    picks = (probs / race_noise(seeds, draws, CODE_PREDICTOR, len(probs))).argmax(-1)
    counts = torch.bincount(picks, minlength=len(probs)).double()
    expected = probs.double() * n
    sigma = torch.sqrt(n * probs.double() * (1 - probs.double()))
    assert (counts[5:] == 0).all()  # a filtered token is never drawn
    assert ((counts[:5] - expected[:5]).abs() <= 5 * sigma[:5]).all(), counts.tolist()


def test_greedy_is_argmax_and_sampling_needs_seeds() -> None:
    scores = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert choose(scores, Sampling(), None, None, THINKER).tolist() == [1, 0]
    with pytest.raises(ValueError, match="seeds"):
        choose(scores, QWEN_THINKER, None, None, THINKER)
    seeds, draws = torch.tensor([1, 1]), torch.tensor([0, 0])
    drawn = choose(scores, Sampling(True), seeds, draws, THINKER)
    assert torch.equal(drawn, choose(scores, Sampling(True), seeds, draws, THINKER))
    with pytest.raises(ValueError, match="temperature"):
        Sampling(True, temperature=0.0)


def test_model_defaults_come_from_its_generation_config(tmp_path, tiny_model_dir) -> None:
    tiny = defaults_for(str(tiny_model_dir))
    assert tiny.tiny and tiny.max_reply_tokens == 48 and tiny.max_reply_seconds == 4.0
    assert not tiny.decoding.samples
    assert Config(model=str(tiny_model_dir)).max_reply_tokens == 48

    real = defaults_for(str(tmp_path))  # a checkpoint folder with no generation config
    assert not real.tiny and real.max_reply_tokens >= 512 and real.max_reply_seconds >= 30
    assert real.decoding == Decoding(QWEN_THINKER, QWEN_TALKER, QWEN_CODE_PREDICTOR)
    assert "voice assistant" in real.system_prompt

    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 300,
                "talker_temperature": 0.8,
                "talker_max_new_tokens": 251,
            }
        )
    )
    real = defaults_for(str(tmp_path))
    assert real.decoding.thinker == Sampling(True, 0.7, 20, 0.8, 1.05)
    assert real.decoding.talker == Sampling(True, 0.8, 50, 1.0, 1.05)
    assert real.max_reply_tokens == 300 and real.max_reply_seconds == pytest.approx(20.0)
    assert not defaults_for(str(tmp_path), "greedy").decoding.samples
    config = Config(model=str(tmp_path), decoding="greedy", max_reply_seconds=9.0, seed=5)
    assert config.max_reply_seconds == 9.0 and config.max_reply_tokens == 300
    assert config.sampling.seed == 5 and not config.sampling.samples
