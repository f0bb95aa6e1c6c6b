"""Conversation edits of a session: cut the latest reply to what the listener heard (a client's
conversation.item.truncate, or the server's own barge-in on WebRTC) or delete it.

Both go through one mechanism, `cut_latest_reply`: the engine keeps the reply's text tokens the
talker had consumed by the last heard codec frame (frame i is made after reading reply token i),
closes the assistant turn there and drops the rest from the session's KV slot
(StreamingRunner.truncate_reply), once every cancelled reply has ended in the engine.
These are the Session's own helpers (with agent/realtime/replies.py); they run on the asyncio loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Optional

from agent.config import CODEC_FRAME_SAMPLES, OUTPUT_RATE

if TYPE_CHECKING:
    from agent.realtime.response import Response
    from agent.realtime.session import Session

FRAME_MS = 80  # one codec frame: the unit a truncation is counted in


def truncate(session: Session, item_id: str, audio_end_ms: int, event_id: Optional[str]) -> None:
    """Cut the latest spoken reply to what the listener heard, in the item and in the model's context."""
    last = session.replies.last
    if item_id not in session.conversation:
        session.emit_error(f"no item {item_id!r}", "item_not_found", param="item_id", event_id=event_id)
        return
    if last is None or last.item_id != item_id or not last.audio:
        session.emit_error(
            "only the latest spoken assistant item can be truncated", "unsupported", param="item_id", event_id=event_id
        )
        return
    produced_ms = last.samples * 1000 // OUTPUT_RATE
    if audio_end_ms > produced_ms:
        session.emit_error(
            f"audio_end_ms {audio_end_ms} is past the item's audio ({produced_ms} ms)",
            "invalid_value",
            param="audio_end_ms",
            event_id=event_id,
        )
        return
    cut_latest_reply(session, audio_end_ms // FRAME_MS, event_id, _announce_truncation(session, last, audio_end_ms))


def truncate_to_heard(session: Session, reply: Response, samples_heard: int) -> None:
    """Barge-in: the listener heard the first `samples_heard` samples of `reply` (the latest
    one) before the rest was flushed; keep only the words of the frames they heard."""
    audio_end_ms = samples_heard * 1000 // OUTPUT_RATE
    frames = samples_heard // CODEC_FRAME_SAMPLES
    cut_latest_reply(session, frames, None, _announce_truncation(session, reply, audio_end_ms))


def delete_item(session: Session, item_id: str, event_id: Optional[str]) -> None:
    """Delete the latest assistant item: its words leave the list and the model's context (an
    empty assistant turn stays, so the turns keep their order). Earlier items are refused:
    the KV cache holds the conversation in order and cannot drop a turn from its middle."""
    last = session.replies.last
    if last is None or last.item_id != item_id:
        session.emit_error(
            "only the latest assistant item can be deleted: the model's context keeps the conversation in order",
            "unsupported",
            param="item_id",
            event_id=event_id,
        )
        return

    def deleted(_kept_tokens: int) -> None:
        session.conversation.remove(item_id)
        session.replies.forget_last()
        session.emit({"type": "conversation.item.deleted", "item_id": item_id})

    cut_latest_reply(session, 0, event_id, deleted)


def cut_latest_reply(session: Session, audio_frames: int, event_id: Optional[str], then: Callable[[int], None]) -> None:
    """Keep the latest reply's first `audio_frames` frames' text in the model's context (a reply
    still running is cancelled first), then call `then(kept_tokens)`."""
    if session.replies.last is session.replies.current:
        session.replies.interrupt("client_cancelled")

    def cut() -> None:
        future = session.engine_call("truncate_reply", audio_frames, event_id=event_id)

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None or session.closed:
                return  # engine_call reported it
            then(f.result()["kept_tokens"])

        future.add_done_callback(done)

    session.replies.after_engine_idle(cut)


def _announce_truncation(session: Session, reply: Response, audio_end_ms: int) -> Callable[[int], None]:
    def truncated(kept_tokens: int) -> None:
        if reply.item_id in session.conversation:
            session.conversation.set_transcript(reply.item_id, reply.text_upto(kept_tokens))
        session.emit(
            {
                "type": "conversation.item.truncated",
                "item_id": reply.item_id,
                "content_index": 0,
                "audio_end_ms": audio_end_ms,
            }
        )

    return truncated
