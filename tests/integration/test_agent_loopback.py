"""The whole path over real aiortc peers on loopback, with the real tiny Qwen3-Omni.

Pins: a client that speaks (espeak-ng WAV, then silence) with a camera over the GA WebRTC
route (POST /v1/realtime/calls, `oai-events` channel) gets the Realtime events in order
(speech_started → speech_stopped → transcript deltas → response.done), and hears AUDIBLE
agent audio after its speech ended; the agent's own TTFT/TTFA land in /metrics; bad offers
get 4xx JSON reasons; a second session works while the first is connected; barge-in clears
the output buffer; output_audio_buffer.clear with the reply left running plays none of its
later audio; bad client events get `error` events; an event larger than the peer's data channel takes is
not sent and an `error` says so (the change it reports stands), non-ASCII text going as UTF-8;
text-only sessions stay silent; an
answered offer whose peer never connects is closed, and the connect deadline counts from the
answer, so an engine slow to open the session does not eat the peer's time to connect.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.realtime_helpers import long_replies_engine, start_agent, wait_no_sessions

from agent.client.client import AgentClient
from agent.engine.factory import build_engine


@pytest.fixture
async def agent_url(tiny_model_dir: Path, request):
    runner_name = getattr(request, "param", "stream")
    running = await start_agent(tiny_model_dir, runner=runner_name, max_sessions=2)
    yield running.url
    await running.stop()


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_spoken_turn_gets_text_and_audible_audio(agent_url: str, speech_wav: Path, strict_events) -> None:
    ttfa_count_before = await _metric(agent_url, "agent_time_to_first_audio_seconds_count")
    client = AgentClient(agent_url, speech_wav)
    try:
        await client.connect()
        await client.wait_event("input_audio_buffer.speech_started", timeout=15)
        stopped = await client.wait_event("input_audio_buffer.speech_stopped", timeout=15)
        done = await client.wait_event("response.done", timeout=60)
        # Let the paced track play the reply out to the client.
        for _ in range(100):
            if client.result.audible_samples >= 24_000:
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()

    r = client.result
    types = strict_events(r.events)
    assert types[0] == "session.created"
    assert r.call_id.startswith("rtc_") and r.location == f"/v1/realtime/calls/{r.call_id}"
    deltas = r.of_type("response.output_audio_transcript.delta")
    assert deltas, f"no transcript deltas in {types}"
    assert all(e["_t"] >= stopped["_t"] for e in deltas), "text came before the turn ended"
    assert not r.of_type("response.output_audio.delta"), "WebRTC audio must stay on the media track"
    response = done["response"]
    assert response["status"] in ("completed", "incomplete")
    assert response["output"][0]["content"][0]["transcript"] == "".join(e["delta"] for e in deltas)
    assert response["usage"]["input_tokens"] > 0 and response["usage"]["output_tokens"] > 0
    omni = response["omni"]
    assert omni["ttfa_ms"] is not None and omni["ttft_ms"] is not None
    assert types.index("output_audio_buffer.started") < len(types)
    # The end of speech the endpointer saw lies inside the sent WAV's speech (±0.3 s).
    assert abs(stopped["audio_end_ms"] / 1000 - client.speech_end / 48_000) < 0.3
    # Audible: at least 0.5 s of received audio above -50 dBFS, after the speech ended.
    assert r.audible_samples >= 24_000, f"only {r.audible_samples} audible samples"
    v2v = client.voice_to_voice()
    assert v2v is not None and v2v > 0, "agent audio arrived before the user stopped speaking"
    print(f"\nvoice_to_voice_ms={v2v * 1000:.0f} server_ttfa_ms={omni['ttfa_ms']} ttft_ms={omni['ttft_ms']}")
    assert await _metric(agent_url, "agent_time_to_first_audio_seconds_count") == ttfa_count_before + 1


@pytest.mark.parametrize(
    "body,content_type,status",
    [
        (b"", "application/sdp", 400),
        (b"garbage", "application/sdp", 400),
        (b"v=0\r\n", "application/sdp", 400),
        (b"x" * 70_000, "application/sdp", 413),
        (
            b'--b\r\nContent-Disposition: form-data; name="session"\r\n\r\n{"type": "realtime"}\r\n--b--\r\n',
            "multipart/form-data; boundary=b",
            400,
        ),
    ],
)
async def test_bad_offers_get_4xx_with_reason(agent_url: str, body: bytes, content_type: str, status: int) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{agent_url}/v1/realtime/calls", data=body, headers={"Content-Type": content_type}
        ) as resp:
            assert resp.status == status
            payload = await resp.json()
            assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
        # The server is still healthy afterwards.
        async with http.get(f"{agent_url}/healthz") as resp:
            assert resp.status == 200


async def test_session_limit_answers_503_and_sessions_keep_working(agent_url: str, speech_wav: Path) -> None:
    clients = [AgentClient(agent_url, speech_wav, video=False) for _ in range(2)]
    try:
        for c in clients:
            await c.connect()
        extra = AgentClient(agent_url, speech_wav, video=False)
        with pytest.raises(RuntimeError, match="503"):
            await extra.connect()
        await extra.close()
        for c in clients:
            await c.wait_event("input_audio_buffer.speech_stopped", timeout=20)
        for c in clients:
            await c.wait_event("response.done", timeout=60)
            assert c.result.of_type("response.output_audio_transcript.delta")
    finally:
        for c in clients:
            await c.close()


async def test_barge_in_silences_the_agent_at_once(agent_url: str, speech_wav: Path, strict_events) -> None:
    """Speaking over the agent's reply stops its audio within a few frames."""
    client = AgentClient(agent_url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("output_audio_buffer.started", timeout=60)
        # Wait until the reply is audible at the client, then talk over it.
        for _ in range(100):
            if client.result.audible_samples > 4800:
                break
            await asyncio.sleep(0.05)
        before = len(client.result.of_type("input_audio_buffer.speech_started"))
        mark = len(client.result.events)
        client.audio.play()
        barge = await _next_event(client, "input_audio_buffer.speech_started", after=before, timeout=15)
        barge_at, barge_index = barge["_t"], client.result.events.index(barge)
        # Watch the window from the barge-in to the end of that utterance (a new reply may begin
        # after it): the audio the client still hears in it.
        stopped = await _event_after(client, "input_audio_buffer.speech_stopped", barge_index, timeout=20)
        window_end = stopped["_t"]
        first_done = client.result.of_type("response.done")
    finally:
        await client.close()
    r = client.result
    strict_events(r.events)
    assert first_done, "the interrupted reply was never closed"
    # Order, not timing: the agent flushed the reply's audio (output_audio_buffer.cleared; the
    # session sends it as it detects the speech, right after speech_started) before the user
    # had even finished talking over it, and the reply that was cut ended (cancelled, or
    # complete with its remaining audio dropped).
    stopped_index = r.events.index(stopped)
    flushed = [i for i, e in enumerate(r.events) if e["type"] == "output_audio_buffer.cleared" and mark <= i]
    assert flushed and flushed[0] < stopped_index, [e["type"] for e in r.events[mark : stopped_index + 1]]
    assert first_done[0]["response"]["status"] in ("cancelled", "completed", "incomplete"), first_done[0]
    # What is still heard after the barge-in is what was in flight (aiortc and jitter buffers),
    # never the rest of the reply: a wide bound, a quarter of the window (an unstopped reply
    # would fill all of it).
    late = sum(n for t, n in r.audible_log if barge_at < t < window_end)
    window = window_end - barge_at
    assert window > 0.5, f"the second utterance lasted {window:.2f} s"
    assert late < 0.25 * window * 48_000, f"{late / 48000:.2f} s of agent audio in the {window:.2f} s after barge-in"


async def test_output_audio_buffer_clear_silences_the_reply_left_running(
    tiny_model_dir: Path, speech_wav: Path, strict_events
) -> None:
    """output_audio_buffer.clear without response.cancel: the queued audio goes and none of the
    audio the reply makes afterwards is played (it used to play on, with no started event)."""
    agent = await start_agent(
        tiny_model_dir, engine=long_replies_engine, max_reply_tokens=48, max_reply_seconds=4.0, speculative_start=False
    )
    client = AgentClient(agent.url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("output_audio_buffer.started", timeout=60)
        for _ in range(100):  # bounded: some of the 4 s reply is heard
            if client.result.audible_samples > 4800:
                break
            await asyncio.sleep(0.05)
        client.send({"type": "output_audio_buffer.clear", "event_id": "clear"})
        cleared = await client.wait_event("output_audio_buffer.cleared", timeout=10)
        done = await client.wait_event("response.done", timeout=60)
        await asyncio.sleep(1.0)
    finally:
        await client.close()
        await agent.stop()
    r = client.result
    strict_events(r.events)
    assert r.events.index(cleared) < r.events.index(done), "the reply had ended: nothing to prove"
    assert done["response"]["status"] in ("completed", "incomplete"), "the reply itself runs on"
    # What is heard later is at most what was in flight at the clear (aiortc and jitter buffers).
    late = sum(n for t, n in r.audible_log if t > cleared["_t"] + 0.3)
    assert late < 0.25 * 48_000, f"{late / 48000:.2f} s of the cleared reply played on"


async def _next_event(client: AgentClient, kind: str, after: int, timeout: float) -> dict:
    """The (after+1)-th event of this kind, waited for (bounded)."""
    for _ in range(int(timeout * 20)):
        seen = client.result.of_type(kind)
        if len(seen) > after:
            return seen[after]
        await asyncio.sleep(0.05)
    pytest.fail(f"no {kind} #{after + 1}: {[e['type'] for e in client.result.events][-12:]}")


async def _event_after(client: AgentClient, kind: str, index: int, timeout: float) -> dict:
    """The first event of this kind after position `index` in the client's events (bounded)."""
    for _ in range(int(timeout * 20)):
        for event in client.result.events[index + 1 :]:
            if event["type"] == kind:
                return event
        await asyncio.sleep(0.05)
    pytest.fail(f"no {kind} after event {index}: {[e['type'] for e in client.result.events][index:]}")


async def test_data_channel_errors_and_text_only_mode(agent_url: str, speech_wav: Path) -> None:
    """Bad client events get `error` events (the session survives); a session switched to
    text-only gets captions and no audio."""
    client = AgentClient(agent_url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("session.created", timeout=10)
        await client.wait_open()
        for bad in (
            "garbage",
            "[1, 2]",
            '{"type": 7}',
            '{"type": "no.such.event"}',
            '{"type": "session.update", "session": [1]}',
            '{"type": "session.update", "event_id": "ev_bad", "session": {"output_modalities": ["smell"]}}',
        ):
            client.channel.send(bad)
        client.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
        await client.wait_event("session.updated", timeout=10)
        done = await client.wait_event("response.done", timeout=60)
        await asyncio.sleep(0.5)
    finally:
        await client.close()
    r = client.result
    errors = r.of_type("error")
    assert len(errors) == 6
    assert {e["error"]["code"] for e in errors} == {"invalid_json", "invalid_event", "unknown_event", "invalid_value"}
    assert errors[-1]["error"]["param"] == "session.output_modalities" and errors[-1]["error"]["event_id"] == "ev_bad"
    assert r.of_type("session.updated")[0]["session"]["output_modalities"] == ["text"]
    assert r.of_type("response.created")[0]["omni"]["mode"] == "text"
    assert done["response"]["output"][0]["content"][0]["text"] and r.of_type("response.output_text.delta")
    assert not r.of_type("output_audio_buffer.started") and r.audible_samples == 0


async def test_events_larger_than_the_peer_takes(agent_url: str, speech_wav: Path) -> None:
    """A peer whose data channel takes small messages (its a=max-message-size; Pion names none:
    64 KiB): non-ASCII text goes as UTF-8 (an event that fits only so is sent), and an event
    that does not fit is not sent, an `error` (event_too_large) says which, and the change it
    reports stands (the client was told it failed, and it was made)."""
    client = AgentClient(agent_url, speech_wav, video=False)
    limit = 8192

    async def small_messages(offer: str) -> tuple[str, str]:
        lines = [line for line in offer.splitlines() if not line.startswith("a=max-message-size")]
        sdp = "\r\n".join(lines).replace("a=sctp-port:5000", f"a=sctp-port:5000\r\na=max-message-size:{limit}")
        async with aiohttp.ClientSession() as http:
            headers = {"Content-Type": "application/sdp"}
            async with http.post(f"{agent_url}/v1/realtime/calls", data=sdp + "\r\n", headers=headers) as resp:
                assert resp.status == 201, await resp.text()
                return await resp.text(), resp.headers["Location"]

    try:
        await client.connect(signal=small_messages)
        await client.wait_event("session.created", timeout=10)
        await client.wait_open()
        chinese = "你好" * 1000  # 6,000 bytes of UTF-8; 12,000 as \u escapes
        client.send({"type": "session.update", "session": {"type": "realtime", "instructions": chinese}})
        updated = await client.wait_event("session.updated", timeout=30)
        assert updated["session"]["instructions"] == chinese
        client.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief. " * 1000}})
        too_large = await client.wait_event("error", timeout=30)
        client.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            }
        )
        added = await client.wait_event("conversation.item.added", timeout=30)
    finally:
        await client.close()
    assert too_large["error"]["code"] == "event_too_large" and "session.updated" in too_large["error"]["message"]
    assert str(limit) in too_large["error"]["message"]
    assert added["item"]["content"][0]["text"] == "Hi"
    # Only the one notice: the update was made (no "failed on the server"), the session goes on.
    assert [e["error"]["code"] for e in client.result.of_type("error")] == ["event_too_large"]
    assert len(client.result.of_type("session.updated")) == 1


async def test_offer_that_never_connects_frees_its_slot(tiny_model_dir: Path, speech_wav: Path) -> None:
    """An answered offer whose peer never completes ICE is closed after connect_timeout_s,
    so dead offers cannot fill the session limit."""
    running = await start_agent(tiny_model_dir, max_sessions=1, connect_timeout_s=1.0)
    url = running.url
    ghost = AgentClient(url, speech_wav, video=False)
    try:
        # Post the offer but never apply the answer: the agent's ICE checks get no reply.
        ghost.pc.addTrack(ghost.audio)
        await ghost.pc.setLocalDescription(await ghost.pc.createOffer())
        async with aiohttp.ClientSession() as http:
            offer = {"data": ghost.pc.localDescription.sdp, "headers": {"Content-Type": "application/sdp"}}
            async with http.post(f"{url}/v1/realtime/calls", **offer) as resp:
                assert resp.status == 201
            async with http.post(f"{url}/v1/realtime/calls", **offer) as resp:
                assert resp.status == 503  # the ghost holds the only slot ...
        await wait_no_sessions(url, "the never-connected session kept its slot")
        real = AgentClient(url, speech_wav, video=False)  # ... until it times out
        await real.connect()
        await real.wait_event("session.created", timeout=10)
        await real.close()
    finally:
        await ghost.close()
        await running.stop()


class _SlowOpen:
    """The real runner, its sessions' opens taking `delay_s` on the engine thread (a busy engine)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_session(self, session_id: str) -> None:
        time.sleep(self._delay_s)
        self._inner.open_session(session_id)


async def test_a_slow_session_open_leaves_the_peer_its_connect_time(tiny_model_dir: Path, speech_wav: Path) -> None:
    """The answer waits up to connect_timeout_s for the engine to open the session; the connect
    deadline starts at the answer, so an open slower than the deadline still leaves the peer its
    whole connect_timeout_s (counted from the offer, it closed such a call before its peer had
    the answer: a 201 for a dead call)."""
    timeout_s = 5.0  # the peer's ICE, DTLS and data channel within it, also on a loaded machine
    running = await start_agent(
        tiny_model_dir,
        engine=lambda config: build_engine(config, wrap=lambda runner: _SlowOpen(runner, 1.5 * timeout_s)),
        max_sessions=1,
        connect_timeout_s=timeout_s,
    )
    client = AgentClient(running.url, speech_wav, video=False)
    try:
        offered = time.monotonic()
        await client.connect()
        assert time.monotonic() - offered >= timeout_s  # the scenario: the answer came after the old deadline
        await client.wait_event("session.created", timeout=30)
        await asyncio.sleep(timeout_s + 0.5)  # past the deadline counted from the answer: still connected
        assert client.pc.connectionState == "connected" and not client.result.of_type("error")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{running.url}/v1/realtime/calls/{client.result.call_id}/events") as resp:
                assert resp.status == 200  # the call is still the agent's
    finally:
        await client.close()
        await running.stop()
