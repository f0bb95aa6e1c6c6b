"""Conformance with the `openai` SDK's GA types, over a real WebSocket session (tiny model).

Pins:
- every client event shape the SDK's GA param TypedDicts allow (tests/support/ga_shapes.py:
  each optional field absent, then null, nested objects too) is served: session.update (a
  realtime and a transcription session), input_audio_buffer.append/commit/clear,
  conversation.item.create (a user message with input_text, with input_audio, with input_image;
  a system message),
  conversation.item.retrieve/delete/truncate, response.create, response.cancel,
  output_audio_buffer.clear. None of them gets an `error` for a null or absent optional field;
  the errors that remain are the session's state or a capability the agent does not have, each
  asserted by its code (REFUSED, and the cases named in the tests);
- a null field is one not given: session.updated keeps its value, except where GA null means
  off or none (NULL_MEANS_NONE: the echo holds null); the echoed session is whole (a
  turn_detection holds every field of its type, an audio/pcm format its rate, a transcription
  its model/language/prompt);
- every server event received validates (strict pydantic) against the SDK's GA server event
  union `RealtimeServerEvent`, or is one of the project's extra event types (EXTRAS): in the
  runs above and in a spoken turn with server VAD and input transcription (whose settings
  came as nulls); a WebSocket session that did not ask for the extra types (session.omni.events)
  gets none of them, even with input transcription on;
- a user message of text and an image is one item whose image part carries no bytes, and the
  reply's usage counts image tokens (the next reply's none); a bad image part (a URL to fetch)
  refuses the whole message, naming the part;
- a replayed history (user, assistant and system messages in turn, each assistant shape the SDK
  allows, an output_audio transcript and Pipecat's input_text one, announced as output_text)
  is added and a reply made over it; an assistant message
  right after an image not yet answered is refused and withdrawn (conversation.item.deleted);
- what client libraries send and expect: a first item placed at `previous_item_id: "root"`
  (LiveKit) is added; a later one there is refused (items are only added at the end); the
  default session's `max_output_tokens` is "inf"; response.cancel with no active response
  gets OpenAI's code and wording, and one naming another response cancels nothing; an item
  replaced by a delete and a create of its id sent back to back (LiveKit) is deleted, then
  added (the events after a delete or truncate wait for it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import aiohttp
import numpy as np
import pydantic
import pytest
from openai.types.realtime import RealtimeServerEvent
from openai.types.realtime.conversation_item_create_event_param import ConversationItemCreateEventParam
from openai.types.realtime.conversation_item_delete_event_param import ConversationItemDeleteEventParam
from openai.types.realtime.conversation_item_retrieve_event_param import ConversationItemRetrieveEventParam
from openai.types.realtime.conversation_item_truncate_event_param import ConversationItemTruncateEventParam
from openai.types.realtime.input_audio_buffer_append_event_param import InputAudioBufferAppendEventParam
from openai.types.realtime.input_audio_buffer_clear_event_param import InputAudioBufferClearEventParam
from openai.types.realtime.input_audio_buffer_commit_event_param import InputAudioBufferCommitEventParam
from openai.types.realtime.output_audio_buffer_clear_event_param import OutputAudioBufferClearEventParam
from openai.types.realtime.realtime_conversation_item_assistant_message_param import (
    RealtimeConversationItemAssistantMessageParam,
)
from openai.types.realtime.realtime_conversation_item_function_call_output_param import (
    RealtimeConversationItemFunctionCallOutputParam,
)
from openai.types.realtime.realtime_conversation_item_system_message_param import (
    RealtimeConversationItemSystemMessageParam,
)
from openai.types.realtime.realtime_conversation_item_user_message_param import (
    Content,
    RealtimeConversationItemUserMessageParam,
)
from openai.types.realtime.realtime_function_tool_param import RealtimeFunctionToolParam
from openai.types.realtime.realtime_response_create_params_param import RealtimeResponseCreateParamsParam
from openai.types.realtime.realtime_session_create_request_param import RealtimeSessionCreateRequestParam
from openai.types.realtime.realtime_transcription_session_create_request_param import (
    RealtimeTranscriptionSessionCreateRequestParam,
)
from openai.types.realtime.response_cancel_event_param import ResponseCancelEventParam
from openai.types.realtime.response_create_event_param import ResponseCreateEventParam
from openai.types.realtime.session_update_event_param import SessionUpdateEventParam
from support.ga_shapes import at, null_paths, shapes
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import b64, pcm24, picture

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent(max_reply_seconds=0.5, max_reply_tokens=4)

SERVER_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)
# Server event types outside the SDK's union: the project's extras (docs/realtime.md, "Project
# extras"), sent on a WebSocket only to a session that asks (session.omni.events).
EXTRAS = {
    "omni.response.mode",  # the degradation ladder changed level
    "omni.input_audio_transcription.partial",  # a transcription hypothesis with no new stable text
}
# Where GA null means off or none: the echo holds null there, not the value before.
NULL_MEANS_NONE = {
    ("tracing",),
    ("prompt",),
    ("include",),
    ("audio", "input", "turn_detection"),
    ("audio", "input", "transcription"),
    ("audio", "input", "noise_reduction"),
    ("audio", "input", "turn_detection", "idle_timeout_ms"),
}
TURN_DETECTION_FIELDS = {
    "server_vad": {
        "type",
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
        "idle_timeout_ms",
    },
    "semantic_vad": {"type", "eagerness", "create_response", "interrupt_response"},
}
SILENCE = base64.b64encode(bytes(2 * 4800)).decode()  # 200 ms of 24 kHz pcm16
PICTURE = picture()


def refused(shape: dict[str, Any], of: str = "session") -> Optional[tuple[str, str]]:
    """The (code, param) a session (or response) shape is refused with for a capability the
    agent lacks: it speaks audio/pcm at 24 kHz only."""
    fmt = ((shape.get("audio") or {}).get("output") or {}).get("format") or {}
    if fmt.get("type") in ("audio/pcmu", "audio/pcma"):
        return "invalid_value", f"{of}.audio.output.format"
    return None


class Conn:
    """A raw WebSocket session (nulls go out as sent): every server event is validated as it
    comes; `exchange` sends one client event and returns what it caused."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.events, self._barriers = ws, [], 0
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            event = json.loads(msg.data)
            if event["type"] in EXTRAS:
                assert isinstance(event.get("event_id"), str), event
            else:
                try:  # strict: a missing required field or a wrong type fails (extra fields may come)
                    SERVER_EVENT.validate_python(event, strict=True)
                except pydantic.ValidationError as exc:
                    raise AssertionError(f"not a GA server event: {event}") from exc
            self.events.append(event)

    async def wait(self, kind: str, after: int, timeout: float = 60) -> int:
        """The index of the first `kind` event from `after` on (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.events)):
                if self.events[i]["type"] == kind:
                    return i
            if self._task.done():
                self._task.result()  # a schema failure surfaces here
                raise AssertionError("the socket closed")
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind} in {[e['type'] for e in self.events[after:]]}")

    async def exchange(self, event: dict[str, Any], until: Optional[str] = None) -> list[dict[str, Any]]:
        """Send `event`, then a barrier (a retrieve of no item, whose error names it): the server
        handles events in order, so what `event` caused came before the barrier's error, and
        `until` (a reply's end) after it if not before. The barrier's error is left out."""
        start, self._barriers = len(self.events), self._barriers + 1
        barrier = f"barrier-{self._barriers}"
        await self.ws.send_str(json.dumps(event))
        await self.ws.send_str(json.dumps({"type": "conversation.item.retrieve", "item_id": "-", "event_id": barrier}))
        end = await self.wait("error", start)
        while self.events[end]["error"]["event_id"] != barrier:
            end = await self.wait("error", end + 1)
        if until is not None:
            end = max(end, await self.wait(until, start))
        return [
            e for e in self.events[start : end + 1] if not (e["type"] == "error" and e["error"]["event_id"] == barrier)
        ]

    async def close(self) -> None:
        await self.ws.close()
        self._task.cancel()
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()


@contextlib.asynccontextmanager
async def connected(agent: RunningAgent, query: str = "") -> AsyncIterator[tuple[Conn, dict]]:
    """A WebSocket session of the agent, from session.created to a close that re-raises what the
    reader's schema check found: yields the connection and the session it was created with."""
    async with aiohttp.ClientSession() as http:
        conn = Conn(await http.ws_connect(f"{agent.url}/v1/realtime{query}", protocols=("realtime",)))
        try:
            created = conn.events[await conn.wait("session.created", 0, timeout=10)]
            yield conn, created["session"]
        finally:
            await conn.close()


def errors(events: list[dict[str, Any]]) -> list[tuple[str, Optional[str]]]:
    return [(e["error"]["code"], e["error"]["param"]) for e in events if e["type"] == "error"]


def event_shapes(td: type, base: dict[str, Any]) -> list[dict[str, Any]]:
    """A client event's own shapes (event_id and its other optional fields absent, null)."""
    return shapes(td, base, depth=0)


def check_echo(before: dict[str, Any], update: dict[str, Any], echo: dict[str, Any]) -> None:
    """A null is not given (the value stays) unless null means none there; the echo is whole."""
    for path in null_paths(update):
        if path in NULL_MEANS_NONE:
            assert at(echo, path) == (True, None), path
            continue
        had, value = at(before, path)
        same_object = at(before, path[:-1] + ("type",)) == at(echo, path[:-1] + ("type",))
        if had and same_object:
            assert at(echo, path) == (True, value), path
    audio_in = echo["audio"]["input"]
    td = audio_in.get("turn_detection")
    if td is not None:
        assert set(td) == TURN_DETECTION_FIELDS[td["type"]] and None not in (td["type"], td.get("create_response"))
    formats = [audio_in["format"]] + ([echo["audio"]["output"]["format"]] if "output" in echo["audio"] else [])
    assert all(f.get("rate") == 24000 for f in formats if f["type"] == "audio/pcm"), formats
    if audio_in.get("transcription") is not None:
        assert {"model", "language", "prompt"} <= set(audio_in["transcription"]), audio_in["transcription"]


@pytest.mark.parametrize(
    "query, td, kind",
    [
        ("", RealtimeSessionCreateRequestParam, "realtime"),
        ("?intent=transcription", RealtimeTranscriptionSessionCreateRequestParam, "transcription"),
    ],
)
async def test_session_update_shapes(agent: RunningAgent, query: str, td: type, kind: str) -> None:
    async with connected(agent, query) as (conn, session):
        sent = 0
        for shape in shapes(td, {"type": kind}):
            for event in event_shapes(SessionUpdateEventParam, {"type": "session.update", "session": shape}):
                got = await conn.exchange(event)
                if refused(shape):
                    assert errors(got) == [refused(shape)], (shape, got)
                    continue
                assert not errors(got), (shape, errors(got))
                [updated] = [e for e in got if e["type"] == "session.updated"]
                check_echo(session, shape, updated["session"])
                session, sent = updated["session"], sent + 1
        assert sent >= 30  # (the shapes were generated: the SDK's types were read)


async def test_audio_buffer_and_item_shapes(agent: RunningAgent) -> None:
    async with connected(agent) as (conn, _):
        manual = {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
        assert not errors(await conn.exchange(manual))
        append = {"type": "input_audio_buffer.append", "audio": SILENCE}
        for event in event_shapes(InputAudioBufferAppendEventParam, append):
            assert not errors(await conn.exchange(event))
        for event in event_shapes(InputAudioBufferCommitEventParam, {"type": "input_audio_buffer.commit"}):
            await conn.exchange(append)
            got = await conn.exchange(event)
            assert not errors(got) and [e["type"] for e in got][:2] == [
                "input_audio_buffer.committed",
                "conversation.item.added",
            ]
        for event in event_shapes(InputAudioBufferClearEventParam, {"type": "input_audio_buffer.clear"}):
            await conn.exchange(append)
            got = await conn.exchange(event)
            assert not errors(got) and [e["type"] for e in got] == ["input_audio_buffer.cleared"]
        parts = [
            {"type": "input_text", "text": "hello"},
            {"type": "input_audio", "audio": SILENCE},
            {"type": "input_image", "image_url": PICTURE},
        ]
        items = []
        for part in [p for base in parts for p in shapes(Content, base, depth=0)]:
            user = {"type": "message", "role": "user", "content": [part]}
            for item in shapes(RealtimeConversationItemUserMessageParam, user, depth=0):
                base = {"type": "conversation.item.create", "item": item}
                for event in event_shapes(ConversationItemCreateEventParam, base):
                    got = await conn.exchange(event)
                    assert not errors(got), (event, errors(got))
                    added = [e for e in got if e["type"] == "conversation.item.added"]
                    assert len(added) == 1 and added[0]["item"]["content"][0]["type"] == part["type"]
                    items.append(added[0]["item"]["id"])
        assert len(items) == 24
        system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}
        for item in shapes(RealtimeConversationItemSystemMessageParam, system, depth=0):
            got = await conn.exchange({"type": "conversation.item.create", "item": item})
            assert not errors(got), (item, errors(got))
            [added] = [e["item"] for e in got if e["type"] == "conversation.item.added"]
            assert added["role"] == "system" and added["content"] == [{"type": "input_text", "text": "Be brief."}]
        retrieve = {"type": "conversation.item.retrieve", "item_id": items[-1]}
        for event in event_shapes(ConversationItemRetrieveEventParam, retrieve):
            got = await conn.exchange(event)
            assert not errors(got) and got[0]["type"] == "conversation.item.retrieved"
        out_clear = {"type": "output_audio_buffer.clear"}
        for event in event_shapes(OutputAudioBufferClearEventParam, out_clear):
            # WebSocket audio is the client's to play: a WebRTC call's event, refused here.
            assert errors(await conn.exchange(event)) == [("unsupported", "type")]


async def test_response_shapes(agent: RunningAgent) -> None:
    async with connected(agent) as (conn, _):
        hello = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
        assert not errors(await conn.exchange({"type": "conversation.item.create", "item": hello}))
        last = None
        creates = [{"type": "response.create"}]  # no `response` at all, then each params shape
        for params in shapes(RealtimeResponseCreateParamsParam, {}):
            creates += event_shapes(ResponseCreateEventParam, {"type": "response.create", "response": params})
        for event in creates:
            if refused(event.get("response") or {}, "response"):
                assert errors(await conn.exchange(event)) == [refused(event["response"], "response")]
                continue
            got = await conn.exchange(event, until="response.done")
            assert not errors(got), (event, errors(got))
            done = [e for e in got if e["type"] == "response.done"]
            assert done[0]["response"]["status"] in ("completed", "incomplete"), done[0]["response"]
            last = done[0]["response"]
        assert len(creates) >= 20 and last["output"][0]["content"][0]["type"] == "output_audio"
        truncate = {"type": "conversation.item.truncate", "item_id": last["output"][0]["id"]}
        truncate |= {"content_index": 0, "audio_end_ms": 0}
        for event in event_shapes(ConversationItemTruncateEventParam, truncate):
            got = await conn.exchange(event, until="conversation.item.truncated")
            assert not errors(got)
        for event in event_shapes(ConversationItemDeleteEventParam, {"type": "conversation.item.delete"}):
            reply = await conn.exchange({"type": "response.create"}, until="response.done")
            item_id = [e for e in reply if e["type"] == "response.done"][0]["response"]["output"][0]["id"]
            got = await conn.exchange({**event, "item_id": item_id}, until="conversation.item.deleted")
            assert not errors(got)
        for event in event_shapes(ResponseCancelEventParam, {"type": "response.cancel"}):
            # With no response in flight the cancel is refused for the state; with one, it
            # is cancelled (or had already ended: refused the same way).
            assert errors(await conn.exchange(event)) == [("response_cancel_not_active", None)]
            start = len(conn.events)
            await conn.ws.send_str(json.dumps({"type": "response.create"}))
            got = await conn.exchange(event, until="response.done")
            done = conn.events[await conn.wait("response.done", start)]
            assert errors(got) in ([], [("response_cancel_not_active", None)])
            assert (done["response"]["status"] == "cancelled") == (not errors(got)), done["response"]


async def test_a_message_with_an_image(agent: RunningAgent) -> None:
    """Text and an image in one user message: one item (no image bytes echoed), and the reply's
    usage counts the image's tokens; a bad image refuses the whole message."""
    async with connected(agent) as (conn, _):
        message = {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in this picture?"},
                {"type": "input_image", "image_url": PICTURE, "detail": "low"},
            ],
        }
        got = await conn.exchange({"type": "conversation.item.create", "item": message})
        assert not errors(got)
        [added] = [e["item"] for e in got if e["type"] == "conversation.item.added"]
        assert added["content"] == [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "detail": "low", "image_url": None},
        ]
        got = await conn.exchange({"type": "response.create"}, until="response.done")
        [done] = [e["response"] for e in got if e["type"] == "response.done"]
        assert done["usage"]["input_token_details"]["image_tokens"] > 0, done["usage"]
        # The next reply's turn has no image: it went with the answered one.
        got = await conn.exchange({"type": "response.create"}, until="response.done")
        [done] = [e["response"] for e in got if e["type"] == "response.done"]
        assert done["usage"]["input_token_details"]["image_tokens"] == 0, done["usage"]
        bad = {
            **message,
            "content": [message["content"][0], {"type": "input_image", "image_url": "https://x.test/a.png"}],
        }
        got = await conn.exchange({"type": "conversation.item.create", "item": bad, "event_id": "bad-image"})
        assert errors(got) == [("unsupported", "item.content[1].image_url")]
        assert [e["error"]["event_id"] for e in got if e["type"] == "error"] == ["bad-image"]
        assert not [e for e in got if e["type"] == "conversation.item.added"]


