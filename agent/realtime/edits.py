"""Conversation edits of a session: cut the latest reply to what the listener heard (a client's
conversation.item.truncate, or the server's own barge-in on WebRTC) or delete it.

Both go through one mechanism, `cut_latest_reply`: the engine keeps the reply's text tokens the
talker had consumed by the last heard codec frame (frame i is made after reading reply token i),
closes the assistant turn there and drops the rest from the session's KV slot
(TruncateReply: StreamingRunner.truncate_reply). It is sent at once, right behind the cancel of a
reply still running: the engine applies its commands in order and ends a cancelled reply at the
cancel itself, so the truncation finds that reply ended and comes before the next reply's begin.
(Sent only once the cancelled reply's end had come back, it could land behind a reply begun
meanwhile, when a loaded engine answered late, and was refused with an `error` event.)
`Edits` is owned by the Session and given only the ports it needs: the session's replies, its
engine port, its conversation and its outbox. It runs on the asyncio loop.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from agent.config import CODEC_FRAME_SAMPLES, OUTPUT_RATE
from agent.engine.commands import TruncateReply
from agent.realtime.conversation import Conversation
from agent.realtime.engine_port import EnginePort
from agent.realtime.outbox import Outbox
from agent.realtime.replies import Replies
from agent.realtime.response import Response

FRAME_MS = 80  # one codec frame: the unit a truncation is counted in


class Edits:
    def __init__(self, replies: Replies, engine: EnginePort, conversation: Conversation, outbox: Outbox) -> None:
        self._replies, self._engine, self._conversation, self._outbox = replies, engine, conversation, outbox

    def truncate(self, item_id: str, audio_end_ms: int, event_id: Optional[str]) -> None:
        """Cut the latest spoken reply to what the listener heard, in the item and in the model's context."""
        last = self._replies.last
        if item_id not in self._conversation:
            self._outbox.error(  # OpenAI's code, which clients treat as a harmless race
                f"Error truncating item: the item with id {item_id!r} does not exist.",
                "item_truncate_invalid_item_id",
                param="item_id",
                event_id=event_id,
            )
            return
        if last is None or last.item_id != item_id or not last.audio:
            self._outbox.error(
                "only the latest spoken assistant item can be truncated",
                "unsupported",
                param="item_id",
                event_id=event_id,
            )
            return
        produced_ms = last.samples * 1000 // OUTPUT_RATE
        if audio_end_ms > produced_ms:
            self._outbox.error(
                f"audio_end_ms {audio_end_ms} is past the item's audio ({produced_ms} ms)",
                "invalid_value",
                param="audio_end_ms",
                event_id=event_id,
            )
            return
        self.cut_latest_reply(audio_end_ms // FRAME_MS, event_id, self._announce_truncation(last, audio_end_ms))

    def barge_in(self) -> None:
        """Server VAD heard the user start a turn that interrupts: stop the reply (Replies.interrupt)
        and, where the latest reply was playing, keep only the words of the frames they heard."""
        heard = self._replies.interrupt("turn_detected")
        if heard is not None:
            self.truncate_to_heard(*heard)

    def truncate_to_heard(self, reply: Response, samples_heard: int) -> None:
        """Barge-in: the listener heard the first `samples_heard` samples of `reply` (the latest
        one) before the rest was flushed; keep only the words of the frames they heard."""
        audio_end_ms = samples_heard * 1000 // OUTPUT_RATE
        frames = samples_heard // CODEC_FRAME_SAMPLES
        self.cut_latest_reply(frames, None, self._announce_truncation(reply, audio_end_ms))

    def delete_item(self, item_id: str, event_id: Optional[str]) -> None:
        """Delete the latest assistant item: its words leave the list and the model's context (an
        empty assistant turn stays, so the turns keep their order). Earlier items are refused:
        the KV cache holds the conversation in order and cannot drop a turn from its middle."""
        last = self._replies.last
        if last is None or last.item_id != item_id:
            self._outbox.error(
                "only the latest assistant item can be deleted: the model's context keeps the conversation in order",
                "unsupported",
                param="item_id",
                event_id=event_id,
            )
            return
        # The list changes now, not when the engine answers: the engine applies the cut before
        # any command of a later event, and the later events must see the item gone. LiveKit
        # replaces an item by a delete and a create of the same id, back to back: the create was
        # refused, the deleted item still being the last one.
        self.cut_latest_reply(0, event_id)
        self._conversation.remove(item_id)
        self._replies.forget_last()
        self._outbox.emit({"type": "conversation.item.deleted", "item_id": item_id})

    def cut_latest_reply(
        self, audio_frames: int, event_id: Optional[str], then: Optional[Callable[[Optional[int]], None]] = None
    ) -> None:
        """Keep the latest reply's first `audio_frames` frames' text in the model's context (a reply
        still running is cancelled first, in the command before), then call `then(kept_tokens)`, if given.
        Nothing is called once the session has closed: the engine port cancels the command then."""
        replies, engine = self._replies, self._engine
        if replies.last is replies.current:
            replies.cancel_for_edit()
        future = engine.send(TruncateReply(audio_frames, missing_ok=True), event_id=event_id)
        if then is None:
            return

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None or engine.closed:
                return  # the engine port reported it
            # None: the model never held the reply (cancelled before its prefill ended, or the
            # fallback's): nothing of it to cut, its item goes or stays as it is.
            then(None if f.result().get("absent") else f.result()["kept_tokens"])

        future.add_done_callback(done)

    def _announce_truncation(self, reply: Response, audio_end_ms: int) -> Callable[[Optional[int]], None]:
        conversation, outbox = self._conversation, self._outbox

        def truncated(kept_tokens: Optional[int]) -> None:
            if kept_tokens is not None and reply.item_id in conversation:
                conversation.set_transcript(reply.item_id, reply.text_upto(kept_tokens))
            outbox.emit(
                {
                    "type": "conversation.item.truncated",
                    "item_id": reply.item_id,
                    "content_index": 0,
                    "audio_end_ms": audio_end_ms,
                }
            )

        return truncated
