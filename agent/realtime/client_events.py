"""Client events: parse, validate, and hand each to the Session.

Malformed or unsupported events get an `error` event naming the client event (`event_id`) and,
where one field is at fault, that field (`param`); the session goes on. A session sends at
most `--max-events-per-s` events (a token bucket, bursts of a second's worth; appends that
carry at least 10 ms of audio are not counted): the excess is dropped and reported in one
`rate_limited` error a second, so a flooding client costs the loop little and slows no one
else. Events other than audio are at most 256 KiB. What clients send is
logged at debug level (type and top-level keys, never audio), to see what real clients use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from agent import metrics
from agent.engine.api import EngineBusy
from agent.realtime import message_content, response_checks, session_checks, session_config, slow_events
from agent.realtime.bad_event import BadEvent
from agent.realtime.call_outputs import UnknownCall
from agent.realtime.events import new_id
from agent.realtime.inbox import Later
from agent.realtime.mcp_calls import UnknownRequest
from agent.tools.spec import NAME

if TYPE_CHECKING:
    from agent.realtime.session import Session

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = slow_events.MAX_APPEND_BYTES * 4 // 3 + 64 * 1024  # base64 audio plus the JSON around it
_MAX_EVENT_CHARS = 256 * 1024  # any other event: instructions and text messages fit many times over
_AUDIO_EVENTS = ("input_audio_buffer.append", "conversation.item.create")
_MIN_AUDIO_CHARS = 428  # base64 of 10 ms of 16 kHz pcm16: an append that carries real audio
_MAX_ITEM_ID = 32  # characters in a client-chosen item id, as GA allows


def handle(session: "Session", message: str | bytes) -> None:
    if len(message) > MAX_MESSAGE_CHARS:
        if _admit(session):
            session.emit_error(f"client event too large ({len(message)} bytes)", "event_too_large")
        return
    try:
        event = json.loads(message)
    except (ValueError, UnicodeDecodeError):
        if _admit(session):
            session.emit_error("client events must be JSON", "invalid_json")
        return
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        given = event.get("event_id") if isinstance(event, dict) else None  # (answered with it, if it has one)
        if _admit(session):
            session.emit_error(
                "a client event is a JSON object with a string 'type'",
                "invalid_event",
                param="type",
                event_id=given if isinstance(given, str) else None,
            )
        return
    kind, event_id = event["type"], event.get("event_id")
    event_id = event_id if isinstance(event_id, str) else None
    # Audio is not counted: a client catching up after a stall sends its backlog at once, and
    # dropping it would cut the user's words. What it costs is bounded by the audio itself.
    carries_audio = (
        kind == "input_audio_buffer.append"
        and isinstance(event.get("audio"), str)
        and len(event["audio"]) >= _MIN_AUDIO_CHARS
    )
    if not carries_audio and not _admit(session):
        return
    if len(message) > _MAX_EVENT_CHARS and kind not in _AUDIO_EVENTS:
        session.emit_error(
            f"{kind} too large ({len(message)} bytes; at most {_MAX_EVENT_CHARS})", "event_too_large", event_id=event_id
        )
        return
    if kind != "input_audio_buffer.append":
        log.debug("session %s: %s %s", session.id, kind, sorted(k for k in event if k not in ("type", "event_id")))
    if not session.inbox.put(lambda: _dispatch(session, kind, event, event_id), len(message)):
        metrics.ERRORS.labels(where="event_backlog").inc()
        session.emit_error(
            f"{kind} dropped: too many client events wait behind one still being handled",
            "rate_limited",
            event_id=event_id,
        )


def _dispatch(session: "Session", kind: str, event: dict[str, Any], event_id: Optional[str]) -> Optional[Later]:
    """Handle one event, in its turn (agent/realtime/inbox.py): its error reported here; what
    its handler leaves for later, reported when it runs."""
    handler = _HANDLERS.get(kind)
    if handler is None:
        session.emit_error(f"unknown client event type {kind!r}", "unknown_event", param="type", event_id=event_id)
        return None
    with _reported(session, kind, event_id):
        later = handler(session, event)
        return None if later is None else lambda: _finish(session, kind, event_id, later)
    return None  # reported


async def _finish(session: "Session", kind: str, event_id: Optional[str], later: Later) -> None:
    with _reported(session, kind, event_id):
        await later()


@contextlib.contextmanager
def _reported(session: "Session", kind: str, event_id: Optional[str]) -> Iterator[None]:
    """An event's failure as the client's `error` event; the session goes on."""
    try:
        yield
    except BadEvent as exc:
        session.emit_error(str(exc), exc.code, param=exc.param, event_id=event_id)
    except session_config.ConfigError as exc:
        session.emit_error(str(exc), "invalid_value", param=exc.param, event_id=event_id)
    except EngineBusy:
        session.emit_error("engine is overloaded; try again", "engine_busy", kind="server_error", event_id=event_id)
    except Exception:  # a bug in one event's handling must not end the session
        log.exception("session %s: %s failed", session.id, kind)
        session.emit_error(f"{kind} failed on the server", "server_error", kind="server_error", event_id=event_id)


def _admit(session: "Session") -> bool:
    """Count one event against the session's rate; report drops (one error a second at most)."""
    rate = session.events_in
    allowed = rate.take()
    dropped = rate.report_due()  # also after a flood has stopped: the next event reports the rest
    if dropped is not None:
        metrics.ERRORS.labels(where="event_rate").inc()
        session.emit_error(
            f"too many client events (more than {rate.rate:g} a second): {dropped} dropped", "rate_limited"
        )
    return allowed


