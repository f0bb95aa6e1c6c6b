"""The engine thread's contract, with a scripted runner standing in for the model.

Pins: the runner is built and driven only on the engine thread; outputs reach each
session's sink on the asyncio loop thread, in order; a failing step ends the replies in
flight with an error and the engine keeps serving; a full inbox raises EngineBusy instead
of blocking the loop; a model that fails to load makes start() raise; Engine.send runs a
typed command's runner method in order on the engine thread and hands back its result or exception.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from agent.engine.api import AudioOut, EngineBusy, Output, ReplyDone, StageTime, TextDelta
from agent.engine.commands import SessionCommand, TruncateReply
from agent.engine.loop import Engine


class ScriptedRunner:
    """Replies with one text token and one audio frame per appended chunk, then done."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.audio: dict[str, int] = {}
        self.pending: list[str] = []
        self.fail_next = False

    def _mark(self) -> None:
        self.threads.add(threading.current_thread().name)

    def open_session(self, sid: str) -> None:
        self._mark()
        self.audio[sid] = 0

    def close_session(self, sid: str) -> None:
        self._mark()
        self.audio.pop(sid, None)

    def append_audio(self, sid: str, pcm: np.ndarray) -> None:
        self._mark()
        self.audio[sid] += 1

    def discard_turn(self, sid: str) -> None:
        self.audio[sid] = 0

    def begin_reply(self, sid: str, images: list, text_only: bool = False) -> None:
        self._mark()
        self.pending.append(sid)

    def cancel_reply(self, sid: str) -> None:
        if sid in self.pending:
            self.pending.remove(sid)

    def has_work(self) -> bool:
        return bool(self.pending)

    def idle_s(self) -> float:
        return 0.0

    def step(self) -> list[Output]:
        self._mark()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("kernel exploded")
        sid = self.pending.pop(0)
        n = self.audio[sid]
        return [
            StageTime("generate", 0.001),
            TextDelta(sid, f"heard {n}"),
            AudioOut(sid, np.full(1920, n, np.int16)),
            ReplyDone(sid, "stop"),
        ]


class Sink:
    def __init__(self) -> None:
        self.got: list[tuple[str, object, str]] = []
        self.errors: list[str] = []  # each done's error (stats["error"]; "" when none)
        self.done = asyncio.Event()

    def on_text(self, d: TextDelta) -> None:
        self.got.append(("text", d.text, threading.current_thread().name))

    def on_audio(self, a: AudioOut) -> None:
        self.got.append(("audio", int(a.pcm[0]), threading.current_thread().name))

    def on_done(self, d: ReplyDone) -> None:
        self.got.append(("done", d.reason, threading.current_thread().name))
        self.errors.append(d.stats.get("error", ""))
        self.done.set()


async def test_outputs_reach_sinks_on_the_loop_thread_in_order() -> None:
    runner = ScriptedRunner()
    engine = Engine(lambda: runner)
    await engine.start()
    a, b = Sink(), Sink()
    engine.open_session("a", a)
    engine.open_session("b", b)
    for _ in range(3):
        engine.append_audio("a", np.zeros(1280, np.float32))
    engine.append_audio("b", np.zeros(1280, np.float32))
    engine.begin_reply("a", [])
    engine.begin_reply("b", [])
    await asyncio.wait_for(asyncio.gather(a.done.wait(), b.done.wait()), 5)
    await engine.stop()

    loop_thread = threading.current_thread().name
    assert [g[:2] for g in a.got] == [("text", "heard 3"), ("audio", 3), ("done", "stop")]
    assert [g[:2] for g in b.got] == [("text", "heard 1"), ("audio", 1), ("done", "stop")]
    assert {g[2] for g in a.got + b.got} == {loop_thread}
    assert runner.threads == {"engine"}


async def test_failed_step_ends_reply_with_error_and_engine_survives() -> None:
    runner = ScriptedRunner()
    engine = Engine(lambda: runner)
    await engine.start()
    s = Sink()
    engine.open_session("s", s)
    runner.fail_next = True
    engine.begin_reply("s", [])
    await asyncio.wait_for(s.done.wait(), 5)
    assert s.got[-1][:2] == ("done", "error") and "kernel exploded" in s.errors[-1]
    s.done.clear()
    engine.append_audio("s", np.zeros(1280, np.float32))
    engine.begin_reply("s", [])
    await asyncio.wait_for(s.done.wait(), 5)
    await engine.stop()
    assert s.got[-1][:2] == ("done", "stop")


async def test_full_inbox_raises_instead_of_blocking() -> None:
    gate = threading.Event()

    def slow_factory() -> ScriptedRunner:
        gate.wait(5)  # hold the thread so the inbox cannot drain
        return ScriptedRunner()

    engine = Engine(slow_factory, inbox_size=4)
    start = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.05)
    for _ in range(4):
        engine.append_audio("x", np.zeros(1280, np.float32))
    with pytest.raises(EngineBusy):
        engine.append_audio("x", np.zeros(1280, np.float32))
    gate.set()
    await start
    await engine.stop()


