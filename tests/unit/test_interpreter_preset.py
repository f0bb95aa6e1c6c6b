"""Interpreter mode as a session preset (omni.interpret_to, agent/realtime/session_config.py).

Pins: setting omni.interpret_to fills the session's instructions from the interpreter template
for that language and turns barge-in off (turn_detection.interrupt_response false), unless the
same update sets instructions or interrupt_response itself; the update that changes nothing
about it re-applies nothing (a client's later instructions stay); a bad language, or one on a
transcription session, is refused with param session.omni.interpret_to; and transcription
sessions keep their type (an update to realtime is refused with param session.type).
"""

from __future__ import annotations

import pytest

from agent.config import Config
from agent.realtime import session_config as sc


def test_preset_fills_instructions_and_turns_off_barge_in():
    base = sc.default_session(Config())
    s = sc.merge(base, {"omni": {"interpret_to": "French"}})
    assert s["instructions"] == sc.interpret_instructions("French") and "French" in s["instructions"]
    assert s["audio"]["input"]["turn_detection"]["interrupt_response"] is False
    assert s["omni"] == {"priority": "normal", "interpret_to": "French"}
    # Later updates that leave interpret_to alone keep what the client sets.
    s2 = sc.merge(s, {"instructions": "Only German.", "omni": {"interpret_to": "French"}})
    assert s2["instructions"] == "Only German."
    s3 = sc.merge(s, {"audio": {"input": {"turn_detection": {"type": "server_vad", "interrupt_response": True}}}})
    assert s3["audio"]["input"]["turn_detection"]["interrupt_response"] is True


def test_same_update_overrides_the_preset():
    base = sc.default_session(Config())
    s = sc.merge(
        base,
        {
            "instructions": "Mine.",
            "omni": {"interpret_to": "Spanish"},
            "audio": {"input": {"turn_detection": {"type": "server_vad", "interrupt_response": True}}},
        },
    )
    assert s["instructions"] == "Mine."
    assert s["audio"]["input"]["turn_detection"]["interrupt_response"] is True


@pytest.mark.parametrize("lang", ["", "   ", 3, "x" * 65])
def test_bad_language_is_refused(lang):
    with pytest.raises(sc.ConfigError) as err:
        sc.merge(sc.default_session(Config()), {"omni": {"interpret_to": lang}})
    assert err.value.param == "session.omni.interpret_to"


def test_transcription_sessions():
    t = sc.default_transcription_session(Config())
    assert t["type"] == "transcription" and sc.transcribes(t)
    with pytest.raises(sc.ConfigError) as err:
        sc.merge(t, {"omni": {"interpret_to": "French"}})
    assert err.value.param == "session.omni.interpret_to"
    with pytest.raises(sc.ConfigError) as err:
        sc.merge(t, {"type": "realtime"})
    assert err.value.param == "session.type"
    updated = sc.merge(t, {"type": "transcription", "audio": {"input": {"turn_detection": None}}})
    assert updated["audio"]["input"]["turn_detection"] is None and updated["id"] == t["id"]
    assert not sc.transcribes(sc.default_session(Config()))
