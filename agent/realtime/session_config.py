"""The GA session object: its defaults, `session.update` merging, and what the agent honours.

A client's update is merged into the whole session (nested objects field by field) and the
result is validated as one piece, so a rejected update leaves the session as it was. A null
field is one not given (it keeps its value), except where the GA API gives null a meaning
(`turn_detection`, `transcription`, `noise_reduction`: off; `tracing`, `prompt`, `include`,
`idle_timeout_ms`: none; `omni.interpret_to`: off). The session echoed is always whole: a
`turn_detection` or `format` of a new type starts from that type's defaults, a transcription
turned on from the default one, and every field they leave out keeps its default. Fields
the agent cannot act on but that change nothing a client would notice (`tracing`,
`prompt`, `include`, transcription and noise-reduction settings, VAD `threshold`) are kept
and echoed; values that would change behaviour the agent cannot deliver raise ConfigError
naming the offending `param`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from agent.config import Config
from agent.gate import priority
from agent.media.semantic_turn import SemanticPolicy
from agent.realtime import beta_session
from agent.realtime.config_error import ConfigError
from agent.realtime.events import PCM_FORMAT, new_id
from agent.realtime.session_checks import INPUT_FORMATS, check, validate

# semantic_vad: each pause is judged for completeness (agent/media/semantic_turn.py). Its eagerness
# picks the policy (how sure the judge must be for which silence), the long silence a turn judged
# unfinished waits for (over the 150-700 ms pauses people make inside a sentence), and the silence
# alone that ends a turn when the agent has no judge. Chosen on the tune part of the end-of-turn
# corpus (scripts/bench_turns.py, docs/turn-taking.md): Smart Turn tells a finished sentence from
# a mid-sentence pause only moderately well there, so auto ends a turn fast only when the judge is
# very sure, and waits out every pause people make otherwise.
_EAGERNESS: dict[str, tuple[SemanticPolicy, int, int]] = {
    "low": (SemanticPolicy(tiers=((0.97, 300), (0.7, 900))), 1200, 800),
    "medium": (SemanticPolicy(tiers=((0.97, 150), (0.5, 600))), 1000, 500),
    "auto": (SemanticPolicy(tiers=((0.97, 150), (0.5, 600))), 1000, 500),
    "high": (SemanticPolicy(tiers=((0.8, 100),)), 600, 300),
}
# Interpreter mode (omni.interpret_to): answered turns kept in the model's context, so a
# two-hour stream neither grows the context nor slows down.
INTERPRET_TURNS = 4
# What a transcription session transcribes with unless told: the Thinker of the loaded model.
DEFAULT_TRANSCRIPTION = {"model": "qwen3-omni-thinker", "language": None, "prompt": ""}

_TD = ("audio", "input", "turn_detection")
# Where the GA API gives null a meaning (off, none); anywhere else a null field is one not given.
_NULL_MEANS_NONE = frozenset(
    tuple(path.split("."))
    for path in "tracing prompt include audio.input.transcription audio.input.noise_reduction "
    "audio.input.turn_detection audio.input.turn_detection.idle_timeout_ms omni.interpret_to".split()
)
# The objects a client sets field by field, nulls inside them dropped too: those under `audio`
# and `omni` (the others, `prompt`, `tracing`, tools, are the client's, kept as sent).
_OBJECT_ROOTS = ("audio", "omni")


def server_vad(silence_ms: int) -> dict[str, Any]:
    """GA server_vad turn detection with every field at its default (silence: the agent's)."""
    return {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": silence_ms,
        "create_response": True,
        "interrupt_response": True,
        "idle_timeout_ms": None,
    }


def _typed_defaults(path: tuple[str, ...], kind: Any, silence_ms: int) -> dict[str, Any]:
    """The defaults of a typed object (turn_detection, a format) of type `kind`; {} if unknown
    (validate() then names it)."""
    if path == _TD:
        if kind == "server_vad":
            return server_vad(silence_ms)
        if kind == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": True}
        return {}
    if kind in INPUT_FORMATS:  # (validate() refuses what the output cannot be)
        return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}
    return {}


class SessionSettings:
    """A session's settings as they are now (a session.update replaces them whole): the parts of
    the session that read them are given this, and call it for the current ones."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def __call__(self) -> dict[str, Any]:
        return self.value


@dataclass(frozen=True)
class TurnDetection:
    """Server-side turn detection as the session's endpointer runs it."""

    silence_ms: int  # the silence that ends a turn (semantic_vad with a judge: one judged unfinished)
    prefix_padding_ms: int
    create_response: bool
    interrupt_response: bool
    semantic: Optional[SemanticPolicy] = None  # semantic_vad: judge each pause
    unjudged_silence_ms: int = 0  # semantic_vad when the agent has no judge: silence alone
    idle_timeout_ms: Optional[int] = None  # server_vad: prompt a reply after this much silence


