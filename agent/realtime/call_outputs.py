"""Function calls and their results as the client adds them (conversation.item.create):

- `function_call_output` items, the results of calls, given to the model as Qwen gives results:
  `<tool_response>` blocks in the user turn the model answers next (agent/tools/qwen_format.py),
  each a text item of that turn (on a line of its own);
- `function_call` items, calls the client replays (a conversation restored, as LiveKit's
  chat context sends it): a closed assistant turn holding the call as the model writes one
  (`<tool_call>`), where it is added, after the user's text before it
  (agent/engine/runner/edits.py `add_assistant_text`); right behind an assistant message or
  call it joins that turn, as parallel calls share one; its call_id may then be answered.

A part of the Session, given the engine port, the items port and the replies (which know the
calls made), never the Session.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from agent.engine.commands import AddAssistantText, AddUserText
from agent.realtime.engine_port import EnginePort
from agent.realtime.items import Items
from agent.realtime.replies import Replies
from agent.tools import qwen_format


class UnknownCall(ValueError):
    """An output for a call_id the model did not make (in this session, among the newest)."""


class CallOutputs:
    def __init__(self, engine: EnginePort, items: Items, replies: Replies) -> None:
        self._engine, self._items, self._replies = engine, items, replies

    def add_call(
        self, item_id: str, call_id: str, name: str, arguments: str, event_id: Optional[str]
    ) -> asyncio.Future:
        """A replayed call (arguments: a JSON object's text, or "" for none). Returns the
        engine's answer: an output for the call should wait for it (refused, the call is gone)."""
        # Right behind an assistant message or call (as LiveKit replays a reply's text and its
        # parallel calls), it joins that assistant turn, if the engine still has it last.
        text = qwen_format.call_text(name, arguments or "{}")
        joins = self._items.last_is_assistant()
        answer = self._engine.send(AddAssistantText(text, joins=joins), event_id=event_id, param="item")
        fresh = call_id not in self._replies.calls
        self._replies.calls.add(call_id, name)
        self._items.add(
            {
                "id": item_id,
                "object": "realtime.item",
                "type": "function_call",
                "status": "completed",
                "call_id": call_id,
                "name": name,
                "arguments": arguments,  # as the client gave them
            }
        )
        # The engine may not place it (images not yet answered: the error says so): then the
        # item is withdrawn and its call (one not known before) cannot be answered.
        answer.add_done_callback(self._items.withdraw_if_refused(item_id))

        def forget_if_refused(future: asyncio.Future) -> None:
            if fresh and not future.cancelled() and future.exception() is not None:
                self._replies.calls.discard(call_id)

        answer.add_done_callback(forget_if_refused)
        return answer

    def add(self, item_id: str, call_id: str, output: str, event_id: Optional[str]) -> None:
        if call_id not in self._replies.calls:
            raise UnknownCall(f"no function call has call_id {call_id!r}")
        self._engine.send(AddUserText(qwen_format.response_text(output)), event_id=event_id)
        self._replies.remember("user", output)
        self._items.add(
            {
                "id": item_id,
                "object": "realtime.item",
                "type": "function_call_output",
                "status": "completed",
                "call_id": call_id,
                "output": output,
            }
        )
