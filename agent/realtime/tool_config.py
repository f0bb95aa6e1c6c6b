"""The GA `tools` and `tool_choice` of a session or a response: checked, and made a ToolSet.

A tool is `{"type": "function", "name", "description"?, "parameters"?}`: the name as OpenAI's
function names go (letters, digits, `_` and `-`, at most 64), the parameters a JSON schema of an
object (checked against its JSON Schema meta-schema). `tool_choice` is "auto", "none",
"required" or `{"type": "function", "name": …}` naming one of the tools. A fault raises
ConfigError naming the field (`session.tools[1].parameters`, `response.tool_choice`, …),
including a schema the engine's grammar could not compile (agent/engine/stages/tool_grammar.py).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Optional

import jsonschema
import llguidance

from agent.engine.commands import SessionCommand, SetReplyInstructions, SetReplyTools
from agent.realtime.config_error import ConfigError
from agent.tools import qwen_format
from agent.tools.spec import NAME, Tool, ToolChoice, ToolSchemaError, ToolSet

MAX_TOOLS = 128


def check_tools(tools: Any, param: str) -> tuple[Tool, ...]:
    """The tools of a `tools` field (param: its name in errors, e.g. "session.tools"). The same
    tools are checked once: a session's are read again at every update and every response, and
    a check runs a JSON Schema meta-check and llguidance's over each schema."""
    if not isinstance(tools, list):
        raise ConfigError("tools must be a list", param)
    if len(tools) > MAX_TOOLS:
        raise ConfigError(f"at most {MAX_TOOLS} tools", param)
    try:  # (key order kept: properties come in schema order)
        return _checked(json.dumps(tools))
    except ConfigError as exc:
        raise ConfigError(str(exc), param + exc.param) from None


# Keyed by the list alone (a session's tools are read as "session.tools" and, at each reply, as
# "response.tools": one check for both). Sized for many sessions with tool sets of their own: a
# list evicted is checked again, on the loop, at its session's next reply.
@functools.lru_cache(maxsize=512)
def _checked(text: str) -> tuple[Tool, ...]:
    """check_tools of the tools in `text` (JSON), remembered (a refusal raises, and is not);
    a refusal's param is relative to the list ("[2].name")."""
    tools = json.loads(text)
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        at = f"[{i}]"
        if not isinstance(tool, dict):
            raise ConfigError("a tool is an object", at)
        if tool.get("type") == "mcp":  # a server whose tools are listed (agent/realtime/mcp_config.py)
            continue
        if (tool.get("type") or "function") != "function":  # (a null field is one not given)
            raise ConfigError(
                f"tools of type {tool.get('type')!r} are not served (function and mcp tools only)", f"{at}.type"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError("a tool's name is 1-64 letters, digits, _ or -", f"{at}.name")
        if any(t.name == name for t in out):
            raise ConfigError(f"two tools are named {name!r}", f"{at}.name")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise ConfigError("description must be a string", f"{at}.description")
        try:
            out.append(Tool(name, description or "", parameters(tool.get("parameters"), f"{at}.parameters")))
        except ToolSchemaError as exc:
            raise ConfigError(exc.message, f"{at}.parameters") from None
    return tuple(out)


def parameters(schema: Any, param: str) -> Optional[dict[str, Any]]:
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise ConfigError("parameters must be a JSON schema object", param)
    if schema.get("type", "object") != "object":
        raise ConfigError('parameters must describe an object ("type": "object")', param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"parameters is not a valid JSON schema: {exc.message}", param) from None
    # What the engine's grammar would refuse (an unknown format, a $ref to nowhere), refused now,
    # before the session takes it (llguidance checks a schema without the tokenizer).
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema), None
        )
    except ValueError as exc:
        failed, messages = True, [str(exc)]
    if failed:
        raise ConfigError(f"parameters cannot constrain a call: {messages[0] if messages else 'no grammar'}", param)
    return schema


def check_choice(
    choice: Any,
    tools: tuple[Tool, ...],
    param: str,
    mcp: Mapping[str, tuple[Tool, ...]] = {},
    labels: frozenset[str] = frozenset(),
) -> tuple[str, Optional[str]]:
    """(mode, function name) of a `tool_choice` value. `required` with no tools is kept, not
    refused: Pipecat sets it before it sends the tools, and a refusal there stops its session.
    A response it applies to, with still no tool, is an ordinary reply (tool_set: no ToolSet)."""
    if choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not any(t.name == name for t in tools):
            raise ConfigError(f"tool_choice names {name!r}, which is not one of the tools", f"{param}.name")
        return "function", name
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        # {"type": "mcp", "server_label", "name"?}: a server of the tools; its tool, once listed.
        # Until then (and for a name it does not offer) the choice is the model's: what is not
        # listed cannot be forced, and a listing that ends later must not make the session fail.
        label, name = choice.get("server_label"), choice.get("name")
        if label not in labels:
            raise ConfigError(f"tool_choice names the MCP server {label!r}, which is not one of the tools", param)
        listed = mcp.get(label, ())
        if name is not None and any(t.name == name for t in listed):
            return "function", name
        return ("required" if name is None and listed else "auto"), None
    raise ConfigError(
        'tool_choice must be "auto", "none", "required", {"type": "function", "name": ...} or '
        '{"type": "mcp", "server_label": ..., "name": ...}',
        param,
    )


