"""The model keeps what the conversation says it holds: committed user items are not rolled
back by a refused response, and their end is marked for the engine (EndUserItem) so that a
later discard (input_audio_buffer.clear) keeps their audio (the engine side:
tests/unit/test_streaming_exact.py, test_video_exact.py).

Pins: a `response.create` refused as `rate_limited` (its event_id in the error) after a manual
commit rolls nothing back: the engine is not told to discard the turn (the committed item's
audio stays in the model's context; it was discarded once, so the conversation listed an item
the model no longer had), only a speculation is dropped, the item is still retrievable, and
once the bucket refills the next `response.create` begins a reply. With server VAD a turn whose
response is refused is committed as if it asked none: speech_stopped and committed are sent,
nothing is discarded, and its end is marked (with transcription on its transcript is finished
at once, so the item does not wait for a reply that is not coming). A user message with an
`input_audio` part is marked too, with no transcript asked (the client gave the audio), unless
it joined speech under way (then it is part of that speech, documented). A response that may
call tools announces its message with its first words; an item the client added before then
is listed after the response's outputs (previous_item_id saying so), as the model has it
after the reply. A `response.create` while server VAD hears the user speaking commits the
speech so far first (the reply hears it), and the rest of the utterance is a new item with
its own speech_started, committed when the speech ends.
"""

from __future__ import annotations

import base64

import numpy as np
from support.recording_session import errors, recording_session, send_event
from support.speech import espeak_at

from agent.config import Config
from agent.engine.api import ReplyDone, TextDelta
from agent.engine.commands import EndUserItem
from agent.gate.ladder import Admission, TurnRateLimiter
from agent.media.turn_events import SpeechStarted, SpeechStopped
from agent.realtime.message_content import AudioPart


def _admission(now: list[float]) -> Admission:
    """One turn a second, burst one, on a clock the test moves."""
    return Admission(Admission.from_config(Config()).ladder, TurnRateLimiter(1.0, 1.0, clock=lambda: now[0]))


def _speech(ms: int) -> str:
    pcm = (np.sin(np.arange(24 * ms) / 7) * 8000).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


async def test_a_refused_response_keeps_the_committed_turn() -> None:
    now = [0.0]
    admission = _admission(now)
    session, engine, sent = recording_session(admission=admission)
    send_event(session, {"type": "input_audio_buffer.append", "audio": _speech(300)})
    send_event(session, {"type": "input_audio_buffer.commit"})
    await session.inbox.idle()
    [item_id] = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.committed"]
    assert admission.turns.allow()  # another session took the engine's last turn

    send_event(session, {"type": "response.create", "event_id": "evt_refused"})
    await session.inbox.idle()
    [error] = errors(sent)
    assert (error["code"], error["event_id"]) == ("rate_limited", "evt_refused")
    assert engine.turn_calls == ["drop_speculation"]  # nothing rolled back
    assert not [e for e in sent if e["type"] == "response.created"]

    send_event(session, {"type": "conversation.item.retrieve", "item_id": item_id})
    await session.inbox.idle()
    assert [e["item"]["id"] for e in sent if e["type"] == "conversation.item.retrieved"] == [item_id]

    now[0] = 1.5  # the bucket refills: the same turn is answered now
    send_event(session, {"type": "response.create"})
    await session.inbox.idle()
    assert engine.turn_calls == ["drop_speculation", "begin_reply:audio"]
    assert len([e for e in sent if e["type"] == "response.created"]) == 1 and len(errors(sent)) == 1
    await session.close()


async def test_a_refused_vad_turn_is_committed_with_its_transcript() -> None:
    now = [0.0]
    admission = _admission(now)
    session, engine, sent = recording_session(manual=False, admission=admission)
    transcription = {"model": "qwen3-omni-thinker"}
    send_event(session, {"type": "session.update", "session": {"audio": {"input": {"transcription": transcription}}}})
    await session.inbox.idle()
    assert admission.turns.allow()

    session.turn.on_event(SpeechStarted(at=0.1, onset=0.1))
    session.turn.on_event(SpeechStopped(at=1.2, end_of_speech=0.9))
    await session.inbox.idle()
    kinds = [e["type"] for e in sent]
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed")
    assert [e["code"] for e in errors(sent)] == ["rate_limited"]
    assert "discard_turn" not in engine.turn_calls and not any(k.startswith("begin_reply") for k in engine.turn_calls)
    assert [c for c in engine.commands if isinstance(c, EndUserItem)] == [EndUserItem()]
    await session.close()


