"""Stopping: a dead engine is reported at once, and SIGTERM / Ctrl-C shut the agent down in order.

Pins:
- when the engine thread dies, the next `/healthz` is 503 naming the failure, and new calls
  (WebRTC offers and WebSockets) get 503 `engine_failed` with a JSON reason;
- SIGTERM to a real `omni-agent serve` process: new calls get 503 `shutting_down` at once
  while a session's reply in progress runs to its end (completed, not cancelled), then the
  connection is closed and the process exits 0; SIGINT (Ctrl-C, what `make run` gets) on an
  idle agent exits 0 as well; a reply longer than `--drain-s` is cut at that deadline and the
  process still exits 0; the client of that reply gets its `response.done` (failed,
  `server_shutting_down`), an `error` saying why, and a close with 1001 (going away);
- a WebSocket client that stops reading its socket (its server-side writes back up) cannot hold
  up the shutdown: `stop()` ends within the close bound, and another client mid-reply is
  told and closed as above (once, a stalled client held every close and the exit forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.loopback import free_port, serve_args
from support.raw_ws import stalled_client
from support.realtime_helpers import offer_sdp, start_agent

from agent.client.client import NotReady, wait_ready
from agent.transport import ws as ws_transport

ROOT = Path(__file__).resolve().parents[2]


class _Fatal(BaseException):
    """Escapes the engine's model-error handling: the loop itself breaks."""


async def test_a_dead_engine_fails_health_and_refuses_calls(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir)
    engine = running.engine
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{running.url}/healthz") as resp:
                assert resp.status == 200

            def broken(*args: object) -> None:
                raise _Fatal("injected: the engine loop broke")

            engine.core.apply = broken  # type: ignore[method-assign,union-attr]
            engine.discard_turn("nobody")  # any command reaches EngineCore.apply on the engine thread
            await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 10)  # type: ignore[union-attr]
            # No polling: the first probe after the thread ended already fails.
            async with http.get(f"{running.url}/healthz") as resp:
                body = await resp.json()
                assert resp.status == 503 and body["status"] == "failed" and "loop broke" in body["error"], body
            async with http.post(
                f"{running.url}/v1/realtime/calls",
                data=await offer_sdp(events=False),
                headers={"Content-Type": "application/sdp"},
            ) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_failed"
                assert "Retry-After" in resp.headers
            async with http.get(f"{running.url}/v1/realtime?model=x") as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_failed"
    finally:
        await running.stop()


def _spawn(tiny_model_dir: Path, port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            *serve_args(port, tiny_model_dir),
            "--max-calls-per-minute",
            "0",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@contextlib.asynccontextmanager
async def _agent_process(tiny_model_dir: Path, *flags: str) -> AsyncIterator[tuple[subprocess.Popen, str]]:
    """A ready agent in a child process (its own signal handlers): (process, url); killed on the
    way out if the test left it running."""
    port = free_port()
    proc = _spawn(tiny_model_dir, port, *flags)
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


async def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    try:
        await wait_ready(url, timeout_s=90, proc=proc)  # model load in a fresh process, bounded
    except NotReady as exc:
        proc.kill()
        pytest.fail(f"{exc}: {proc.communicate()[0][-3000:]}")


async def _exit_status(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, proc.wait, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the agent did not exit: {proc.communicate()[0][-3000:]}")
    return proc.returncode, proc.stdout.read() if proc.stdout else ""


async def _start_reply(http: aiohttp.ClientSession, url: str) -> tuple[aiohttp.ClientWebSocketResponse, list]:
    ws = await http.ws_connect(f"{url}/v1/realtime?model=x", protocols=("realtime",))
    events: list[dict] = []
    await ws.send_str(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Tell me a story."}],
                },
            }
        )
    )
    await ws.send_str(json.dumps({"type": "response.create"}))
    async for msg in ws:
        events.append({**json.loads(msg.data), "_t": time.monotonic()})
        if events[-1]["type"] == "response.output_audio.delta":
            return ws, events
    raise AssertionError(f"no reply began: {[e['type'] for e in events]}")


async def _read_until_closed(ws: aiohttp.ClientWebSocketResponse, events: list) -> None:
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.TEXT:
            events.append({**json.loads(msg.data), "_t": time.monotonic()})


