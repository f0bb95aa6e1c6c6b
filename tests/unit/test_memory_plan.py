"""The memory plan: how many sessions of how many tokens a GPU holds beside the model.

Pins, with the real Qwen3-Omni-30B-A3B config counted on the meta device (no weights):
- the counts: 65.7 GiB of bf16 weights, 96 KiB (thinker) + 20 KiB (talker) of KV per token and
  session, ~3.6 GiB per session at 32768 tokens;
- an 80 GB H100 runs with no flags: 2 sessions at 32768 (two slots need no pad row; a third
  session does not fit); an H200 holds more
  (8, the cap, at 32768); the plan never needs more than is free;
- a 24 GB card is refused with a message naming --max-sessions and --context-limit;
- given flags that do not fit are refused, and the message's "lower --max-sessions to N or
  --context-limit to M" both fit; a given flag is kept and the other derived around it;
- transcription slots and the pad row are rows of every cache; the pad row only where the
  engine's graphs pad a batch (3 slots or more), by the wiring's own rule; a derived context is
  a tier (16384 for two sessions and a caption slot on an H100, where a third session then fits);
- a derived context is the tier (4096 x 2**k or 1.5 x that) under the longest that fits, so
  free memory 1 GiB apart inside one tier derives the same context (and compiled shapes) where
  the longest that fits differs by 2048 tokens;
- scripts/bench_engine.py sizes its slots to the largest batch it runs at --context tokens
  (4096): its largest run (10 sessions) fits an 80 GB H100, where the engine's defaults do not;
- on the CPU nothing is derived or refused: 8 sessions x 32768 tokens, exported on /metrics;
- the command line records which limits it left out, and `omni-agent` exits 2 with the plan's
  message when the plan is refused (a GPU faked by its free memory).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from agent import metrics
from agent.__main__ import main
from agent.config import Config
from agent.engine import memory_plan
from agent.engine.checkpoints.presets import REAL, preset_config
from agent.engine.memory_plan import LIMITS, MIN_CONTEXT, MemoryPlanError, context_tier, plan
from agent.engine.model_memory import H100_80G, H200, Card, GiB, KiB, ModelMemory
from agent.flags import add_serve_arguments, config_from_args


@pytest.fixture(scope="module")
def real() -> ModelMemory:
    return ModelMemory.from_config(preset_config(REAL), torch.bfloat16, max_reply_seconds=60.0)


def test_real_model_counts(real: ModelMemory) -> None:
    assert 65.5 * GiB < real.weights < 65.9 * GiB
    assert real.thinker_kv_token == 96 * KiB and real.talker_kv_token == 20 * KiB
    assert real.talker_extra_tokens == 751 + 16  # 60 s of 80 ms frames, one more, and the talker's margin
    assert 0 < real.slot_state < 8 * 2**20 and 0 < real.engine_weights < GiB
    assert 3.5 * GiB < real.kv_per_slot(32768) < 3.7 * GiB


def test_an_80gb_h100_runs_with_the_defaults(real: ModelMemory) -> None:
    p = plan(real, H100_80G.free)
    # Two sessions at the full context: two slots pad no batch, so no scratch row is counted.
    assert (p.sessions, p.context, p.rows) == (2, 32768, 2)
    assert p.need <= H100_80G.free and p.derived == LIMITS
    # A third would need its row and the pad row (a batch of 3 runs in the bucket of 4).
    with pytest.raises(MemoryPlanError, match="lower --max-sessions to 2"):
        plan(real, H100_80G.free, sessions=3, context=32768)


def test_the_pad_row_is_counted_where_the_engine_makes_one() -> None:
    """The plan counts a scratch row by the rule the engine's graph wiring makes it by: only
    where some batch of sessions is padded up to a bucket (3 of 1, 2, 4, 8, 16: not 1 or 2)."""
    from agent.engine.compile.wiring import Graphing
    from agent.engine.instruments.fake_graphs import fake_graph_config

    for slots in range(1, 10):
        engine = Graphing(fake_graph_config(), torch.device("cpu"), slots).kv_rows(slots)
        assert slots + memory_plan.pad_rows(slots) == engine == slots + (slots > 2), slots


def test_an_h200_holds_more(real: ModelMemory) -> None:
    h100, h200 = plan(real, H100_80G.free), plan(real, H200.free)
    assert (h200.sessions, h200.context) == (8, 32768)  # the cap, at the full context
    assert h200.sessions * h200.context > h100.sessions * h100.context
    assert h200.need <= H200.free


def test_a_24gb_card_is_refused_naming_the_flags(real: ModelMemory) -> None:
    with pytest.raises(MemoryPlanError) as refused:
        plan(real, Card("24 GB", 23 * GiB).free)
    message = str(refused.value)
    assert "--max-sessions" in message and "--context-limit" in message and "65.8 GiB" in message


def test_given_flags_that_do_not_fit_are_refused_with_remedies_that_fit(real: ModelMemory) -> None:
    with pytest.raises(MemoryPlanError) as refused:
        plan(real, H100_80G.free, sessions=9, context=32768)
    message = str(refused.value)
    assert message.startswith("9 sessions x 32768 tokens need ") and "GiB free" in message
    remedy = re.search(r"lower --max-sessions to (\d+) or --context-limit to (\d+)", message)
    sessions, context = map(int, remedy.groups())
    assert plan(real, H100_80G.free, sessions=sessions, context=32768).sessions == sessions
    assert plan(real, H100_80G.free, sessions=9, context=context).context == context
    with pytest.raises(MemoryPlanError):
        plan(real, H100_80G.free, sessions=sessions + 1, context=32768)


def test_a_given_flag_is_kept_and_the_other_derived_around_it(real: ModelMemory) -> None:
    four = plan(real, H100_80G.free, sessions=4)
    assert four.sessions == 4 and MIN_CONTEXT <= four.context < plan(real, H100_80G.free).context
    assert four.derived == ("context_limit",) and four.need <= H100_80G.free
    short = plan(real, H100_80G.free, context=8192)
    assert short.context == 8192 and short.sessions > 2 and short.derived == ("max_sessions",)
    with pytest.raises(MemoryPlanError, match="lower --context-limit to"):
        plan(real, H100_80G.free, context=131072)
    with pytest.raises(MemoryPlanError, match="lower --max-sessions to"):
        plan(real, H100_80G.free, sessions=30)


def test_transcription_slots_are_rows_of_every_cache(real: ModelMemory) -> None:
    alone, with_captions = plan(real, H100_80G.free), plan(real, H100_80G.free, transcription=1)
    assert with_captions.rows == with_captions.sessions + 1 + 1  # 3 slots: the pad row too
    assert with_captions.kv == with_captions.rows * real.kv_per_slot(with_captions.context) + real.fixed_state
    # The caption viewer's slot is paid for with context: two sessions' longest context (21504
    # tokens) rounds down to the 16384 tier, and at that tier a third session fits as well.
    assert (alone.sessions, alone.context) == (2, 32768)
    assert (with_captions.sessions, with_captions.context) == (3, 16384)
    assert with_captions.need <= H100_80G.free


def test_context_tiers_are_powers_of_two_and_their_one_and_a_half() -> None:
    tiers = {tokens: context_tier(tokens) for tokens in (4095, 4096, 6143, 6144, 8192, 12287, 12288, 20000, 32767)}
    assert tiers == {
        4095: 0,
        4096: 4096,
        6143: 4096,
        6144: 6144,
        8192: 8192,
        12287: 8192,
        12288: 12288,
        20000: 16384,
        32767: 24576,
    }
    assert context_tier(98303) == 65536 and context_tier(98304) == 98304  # the tiers go on past 32768


def test_a_little_less_free_memory_derives_the_same_context(real: ModelMemory) -> None:
    """Three sessions on an H100, and on the same card with 1 GiB less free: the longest context
    that fits differs (what a refusal suggests for --context-limit, in steps of 1024), the derived
    one does not."""
    frees = (H100_80G.free, H100_80G.free - GiB)
    longest = []
    for free in frees:
        with pytest.raises(MemoryPlanError) as refused:
            plan(real, free, sessions=3, context=32768)
        longest.append(int(re.search(r"--context-limit to (\d+)", str(refused.value)).group(1)))
    assert longest == [21504, 19456]
    derived = [plan(real, free, sessions=3) for free in frees]
    assert [p.context for p in derived] == [16384, 16384]
    assert all(p.need <= free for p, free in zip(derived, frees))


def test_the_engine_bench_sizes_its_slots_to_its_largest_batch(real: ModelMemory) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_engine import BENCH_CONTEXT, bench_config

    sized = bench_config(Config(max_transcription_sessions=1), [1, 4, 10], BENCH_CONTEXT)
    assert (sized.engine_slots, sized.context_limit) == (10, 4096)
    assert bench_config(Config(), [2], 8192).engine_slots == 2
    assert bench_config(Config(), [2], 8192, profile_ticks=8).engine_slots == 4  # it profiles batches 1 and 4
    # The largest run fits an 80 GB H100; the engine's own 8 x 32768 tokens do not.
    assert plan(real, H100_80G.free, sessions=sized.max_sessions, context=sized.context_limit).need <= H100_80G.free
    with pytest.raises(MemoryPlanError):
        plan(real, H100_80G.free, sessions=Config().max_sessions, context=Config().context_limit)


def test_the_cpu_keeps_the_defaults(real: ModelMemory, tiny_model_dir: Path) -> None:
    cpu = plan(real, None)  # the real model on the CPU: no free memory to size from
    assert (cpu.sessions, cpu.context, cpu.derived) == (8, 32768, ())
    config = Config(model=str(tiny_model_dir), device="cpu", sized_from_memory=LIMITS)
    sized, p = memory_plan.size_limits(config)
    assert (sized.max_sessions, sized.context_limit) == (8, 32768) and p.free is None and p.derived == ()
    assert metrics.REGISTRY.get_sample_value("agent_memory_plan_sessions") == 8
    assert metrics.REGISTRY.get_sample_value("agent_memory_plan_context_tokens") == 32768
    assert metrics.REGISTRY.get_sample_value("agent_memory_plan_bytes", {"part": "weights"}) == p.weights


def test_the_command_line_records_the_limits_it_left_out() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert default.sized_from_memory == LIMITS and (default.max_sessions, default.context_limit) == (8, 32768)
    given = config_from_args(parser.parse_args(["--max-sessions", "3"]))
    assert given.sized_from_memory == ("context_limit",) and given.max_sessions == 3
    both = config_from_args(parser.parse_args(["--max-sessions", "3", "--context-limit", "4096"]))
    assert both.sized_from_memory == () and (both.max_sessions, both.context_limit) == (3, 4096)


def test_serve_exits_with_the_plans_message_when_it_cannot_fit(tiny_model_dir: Path, monkeypatch, capsys) -> None:
    """A GPU faked by its free memory: the tiny model with 2 GiB free leaves no room for the reserve.
    No NVML (an import that fails), so the plan reads torch's figure, as it does without the `gpu`
    extra (tests/unit/test_memory_plan_nvml.py fakes NVML instead)."""
    import sys

    from agent.engine.checkpoints import model

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(model, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 2 * GiB))
    code = main(["serve", "--model", str(tiny_model_dir), "--ice-host", "127.0.0.1", "--fallback-model", "none"])
    assert code == 2
    assert "no --max-sessions or --context-limit fits on this GPU" in capsys.readouterr().err
