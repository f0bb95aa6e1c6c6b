"""A session's client events run one at a time in arrival order, and heavy ones leave the loop
free (agent/realtime/inbox.py, agent/realtime/client_events.py).

Pins:
- a long input_audio_buffer.append is pushed in slices with the loop yielded between them (other
  work runs meanwhile: counted, where handling it whole ran nothing until it was done), and a
  commit sent right behind it commits all of its audio, none lost or reordered;
- a long append with a bad base64 character near its end is refused whole (param `audio`, its
  event_id) and pushes nothing; an odd pcm16 byte count too;
- a user message with an image is decoded on the decode pool's thread, not the loop's, while the
  loop runs on; the item is added before the events sent behind it are handled (a
  response.create right after an image sees it: the engine is told in that order); a bad image
  is refused with its part's param, the next events handled as usual;
- a text-only message, and a short append, are handled at once (nothing waits);
- the events waiting behind a slow one are bounded: past MAX_WAITING the next is refused (False),
  and once the slow one is done they run in order;
- closing the session stops the work under way and drops what waits: nothing more reaches the
  engine, no error is reported and no coroutine is left unawaited (closed before the work began
  too);
- a handler that fails, or work whose awaited future is cancelled (the pool shutting down), is
  logged, and the events behind it still run, in order;
- a full backlog refuses the event with `rate_limited` and that event's id; padding inside a
  long append (at a slice's end) is refused as bad base64, as a whole decode would;
- a session.update with tools has them checked on the pool (the loop runs meanwhile), then is
  applied (session.updated with them) before the events behind it; a bad schema in the list is
  refused with its param and event_id and the session keeps its tools;
- an item the model adds while a message decodes moves the end: the message that named the
  old last item (`previous_item_id`) is refused, not put elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.recording_session import errors, recording_session, send_event

from agent.engine.commands import AddUserImage, AddUserText
from agent.realtime import inbox, message_content, slow_events
from agent.realtime.session import Session


def _pcm(seconds: float) -> bytes:
    t = np.arange(int(24_000 * seconds)) / 24_000
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()


async def _ticks_until_idle(session: Session) -> int:
    """How many times other work ran on the loop until the session's inbox was idle."""
    ticks = 0
    while session.inbox.busy:
        ticks += 1
        await asyncio.sleep(0)
    return ticks


def _png(side: int) -> str:
    out = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    Image.fromarray(noise).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def test_a_long_append_yields_the_loop_and_a_commit_behind_it_takes_all_its_audio() -> None:
    session, engine, sent = recording_session()
    seconds = 20.0  # under Config.max_turn_seconds, all of which a manual turn keeps
    send_event(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm(seconds)).decode()})
    send_event(session, {"type": "input_audio_buffer.commit", "event_id": "c1"})
    assert session.inbox.busy and engine.audio_samples == 0, "the commit waits behind the append"
    ticks = await _ticks_until_idle(session)
    # 0.5 s slices: the loop ran other work between each of the 40 (none when handled whole).
    assert ticks >= seconds / slow_events.SLICE_S - 1, ticks
    assert errors(sent) == []
    assert [e["type"] for e in sent if e["type"].startswith("input_audio_buffer")] == ["input_audio_buffer.committed"]
    # 20 s at 16 kHz, give or take the resampler's last partial chunk.
    assert abs(engine.audio_samples - seconds * 16_000) <= 16_000 * 0.08, engine.audio_samples
    await session.close()


@pytest.mark.parametrize("fault", ["bad character", "odd bytes"])
async def test_a_long_append_with_a_fault_is_refused_whole(fault: str) -> None:
    session, engine, sent = recording_session()
    pcm = _pcm(30.0)
    if fault == "odd bytes":
        pcm += b"\x00"
    audio = base64.b64encode(pcm).decode()
    if fault == "bad character":
        audio = audio[:-10] + "!" + audio[-9:]
    send_event(session, {"type": "input_audio_buffer.append", "event_id": "a1", "audio": audio})
    await session.inbox.idle()
    [error] = errors(sent)
    assert (error["param"], error["event_id"]) == ("audio", "a1"), error
    assert session.input.buffered_ms() == 0, "nothing of it was pushed"
    await session.close()


