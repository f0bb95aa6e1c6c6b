"""Priority classes (high, normal): the scheduler, admission and the session's priority field.

Pins: plan_tick starts high-priority first-audio replies before earlier normal ones, and among
speaking sessions serves urgent (under low water) ones first, high before normal, while a
high-priority session with audio to spare never takes the row of a normal one about to run dry;
with equal priorities the order is the old one. Admission keeps `reserved` of `max_sessions` for
high priority (normal refused as "reserved", high admitted up to the limit, then "capacity").
The session's omni.priority defaults to normal, an offer's ?priority= sets it, bad values and a
change of an ephemeral key's priority are refused with a param. On the engine, saturated (more
replies ending together than one tick serves) with the tiny model: high-priority replies get
their first audio before the normal ones that ended earlier, and their mean TTFA is well under
the normal ones' (a ratio from one run); with priorities unset the order reverses (deadline).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.engine_drive import SYSTEM

from agent.config import Config
from agent.engine.api import AudioOut
from agent.engine.runner.scheduler import ReplyView, SchedulerConfig, plan_tick
from agent.engine.runner.streaming import StreamingRunner
from agent.gate import priority
from agent.realtime import session_config


def view(sid: str, buffer: float | None, first: bool = False, started: float = 0.0, prio: int = 0) -> ReplyView:
    return ReplyView(sid, started, first, buffer, prio)


def test_first_audio_high_before_earlier_normal():
    config = SchedulerConfig(max_batch=2)
    plan = plan_tick(
        [view("n1", None, True, 1.0), view("n2", None, True, 2.0), view("h", None, True, 3.0, prio=1)], config
    )
    assert plan.first == ["h", "n1"]
    same = plan_tick([view("n1", None, True, 1.0), view("n2", None, True, 2.0), view("h", None, True, 3.0)], config)
    assert same.first == ["n1", "n2"]  # equal priority: earliest end of turn first, as before


def test_speaking_rows_urgent_first_then_priority():
    config = SchedulerConfig(low_water_s=0.16, high_water_s=1.0, max_batch=2)
    # Two urgent sessions and one row each: the high one gets it although it has more buffered.
    plan = plan_tick(
        [view("n", 0.02, prio=0), view("h", 0.1, prio=1), view("far", 0.5, prio=1)], SchedulerConfig(max_batch=1)
    )
    assert plan.decode == ["h"]
    # A high session with audio to spare does not take the row of a normal one about to run dry.
    plan = plan_tick([view("h", 0.5, prio=1), view("n", 0.05)], SchedulerConfig(max_batch=1))
    assert plan.decode == ["n"]
    # Among non-urgent sessions the high one goes first.
    plan = plan_tick([view("n", 0.3), view("h", 0.6, prio=1), view("n2", 0.4)], config)
    assert plan.decode == ["h", "n"]
    # First-audio ticks: only urgent speaking sessions join, high first.
    plan = plan_tick(
        [view("new", None, True), view("n", 0.05), view("h", 0.1, prio=1), view("ok", 0.5, prio=1)],
        SchedulerConfig(max_batch=2),
    )
    assert plan.first == ["new"] and plan.decode == ["h"]


def test_reserved_admission():
    counts = lambda high, normal: {priority.HIGH: high, priority.NORMAL: normal}  # noqa: E731
    assert priority.refusal(counts(0, 2), priority.NORMAL, max_sessions=4, reserved=1) is None
    assert priority.refusal(counts(0, 3), priority.NORMAL, max_sessions=4, reserved=1) == "reserved"
    assert priority.refusal(counts(0, 3), priority.HIGH, max_sessions=4, reserved=1) is None
    assert priority.refusal(counts(1, 3), priority.HIGH, max_sessions=4, reserved=1) == "capacity"
    assert priority.refusal(counts(1, 3), priority.NORMAL, max_sessions=4, reserved=1) == "capacity"
    # High sessions may use the normal slots too; nothing reserved: first come, first served.
    assert priority.refusal(counts(3, 0), priority.NORMAL, max_sessions=4, reserved=1) == "reserved"
    assert priority.refusal(counts(0, 3), priority.NORMAL, max_sessions=4, reserved=0) is None


def test_session_priority_field():
    config = Config()
    base = session_config.default_session(config)
    assert session_config.priority_of(base) == "normal"
    high = session_config.offer_priority(base, "high", fixed=None)
    assert session_config.priority_of(high) == "high" and session_config.priority_of(base) == "normal"
    assert session_config.priority_of(session_config.merge(base, {"omni": {"priority": "high"}})) == "high"
    with pytest.raises(session_config.ConfigError) as bad:
        session_config.offer_priority(base, "urgent", fixed=None)
    assert bad.value.param == "priority"
    with pytest.raises(session_config.ConfigError) as bad:
        session_config.merge(base, {"omni": {"priority": 3}})
    assert bad.value.param == "session.omni.priority"
    with pytest.raises(session_config.ConfigError) as fixed:  # an ephemeral key said normal
        session_config.offer_priority(base, "high", fixed="normal")
    assert fixed.value.param == "priority"
    assert session_config.priority_of({"type": "realtime"}) == "normal"  # a key minted before priorities


def saturated_run(loaded, with_priority: bool) -> tuple[dict[str, float], dict[str, int]]:
    """Six replies end in the same tick, one row per tick: TTFA (s) and first-audio tick per session.
    Normal sessions end their turns first, so deadline order alone would serve them first."""
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_sessions=6,
        max_reply_tokens=6,
        max_reply_seconds=0.8,
        audio_window_s=1.0,
        schedule=SchedulerConfig(max_batch=1, prefill_chunk_tokens=64),
    )
    sids = ["n0", "n1", "n2", "h0", "h1", "h2"]
    rng = np.random.default_rng(0)
    for sid in sids:
        runner.open_session(sid)
        if with_priority and sid.startswith("h"):
            runner.set_priority(sid, priority.RANK[priority.HIGH])
        audio = (0.1 * rng.standard_normal(16000 // 2)).astype(np.float32)
        for i in range(0, len(audio), 1280):
            runner.append_audio(sid, audio[i : i + 1280])
    began: dict[str, float] = {}
    for sid in sids:
        began[sid] = time.perf_counter()
        runner.begin_reply(sid, [])
    ttfa: dict[str, float] = {}
    tick_of: dict[str, int] = {}
    for tick in range(200):
        outputs = runner.step()
        now = time.perf_counter()
        for out in outputs:
            if isinstance(out, AudioOut) and out.session_id not in ttfa:
                ttfa[out.session_id] = now - began[out.session_id]
                tick_of[out.session_id] = tick
        if len(ttfa) == len(sids):
            break
    assert set(ttfa) == set(sids)
    return ttfa, tick_of


def test_saturated_engine_serves_high_priority_first(loaded):
    ttfa, ticks = saturated_run(loaded, with_priority=True)
    high = [ttfa[s] for s in ttfa if s.startswith("h")]
    normal = [ttfa[s] for s in ttfa if s.startswith("n")]
    assert max(ticks[s] for s in ticks if s.startswith("h")) < min(ticks[s] for s in ticks if s.startswith("n"))
    ratio = np.mean(high) / np.mean(normal)
    assert ratio < 0.75, f"high/normal TTFA ratio {ratio:.2f}"
    # Control: without priorities the earlier (normal) turns are answered first.
    _, plain = saturated_run(loaded, with_priority=False)
    assert max(plain[s] for s in plain if s.startswith("n")) < min(plain[s] for s in plain if s.startswith("h"))
