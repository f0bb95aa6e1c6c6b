"""The function calls a `function_call_output` may answer: those the model made (agent/realtime/
replies.py adds them as they end) and those the client replayed as `function_call` items
(agent/realtime/call_outputs.py), the newest MAX_KNOWN_CALLS, call_id -> function name."""

from __future__ import annotations

MAX_KNOWN_CALLS = 256


class KnownCalls:
    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def add(self, call_id: str, name: str) -> None:
        self._names.pop(call_id, None)  # a call_id made again is the newest
        self._names[call_id] = name
        while len(self._names) > MAX_KNOWN_CALLS:
            self._names.pop(next(iter(self._names)))

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._names

    def discard(self, call_id: str) -> None:
        self._names.pop(call_id, None)
