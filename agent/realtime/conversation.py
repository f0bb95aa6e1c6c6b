"""The conversation's items as the client sees them (the model's view is its KV cache).

Owned by the Session. Items keep their GA shape so `conversation.item.retrieve` can return them
as they are; audio bytes are not kept (the model holds the audio, as tokens).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Optional

_MAX_ITEMS = 512  # a long call keeps its newest items; the model's context has its own limit


class Conversation:
    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, item: dict[str, Any], after: Optional[str] = None) -> Optional[str]:
        """Append an item, or insert it right after item `after` (a held turn's answer goes
        after its user item, before the turns spoken since); returns the id of the item before
        it (previous_item_id)."""
        if after is not None and after in self._items and after != self.last_id():
            items = list(self._items.items())
            at = next(i for i, (key, _) in enumerate(items) if key == after) + 1
            self._items = OrderedDict([*items[:at], (item["id"], item), *items[at:]])
            return after
        previous = next(reversed(self._items), None) if self._items else None
        self._items[item["id"]] = item
        while len(self._items) > _MAX_ITEMS:
            self._items.popitem(last=False)
        return previous

    def get(self, item_id: str) -> Optional[dict[str, Any]]:
        item = self._items.get(item_id)
        return None if item is None else copy.deepcopy(item)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def update(self, item_id: str, item: dict[str, Any]) -> None:
        if item_id in self._items:
            self._items[item_id] = item

    def remove(self, item_id: str) -> None:
        self._items.pop(item_id, None)

    def last_id(self) -> Optional[str]:
        return next(reversed(self._items), None) if self._items else None

    def set_input_transcript(self, item_id: str, text: str) -> None:
        """A user audio item's transcript (live input transcription)."""
        item = self._items.get(item_id)
        if item is not None and item.get("content") and item["content"][0].get("type") == "input_audio":
            item["content"][0]["transcript"] = text

    def set_transcript(self, item_id: str, text: str) -> None:
        """The assistant item's content after a truncation."""
        item = self._items.get(item_id)
        if item is None or not item.get("content"):
            return
        part = item["content"][0]
        part["transcript" if part.get("type") == "output_audio" else "text"] = text
