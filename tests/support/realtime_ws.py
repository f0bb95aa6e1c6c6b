"""The `openai` SDK's realtime WebSocket, as the tests drive it: 24 kHz pcm16 from a WAV, appends
paced like a microphone, and every server event of a connection kept and validated as it comes."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np

from support.speech import read_wav, resample


def pcm24(path: Path) -> np.ndarray:
    """The 16 kHz fixture as 24 kHz int16 (linear interpolation)."""
    pcm, rate = read_wav(path)
    return resample(pcm, rate, 24_000).astype(np.int16)


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def png_url(image: np.ndarray) -> str:
    """An RGB uint8 image as a PNG data URL (an input_image part's image_url)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def picture(seed: int = 0, height: int = 96, width: int = 128) -> str:
    """A seeded noise picture as a PNG data URL."""
    return png_url(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


class Events:
    """Every raw server event of one connection, each validated strictly as it arrives."""

    def __init__(self, conn: Any, strict: Callable[[dict], None]) -> None:
        self.conn, self.strict = conn, strict
        self.all: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            event = json.loads(await self.conn.recv_bytes())
            self.strict(event)
            event["_t"] = time.monotonic()
            self.all.append(event)
            self._new.set()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.all if e["type"] == kind]

    async def wait(
        self, kind: str, timeout: float = 60, after: int = 0, where: Optional[Callable[[dict], bool]] = None
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.all[after:]:
                if event["type"] == kind and (where is None or where(event)):
                    return event
            if self._task.done():
                self._task.result()  # a schema failure surfaces here
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind} in {[e['type'] for e in self.all[after:]]}")
            self._new.clear()
            try:
                await asyncio.wait_for(self._new.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass

    def close(self) -> None:
        self._task.cancel()
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()


async def stream_realtime(conn: Any, pcm: np.ndarray, tail_silence_s: float) -> None:
    """20 ms appends paced to the wall clock, like a microphone, then silence."""
    chunk = 480
    audio = np.concatenate([pcm, np.zeros(int(tail_silence_s * 24_000), np.int16)])
    start = time.monotonic()
    for i, at in enumerate(range(0, len(audio), chunk)):
        await conn.input_audio_buffer.append(audio=b64(audio[at : at + chunk]))
        wait = start + (i + 1) * 0.02 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)


@asynccontextmanager
async def sdk_session(url: str, strict: Callable[[dict], None]) -> AsyncIterator[tuple[Any, Events]]:
    """A Realtime session through the official `openai` SDK's WebSocket (`AsyncOpenAI(base_url=…/v1)
    .realtime.connect()`), its server events kept and validated in `Events`; closed on exit."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused-on-an-open-agent")
    manager = client.realtime.connect(model="qwen3-omni")
    conn = await manager.__aenter__()
    events = Events(conn, strict)
    try:
        yield conn, events
    finally:
        events.close()
        await manager.__aexit__(None, None, None)


async def ask_text(conn: Any, text: str, **response: Any) -> None:
    """A user text message, then response.create (with `response` parameters, if any)."""
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await conn.response.create(response=response or None)
