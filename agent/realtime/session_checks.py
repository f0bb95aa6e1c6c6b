"""The checks of a whole GA session (agent/realtime/session_config.py merges an update into the
session, then hands the result here): types, ranges, and what the agent can serve. A fault
raises ConfigError naming the offending `param`; nothing is changed by a check.
"""

from __future__ import annotations

from typing import Any, Optional

from agent.engine.api import Voices
from agent.gate import priority
from agent.realtime.config_error import ConfigError
from agent.realtime.mcp_config import check_servers
from agent.realtime.tool_config import system_text, tool_set

INPUT_FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")
MAX_OUTPUT_TOKENS = 4096
# GA's enumerations: a value outside them is refused, not echoed back (a client's own types,
# the openai SDK's and pipecat's, would then fail to read the session.updated it is sent).
EAGERNESS = ("low", "medium", "high", "auto")
NOISE_REDUCTION = ("near_field", "far_field")
INCLUDE = ("item.input_audio_transcription.logprobs",)
# The voices OpenAI's Realtime API names; a client that sends one (most do, by default) is served by
# the model's default speaker.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "marin", "sage", "shimmer", "verse"})
_VOICE = "session.audio.output.voice"


def check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ConfigError(message, param)


def validate(s: dict[str, Any]) -> None:
    if s.get("type") == "transcription":
        audio = s.get("audio")
        check(
            isinstance(audio, dict) and isinstance(audio.get("input"), dict),
            "audio must hold an input object",
            "session.audio",
        )
        _validate_input(audio["input"])
        _validate_include(s)
        _validate_omni(s)
        return
    modalities = s.get("output_modalities")
    check(
        modalities in (["audio"], ["text"]),
        'output_modalities must be ["audio"] or ["text"]',
        "session.output_modalities",
    )
    check(isinstance(s.get("instructions"), str), "instructions must be a string", "session.instructions")
    check(isinstance(s.get("model"), str), "model must be a string", "session.model")
    limit = s.get("max_output_tokens")
    check(
        limit == "inf" or (isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= MAX_OUTPUT_TOKENS),
        f'max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or "inf"',
        "session.max_output_tokens",
    )
    tool_set(s.get("tools"), s.get("tool_choice"), "session", s.get("parallel_tool_calls"))  # checked
    _validate_include(s)
    _validate_accepted(s)
    audio = s.get("audio")
    check(
        isinstance(audio, dict) and isinstance(audio.get("input"), dict) and isinstance(audio.get("output"), dict),
        "audio must hold input and output objects",
        "session.audio",
    )
    _validate_input(audio["input"])
    out = audio["output"]
    fmt = out.get("format")
    check(
        isinstance(fmt, dict) and fmt.get("type") == "audio/pcm" and fmt.get("rate", 24000) == 24000,
        "audio.output.format must be audio/pcm at 24000 Hz",
        "session.audio.output.format",
    )
    speed = out.get("speed", 1.0)
    check(speed in (None, 1, 1.0), "only speed 1.0 is served", "session.audio.output.speed")
    check(
        out.get("voice") is None or isinstance(out.get("voice"), (str, dict)),
        "voice must be a string",
        "session.audio.output.voice",
    )
    _validate_omni(s)


def check_servable(
    session: dict[str, Any], voices: Voices, context_limit: int, mcp_allow: Optional[tuple[str, ...]] = None
) -> None:
    """What the loaded model can serve, checked before the session changes: its voice
    (check_voice), instructions and tools that fit the model's context (check_fits) and, given
    the operator's allowed hosts (a new session's; a live one checks against its own servers:
    agent/realtime/mcp.py), its MCP servers."""
    check_voice(session, voices)
    check_fits(session, context_limit)
    if mcp_allow is not None and session.get("type") == "realtime":
        check_servers(session.get("tools"), mcp_allow, "session.tools")