def mcp_tools(tools: Any, mcp: Mapping[str, tuple[Tool, ...]], param: str) -> tuple[Tool, ...]:
    """The listed tools of the MCP servers a `tools` list names, after its function tools' names
    (a name already taken is not offered twice: the first keeps it)."""
    out: list[Tool] = []
    for label in mcp_labels(tools):
        out.extend(mcp.get(label, ()))  # (none while it is being listed)
    return tuple(out)


def mcp_labels(tools: Any) -> frozenset[str]:
    """The server labels of a `tools` list's MCP entries."""
    entries = tools if isinstance(tools, list) else []
    return frozenset(
        t["server_label"]
        for t in entries
        if isinstance(t, dict) and t.get("type") == "mcp" and isinstance(t.get("server_label"), str)
    )


def offered(tools: Any, mcp: Mapping[str, tuple[Tool, ...]], param: str) -> tuple[Tool, ...]:
    """What the model may call of a `tools` list: its function tools, then the listed tools of
    the MCP servers it names (mcp: a label's listed tools), no name twice."""
    own = check_tools(tools, param)
    taken = {t.name for t in own}
    extra = []
    for tool in mcp_tools(tools, mcp, param):
        if tool.name not in taken:
            taken.add(tool.name)
            extra.append(tool)
    return own + tuple(extra)


def tool_set(
    tools: Any, choice: Any, param: str, parallel: Any = None, mcp: Mapping[str, tuple[Tool, ...]] = {}
) -> Optional[ToolSet]:
    """The ToolSet of a session's or a response's `tools`, `tool_choice` and `parallel_tool_calls`
    (param: "session" or "response"; parallel None: allowed; mcp: each MCP server's listed
    tools); None without tools. With parallel_tool_calls false a reply makes one call at most:
    the grammar ends it after that one."""
    checked = offered(tools, mcp, f"{param}.tools")
    mode, name = check_choice(choice, checked, f"{param}.tool_choice", mcp, mcp_labels(tools))
    if parallel is not None and not isinstance(parallel, bool):
        raise ConfigError("parallel_tool_calls must be a boolean", f"{param}.parallel_tool_calls")
    many = parallel is not False
    return ToolSet(checked, ToolChoice(mode, name), parallel=many) if checked else None  # type: ignore[arg-type]


def system_text(settings: dict[str, Any], mcp: Mapping[str, tuple[Tool, ...]] = {}) -> str:
    """A session's system message: its instructions and, in Qwen's format, its tools (those of
    its MCP servers as listed so far)."""
    tools = offered(settings.get("tools", []), mcp, "session.tools")
    return qwen_format.system_text(settings["instructions"], tools)


def session_tools(settings: dict[str, Any], mcp: Mapping[str, tuple[Tool, ...]] = {}) -> Optional[ToolSet]:
    """A session's ToolSet (None: no tools)."""
    return tool_set(
        settings.get("tools", []),
        settings.get("tool_choice", "auto"),
        "session",
        settings.get("parallel_tool_calls"),
        mcp,
    )


def reply_commands(
    params: dict[str, Any], settings: dict[str, Any], mcp: Mapping[str, tuple[Tool, ...]] = {}
) -> tuple[list[tuple[SessionCommand, Optional[str]]], bool]:
    """What the engine is told of a response's own instructions and tools before it begins
    (each command with the param a refusal names), and whether the response may call a tool
    (its message is then announced with its first words)."""
    own_tools, own_choice, own_parallel = (
        params.get("tools"),
        params.get("tool_choice"),
        params.get("parallel_tool_calls"),
    )
    tools = tool_set(
        settings.get("tools", []) if own_tools is None else own_tools,
        settings.get("tool_choice", "auto") if own_choice is None else own_choice,
        "response",
        settings.get("parallel_tool_calls") if own_parallel is None else own_parallel,
        mcp,
    )
    commands: list[tuple[SessionCommand, Optional[str]]] = []
    instructions = params.get("instructions") or ""
    if own_tools is not None:  # its tools are described to the model in its own system message
        instructions = qwen_format.system_text(instructions, tools.tools if tools is not None else ())
    if instructions:
        commands.append((SetReplyInstructions(instructions), None))
    if own_tools is not None or own_choice is not None or own_parallel is not None:
        commands.append((SetReplyTools(tools or ToolSet((), ToolChoice("none"))), "response.tools"))
    return commands, tools is not None and tools.calls