async def test_sigterm_refuses_new_calls_lets_the_reply_finish_and_exits_0(tiny_model_dir: Path) -> None:
    # An 8 s reply (made faster than real time, but not at once): SIGTERM lands in its middle.
    flags = ("--max-reply-seconds", "8", "--max-reply-tokens", "80", "--drain-s", "60")
    async with _agent_process(tiny_model_dir, *flags) as (proc, url), aiohttp.ClientSession() as http:
        ws, events = await _start_reply(http, url)
        reader = asyncio.ensure_future(_read_until_closed(ws, events))
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(100):  # until the signal is handled (bounded: 10 s)
            async with http.post(
                f"{url}/v1/realtime/calls",
                data=await offer_sdp(events=False),
                headers={"Content-Type": "application/sdp"},
            ) as resp:
                if resp.status == 503:
                    refused, refused_at = await resp.json(), time.monotonic()
                    break
                if resp.status == 201:
                    async with http.delete(url + resp.headers["Location"]):
                        pass
            await asyncio.sleep(0.1)
        assert refused is not None and refused["error"]["code"] == "shutting_down", refused
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "draining"
        await asyncio.wait_for(reader, 60)  # the agent closes the socket once the reply is done
        status, output = await _exit_status(proc)
    types = [e["type"] for e in events]
    done = [e for e in events if e["type"] == "response.done"]
    assert done, f"the reply in progress was not finished: {types[-10:]}"
    assert done[0]["response"]["status"] in ("completed", "incomplete"), done[0]["response"]["status"]
    assert done[0]["_t"] > refused_at, "the reply had ended before the shutdown began: nothing was drained"
    assert status == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "omni-agent: stopped" in output
    print(
        f"\nSIGTERM: new calls 503 shutting_down, reply {done[0]['response']['status']} "
        f"with {types.count('response.output_audio.delta')} audio deltas, exit status {status}"
    )


async def test_sigint_on_an_idle_agent_exits_0(tiny_model_dir: Path) -> None:
    async with _agent_process(tiny_model_dir) as (proc, _url):
        proc.send_signal(signal.SIGINT)
        status, output = await _exit_status(proc, timeout=30)
    assert status == 0 and "Traceback" not in output and "omni-agent: stopped" in output, output[-3000:]


def _told_it_was_cut(ws: aiohttp.ClientWebSocketResponse, events: list) -> None:
    done = [e for e in events if e["type"] == "response.done"]
    assert done and done[-1]["response"]["status"] == "failed", [e["type"] for e in events][-8:]
    assert done[-1]["response"]["status_details"]["error"]["code"] == "server_shutting_down"
    assert [e for e in events if e["type"] == "error" and e["error"]["code"] == "server_shutting_down"]
    assert ws.close_code == 1001


async def test_a_reply_longer_than_the_drain_deadline_is_cut(tiny_model_dir: Path) -> None:
    flags = ("--max-reply-seconds", "30", "--max-reply-tokens", "400", "--drain-s", "1")
    async with _agent_process(tiny_model_dir, *flags) as (proc, url), aiohttp.ClientSession() as http:
        ws, events = await _start_reply(http, url)
        reader = asyncio.ensure_future(_read_until_closed(ws, events))
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(reader, 60)
        status, output = await _exit_status(proc)
    assert status == 0 and "Traceback" not in output, output[-3000:]
    assert "cut off at the 1 s deadline" in output, output[-3000:]
    _told_it_was_cut(ws, events)
    print(f"\ndrain deadline: a 30 s reply cut, exit 0 after {time.monotonic() - signalled:.1f} s")


async def test_a_client_that_stops_reading_cannot_hold_up_the_shutdown(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir, max_reply_seconds=30.0, max_reply_tokens=400)
    stopped = False
    _, stalled = await stalled_client(running.url, "model=x")
    try:
        async with aiohttp.ClientSession() as http:
            ws, events = await _start_reply(http, running.url)
            reader = asyncio.ensure_future(_read_until_closed(ws, events))
            await asyncio.sleep(1.0)  # its answers back up in the agent
            started = time.monotonic()
            await asyncio.wait_for(running.stop(), 30)
            stopped = True
            took = time.monotonic() - started
            await asyncio.wait_for(reader, 10)
        assert took < 3 * ws_transport.CLOSE_TIMEOUT_S + 5, took
        _told_it_was_cut(ws, events)
        print(f"\nshutdown with a client that does not read: {took:.1f} s")
    finally:
        stalled.close()
        if not stopped:
            await running.stop()
