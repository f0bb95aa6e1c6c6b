"""Keys on the /v1/realtime routes of an agent started with an API key.

Pins:
- no key, a wrong key, or a wrong ephemeral key → 401 with a JSON error, on the WebRTC, WebSocket
  and client_secrets routes; /v1/omni/config and /healthz stay open and say a key is needed
  (/v1/omni/config also lists the model's voices);
- the API key works with the official SDK (WebSocket) and on POST /v1/realtime/calls;
- client_secrets (API key only) mints `ek_…` keys with expires_at and the session they carry;
  `expires_after.seconds` outside 10..7200 (or `expires_after` not an object) is refused naming the param;
- a valid ephemeral key connects (SDK over WebSocket, and the browser's subprotocol form, with
  `realtime` echoed) and its session applies; once expired it gets 401;
- a key minted for a transcription session (the page's Captions only on a keyed agent) makes a
  WebRTC call that transcribes and never answers; a WebSocket with it asking another
  `?intent` is refused (400, param intent), not silently given the key's type.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI
from support.realtime_helpers import RunningAgent, module_agent
from websockets.exceptions import InvalidStatus

from agent.client.client import AgentClient
from agent.transport.http import KEYS

pytestmark = pytest.mark.asyncio(loop_scope="module")
API_KEY = "sk-omni-test-key"


agent = module_agent(api_key=API_KEY, max_reply_tokens=4, max_reply_seconds=0.5)


async def _mint(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> tuple[int, dict]:
    async with http.post(
        f"{url}/v1/realtime/client_secrets", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, await resp.json()


async def _first_event(sdk_key: str, url: str) -> dict:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=sdk_key)
    async with client.realtime.connect(model="qwen3-omni") as conn:
        return json.loads(await conn.recv_bytes())


async def test_missing_or_wrong_keys_get_401(agent: RunningAgent, speech_wav: Path) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{agent.url}/v1/omni/config") as resp:
            config = await resp.json()
        # The tiny model's talker speakers, for the page's voice picker (engine thread here; the
        # engine process: tests/integration/test_engine_process.py).
        assert resp.status == 200 and config["auth_required"] is True, config
        assert config["voices"] == ["aiden", "chelsie", "ethan"] and config["default_voice"] == "ethan", config
        for headers in (
            {},
            {"Authorization": "Bearer sk-wrong"},
            {"Authorization": "Bearer ek_00_11"},
            {"Authorization": "Basic " + API_KEY},
        ):
            for method, path in (
                ("POST", "/v1/realtime/calls"),
                ("GET", "/v1/realtime?model=x"),
                ("POST", "/v1/realtime/client_secrets"),
            ):
                async with http.request(method, f"{agent.url}{path}", headers=headers, data=b"v=0") as resp:
                    assert resp.status == 401, (method, path, headers)
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    with pytest.raises(InvalidStatus) as info:
        await _first_event("sk-wrong", agent.url)
    assert info.value.response.status_code == 401
    # The right key: the SDK connects, and a WebRTC offer is answered.
    assert (await _first_event(API_KEY, agent.url))["type"] == "session.created"
    client = AgentClient(agent.url, speech_wav, video=False, api_key=API_KEY)
    try:
        await client.connect()
        assert client.result.call_id.startswith("rtc_")
        assert await client.hangup() == 204
    finally:
        await client.close()


async def test_ephemeral_keys(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        status, body = await _mint(http, agent.url, API_KEY, {"expires_after": {"anchor": "created_at", "seconds": 5}})
        assert status == 400 and body["error"]["param"] == "expires_after.seconds"
        status, body = await _mint(http, agent.url, API_KEY, {"expires_after": [1]})
        assert status == 400 and body["error"]["param"] == "expires_after", body
        status, body = await _mint(
            http,
            agent.url,
            API_KEY,
            {
                "expires_after": {"anchor": "created_at", "seconds": 60},
                "session": {"type": "realtime", "instructions": "Speak like a sailor.", "output_modalities": ["text"]},
            },
        )
        assert status == 200, body
        ek = body["value"]
        assert ek.startswith("ek_") and 55 <= body["expires_at"] - time.time() <= 61
        assert body["session"]["instructions"] == "Speak like a sailor."
        status, _ = await _mint(http, agent.url, ek, {})
        assert status == 401, "an ephemeral key must not mint keys"

    created = await _first_event(ek, agent.url)
    assert created["session"]["instructions"] == "Speak like a sailor."
    assert created["session"]["output_modalities"] == ["text"]
    # A browser's WebSocket passes the key as a subprotocol; the agent echoes `realtime`.
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(
            f"{agent.url}/v1/realtime?model=qwen3-omni", protocols=("realtime", f"openai-insecure-api-key.{ek}")
        ) as ws:
            assert ws.protocol == "realtime"
            assert json.loads((await ws.receive()).data)["type"] == "session.created"

    keys = agent.runner.app[KEYS]
    real_clock = keys.clock
    keys.clock = lambda: real_clock() + 61  # past expires_at
    try:
        with pytest.raises(InvalidStatus) as info:
            await _first_event(ek, agent.url)
        assert info.value.response.status_code == 401
    finally:
        keys.clock = real_clock


async def test_an_ephemeral_key_for_transcription_makes_a_transcription_call(
    agent: RunningAgent, speech_wav: Path
) -> None:
    """What the page's Captions only does on a keyed agent: the key carries the session type
    (a raw offer has no session part), and the call made with it is a transcription session."""
    async with aiohttp.ClientSession() as http:
        status, minted = await _mint(http, agent.url, API_KEY, {"session": {"type": "transcription"}})
        assert status == 200 and minted["session"]["type"] == "transcription", minted
        client = AgentClient(agent.url, speech_wav, video=False, api_key=minted["value"])
        try:
            await client.connect()
            headers = {"Authorization": f"Bearer {minted['value']}"}
            async with http.get(
                f"{agent.url}/v1/realtime/calls/{client.result.call_id}/events", headers=headers
            ) as resp:
                assert resp.status == 200
                seen: list[str] = []
                async with asyncio.timeout(90):  # a turn of the WAV, then its transcript
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            seen.append(json.loads(line[len(b"data: ") :])["type"])
                            if seen[-1] == "conversation.item.input_audio_transcription.completed":
                                break
            # Transcribed, never answered (a conversation would have created its reply by now).
            assert "input_audio_buffer.speech_stopped" in seen and "response.created" not in seen, seen
        finally:
            await client.close()
        # The key's session type is the key's: a WebSocket asking another ?intent is refused.
        headers = {"Authorization": f"Bearer {minted['value']}"}
        async with http.get(f"{agent.url}/v1/realtime?intent=conversation", headers=headers) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "intent"
