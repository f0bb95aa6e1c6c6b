"""Faults inside the model step end one reply with an error, never the engine or the others.

Pins, with the real engine thread driving the real streaming runner (tiny model, CPU):
- an exception (or a CUDA out-of-memory error, raised here on CPU) in one session's own
  end-of-turn work ends that session's reply with reason "error" naming it, while another
  session's reply in flight goes on to its end with every frame; the failed session's next
  turn is answered normally; the engine thread lives on;
- the same fault in a stage that batches sessions together ends the replies of that tick
  with an error; each session's next turn is answered; the engine thread lives on;
- a runner whose close of a session fails still leaves the engine without that session: its
  sink (the Session, in the agent) is no longer held, and the next session is served;
- a session the engine cannot open (every slot taken) is told so through its sink's
  on_open_failed, naming the cause, and is not held; its later commands are ignored; once a
  slot is free the next session opens and is answered; the engine logs it as one warning
  line, without a traceback (it is admission, not a fault);
- an error that escapes the engine loop itself (not a model error) is reported: the
  thread ends, `Engine.failed` says why, `alive` is False, and replies in flight get their
  error instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from agent.engine.api import AudioOut, ReplyDone, TextDelta
from agent.engine.loop import Engine
from agent.engine.runner.streaming import StreamingRunner

SYSTEM = "You are a helpful assistant."


class Sink:
    def __init__(self) -> None:
        self.open_failed: list[str] = []
        self.audio = 0
        self.text: list[str] = []
        self.done: list[ReplyDone] = []
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self.first_audio = asyncio.Event()

    def on_text(self, delta: TextDelta) -> None:
        self.text.append(delta.text)

    def on_audio(self, audio: AudioOut) -> None:
        self.audio += 1
        self.first_audio.set()

    def on_open_failed(self, message: str) -> None:
        self.open_failed.append(message)

    def on_done(self, done: ReplyDone) -> None:
        self.done.append(done)
        for n, fut in self._waiters:
            if len(self.done) >= n and not fut.done():
                fut.set_result(None)

    async def wait_done(self, n: int, timeout: float = 120) -> ReplyDone:
        if len(self.done) < n:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((n, fut))
            await asyncio.wait_for(fut, timeout)
        return self.done[n - 1]


def speech(seconds: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def say(engine: Engine, sid: str, seconds: float = 0.8) -> None:
    audio = speech(seconds)
    for i in range(0, len(audio), 1280):
        engine.append_audio(sid, audio[i : i + 1280])
    engine.begin_reply(sid, [])


@pytest.fixture
async def engine(loaded):
    built: list[StreamingRunner] = []

    def factory() -> StreamingRunner:
        # 3 s replies: long enough that a second session's turn starts while the first speaks.
        built.append(StreamingRunner(loaded, SYSTEM, max_reply_tokens=24, max_reply_seconds=3.0, audio_window_s=1.0))
        return built[0]

    engine = Engine(factory)
    await engine.start()
    engine.runner = built[0]  # the test's handle for injecting faults
    yield engine
    await engine.stop()


def _once(fn: Any, exc: BaseException, when: Any) -> Any:
    """fn, except that the first call for which when(args) holds raises exc instead."""
    fired: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not fired and when(args):
            fired.append(True)
            raise exc
        return fn(*args, **kwargs)

    return wrapped


def open_two(engine: Engine) -> tuple[StreamingRunner, Sink, Sink]:
    """The engine's runner (for injecting faults) and two open sessions, "a" and "b"."""
    a, b = Sink(), Sink()
    engine.open_session("a", a)
    engine.open_session("b", b)
    return engine.runner, a, b  # type: ignore[attr-defined]


