"""A session's engine calls do not outlive it.

Pins: an engine call still unanswered when its session closes is cancelled at close, so what
was chained on it (here a truncation's announcement, reached through the weak proxy the
session's parts hold) never runs against a session that is gone: under four loaded calls the
engine answered a truncation after its session had been freed and the callback raised
`ReferenceError: weakly-referenced object no longer exists` on the event loop.
"""

from __future__ import annotations

import asyncio
import gc

from agent.config import Config
from agent.gate.ladder import Admission
from agent.realtime import edits
from agent.realtime.session import Session


class SlowEngine:
    """Answers nothing by itself: the test settles the calls, as the engine thread would later."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, asyncio.Future]] = []

    def call(self, sid: str, method: str, *args) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.calls.append((method, future))
        return future

    def close_session(self, sid: str) -> None:
        pass


def _truncating_session() -> tuple[SlowEngine, Session, list[int]]:
    """A session that has asked the engine to truncate its latest reply; `announced` gets the
    kept tokens once the engine answers."""
    config = Config()
    engine = SlowEngine()
    session = Session(
        config, engine, Admission.from_config(config), send=lambda _: None, on_closed=lambda _: None, webrtc=False
    )
    announced: list[int] = []
    # The parts hand the session on as their weak proxy (agent/realtime/replies.py does).
    edits.cut_latest_reply(session.replies._session, 3, None, announced.append)
    return engine, session, announced


async def test_a_call_answered_after_close_runs_nothing_of_the_session() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    engine, session, announced = _truncating_session()
    ((method, future),) = engine.calls
    assert method == "truncate_reply"
    await session.close()
    assert future.cancelled()
    del session
    gc.collect()
    if not future.done():  # what the engine thread's _settle does for a call it answers late
        future.set_result({"kept_tokens": 2})
    await asyncio.sleep(0.05)  # let every callback run
    assert errors == [] and announced == []


async def test_a_call_answered_in_time_still_announces() -> None:
    engine, session, announced = _truncating_session()
    ((_, future),) = engine.calls
    future.set_result({"kept_tokens": 2})
    await asyncio.sleep(0.01)
    assert announced == [2]
    await session.close()
