"""A session's engine commands do not outlive it.

Pins: a command still unanswered when its session closes is cancelled at close, so what was
chained on it (here a truncation's announcement) never runs against a session that is gone:
under four loaded calls the engine once answered a truncation after its session had been freed
and the callback raised `ReferenceError: weakly-referenced object no longer exists` on the event
loop (the parts held their session through weak references then; now they hold only the
session's ports, agent/realtime/engine_port.py, and no weakref is left in agent/realtime). A
closed session and its parts are freed by reference counting alone; a port of a closed session
sends nothing more.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

from agent.config import Config
from agent.engine.api import Voices
from agent.engine.commands import SessionCommand, SetVoice, TruncateReply
from agent.gate.ladder import Admission
from agent.realtime.session import Session


class SlowEngine:
    """Answers nothing by itself: the test settles the commands, as the engine thread would later."""

    has_fallback = False
    voices = Voices()

    def __init__(self) -> None:
        self.sent: list[tuple[SessionCommand, asyncio.Future]] = []
        self.closed: list[str] = []

    def send(self, sid: str, command: SessionCommand) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.sent.append((command, future))
        return future

    def close_session(self, sid: str) -> None:
        self.closed.append(sid)


def _truncating_session() -> tuple[SlowEngine, Session, list[int]]:
    """A session that has asked the engine to truncate its latest reply; `announced` gets the
    kept tokens once the engine answers."""
    config = Config()
    engine = SlowEngine()
    session = Session(
        config,
        engine,  # type: ignore[arg-type]
        Admission.from_config(config),
        send=lambda _: None,
        on_closed=lambda _: None,
        webrtc=False,
    )
    announced: list[int] = []
    session.edits.cut_latest_reply(3, None, announced.append)
    return engine, session, announced


async def test_a_call_answered_after_close_runs_nothing_of_the_session() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    engine, session, announced = _truncating_session()
    ((command, future),) = engine.sent
    assert command == TruncateReply(3, missing_ok=True)
    await session.close()
    assert future.cancelled() and engine.closed == [session.id]
    assert session.engine.send(SetVoice("x")).cancelled() and len(engine.sent) == 1, "a closed port sends nothing"
    del session
    gc.collect()
    if not future.done():  # what the engine thread's _settle does for a command it answers late
        future.set_result({"kept_tokens": 2})
    await asyncio.sleep(0.05)  # let every callback run
    assert errors == [] and announced == []


async def test_a_call_answered_in_time_still_announces() -> None:
    engine, session, announced = _truncating_session()
    ((_, future),) = engine.sent
    future.set_result({"kept_tokens": 2})
    await asyncio.sleep(0.01)
    assert announced == [2]
    await session.close()


async def test_a_closed_session_and_its_parts_are_freed_without_the_cycle_collector() -> None:
    gc.collect()
    gc.disable()  # what a cycle would keep stays: the test sees it
    try:
        engine, session, _announced = _truncating_session()
        parts = [session, session.replies, session.turn, session.transcription, session.edits, session.engine]
        refs = [weakref.ref(part) for part in parts]
        await session.close()
        await asyncio.sleep(0)  # the cancelled command's callbacks run
        del parts, session, _announced
        engine.sent.clear()  # the engine thread forgets a command it has answered
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_no_weak_references_in_the_realtime_session() -> None:
    folder = Path(__file__).resolve().parents[2] / "agent" / "realtime"
    assert not [p.name for p in folder.glob("*.py") if "weakref" in p.read_text()]