def default_session(config: Config, model: str = "") -> dict[str, Any]:
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": new_id("sess"),
        "model": model or config.model or "qwen3-omni-tiny",
        "output_modalities": ["audio"],
        "instructions": config.system_prompt,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        # "inf": the server's own cap (max_reply_tokens) still ends a reply; that cap copied here
        # would make every session.update invalid once it passes GA's 4096.
        "max_output_tokens": "inf",
        "tracing": None,
        "truncation": "auto",
        "prompt": None,
        "include": None,
        "audio": {
            "input": {
                "format": dict(PCM_FORMAT),
                "transcription": None,
                "noise_reduction": None,
                "turn_detection": server_vad(config.vad_silence_ms),
            },
            "output": {"format": dict(PCM_FORMAT), "voice": config.speaker or "default", "speed": 1.0},
        },
        # Project extras: the session's priority class (omni.video, omni.events and
        # omni.interpret_to are read with their defaults when absent).
        "omni": {"priority": priority.NORMAL},
    }


def default_transcription_session(config: Config) -> dict[str, Any]:
    """A transcription-only session (GA `type: "transcription"`): the user's speech is
    transcribed live, nothing is answered (docs/realtime.md, "Transcription")."""
    realtime = default_session(config)
    audio_in = realtime["audio"]["input"]
    audio_in["transcription"] = dict(DEFAULT_TRANSCRIPTION)
    return {
        "type": "transcription",
        "object": "realtime.transcription_session",
        "id": new_id("sess"),
        "audio": {"input": audio_in},
        "include": None,
        "omni": realtime["omni"],
    }


def base_session(config: Config, kind: Any) -> dict[str, Any]:
    """The defaults a session of `kind` (a session object's `type`, or None) starts from."""
    return default_transcription_session(config) if kind == "transcription" else default_session(config)


def transcribes(session: dict[str, Any]) -> bool:
    """The user's speech is transcribed live: a transcription session, or a realtime one with
    audio.input.transcription set."""
    return session["type"] == "transcription" or session["audio"]["input"].get("transcription") is not None


def interpret_instructions(language: str) -> str:
    """The interpreter preset's instructions (docs/realtime.md, "Interpreter mode")."""
    return (
        f"You are a simultaneous interpreter. Translate everything the user says into {language}. "
        f"Answer only with the translation, spoken in {language}: no comments, no answers, no questions."
    )


def interpret_to(session: dict[str, Any]) -> Optional[str]:
    """The target language of interpreter mode, None when off."""
    return (session.get("omni") or {}).get("interpret_to")


def _interpreter_preset(merged: dict[str, Any], update: dict[str, Any]) -> None:
    """omni.interpret_to was just set: its instructions, and no barge-in (the speaker goes on
    while the translation plays), unless the same update says otherwise."""
    merged["instructions"] = update.get("instructions", interpret_instructions(merged["omni"]["interpret_to"]))
    td = merged["audio"]["input"].get("turn_detection")
    asked = ((update.get("audio") or {}).get("input") or {}).get("turn_detection") or {}
    if isinstance(td, dict) and isinstance(asked, dict) and "interrupt_response" not in asked:
        td["interrupt_response"] = False


