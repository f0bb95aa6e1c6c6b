"""MCP tools through the official `openai` SDK over the WebSocket, by base URL only, against a real
MCP server (the `mcp` package's MCPServer, FastMCP's successor) on loopback, with the tiny model.

Pins:
- a session.update naming the server lists its tools: conversation.item.added of an
  `mcp_list_tools` item (no tools yet) and mcp_list_tools.in_progress before session.updated,
  then conversation.item.done with the tools `allowed_tools` lets through (with their input
  schemas) and mcp_list_tools.completed; the headers and the authorization token reach the
  server;
- a response whose tool_choice names the server's tool (require_approval "never"): one
  `mcp_call` item (output_item.added with no arguments, mcp_call_arguments.delta… joined equal
  to .done's arguments), response.mcp_call.in_progress, response.done carrying the item
  without output, then response.mcp_call.completed, output_item.done and conversation.item.done
  with the server's own result as `output`; the server ran exactly that call; the next
  response (the client's, as GA asks) is answered with a message;
- approval: the call is an `mcp_approval_request` item and nothing runs until the client's
  `mcp_approval_response`; approved, a new `mcp_call` naming the request runs; refused, it
  fails with the reason and the server never sees it;
- a tool that raises fails the call (response.mcp_call.failed, a tool_execution_error), a
  server that is down fails its listing (mcp_list_tools.failed), a host the operator did not
  allow is refused naming server_url; no other `error`; the session goes on;
- a function tool keeps its name: a call of it is the client's function_call even when an MCP
  server lists a tool of that name, which never runs;
- every server event validates strictly against the SDK's GA models.
"""

from __future__ import annotations

import json

import pytest
from support.mcp_server import FORECASTS, mcp_server
from support.realtime_helpers import RunningAgent, module_agent
from support.realtime_ws import Events, ask_text, sdk_session

pytestmark = pytest.mark.asyncio(loop_scope="module")

agent = module_agent(mcp_allow=("127.0.0.1",), mcp_timeout_s=10.0, max_reply_tokens=12)


def _mcp(url: str, **extra: object) -> dict:
    return {"type": "mcp", "server_label": "weather", "server_url": url, **extra}


async def _listed(conn, ev: Events, tool: dict) -> dict:
    """session.update with the tool; returns the listing's item as done, once completed."""
    mark = len(ev.all)
    await conn.session.update(session={"type": "realtime", "tools": [tool]})
    completed = await ev.wait("mcp_list_tools.completed", 30, after=mark)
    kinds = [e["type"] for e in ev.all[mark:]]
    added = next(e for e in ev.all[mark:] if e["type"] == "conversation.item.added")
    assert added["item"]["type"] == "mcp_list_tools" and added["item"]["tools"] == []
    assert kinds.index("conversation.item.added") < kinds.index("mcp_list_tools.in_progress")
    assert kinds.index("mcp_list_tools.in_progress") < kinds.index("session.updated")
    done = next(
        e for e in ev.all[mark:] if e["type"] == "conversation.item.done" and e["item"]["id"] == completed["item_id"]
    )
    assert kinds.index("conversation.item.done") < kinds.index("mcp_list_tools.completed")
    assert added["item"]["id"] == completed["item_id"]
    return done["item"]


async def test_a_listed_tool_is_called_by_the_agent(agent: RunningAgent, strict_event) -> None:
    with mcp_server() as server:
        async with sdk_session(agent.url, strict_event) as (conn, ev):
            await ev.wait("session.created", 10)
            tool = _mcp(
                server.url,
                allowed_tools=["forecast", "broken"],
                require_approval="never",
                headers={"X-Desk": "front"},
                authorization="token-123",
            )
            listing = await _listed(conn, ev, tool)
            assert listing["server_label"] == "weather"
            assert sorted(t["name"] for t in listing["tools"]) == ["broken", "forecast"]  # book_table filtered
            schema = next(t for t in listing["tools"] if t["name"] == "forecast")["input_schema"]
            assert schema["properties"]["city"]["enum"] == ["Paris", "Oslo"]
            assert any(
                h.get("x-desk") == "front" and h.get("authorization") == "Bearer token-123" for h in server.headers
            )

            mark = len(ev.all)
            await ask_text(conn, "Weather?", tool_choice={"type": "mcp", "server_label": "weather", "name": "forecast"})
            done = await ev.wait("response.done", 60, after=mark)
            completed = await ev.wait("response.mcp_call.completed", 30, after=mark)
            item_done = await ev.wait(
                "conversation.item.done", 10, after=mark, where=lambda e: e["item"]["id"] == completed["item_id"]
            )
            events = ev.all[mark:]
            kinds = [e["type"] for e in events]
            calls = [o for o in done["response"]["output"] if o["type"] == "mcp_call"]
            assert len(calls) == 1 and calls[0]["name"] == "forecast" and calls[0]["output"] is None, done
            item_id = calls[0]["id"]
            added = next(e for e in events if e["type"] == "response.output_item.added" and e["item"]["id"] == item_id)
            assert added["item"]["arguments"] == ""
            deltas = "".join(e["delta"] for e in events if e["type"] == "response.mcp_call_arguments.delta")
            args_done = next(e for e in events if e["type"] == "response.mcp_call_arguments.done")
            assert deltas == args_done["arguments"] == calls[0]["arguments"]
            city = json.loads(args_done["arguments"])["city"]
            assert kinds.index("response.mcp_call.in_progress") > kinds.index("response.mcp_call_arguments.done")
            # GA's order: the response ends, then the call's end follows.
            assert kinds.index("response.done") < kinds.index("response.mcp_call.completed")
            output_done = next(
                e for e in events if e["type"] == "response.output_item.done" and e["item"]["id"] == item_id
            )
            assert kinds.index("response.mcp_call.completed") < events.index(output_done) < events.index(item_done)
            assert item_done["item"]["output"] == f"{city}: {FORECASTS[city]}" and item_done["item"]["error"] is None
            assert server.calls == [("forecast", {"city": city})]

            mark = len(ev.all)
            await conn.response.create(response={"tool_choice": "none"})
            answer = await ev.wait("response.done", 60, after=mark)
            assert [o["type"] for o in answer["response"]["output"]] == ["message"]

            # A tool that raises: the call fails, the session goes on.
            mark = len(ev.all)
            await ask_text(conn, "Again.", tool_choice={"type": "mcp", "server_label": "weather", "name": "broken"})
            failed = await ev.wait("response.mcp_call.failed", 60, after=mark)
            item = (
                await ev.wait(
                    "conversation.item.done", 10, after=mark, where=lambda e: e["item"]["id"] == failed["item_id"]
                )
            )["item"]
            assert item["error"]["type"] == "tool_execution_error" and item["output"] is None
        assert not ev.of("error"), ev.of("error")


