"""User, system and assistant messages the client adds (conversation.item.create), into the
model's context.

A part of the Session, given the engine port, the items port and the fallback's history (which
keeps the user's words for a model with no context of its own), never the Session. The parts
come checked and decoded (agent/realtime/message_content.py): nothing here can refuse a message
half sent, except the engine itself (an image past a turn's limit: an `error` naming it).
"""

from __future__ import annotations

from typing import Callable, Optional

from agent.config import INPUT_FRAME_SAMPLES
from agent.engine.commands import AddAssistantText, AddSystemText, AddUserImage, AddUserText, EndUserItem
from agent.realtime.engine_port import EnginePort
from agent.realtime.events import message_item
from agent.realtime.items import Items
from agent.realtime.message_content import AudioPart, ImagePart, TextPart, UserPart, item_content


class Messages:
    def __init__(
        self,
        engine: EnginePort,
        items: Items,
        remember: Callable[[str, str], None],
        speaking: Callable[[], bool] = lambda: False,
    ) -> None:
        """remember: (role, text) for the fallback model's short history; speaking: whether
        server VAD is in the middle of the user's speech."""
        self._engine, self._items, self._remember, self._speaking = engine, items, remember, speaking

    def add_user(self, item_id: str, parts: list[UserPart], event_id: Optional[str]) -> None:
        """A user message joins the user turn being spoken: its audio as if spoken, then its
        images, then its text (the engine's order, whatever the parts' order). Its audio is a
        committed item's: unless it joined speech under way, the engine marks where it ends, so
        that a discard of the speech after it keeps it (no transcript: the client gave the audio)."""
        audio = False
        for index, part in enumerate(parts):
            if isinstance(part, AudioPart):
                for start in range(0, len(part.pcm16k), INPUT_FRAME_SAMPLES):
                    self._engine.append_audio(part.pcm16k[start : start + INPUT_FRAME_SAMPLES])
                audio = True
            elif isinstance(part, ImagePart):
                self._engine.send(AddUserImage(part.image), event_id=event_id, param=f"item.content[{index}].image_url")
        if audio and not self._speaking():
            self._engine.send(EndUserItem(transcript=False), event_id=event_id)
        texts = [part.text for part in parts if isinstance(part, TextPart)]
        if texts:
            text = "\n".join(texts)
            self._engine.send(AddUserText(text), event_id=event_id)
            self._remember("user", text)
        self._items.add(message_item(item_id, "user", item_content(parts)))

    def add_system(self, item_id: str, text: str, event_id: Optional[str]) -> None:
        """A system message: in the model's context where it is added (the session's
        instructions stay as they are)."""
        self._engine.send(AddSystemText(text), event_id=event_id)
        self._items.add(message_item(item_id, "system", [{"type": "input_text", "text": text}]))

    def add_assistant(self, item_id: str, text: str, event_id: Optional[str]) -> None:
        """An assistant message: a closed assistant turn in the model's context where it is
        added, after the user's text items before it (agent/engine/runner/edits.py)."""
        answer = self._engine.send(AddAssistantText(text), event_id=event_id, param="item")
        self._remember("assistant", text)
        self._items.add(message_item(item_id, "assistant", [{"type": "output_text", "text": text}]))
        # The engine may not place it (images not yet answered: the error says so).
        answer.add_done_callback(self._items.withdraw_if_refused(item_id))
