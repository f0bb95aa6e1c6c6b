"""Ids and the small builders every server event shares.

Ids follow the API's shapes (`event_…`, `resp_…`, `item_…`, `sess_…`, `rtc_…`): a prefix and
24 random hex digits, so clients that only check the prefix (or nothing) accept them.
"""

from __future__ import annotations

import secrets
from typing import Any, Optional

PCM_FORMAT: dict[str, Any] = {"type": "audio/pcm", "rate": 24000}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def error_event(
    message: str,
    code: str,
    *,
    param: Optional[str] = None,
    event_id: Optional[str] = None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    """An `error` server event; event_id names the client event that caused it."""
    return {
        "type": "error",
        "error": {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id},
    }


def message_item(item_id: str, role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """A user or system message as the conversation keeps it."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": role,
        "status": "completed",
        "content": content,
    }


def user_audio_item(item_id: str) -> dict[str, Any]:
    # The audio itself is not kept (it lives in the model's cache); no transcript is made.
    return message_item(item_id, "user", [{"type": "input_audio", "transcript": None}])


def assistant_item(item_id: str, audio: bool, status: str, content: str | None) -> dict[str, Any]:
    """An assistant message; content None: no content part yet (the item just started)."""
    parts: list[dict[str, Any]] = []
    if content is not None:
        parts.append(
            {"type": "output_audio", "transcript": content} if audio else {"type": "output_text", "text": content}
        )
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": parts,
    }
