"""WebRTC signalling in the GA form, driven by the official `openai` SDK and a real aiortc peer.

Pins:
- `client.realtime.calls.create(sdp=…, session=…)` (multipart) gets 201, an SDP answer and
  `Location: /v1/realtime/calls/rtc_…`; the session part is applied (session.created shows it);
- the spoken WAV is answered with audible audio on the media track, events on the
  client-created `oai-events` channel (the agent opens no channel of its own), no audio
  deltas on the channel, output_audio_buffer.started/stopped around the reply, and every
  event validates strictly against the SDK's GA models; SSE streams the same events;
- `calls.hangup` ends the call; raw SDP on /v1/realtime/calls?model= and the older
  POST /v1/realtime?model= are answered 201 too; a sideband WebSocket (?call_id=) carries the
  call's events; DELETE ends a call (204), then 404; a sideband on an ended call is 410
  `call_ended`, on one never seen 404; a sideband whose client stopped reading is ended with
  its call (it was left open, its session alive, until the client went).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI
from support.raw_ws import stalled_client
from support.realtime_helpers import RunningAgent, module_agent, wait_no_sessions

from agent.client.client import AgentClient

pytestmark = pytest.mark.asyncio(loop_scope="module")


agent = module_agent(max_reply_seconds=2.0, max_reply_tokens=16)


async def _sse(url: str, out: list[dict]) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    out.append(json.loads(line[6:]))


async def test_sdk_calls_create_and_a_spoken_turn(agent: RunningAgent, speech_wav: Path, strict_events) -> None:
    sdk = AsyncOpenAI(base_url=f"{agent.url}/v1", api_key="unused-on-an-open-agent")
    seen: dict = {}

    async def signal(offer: str) -> tuple[str, str]:
        raw = await sdk.realtime.calls.with_raw_response.create(
            sdp=offer, session={"type": "realtime", "model": "qwen3-omni", "instructions": "Be brief."}
        )
        seen.update(status=raw.status_code, content_type=raw.headers["content-type"])
        return raw.text, raw.headers["location"]

    client = AgentClient(agent.url, speech_wav, video=False)
    server_channels: list = []
    client.pc.on("datachannel", server_channels.append)
    sse: list[dict] = []
    sse_task = None
    try:
        await client.connect(signal=signal)
        assert seen["status"] == 201 and seen["content_type"].startswith("application/sdp")
        assert client.result.call_id.startswith("rtc_") and len(client.result.call_id) == 28
        assert client.result.location == f"/v1/realtime/calls/{client.result.call_id}"
        sse_task = asyncio.ensure_future(_sse(f"{agent.url}{client.result.location}/events", sse))
        created = await client.wait_event("session.created", 10)
        assert created["session"]["instructions"] == "Be brief." and created["session"]["model"] == "qwen3-omni"
        done = await client.wait_event("response.done", 90)
        for _ in range(100):
            if client.result.of_type("output_audio_buffer.stopped") and client.result.audible_samples >= 24_000:
                break
            await asyncio.sleep(0.1)
        await sdk.realtime.calls.hangup(client.result.call_id)
        await wait_no_sessions(agent.url, "hangup left the session open")
    finally:
        if sse_task is not None:
            sse_task.cancel()
        await client.close()

    r = client.result
    types = strict_events(r.events)
    assert not r.of_type("error"), r.of_type("error")
    assert not server_channels, "the agent must use the client's oai-events channel"
    assert r.audible_samples >= 24_000, f"only {r.audible_samples} audible samples"
    assert not r.of_type("response.output_audio.delta")
    assert r.of_type("response.output_audio_transcript.delta")
    started = r.of_type("output_audio_buffer.started")[0]
    assert started["response_id"] == done["response"]["id"] and started["omni"]["ttfa_ms"] is not None
    assert r.of_type("output_audio_buffer.stopped")[0]["response_id"] == done["response"]["id"]
    assert (
        types.index("input_audio_buffer.speech_stopped")
        < types.index("response.created")
        < types.index("response.done")
    )
    assert done["response"]["usage"]["output_tokens"] > 0
    sse_types = [e["type"] for e in sse]
    assert "response.done" in sse_types
    assert sse_types == [t for t in types if t in set(sse_types)][-len(sse_types) :]


@pytest.mark.parametrize("path", ["/v1/realtime/calls?model=qwen3-omni", "/v1/realtime?model=qwen3-omni"])
async def test_raw_sdp_url_forms_and_delete(agent: RunningAgent, speech_wav: Path, path: str) -> None:
    client = AgentClient(agent.url, speech_wav, video=False)
    client.pc.addTrack(client.audio)
    client.pc.createDataChannel("oai-events")
    await client.pc.setLocalDescription(await client.pc.createOffer())
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{agent.url}{path}",
                data=client.pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp", "Accept": "application/sdp"},
            ) as resp:
                assert resp.status == 201 and resp.content_type == "application/sdp"
                assert (await resp.text()).startswith("v=0")
                location = resp.headers["Location"]
            assert location.startswith("/v1/realtime/calls/rtc_")
            # A sideband WebSocket on the call: client events in, the call's events out.
            call_id = location.rsplit("/", 1)[-1]
            async with http.ws_connect(f"{agent.url.replace('http', 'ws')}/v1/realtime?call_id={call_id}") as ws:
                await ws.send_str(
                    json.dumps({"type": "conversation.item.retrieve", "item_id": "item_none", "event_id": "evt_side"})
                )
                reply = json.loads((await ws.receive(timeout=10)).data)
                assert reply["type"] == "error" and reply["error"]["event_id"] == "evt_side"
            async with http.delete(f"{agent.url}{location}") as resp:
                assert resp.status == 204
            async with http.delete(f"{agent.url}{location}") as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "call_not_found"
            # A sideband on the ended call: 410 call_ended (as its events route), a never-seen one 404.
            for ended, (status, code) in ((call_id, (410, "call_ended")), ("rtc_never", (404, "call_not_found"))):
                async with http.get(f"{agent.url}/v1/realtime?call_id={ended}") as resp:
                    assert (resp.status, (await resp.json())["error"]["code"]) == (status, code)
    finally:
        await client.close()


async def test_a_sideband_that_does_not_read_ends_with_its_call(agent: RunningAgent, speech_wav: Path) -> None:
    client = AgentClient(agent.url, speech_wav, video=False)
    await client.connect()
    call_id = client.result.call_id

    def forwards() -> int:
        return sum("_sideband" in repr(t.get_coro()) for t in asyncio.all_tasks() if not t.done())

    writer = None
    try:
        before = forwards()
        _, writer = await stalled_client(agent.url, f"call_id={call_id}")
        await asyncio.sleep(1.0)
        assert forwards() > before, "the sideband is not attached: the test would prove nothing"
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{agent.url}/v1/realtime/calls/{call_id}") as resp:
                assert resp.status == 204
        for _ in range(50):  # bounded: 5 s
            if forwards() == before:
                break
            await asyncio.sleep(0.1)
        assert forwards() == before, "the sideband of the ended call is still open"
    finally:
        if writer is not None:
            writer.close()
        await client.close()