async def test_an_image_decodes_off_the_loop_and_what_follows_sees_it() -> None:
    decoded_on: list[str] = []
    real_decode = message_content.decode_image

    def recording_decode(*args: Any, **kwargs: Any) -> np.ndarray:
        decoded_on.append(threading.current_thread().name)
        return real_decode(*args, **kwargs)

    with ThreadPoolExecutor(1, thread_name_prefix="decode") as pool:
        session, engine, sent = recording_session(pool)
        message_content.decode_image = recording_decode  # type: ignore[assignment]
        try:
            image = {"type": "input_image", "image_url": _png(1024)}
            text = {"type": "input_text", "text": "what is this?"}
            send_event(session, {"type": "conversation.item.create", "item": _user([text, image])})
            send_event(
                session, {"type": "conversation.item.create", "item": _user([{"type": "input_text", "text": "!"}])}
            )
            assert session.inbox.busy and engine.commands == [], "the second message waits for the first"
            ticks = await _ticks_until_idle(session)
        finally:
            message_content.decode_image = real_decode  # type: ignore[assignment]
        assert decoded_on and decoded_on[0].startswith("decode"), decoded_on
        assert ticks > 0
        assert errors(sent) == []
        kinds = [type(c) for c in engine.commands if isinstance(c, (AddUserImage, AddUserText))]
        assert kinds == [AddUserImage, AddUserText, AddUserText], engine.commands
        added = [e["item"]["content"] for e in sent if e["type"] == "conversation.item.added"]
        assert [len(c) for c in added] == [2, 1]

        # A bad image is refused with its part's param; what follows is handled as usual.
        bad = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
        send_event(session, {"type": "conversation.item.create", "event_id": "i2", "item": _user([text, bad])})
        send_event(session, {"type": "conversation.item.create", "item": _user([text])})
        await session.inbox.idle()
        [error] = errors(sent)
        assert (error["param"], error["event_id"]) == ("item.content[1].image_url", "i2"), error
        assert len([e for e in sent if e["type"] == "conversation.item.added"]) == 3
        await session.close()


def _user(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


async def test_text_messages_and_short_appends_are_handled_at_once() -> None:
    session, engine, sent = recording_session()
    send_event(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm(0.2)).decode()})
    assert not session.inbox.busy and session.input.buffered_ms() > 0
    send_event(session, {"type": "conversation.item.create", "item": _user([{"type": "input_text", "text": "hi"}])})
    assert not session.inbox.busy and [type(c) for c in engine.commands] == [AddUserText]
    await session.close()


async def test_waiting_is_bounded_and_runs_in_order() -> None:
    box = inbox.Inbox()
    release = asyncio.Event()
    ran: list[int] = []

    async def slow() -> None:
        await release.wait()
        ran.append(-1)

    assert box.put(lambda: slow, 10)
    for i in range(inbox.MAX_WAITING):
        assert box.put(lambda i=i: ran.append(i), 10)  # type: ignore[func-returns-value]
    assert not box.put(lambda: ran.append(999), 10), "one past the bound is refused"  # type: ignore[func-returns-value]
    assert ran == []
    release.set()
    await box.idle()
    assert ran == [-1, *range(inbox.MAX_WAITING)]
    assert box.put(lambda: ran.append(1000), 10) and ran[-1] == 1000, "idle again: at once"  # type: ignore[func-returns-value]


async def test_closing_stops_the_work_and_drops_what_waits() -> None:
    session, engine, sent = recording_session()
    send_event(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm(120.0)).decode()})
    send_event(session, {"type": "input_audio_buffer.commit"})
    await asyncio.sleep(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited warns
        await session.close()
        await asyncio.sleep(0.05)
    assert not session.inbox.busy
    assert engine.audio_samples == 0 and errors(sent) == []


async def test_a_session_closed_before_its_heavy_event_began_leaves_no_coroutine_behind() -> None:
    session, engine, sent = recording_session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        send_event(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm(5.0)).decode()})
        image = {"type": "input_image", "image_url": _png(64)}
        send_event(session, {"type": "conversation.item.create", "item": _user([image])})
        await session.close()  # in the same pass of the loop: the work never started
        await asyncio.sleep(0.01)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
    assert not session.inbox.busy and session.input.buffered_ms() == 0 and errors(sent) == []


async def test_a_failed_or_cancelled_event_leaves_the_rest_in_order(caplog: pytest.LogCaptureFixture) -> None:
    box = inbox.Inbox()
    release = asyncio.Event()
    lost: asyncio.Future = asyncio.get_running_loop().create_future()
    ran: list[str] = []

    async def slow() -> None:
        await release.wait()
        ran.append("slow")

    def broken() -> None:
        raise RuntimeError("a bug in a handler")

    assert box.put(lambda: slow, 1)
    assert box.put(broken, 1)  # type: ignore[arg-type]
    assert box.put(lambda: lambda: lost, 1)  # its work awaits a future that gets cancelled
    assert box.put(lambda: ran.append("after"), 1)  # type: ignore[func-returns-value]
    release.set()
    await asyncio.sleep(0)
    lost.cancel()  # what the pool's shutdown does to a job not begun
    await box.idle()
    assert ran == ["slow", "after"]
    assert "a bug in a handler" in caplog.text and "cancelled" in caplog.text
    assert box.put(lambda: ran.append("at once"), 1) and ran[-1] == "at once"  # type: ignore[func-returns-value]