async def test_a_replayed_history(agent: RunningAgent) -> None:
    """User, assistant and system messages in turn, as the Agents SDK's updateHistory sends
    them, then a reply over them; an assistant message the model cannot place is withdrawn."""
    async with connected(agent) as (conn, _):
        user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]}
        spoken = {"type": "message", "role": "assistant", "content": [{"type": "output_audio", "transcript": "Hey."}]}
        # Pipecat's assistant message: its text typed input_text (announced as GA's output_text).
        pipecat = {"type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "Hello!"}]}
        sent = 0
        for item in [*shapes(RealtimeConversationItemAssistantMessageParam, answer, depth=0), spoken, pipecat]:
            assert not errors(await conn.exchange({"type": "conversation.item.create", "item": user}))
            got = await conn.exchange({"type": "conversation.item.create", "item": item})
            assert not errors(got), (item, errors(got))
            [added] = [e["item"] for e in got if e["type"] == "conversation.item.added"]
            assert added["role"] == "assistant" and added["content"][0]["text"] in ("Hello!", "Hey.")
            assert added["content"][0]["type"] == "output_text"
            sent += 1
        assert sent == 4
        system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}
        assert not errors(await conn.exchange({"type": "conversation.item.create", "item": system}))
        got = await conn.exchange({"type": "response.create"}, until="response.done")
        assert not errors(got)
        [done] = [e["response"] for e in got if e["type"] == "response.done"]
        assert done["status"] in ("completed", "incomplete")
        # An image waits for its answer: an assistant message cannot come between them.
        image = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": PICTURE}]}
        assert not errors(await conn.exchange({"type": "conversation.item.create", "item": image}))
        start = len(conn.events)
        await conn.exchange(
            {"type": "conversation.item.create", "item": {**answer, "id": "item_replayed"}, "event_id": "early"}
        )
        # (the engine's refusal comes after the barrier: it answers on its own thread)
        got = conn.events[start : await conn.wait("conversation.item.deleted", start) + 1]
        got = [e for e in got if not (e["type"] == "error" and e["error"]["event_id"].startswith("barrier"))]
        assert errors(got) == [("invalid_value", "item")]
        assert [e["error"]["event_id"] for e in got if e["type"] == "error"] == ["early"]
        assert [
            e["type"]
            for e in got
            if e.get("item_id") == "item_replayed" or e.get("item", {}).get("id") == "item_replayed"
        ] == [
            "conversation.item.added",
            "conversation.item.done",
            "conversation.item.deleted",
        ]
        got = await conn.exchange({"type": "conversation.item.retrieve", "item_id": "item_replayed"})
        assert errors(got) == [("item_retrieve_invalid_item_id", "item_id")]


