"""Shared by the engine tests: microphone audio, feeding it to a runner and stepping the runner
until it is idle, generate() as the reference (imported by test modules, not a test itself)."""

from __future__ import annotations

import numpy as np
import torch

from agent.config import INPUT_FRAME_SAMPLES
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.state.kv import KVState

PIECE = INPUT_FRAME_SAMPLES  # 80 ms of 16 kHz microphone audio: one ingest chunk


# The system prompt of the engine tests (the generate() references use the same one).
SYSTEM = "You are a helpful voice assistant."


def make_audio(
    seconds: float,
    freq: float = 220.0,
    seed: int = 7,
    *,
    onset_s: float = 0.0,
    noise: float = 0.02,
    loud_first: bool = True,
) -> np.ndarray:
    """A tone (from `onset_s` on) plus seeded noise at 16 kHz. `loud_first`: the first 40 samples
    are the loudest, so the streamed log-mel equals the feature extractor's (its normalisation
    uses the running maximum, which the first sample then fixes)."""
    t = np.arange(int(16000 * seconds)) / 16000
    wav = (
        0.2 * np.sin(2 * np.pi * freq * t) * (t > onset_s)
        + np.random.default_rng(seed).standard_normal(t.shape) * noise
    )
    if loud_first:
        wav[:40] = 0.5
    return wav.astype(np.float32)


def speak(runner: StreamingRunner, sid: str, audio: np.ndarray) -> None:
    """Hand `audio` to the runner in ingest-sized pieces, as the engine thread does."""
    for i in range(0, len(audio), PIECE):
        runner.append_audio(sid, audio[i : i + PIECE])


def run_until_idle(runner: StreamingRunner, limit: int = 200) -> list:
    """Step the runner until it has no work; every output, in order. Fails past `limit` steps."""
    return [output for step in steps_until_idle(runner, limit) for output in step]


def steps_until_idle(runner: StreamingRunner, limit: int = 200) -> list[list]:
    """Step the runner until it has no work; each step's outputs. Fails past `limit` steps."""
    steps = []
    for _ in range(limit):
        if not runner.has_work():
            return steps
        steps.append(runner.step())
    raise AssertionError("the runner never went idle")


def assert_loop_equals_eager(predictor, batch: int, seed: int) -> torch.Tensor:
    """The code predictor's loop as the engine runs it (`run`: graphed, compiled) against the
    eager loop (`_run`) on seeded inputs: the same codes exactly, the same embedding sums to
    float rounding, and codes that vary (a loop that really ran). Returns the codes."""
    gen = torch.Generator().manual_seed(seed)
    hidden = predictor.talker_embed.embedding_dim
    with torch.inference_mode():
        last = torch.randn(batch, 1, hidden, generator=gen)
        code0 = torch.randint(0, 2048, (batch,), generator=gen)
        rows = torch.zeros_like(code0)  # seeds and frame indices (a greedy loop reads neither)
        codes, sums = predictor.run(last, code0, rows, rows)
        want_codes, want_sums = predictor._run(last, code0, rows, rows)
    torch.testing.assert_close(codes, want_codes, rtol=0, atol=0)
    torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-4)
    assert len(set(codes[:, 1:].flatten().tolist())) > 1
    return codes


def fill_with_noise(*ops, gen: torch.Generator | None = None) -> None:
    """Fill the KV caches of `ops` with noise, so that attention reads something that tells
    rows and positions apart."""
    with torch.inference_mode():
        for kv in (o.kv for o in ops):
            for t in kv.keys + kv.values:
                t.normal_(generator=gen)


def decode_inputs(ops, batch: int, gen: torch.Generator):
    """Rows of `batch` sessions in random slots of `ops`' cache, at random cache lengths and
    RoPE positions, as the engine hands them to a graphed decode step."""
    states = []
    # Sessions' slots only: the scratch row (where there is one) takes the pad rows' writes, and
    # flex gathers its queries by slot, so a session there would share its row with a pad row.
    scratch = ops.pad_slot != 0 and ops.pad_slot == ops.kv.slots - 1
    for slot in torch.randperm(ops.kv.slots - scratch, generator=gen)[:batch].tolist():
        state = KVState(slot)
        state.length, state.next_pos = torch.randint(0, 200, (2,), generator=gen).tolist()
        states.append(state)
    return ops.graphing.decode_rows(states, ops.kv, ops.kv.device, tokens=[5] * batch)


