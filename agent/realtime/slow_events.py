"""The client events whose work would hold the event loop, which paces every call's outbound
audio, and how each leaves it free. Their handlers give the session's inbox what is left to do
(agent/realtime/inbox.py), and the session's later events wait behind it, in order.

- A long `input_audio_buffer.append`: its voice detection runs ~4 ms a second of audio, so a
  15 MiB append of μ-law (31 minutes) is seconds of it. It is base64-decoded and pushed half a
  second at a time, the loop yielded between slices.
- A user message with `input_audio` or `input_image` parts: decoded on the decode pool.
- A `tools` list (session.update, response.create): its JSON Schema meta-check is ~8 ms a
  schema in Python, a second for 128 tools. It is checked on the decode pool first; the check
  is remembered (agent/realtime/tool_config.py), so the handler's own finds it done. Python
  threads share the interpreter, but the checking thread gives the loop its turn every few
  milliseconds (the interpreter's switch interval), where the loop itself would not.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.realtime import audio_codec, message_content, tool_config
from agent.realtime.bad_event import BadEvent
from agent.realtime.inbox import Later

if TYPE_CHECKING:
    from agent.realtime.session import Session

MAX_APPEND_BYTES = 15 * 1024 * 1024  # the API's own limit for one append
SLICE_S = 0.5  # audio pushed per slice: ~2 ms of voice detection


def append(session: "Session", event: dict[str, Any]) -> Optional[Later]:
    """input_audio_buffer.append: pushed at once when it is short (what a client streams), else
    in slices."""
    audio = event.get("audio")
    if not isinstance(audio, str) or len(audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
        raise BadEvent("audio must be a base64 string (at most 15 MiB of audio)", param="audio")
    fmt = session.settings["audio"]["input"]["format"]["type"]
    if len(audio) <= _slice_bytes(fmt) * 4 // 3:
        _push(session, fmt, _base64_audio(audio))
        return None
    return lambda: _append_slices(session, fmt, audio)


def _slice_bytes(fmt: str) -> int:
    """Bytes of SLICE_S of audio (whole samples)."""
    return int(audio_codec.RATES[fmt] * SLICE_S) * (2 if fmt == "audio/pcm" else 1)


async def _append_slices(session: "Session", fmt: str, audio: str) -> None:
    pieces = []  # all decoded before any is pushed: a bad character refuses the whole append
    try:
        for piece in message_content.base64_slices(audio):
            pieces.append(piece)
            await asyncio.sleep(0)
    except (binascii.Error, ValueError):
        raise BadEvent("audio is not valid base64", param="audio") from None
    if fmt == "audio/pcm" and sum(map(len, pieces)) % 2:
        raise BadEvent("audio/pcm is 16-bit samples: an even number of bytes", param="audio")
    data, step = b"".join(pieces), _slice_bytes(fmt)
    for start in range(0, len(data), step):
        _push(session, fmt, data[start : start + step])
        await asyncio.sleep(0)


def _base64_audio(audio: str) -> bytes:
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise BadEvent("audio is not valid base64", param="audio") from None


def _push(session: "Session", fmt: str, data: bytes) -> None:
    if fmt == "audio/pcm" and len(data) % 2:
        raise BadEvent("audio/pcm is 16-bit samples: an even number of bytes", param="audio")
    if data:
        session.push_audio(audio_codec.to_frame(fmt, data))


def add_decoded(session: "Session", item_id: str, content: list[Any], previous: Any, event_id: Optional[str]) -> Later:
    """A user message with audio or images: decoded on the pool, the loop free meanwhile."""

    async def later() -> None:
        inbox, side = session.inbox, session.config.video_max_side
        fmt = session.settings["audio"]["input"]["format"]["type"]
        try:
            parts = await inbox.run(message_content.user_parts, content, fmt, side, inbox.pixels.allow)
        except message_content.ContentError as exc:
            raise BadEvent(str(exc), exc.code, exc.param) from None
        # Meanwhile the model may have added items (a reply, a turn the server VAD heard): checked
        # again, so the item goes where the client said or is refused.
        check_at_end(session, previous)
        if item_id in session.conversation:
            raise BadEvent(f"item {item_id!r} exists already", "invalid_value", "item.id")
        session.messages.add_user(item_id, parts, event_id)

    return later


def check_at_end(session: "Session", previous: Any) -> None:
    """`previous_item_id` names the conversation's last item (or is left out)."""
    last = session.conversation.last_id()
    # "root" asks for the beginning (LiveKit sends it for the first item): the end while empty.
    if previous is not None and previous != last and not (previous == "root" and last is None):
        raise BadEvent("items can only be added at the end of the conversation", "unsupported", "previous_item_id")


def tools_first(session: "Session", tools: Any, param: str, handle: Callable[[], None]) -> Optional[Later]:
    """`handle()` once `tools` (a field of the event it handles; param: its name) are checked on
    the pool; at once when there are none (or they are no list: `handle` says so)."""
    if not isinstance(tools, list) or not tools:
        handle()
        return None

    async def later() -> None:
        await session.inbox.run(tool_config.check_tools, tools, param)  # a refusal raises here
        handle()

    return later