async def test_spoken_turn_events(agent: RunningAgent, speech_wav: Path) -> None:
    async with connected(agent) as (conn, _):
        transcribed = {"transcription": {"model": None, "language": None, "prompt": None}}
        update = {"type": "session.update", "session": {"type": "realtime", "audio": {"input": transcribed}}}
        assert not errors(await conn.exchange(update))
        start = len(conn.events)
        pcm = np.concatenate([pcm24(speech_wav), np.zeros(24_000, np.int16)])  # a second of silence ends it
        begun = time.monotonic()
        for i, offset in enumerate(range(0, len(pcm), 480)):  # 20 ms appends, paced like a microphone
            await conn.ws.send_str(
                json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[offset : offset + 480])})
            )
            await asyncio.sleep(max(0.0, begun + (i + 1) * 0.02 - time.monotonic()))
        await conn.wait("response.done", start)
        await conn.wait("conversation.item.input_audio_transcription.completed", start)
        kinds = {e["type"] for e in conn.events[start:]}
        assert not errors(conn.events[start:])
        assert {
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "response.output_audio.delta",
            "response.output_audio_transcript.done",
        } <= kinds, kinds
        assert not kinds & EXTRAS, kinds  # this session did not ask for them


async def test_what_client_libraries_send_and_expect(agent: RunningAgent) -> None:
    async with connected(agent) as (conn, session):
        assert session["max_output_tokens"] == "inf"
        hello = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
        first = await conn.exchange({"type": "conversation.item.create", "previous_item_id": "root", "item": hello})
        added = [e for e in first if e["type"] == "conversation.item.added"]
        assert not errors(first) and len(added) == 1 and added[0]["previous_item_id"] is None
        again = {"type": "conversation.item.create", "previous_item_id": "root", "item": hello}
        assert errors(await conn.exchange(again)) == [("unsupported", "previous_item_id")]
        none = [e for e in await conn.exchange({"type": "response.cancel"}) if e["type"] == "error"]
        assert none[0]["error"]["message"] == "Cancellation failed: no active response found"
        start = len(conn.events)
        await conn.ws.send_str(json.dumps({"type": "response.create"}))
        other = {"type": "response.cancel", "response_id": "resp_not_this_one"}
        assert errors(await conn.exchange(other)) == [("response_cancel_not_active", None)]
        done = conn.events[await conn.wait("response.done", start)]
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        bad = {"type": "response.cancel", "response_id": 7}
        assert errors(await conn.exchange(bad)) == [("invalid_value", "response_id")]
        # LiveKit replaces an item by a delete and a create of the same id, back to back: the
        # create sees the list as the delete left it (it was refused, the item still the last).
        reply_id, start = done["response"]["output"][0]["id"], len(conn.events)
        await conn.ws.send_str(json.dumps({"type": "conversation.item.delete", "item_id": reply_id}))
        edited = {
            "id": reply_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi."}],
        }
        after = {"type": "conversation.item.create", "previous_item_id": added[0]["item"]["id"], "item": edited}
        await conn.exchange(after)
        replaced = [e for e in conn.events[start:] if e["type"] != "error" or e["error"]["event_id"] is None]
        kinds = [(e["type"], e.get("item_id") or e.get("item", {}).get("id")) for e in replaced]
        assert kinds[:2] == [("conversation.item.deleted", reply_id), ("conversation.item.added", reply_id)], replaced
        assert not errors(replaced), replaced