def assert_steps_equal_eager(thinker, talker, batch: int, gen: torch.Generator) -> None:
    """The thinker's decode step and the talker's step as the engine runs them (`_graph`:
    graphed, compiled) against their eager steps on seeded ragged rows over the caches as they
    are: the same logits and hidden states to float rounding. The eager thinker step runs second
    and writes the same keys where the compiled one did."""
    with torch.inference_mode():
        rows = decode_inputs(thinker, batch, gen)
        tokens = torch.randint(0, 1000, (batch,), generator=gen)
        args = (tokens, rows.slots, rows.index, rows.positions, rows.mask)
        compiled = thinker._graph(*args).clone()
        torch.testing.assert_close(compiled, thinker._decode_step(*args), rtol=1e-4, atol=1e-4)

        rows = decode_inputs(talker, batch, gen)
        hidden = talker.talker.config.text_config.hidden_size
        embeds = torch.randn(batch, 1, hidden, generator=gen)
        args = (embeds, rows.slots, rows.index, rows.positions, rows.mask)
        logits, last = talker._graph(*args)
        want_logits, want_last = talker._step(*args)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last, want_last, rtol=1e-4, atol=1e-4)


def generate_speaking(
    loaded, tokens: int, frames: int, sampling: dict | None = None, **inputs
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """transformers' generate(), speaking, at most `tokens` text tokens and `frames` codec frames,
    greedy unless `sampling` gives generate()'s sampling arguments: (sequences, waveform, the codes
    [16, frames] code2wav was given)."""
    captured = {}
    hook = loaded.model.code2wav.register_forward_pre_hook(lambda m, args: captured.setdefault("codes", args[0]))
    try:
        sequences, wav = loaded.model.generate(
            **inputs,
            speaker=loaded.speaker,
            return_audio=True,
            **(sampling or dict(thinker_do_sample=False, talker_do_sample=False)),
            thinker_max_new_tokens=tokens,
            thinker_eos_token_id=loaded.thinker_eos_ids,
            thinker_min_new_tokens=1,
            talker_max_new_tokens=frames + 1,
        )
    finally:
        hook.remove()
    return sequences, wav, captured["codes"][0].cpu().numpy()


def generate_reference(loaded, inputs: dict, decoding, seed: int, tokens: int, frames: int, monkeypatch):
    """transformers' generate() on prepared inputs, sampled as `decoding` says, its
    torch.multinomial drawing from the engine's noise for the reply seeded `seed` (the stage told
    apart by its vocabulary; agent/engine/ops/sampling.py): (text ids without the end, codes
    [16, frames], waveform). Greedy stages never draw."""
    from agent.engine.ops.sampling import CODE_PREDICTOR, TALKER, THINKER, race_noise
    from agent.engine.runner.reference import generate_kwargs

    stages = {
        loaded.model.thinker.lm_head.out_features: THINKER,
        loaded.model.talker.codec_head.out_features: TALKER,
        loaded.model.talker.code_predictor.lm_head[0].out_features: CODE_PREDICTOR,
    }
    assert len(stages) == 3, "the stages must be told apart by their vocabularies"
    draws = {stage: 0 for stage in stages.values()}

    def multinomial(probs: torch.Tensor, num_samples: int = 1, **_) -> torch.Tensor:
        assert probs.shape[0] == 1 and num_samples == 1
        stage = stages[probs.shape[-1]]
        noise = race_noise(torch.tensor([seed]), torch.tensor([draws[stage]]), stage, probs.shape[-1])
        draws[stage] += 1
        return (probs / noise).argmax(-1, keepdim=True)

    sampling = {**generate_kwargs("thinker", decoding.thinker), **generate_kwargs("talker", decoding.talker)}
    monkeypatch.setattr(torch, "multinomial", multinomial)
    try:
        sequences, wav, codes = generate_speaking(loaded, tokens, frames, sampling, **inputs)
    finally:
        monkeypatch.undo()
    generated = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    text = [t for t in generated if t not in loaded.thinker_eos_ids]
    if decoding.code_predictor.do_sample:
        assert draws[CODE_PREDICTOR] == 15 * codes.shape[-1]  # the patch drew every residual code
    return text, codes, wav.reshape(-1).float().cpu().numpy()