def check_fits(session: dict[str, Any], context_limit: int) -> None:
    """A realtime session's system message (its instructions and, in Qwen's format, its tools)
    takes at most 2 bytes of UTF-8 per token of the model's context: text takes 3 to 4 bytes a
    token (English, JSON, CJK), so what passes fits with room for the conversation. Past the
    context it could never be prefilled, and the engine prefills it at once, every session
    waiting (60 KB took 13 s of a 2-core CPU). The engine counts the tokens of what passes
    (StreamingRunner.set_instructions) and refuses what still does not fit."""
    if session.get("type") != "realtime":
        return
    size, most = len(system_text(session).encode("utf-8", "surrogatepass")), 2 * context_limit
    if size <= most:
        return
    own = len(session["instructions"].encode("utf-8", "surrogatepass"))
    param = "session.instructions" if own > most // 2 or not session.get("tools") else "session.tools"
    raise ConfigError(
        f"the instructions and tools take {size} bytes; at most {most} fit the model's context "
        f"({context_limit} tokens)",
        param,
    )


def check_voice(session: dict[str, Any], voices: Voices) -> None:
    """A realtime session's voice is one the model speaks with: one of its speakers (any case),
    "default", or one of OpenAI's names (the default speaker serves them); a custom-voice object
    is refused. Checked before the session changes, so a refused voice leaves it as it was.
    `voices`: the loaded model's (none known yet: the engine refuses an unknown one itself)."""
    if session.get("type") != "realtime" or session["audio"]["output"].get("voice") is None:
        return
    check_voice_name(session["audio"]["output"]["voice"], voices, _VOICE)


def check_voice_name(voice: Any, voices: Voices, param: str) -> None:
    """check_voice for one value (a session's or a response's, named by `param`)."""
    check(isinstance(voice, str), "this model has no custom voices; name one of its speakers", param)
    name = voice.lower()
    known = not voices.names or name == "default" or name in voices.names or name in OPENAI_VOICES
    check(known, f"unknown voice {voice!r}; this model speaks as: {', '.join(sorted(voices.names))}", param)


def speaker(voice: str) -> str:
    """The talker speaker a checked voice names: OpenAI's own names, which stock clients send
    by default, are the model's default speaker, so such a client works with only its base URL
    changed."""
    return "default" if voice.lower() in OPENAI_VOICES else voice


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_include(s: dict[str, Any]) -> None:
    include = s.get("include")
    check(
        include is None or (isinstance(include, list) and all(x in INCLUDE for x in include)),
        f"include must be null or a list of {', '.join(INCLUDE)}",
        "session.include",
    )


def _validate_accepted(s: dict[str, Any]) -> None:
    """Fields accepted and echoed for compatibility, whose values change nothing here: checked
    against GA's shapes all the same."""
    tracing = s.get("tracing")
    check(
        tracing in (None, "auto")
        or (
            isinstance(tracing, dict)
            and all(isinstance(tracing.get(k), (str, type(None))) for k in ("workflow_name", "group_id"))
            and isinstance(tracing.get("metadata"), (dict, type(None)))
        ),
        'tracing must be null, "auto" or an object with workflow_name, group_id, metadata',
        "session.tracing",
    )
    truncation = s.get("truncation")
    ratio = truncation.get("retention_ratio") if isinstance(truncation, dict) else None
    check(
        truncation in ("auto", "disabled")
        or (
            isinstance(truncation, dict)
            and truncation.get("type") == "retention_ratio"
            and _is_number(ratio)
            and 0 <= ratio <= 1
            and isinstance(truncation.get("token_limits"), (dict, type(None)))
        ),
        'truncation must be "auto", "disabled" or {"type": "retention_ratio", "retention_ratio": 0..1}',
        "session.truncation",
    )
    prompt = s.get("prompt")
    check(
        prompt is None
        or (
            isinstance(prompt, dict)
            and isinstance(prompt.get("id"), str)
            and isinstance(prompt.get("version"), (str, type(None)))
            and isinstance(prompt.get("variables"), (dict, type(None)))
        ),
        "prompt must be null or an object with a string id (version, variables optional)",
        "session.prompt",
    )


