"""Qwen's text format for tools, as the chat template of Qwen3 models (Qwen3-Omni's included)
renders it, so the model reads tools, calls and results as it was trained to (docs/tools.md):

- the tools: appended to the system message under "# Tools", one JSON object per line inside
  <tools></tools>, each `{"type": "function", "function": {name, description, parameters}}`
  as Jinja's `tojson` writes it (json.dumps with its default separators);
- a call: `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`, calls joined by "\n";
- results: a user message of `<tool_response>\nOUTPUT\n</tool_response>` blocks joined by "\n"
  (the engine puts each text item of a user turn on a line of its own: state/session.py
  `join_text`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from agent.tools.spec import Tool

_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def tool_json(tool: Tool) -> str:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def system_text(instructions: str, tools: Sequence[Tool]) -> str:
    """The system message's text: the instructions, then the tool block (none without tools)."""
    if not tools:
        return instructions
    head = instructions + "\n\n" if instructions else ""
    return head + _HEADER + "".join("\n" + tool_json(t) for t in tools) + _FOOTER


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (arguments: its JSON text)."""
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n</tool_call>'


def response_text(output: str) -> str:
    """One result, a text item of the user message that carries results."""
    return f"<tool_response>\n{output}\n</tool_response>"
