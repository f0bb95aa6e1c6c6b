"""What a response asks of the engine, worked out before anything of it begins: its mode on the
degradation ladder, its token cap, its own instructions and tools, its voice.

Pure: from the response's parameters (checked already: agent/realtime/response_checks.py), the
session's settings, the server's reply cap and the ladder's level. `Replies` (agent/realtime/
replies.py) plans each response here, then sends what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from agent.engine.commands import SessionCommand
from agent.realtime import response_checks, session_config, tool_config
from agent.tools.spec import Tool


def reply_mode(level: int, has_fallback: bool, modalities: list[str]) -> str:
    """audio | text | fallback, by the degradation ladder's level and the modalities asked."""
    if level >= 2 and has_fallback:
        return "fallback"
    if level >= 1 or modalities == ["text"]:
        return "text"
    return "audio"


@dataclass(frozen=True)
class ResponsePlan:
    mode: str  # audio | text | fallback
    max_tokens: Optional[int]  # the client's cap, when under the server's own (None: the server's)
    commands: list[tuple[SessionCommand, Optional[str]]]  # its own instructions and tools (param a refusal names)
    tools: bool  # it may call a tool: its message is announced with its first words
    voice: str  # the voice it speaks with
    session_voice: str  # the session's, which the engine goes back to after it


def plan_response(
    params: dict[str, Any],
    settings: dict[str, Any],
    max_reply_tokens: int,
    level: int,
    has_fallback: bool,
    held: bool,
    mcp: Mapping[str, tuple[Tool, ...]] = {},
) -> ResponsePlan:
    """`params`: the response object (null fields dropped; {} for a turn's own response).
    `held`: it answers a turn the engine held (interpreter mode), which the fallback would drop.
    `mcp`: the tools each of the session's MCP servers offers now."""
    mode = reply_mode(level, has_fallback, params.get("output_modalities") or settings["output_modalities"])
    if held and mode == "fallback":
        mode = "text"
    limit = session_config.max_output_tokens(params.get("max_output_tokens", settings["max_output_tokens"]))
    if limit is not None and limit >= max_reply_tokens:
        limit = None  # the engine's own cap ends the reply there (as "incomplete", with its stats)
    commands, tools = tool_config.reply_commands(params, settings, mcp)
    session_voice = settings["audio"]["output"].get("voice") or "default"
    voice = response_checks.response_voice(params) or session_voice
    return ResponsePlan(mode, limit, commands, tools, voice if isinstance(voice, str) else "default", session_voice)