def _validate_input(inp: dict[str, Any]) -> None:
    fmt = inp.get("format")
    check(
        isinstance(fmt, dict) and fmt.get("type") in INPUT_FORMATS,
        "audio.input.format.type must be audio/pcm, audio/pcmu or audio/pcma",
        "session.audio.input.format",
    )
    if fmt["type"] == "audio/pcm":
        check(fmt.get("rate", 24000) == 24000, "audio/pcm input is 24000 Hz only", "session.audio.input.format.rate")
    tr = inp.get("transcription")
    check(
        tr is None
        or (
            isinstance(tr, dict)
            and all(isinstance(tr.get(k), (str, type(None))) for k in ("model", "language", "prompt"))
        ),
        "transcription must be null or an object with string model, language, prompt",
        "session.audio.input.transcription",
    )
    noise = inp.get("noise_reduction")
    check(
        noise is None or (isinstance(noise, dict) and noise.get("type") in (None, *NOISE_REDUCTION)),
        f"noise_reduction must be null or an object whose type (if given) is one of {', '.join(NOISE_REDUCTION)}",
        "session.audio.input.noise_reduction",
    )
    td = inp.get("turn_detection")
    if td is not None:
        check(
            isinstance(td, dict) and td.get("type") in ("server_vad", "semantic_vad"),
            "turn_detection.type must be server_vad or semantic_vad (or turn_detection null)",
            "session.audio.input.turn_detection.type",
        )
        silence = td.get("silence_duration_ms")
        check(
            silence is None or (isinstance(silence, int) and 20 <= silence <= 10_000),
            "silence_duration_ms must be 20..10000",
            "session.audio.input.turn_detection.silence_duration_ms",
        )
        padding = td.get("prefix_padding_ms")
        check(
            padding is None or (isinstance(padding, int) and 0 <= padding <= 2000),
            "prefix_padding_ms must be 0..2000",
            "session.audio.input.turn_detection.prefix_padding_ms",
        )
        threshold = td.get("threshold")
        check(
            threshold is None or (_is_number(threshold) and 0 <= threshold <= 1),
            "threshold must be 0..1",
            "session.audio.input.turn_detection.threshold",
        )
        check(
            td.get("eagerness") is None or td["eagerness"] in EAGERNESS,
            f"eagerness (semantic_vad) must be one of {', '.join(EAGERNESS)}",
            "session.audio.input.turn_detection.eagerness",
        )
        for flag in ("create_response", "interrupt_response"):
            check(
                td.get(flag) is None or isinstance(td.get(flag), bool),
                f"{flag} must be a boolean",
                f"session.audio.input.turn_detection.{flag}",
            )
        idle = td.get("idle_timeout_ms")
        check(
            idle is None or (isinstance(idle, int) and not isinstance(idle, bool) and 1000 <= idle <= 600_000),
            "idle_timeout_ms must be 1000..600000",
            "session.audio.input.turn_detection.idle_timeout_ms",
        )
        check(
            idle is None or td.get("type") == "server_vad",
            "idle_timeout_ms is for server_vad only",
            "session.audio.input.turn_detection.idle_timeout_ms",
        )


def _validate_omni(s: dict[str, Any]) -> None:
    omni = s.get("omni", {})
    check(isinstance(omni, dict), "omni must be an object", "session.omni")
    check(
        omni.get("priority", priority.NORMAL) in priority.PRIORITIES,
        f"omni.priority must be one of {', '.join(priority.PRIORITIES)}",
        "session.omni.priority",
    )
    check(isinstance(omni.get("video", True), bool), "omni.video must be true or false", "session.omni.video")
    events = omni.get("events")
    check(events is None or isinstance(events, bool), "omni.events must be true or false", "session.omni.events")
    lang = omni.get("interpret_to")
    check(
        lang is None or (isinstance(lang, str) and 0 < len(lang.strip()) <= 64 and s["type"] == "realtime"),
        "omni.interpret_to is a language name (1-64 characters), in realtime sessions only",
        "session.omni.interpret_to",
    )
