"""The checks of a whole GA session (agent/realtime/session_config.py merges an update into the
session, then hands the result here): types, ranges, and what the agent can serve. A fault
raises ConfigError naming the offending `param`; nothing is changed by a check.
"""

from __future__ import annotations

from typing import Any

from agent.gate import priority
from agent.realtime.config_error import ConfigError
from agent.realtime.tool_config import tool_set

INPUT_FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")
MAX_OUTPUT_TOKENS = 4096


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
    tool_set(s.get("tools"), s.get("tool_choice"), "session")  # the tools and the choice, checked
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
        for flag in ("create_response", "interrupt_response"):
            check(
                td.get(flag) is None or isinstance(td.get(flag), bool),
                f"{flag} must be a boolean",
                f"session.audio.input.turn_detection.{flag}",
            )
        check(
            td.get("idle_timeout_ms") is None,
            "idle_timeout_ms is not supported",
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
