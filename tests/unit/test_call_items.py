"""Function calls the client replays (`function_call` items) and their results, as the session
hands them to the model (agent/realtime/call_outputs.py).

Pins:
- a function_call item becomes a closed assistant turn holding the call as the model writes one
  (Qwen's `<tool_call>` text, agent/tools/qwen_format.py), announced as the item the client gave
  (type, call_id, name, arguments, status completed);
- its call_id may then be answered: the output goes to the model as a `<tool_response>` block,
  a text item of the next user turn, also after an earlier call and its output;
  an output for a call never made or replayed is refused (`item.call_id`);
- calls replayed right behind an assistant message or call (a reply's text and its parallel
  calls, as LiveKit replays them) ask the engine to join that assistant turn; a call after
  anything else (an output, a user message) opens a turn of its own;
- arguments left out or empty are the empty object to the model (announced as given); a
  duplicate item id is refused;
- a call the engine cannot place (it refuses: images not yet answered) is withdrawn again,
  announced as deleted, so the client's list matches the model's, and its call_id cannot be
  answered: an output sent right behind the call waits for the engine's answer and is refused.
"""

from __future__ import annotations

from support.recording_session import errors, recording_session, send_event

from agent.engine.commands import AddAssistantText, AddUserText
from agent.tools import qwen_format


def _call(call_id: str, arguments: str | None = '{"city": "Paris"}', item_id: str | None = None) -> dict:
    item = {"type": "function_call", "call_id": call_id, "name": "get_weather"}
    if arguments is not None:
        item["arguments"] = arguments
    if item_id is not None:
        item["id"] = item_id
    return {"type": "conversation.item.create", "item": item}


def _output(call_id: str, output: str) -> dict:
    return {
        "type": "conversation.item.create",
        "item": {"type": "function_call_output", "call_id": call_id, "output": output},
    }


def _texts(engine) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(type(c).__name__, c.text) for c in engine.commands if isinstance(c, (AddAssistantText, AddUserText))]


async def test_replayed_calls_and_outputs_reach_the_model_in_qwens_format() -> None:
    session, engine, sent = recording_session()
    for call_id, city in (("call_1", "Paris"), ("call_2", "Oslo")):
        send_event(session, _call(call_id, f'{{"city": "{city}"}}'))
        send_event(session, _output(call_id, f"{city}: 21 C"))
    await session.inbox.idle()
    assert errors(sent) == []
    assert _texts(engine) == [
        ("AddAssistantText", qwen_format.call_text("get_weather", '{"city": "Paris"}')),
        ("AddUserText", "<tool_response>\nParis: 21 C\n</tool_response>"),
        ("AddAssistantText", qwen_format.call_text("get_weather", '{"city": "Oslo"}')),
        ("AddUserText", "<tool_response>\nOslo: 21 C\n</tool_response>"),
    ]
    added = [e["item"] for e in sent if e["type"] == "conversation.item.added"]
    assert [i["type"] for i in added] == ["function_call", "function_call_output"] * 2
    assert {k: added[0][k] for k in ("call_id", "name", "arguments", "status")} == {
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    await session.close()


async def test_outputs_need_a_known_call_and_arguments_default_to_the_empty_object() -> None:
    session, engine, sent = recording_session()
    send_event(session, _output("call_nowhere", "x"))
    [error] = errors(sent)
    assert error["param"] == "item.call_id"
    send_event(session, _call("call_3", None, item_id="item_c3"))
    send_event(session, _call("call_4", "", item_id="item_c3"))
    await session.inbox.idle()
    assert [e["param"] for e in errors(sent)] == ["item.call_id", "item.id"]
    assert _texts(engine) == [("AddAssistantText", qwen_format.call_text("get_weather", "{}"))]
    [added] = [e["item"] for e in sent if e["type"] == "conversation.item.added"]
    assert added["arguments"] == "", "announced as the client gave it"
    await session.close()


async def test_a_call_the_engine_refuses_is_withdrawn() -> None:
    session, engine, sent = recording_session()
    engine.refuse = lambda command: isinstance(command, AddAssistantText)
    send_event(session, {**_call("call_5", item_id="item_c5"), "event_id": "e5"})
    send_event(session, _output("call_5", "x"))  # right behind it: it waits for the engine's answer
    await session.inbox.idle()
    kinds = [e["type"] for e in sent if e["type"] != "error"]
    assert kinds[-2:] == ["conversation.item.done", "conversation.item.deleted"], kinds
    assert "item_c5" not in session.conversation
    refused, orphan = errors(sent)
    assert (refused["event_id"], refused["param"]) == ("e5", "item")
    assert orphan["param"] == "item.call_id", "never placed: nothing to answer"
    assert [c for c in engine.commands if isinstance(c, AddUserText)] == []
    await session.close()


async def test_parallel_calls_join_the_assistant_turn_before_them() -> None:
    session, engine, sent = recording_session()
    reply = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]}
    send_event(session, {"type": "conversation.item.create", "item": reply})
    send_event(session, _call("call_a", '{"city": "Paris"}'))
    send_event(session, _call("call_b", '{"city": "Oslo"}'))
    send_event(session, _output("call_a", "21 C"))
    send_event(session, _output("call_b", "9 C"))
    send_event(session, _call("call_c", '{"city": "Rome"}'))  # a new reply's call, after the results
    await session.inbox.idle()
    assert errors(sent) == []
    joins = [c.joins for c in engine.commands if isinstance(c, AddAssistantText)]
    assert joins == [False, True, True, False]
    results = [c.text for c in engine.commands if isinstance(c, AddUserText)]
    assert results == ["<tool_response>\n21 C\n</tool_response>", "<tool_response>\n9 C\n</tool_response>"]
    await session.close()
