"""A response's output items in the conversation: where each goes in the list, and the events
that announce, stream and complete them.

The items of the response in progress go right after the item that was last when it began (a
held turn's: its user item), then each after the one before. Items the client adds meanwhile go
after the reply in the model (after_reply), so they are listed after its outputs, even those
announced later (a message that opens with its first words, a call once it is named).
`ReplyItems` is owned by the session's `Replies` (agent/realtime/replies.py), which calls it
from the engine's output; it holds only the list position and the ports it writes to. A call of
an MCP server's tool (`route` finds it) is handed, once its arguments are complete, to
`mcp_ready` (agent/realtime/mcp_calls.py), which runs it and ends its item.
"""

from __future__ import annotations

from typing import Callable, Optional

from agent.engine.api import CallDelta
from agent.realtime.conversation import Conversation
from agent.realtime.function_calls import FunctionCall
from agent.realtime.known_calls import KnownCalls
from agent.realtime.mcp_servers import Route
from agent.realtime.outbox import Outbox
from agent.realtime.response import Response


class ReplyItems:
    def __init__(
        self,
        conversation: Conversation,
        outbox: Outbox,
        calls: KnownCalls,
        route: Callable[[str], Optional[Route]],
        mcp_ready: Callable[[FunctionCall], None],
    ) -> None:
        self._conversation, self._outbox, self._calls = conversation, outbox, calls
        self._route, self._mcp_ready = route, mcp_ready
        self._after: Optional[str] = None  # the item the response's next output follows

    def begin(self, after: Optional[str]) -> None:
        """A response begins; its first output goes after `after` (None: first in the list)."""
        self._after = after

    def open_message(self, reply: Response) -> None:
        """Announce the response's message item (once)."""
        if reply.message_index is not None:
            return
        previous = self._conversation.add(reply.item("in_progress", ""), after=self._after)
        self._after = reply.item_id
        for event in reply.message_started(previous):
            self._outbox.emit(event)

    def advance_call(self, reply: Response, delta: CallDelta) -> None:
        """The model's tool call `delta.index` grew or ended: its item is announced once its
        function is named, its arguments stream, and its end completes it (a call that does not
        parse is incomplete, with an error event: the grammar should never let that happen)."""
        call = reply.call(delta.index)
        if call.status != "in_progress":
            return
        was_announced = call.announced
        last, error = call.advance(delta.text, delta.done)
        if error is not None:
            self._outbox.error(
                f"the model's tool call could not be read: {error}", "tool_call_invalid", kind="server_error"
            )
        if call.announced and not was_announced:
            call.mcp = self._route(call.parser.name or "")
            self._outbox.emit(call.added())
            previous = self._conversation.add(call.opened(), after=self._after)
            self._after = call.item_id
            self._outbox.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": call.opened()})
        delta = call.delta(last) if last and call.announced else None
        if delta is not None:
            self._outbox.emit(delta)
        if call.status != "in_progress" and call.announced:
            if call.mcp is None:
                self._calls.add(call.call_id, call.parser.name or "")
            for event in call.done():
                self._outbox.emit(event)
            self._conversation.update(call.item_id, call.item())
            if not call.runs_later:  # (an mcp_call's item is done once run)
                self._outbox.emit({"type": "conversation.item.done", "item": call.item()})
            if call.mcp is not None and call.status == "completed":
                self._mcp_ready(call)