def _event_id(event: dict[str, Any]) -> Optional[str]:
    value = event.get("event_id")
    return value if isinstance(value, str) else None


def _session_update(session: "Session", event: dict[str, Any]) -> Optional[Later]:
    if "session" not in event:
        raise BadEvent("session.update needs a session object", "missing_required_parameter", "session")
    update = event["session"]
    # (A transcription session has no tools: it ignores them, as merge does.)
    tools = update.get("tools") if isinstance(update, dict) and "tools" in session.settings else None
    return slow_events.tools_first(session, tools, "session.tools", lambda: _update(session, update))


def _update(session: "Session", update: Any) -> None:
    if isinstance(update, dict) and set(update) - set(session.settings):
        log.debug(
            "session %s: session.update fields not served: %s", session.id, sorted(set(update) - set(session.settings))
        )
    merged = session_config.merge(session.settings, update, session.config.vad_silence_ms)
    session_checks.check_servable(merged, session.engine.voices, session.config.context_limit)
    if merged.get("type") == "realtime":
        session.mcp.check(merged.get("tools"), "session.tools")  # (its servers: listed once applied)
    if session_config.priority_of(merged) != session.priority:
        raise BadEvent(
            "omni.priority is set when the session is created (the offer's ?priority=)", param="session.omni.priority"
        )
    session.apply_settings(merged)


def _commit(session: "Session", event: dict[str, Any]) -> None:
    session.commit_audio(_event_id(event))


def _clear(session: "Session", event: dict[str, Any]) -> None:
    session.clear_audio()