async def test_load_failure_surfaces_from_start() -> None:
    def broken() -> ScriptedRunner:
        raise OSError("no such checkpoint")

    engine = Engine(broken)
    with pytest.raises(OSError, match="no such checkpoint"):
        await engine.start()
    assert not engine.ready


async def test_fallback_mode_routes_to_the_fallback_runner_and_errors_stay_local() -> None:
    primary, fallback = ScriptedRunner(), ScriptedRunner()
    engine = Engine(lambda: primary, fallback_factory=lambda: fallback)
    await engine.start()
    a, b = Sink(), Sink()
    engine.open_session("a", a)
    engine.open_session("b", b)
    engine.append_audio("a", np.zeros(1280, np.float32))
    engine.append_audio("b", np.zeros(1280, np.float32))
    fallback.fail_next = True
    engine.begin_reply("a", [], mode="fallback", history=(("assistant", "hi"),))
    engine.begin_reply("b", [], mode="audio")
    await asyncio.wait_for(asyncio.gather(a.done.wait(), b.done.wait()), 5)
    await engine.stop()
    assert [g[:2] for g in a.got] == [("done", "error")]  # the fallback failed: only a hears it
    assert [g[:2] for g in b.got] == [("text", "heard 1"), ("audio", 1), ("done", "stop")]
    assert "a" not in primary.pending


async def test_unavailable_mode_is_refused_on_the_caller_side() -> None:
    engine = Engine(ScriptedRunner)
    with pytest.raises(ValueError):
        engine.begin_reply("x", [], mode="fallback")
    with pytest.raises(ValueError):
        engine.begin_reply("x", [], mode="shout")


class EditingRunner(ScriptedRunner):
    """A runner with one conversation edit, recording the thread it ran on."""

    def rename(self, sid: str, name: str) -> str:
        self._mark()
        if not name:
            raise ValueError("empty name")
        return f"{sid}:{name}"


@dataclass(frozen=True)
class Rename(SessionCommand):
    """A test's own session command (EditingRunner.rename), given to the engine by register()."""

    name: str


@dataclass(frozen=True)
class Unknown(SessionCommand):
    """A session command no engine has a handler for."""


async def test_send_runs_session_commands_in_order_on_the_engine_thread() -> None:
    """Engine.send: the result (or the exception) comes back as a future on the loop; a command
    whose capability the runner lacks is NotImplementedError; a closed session is an error, not
    a hang; a command type the engine has no handler for is refused on the caller's side."""
    runner = EditingRunner()
    engine = Engine(lambda: runner)
    engine.register(Rename, lambda r, sid, cmd: r.rename(sid, cmd.name))
    await engine.start()
    try:
        engine.open_session("s", Sink())
        engine.append_audio("s", np.zeros(1280, np.float32))
        future = engine.send("s", Rename("x"))
        assert await asyncio.wait_for(future, 5) == "s:x"
        assert runner.audio["s"] == 1  # the append queued before the command ran before it
        assert runner.threads == {"engine"}
        with pytest.raises(ValueError):
            await asyncio.wait_for(engine.send("s", Rename("")), 5)
        # EditingRunner is no ConversationEditing: a truncation is not its to do.
        with pytest.raises(NotImplementedError, match="cannot truncate reply"):
            await asyncio.wait_for(engine.send("s", TruncateReply(1)), 5)
        with pytest.raises(TypeError):
            engine.send("s", Unknown())
        with pytest.raises(TypeError):
            engine.send("s", "truncate_reply")  # type: ignore[arg-type]  # names are no commands
        engine.close_session("s")
        with pytest.raises(KeyError):
            await asyncio.wait_for(engine.send("s", Rename("y")), 5)
    finally:
        await engine.stop()


def test_runner_capabilities_are_named_by_protocols() -> None:
    """The StreamingRunner has every optional capability the session commands need; the
    reference and fallback runners have none (their commands answer NotImplementedError), and
    the fallback takes its history. `supports` looks the methods up: a class or an instance."""
    from agent.engine.api import (
        ConversationEditing,
        Runner,
        Speculating,
        TakesHistory,
        Transcribing,
        TurnControl,
        VideoIntake,
        supports,
    )
    from agent.engine.runner.fallback import FallbackRunner
    from agent.engine.runner.reference import GenerateRunner
    from agent.engine.runner.streaming import StreamingRunner

    optional = (Speculating, VideoIntake, TurnControl, Transcribing, ConversationEditing)
    for capability in (Runner, *optional):
        assert supports(StreamingRunner, capability), capability
    for runner in (GenerateRunner, FallbackRunner):
        assert supports(runner, Runner)
        assert not any(supports(runner, capability) for capability in optional), runner
    assert supports(FallbackRunner, TakesHistory) and not supports(GenerateRunner, TakesHistory)
    assert not supports(ScriptedRunner(), Speculating)
