"""The results of the model's function calls: `function_call_output` items, as the client adds
them (conversation.item.create), given to the model as Qwen gives results: `<tool_response>`
blocks in the user turn the model answers next (agent/tools/qwen_format.py), joined by a newline
when a turn carries several. A part of the Session, given the engine port, the items port and
the replies (which know the calls the model made), never the Session.
"""

from __future__ import annotations

from typing import Optional

from agent.engine.commands import AddUserText
from agent.realtime.engine_port import EnginePort
from agent.realtime.items import Items
from agent.realtime.replies import Replies
from agent.tools import qwen_format


class UnknownCall(ValueError):
    """An output for a call_id the model did not make (in this session, among the newest)."""


class CallOutputs:
    def __init__(self, engine: EnginePort, items: Items, replies: Replies) -> None:
        self._engine, self._items, self._replies = engine, items, replies
        self._turn = -1  # replies.turns when the latest output was added: the turn it joined

    def add(self, item_id: str, call_id: str, output: str, event_id: Optional[str]) -> None:
        if call_id not in self._replies.calls:
            raise UnknownCall(f"no function call has call_id {call_id!r}")
        first = self._turn != self._replies.turns  # the first result of the turn the model answers next
        self._turn = self._replies.turns
        self._engine.send(AddUserText(qwen_format.response_text(output, first)), event_id=event_id)
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
