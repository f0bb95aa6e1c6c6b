"""The whole path over real aiortc peers on loopback, with the real tiny Qwen3-Omni.

Pins: a client that speaks (espeak-ng WAV, then silence) with a camera gets the OpenAI
Realtime-style events in order (speech_started → speech_stopped → text deltas →
response.done), and hears AUDIBLE agent audio after its speech ended; the agent's own
TTFT/TTFA land in /metrics; bad offers get 4xx JSON reasons; a second session works
while the first is connected.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.client import AgentClient
from agent.config import Config
from agent.engine import build_engine
from agent.server import create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def agent_url(tiny_model_dir: Path, request):
    runner_name = getattr(request, "param", "stream")
    config = Config(host="127.0.0.1", port=_free_port(), ice_hosts=("127.0.0.1",),
                    model=str(tiny_model_dir), runner=runner_name, max_sessions=2, threads=1,
                    fallback_model="none")
    engine = build_engine(config)
    app = create_app(config, engine)
    app_runner = web.AppRunner(app)
    await app_runner.setup()
    await web.TCPSite(app_runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):  # model load, bounded: 60 s
            async with http.get(f"{url}/healthz") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("engine did not become ready")
    yield url
    await app_runner.cleanup()


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_spoken_turn_gets_text_and_audible_audio(agent_url: str, speech_wav: Path) -> None:
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
    types = [e["type"] for e in r.events]
    assert types[0] == "session.created"
    deltas = r.of_type("response.text.delta")
    assert deltas, f"no text deltas in {types}"
    assert all(e["_t"] >= stopped["_t"] for e in deltas), "text came before the turn ended"
    assert done["status"] in ("completed", "incomplete")
    assert done["text"] == "".join(e["delta"] for e in deltas)
    assert done["ttfa_ms"] is not None and done["ttft_ms"] is not None
    # The end of speech the endpointer saw lies inside the sent WAV's speech (±0.3 s).
    assert abs(stopped["audio_end_ms"] / 1000 - client.speech_end / 48_000) < 0.3
    # Audible: at least 0.5 s of received audio above -50 dBFS, after the speech ended.
    assert r.audible_samples >= 24_000, f"only {r.audible_samples} audible samples"
    v2v = client.voice_to_voice()
    assert v2v is not None and v2v > 0, "agent audio arrived before the user stopped speaking"
    print(f"\nvoice_to_voice_ms={v2v * 1000:.0f} server_ttfa_ms={done['ttfa_ms']} ttft_ms={done['ttft_ms']}")
    assert await _metric(agent_url, "agent_time_to_first_audio_seconds_count") == ttfa_count_before + 1


@pytest.mark.parametrize(
    "body,status",
    [
        (b"not json", 400),
        (b'{"sdp": 5, "type": "offer"}', 400),
        (b'{"sdp": "v=0", "type": "answer"}', 400),
        (b'{"sdp": "garbage", "type": "offer"}', 400),
        (b"[]", 400),
    ],
)
async def test_bad_offers_get_4xx_with_reason(agent_url: str, body: bytes, status: int) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{agent_url}/offer", data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            payload = await resp.json()
            assert isinstance(payload.get("error"), str) and payload["error"]
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
            assert c.result.of_type("response.text.delta")
    finally:
        for c in clients:
            await c.close()


async def test_barge_in_silences_the_agent_at_once(agent_url: str, speech_wav: Path) -> None:
    """Speaking over the agent's reply stops its audio within a few frames."""
    client = AgentClient(agent_url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("response.audio.started", timeout=60)
        # Wait until the reply is audible at the client, then talk over it.
        for _ in range(100):
            if client.result.audible_samples > 4800:
                break
            await asyncio.sleep(0.05)
        client.audio.play()
        for _ in range(150):
            starts = client.result.of_type("input_audio_buffer.speech_started")
            if len(starts) >= 2:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the second utterance was not detected")
        barge_at = starts[1]["_t"]
        await asyncio.sleep(1.0)
        first_done = client.result.of_type("response.done")
    finally:
        await client.close()
    r = client.result
    assert first_done, "the interrupted reply was never closed"
    cancelled = first_done[0]["status"] == "cancelled" or r.of_type("response.audio.cancelled")
    assert cancelled, f"no cancellation reported: {first_done[0]}"
    # Audio still heard 150 ms after the server saw the barge-in: at most what was in
    # flight (aiortc/jitter buffers), never the rest of a 4 s reply.
    late = sum(n for t, n in r.audible_log if barge_at + 0.15 < t < barge_at + 1.0)
    assert late <= 2400, f"{late / 48000:.2f} s of agent audio after barge-in"  # 48 kHz at the client


async def test_data_channel_errors_and_text_only_mode(agent_url: str, speech_wav: Path) -> None:
    """Bad client events get `error` events (the session survives); a session switched to
    text-only gets captions and no audio."""
    client = AgentClient(agent_url, speech_wav, video=False)
    try:
        await client.connect()
        await client.wait_event("session.created", timeout=10)
        for _ in range(50):
            if client.channel.readyState == "open":
                break
            await asyncio.sleep(0.1)
        for bad in ("garbage", "[1, 2]", '{"type": 7}', '{"type": "no.such.event"}',
                    '{"type": "session.update", "session": [1]}',
                    '{"type": "session.update", "session": {"modalities": ["smell"]}}'):
            client.channel.send(bad)
        client.channel.send('{"type": "session.update", "session": {"modalities": ["text"]}}')
        await client.wait_event("session.updated", timeout=10)
        done = await client.wait_event("response.done", timeout=60)
        await asyncio.sleep(0.5)
    finally:
        await client.close()
    r = client.result
    assert len(r.of_type("error")) == 6
    assert {e["error"]["code"] for e in r.of_type("error")} == {"invalid_event", "unknown_event"}
    assert r.of_type("response.created")[0]["mode"] == "text"
    assert done["text"] and r.of_type("response.text.delta")
    assert not r.of_type("response.audio.started") and r.audible_samples == 0


async def test_offer_that_never_connects_frees_its_slot(tiny_model_dir: Path, speech_wav: Path) -> None:
    """An answered offer whose peer never completes ICE is closed after connect_timeout_s,
    so dead offers cannot fill the session limit."""
    config = Config(host="127.0.0.1", port=_free_port(), ice_hosts=("127.0.0.1",), model=str(tiny_model_dir),
                    max_sessions=1, threads=1, fallback_model="none", connect_timeout_s=1.0)
    engine = build_engine(config)
    app_runner = web.AppRunner(create_app(config, engine))
    await app_runner.setup()
    await web.TCPSite(app_runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    ghost = AgentClient(url, speech_wav, video=False)
    try:
        for _ in range(300):
            if engine.ready:
                break
            await asyncio.sleep(0.1)
        # Post the offer but never apply the answer: the agent's ICE checks get no reply.
        ghost.pc.addTrack(ghost.audio)
        await ghost.pc.setLocalDescription(await ghost.pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/offer", json={"sdp": ghost.pc.localDescription.sdp, "type": "offer"}) as resp:
                assert resp.status == 200
            async with http.post(f"{url}/offer", json={"sdp": ghost.pc.localDescription.sdp, "type": "offer"}) as resp:
                assert resp.status == 503  # the ghost holds the only slot ...
            for _ in range(50):
                async with http.get(f"{url}/healthz") as resp:
                    if (await resp.json())["sessions"] == 0:
                        break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the never-connected session kept its slot")
        real = AgentClient(url, speech_wav, video=False)  # ... until it times out
        await real.connect()
        await real.wait_event("session.created", timeout=10)
        await real.close()
    finally:
        await ghost.close()
        await app_runner.cleanup()