async def test_a_call_waits_for_the_clients_approval(agent: RunningAgent, strict_event) -> None:
    with mcp_server() as server:
        async with sdk_session(agent.url, strict_event) as (conn, ev):
            await ev.wait("session.created", 10)
            await _listed(conn, ev, _mcp(server.url, require_approval={"never": {"read_only": True}}))
            for approve in (True, False):
                mark, ran = len(ev.all), len(server.calls)
                choice = {"type": "mcp", "server_label": "weather", "name": "book_table"}
                await ask_text(conn, "Book it.", tool_choice=choice)
                done = await ev.wait("response.done", 60, after=mark)
                request = next(o for o in done["response"]["output"] if o["type"] == "mcp_approval_request")
                assert request["name"] == "book_table" and json.loads(request["arguments"])["city"] in FORECASTS
                assert not [e for e in ev.all[mark:] if e["type"].startswith("response.mcp_call")]
                assert len(server.calls) == ran  # nothing runs before the answer
                mark = len(ev.all)
                await conn.conversation.item.create(
                    item={
                        "type": "mcp_approval_response",
                        "approval_request_id": request["id"],
                        "approve": approve,
                        **({} if approve else {"reason": "not tonight"}),
                    },
                    previous_item_id=request["id"],
                )
                end = "response.mcp_call.completed" if approve else "response.mcp_call.failed"
                ended = await ev.wait(end, 30, after=mark)
                item = (
                    await ev.wait(
                        "conversation.item.done",
                        10,
                        after=mark,
                        where=lambda e, ended=ended: e["item"]["id"] == ended["item_id"],
                    )
                )["item"]
                assert item["type"] == "mcp_call" and item["approval_request_id"] == request["id"]
                if approve:
                    assert item["output"] == f"booked in {json.loads(request['arguments'])['city']}"
                else:
                    assert "not tonight" in item["error"]["message"]
            assert [name for name, _ in server.calls] == ["book_table"]  # the refused one never ran
            mark = len(ev.all)
            await conn.conversation.item.create(
                item={"type": "mcp_approval_response", "approval_request_id": "mcpr_nothing", "approve": True}
            )
            error = await ev.wait("error", 10, after=mark)
            assert error["error"]["param"] == "item.approval_request_id"


async def test_unreachable_and_forbidden_servers(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        with mcp_server() as server:
            url = server.url
        mark = len(ev.all)  # (the server is gone: its port refuses)
        await conn.session.update(session={"type": "realtime", "tools": [_mcp(url, require_approval="never")]})
        failed = await ev.wait("mcp_list_tools.failed", 30, after=mark)
        item = (
            await ev.wait(
                "conversation.item.done", 10, after=mark, where=lambda e: e["item"]["id"] == failed["item_id"]
            )
        )["item"]
        assert item["tools"] == []
        mark = len(ev.all)
        await conn.send(
            {
                "type": "session.update",
                "event_id": "far",
                "session": {"type": "realtime", "tools": [_mcp("http://192.0.2.1/mcp")]},
            }
        )
        error = await ev.wait("error", 10, after=mark)
        assert error["error"]["param"] == "session.tools[0].server_url" and error["error"]["event_id"] == "far"
        mark = len(ev.all)
        await ask_text(conn, "Hello.")
        done = await ev.wait("response.done", 60, after=mark)
        assert [o["type"] for o in done["response"]["output"]] == ["message"]


async def test_a_function_tool_keeps_its_name(agent: RunningAgent, strict_event) -> None:
    """A function tool and an MCP tool of the same name: the model's call is the function's,
    returned to the client, and the MCP server never runs it."""
    with mcp_server() as server:
        async with sdk_session(agent.url, strict_event) as (conn, ev):
            await ev.wait("session.created", 10)
            function = {
                "type": "function",
                "name": "forecast",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome"]}}},
            }
            mark = len(ev.all)
            await conn.session.update(
                session={"type": "realtime", "tools": [function, _mcp(server.url, require_approval="never")]}
            )
            await ev.wait("mcp_list_tools.completed", 30, after=mark)
            mark = len(ev.all)
            await ask_text(conn, "Forecast?", tool_choice={"type": "function", "name": "forecast"})
            done = await ev.wait("response.done", 60, after=mark)
        assert [o["type"] for o in done["response"]["output"]] == ["function_call"], done["response"]["output"]
        assert json.loads(done["response"]["output"][0]["arguments"]) in ({"city": "Rome"}, {})
        assert server.calls == [] and not ev.of("error"), ev.of("error")
