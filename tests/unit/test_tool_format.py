"""Tools on the protocol side, without a model: Qwen's text format, the streaming call parser,
the GA checks of `tools` / `tool_choice`, and the response events of a call.

Pins:
- the system text is Qwen3's chat template's tool block, byte for byte (tools as `tojson` writes
  them, one per line inside <tools></tools>, the call instructions after); results are
  `<tool_response>` blocks joined by a newline;
- the parser names the function as soon as it is written, and its argument deltas, however
  the text is chunked, join to exactly the arguments the model wrote; a broken call raises;
- bad tools and choices raise ConfigError naming the field; a good set becomes a ToolSet;
  `required` with no tools yet is no set (Pipecat sends it before its tools), not an error;
- a list is checked once whatever field it is read as: a session's tools checked as
  `session.tools` are found checked when a reply reads them as `response.tools` (the loop must
  not check them again), and a refusal names the field it was read as;
- `parallel_tool_calls` reaches the set (a session's, overridden by a response's own: told to the
  engine as the reply's tools); false makes a set of one call at most (the grammar then ends the
  reply after it: tests/unit/test_tool_grammar.py), a non-boolean is refused naming the field;
- a response that may call announces no message until it has words; a call cut off by a
  cancel ends `incomplete` in its output_item.done and in response.done, and a finished one
  is `completed` with .done carrying the whole arguments.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.realtime import tool_config
from agent.realtime.config_error import ConfigError
from agent.realtime.response import Response
from agent.realtime.tool_config import tool_set
from agent.tools import qwen_format
from agent.tools.call_parser import CallParseError, CallParser
from agent.tools.spec import Tool

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_system_text_is_qwens_tool_block() -> None:
    tool = Tool("get_weather", "Weather now.", WEATHER["parameters"])
    text = qwen_format.system_text("Be brief.", [tool])
    expected = (
        "Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert text == expected
    assert qwen_format.system_text("Be brief.", []) == "Be brief."
    assert qwen_format.response_text('{"t": 21}') == '<tool_response>\n{"t": 21}\n</tool_response>'
    assert qwen_format.call_text("f", '{"a": 1}') == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


CALL = '\n{"name": "get_weather", "arguments": {"city": "Oslo }", "days": [1, {"x": {}}]}}\n'


@given(st.lists(st.integers(min_value=1, max_value=len(CALL)), max_size=12))
def test_parser_deltas_join_to_the_arguments(cuts: list[int]) -> None:
    parser = CallParser()
    deltas, at = [], 0
    for cut in sorted(set(cuts)):
        deltas.append(parser.push(CALL[at:cut]))
        at = cut
    name, arguments, last = parser.finish(CALL[at:])
    assert name == "get_weather" and arguments == {"city": "Oslo }", "days": [1, {"x": {}}]}
    assert "".join(deltas) + last == '{"city": "Oslo }", "days": [1, {"x": {}}]}' == parser.sent


def test_parser_names_the_function_before_the_arguments_end() -> None:
    parser = CallParser()
    assert parser.push('\n{"name": "get_wea') == "" and parser.name is None
    assert parser.push('ther", "arguments": {"ci') == '{"ci' and parser.name == "get_weather"
    with pytest.raises(CallParseError):
        CallParser().finish('{"name": "f", "arguments": {"a": 1}')  # not closed


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ("x", "auto", "session.tools"),
        ([{**WEATHER, "name": "bad name"}], "auto", "session.tools[0].name"),
        ([WEATHER, WEATHER], "auto", "session.tools[1].name"),
        ([{**WEATHER, "parameters": {"type": "array"}}], "auto", "session.tools[0].parameters"),
        (
            [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}],
            "auto",
            "session.tools[0].parameters",
        ),
        ([{"type": "web_search"}], "auto", "session.tools[0].type"),
        (
            [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}}],
            "auto",
            "session.tools[0].parameters",
        ),
        (
            [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}],
            "auto",
            "session.tools[0].parameters",
        ),
        ([WEATHER], {"type": "function", "name": "other"}, "session.tool_choice.name"),
        ([WEATHER], "sometimes", "session.tool_choice"),
    ],
)
def test_bad_tools_name_their_field(tools, choice, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        tool_set(tools, choice, "session")
    assert info.value.param == param


def test_a_good_set() -> None:
    tools = tool_set([WEATHER], {"type": "function", "name": "get_weather"}, "response")
    assert tools is not None and tools.calls and tools.choice.name == "get_weather"
    assert tools.tools[0].parameters["required"] == ["city"]
    assert tool_set([], "auto", "session") is None
    assert tool_set([], "required", "session") is None  # kept for the tools to come (Pipecat)
    assert not tool_set([WEATHER], "none", "session").calls


def test_parallel_tool_calls_reaches_the_set() -> None:
    from agent.engine.commands import SetReplyTools

    session = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True}
    assert tool_config.session_tools(session).parallel
    assert not tool_config.session_tools({**session, "parallel_tool_calls": False}).parallel
    assert tool_config.session_tools({**session, "parallel_tool_calls": None}).parallel  # not given: allowed
    # A response's own value overrides the session's, and is told to the engine for that reply.
    commands, _ = tool_config.reply_commands({"parallel_tool_calls": False}, session)
    (told,) = [c for c, _ in commands if isinstance(c, SetReplyTools)]
    assert told.tools is not None and not told.tools.parallel
    commands, _ = tool_config.reply_commands({}, {**session, "parallel_tool_calls": False})
    assert not [c for c, _ in commands if isinstance(c, SetReplyTools)]  # the session's set applies
    with pytest.raises(ConfigError) as refused:
        tool_set([WEATHER], "auto", "response", "no")
    assert refused.value.param == "response.parallel_tool_calls"


def test_a_list_is_checked_once_whatever_field_reads_it() -> None:
    tools = [{**WEATHER, "name": "checked_once"}]
    before = tool_config._checked.cache_info()
    tool_set(tools, "auto", "session")
    tool_set(tools, "auto", "response")
    after = tool_config._checked.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    bad = [WEATHER, {**WEATHER, "name": "bad name"}]
    for field in ("session", "response"):
        with pytest.raises(ConfigError) as info:
            tool_set(bad, "auto", field)
        assert info.value.param == f"{field}.tools[1].name"


def _response() -> Response:
    return Response(audio=True, mode="audio", end_of_turn=0.0, conversation_id="conv_1", voice="default", tools=True)


def test_call_events_completed_and_cancelled() -> None:
    reply = _response()
    assert [e["type"] for e in reply.started()] == ["response.created"]  # no message before its words
    done_call = reply.call(0)
    done_call.parser.push('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    _, arguments, _ = done_call.parser.finish("\n")
    done_call.status = "completed"
    events = done_call.done()
    assert events[0]["type"] == "response.function_call_arguments.done"
    assert json.loads(events[0]["arguments"]) == arguments == {"city": "Oslo"}
    assert events[1]["item"]["status"] == "completed" and events[1]["output_index"] == 0
    cut = reply.call(1)
    cut.parser.push('\n{"name": "get_weather", "arguments": {"ci')
    assert cut.output_index == 1 and cut.announced
    closing = reply.finished("cancelled", "turn_detected", {"text_tokens": 30})
    kinds = [e["type"] for e in closing]
    assert "response.output_audio.done" not in kinds  # it never had a message
    assert closing[0]["type"] == "response.output_item.done" and closing[0]["item"]["status"] == "incomplete"
    output = closing[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in output] == [
        ("function_call", "completed"),
        ("function_call", "incomplete"),
    ]
    assert closing[-1]["response"]["usage"]["output_token_details"]["text_tokens"] == 30