def _given(update: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields an update sets: a null is dropped (not given) unless null means something there."""
    out = {}
    for key, value in update.items():
        at = (*path, key)
        if value is None and at not in _NULL_MEANS_NONE:
            continue
        out[key] = _given(value, at) if isinstance(value, dict) and at[0] in _OBJECT_ROOTS else value
    return out


def _merge(base: dict[str, Any], update: dict[str, Any], silence_ms: int, path: tuple[str, ...] = ()) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        at, current = (*path, key), out.get(key)
        if isinstance(value, dict) and at in (_TD, ("audio", "input", "format"), ("audio", "output", "format")):
            # A typed object: the same type merges field by field; a new type starts over from
            # its own defaults (no field of the old type is left behind). Without a type: the
            # current one (server_vad when turn detection was off).
            was = current if isinstance(current, dict) else {}
            kind = value.get("type", was.get("type", "server_vad" if at == _TD else None))
            start = was if was.get("type") == kind else {}
            out[key] = {**_typed_defaults(at, kind, silence_ms), **start, **copy.deepcopy(value)}
        elif isinstance(value, dict) and at == ("audio", "input", "transcription"):
            out[key] = {**DEFAULT_TRANSCRIPTION, **(current or {}), **copy.deepcopy(value)}
        elif isinstance(value, dict) and isinstance(current, dict):
            out[key] = _merge(current, value, silence_ms, at)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge(session: dict[str, Any], update: Any, vad_silence_ms: int = Config.vad_silence_ms) -> dict[str, Any]:
    """The session after `update` (a GA partial session); raises ConfigError and changes nothing
    when the result is not something the agent can serve. vad_silence_ms: the agent's
    server_vad silence (--vad-silence-ms), the default of a turn_detection switched to server_vad."""
    if not isinstance(update, dict):
        raise ConfigError("session must be an object", "session")
    update = _given(beta_session.to_ga(update))
    kind = session.get("type", "realtime")
    if update.get("type", kind) != kind:
        raise ConfigError(
            f"this is a {kind} session: its type is set when it is created (a transcription "
            "session: ?intent=transcription or an offer's session with type transcription)",
            "session.type",
        )
    # Unknown top-level fields are dropped, not echoed (beta-era ones were moved to GA's places).
    known = {k: v for k, v in update.items() if k in session}
    if isinstance(known.get("audio"), dict):  # a transcription session has no audio.output
        known["audio"] = {k: v for k, v in known["audio"].items() if k in session["audio"]}
    merged = _merge(session, known, vad_silence_ms)
    # Fields that are the server's, whatever the client says.
    merged["id"], merged["object"], merged["type"] = session["id"], session["object"], kind
    if kind == "realtime" and isinstance(interpret_to(merged), str) and interpret_to(merged) != interpret_to(session):
        _interpreter_preset(merged, update)
    validate(merged)
    return merged


def video_on(session: dict[str, Any]) -> bool:
    """Whether the camera enters the session's turns as video (omni.video, default true)."""
    return bool((session.get("omni") or {}).get("video", True))


def extra_events(session: dict[str, Any], webrtc: bool) -> bool:
    """Whether the session's transport gets the project's extra event types (outbox.is_extra):
    omni.events when set; otherwise yes on WebRTC (the page and the agent's client read them)
    and no on a WebSocket, where strict client libraries raise on a type they do not know."""
    events = (session.get("omni") or {}).get("events")
    return webrtc if events is None else bool(events)


def priority_of(session: dict[str, Any]) -> str:
    """The session's priority class (sessions from keys minted before it existed: normal)."""
    return (session.get("omni") or {}).get("priority", priority.NORMAL)


def offer_priority(session: dict[str, Any], requested: Optional[str], fixed: Optional[str]) -> dict[str, Any]:
    """The session with the offer's `?priority=` applied; `fixed`: the priority an ephemeral key's
    session carries, which the offer may not change. Raises ConfigError."""
    if requested is not None:
        check(requested in priority.PRIORITIES, f"priority must be one of {', '.join(priority.PRIORITIES)}", "priority")
        session = {**session, "omni": {**(session.get("omni") or {}), "priority": requested}}
    check(
        fixed is None or priority_of(session) == fixed,
        f"this key's session has priority {fixed}; the offer cannot change it",
        "priority",
    )
    return session


def turn_detection(session: dict[str, Any], default_silence_ms: int) -> Optional[TurnDetection]:
    """What the endpointer should do; None: manual turns (commit + response.create)."""
    td = session["audio"]["input"].get("turn_detection")
    if td is None:
        return None
    semantic, unjudged = None, 0
    if td["type"] == "semantic_vad":
        semantic, silence, unjudged = _EAGERNESS[td.get("eagerness") or "auto"]
    else:
        silence = td.get("silence_duration_ms") or default_silence_ms
    padding = td.get("prefix_padding_ms")
    return TurnDetection(
        silence_ms=silence,
        prefix_padding_ms=300 if padding is None else padding,
        create_response=td.get("create_response") is not False,
        interrupt_response=td.get("interrupt_response") is not False,
        semantic=semantic,
        unjudged_silence_ms=unjudged,
        idle_timeout_ms=td.get("idle_timeout_ms") if td["type"] == "server_vad" else None,
    )


def max_output_tokens(value: Any) -> Optional[int]:
    return None if value in (None, "inf") else int(value)


def client_secret_session(config: Config, body: Any) -> dict[str, Any]:
    """The session an ephemeral key carries: the defaults with the request's session merged in."""
    part = body.get("session") if isinstance(body, dict) else None
    base = base_session(config, part.get("type") if isinstance(part, dict) else None)
    if isinstance(body, dict) and body.get("session") is not None:
        base = merge(base, body["session"], config.vad_silence_ms)
    return base
