"""Continuous batching in StreamingRunner: many sessions per tick, exactly as if each were alone.

Pins, on the tiny model under greedy decoding:
- three sessions with different audio lengths, started at different ticks (one joins while the
  first is mid-reply, one speaks while the others reply so its audio is prefilled between their
  frames, one is cancelled mid-reply), with end-of-turn prefills split into 16-token chunks,
  give the same text ids, the same 16 codec codes per frame and the same waveform (1e-4) as
  each session run alone in its own runner; and the ticks really were batched (3 rows);
- scheduling: a new reply's first frame comes out in a tick of its own, before the next frames
  of sessions that have audio buffered (sessions under the low-water mark share that tick, after
  it in the output); a session over the fill ceiling yields its tick to one near underrun,
  and with one row per tick the least-buffered session gets it; speaking sessions under the
  ceiling step together in one due tick, and while every one is over the high-water mark the
  runner says how long a step can wait (idle_s), until the first one is due;
- the pure policy (plan_tick, idle_s) and the engine-side playout estimate (PlayoutClock);
- SlotCode2Wav (per-slot conv states, sessions at different frames in one call) equals the
  one-shot code2wav decode, and its first frame yields 1920 - 555 samples;
- a reply cancelled while its prefill is still in chunks rolls the turn back: the next
  begin_reply answers the same turn exactly as if the cancelled one had never begun;
- session slots: max_sessions is enforced and a closed session's slot is reused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.code2wav import small_code2wav
from support.engine_drive import PIECE, SYSTEM, make_audio, speak
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from agent.engine.api import AudioOut, ReplyDone, StageTime
from agent.engine.codecs.code2wav import SlotCode2Wav
from agent.engine.runner.scheduler import ReplyView, SchedulerConfig, idle_s, plan_tick
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.state.reply import PlayoutClock

OPTIONS = dict(max_reply_tokens=12, max_reply_seconds=1.6, audio_window_s=1.0, record=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def frames_of(outputs, sid: str) -> int:
    return sum(isinstance(o, AudioOut) and o.session_id == sid for o in outputs)


def alone(loaded, sid: str, audio: np.ndarray, cancel_after: int | None = None):
    """The session by itself in its own runner: one row per tick."""
    runner = StreamingRunner(loaded, SYSTEM, **OPTIONS)
    runner.open_session(sid)
    speak(runner, sid, audio)
    runner.begin_reply(sid, [])
    frames = 0
    while runner.has_work():
        frames += frames_of(runner.step(), sid)
        if frames == cancel_after:
            runner.cancel_reply(sid)
    return runner.records[sid]


def test_batched_ticks_equal_each_session_alone(loaded):
    audio = {"a": make_audio(1.3, 220, 1), "b": make_audio(2.2, 330, 2), "c": make_audio(1.6, 180, 3)}
    clock = FakeClock()
    runner = StreamingRunner(loaded, SYSTEM, schedule=SchedulerConfig(prefill_chunk_tokens=16), clock=clock, **OPTIONS)
    for sid in audio:
        runner.open_session(sid)
    system_length = runner.sessions["c"].thinker.length
    speak(runner, "a", audio["a"])
    runner.begin_reply("a", [])
    outputs, rows, c_fed, c_prefilled_early = [], [], 0, False
    for tick in range(200):
        if tick == 3:  # b joins while a is mid-reply
            speak(runner, "b", audio["b"])
            runner.begin_reply("b", [])
        if tick >= 1 and c_fed < len(audio["c"]):  # c speaks while a and b reply
            runner.append_audio("c", audio["c"][c_fed : c_fed + PIECE])
            c_fed += PIECE
            if c_fed >= len(audio["c"]):
                c_prefilled_early = runner.sessions["c"].thinker.length > system_length
                runner.begin_reply("c", [])
        if frames_of(outputs, "b") == 16:
            runner.cancel_reply("b")
        step = runner.step()
        outputs += step
        rows += [o.batch for o in step if isinstance(o, StageTime) and o.stage == "code2wav"]
        clock.now += 0.04  # slower than the audio made: buffers grow, audio prefill gets ticks
        if not runner.has_work() and c_fed >= len(audio["c"]):
            break
    done = {o.session_id: o.reason for o in outputs if isinstance(o, ReplyDone)}
    assert done["b"] == "cancelled" and done["a"] != "cancelled" and done["c"] != "cancelled"
    assert max(rows) == 3, "the three sessions never shared a tick"
    assert c_prefilled_early, "c's audio was not prefilled while the others replied"

    expected = {
        "a": alone(loaded, "a", audio["a"]),
        "b": alone(loaded, "b", audio["b"], cancel_after=16),
        "c": alone(loaded, "c", audio["c"]),
    }
    for sid, ref in expected.items():
        got = runner.records[sid]
        assert got.text_ids == ref.text_ids, sid
        assert got.codes.shape == ref.codes.shape and got.codes.shape[1] > 0, sid
        np.testing.assert_array_equal(got.codes, ref.codes, err_msg=sid)
        assert got.wav.shape == ref.wav.shape
        np.testing.assert_allclose(got.wav, ref.wav, atol=1e-4, rtol=0, err_msg=sid)
    assert expected["b"].codes.shape[1] == 16 < expected["a"].codes.shape[1]


def test_cancel_during_a_chunked_prefill_rolls_the_turn_back(loaded):
    audio = make_audio(1.4, 260, 4)
    runner = StreamingRunner(loaded, SYSTEM, schedule=SchedulerConfig(prefill_chunk_tokens=4), **OPTIONS)
    runner.open_session("s")
    speak(runner, "s", audio)
    before = runner.sessions["s"].thinker.length
    runner.begin_reply("s", [])
    assert frames_of(runner.step(), "s") == 0  # one chunk in: no audio yet
    assert runner.sessions["s"].thinker.length == before + 4
    runner.cancel_reply("s")
    done = runner.step()[-1]
    assert isinstance(done, ReplyDone) and done.reason == "cancelled" and done.text == ""
    # The turn is the one being spoken again (its final audio tokens prefill as audio again).
    assert runner.sessions["s"].turn.audio_open and not runner.sessions["s"].turn.pcm
    runner.begin_reply("s", [])
    while runner.has_work():
        runner.step()
    ref = alone(loaded, "s", audio)
    got = runner.records["s"]
    assert got.text_ids == ref.text_ids
    np.testing.assert_array_equal(got.codes, ref.codes)
    np.testing.assert_allclose(got.wav, ref.wav, atol=1e-4, rtol=0)


def start_speaking(runner: StreamingRunner, clock: FakeClock, sids: list[str], ticks: int) -> None:
    for i, sid in enumerate(sids):
        runner.open_session(sid)
        speak(runner, sid, make_audio(1.0, 200 + 60 * i, 20 + i))
        runner.begin_reply(sid, [])
    for _ in range(ticks):  # the clock stands still: every tick adds 80 ms of buffer
        runner.step()


def test_new_reply_first_frame_comes_before_the_others_next_frames(loaded):
    clock = FakeClock()
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=24, max_reply_seconds=4.0, clock=clock)
    start_speaking(runner, clock, ["a", "b"], ticks=4)
    runner.open_session("c")
    speak(runner, "c", make_audio(0.8, 400, 30))
    runner.begin_reply("c", [])
    first = runner.step()
    assert frames_of(first, "c") == 1
    assert frames_of(first, "a") == frames_of(first, "b") == 0  # buffered: they wait one tick
    after = runner.step()
    assert frames_of(after, "a") == frames_of(after, "b") == frames_of(after, "c") == 1

    # Under the low-water mark a session cannot wait: it shares the tick, after the new reply.
    clock.now += 10.0
    runner.open_session("d")
    speak(runner, "d", make_audio(0.7, 500, 31))
    runner.begin_reply("d", [])
    tick = runner.step()
    order = [o.session_id for o in tick if isinstance(o, AudioOut)]
    assert order[0] == "d" and set(order) == {"a", "b", "c", "d"}


def test_speaking_sessions_step_together_and_wait_while_ahead(loaded):
    clock = FakeClock()
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=48, max_reply_seconds=4.0, clock=clock)
    start_speaking(runner, clock, ["a"], ticks=8)  # a: 0.64 s ahead
    start_speaking(runner, clock, ["b"], ticks=16)  # b: 1.28 s ahead, a: 1.28 + 0.64 s (its ticks went on)
    buffers = {p.session_id: p.buffer_s for p in runner.playout()}
    assert buffers["a"] > buffers["b"] > 1.0
    assert runner.idle_s() == pytest.approx(buffers["b"] - 1.0, abs=1e-6)  # until b is due
    clock.now += buffers["b"] - 0.9  # b is due, a is still over the mark: both step in one tick
    assert runner.idle_s() == 0.0
    tick = runner.step()
    assert frames_of(tick, "a") == frames_of(tick, "b") == 1
    assert [t.batch for t in tick if isinstance(t, StageTime) and t.stage == "code_predictor"] == [2, 2]


def test_far_ahead_session_yields_to_one_near_underrun(loaded):
    clock = FakeClock()
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=48,
        max_reply_seconds=4.0,
        clock=clock,
        schedule=SchedulerConfig(batch_fill_s=1.0),
    )
    start_speaking(runner, clock, ["far"], ticks=16)  # ~1.2 s of audio made in no time
    runner.open_session("near")
    speak(runner, "near", make_audio(0.8, 300, 40))
    runner.begin_reply("near", [])
    runner.step()  # near's first frame
    clock.now += 0.1  # near is now close to underrun, far still over the high-water mark
    buffers = {p.session_id: p.buffer_s for p in runner.playout()}
    assert buffers["far"] > 1.0 and buffers["near"] < 0.16
    for _ in range(3):
        tick = runner.step()
        assert frames_of(tick, "near") == 1 and frames_of(tick, "far") == 0

    # One row per tick: the least buffered session gets it, whichever it is.
    runner.schedule = SchedulerConfig(max_batch=1)
    clock.now += 1.0
    buffers = {p.session_id: p.buffer_s for p in runner.playout()}
    served = [o.session_id for o in runner.step() if isinstance(o, AudioOut)]
    assert served == [min(buffers, key=buffers.get)]


def test_plan_tick_rules():
    config = SchedulerConfig(low_water_s=0.16, high_water_s=1.0, max_batch=3)
    view = lambda sid, buffer, first=False, started=0.0: ReplyView(sid, started, first, buffer)  # noqa: E731
    plan = plan_tick(
        [
            view("new2", None, True, 2.0),
            view("new1", None, True, 1.0),
            view("low", 0.05),
            view("ok", 0.5),
            view("lower", -0.2),
        ],
        config,
    )
    assert plan.first == ["new1", "new2"] and plan.decode == ["lower"] and not plan.audio_prefill
    plan = plan_tick([view("far", 2.0), view("ok", 0.5), view("low", 0.1), view("text", None)], config)
    assert plan.decode == ["low", "text", "ok"] and not plan.audio_prefill
    # A due tick fills its rows with every speaking session under the fill ceiling (3 s) ...
    plan = plan_tick([view("far", 2.0), view("ok", 0.5)], config)
    assert plan.decode == ["ok", "far"] and plan.audio_prefill
    plan = plan_tick([view("farther", 3.5), view("ok", 0.5)], config)
    assert plan.decode == ["ok"]  # ... and no one over it
    # No one due: a tick for other work steps no one; one asked for with nothing to do steps all.
    assert plan_tick([view("far", 2.0), view("ok", 1.5)], config, other_work=True).decode == []
    assert plan_tick([view("far", 2.0)], config).decode == ["far"]


def test_idle_s_counts_down_to_the_first_session_due():
    config = SchedulerConfig(low_water_s=0.16, high_water_s=1.0)
    view = lambda sid, buffer, first=False, spec=False: ReplyView(sid, 0.0, first, buffer, speculative=spec)  # noqa: E731
    assert idle_s([view("a", 1.7), view("b", 1.25)], config) == pytest.approx(0.25)
    assert idle_s([view("a", 1.7), view("b", 0.9)], config) == 0.0
    assert idle_s([view("a", 1.7), view("new", None, first=True)], config) == 0.0
    assert idle_s([view("a", 1.7), view("text", None)], config) == 0.0
    assert idle_s([view("a", 1.7), view("spec", None, spec=True)], config) == 0.0
    assert idle_s([], config) == float("inf")


def test_playout_clock_follows_the_track_through_an_underrun():
    clock = PlayoutClock()
    assert clock.buffer_s(0.0) is None
    clock.add(10.0, 0.08)
    clock.add(10.01, 0.08)
    assert clock.buffer_s(10.05) == pytest.approx(0.11)
    clock.add(11.0, 0.08)  # the track ran dry at 10.16 and resumes with this frame
    assert clock.buffer_s(11.0) == pytest.approx(0.08)
    assert clock.produced_s == pytest.approx(0.24)


@pytest.fixture(scope="module")
def code2wav() -> Qwen3OmniMoeCode2Wav:
    return small_code2wav()


def test_slot_code2wav_equals_one_shot_for_rows_at_different_frames(code2wav):
    generator = torch.Generator().manual_seed(1)
    frames = 90  # > the 72-frame window: the ring must evict
    codes = torch.randint(0, 256, (3, 16, frames), generator=generator)
    with torch.no_grad():
        expected = code2wav(codes)[:, 0]
    stream = SlotCode2Wav(code2wav, slots=4)
    starts, slots = [0, 5, 20], [3, 1, 0]  # rows join at different ticks, slots out of order
    pieces: list[list[torch.Tensor]] = [[], [], []]
    with torch.no_grad():
        for tick in range(starts[-1] + frames):
            rows = [i for i in range(3) if starts[i] <= tick < starts[i] + frames]
            for i in rows:
                if tick == starts[i]:
                    stream.reset(slots[i])
            batch = torch.stack([codes[i, :, tick - starts[i]] for i in rows]).unsqueeze(-1)
            for i, wav in zip(rows, stream.push([slots[i] for i in rows], batch)):
                pieces[i].append(wav)
    assert [p.shape[0] for p in pieces[0][:2]] == [1920 - 555, 1920]
    for i in range(3):
        torch.testing.assert_close(torch.cat(pieces[i]), expected[i], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunks", [[1], [2], [7], [1, 2, 7, 3, 5]])
def test_slot_code2wav_equals_one_shot_for_any_chunking(code2wav, chunks):
    """The production code2wav path, pushed several frames at a time (cycling `chunks`)."""
    generator = torch.Generator().manual_seed(2)
    frames = 90
    codes = torch.randint(0, 256, (1, 16, frames), generator=generator)
    with torch.no_grad():
        expected = code2wav(codes)[0, 0]
    stream = SlotCode2Wav(code2wav, slots=2, max_frames_per_push=max(chunks))
    stream.reset(1)
    pieces, at, k = [], 0, 0
    with torch.no_grad():
        while at < frames:
            n = min(chunks[k % len(chunks)], frames - at)
            pieces += stream.push([1], codes[:, :, at : at + n])
            at, k = at + n, k + 1
    assert pieces[0].shape[0] == chunks[0] * 1920 - 555
    torch.testing.assert_close(torch.cat(pieces), expected, rtol=0, atol=1e-5)


def test_session_slots_are_bounded_and_reused(loaded):
    runner = StreamingRunner(loaded, SYSTEM, max_sessions=2)
    runner.open_session("a")
    runner.open_session("b")
    with pytest.raises(RuntimeError, match="slots"):
        runner.open_session("c")
    slot = runner.sessions["a"].slot
    runner.close_session("a")
    runner.open_session("c")
    assert runner.sessions["c"].slot == slot
