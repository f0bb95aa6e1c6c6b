"""Function calling over the Realtime protocol, with the tiny model: the official `openai` SDK over
the WebSocket, and a plain aiortc peer over WebRTC (`oai-events`).

Pins:
- a session with two tools and a named tool_choice: the response's output is one function_call
  item (response.output_item.added → function_call_arguments.delta… → .done →
  response.output_item.done, response.done carrying it, no message item), its name is the named
  tool, its arguments parse and validate against that tool's schema and are exactly the deltas
  joined, the item announced with none (""); nothing of the call reaches a transcript delta or the audio;
- the client's function_call_output for that call_id joins the conversation, and the next
  response (tool_choice auto) is spoken to the end, with audio;
- response.tools with tool_choice required: the call names one of the response's own tools;
  usage counts the call's tokens; a session's required choice set before any tool (Pipecat)
  is kept, not refused;
- bad tools are refused with an `error` naming the field (an unknown function in tool_choice,
  an invalid schema, an output for an unknown call_id, a non-string output, an MCP tool on a
  server that allows none), the
  session unchanged; a text turn is answered after them;
- WebRTC: the session's tools and a required choice come with the offer; the spoken turn is
  answered with a function_call on the data channel and no audio on the track; the
  function_call_output and response.create sent on the channel get a reply spoken on the track;
- a replayed conversation (as LiveKit restores a chat context): a user message, a
  `function_call` item and its `function_call_output`, each added after the one before
  (previous_item_id), are taken in order, the call retrievable as it was given, and the next
  response is answered with a message; a function_call with no call_id, a bad name or arguments that are not a
  JSON object is refused naming the field;
- every server event validates strictly against the SDK's GA models.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import Events, ask_text, sdk_session

from agent.client.client import AgentClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
LIGHT = {
    "type": "function",
    "name": "set_light",
    "description": "Turn a room's light on or off.",
    "parameters": {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "hall", "office"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, LIGHT)}

agent = module_agent(max_reply_seconds=1.0, max_reply_tokens=12)


def _response_events(ev: Events, response_id: str) -> list[dict[str, Any]]:
    return [e for e in ev.all if e.get("response_id") == response_id or e.get("response", {}).get("id") == response_id]


async def test_named_call_then_output_then_spoken_reply(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(
            session={
                "type": "realtime",
                "tools": [WEATHER, LIGHT],
                "tool_choice": {"type": "function", "name": "set_light"},
            }
        )
        updated = await ev.wait("session.updated", 10)
        assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "set_light"]
        mark = len(ev.all)
        await ask_text(conn, "Please turn on the kitchen light.")
        done = await ev.wait("response.done", 120, after=mark)
        response = done["response"]
        assert response["status"] == "completed", response
        assert [o["type"] for o in response["output"]] == ["function_call"]
        call = response["output"][0]
        assert call["name"] == "set_light" and call["status"] == "completed"
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, SCHEMAS["set_light"])
        events = _response_events(ev, response["id"])
        kinds = [e["type"] for e in events]
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
        assert "".join(deltas) == call["arguments"]
        # Announced with no arguments yet (GA's added): a client appending the deltas to it gets them once.
        added = next(e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] != "message")
        assert (added["item"]["arguments"], added["item"]["status"]) == ("", "in_progress")
        args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert args_done["arguments"] == call["arguments"] and args_done["call_id"] == call["call_id"]
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done")
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
        # The call is never spoken and never a transcript.
        assert not [k for k in kinds if k.startswith("response.output_audio")]
        assert response["usage"]["output_token_details"]["text_tokens"] >= len(call["arguments"]) // 8

        mark = len(ev.all)
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": '{"ok": true}'}
        )
        added = await ev.wait("conversation.item.added", 10, after=mark)
        assert added["item"]["type"] == "function_call_output" and added["item"]["call_id"] == call["call_id"]
        await conn.response.create(response={"tool_choice": "auto"})
        done = await ev.wait("response.done", 120, after=mark)
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        spoken = [o for o in done["response"]["output"] if o["type"] == "message"]
        assert spoken and not [o for o in done["response"]["output"] if o["type"] == "function_call"]
        events = _response_events(ev, done["response"]["id"])
        assert [e for e in events if e["type"] == "response.output_audio.delta"], "the reply after the call is spoken"
        transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        assert "tool_call" not in transcript and "<tool_response>" not in transcript


async def test_response_tools_required(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        # Pipecat sets a required choice before it sends any tool: kept, not refused.
        await conn.session.update(session={"type": "realtime", "tool_choice": "required"})
        updated = await ev.wait("session.updated", 10)
        assert updated["session"]["tool_choice"] == "required" and not updated["session"]["tools"]
        mark = len(ev.all)
        await ask_text(conn, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required")
        done = await ev.wait("response.done", 120, after=mark)
        calls = [o for o in done["response"]["output"] if o["type"] == "function_call"]
        assert calls and all(c["name"] == "get_weather" for c in calls), done["response"]
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS["get_weather"])
        assert not [e for e in ev.all if e["type"] == "error"]


async def test_bad_tools_are_refused_and_the_session_goes_on(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "session.tool_choice.name"),
            (
                {"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": 7}}}}]},
                "session.tools[0].parameters",
            ),
            (
                # (this agent allows no MCP host: tests/integration/test_mcp_tools.py allows one)
                {"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9"}]},
                "session.tools[0].server_url",
            ),
            ({"tools": [WEATHER, WEATHER]}, "session.tools[1].name"),
        ]
        for update, param in bad:
            mark = len(ev.all)
            await conn.send({"type": "session.update", "event_id": f"bad-{param}", "session": update})
            error = await ev.wait("error", 10, after=mark)
            assert error["error"]["param"] == param, error
            assert error["error"]["event_id"] == f"bad-{param}"
        for item, param in (
            ({"type": "function_call_output", "call_id": "call_unknown", "output": "{}"}, "item.call_id"),
            ({"type": "function_call_output", "call_id": "call_unknown", "output": {"a": 1}}, "item.output"),
        ):
            mark = len(ev.all)
            await conn.send({"type": "conversation.item.create", "item": item})
            error = await ev.wait("error", 10, after=mark)
            assert error["error"]["param"] == param, error
        mark = len(ev.all)
        await conn.send(
            {
                "type": "response.create",
                "response": {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            }
        )
        error = await ev.wait("error", 10, after=mark)
        assert error["error"]["param"] == "response.tool_choice.name"
        # Nothing was taken: the session has no tools, and a text turn is answered with speech.
        mark = len(ev.all)
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        updated = await ev.wait("session.updated", 10, after=mark)
        assert updated["session"]["tools"] == [] and updated["session"]["tool_choice"] == "auto"
        await ask_text(conn, "Hello there.")
        done = await ev.wait("response.done", 120, after=mark)
        assert [o["type"] for o in done["response"]["output"]] == ["message"]


async def test_webrtc_call_output_and_spoken_reply(agent: RunningAgent, speech_wav: Path, strict_events) -> None:
    session = {"type": "realtime", "tools": [WEATHER, LIGHT], "tool_choice": "required"}
    client = AgentClient(agent.url, speech_wav, video=False, session=session)
    try:
        await client.connect()
        await client.wait_open()
        created = await client.wait_event("session.created", 10)
        assert [t["name"] for t in created["session"]["tools"]] == ["get_weather", "set_light"]
        done = await client.wait_event("response.done", 120)  # the spoken turn, answered with a call
        calls = [o for o in done["response"]["output"] if o["type"] == "function_call"]
        assert calls and not [o for o in done["response"]["output"] if o["type"] == "message"], done["response"]
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert client.result.audible_samples == 0, "a response that only calls plays nothing"
        mark = len(client.result.events)
        client.send({"type": "session.update", "session": {"type": "realtime", "tool_choice": "auto"}})
        client.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "21 C"},
            }
        )
        client.send({"type": "response.create"})
        for _ in range(1200):  # the next response, spoken on the track
            ended = [e for e in client.result.events[mark:] if e["type"] == "response.done"]
            if ended and client.result.of_type("output_audio_buffer.stopped"):
                break
            await asyncio.sleep(0.1)
        assert ended and [o["type"] for o in ended[0]["response"]["output"]] == ["message"], ended
        assert client.result.audible_samples > 0
    finally:
        await client.close()
    strict_events(client.result.events)
    assert not client.result.of_type("error"), client.result.of_type("error")


async def test_a_replayed_call_and_its_output_are_taken(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await ev.wait("session.updated", 10)
        mark = len(ev.all)
        history: list[dict[str, Any]] = [
            {
                "id": "item_r1",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Paris?"}],
            },
            {
                "id": "item_r2",
                "type": "function_call",
                "call_id": "call_r1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"id": "item_r3", "type": "function_call_output", "call_id": "call_r1", "output": '{"temp_c": 21}'},
        ]
        previous = None
        for item in history:
            event: dict[str, Any] = {"type": "conversation.item.create", "item": item}
            if previous is not None:
                event["previous_item_id"] = previous
            await conn.send(event)
            added = await ev.wait("conversation.item.added", 10, where=lambda e, i=item: e["item"]["id"] == i["id"])
            assert added["previous_item_id"] == previous
            previous = item["id"]
        assert not [e for e in ev.all[mark:] if e["type"] == "error"], ev.all[mark:]
        mark = len(ev.all)
        await conn.conversation.item.retrieve(item_id="item_r2")
        call = (await ev.wait("conversation.item.retrieved", 10, after=mark))["item"]
        assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
            "type": "function_call",
            "call_id": "call_r1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        }
        mark = len(ev.all)
        await conn.response.create(response={"output_modalities": ["text"], "tool_choice": "none"})
        done = await ev.wait("response.done", 120, after=mark)
        # Answered (the tiny model's random words may run to the token limit: "incomplete").
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        assert [o["type"] for o in done["response"]["output"]] == ["message"]
        assert not [e for e in ev.all[mark:] if e["type"] == "error"]

        for item, param in (
            ({"type": "function_call", "name": "get_weather", "arguments": "{}"}, "item.call_id"),
            ({"type": "function_call", "call_id": "c2", "name": "get weather", "arguments": "{}"}, "item.name"),
            ({"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "Paris"}, "item.arguments"),
            ({"type": "function_call", "call_id": "c4", "name": "get_weather", "arguments": "[1]"}, "item.arguments"),
        ):
            mark = len(ev.all)
            await conn.send({"type": "conversation.item.create", "item": item})
            error = await ev.wait("error", 10, after=mark)
            assert error["error"]["param"] == param, error
