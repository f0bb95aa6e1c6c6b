"""Shared by the integration tests: a running agent on loopback, what its /metrics and /healthz
say, and SDP offers to send it (imported by test modules)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack, VideoStreamTrack

from agent.client.client import NotReady, wait_ready
from agent.config import Config
from agent.engine.factory import build_engine
from agent.engine.loop import Engine
from agent.server import create_app
from support.loopback import LADDER_NEVER_MS, free_port


@dataclass
class RunningAgent:
    url: str  # http://127.0.0.1:PORT
    config: Config
    engine: Engine
    runner: web.AppRunner
    app: web.Application

    async def stop(self) -> None:
        await self.runner.cleanup()


def agent_config(tiny_model_dir: Path, **overrides: Any) -> Config:
    """The tests' agent: loopback, the tiny model, one torch thread, no fallback model, the
    degradation ladder out of reach (tests of it set their thresholds), the engine a thread of the test's process (tests reach into it, and a child process costs a
    second start-up per module); tests/integration/test_engine_process.py, the e2e and the
    command-line tests run the default, a child process."""
    values: dict[str, Any] = dict(
        host="127.0.0.1",
        port=free_port(),
        ice_hosts=("127.0.0.1",),
        model=str(tiny_model_dir),
        threads=1,
        fallback_model="none",
        max_calls_per_minute=0,  # the suite opens calls faster than people do
        engine_process=False,
        # Out of the ladder's reach, whatever runs beside the suite (support/loopback.py says why).
        text_only_p95_ms=LADDER_NEVER_MS,
        fallback_p95_ms=LADDER_NEVER_MS,
        speculation_p95_ms=LADDER_NEVER_MS,
    )
    values.update(overrides)
    return Config(**values)


async def start_agent(
    tiny_model_dir: Path, engine: Optional[Callable[[Config], Engine]] = None, **overrides: Any
) -> RunningAgent:
    """Serve an agent on a free loopback port and wait (bounded: 60 s) until its engine is ready;
    fail the test with the reason otherwise. `engine` builds a custom engine from the config
    (e.g. a runner wrapped to be slow); default: the real one."""
    config = agent_config(tiny_model_dir, **overrides)
    engine_ = (engine or build_engine)(config)
    app = create_app(config, engine_)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    try:
        await wait_ready(url, timeout_s=60)  # model load, bounded
    except NotReady as exc:
        await runner.cleanup()
        pytest.fail(str(exc))
    return RunningAgent(url, config, engine_, runner, app)


def module_agent(**overrides: Any) -> Any:
    """A module-scoped fixture named `agent`: start_agent(tiny_model_dir, **overrides) once for
    the module, stopped after its last test. In a test module: `agent = module_agent(...)`."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module", name="agent")
    async def agent(tiny_model_dir: Path):
        running = await start_agent(tiny_model_dir, **overrides)
        yield running
        await running.stop()

    return agent


def talker_never_ends(runner: Any) -> Any:
    """The random tiny talker may end a reply after a second (its codec end token), leaving
    nothing to talk over: make it speak to its cap (max_reply_seconds). Returns the runner."""
    eos = runner.talker.codec_eos

    def never_ends(module: Any, args: Any, logits: Any) -> Any:
        logits = logits.clone()
        logits[..., eos] = float("-inf")
        return logits

    runner.loaded.model.talker.codec_head.register_forward_hook(never_ends)
    return runner


def long_replies_engine(config: Config) -> Engine:
    """build_engine, with replies that always run to max_reply_seconds (talker_never_ends)."""
    return build_engine(config, wrap=talker_never_ends)


async def wait_no_sessions(url: str, message: str) -> None:
    """Bounded (5 s): until /healthz reports no session; fail with `message` otherwise."""
    async with aiohttp.ClientSession() as http:
        for _ in range(50):
            async with http.get(f"{url}/healthz") as resp:
                if (await resp.json())["sessions"] == 0:
                    return
            await asyncio.sleep(0.1)
    pytest.fail(message)


async def metric(http: aiohttp.ClientSession, url: str, line_prefix: str) -> float:
    """The sum of the /metrics samples whose line starts with line_prefix."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix))


async def refused_upgrade(http: aiohttp.ClientSession, ws_url: str) -> dict:
    """GET a WebSocket URL the agent must refuse before the upgrade: 503 with Retry-After.
    Returns the JSON error object."""
    async with http.get(ws_url) as resp:
        assert resp.status == 503 and resp.headers.get("Retry-After"), resp.status
        return (await resp.json())["error"]


async def offer_sdp(audio: bool = True, video: bool = False, events: bool = True) -> str:
    """An SDP offer from a throwaway peer (closed before it returns): the `oai-events` data
    channel unless `events` is False, a sending audio track, a video track if asked."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    if events:
        pc.createDataChannel("oai-events")
    if audio:
        pc.addTrack(AudioStreamTrack())
    if video:
        pc.addTrack(VideoStreamTrack())
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp
