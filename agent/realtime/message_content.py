"""A message the client adds (conversation.item.create): its content parts, checked whole.

GA clients send a user message as a list of parts: `input_text` (text), `input_audio` (base64 in
the session's input format) and `input_image` (a PNG or JPEG as a data URL, with an optional
`detail`). Every part is decoded and checked before anything reaches the engine, so a bad part
refuses the whole message and leaves the conversation as it was.

A system message holds input_text parts only; its text joins the conversation where it is added
(agent/engine/runner/edits.py `add_system_text`), the session's instructions left as they are.
An assistant message (a client replaying a conversation) holds output_text parts, or
output_audio ones whose transcript is taken (no audio is replayed).

Where the parts go in the model's user turn: audio joins the turn's audio (as if spoken), images
are shown after the audio and the camera's frames, text closes the message (the engine's order,
agent/engine/stages/reply_prefill.py), whatever their order in the item.

A message with audio or images is decoded on the server's decode pool, not on the loop (the
session's later events wait for it: agent/realtime/inbox.py); nothing here touches what the loop
owns. A data URL within the event size limit decodes in tens of milliseconds (a JPEG at a
reduced scale, straight from its DCT), and the sides are brought to what
the vision encoder is given: `detail` "low" to the camera frames' longer side
(Config.video_max_side, 448: ~200 vision tokens), "high" and "auto" to twice that. The agent
fetches no URL: a model server that dereferences client URLs is a way into the network it sits on.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np

from agent.realtime import audio_codec

MAX_PARTS = 16  # content parts in one message
MAX_IMAGES = 4  # input_image parts in one message (the engine shows at most 8 a turn)
MAX_SOURCE_PIXELS = 3840 * 2160  # 4K: a larger image is refused before it is decoded
MAX_ASPECT = 150  # the vision processor refuses 200:1 and beyond
# What one session may have decoded is bounded (a token bucket of pixels, its inbox's): a 1080p
# picture's worth a second, in bursts of two 4K ones. A PNG decodes at 10-20 ms a megapixel on
# one core: at most a few tens of ms a second of a pool thread per session, so one session's
# pictures neither starve the others' nor take the engine's core.
PIXELS_PER_S = 1920 * 1080
PIXELS_BURST = 2 * MAX_SOURCE_PIXELS
DETAILS = ("auto", "low", "high")
BASE64_SLICE = 1 << 20  # characters decoded at a time (a multiple of 4): ~1.5 ms
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg)(?:;[^,;]*)*;base64,", re.IGNORECASE)


class ContentError(ValueError):
    """A part the message cannot carry; `param` names it (item.content[i]...)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class AudioPart:
    pcm16k: np.ndarray  # float32 mono 16 kHz
    transcript: Optional[str] = None  # the client's own, kept in the item as given


@dataclass(frozen=True)
class ImagePart:
    image: np.ndarray  # RGB uint8 HxWx3, sized for the vision encoder
    detail: str


UserPart = Union[TextPart, AudioPart, ImagePart]


def user_parts(
    content: Any, input_format: str, max_side: int, budget: Callable[[int], bool] = lambda pixels: True
) -> list[UserPart]:
    """The message's parts, decoded, in the item's order. `input_format`: the session's input
    audio format; `max_side`: the camera frames' longer side (what detail "low" gets);
    `budget(pixels)`: whether an image of that many pixels may be decoded now (the session's
    bucket, charged when it may)."""
    content = _part_list(content, "a user message", "parts (objects)")
    if sum(p.get("type") == "input_image" for p in content) > MAX_IMAGES:
        raise ContentError(f"a user message holds at most {MAX_IMAGES} images", "item.content")
    return [_part(part, f"item.content[{i}]", input_format, max_side, budget) for i, part in enumerate(content)]


def needs_decoding(content: Any) -> bool:
    """Whether a user message's parts hold audio or images (decoded off the loop)."""
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in ("input_audio", "input_image") for part in content
    )


def _part(
    part: dict[str, Any], where: str, input_format: str, max_side: int, budget: Callable[[int], bool]
) -> UserPart:
    kind = part.get("type")
    if kind == "input_text":
        if not isinstance(part.get("text"), str):
            raise ContentError("input_text needs text (a string)", f"{where}.text")
        return TextPart(part["text"])
    if kind == "input_audio":
        data = _base64(part.get("audio"), f"{where}.audio", "audio")
        if input_format == "audio/pcm" and len(data) % 2:
            raise ContentError("audio/pcm is 16-bit samples: an even number of bytes", f"{where}.audio")
        transcript = part.get("transcript")
        if transcript is not None and not isinstance(transcript, str):
            raise ContentError("an input_audio transcript is a string", f"{where}.transcript")
        return AudioPart(audio_codec.to_16k(input_format, data), transcript)
    if kind == "input_image":
        detail = part.get("detail") or "auto"
        if detail not in DETAILS:
            raise ContentError(f"detail must be one of {', '.join(DETAILS)}", f"{where}.detail")
        side = max_side if detail == "low" else 2 * max_side
        return ImagePart(decode_image(part.get("image_url"), side, f"{where}.image_url", budget), detail)
    raise ContentError(
        "a part is input_text with text, input_audio with audio or input_image with image_url",
        f"{where}.type",
        "unsupported",
    )


