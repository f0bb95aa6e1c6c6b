"""The readiness wait every test and benchmark uses before talking to an agent (agent.client.client.wait_ready).

Pins: it returns once /healthz answers 200; it never falls through against an agent that is not
there: no answer by the deadline, an engine that reports "failed" (at once, not at the deadline),
and a child process that exited each raise NotReady saying which.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from aiohttp import web
from support.loopback import free_port

from agent.client.client import NotReady, wait_ready


async def _serve(status: int, body: dict) -> tuple[web.AppRunner, str]:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_ready_returns_and_failed_raises_at_once() -> None:
    ok, ok_url = await _serve(200, {"status": "ok"})
    failed, failed_url = await _serve(503, {"status": "failed"})
    try:
        await wait_ready(ok_url, timeout_s=5)
        started = time.monotonic()
        with pytest.raises(NotReady, match="failed"):
            await wait_ready(failed_url, timeout_s=60)
        assert time.monotonic() - started < 30, "a failed engine must not wait out the deadline"
    finally:
        await ok.cleanup()
        await failed.cleanup()


async def test_no_agent_and_an_exited_process_raise() -> None:
    with pytest.raises(NotReady, match="not ready"):
        await wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    with pytest.raises(NotReady, match="exited with status 3"):
        await wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=60, proc=proc)