async def test_an_audio_item_is_marked_unless_it_joins_speech(tmp_path) -> None:
    session, engine, sent = recording_session(manual=False)
    audio = AudioPart(np.zeros(16000, np.float32))
    session.messages.add_user("item_a", [audio], None)
    await session.inbox.idle()
    assert [c for c in engine.commands if isinstance(c, EndUserItem)] == [EndUserItem(transcript=False)]
    # The user speaks (real speech through the session's voice detector): an audio item now
    # joins that speech, so no end is marked for it.
    speech = espeak_at("hello there, how are you today", tmp_path / "hello.wav", 24000).astype("<i2")
    for start in range(0, len(speech) // 2, 480):
        chunk = base64.b64encode(speech[start : start + 480].tobytes()).decode()
        send_event(session, {"type": "input_audio_buffer.append", "audio": chunk})
    await session.inbox.idle()
    assert session.input.in_turn, "the speech was not detected: the test would prove nothing"
    session.messages.add_user("item_b", [audio], None)
    await session.inbox.idle()
    assert len([c for c in engine.commands if isinstance(c, EndUserItem)]) == 1
    await session.close()


async def test_items_added_during_a_response_are_listed_after_its_outputs() -> None:
    session, engine, sent = recording_session()
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    send_event(session, {"type": "session.update", "session": {"type": "realtime", "tools": [tool]}})
    question = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time?"}]}
    send_event(session, {"type": "conversation.item.create", "item": {**question, "id": "item_q"}})
    send_event(session, {"type": "response.create"})
    during = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Also"}]}
    send_event(session, {"type": "conversation.item.create", "item": {**during, "id": "item_during"}})
    await session.inbox.idle()
    session.on_text(TextDelta(session.id, "It is noon.", (1, 2, 3)))  # the first words
    session.on_done(ReplyDone(session.id, "stop", "It is noon.", {"text_tokens": 3}))
    added = {e["item"]["id"]: e["previous_item_id"] for e in sent if e["type"] == "conversation.item.added"}
    [message] = [i for i in added if i not in ("item_q", "item_during")]
    assert added[message] == "item_q" and added["item_during"] == "item_q"
    send_event(session, {"type": "conversation.item.retrieve", "item_id": "item_during"})
    await session.inbox.idle()
    assert errors(sent) == []
    await session.close()


async def test_a_response_asked_mid_speech_commits_the_speech_so_far(tmp_path) -> None:
    session, engine, sent = recording_session(manual=False)
    vad = {"type": "server_vad", "create_response": False}
    send_event(session, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": vad}}}})
    speech = espeak_at("hello there, how are you today", tmp_path / "hello.wav", 24000).astype("<i2")

    def append(pcm: np.ndarray) -> None:
        for start in range(0, len(pcm), 480):
            chunk = base64.b64encode(pcm[start : start + 480].tobytes()).decode()
            send_event(session, {"type": "input_audio_buffer.append", "audio": chunk})

    append(speech[: len(speech) // 2])
    await session.inbox.idle()
    assert session.input.in_turn, "the speech was not detected: the test would prove nothing"
    [first] = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.speech_started"]
    send_event(session, {"type": "response.create"})
    await session.inbox.idle()
    kinds = [e["type"] for e in sent]
    committed = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.committed"]
    started = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.speech_started"]
    assert committed == [first] and len(started) == 2 and started[1] != first
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    assert engine.turn_calls[-1] == "begin_reply:audio"
    append(np.concatenate([speech[len(speech) // 2 :], np.zeros(24000, "<i2")]))  # the rest, then silence
    await session.inbox.idle()
    stopped = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.speech_stopped"]
    committed = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.committed"]
    assert stopped == [started[1]] and committed == [first, started[1]]
    assert "turn_detected" not in str([e for e in sent if e["type"] == "response.done"])  # no barge-in
    await session.close()