def _item_create(session: "Session", event: dict[str, Any]) -> Optional[Later]:
    item = event.get("item")
    if not isinstance(item, dict):
        raise BadEvent("item must be an object", "missing_required_parameter", "item")
    previous = event.get("previous_item_id")
    if item.get("type") == "mcp_approval_response":  # (it names its request: the Agents SDK's previous)
        _approval(session, item)
        return None
    slow_events.check_at_end(session, previous)
    if item.get("type") == "function_call_output":
        _call_output(session, item, event)
        return None
    if item.get("type") == "function_call":
        return _call(session, item, event)
    if item.get("type") != "message" or item.get("role") not in ("user", "system", "assistant"):
        raise BadEvent(
            "only message, function_call, function_call_output and mcp_approval_response items can be added",
            "unsupported",
            "item.role" if item.get("type") == "message" else "item.type",
        )
    item_id = _new_item_id(session, item)
    fmt = session.settings["audio"]["input"]["format"]["type"]
    try:  # every part checked first: a bad one refuses the whole message
        if item["role"] == "system":
            session.messages.add_system(item_id, message_content.system_text(item.get("content")), _event_id(event))
        elif item["role"] == "assistant":
            session.messages.add_assistant(
                item_id, message_content.assistant_text(item.get("content")), _event_id(event)
            )
        elif message_content.needs_decoding(item.get("content")):
            return slow_events.add_decoded(session, item_id, item["content"], previous, _event_id(event))
        else:
            parts = message_content.user_parts(item.get("content"), fmt, session.config.video_max_side)
            session.messages.add_user(item_id, parts, _event_id(event))
    except message_content.ContentError as exc:
        raise BadEvent(str(exc), exc.code, exc.param) from None
    return None


