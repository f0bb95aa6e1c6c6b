"""/livez and /readyz: what a supervisor (Kubernetes probes) reads to restart the agent or send it calls.

Pins, against the real agent (tiny model) on loopback:
- while the model loads (held in the engine thread), /livez is 200 `loading` (a slow load is
  no reason to restart) and /readyz 503 `loading`; once loaded both are 200 `ok`;
- a failed model load: /livez and /readyz are both 503 `failed`, naming the error;
- an engine thread that dies after loading: both 503 `failed` on the next request;
- draining (the SIGTERM path, agent/server.py drain): /readyz 503 `draining` while /livez
  stays 200 (a liveness failure would restart the agent in the middle of its drain), and
  /healthz keeps its own answer (503 `draining`);
- both are open routes: with --api-key set they answer without a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from support.realtime_helpers import agent_config, start_agent

from agent.engine.factory import build_engine
from agent.server import create_app, drain
from agent.transport.http import ENGINE_START

_HOLD_S = 60.0  # a held load gives up after this, so a failing test never leaves a thread waiting


class _Fatal(BaseException):
    """Escapes the engine's model-error handling: the loop itself breaks."""


@contextlib.asynccontextmanager
async def _serving(tiny_model_dir: Path, wrap: Any) -> AsyncIterator[tuple[str, web.Application]]:
    """An agent whose engine's runner goes through `wrap` in the engine thread, served on a
    loopback port without waiting for it to load: (url, app)."""
    config = agent_config(tiny_model_dir)
    app = create_app(config, build_engine(config, wrap=wrap))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    try:
        yield f"http://{config.host}:{config.port}", app
    finally:
        await runner.cleanup()


async def _probe(http: aiohttp.ClientSession, url: str, path: str) -> tuple[int, dict]:
    async with http.get(url + path) as resp:
        return resp.status, await resp.json()


async def test_loading_is_alive_but_not_ready_then_both_ok(tiny_model_dir: Path) -> None:
    release, held = threading.Event(), threading.Event()

    def hold(runner: Any) -> Any:
        held.set()
        release.wait(_HOLD_S)
        return runner

    async with _serving(tiny_model_dir, hold) as (url, app), aiohttp.ClientSession() as http:
        try:
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, held.wait, _HOLD_S), "the engine never reached its load"
            assert await _probe(http, url, "/livez") == (200, {"status": "loading"})
            status, body = await _probe(http, url, "/readyz")
            # Where it is: the runner built, held before the engine says ready.
            assert status == 503 and body["status"] == "loading" and body["phase"] == "build", body
            assert list(body["phases"])[0] == "load" and "ready" not in body["phases"], body
        finally:
            release.set()
        await asyncio.wait_for(asyncio.shield(app[ENGINE_START]), _HOLD_S)
        assert await _probe(http, url, "/livez") == (200, {"status": "ok"})
        assert await _probe(http, url, "/readyz") == (200, {"status": "ok"})


async def test_a_failed_load_fails_both(tiny_model_dir: Path) -> None:
    def broken(runner: Any) -> Any:
        raise RuntimeError("injected: weights missing")

    async with _serving(tiny_model_dir, broken) as (url, app), aiohttp.ClientSession() as http:
        with contextlib.suppress(RuntimeError):
            await asyncio.wait_for(asyncio.shield(app[ENGINE_START]), _HOLD_S)
        for path in ("/livez", "/readyz"):
            status, body = await _probe(http, url, path)
            assert status == 503 and body["status"] == "failed" and "weights missing" in body["error"], (path, body)


async def test_a_dead_engine_thread_fails_both(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir)
    engine = running.engine
    try:
        async with aiohttp.ClientSession() as http:
            assert (await _probe(http, running.url, "/livez"))[0] == 200

            def broken(*args: object) -> None:
                raise _Fatal("injected: the engine loop broke")

            engine.core.apply = broken  # type: ignore[method-assign,union-attr]
            engine.discard_turn("nobody")  # any command reaches EngineCore.apply on the engine thread
            await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 10)  # type: ignore[union-attr]
            for path in ("/livez", "/readyz"):
                status, body = await _probe(http, running.url, path)
                assert status == 503 and body["status"] == "failed" and "loop broke" in body["error"], (path, body)
    finally:
        await running.stop()


async def test_draining_is_alive_but_not_ready_and_both_need_no_key(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir, api_key="sk-probe-test")
    try:
        async with aiohttp.ClientSession() as http:
            assert await _probe(http, running.url, "/livez") == (200, {"status": "ok"})  # no Authorization header
            assert await _probe(http, running.url, "/readyz") == (200, {"status": "ok"})
            async with http.post(f"{running.url}/v1/realtime/client_secrets", json={}) as resp:
                assert resp.status == 401  # the key is enforced where it applies
            assert await drain(running.app, 0.0) == 0
            assert await _probe(http, running.url, "/readyz") == (503, {"status": "draining"})
            assert await _probe(http, running.url, "/livez") == (200, {"status": "ok"})
            status, body = await _probe(http, running.url, "/healthz")
            assert status == 503 and body["status"] == "draining"
    finally:
        await running.stop()