def _base64(value: Any, param: str, what: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ContentError(f"{what} must be a base64 string", param)
    try:
        return b"".join(base64_slices(value))
    except (binascii.Error, ValueError):
        raise ContentError(f"{what} is not valid base64", param) from None


def base64_slices(value: str) -> Iterator[bytes]:
    """`value` decoded BASE64_SLICE characters at a time (strict: padding only at the very end;
    raises binascii.Error). In slices because binascii holds the interpreter: between slices the
    loop's thread gets its turn (a pool thread decoding), or the loop itself does (an append)."""
    for start in range(0, len(value), BASE64_SLICE):
        piece = value[start : start + BASE64_SLICE]
        if "=" in piece and start + BASE64_SLICE < len(value):  # b64decode would take it mid-way
            raise binascii.Error("padding before the end")
        yield base64.b64decode(piece, validate=True)


def decode_image(url: Any, side: int, param: str, budget: Callable[[int], bool] = lambda pixels: True) -> np.ndarray:
    """A PNG or JPEG data URL as RGB uint8, its longer side at most `side` (aspect kept); only
    when `budget` admits its pixels (read from its header, before decoding)."""
    from PIL import Image

    if not isinstance(url, str) or not url:
        raise ContentError("input_image needs image_url: a data URL (data:image/png;base64,...)", param)
    match = _DATA_URL.match(url)
    if match is None:
        if url.startswith(("http://", "https://")):
            raise ContentError("image_url must be a data URL: the agent fetches no URL", param, "unsupported")
        raise ContentError("image_url must be a PNG or JPEG data URL (data:image/png;base64,...)", param)
    data = _base64(url[match.end() :], param, "the image")
    try:
        with Image.open(io.BytesIO(data), formats=("PNG", "JPEG")) as im:
            width, height = im.size
            if width * height > MAX_SOURCE_PIXELS:
                raise ContentError(f"the image is {width}x{height}: at most {MAX_SOURCE_PIXELS:,} pixels", param)
            if max(width, height) > MAX_ASPECT * min(width, height):
                raise ContentError(f"the image is {width}x{height}: its sides at most {MAX_ASPECT}:1", param)
            if not budget(width * height):
                raise ContentError(
                    f"images come faster than one session may have them decoded ({PIXELS_PER_S:,} pixels a "
                    "second): send fewer or smaller ones",
                    param,
                    "rate_limited",
                )
            if im.format == "JPEG":
                im.draft("RGB", (side, side))  # decode at 1/2, 1/4 or 1/8 scale where that is enough
            rgb = im.convert("RGB")
    except ContentError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ContentError("image_url does not hold a readable PNG or JPEG image", param) from None
    if max(rgb.size) > side:
        rgb.thumbnail((side, side), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))


def system_text(content: Any) -> str:
    """A system message's text: its input_text parts (the only kind GA gives it; the SDK's type
    makes `type` optional), joined."""
    fields = {"input_text": "text", None: "text"}
    return _texts(
        content, "a system message", "input_text parts", fields, "a system message holds input_text parts only"
    )


def assistant_text(content: Any) -> str:
    """An assistant message's text: its output_text parts' text and output_audio parts'
    transcripts (a replayed conversation's words; audio bytes are not taken), joined. Text
    parts typed `input_text` (Pipecat sends its assistant messages so) or the beta's `text` are
    taken as output_text: a refusal there stops Pipecat's session. The item is announced with
    GA's output_text all the same."""
    return _texts(
        content,
        "an assistant message",
        "output_text parts",
        {"output_text": "text", "output_audio": "transcript", "input_text": "text", "text": "text"},
        "an assistant message holds output_text (or output_audio with a transcript) parts",
    )


def _texts(content: Any, message: str, kinds: str, fields: dict[Any, str], only: str) -> str:
    """The text of each part, by its type's field in `fields` (a type not there: `only`, the
    error), joined with newlines."""
    texts = []
    for i, part in enumerate(_part_list(content, message, kinds)):
        field = fields.get(part.get("type"))
        if field is None:
            raise ContentError(only, f"item.content[{i}].type", "unsupported")
        if not isinstance(part.get(field), str):
            kind = part.get("type") or "input_text"
            raise ContentError(f"{kind} needs {field} (a string)", f"item.content[{i}].{field}")
        texts.append(part[field])
    return "\n".join(texts)


def _part_list(content: Any, message: str, kinds: str) -> list[dict[str, Any]]:
    """`content` as a message's parts: a list of 1 to MAX_PARTS objects (`message`, e.g. "a
    user message", and `kinds` name them in the error)."""
    if not isinstance(content, list) or not content or not all(isinstance(p, dict) for p in content):
        raise ContentError(f"{message}'s content is a list of {kinds}", "item.content")
    if len(content) > MAX_PARTS:
        raise ContentError(f"{message} holds at most {MAX_PARTS} parts", "item.content")
    return content


def item_content(parts: list[UserPart]) -> list[dict[str, Any]]:
    """The item's content as the conversation keeps and announces it. Audio and image bytes are
    not kept (they live in the model's cache), as for the committed audio buffer."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append({"type": "input_text", "text": part.text})
        elif isinstance(part, AudioPart):
            out.append({"type": "input_audio", "transcript": part.transcript})
        else:
            out.append({"type": "input_image", "detail": part.detail, "image_url": None})
    return out
