"""A response's function calls: each an output item of type `function_call`, from the model's
call text (agent/engine/api.py CallDelta) to the GA events that describe it.

An item is announced (response.output_item.added) once its function name has been written,
its arguments stream as response.function_call_arguments.delta, and the call's end gives
.done with the whole arguments text (exactly the deltas joined), then the item's done events.
A call the response ended before its end (barge-in, cancel, the cap) is `incomplete`.

A call of an MCP server's tool (`mcp`: its route, set once the call is named) is an `mcp_call`
item instead: its arguments stream as response.mcp_call_arguments.*, and its item is done only
once the agent has run it (agent/realtime/mcp_calls.py: `output` or `error`). One that needs
the client's approval is an `mcp_approval_request` item, done with its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from agent.realtime.events import new_id
from agent.realtime.mcp_servers import Route
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
    mcp: Optional[Route] = None  # an MCP server's tool (set when the call is named)
    # An mcp_call's result, once run (agent/realtime/mcp_calls.py), and the approval it waited for.
    output: Optional[str] = None
    error: Optional[dict[str, Any]] = None
    approval_request_id: Optional[str] = None

    @property
    def asks_approval(self) -> bool:
        return self.mcp is not None and self.mcp.approval and self.approval_request_id is None

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
        if self.mcp is not None:
            return self.mcp_item(arguments)
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.parser.name or "",
            "arguments": self.parser.sent if arguments is None else arguments,
        }

    def mcp_item(self, arguments: Optional[str] = None) -> dict[str, Any]:
        assert self.mcp is not None
        common = {
            "id": self.item_id,
            "server_label": self.mcp.server.label,
            "name": self.parser.name or "",
            "arguments": self.parser.sent if arguments is None else arguments,
        }
        if self.asks_approval:
            return {**common, "type": "mcp_approval_request"}
        return {
            **common,
            "type": "mcp_call",
            "approval_request_id": self.approval_request_id,
            "output": self.output,
            "error": self.error,
        }

    def _ids(self) -> dict[str, Any]:
        ids = {"response_id": self.response_id, "item_id": self.item_id, "output_index": self.output_index}
        return ids if self.mcp is not None else {**ids, "call_id": self.call_id}

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

    def delta(self, text: str) -> Optional[dict[str, Any]]:
        if self.asks_approval:
            return None  # a request is shown whole, with its arguments, when done
        kind = "response.mcp_call_arguments.delta" if self.mcp else "response.function_call_arguments.delta"
        return {"type": kind, **self._ids(), "delta": text}

    @property
    def runs_later(self) -> bool:
        """An mcp_call whose arguments are complete: its item is done once it has been run."""
        return self.mcp is not None and not self.asks_approval and self.status == "completed"

    def done(self) -> list[dict[str, Any]]:
        """The closing events, once `status` is final (the conversation.item.done is the caller's).
        An mcp_call's end of arguments only: its item's done events follow its run."""
        events: list[dict[str, Any]] = []
        if self.status == "completed" and self.mcp is None:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **self._ids(),
                    "name": self.parser.name,
                    "arguments": self.parser.sent,
                }
            )
        elif self.status == "completed" and not self.asks_approval:
            events.append({"type": "response.mcp_call_arguments.done", **self._ids(), "arguments": self.parser.sent})
            return events
        events.append(
            {
                "type": "response.output_item.done",
                "response_id": self.response_id,
                "output_index": self.output_index,
                "item": self.item(),
            }
        )
        return events
