"""Shared by the integration tests: a running agent on loopback (imported by test modules)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.config import Config
from agent.engine import Engine, build_engine
from agent.server import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningAgent:
    url: str  # http://127.0.0.1:PORT
    config: Config
    engine: Engine
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_agent(tiny_model_dir: Path, **overrides: Any) -> RunningAgent:
    values: dict[str, Any] = dict(host="127.0.0.1", port=free_port(), ice_hosts=("127.0.0.1",),
                                  model=str(tiny_model_dir), threads=1, fallback_model="none")
    values.update(overrides)
    config = Config(**values)
    engine = build_engine(config)
    runner = web.AppRunner(create_app(config, engine))
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):  # model load, bounded: 60 s
            async with http.get(f"{url}/healthz") as resp:
                if resp.status == 200:
                    return RunningAgent(url, config, engine, runner)
            await asyncio.sleep(0.1)
    await runner.cleanup()
    pytest.fail("engine did not become ready")


async def wait_no_sessions(url: str, message: str) -> None:
    """Bounded (5 s): until /healthz reports no session; fail with `message` otherwise."""
    async with aiohttp.ClientSession() as http:
        for _ in range(50):
            async with http.get(f"{url}/healthz") as resp:
                if (await resp.json())["sessions"] == 0:
                    return
            await asyncio.sleep(0.1)
    pytest.fail(message)
