"""Shared by the tests (imported, not a test): a real Session over a recording engine, for tests
of what a session does with client events without a model.

The engine takes every command and answers it at once (or refuses the ones `refuse` picks, as
the engine thread refuses a command it cannot carry out, with a ValueError); it counts the
audio it is handed and records the calls on the turn's stream (begin, discard, speculation). The session runs manual turns (turn detection off) unless told otherwise,
and its server events are collected, parsed.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor
from typing import Any, Callable, Optional

import numpy as np

from agent.config import Config
from agent.engine.api import Voices
from agent.engine.commands import SessionCommand
from agent.gate.ladder import Admission
from agent.realtime import client_events
from agent.realtime.session import Session
from agent.realtime.session_config import default_session


class RecordingEngine:
    has_fallback = False
    voices = Voices()  # (none known: a voice is the engine's to refuse)

    def __init__(self) -> None:
        self.commands: list[SessionCommand] = []
        self.audio_samples = 0
        self.closed: list[str] = []
        self.turn_calls: list[str] = []
        self.refuse: Callable[[SessionCommand], bool] = lambda command: False

    def send(self, sid: str, command: SessionCommand) -> asyncio.Future:
        self.commands.append(command)
        future = asyncio.get_running_loop().create_future()
        if self.refuse(command):
            future.set_exception(ValueError(f"{type(command).__name__} refused"))
        else:
            future.set_result(None)
        return future

    def append_audio(self, sid: str, pcm: np.ndarray) -> None:
        self.audio_samples += len(pcm)

    # The turn's stream: recorded by name, in order with nothing else (what a test asks is
    # whether the session rolled a turn back, answered it, or dropped a speculation).
    def discard_turn(self, sid: str) -> None:
        self.turn_calls.append("discard_turn")

    def begin_reply(self, sid: str, images: list, *, mode: str, history: tuple) -> None:
        self.turn_calls.append(f"begin_reply:{mode}")

    def drop_speculation(self, sid: str) -> None:
        self.turn_calls.append("drop_speculation")

    def cancel_reply(self, sid: str) -> None:
        self.turn_calls.append("cancel_reply")

    def close_session(self, sid: str) -> None:
        self.closed.append(sid)


def recording_session(
    pool: Optional[Executor] = None, manual: bool = True, admission: Optional[Admission] = None
) -> tuple[Session, RecordingEngine, list[dict[str, Any]]]:
    """A WebSocket session (turn detection off when `manual`), its engine and its events;
    `admission`: the engine's (the config's defaults unless given)."""
    config = Config()
    settings = default_session(config)
    if manual:
        settings["audio"]["input"]["turn_detection"] = None
    engine = RecordingEngine()
    sent: list[dict[str, Any]] = []
    session = Session(
        config,
        engine,  # type: ignore[arg-type]
        admission or Admission.from_config(config),
        send=lambda text: sent.append(json.loads(text)),
        on_closed=lambda _: None,
        webrtc=False,
        settings=settings,
        decode_pool=pool,
    )
    return session, engine, sent


def send_event(session: Session, event: dict[str, Any]) -> None:
    client_events.handle(session, json.dumps(event))


def errors(sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in sent if e["type"] == "error"]
