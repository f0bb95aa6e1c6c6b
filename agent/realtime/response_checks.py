"""The checks of a response.create's parameters, before anything of the response is made: a fault
raises BadEvent naming the field (`response.…`). The response's own tools are checked by
agent/realtime/tool_config.py, whole, as the response will see them with the session's.
"""

from __future__ import annotations

from typing import Any

from agent.engine.api import Voices
from agent.realtime.bad_event import BadEvent
from agent.realtime.config_error import ConfigError
from agent.realtime.session_checks import MAX_OUTPUT_TOKENS, check_voice_name
from agent.realtime.tool_config import mcp_labels, tool_set

# GA's bounds on metadata: 16 pairs of string keys (64 characters) and string values (512).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_response(params: dict[str, Any], settings: dict[str, Any], voices: Voices) -> None:
    """`params`: the response object with null fields dropped (a null is the session's value)."""
    if params.get("conversation") not in (None, "auto"):
        raise BadEvent(
            "out-of-band responses (conversation: none) are not served", "unsupported", "response.conversation"
        )
    if params.get("input") is not None:
        raise BadEvent("responses over a custom input are not served", "unsupported", "response.input")
    if "output_modalities" in params and params["output_modalities"] not in (["audio"], ["text"]):
        raise BadEvent('output_modalities must be ["audio"] or ["text"]', param="response.output_modalities")
    if "instructions" in params and not isinstance(params["instructions"], str):
        raise BadEvent("instructions must be a string", param="response.instructions")
    limit = params.get("max_output_tokens")
    if limit is not None and limit != "inf" and not (_is_int(limit) and 1 <= limit <= MAX_OUTPUT_TOKENS):
        raise BadEvent(f'max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or "inf"', param="response.max_output_tokens")
    _check_metadata(params.get("metadata"))
    _check_audio(params.get("audio"), voices)
    if any(params.get(k) is not None for k in ("tools", "tool_choice", "parallel_tool_calls")):
        tools = settings.get("tools", []) if params.get("tools") is None else params["tools"]
        choice = settings.get("tool_choice", "auto") if params.get("tool_choice") is None else params["tool_choice"]
        tool_set(tools, choice, "response", params.get("parallel_tool_calls"))
        unknown = mcp_labels(params.get("tools")) - mcp_labels(settings.get("tools", []))
        if unknown:  # a response uses the session's MCP servers, as listed
            raise BadEvent(
                f"the MCP server {sorted(unknown)[0]!r} is not one of the session's (add it with session.update)",
                param="response.tools",
            )


def response_voice(params: dict[str, Any]) -> Any:
    """The voice the response asks for (None: the session's)."""
    audio = params.get("audio")
    output = audio.get("output") if isinstance(audio, dict) else None
    return output.get("voice") if isinstance(output, dict) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    fine = (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_PAIRS
        and all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()
        )
    )
    if not fine:
        raise BadEvent(
            f"metadata is an object of at most {MAX_METADATA_PAIRS} string values (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})",
            param="response.metadata",
        )


def _check_audio(audio: Any, voices: Voices) -> None:
    """The response's own output audio: the session's format only (pcm16 at 24 kHz), and a voice
    the model speaks with, for this response alone."""
    if audio is None:
        return
    output = audio.get("output") if isinstance(audio, dict) else None
    if not isinstance(audio, dict) or not isinstance(output, (dict, type(None))):
        raise BadEvent("audio must be an object holding an output object", param="response.audio")
    fmt = (output or {}).get("format")
    rate = fmt.get("rate") if isinstance(fmt, dict) else None  # (a null rate is one not given)
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "audio/pcm" and rate in (None, 24000)):
        raise BadEvent("audio.output.format must be audio/pcm at 24000 Hz", param="response.audio.output.format")
    voice = (output or {}).get("voice")
    if voice is not None:
        try:
            check_voice_name(voice, voices, "response.audio.output.voice")
        except ConfigError as exc:
            raise BadEvent(str(exc), param=exc.param) from None