def _call(session: "Session", item: dict[str, Any], event: dict[str, Any]) -> Later:
    """A function_call item: a call the client replays (a restored conversation). The events
    behind it wait for the engine to place it: an output for it must not outlive a refusal."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise BadEvent("a function_call names its call (call_id)", "missing_required_parameter", "item.call_id")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadEvent("a function_call's name is 1-64 letters, digits, _ or -", "invalid_value", "item.name")
    arguments = "" if arguments is None else arguments
    try:
        parsed = json.loads(arguments or "{}") if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise BadEvent("arguments must be a JSON object's text", "invalid_value", "item.arguments")
    item_id = _new_item_id(session, item)
    answer = session.call_outputs.add_call(item_id, call_id, name, arguments, _event_id(event))

    async def placed() -> None:
        await asyncio.wait({answer})  # a refusal is reported by the engine port, not raised here

    return placed


def _approval(session: "Session", item: dict[str, Any]) -> None:
    """An mcp_approval_response: the call it approves runs; one it refuses fails, with the reason."""
    request_id, approve, reason = item.get("approval_request_id"), item.get("approve"), item.get("reason")
    if not isinstance(request_id, str) or not request_id:
        raise BadEvent(
            "an mcp_approval_response names its request (approval_request_id)",
            "missing_required_parameter",
            "item.approval_request_id",
        )
    if not isinstance(approve, bool):
        raise BadEvent("approve must be true or false", "invalid_value", "item.approve")
    if reason is not None and not isinstance(reason, str):
        raise BadEvent("reason must be a string", "invalid_value", "item.reason")
    try:
        session.mcp.calls.answer(_new_item_id(session, item), request_id, approve, reason)
    except UnknownRequest as exc:
        raise BadEvent(str(exc), "invalid_value", "item.approval_request_id") from None


def _new_item_id(session: "Session", item: dict[str, Any]) -> str:
    """The item's id: the client's (unused so far) or a new one. GA holds a client's id to 32
    characters (a UUID's 36 is refused there), so a client tested here works there too."""
    given = item.get("id")
    if given is not None and not isinstance(given, str):
        raise BadEvent("Invalid type for 'item.id': expected a string.", "invalid_type", "item.id")
    if given and len(given) > _MAX_ITEM_ID:
        raise BadEvent(
            f"Invalid 'item.id': string too long. Expected a string with maximum length {_MAX_ITEM_ID}, "
            f"but got a string with length {len(given)} instead.",
            "string_above_max_length",
            "item.id",
        )
    item_id = given or new_id("item")
    if item_id in session.conversation:
        raise BadEvent(f"item {item_id!r} exists already", "invalid_value", "item.id")
    return item_id


def _call_output(session: "Session", item: dict[str, Any], event: dict[str, Any]) -> None:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise BadEvent(
            "a function_call_output names the call it answers (call_id)", "missing_required_parameter", "item.call_id"
        )
    if not isinstance(output, str):
        raise BadEvent("output must be a string (the function's result, e.g. JSON)", "invalid_value", "item.output")
    item_id = _new_item_id(session, item)
    try:
        session.add_call_output(item_id, call_id, output, _event_id(event))
    except UnknownCall as exc:
        raise BadEvent(str(exc), "invalid_value", "item.call_id") from None


def _item_retrieve(session: "Session", event: dict[str, Any]) -> None:
    item = session.conversation.get(str(event.get("item_id")))
    if item is None:
        # OpenAI's code and wording: pipecat's retrieve waits on this code and no other.
        raise BadEvent(
            f"Error retrieving item: the item with id {event.get('item_id')!r} does not exist.",
            "item_retrieve_invalid_item_id",
            "item_id",
        )
    current = session.replies.current
    if current is not None and current.item_id == item["id"]:
        # The message being made: its words so far (the Agents SDK retrieves it mid-reply; the
        # list keeps its text only from its end).
        item = current.item("in_progress", current.text)
    session.emit({"type": "conversation.item.retrieved", "item": item})


def _item_delete(session: "Session", event: dict[str, Any]) -> None:
    item_id = str(event.get("item_id"))
    if item_id not in session.conversation:
        raise BadEvent(
            f"Error deleting item: the item with id {item_id!r} does not exist.",
            "item_delete_invalid_item_id",
            "item_id",
        )
    session.delete_item(item_id, event.get("event_id"))


def _item_truncate(session: "Session", event: dict[str, Any]) -> None:
    end = event.get("audio_end_ms")
    if not isinstance(end, int) or isinstance(end, bool) or end < 0:
        raise BadEvent("audio_end_ms must be a non-negative integer", param="audio_end_ms")
    if event.get("content_index", 0) != 0:
        raise BadEvent("assistant items have one content part (content_index 0)", param="content_index")
    session.truncate(str(event.get("item_id")), end, _event_id(event))


def _response_create(session: "Session", event: dict[str, Any]) -> Optional[Later]:
    params = event.get("response")
    params = {} if params is None else params  # [] or "" are wrong types, not "no parameters"
    if not isinstance(params, dict):
        raise BadEvent("response must be an object", param="response")
    tools = params.get("tools")
    return slow_events.tools_first(session, tools, "response.tools", lambda: _respond(session, params, event))


def _respond(session: "Session", params: dict[str, Any], event: dict[str, Any]) -> None:
    # A null parameter is one not given (the session's value), as clients send them; for
    # `metadata` and `prompt` null is "none", which absent means too.
    params = {key: value for key, value in params.items() if value is not None}
    response_checks.check_response(params, session.settings, session.engine.voices)
    if session.input.in_turn and session.replies.current is None and not session.transcription_only:
        session.turn.split()  # the reply hears the speech so far: it is an item first
    session.replies.create_response(params, _event_id(event))


def _response_cancel(session: "Session", event: dict[str, Any]) -> None:
    response_id = event.get("response_id")
    if response_id is not None and not isinstance(response_id, str):
        raise BadEvent("response_id must be a string", param="response_id")
    session.replies.cancel_response(_event_id(event), response_id)


def _output_clear(session: "Session", event: dict[str, Any]) -> None:
    if not session.webrtc:
        raise BadEvent(
            "output_audio_buffer.clear is for WebRTC calls (WebSocket audio is the client's)", "unsupported", "type"
        )
    session.replies.clear_output()


_HANDLERS: dict[str, Callable[["Session", dict[str, Any]], Optional[Later]]] = {
    "session.update": _session_update,
    "input_audio_buffer.append": slow_events.append,
    "input_audio_buffer.commit": _commit,
    "input_audio_buffer.clear": _clear,
    "conversation.item.create": _item_create,
    "conversation.item.retrieve": _item_retrieve,
    "conversation.item.delete": _item_delete,
    "conversation.item.truncate": _item_truncate,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
    "output_audio_buffer.clear": _output_clear,
}
