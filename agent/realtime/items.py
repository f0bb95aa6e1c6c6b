"""The user's items as they join the conversation, announced on the session's outbox.

A port given to the session's parts that add user items (agent/realtime/server_turn.py, and the
Session itself for client-created ones): the conversation and the events about it, nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from agent.realtime.conversation import Conversation
from agent.realtime.events import user_audio_item
from agent.realtime.outbox import Outbox


class Items:
    def __init__(self, conversation: Conversation, outbox: Outbox) -> None:
        self._conversation, self._outbox = conversation, outbox

    def commit(self, item_id: str) -> None:
        """The input audio buffer became the user audio item `item_id`."""
        previous = self._conversation.last_id()
        self._outbox.emit({"type": "input_audio_buffer.committed", "item_id": item_id, "previous_item_id": previous})
        self.add(user_audio_item(item_id))

    def withdraw(self, item_id: str) -> None:
        """An item just added that the model could not take: gone again, announced as deleted."""
        if item_id in self._conversation:
            self._conversation.remove(item_id)
            self._outbox.emit({"type": "conversation.item.deleted", "item_id": item_id})

    def withdraw_if_refused(self, item_id: str) -> Callable[[asyncio.Future], None]:
        """A done-callback for the engine's answer to an item: refused (the error says why), the
        item is withdrawn, so the client's list matches the model's."""

        def refused(future: asyncio.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                self.withdraw(item_id)

        return refused

    def last_is_assistant(self) -> bool:
        """Whether the newest item is the assistant's: a message of its, or a function call."""
        last_id = self._conversation.last_id()
        item = None if last_id is None else self._conversation.get(last_id)
        return item is not None and (item["type"] == "function_call" or item.get("role") == "assistant")

    def add(self, item: dict[str, Any]) -> None:
        previous = self._conversation.add(item)
        self._outbox.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        self._outbox.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item})
