"""Back-pressure in Chromium: the page obeys the agent's `input_video.throttle`.

Pins, with headless Chromium (fake camera at 15 fps, capped by the page at 4 fps) in a call
with an in-process agent (tiny model) whose engine thread the test can stall: before the stall
the camera's outbound-rtp framesSent grows at the page's cap and nothing is throttled; with the
engine stalled, the page receives the throttle event on the data channel, shows it next to the
state, and its outbound video frame rate (getStats) drops (1 fps at half size, then paused:
RTCRtpSender.setParameters with maxFramerate, scaleResolutionDownBy and active); released, the
agent sends `recovered`, the indicator goes away and the frame rate recovers.
The agent runs in a thread of the test process (its own event loop) so the test can hold its
engine; the browser and the loopback-only rule come from tests/e2e/conftest.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web
from support.engine_hold import HeldEngine, Hold
from support.loopback import free_port

from agent.config import Config
from agent.server import create_app
from agent.transport.http import SESSIONS

pytestmark = pytest.mark.browser

STATS_JS = """async () => {
  let sent = null;
  (await window.omni.pc.getStats()).forEach((r) => {
    if (r.type === "outbound-rtp" && r.kind === "video") sent = (sent ?? 0) + (r.framesSent ?? 0);
  });
  return { sent, now: performance.now() };
}"""


class ThreadedAgent:
    """The agent on its own event loop in a thread, with a stallable engine."""

    def __init__(self, tiny_model_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.config = Config(
            port=self.port,
            ice_hosts=("127.0.0.1",),
            model=str(tiny_model_dir),
            fallback_model="none",
            threads=1,
            max_reply_seconds=1.0,
            video_throttle_hold_s=1.0,
            video_pause_after_s=2.0,
            engine_inbox=1024,
        )
        self.held = HeldEngine()
        self.engine = self.held(self.config)
        self.app = create_app(self.config, self.engine)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._site: web.AppRunner | None = None

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self._site = web.AppRunner(self.app)
        await self._site.setup()
        await web.TCPSite(self._site, "127.0.0.1", self.port).start()
        for _ in range(1200):
            if self.engine.ready:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("the engine did not load")

    def hold(self) -> None:
        async def call() -> None:
            session = next(iter(self.app[SESSIONS].values())).session
            self.engine.send(session.id, Hold())

        self.run(call(), 10)

    def release(self) -> None:
        self.held.release()

    def stop(self) -> None:
        self.release()
        if self._site is not None:
            self.run(self._site.cleanup(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def held_agent(tiny_model_dir):
    agent = ThreadedAgent(tiny_model_dir)
    agent.start()
    yield agent
    agent.stop()


def video_fps(page, seconds: float) -> float:
    """The camera sender's frames per second over the next `seconds`, from getStats."""
    a = page.evaluate(STATS_JS)
    time.sleep(seconds)
    b = page.evaluate(STATS_JS)
    assert a["sent"] is not None and b["sent"] is not None, "no outbound video stream"
    return (b["sent"] - a["sent"]) / ((b["now"] - a["now"]) / 1000)


def test_page_throttles_its_camera_when_the_agent_falls_behind(page, held_agent):
    page.goto(held_agent.url)
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'connected'", timeout=60_000)
    time.sleep(1.0)  # the encoder's first frames come in a burst
    base = video_fps(page, 3.0)
    assert base >= 2.0, f"the camera should send about 4 fps, sends {base:.1f}"
    assert page.evaluate("window.omni.throttle") is None

    held_agent.hold()
    page.wait_for_function("window.omni.throttle !== null", timeout=30_000)
    first = page.evaluate("window.omni.throttle")
    assert first["max_fps"] == 1 and first["scale_resolution_down_by"] == 2 and first["paused"] is False
    indicator = page.locator("#camera-throttle")
    assert indicator.is_visible() and "agent busy" in indicator.inner_text()
    params = page.evaluate("window.omni.camera.sender.getParameters().encodings[0]")
    assert params["maxFramerate"] == 1 and params["scaleResolutionDownBy"] == 2
    page.wait_for_function("window.omni.throttle.paused === true", timeout=30_000)
    assert "paused" in indicator.inner_text()
    time.sleep(0.5)
    throttled = video_fps(page, 3.0)
    assert throttled <= 0.5 * base, f"throttled {throttled:.1f} fps vs {base:.1f} before"

    held_agent.release()
    page.wait_for_function("window.omni.throttle.reason === 'recovered'", timeout=30_000)
    assert not indicator.is_visible()
    assert page.evaluate("window.omni.camera.sender.getParameters().encodings[0].active") is True
    time.sleep(1.0)
    recovered = video_fps(page, 3.0)
    assert recovered >= 0.5 * base and recovered > throttled, (base, throttled, recovered)
    types = page.evaluate("window.omni.events.filter((e) => e.type === 'input_video.throttle').map((e) => e.reason)")
    assert types == ["ingest_backlog", "ingest_backlog", "recovered"]