async def test_a_full_backlog_refuses_with_the_events_id() -> None:
    session, engine, sent = recording_session()
    send_event(session, {"type": "input_audio_buffer.append", "audio": base64.b64encode(_pcm(20.0)).decode()})
    short = base64.b64encode(_pcm(0.02)).decode()
    for i in range(inbox.MAX_WAITING + 1):
        send_event(session, {"type": "input_audio_buffer.append", "event_id": f"a{i}", "audio": short})
    [error] = errors(sent)
    assert (error["code"], error["event_id"]) == ("rate_limited", f"a{inbox.MAX_WAITING}"), error
    await session.inbox.idle()
    assert len(errors(sent)) == 1
    await session.close()


async def test_padding_inside_a_long_append_is_refused() -> None:
    session, engine, sent = recording_session()
    first = "A" * (message_content.BASE64_SLICE - 4) + "AA=="  # a slice of its own, ending padded
    audio = first + base64.b64encode(_pcm(1.0)).decode()
    send_event(session, {"type": "input_audio_buffer.append", "event_id": "p1", "audio": audio})
    await session.inbox.idle()
    [error] = errors(sent)
    assert (error["param"], error["event_id"]) == ("audio", "p1") and session.input.buffered_ms() == 0
    await session.close()


async def test_an_item_the_model_added_during_decoding_moves_the_end_the_client_named() -> None:
    with ThreadPoolExecutor(1) as pool:
        session, engine, sent = recording_session(pool)
        send_event(
            session, {"type": "conversation.item.create", "item": _user([{"type": "input_text", "text": "one"}])}
        )
        [first] = [e["item"]["id"] for e in sent if e["type"] == "conversation.item.added"]
        image = {"type": "input_image", "image_url": _png(256)}
        create = {"type": "conversation.item.create", "event_id": "i1", "previous_item_id": first}
        send_event(session, {**create, "item": _user([image])})
        assert session.inbox.busy
        # While it decodes, a turn is committed on the server's side (as server VAD commits one).
        session.push_audio(_frame(_pcm(0.5)))
        session.commit_audio(None)
        await session.inbox.idle()
        [error] = errors(sent)
        assert (error["code"], error["param"], error["event_id"]) == ("unsupported", "previous_item_id", "i1")
        assert len([e for e in sent if e["type"] == "conversation.item.added"]) == 2  # "one" and the turn
        await session.close()


def _frame(pcm: bytes):  # type: ignore[no-untyped-def]
    from agent.realtime import audio_codec

    return audio_codec.to_frame("audio/pcm", pcm)


def _tools(count: int, bad_at: int | None = None) -> list[dict[str, Any]]:
    enum = {"type": "string", "enum": ["a", "b", "c"]}
    tools = [
        {
            "type": "function",
            "name": f"tool_{i}",
            "parameters": {"type": "object", "properties": {f"p{j}": enum for j in range(8)}},
        }
        for i in range(count)
    ]
    if bad_at is not None:
        tools[bad_at]["parameters"]["properties"]["p0"] = {"type": 5}  # no JSON Schema type
    return tools


async def test_tools_are_checked_off_the_loop_before_the_update_applies() -> None:
    with ThreadPoolExecutor(1) as pool:
        session, engine, sent = recording_session(pool)
        send_event(
            session, {"type": "session.update", "event_id": "u1", "session": {"type": "realtime", "tools": _tools(24)}}
        )
        send_event(session, {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
        assert session.inbox.busy and not [e for e in sent if e["type"] == "session.updated"]
        ticks = await _ticks_until_idle(session)
        assert ticks > 0
        updated = [e["session"] for e in sent if e["type"] == "session.updated"]
        assert [len(u["tools"]) for u in updated] == [24, 24] and updated[1]["instructions"] == "Be brief."
        assert errors(sent) == []

        bad = {"type": "realtime", "tools": _tools(24, bad_at=17)}
        send_event(session, {"type": "session.update", "event_id": "u2", "session": bad})
        await session.inbox.idle()
        [error] = errors(sent)
        assert (error["param"], error["event_id"]) == ("session.tools[17].parameters", "u2"), error
        assert len(session.settings["tools"]) == 24 and len([e for e in sent if e["type"] == "session.updated"]) == 2
        await session.close()
