"""The protocol pieces that need no network: session config merging, keys, G.711 decoding.

Pins:
- the default session validates strictly as the SDK's GA session model (its max_output_tokens
  "inf", whatever the server's own cap); an update merges
  nested objects field by field, drops unknown top-level fields (and audio.output in a
  transcription session), moves beta-era flat fields to their GA places (the GA field winning
  when both are given, beta format names mapped, a bad beta value refused under its GA
  param), keeps tolerated ones
  (tracing, tools, transcription model, noise reduction) and leaves the session unchanged
  when refused, naming the param (values outside GA's enumerations and ranges too); turn
  detection maps to the endpointer's settings; a voice is one of the model's speakers, any
  case, `default` or an OpenAI name, never a custom-voice object; instructions and tools past
  2 bytes of UTF-8 per token of the model's context are refused, naming which;
- events go out as UTF-8 JSON, non-ASCII unescaped (a lone surrogate escaped);
- a null field is one not given (its value stays), except where GA null means off/none
  (turn_detection, transcription, noise_reduction, tracing, prompt, include); the merged
  session is whole: turn_detection holds every field of its type (a new type: that type's
  defaults plus what was given), a format its rate, a transcription its model/language/prompt;
- keys: open without an API key; with one, only it or a live ephemeral key passes; expired or
  tampered ephemeral keys fail; TTLs outside 10..7200 s are refused; the WebSocket
  subprotocol form is read;
- µ-law and A-law decode to the G.711 reference values;
- the project's extra event types (omni.*, input_video.throttle) reach a session's transport only
  when it asks (omni.events; default on for WebRTC, off for a WebSocket, where some client
  libraries raise on a type they do not know); SSE readers and taps get every event; a reader
  that falls a queue behind is dropped and gets the end marker (after its backlog), as every
  reader does when the outbox closes, full queue or not, so its connection is closed rather
  than left open and silent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from openai.types.realtime import RealtimeSessionCreateRequest

from agent.config import Config
from agent.engine.api import Voices
from agent.gate.api_keys import KeyStore, bearer_token
from agent.realtime import audio_codec, session_checks, session_config
from agent.realtime.config_error import ConfigError
from agent.realtime.outbox import Outbox


def test_default_session_is_a_ga_session() -> None:
    s = session_config.default_session(Config(), model="m")
    RealtimeSessionCreateRequest.model_validate(s)
    # The server's reply cap is not the session's field: a cap above GA's 4096 keeps it valid.
    long = session_config.default_session(Config(max_reply_tokens=8192))
    assert session_config.merge(long, {"type": "realtime"}, 300)["max_output_tokens"] == "inf"
    assert s["type"] == "realtime" and s["id"].startswith("sess_") and s["output_modalities"] == ["audio"]


TD = "session.audio.input.turn_detection"


def test_beta_fields_move_to_their_ga_places() -> None:
    base = session_config.default_session(Config(vad_silence_ms=300))
    beta = {
        "modalities": ["text", "audio"],
        "voice": "alloy",
        "input_audio_format": "g711_ulaw",
        "output_audio_format": "pcm16",
        "input_audio_transcription": {"model": "whisper-1"},
        "input_audio_noise_reduction": {"type": "near_field"},
        "turn_detection": None,
        "max_response_output_tokens": 200,
        "temperature": 0.7,
    }
    merged = session_config.merge(base, beta)
    RealtimeSessionCreateRequest.model_validate(merged)
    audio_in, audio_out = merged["audio"]["input"], merged["audio"]["output"]
    assert merged["output_modalities"] == ["audio"] and merged["max_output_tokens"] == 200
    assert audio_in["format"] == {"type": "audio/pcmu"} and audio_in["turn_detection"] is None
    assert audio_in["transcription"]["model"] == "whisper-1" and audio_in["noise_reduction"]["type"] == "near_field"
    assert audio_out["voice"] == "alloy" and audio_out["format"] == {"type": "audio/pcm", "rate": 24000}
    assert not set(beta) & set(merged) and beta["voice"] == "alloy"  # the client's dict untouched
    assert session_config.merge(base, {"modalities": ["text"]})["output_modalities"] == ["text"]
    # The GA field wins over its beta twin in the same update.
    both = session_config.merge(base, {"voice": "alloy", "audio": {"output": {"voice": "marin"}}})
    assert both["audio"]["output"]["voice"] == "marin"
    with pytest.raises(ConfigError) as refused:
        session_config.merge(base, {"input_audio_format": "pcm24"})
    assert refused.value.param == "session.audio.input.format"
    # A transcription session has no output: a beta voice (or a GA audio.output) is dropped.
    transcription = session_config.default_transcription_session(Config())
    quiet = session_config.merge(transcription, {"voice": "alloy", "audio": {"output": {"speed": 2}}})
    assert set(quiet["audio"]) == {"input"}


def test_merge_tolerates_refuses_and_maps() -> None:
    base = session_config.default_session(Config(vad_silence_ms=300))
    merged = session_config.merge(
        base,
        {
            "type": "realtime",
            "tracing": "auto",
            "tools": [{"type": "function", "name": "f"}],
            "unknown_field": 1,
            "audio": {
                "input": {
                    "transcription": {"model": "gpt-4o-mini-transcribe"},
                    "noise_reduction": {"type": "far_field"},
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 700, "create_response": False},
                },
                "output": {"voice": "marin"},
            },
        },
    )
    assert merged["tracing"] == "auto" and merged["tools"][0]["name"] == "f" and "unknown_field" not in merged
    assert merged["audio"]["input"]["format"] == base["audio"]["input"]["format"]  # untouched sibling kept
    assert merged["audio"]["output"]["voice"] == "marin" and merged["id"] == base["id"]
    RealtimeSessionCreateRequest.model_validate(merged)
    td = session_config.turn_detection(merged, 300)
    assert (td.silence_ms, td.create_response, td.interrupt_response) == (700, False, True)
    manual = session_config.merge(merged, {"audio": {"input": {"turn_detection": None}}})
    assert session_config.turn_detection(manual, 300) is None
    semantic = session_config.merge(
        base, {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}}
    )
    low = session_config.turn_detection(semantic, 300)  # eagerness low: judged, or 800 ms by silence alone
    assert (low.silence_ms, low.unjudged_silence_ms, low.semantic.tiers[0][0]) == (1200, 800, 0.97)
    for update, param in [
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate"),
        ({"audio": {"output": {"format": {"type": "audio/pcma"}}}}, "session.audio.output.format"),
        ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
        ({"type": "transcription"}, "session.type"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        ({"instructions": 5}, "session.instructions"),
        # GA's enumerations and ranges: refused rather than echoed (a client's own types would
        # fail to read the session.updated back).
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "bogus"}}}}, f"{TD}.eagerness"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}}, f"{TD}.threshold"),
        ({"audio": {"input": {"noise_reduction": {"type": "bogus"}}}}, "session.audio.input.noise_reduction"),
        ({"tracing": "sometimes"}, "session.tracing"),
        ({"truncation": "bogus"}, "session.truncation"),
        ({"truncation": {"type": "retention_ratio", "retention_ratio": 1.5}}, "session.truncation"),
        ({"include": ["bogus"]}, "session.include"),
        ({"prompt": {"id": 5}}, "session.prompt"),
    ]:
        with pytest.raises(session_config.ConfigError) as info:
            session_config.merge(base, update)
        assert info.value.param == param
    assert base == session_config.default_session(Config(vad_silence_ms=300)) | {"id": base["id"]}
    # Their GA values are taken, and the SDK reads the session back.
    fine = session_config.merge(
        base,
        {
            "truncation": {"type": "retention_ratio", "retention_ratio": 0.5},
            "prompt": {"id": "pmpt_1", "variables": {"city": "Oslo"}},
            "tracing": {"workflow_name": "w"},
            "include": ["item.input_audio_transcription.logprobs"],
            "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7}}},
        },
    )
    RealtimeSessionCreateRequest.model_validate(fine)


def test_a_voice_is_one_the_model_speaks_with() -> None:
    voices = Voices(("aiden", "chelsie", "ethan"), "ethan")
    base = session_config.default_session(Config())
    for voice in ("Chelsie", "default", "alloy", "marin"):
        session_checks.check_voice(session_config.merge(base, {"audio": {"output": {"voice": voice}}}), voices)
    for voice in ("nobody", {"id": "voice_1"}):
        with pytest.raises(ConfigError) as info:
            session_checks.check_voice(session_config.merge(base, {"audio": {"output": {"voice": voice}}}), voices)
        assert info.value.param == "session.audio.output.voice"
    assert "chelsie" in str(info.value) or "custom" in str(info.value)
    # Before the model is loaded its speakers are not known: a name is the engine's to refuse.
    session_checks.check_voice(session_config.merge(base, {"audio": {"output": {"voice": "nobody"}}}), Voices())


def test_instructions_and_tools_fit_the_context() -> None:
    base = session_config.default_session(Config())
    tool = {"type": "function", "name": "f", "description": "Does f. " * 150, "parameters": {"type": "object"}}
    fits = session_config.merge(base, {"type": "realtime", "instructions": "x" * 800, "tools": [tool]})
    session_checks.check_servable(fits, Voices(), context_limit=4096)
    for update, param in [
        ({"instructions": "x" * 9000}, "session.instructions"),
        ({"instructions": "字" * 2800}, "session.instructions"),  # 8,400 bytes of UTF-8: over, though 2,800 characters
        ({"tools": [{**tool, "name": f"f{i}"} for i in range(8)]}, "session.tools"),
    ]:
        with pytest.raises(ConfigError) as info:
            session_checks.check_fits(session_config.merge(base, {"type": "realtime", **update}), 4096)
        assert info.value.param == param and "8192 fit" in str(info.value)
    # A transcription session has no system message.
    session_checks.check_fits(session_config.base_session(Config(), "transcription"), 16)


def test_events_keep_their_characters_unescaped() -> None:
    """Non-ASCII text goes as UTF-8, not \\u escapes (a data channel's messages are bounded);
    a lone surrogate, which has no UTF-8, is escaped as it came."""
    sent: list[str] = []
    outbox = Outbox(sent.append)
    outbox.emit({"type": "conversation.item.added", "text": "你好, señor"})
    outbox.emit({"type": "conversation.item.added", "text": "half \ud800 pair"})
    assert "你好, señor" in sent[0] and len(sent[0].encode()) < len(json.dumps(json.loads(sent[0])).encode())
    assert "\\ud800" in sent[1] and json.loads(sent[1])["text"] == "half \ud800 pair"
    assert all(text.encode("utf-8") for text in sent)


def test_null_is_not_given_and_the_session_stays_whole() -> None:
    base = session_config.default_session(Config(vad_silence_ms=300))
    nulls = {
        "type": None,
        "instructions": None,
        "output_modalities": None,
        "model": None,
        "max_output_tokens": None,
        "tools": None,
        "tool_choice": None,
        "truncation": None,
        "omni": {"priority": None, "video": None},
        "audio": {
            "input": {"format": None},
            "output": {"format": {"type": "audio/pcm", "rate": None}, "voice": None, "speed": None},
        },
    }
    assert session_config.merge(base, nulls) == base
    td_nulls = {k: None for k in session_config.server_vad(300) if k != "type"}
    assert (
        session_config.merge(base, {"audio": {"input": {"turn_detection": {"type": "server_vad", **td_nulls}}}}) == base
    )
    assert session_config.merge(base, {"audio": None, "omni": None}) == base
    off = session_config.merge(
        {**base, "tracing": "auto", "include": ["item.input_audio_transcription.logprobs"]},
        {
            "tracing": None,
            "prompt": None,
            "include": None,
            "audio": {"input": {"turn_detection": None, "transcription": None, "noise_reduction": None}},
        },
    )
    assert (off["tracing"], off["prompt"], off["include"]) == (None, None, None)
    assert all(off["audio"]["input"][k] is None for k in ("turn_detection", "transcription", "noise_reduction"))

    def td_after(session: dict, update: dict, silence: int = 300) -> dict:
        merged = session_config.merge(session, {"audio": {"input": {"turn_detection": update}}}, silence)
        RealtimeSessionCreateRequest.model_validate(merged)
        return merged["audio"]["input"]["turn_detection"]

    assert td_after(base, {"type": "server_vad", "silence_duration_ms": 400}) == {
        **session_config.server_vad(300),
        "silence_duration_ms": 400,
    }
    semantic = {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": True}
    assert td_after(base, {"type": "semantic_vad"}) == semantic  # a new type: none of server_vad's fields
    was_semantic = session_config.merge(base, {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    assert td_after(was_semantic, {"type": "server_vad", "create_response": False}, 250) == {
        **session_config.server_vad(250),
        "create_response": False,
    }
    assert td_after(off, {"silence_duration_ms": 600}) == {**session_config.server_vad(300), "silence_duration_ms": 600}

    def input_after(update: dict) -> dict:
        merged = session_config.merge(base, {"audio": {"input": update}})
        RealtimeSessionCreateRequest.model_validate(merged)
        return merged["audio"]["input"]

    assert input_after({"format": {"type": "audio/pcmu"}})["format"] == {"type": "audio/pcmu"}
    assert input_after({"format": {"type": "audio/pcm"}})["format"] == {"type": "audio/pcm", "rate": 24000}
    assert input_after({"transcription": {}})["transcription"] == session_config.DEFAULT_TRANSCRIPTION
    assert input_after({"transcription": {"language": "en", "model": None}})["transcription"] == {
        **session_config.DEFAULT_TRANSCRIPTION,
        "language": "en",
    }


def test_keys() -> None:
    assert KeyStore("").check(None) is not None  # open
    now = [1000.0]
    keys = KeyStore("sk-1", clock=lambda: now[0])
    assert keys.check(None) is None and keys.check("sk-2") is None and keys.check("sk-1") is not None
    value, expires_at = keys.mint(60, {"instructions": "x"})
    assert value.startswith("ek_") and expires_at == 1060
    grant = keys.check(value)
    assert grant is not None and grant.ephemeral and grant.session == {"instructions": "x"}
    assert keys.check(value[:-1] + ("0" if value[-1] != "0" else "1")) is None
    now[0] = 1060.0
    assert keys.check(value) is None
    for ttl in (9, 7201):
        with pytest.raises(ValueError):
            keys.mint(ttl, {})
    assert bearer_token({"Authorization": "Bearer abc"}) == "abc"
    assert (
        bearer_token({"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.ek_x, openai-agents-sdk.1"})
        == "ek_x"
    )
    assert bearer_token({}) is None


def test_g711_decoding() -> None:
    # Reference points of ITU-T G.711 (as the C reference and Python's audioop decode them).
    ulaw = audio_codec.to_pcm16("audio/pcmu", bytes([0x00, 0x7F, 0x80, 0xFF]))
    alaw = audio_codec.to_pcm16("audio/pcma", bytes([0x55, 0xD5, 0x2A, 0xAA]))
    assert ulaw.tolist() == [-32124, 0, 32124, 0]
    assert alaw.tolist() == [-8, 8, -32256, 32256]
    frame = audio_codec.to_frame("audio/pcmu", bytes(160))
    assert frame.sample_rate == 8000 and frame.samples == 160
    pcm = np.arange(2400, dtype=np.int16)
    assert len(audio_codec.to_16k("audio/pcm", pcm.tobytes())) == 1600


def test_extra_event_types_only_for_sessions_that_ask() -> None:
    sent: list[str] = []
    tapped: list[str] = []
    outbox = Outbox(sent.append)
    outbox.taps.append(lambda event, text: tapped.append(event["type"]))
    sse = outbox.subscribe()
    kinds = ["response.created", "omni.response.mode", "input_video.throttle", "omni.input_audio_transcription.partial"]
    outbox.extras = False
    for kind in kinds:
        outbox.emit({"type": kind})
    assert [json.loads(t)["type"] for t in sent] == ["response.created"]
    assert tapped == kinds
    assert [json.loads(sse.get_nowait())["type"] for _ in kinds] == kinds
    outbox.extras = True
    outbox.emit({"type": "omni.response.mode"})
    assert json.loads(sent[-1])["type"] == "omni.response.mode"

    base = session_config.default_session(Config())
    assert session_config.extra_events(base, webrtc=True) is True
    assert session_config.extra_events(base, webrtc=False) is False
    on = session_config.merge(base, {"type": "realtime", "omni": {"events": True}}, 300)
    off = session_config.merge(base, {"type": "realtime", "omni": {"events": False}}, 300)
    assert session_config.extra_events(on, webrtc=False) is True
    assert session_config.extra_events(off, webrtc=True) is False
    assert on["omni"]["priority"] == base["omni"]["priority"]  # merged field by field
    with pytest.raises(ConfigError) as refused:
        session_config.merge(base, {"type": "realtime", "omni": {"events": "yes"}}, 300)
    assert refused.value.param == "session.omni.events"


def test_a_reader_dropped_or_at_the_close_gets_the_end_marker() -> None:
    outbox = Outbox(lambda _: None)
    slow, quick = outbox.subscribe(), outbox.subscribe()
    for n in range(slow.maxsize + 1):  # the slow reader never takes one
        outbox.emit({"type": "omni.tick", "n": n})
        while not quick.empty():
            quick.get_nowait()
    assert not outbox.subscribed(slow) and outbox.subscribed(quick)
    backlog = [slow.get_nowait() for _ in range(slow.qsize())]
    assert backlog[-1] is None and all(backlog[:-1])  # told, after what it still holds
    full = outbox.subscribe()
    for n in range(full.maxsize):
        outbox.emit({"type": "omni.tick", "n": n})
    assert full.full()
    outbox.close()
    left = [full.get_nowait() for _ in range(full.qsize())]
    assert left[-1] is None and quick.get_nowait() is not None
