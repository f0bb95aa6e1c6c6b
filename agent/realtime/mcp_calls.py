"""The model's calls of MCP tools, run by the agent: from the end of a call's arguments to its
`mcp_call` item's output (or error) and the result in the model's context.

GA's order, as OpenAI's own clients read it: the response that made a call ends
(response.done, the item without output), and the call's end follows:
`response.mcp_call.in_progress` when it starts, then `response.mcp_call.completed` (or
`.failed`), `response.output_item.done` and `conversation.item.done` with the item's `output`
(or `error`). A call starts as soon as its arguments are complete, while its response is still
ending; a result that comes back before the response's end waits for it, so the order holds.
Nothing answers by itself: as on GA, the client asks for the spoken answer (`response.create`,
which the Agents SDK sends on the item's done), and that response reads the result, given to
the model as Qwen gives a tool's result (a `<tool_response>` in the user turn it answers next).

A call that needs approval is an `mcp_approval_request` item of its response; the client's
`mcp_approval_response` item (conversation.item.create) runs it, as a new `mcp_call` item
naming the request, or refuses it (the item fails with the reason; the model is told).
`McpCalls` is a part of the Session, given the engine port, the outbox and the conversation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Optional

from agent.engine.api import EngineBusy
from agent.engine.commands import AddUserText
from agent.realtime import mcp_client
from agent.realtime.conversation import Conversation
from agent.realtime.engine_port import EnginePort
from agent.realtime.events import new_id
from agent.realtime.function_calls import FunctionCall
from agent.realtime.outbox import Outbox
from agent.tools import qwen_format

log = logging.getLogger(__name__)

MAX_WAITING_APPROVAL = 64  # requests a session keeps unanswered (the oldest is forgotten)


class UnknownRequest(ValueError):
    """An mcp_approval_response for a request this session does not have (or has answered)."""


class McpCalls:
    def __init__(self, engine: EnginePort, outbox: Outbox, conversation: Conversation, timeout_s: float) -> None:
        self._engine, self._outbox, self._conversation = engine, outbox, conversation
        self._timeout_s = timeout_s
        self._open: set[str] = set()  # responses not ended yet that made calls
        self._parked: dict[str, list[Callable[[], None]]] = {}  # results waiting for their response's end
        self._requests: dict[str, FunctionCall] = {}  # approval request item id -> its call
        self._tasks: set[asyncio.Task] = set()

    # ---- from the reply's items (agent/realtime/reply_items.py) ------------------------------
    def ready(self, call: FunctionCall) -> None:
        """A call's arguments are complete, its response not yet ended."""
        self._open.add(call.response_id)
        if call.asks_approval:
            self._requests[call.item_id] = call
            while len(self._requests) > MAX_WAITING_APPROVAL:
                self._requests.pop(next(iter(self._requests)))
            return
        self._run(call)

    def response_done(self, response_id: str) -> None:
        """The response ended (its response.done sent): the results that waited for it follow."""
        self._open.discard(response_id)
        for report in self._parked.pop(response_id, []):
            report()

    # ---- from the client (conversation.item.create) ------------------------------------------
    def answer(self, item_id: str, request_id: str, approve: bool, reason: Optional[str]) -> None:
        """An mcp_approval_response item: it joins the conversation; the call runs, or fails."""
        call = self._requests.pop(request_id, None)
        if call is None:
            raise UnknownRequest(f"no MCP approval request {request_id!r} waits for an answer")
        item = {"id": item_id, "type": "mcp_approval_response", "approval_request_id": request_id, "approve": approve}
        if reason is not None:
            item["reason"] = reason
        self._added(item)
        self._outbox.emit({"type": "conversation.item.done", "item": item})
        approved = dataclasses.replace(call, item_id=new_id("item"), approval_request_id=request_id, output_index=0)
        self._added(approved.item())
        if approve:
            self._run(approved)
            return
        why = "the user did not approve this call" + (f": {reason}" if reason else "")
        approved.error = {"type": "tool_execution_error", "message": why}
        self._report(approved)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._parked.clear()
        self._requests.clear()

    # ---- running ----------------------------------------------------------------------------
    def _run(self, call: FunctionCall) -> None:
        self._outbox.emit({"type": "response.mcp_call.in_progress", **self._ids(call)})
        task = asyncio.ensure_future(self._call(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, call: FunctionCall) -> None:
        assert call.mcp is not None
        outcome = await mcp_client.call_tool(
            call.mcp.server, call.parser.name or "", call.arguments or {}, self._timeout_s
        )
        call.output, call.error = outcome.output, outcome.error
        if call.response_id in self._open:
            self._parked.setdefault(call.response_id, []).append(lambda: self._report(call))
        else:
            self._report(call)

    def _report(self, call: FunctionCall) -> None:
        """The call's end: its events, its item, its result in the model's context."""
        kind = "response.mcp_call.failed" if call.error is not None else "response.mcp_call.completed"
        self._outbox.emit({"type": kind, **self._ids(call)})
        item = call.item()
        self._conversation.update(call.item_id, item)
        self._outbox.emit(
            {
                "type": "response.output_item.done",
                "response_id": call.response_id,
                "output_index": call.output_index,
                "item": item,
            }
        )
        self._outbox.emit({"type": "conversation.item.done", "item": item})
        result = call.output if call.error is None else f"Error: {call.error.get('message', 'the call failed')}"
        try:
            self._engine.send(AddUserText(qwen_format.response_text(result or "")))
        except EngineBusy:
            log.warning("MCP call %s: engine inbox full; its result is not in the model's context", call.item_id)

    def _added(self, item: dict[str, Any]) -> None:
        previous = self._conversation.add(item)
        self._outbox.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})

    @staticmethod
    def _ids(call: FunctionCall) -> dict[str, Any]:
        return {"item_id": call.item_id, "output_index": call.output_index}