FAULTS = [RuntimeError("injected fault"), torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")]


@pytest.mark.parametrize("fault", FAULTS, ids=["exception", "cuda_oom"])
async def test_a_fault_in_one_sessions_work_ends_only_its_reply(engine: Engine, fault: Exception) -> None:
    runner, a, b = open_two(engine)
    say(engine, "b")
    await asyncio.wait_for(b.first_audio.wait(), 60)
    # A's end of turn (its audio tail, its frames) fails once, while B speaks.
    runner.turns.reply_chunk = _once(runner.turns.reply_chunk, fault, lambda args: args[0] is runner.sessions.get("a"))
    say(engine, "a")
    failed = await a.wait_done(1)
    b_done = await b.wait_done(1)
    assert failed.reason == "error" and type(fault).__name__ in failed.stats["error"], failed
    assert b_done.reason in ("stop", "length"), b_done
    # B lost nothing: every frame its reply made reached its sink, and it outlived A's failure.
    assert b.audio == b_done.stats["audio_frames"] > 0
    assert a.done[0] is failed and not b.done[1:]
    # A's next turn is answered normally, on the same engine thread.
    say(engine, "a")
    again = await a.wait_done(2)
    assert again.reason in ("stop", "length") and again.stats["audio_frames"] > 0 and a.audio > 0
    assert engine.alive and engine.failed is None
    print(
        f"\nfault ({type(fault).__name__}): A error, B {b.audio} frames of {b_done.stats['audio_frames']}, "
        f"A's next turn {again.stats['audio_frames']} frames"
    )


@pytest.mark.parametrize("fault", FAULTS, ids=["exception", "cuda_oom"])
async def test_a_fault_in_a_batched_stage_ends_that_tick_and_turns_go_on(engine: Engine, fault: Exception) -> None:
    runner, a, b = open_two(engine)
    say(engine, "a")
    say(engine, "b")
    await asyncio.wait_for(a.first_audio.wait(), 60)
    runner.frames.render = _once(runner.frames.render, fault, lambda args: len(args[0]) > 0)
    first = [await a.wait_done(1), await b.wait_done(1)]
    assert "error" in [d.reason for d in first], first
    for sid in ("a", "b"):
        say(engine, sid)
    for sink in (a, b):
        again = await sink.wait_done(2)
        assert again.reason in ("stop", "length") and again.stats["audio_frames"] > 0, again
    assert engine.alive and engine.failed is None


async def test_a_failing_close_still_forgets_the_session(engine: Engine) -> None:
    runner: StreamingRunner = engine.runner  # type: ignore[attr-defined]
    a, b = Sink(), Sink()
    engine.open_session("a", a)
    runner.close_session = _once(
        runner.close_session,
        RuntimeError("injected close fault"),  # type: ignore[method-assign]
        lambda args: args[0] == "a",
    )
    held = weakref.ref(a)
    engine.close_session("a")
    del a
    engine.open_session("b", b)  # commands run in order: b's reply comes after a's close
    say(engine, "b")
    done = await b.wait_done(1)
    assert done.reason in ("stop", "length") and done.stats["audio_frames"] > 0, done
    assert held() is None, "the engine still holds the closed session's sink"
    assert engine.alive and engine.failed is None


async def test_a_session_without_a_slot_is_told_and_not_held(engine: Engine, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="agent.engine.core")
    runner: StreamingRunner = engine.runner  # type: ignore[attr-defined]
    slots = runner.sessions.slots.size
    sinks = [Sink() for _ in range(slots)]
    for i, sink in enumerate(sinks):
        engine.open_session(f"s{i}", sink)
    extra = Sink()
    engine.open_session("extra", extra)
    say(engine, "extra")  # ignored: the session was never opened
    for _ in range(200):  # bounded: 10 s
        if extra.open_failed:
            break
        await asyncio.sleep(0.05)
    assert len(extra.open_failed) == 1 and "slots are in use" in extra.open_failed[0], extra.open_failed
    assert not extra.done and extra.audio == 0
    told = [r for r in caplog.records if "extra" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in told] == [(logging.WARNING, None)], [r.getMessage() for r in told]
    assert engine.core is not None and "extra" not in engine.core.sinks, (
        "the engine holds the sink of a session it could not open"
    )

    engine.close_session("s0")
    late = Sink()
    engine.open_session("late", late)
    say(engine, "late")
    done = await late.wait_done(1)
    assert done.reason in ("stop", "length") and done.stats["audio_frames"] > 0, done
    assert not late.open_failed and engine.alive and engine.failed is None


class _Fatal(BaseException):
    """Not an Exception: what a model error handler does not catch (a bug in the loop itself)."""


async def test_a_dead_engine_thread_is_reported(engine: Engine) -> None:
    a = Sink()
    engine.open_session("a", a)
    say(engine, "a")
    await asyncio.wait_for(a.first_audio.wait(), 60)
    engine.core.step = _once(engine.core.step, _Fatal("loop broke"), lambda args: True)  # type: ignore[method-assign,union-attr]
    done = await a.wait_done(1)
    assert done.reason == "error" and "engine thread died" in done.stats["error"]
    await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 10)  # type: ignore[union-attr]
    assert not engine.alive and engine.failed is not None and "loop broke" in engine.failed
