"""How long one session's heavy client events hold the event loop, which paces every call's
outbound audio (a 20 ms frame late is a click in every call on the server).

Side by side in one run, on one Session (no model: a recording engine, the real Session, its
InputBuffer with server VAD, its message decoding, its tool checks): each heavy event is handled
the way the agent handles it now (a long append pushed in 0.5 s slices, an image message
decoded and a tool list checked on a pool thread) and the way it was handled before (the whole
append at once, the image and the tools on the loop: the same code with one slice and an
executor that runs inline). A ticker on the loop
sleeps 5 ms at a time; its longest overshoot is the loop's longest stall.

    python scripts/bench_loop_stall.py
    python scripts/bench_loop_stall.py --append-s 120 --repeats 5

Prints a table (longest stall, and the event's wall time, median over --repeats) and a last line
with the ratios of the longest stalls (before / now).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from PIL import Image

from agent.config import Config
from agent.gate.ladder import Admission
from agent.realtime import client_events, slow_events
from agent.realtime.session import Session

TICK_S = 0.005


class Inline(Executor):
    """Runs what is submitted at once, on the caller's thread: the loop, as before the pool."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed back as the future's
            future.set_exception(exc)
        return future


class RecordingEngine:
    has_fallback = False

    def send(self, sid: str, command: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def append_audio(self, sid: str, pcm: np.ndarray) -> None:
        pass

    def discard_turn(self, sid: str) -> None:
        pass

    def begin_reply(self, *args: Any, **kwargs: Any) -> None:
        pass

    def speculate(self, *args: Any, **kwargs: Any) -> None:
        pass

    def drop_speculation(self, sid: str) -> None:
        pass

    def cancel_reply(self, sid: str) -> None:
        pass

    def close_session(self, sid: str) -> None:
        pass


def _session(pool: Executor) -> tuple[Session, list[str]]:
    """A session (server VAD with the default detector, silero, as a session has it) and the
    errors it sends: one means the figure measured nothing."""
    config = Config()
    errors: list[str] = []
    session = Session(
        config,
        RecordingEngine(),  # type: ignore[arg-type]
        Admission.from_config(config),
        send=lambda text: errors.append(text) if json.loads(text)["type"] == "error" else None,
        on_closed=lambda _s: None,
        webrtc=False,
        decode_pool=pool,
    )
    return session, errors


async def _measure(event: dict[str, Any], pool: Executor, whole: bool) -> tuple[float, float]:
    """(longest loop stall, wall time) in ms for handling `event` on a fresh session."""
    session, errors = _session(pool)
    slice_s = slow_events.SLICE_S
    slow_events.SLICE_S = 1e9 if whole else slice_s
    stalls: list[float] = []
    running = True

    async def ticker() -> None:
        while running:
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            stalls.append(time.perf_counter() - t - TICK_S)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)  # the ticker is running
    message = json.dumps(event)
    start = time.perf_counter()
    try:
        client_events.handle(session, message)
        await session.inbox.idle()
        wall = time.perf_counter() - start
        await asyncio.sleep(2 * TICK_S)
    finally:
        slow_events.SLICE_S = slice_s
        running = False
        await tick
        await session.close()
    if errors:
        raise SystemExit(f"the event was refused: {errors[0]}")
    return 1000 * max(stalls), 1000 * wall


def _append(seconds: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    t = np.arange(int(24_000 * seconds)) / 24_000
    pcm = np.sin(2 * np.pi * 180 * t) * 6000 * (np.sin(2 * np.pi * 0.3 * t) > 0) + rng.normal(0, 300, len(t))
    audio = base64.b64encode(pcm.astype("<i2").tobytes()).decode()
    return {"type": "input_audio_buffer.append", "audio": audio}


def _tools_update(count: int) -> dict[str, Any]:
    """session.update with `count` tools of 20 parameters each (~2.7 KiB a schema): a client's
    tool set, each schema unseen before (the check is remembered per list)."""
    enum = {"type": "string", "enum": [f"v{k}" for k in range(10)]}
    nested = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "number"}},
            "b": {"type": "string", "pattern": "^[a-z]+$"},
        },
    }
    tools = [
        {
            "type": "function",
            "name": f"tool_{i}_{time.monotonic_ns()}",
            "description": "Looks something up.",
            "parameters": {
                "type": "object",
                "properties": {f"p{j}": enum if j % 2 else nested for j in range(20)},
                "required": [f"p{j}" for j in range(20)],
            },
        }
        for i in range(count)
    ]
    return {"type": "session.update", "session": {"type": "realtime", "tools": tools}}


def _image_message(width: int, height: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    # A gradient with a little noise: a photo's worth of PNG (a few MiB), within the 15 MiB limit.
    image = (np.indices((height, width)).sum(0)[..., None] // 8 % 224 + rng.integers(0, 4, (height, width, 3))).astype(
        np.uint8
    )
    out = io.BytesIO()
    Image.fromarray(image).save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    content = [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]
    return {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--append-s", type=float, default=60.0, help="seconds of 24 kHz audio in the long append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tools", type=int, default=90, help="tools in the session.update (90: ~240 KiB)")
    args = parser.parse_args()
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"append {args.append_s:g} s pcm16", lambda: _append(args.append_s)),
        ("image 3840x2160 PNG", lambda: _image_message(3840, 2160)),
        (f"tools {args.tools} (session.update)", lambda: _tools_update(args.tools)),
    ]
    ratios = []
    print(f"{'event':<24} {'how':<18} {'longest stall ms':>17} {'wall ms':>9}")
    with ThreadPoolExecutor(1, thread_name_prefix="decode") as pool:
        for name, make in cases:
            figures = {}
            for how, executor, whole in (("before (on loop)", Inline(), True), ("now", pool, False)):
                runs = [await _measure(make(), executor, whole) for _ in range(args.repeats)]
                stall, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                figures[how] = stall
                print(f"{name:<24} {how:<18} {stall:>17.1f} {wall:>9.1f}")
            ratios.append((name, figures["before (on loop)"] / max(figures["now"], 0.1)))
    print(" ".join(f"stall_ratio[{name.split()[0]}]={ratio:.1f}" for name, ratio in ratios))


if __name__ == "__main__":
    asyncio.run(main())
