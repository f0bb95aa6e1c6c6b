"""Integration fixtures: strict GA schema checks of the agent's server events."""

from __future__ import annotations

import typing
from typing import Any, Callable

import pytest

from agent.realtime.outbox import is_extra


def _server_event_models() -> dict[str, Any]:
    """type literal -> the openai SDK's GA pydantic model for that server event."""
    from openai.types.realtime import realtime_server_event

    union = typing.get_args(realtime_server_event.RealtimeServerEvent)[0]
    models: dict[str, Any] = {}
    for model in typing.get_args(union):
        for literal in typing.get_args(model.model_fields["type"].annotation):
            models[literal] = model
    return models


@pytest.fixture(scope="session")
def strict_event() -> Callable[[dict[str, Any]], None]:
    """Validate one server event strictly (model_validate) against the SDK's GA schema.
    Project extras (`omni.`-prefixed types, `input_video.throttle`) are skipped; an unknown type fails."""
    models = _server_event_models()

    def check(event: dict[str, Any]) -> None:
        kind = event.get("type", "")
        if is_extra(kind):
            assert isinstance(event.get("event_id"), str)
            return
        assert kind in models, f"{kind!r} is not a GA server event"
        payload = {k: v for k, v in event.items() if not k.startswith("_")}  # test-side bookkeeping
        models[kind].model_validate(payload)

    return check


@pytest.fixture(scope="session")
def strict_events(strict_event: Callable[[dict[str, Any]], None]) -> Callable[[list[dict[str, Any]]], list[str]]:
    """Validate every event strictly (strict_event); returns their types, in order."""

    def check(events: list[dict[str, Any]]) -> list[str]:
        for event in events:
            strict_event(event)
        return [event["type"] for event in events]

    return check