async def test_function_call_shapes(agent: RunningAgent) -> None:
    """Function tools in every shape the SDK allows (optional fields absent, null), a named call,
    and the result in every function_call_output shape: no error, every server event GA."""
    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
    async with connected(agent) as (conn, _):
        tool = {"type": "function", "name": "switch", "parameters": schema}
        for shape in shapes(RealtimeFunctionToolParam, {"name": "switch"}, depth=0) + [tool]:
            update = {
                "type": "session.update",
                "session": {"type": "realtime", "tools": [shape], "tool_choice": None},
            }
            got = await conn.exchange(update, until="session.updated")
            assert not errors(got), (shape, errors(got))
            echoed = [e for e in got if e["type"] == "session.updated"][-1]["session"]
            assert [t["name"] for t in echoed["tools"]] == ["switch"] and echoed["tool_choice"] == "auto"
        hello = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "lights on"}]}
        assert not errors(await conn.exchange({"type": "conversation.item.create", "item": hello}))
        named = {"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "switch"}}}
        got = await conn.exchange(named, until="response.done")
        assert not errors(got), errors(got)
        output = [e for e in got if e["type"] == "response.done"][0]["response"]["output"]
        assert [o["type"] for o in output] == ["function_call"] and json.loads(output[0]["arguments"])["on"] in (
            True,
            False,
        )
        base = {"type": "function_call_output", "call_id": output[0]["call_id"], "output": "done"}
        for item in shapes(RealtimeConversationItemFunctionCallOutputParam, base, depth=0):
            got = await conn.exchange({"type": "conversation.item.create", "item": item})
            assert not errors(got), (item, errors(got))
            added = [e for e in got if e["type"] == "conversation.item.added"]
            assert len(added) == 1 and added[0]["item"]["type"] == "function_call_output"
        got = await conn.exchange(
            {"type": "response.create", "response": {"tool_choice": "none"}}, until="response.done"
        )
        assert not errors(got) and [o["type"] for o in got[-1]["response"]["output"]] == ["message"]
