"""The official `openai` SDK against the agent's WebSocket transport (GET /v1/realtime).

Pins, with `AsyncOpenAI(base_url=…/v1).realtime.connect()` and the real tiny model:
- session.created carries a whole GA session; session.update merges (tolerating tracing,
  tools, transcription model, noise reduction, prompt, include) and answers session.updated;
  OpenAI's voice names get the default speaker, an unknown voice (or a custom-voice object) is
  refused with `param`, the event's id and the model's speakers, the session left as it was;
- a response's own voice speaks that response only (response.done names it, the next response
  has the session's); a response's unknown voice, another output format or metadata that is not
  string values is refused naming the field;
- a spoken WAV streamed as 24 kHz pcm16 in real time gets speech_started → speech_stopped →
  committed → response.created → transcript deltas and non-silent output_audio deltas →
  response.done with usage, ids consistent across the response's events;
- a manual turn (turn_detection null: the audio in one append, the commit right behind it, then
  response.create), a text turn with a picture (one message of input_text and input_image: the
  usage counts image tokens) and an audio item (conversation.item.create with response.create
  right behind it, with per-response instructions: the item is added first, its audio counted)
  are answered; an empty commit is an error;
- a retrieve of the reply being made holds the transcript sent so far;
- a truncate of the reply being made, then response.cancel (the Agents SDK's interrupt
  without server VAD), ends it with no error; a cancel after that is response_cancel_not_active;
- response.cancel mid-reply ends it as cancelled, no audio of it follows, the next works; the
  model keeps exactly the tokens the client was sent of a cancelled reply, its usage counts
  those and the input its prefill took, and the empty item
  of a response cancelled at once deletes cleanly;
- a bad event gets `error` naming its event_id (and the field) and the connection goes on;
- truncating the latest reply answers conversation.item.truncated and shortens its transcript;
  deleting it answers conversation.item.deleted (it is gone); deleting an earlier item is refused;
- server VAD with create_response false commits a turn without answering it, and with
  interrupt_response false speaking over a reply does not cancel it; a clear of the speech
  after a committed item leaves that item in the model's context (the next response counts
  its audio);
- a client that answers no ping (gone without a FIN) is closed and its session freed;
- agent.client.client.WsAgentClient (the benchmark's WebSocket client) times a turn;
- every server event validates strictly against the SDK's GA pydantic models.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from support.realtime_helpers import RunningAgent, module_agent, wait_no_sessions
from support.realtime_ws import Events, ask_text, b64, pcm24, picture, sdk_session, stream_realtime

from agent.engine.commands import Context
from agent.transport import ws as ws_transport

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "qwen3-omni"
AUDIBLE_RMS = 10 ** (-50 / 20) * 32768


agent = module_agent(max_reply_seconds=2.0, max_reply_tokens=16)


def audible(events: list[dict[str, Any]]) -> int:
    total = 0
    for e in events:
        pcm = np.frombuffer(base64.b64decode(e["delta"]), dtype="<i2").astype(np.float64)
        for at in range(0, len(pcm) - 479, 480):
            if np.sqrt((pcm[at : at + 480] ** 2).mean()) > AUDIBLE_RMS:
                total += 480
    return total


async def test_session_update_and_spoken_turn(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        created = await ev.wait("session.created", 10)
        assert created["session"]["type"] == "realtime" and created["session"]["model"] == MODEL
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "You are terse.",
                "output_modalities": ["audio"],
                "tracing": "auto",
                "tools": [],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 24000},
                        "transcription": {"model": "gpt-4o-mini-transcribe"},
                        "noise_reduction": {"type": "near_field"},
                        "turn_detection": {
                            "type": "server_vad",
                            "silence_duration_ms": 300,
                            "create_response": True,
                            "interrupt_response": True,
                        },
                    },
                    "output": {"voice": "marin"},
                },
            }
        )
        updated = await ev.wait("session.updated", 10)
        session = updated["session"]
        assert session["instructions"] == "You are terse." and session["tracing"] == "auto"
        assert session["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
        assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
        assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}  # kept, not dropped

        await stream_realtime(conn, pcm24(speech_wav), tail_silence_s=1.0)
        done = await ev.wait("response.done", 90)

    assert not ev.of("error"), ev.of("error")  # the instructions were taken, nothing refused
    types = [e["type"] for e in ev.all]
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    positions = [types.index(t) for t in order]
    assert positions == sorted(positions), types
    stopped = ev.of("input_audio_buffer.speech_stopped")[0]
    assert stopped["item_id"] == ev.of("input_audio_buffer.speech_started")[0]["item_id"]
    assert ev.of("input_audio_buffer.committed")[0]["item_id"] == stopped["item_id"]
    response_id, item_id = done["response"]["id"], done["response"]["output"][0]["id"]
    assert ev.of("response.output_item.added")[0]["item"]["id"] == item_id
    deltas = ev.of("response.output_audio.delta")
    transcript = ev.of("response.output_audio_transcript.delta")
    assert transcript, "no transcript deltas"
    for e in deltas + transcript:
        assert (e["response_id"], e["item_id"], e["output_index"], e["content_index"]) == (response_id, item_id, 0, 0)
    assert audible(deltas) >= 2400, "the reply's audio is silent"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "".join(e["delta"] for e in transcript)
    usage = done["response"]["usage"]
    assert usage["input_tokens"] > 0 and usage["input_token_details"]["audio_tokens"] > 0
    assert usage["output_token_details"]["audio_tokens"] > 0 and usage["output_token_details"]["text_tokens"] > 0
    assert done["response"]["status"] in ("completed", "incomplete")
    assert done["response"]["omni"]["ttfa_ms"] is not None


async def test_manual_turn_text_turn_and_errors(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        # A bad event: error with its event_id; the connection stays usable.
        await conn.send({"type": "no.such.event", "event_id": "evt_bad_1"})
        err = await ev.wait("error", 10)
        assert err["error"]["event_id"] == "evt_bad_1" and err["error"]["type"] == "invalid_request_error"
        await conn.send(
            {
                "type": "session.update",
                "event_id": "evt_bad_2",
                "session": {"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcmu"}}}},
            }
        )
        err = await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "evt_bad_2")
        assert err["error"]["param"] == "session.audio.output.format"
        # A voice the model has not: refused with the speakers it has and the event's id, the
        # session left as it was (no session.updated showing the voice, the instructions kept).
        mark = len(ev.all)
        await conn.send(
            {
                "type": "session.update",
                "event_id": "evt_voice",
                "session": {"type": "realtime", "instructions": "Not taken.", "audio": {"output": {"voice": "nobody"}}},
            }
        )
        err = await ev.wait("error", 10, where=lambda e: e["error"].get("param") == "session.audio.output.voice")
        assert "chelsie" in err["error"]["message"] and err["error"]["event_id"] == "evt_voice"
        for custom in ({"id": "voice_1"}, "zzz"):
            await conn.send(
                {"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": custom}}}}
            )
        await conn.send({"type": "conversation.item.retrieve", "event_id": "barrier", "item_id": "none"})
        await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "barrier")
        assert not [e for e in ev.all[mark:] if e["type"] == "session.updated"]
        refused = [e["error"]["param"] for e in ev.all[mark:] if e["type"] == "error"]
        assert refused == ["session.audio.output.voice"] * 3 + ["item_id"]
        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "chelsie"}}})
        # Manual turns.
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": None}},
                "prompt": None,
                "include": ["item.input_audio_transcription.logprobs"],
            }
        )
        updated = await ev.wait(
            "session.updated", 10, where=lambda e: e["session"]["audio"]["input"]["turn_detection"] is None
        )
        assert updated["session"]["audio"]["output"]["voice"] == "chelsie"
        assert updated["session"]["instructions"] != "Not taken.", "a refused update changed nothing"
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        await conn.send({"type": "input_audio_buffer.commit", "event_id": "evt_empty"})
        err = await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "evt_empty")
        assert err["error"]["code"] == "input_audio_buffer_commit_empty"
        pcm = pcm24(speech_wav)
        # All of it in one append (pushed in slices: agent/realtime/inbox.py), the commit right
        # behind it: the commit waits for the append and takes all its audio.
        await conn.input_audio_buffer.append(audio=b64(pcm))
        await conn.input_audio_buffer.commit()
        committed = await ev.wait("input_audio_buffer.committed", 10)
        await asyncio.sleep(0.5)
        assert not ev.of("input_audio_buffer.speech_started"), "VAD ran with turn_detection null"
        assert not ev.of("response.created"), "a commit alone must not start a response"
        mark = len(ev.all)
        await conn.response.create()
        done = await ev.wait("response.done", 90, after=mark)
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] > 0
        item = await _retrieve(conn, ev, committed["item_id"])
        assert item["role"] == "user" and item["content"][0]["type"] == "input_audio"

        # A text turn with a picture, answered in text.
        mark = len(ev.all)
        question = {"type": "input_text", "text": "What can you see?"}
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [question, {"type": "input_image", "image_url": picture()}],
            }
        )
        added = await ev.wait("conversation.item.added", 10, after=mark)
        assert added["item"]["content"][0]["text"] == "What can you see?"
        assert added["item"]["content"][1] == {"type": "input_image", "detail": "auto", "image_url": None}
        await conn.response.create(response={"output_modalities": ["text"]})
        done = await ev.wait("response.done", 90, after=mark)
        text = [e for e in ev.all[mark:] if e["type"] == "response.output_text.delta"]
        assert text and not [e for e in ev.all[mark:] if e["type"] == "response.output_audio.delta"]
        assert done["response"]["output_modalities"] == ["text"]
        usage = done["response"]["usage"]
        assert usage["input_token_details"]["audio_tokens"] == 0 and usage["input_token_details"]["text_tokens"] > 0
        assert usage["input_token_details"]["image_tokens"] > 0

        # A whole audio message as an item, answered with per-response instructions.
        mark = len(ev.all)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": b64(pcm)}]}
        )
        # response.create sent right behind it: it waits for the item's decoding (off the loop).
        await conn.response.create(response={"output_modalities": ["text"], "instructions": "One word only."})
        done = await ev.wait("response.done", 90, after=mark)
        kinds = [e["type"] for e in ev.all[mark:]]
        assert kinds.index("conversation.item.added") < kinds.index("response.created"), kinds
        added = ev.all[mark + kinds.index("conversation.item.added")]
        assert added["item"]["content"][0]["type"] == "input_audio"
        assert not [e for e in ev.all[mark:] if e["type"] == "error"]
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] > 0


async def _retrieve(conn: Any, ev: Events, item_id: str) -> dict[str, Any]:
    mark = len(ev.all)
    await conn.conversation.item.retrieve(item_id=item_id)
    return (await ev.wait("conversation.item.retrieved", 10, after=mark))["item"]


async def test_a_responses_own_voice_and_checks(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        session = (await ev.wait("session.created", 10))["session"]
        own = "aiden" if session["audio"]["output"]["voice"] != "aiden" else "chelsie"
        for n, (response, param) in enumerate(
            [
                ({"audio": {"output": {"voice": "nobody"}}}, "response.audio.output.voice"),
                ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "response.audio.output.format"),
                ({"metadata": {"count": 3}}, "response.metadata"),
            ]
        ):
            await conn.send({"type": "response.create", "event_id": f"evt_r{n}", "response": response})
            err = await ev.wait("error", 10, where=lambda e, n=n: e["error"]["event_id"] == f"evt_r{n}")
            assert err["error"]["param"] == param, err
        assert not ev.of("response.created"), "a refused response.create made nothing"
        voices = []
        for response in ({"audio": {"output": {"voice": own}}}, {}):
            mark = len(ev.all)
            await ask_text(conn, "Say something.", **response)
            done = await ev.wait("response.done", 60, after=mark)
            voices.append(done["response"]["audio"]["output"]["voice"])
        assert voices == [own, session["audio"]["output"]["voice"]]


async def test_cancel_mid_reply_and_truncate(agent: RunningAgent, strict_event) -> None:
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}
        )
        await conn.response.create()
        first = await ev.wait("response.output_audio.delta", 90)
        # The item being made holds the words sent so far (it was empty until the reply ended).
        making = await _retrieve(conn, ev, first["item_id"])
        upto = next(i for i, e in enumerate(ev.all) if e["type"] == "conversation.item.retrieved")
        said = "".join(e["delta"] for e in ev.all[:upto] if e["type"] == "response.output_audio_transcript.delta")
        assert making["status"] == "in_progress" and making["content"][0]["transcript"] == said and said
        await conn.response.cancel()
        done = await ev.wait("response.done", 30)
        assert done["response"]["id"] == first["response_id"] and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        await asyncio.sleep(0.5)
        at_done = ev.all.index(done)
        assert not [
            e for e in ev.all[at_done:] if e.get("response_id") == first["response_id"] and e["type"].endswith(".delta")
        ], "deltas of a cancelled response"

        # Still usable: a full reply, then cut it to the first 160 ms heard.
        mark = len(ev.all)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again please."}]}
        )
        await conn.response.create()
        done = await ev.wait("response.done", 90, after=mark)
        item_id = done["response"]["output"][0]["id"]
        full = done["response"]["output"][0]["content"][0]["transcript"]
        await conn.send(
            {
                "type": "conversation.item.truncate",
                "event_id": "evt_far",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 600_000,
            }
        )
        err = await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "evt_far")
        assert err["error"]["param"] == "audio_end_ms"
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=160)
        truncated = await ev.wait("conversation.item.truncated", 10)
        assert truncated["item_id"] == item_id and truncated["audio_end_ms"] == 160
        item = await _retrieve(conn, ev, item_id)
        cut = item["content"][0]["transcript"]
        assert full.startswith(cut) and len(cut) < len(full)
        # An earlier item cannot be deleted (the model's context keeps the turns in order) ...
        user_item = next(
            e["item"]["id"] for e in ev.all if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"
        )
        await conn.send({"type": "conversation.item.delete", "event_id": "evt_del", "item_id": user_item})
        err = await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "evt_del")
        assert err["error"]["code"] == "unsupported"
        # ... the latest assistant item can: it leaves the list (and the model's context).
        await conn.conversation.item.delete(item_id=item_id)
        deleted = await ev.wait("conversation.item.deleted", 10)
        assert deleted["item_id"] == item_id
        await conn.send({"type": "conversation.item.retrieve", "event_id": "evt_gone", "item_id": item_id})
        err = await ev.wait("error", 10, where=lambda e: e["error"]["event_id"] == "evt_gone")
        assert err["error"]["code"] == "item_retrieve_invalid_item_id"


async def test_an_interrupt_by_truncate_then_cancel_is_no_error(agent: RunningAgent, strict_event) -> None:
    """The Agents SDK's interrupt without server VAD (and on a guardrail trip): a truncate of the
    reply being made, then response.cancel. The truncate ends the reply; the cancel, finding it
    ended, is no error (it was response_cancel_not_active every time). A later one is."""
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await ask_text(conn, "Tell me a long story.")
        first = await ev.wait("response.output_audio.delta", 90)
        await conn.conversation.item.truncate(item_id=first["item_id"], content_index=0, audio_end_ms=0)
        await conn.response.cancel(response_id=first["response_id"])
        truncated = await ev.wait("conversation.item.truncated", 30)
        done = await ev.wait("response.done", 30)
        assert done["response"]["status"] == "cancelled" and truncated["item_id"] == first["item_id"]
        await conn.send({"type": "response.cancel", "event_id": "evt_again"})
        await conn.send({"type": "conversation.item.retrieve", "item_id": first["item_id"], "event_id": "evt_sync"})
        await ev.wait("conversation.item.retrieved", 10)
        errors = [e["error"] for e in ev.all if e["type"] == "error"]
        # Only the cancel sent once the client had seen the response end is refused (OpenAI's code).
        assert [(e["code"], e["event_id"]) for e in errors] == [("response_cancel_not_active", "evt_again")], errors


async def test_a_cancelled_reply_keeps_in_the_model_what_its_item_says(agent: RunningAgent, strict_event) -> None:
    """response.cancel: the model keeps the tokens the client was sent, no more (it kept the
    one or two the engine made before the cancel reached it); a response cancelled before its
    prefill ended has an empty item that deletes cleanly (it was an engine_error)."""
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        created = await ev.wait("session.created", 10)
        session_id = created["session"]["id"]
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await ev.wait("session.updated", 10)
        story = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}
        await conn.conversation.item.create(item=story)
        mark = len(ev.all)
        await conn.response.create()
        first = await ev.wait("response.output_text.delta", 90, after=mark)
        await conn.response.cancel()
        done = await ev.wait("response.done", 30, after=mark)
        assert done["response"]["status"] == "cancelled"
        sent = "".join(e["delta"] for e in ev.all[mark:] if e["type"] == "response.output_text.delta")
        assert sent and sent.startswith(first["delta"])
        context = await agent.engine.send(session_id, Context())
        kept = context["last_reply"]["tokens"]
        usage = done["response"]["usage"]
        assert len(kept) == usage["output_token_details"]["text_tokens"], (kept, sent)
        # Its input was prefilled before its first word: the usage counts it (it said 0).
        assert usage["input_token_details"]["text_tokens"] > 0, usage
        assert usage["input_tokens"] == usage["total_tokens"] - usage["output_tokens"] > 0, usage
        # Cancelled before its prefill ended: nothing of it is in the model; its item deletes.
        await conn.conversation.item.create(item=story)
        mark = len(ev.all)
        await conn.response.create()
        await conn.response.cancel()
        done = await ev.wait("response.done", 30, after=mark)
        item_id = done["response"]["output"][0]["id"]
        await conn.conversation.item.delete(item_id=item_id)
        deleted = await ev.wait("conversation.item.deleted", 10, after=mark)
        assert deleted["item_id"] == item_id and not ev.of("error"), ev.of("error")


async def test_vad_without_create_or_interrupt(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    """create_response false: a detected turn is committed, not answered; interrupt_response
    false: speaking over a reply does not cancel it."""
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {
                        "turn_detection": {"type": "server_vad", "create_response": False, "interrupt_response": False}
                    }
                },
            }
        )
        await ev.wait("session.updated", 10)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk to me."}]}
        )
        # Speak at once (the WAV's lead-in silence cut off) while the reply is being made, so the
        # speech starts during the reply and not only after it has been generated.
        pcm = pcm24(speech_wav)
        voiced = np.flatnonzero(np.abs(pcm) > 500)
        await conn.response.create()
        await ev.wait("response.created", 30)
        await stream_realtime(conn, pcm[max(0, voiced[0] - 480) :], tail_silence_s=1.0)
        committed = await ev.wait("input_audio_buffer.committed", 30)
        first = await ev.wait("response.done", 90)
        started = ev.of("input_audio_buffer.speech_started")[0]
        assert ev.all.index(started) < ev.all.index(first), "the speech did not overlap the reply"
        assert first["response"]["status"] in ("completed", "incomplete")
        await asyncio.sleep(1.0)
        assert len(ev.of("response.created")) == 1, "create_response false still answered the turn"
        mark = len(ev.all)
        await conn.response.create()
        done = await ev.wait("response.done", 90, after=mark)
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] > 0
        assert ev.all.index(committed) < mark


async def test_a_clear_keeps_the_committed_item(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    """create_response false: a committed item, then more speech cleared (input_audio_buffer.clear
    while the user speaks): the response that follows still hears the committed item (its audio
    is counted; the clear once dropped it with the speech after it)."""
    async with sdk_session(agent.url, strict_event) as (conn, ev):
        await ev.wait("session.created", 10)
        vad = {"type": "server_vad", "create_response": False}
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": vad}}})
        await ev.wait("session.updated", 10)
        pcm = pcm24(speech_wav)
        await stream_realtime(conn, pcm, tail_silence_s=1.0)
        await ev.wait("input_audio_buffer.committed", 30)
        mark = len(ev.all)
        voiced = np.flatnonzero(np.abs(pcm) > 500)
        await stream_realtime(conn, pcm[max(0, voiced[0] - 480) : voiced[0] + 24_000], tail_silence_s=0)
        await ev.wait("input_audio_buffer.speech_started", 30, after=mark)
        await conn.input_audio_buffer.clear()
        await ev.wait("input_audio_buffer.cleared", 10, after=mark)
        assert not ev.of("input_audio_buffer.speech_stopped")[1:], "the cleared speech was committed"
        await conn.response.create()
        done = await ev.wait("response.done", 90, after=mark)
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] > 0


async def test_a_client_that_answers_no_ping_is_closed_and_frees_its_session(
    agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat: a client gone without a FIN (here: one that never answers a ping) is
    closed, and its session and engine slot freed, within a heartbeat and a half (it once held
    them until TCP gave up, refusing new sessions at the cap)."""
    monkeypatch.setattr(ws_transport, "HEARTBEAT_S", 1.0)
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{agent.url}/v1/realtime?model=x", protocols=("realtime",), autoping=False)
        started = asyncio.get_running_loop().time()

        async def read() -> int:  # read, never answer
            return sum([msg.type == aiohttp.WSMsgType.PING async for msg in ws])

        pings = await asyncio.wait_for(read(), 15)  # (bounded: without a heartbeat it never ends)
        took = asyncio.get_running_loop().time() - started
    assert pings >= 1 and took < 10, (pings, took)
    await wait_no_sessions(agent.url, "the session of a client that answers no ping is still open")


async def test_ws_agent_client_times_a_turn(agent: RunningAgent, speech_wav: Path, strict_event) -> None:
    """agent.client.client.WsAgentClient (what the benchmark uses) hears a reply after its speech ended."""
    from agent.client.client import WsAgentClient

    client = WsAgentClient(agent.url, speech_wav)
    try:
        await client.connect()
        await client.wait_event("response.done", 90)
        for _ in range(50):
            if client.turn_latencies() and client.turn_latencies()[0] is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    latencies = client.turn_latencies()
    assert latencies and latencies[0] is not None and latencies[0] > 0
    assert client.result.audible_samples > 0
    for event in client.result.events:
        strict_event(event)
