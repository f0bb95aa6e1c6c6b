"""A response's function calls: each an output item of type `function_call`, from the model's
call text (agent/engine/api.py CallDelta) to the GA events that describe it.

An item is announced (response.output_item.added) once its function name has been written,
its arguments stream as response.function_call_arguments.delta, and the call's end gives
.done with the whole arguments text (exactly the deltas joined), then the item's done events.
A call the response ended before its end (barge-in, cancel, the cap) is `incomplete`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from agent.realtime.events import new_id
from agent.tools.call_parser import CallParseError, CallParser


@dataclass
class FunctionCall:
    response_id: str
    output_index: int
    call_id: str = field(default_factory=lambda: new_id("call"))
    item_id: str = field(default_factory=lambda: new_id("item"))
    parser: CallParser = field(default_factory=CallParser)
    status: str = "in_progress"  # in_progress | completed | incomplete
    arguments: Optional[dict[str, Any]] = None  # parsed, once completed

    @property
    def announced(self) -> bool:
        return self.parser.name is not None

    def advance(self, text: str, done: bool) -> tuple[str, Optional[str]]:
        """More of the model's call text (`done`: its end). Returns the arguments text it added
        and, for a call that does not parse (the grammar should never let that happen), why:
        the call is then incomplete."""
        try:
            if done:
                _, self.arguments, last = self.parser.finish(text)
                self.status = "completed"
            else:
                last = self.parser.push(text)
        except CallParseError as exc:
            self.status = "incomplete"
            return "", str(exc)
        return last, None

    def item(self, arguments: Optional[str] = None) -> dict[str, Any]:
        """The item as it stands (`arguments`: as announced, where not the text so far)."""
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.parser.name or "",
            "arguments": self.parser.sent if arguments is None else arguments,
        }

    def _ids(self) -> dict[str, Any]:
        return {
            "response_id": self.response_id,
            "item_id": self.item_id,
            "output_index": self.output_index,
            "call_id": self.call_id,
        }

    def opened(self) -> dict[str, Any]:
        """The item as announced: no arguments yet (GA's `added`), since the deltas alone add up
        to them: a client appending each delta to the item's arguments gets the whole text."""
        return self.item(arguments="")

    def added(self) -> dict[str, Any]:
        return {
            "type": "response.output_item.added",
            "response_id": self.response_id,
            "output_index": self.output_index,
            "item": self.opened(),
        }

    def delta(self, text: str) -> dict[str, Any]:
        return {"type": "response.function_call_arguments.delta", **self._ids(), "delta": text}

    def done(self) -> list[dict[str, Any]]:
        """The closing events, once `status` is final (the conversation.item.done is the caller's)."""
        events: list[dict[str, Any]] = []
        if self.status == "completed":
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **self._ids(),
                    "name": self.parser.name,
                    "arguments": self.parser.sent,
                }
            )
        events.append(
            {
                "type": "response.output_item.done",
                "response_id": self.response_id,
                "output_index": self.output_index,
                "item": self.item(),
            }
        )
        return events
