"""A session's client events, handled one at a time in the order they came.

Most events are handled at once, in the transport's callback on the loop. A few carry work that
would hold the loop for tens or hundreds of milliseconds, and the loop paces every session's
outbound audio: a long `input_audio_buffer.append` (its voice detection runs ~4 ms a second of
audio, so a 15 MiB append of μ-law, 31 minutes, is seconds of it) and a message's images or
audio to decode. Their handler gives back a coroutine (`Later`) that does the work in slices,
yielding the loop between them, or on the decode pool (`run`), and the session's later events
wait behind it in order: a client that adds an image and then sends response.create gets a
reply that saw the image.

Waiting is bounded. A WebSocket reader awaits `idle()` before reading on, so its client is
slowed by TCP itself; the WebRTC data channel cannot be slowed, so past MAX_WAITING events or
MAX_WAITING_BYTES an event is refused (`put` says so; the caller sends `rate_limited`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import Executor
from typing import Any, Callable, Coroutine, Optional, TypeVar

from agent.gate.token_bucket import TokenBucket
from agent.realtime.message_content import PIXELS_BURST, PIXELS_PER_S

log = logging.getLogger(__name__)

T = TypeVar("T")
# The rest of an event's handling, made only when its turn comes (so a session closed before
# then leaves no coroutine behind, unawaited).
Later = Callable[[], Coroutine[Any, Any, None]]
Step = Callable[[], Optional[Later]]  # handles one event: None when done, or the rest to await

MAX_WAITING = 256  # events behind a slow one (the data channel sends at most 256 KiB each)
MAX_WAITING_BYTES = 16 * 1024 * 1024


class Inbox:
    def __init__(self, pool: Optional[Executor] = None) -> None:
        """pool: where decoding runs (the server's decode pool; None: the loop's default)."""
        self._pool = pool
        self._waiting: deque[tuple[Step, int]] = deque()
        self._waiting_bytes = 0
        self._task: Optional[asyncio.Task] = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        # The pixels this session may have decoded (message_content.PIXELS_PER_S), charged only
        # by its image decoding: one event at a time here, on a pool thread, never two at once.
        self.pixels = TokenBucket(PIXELS_PER_S, PIXELS_BURST)

    @property
    def busy(self) -> bool:
        """An event's work is under way (later events wait)."""
        return self._task is not None

    def put(self, step: Step, size: int) -> bool:
        """Handle an event now, or after those before it; False when too many wait (refused)."""
        if self._closed:
            return True  # a closed session drops what still comes, as it always has
        if self._task is None and not self._waiting:
            later = _run_step(step)
            if later is not None:
                self._start(later)
            return True
        if len(self._waiting) >= MAX_WAITING or self._waiting_bytes + size > MAX_WAITING_BYTES:
            return False
        self._waiting.append((step, size))
        self._waiting_bytes += size
        return True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the decode pool (it must touch nothing the loop owns). A job whose
        session closes meanwhile runs to its end on the pool; its result is dropped."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def idle(self) -> None:
        """Until no event's work is under way (a WebSocket reader's back-pressure)."""
        await self._idle.wait()

    def close(self) -> None:
        """Drop the waiting events and stop the one under way (its session is gone)."""
        self._closed = True
        self._waiting.clear()
        self._waiting_bytes = 0
        if self._task is not None:
            self._task.cancel()  # its own cleanup may never run (cancelled before it started)
            self._task = None
            self._idle.set()

    def _start(self, later: Later) -> None:
        self._idle.clear()
        self._task = asyncio.ensure_future(self._work(later))

    def _next(self) -> Optional[Later]:
        """The waiting events handled in order until one has work left (None: none has)."""
        while self._waiting:
            step, size = self._waiting.popleft()
            self._waiting_bytes -= size
            later = _run_step(step)
            if later is not None:
                return later
        return None

    async def _work(self, later: Optional[Later]) -> None:
        try:
            while later is not None:
                try:
                    await later()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if self._closed or (task is not None and task.cancelling()):
                        raise  # this work was stopped (close, or the loop's end)
                    # A future it awaited was cancelled (the pool shut down): the event is lost,
                    # the ones behind it still go, in order.
                    log.warning("a client event's work was cancelled")
                except Exception:  # the handlers report their own errors: this is a bug
                    log.exception("a client event's work failed")
                later = self._next()
        finally:
            if self._task is asyncio.current_task():
                self._task = None
                self._idle.set()


def _run_step(step: Step) -> Optional[Later]:
    try:
        return step()
    except Exception:  # the handlers report their own errors: this is a bug, and the next event goes on
        log.exception("a client event's handling failed")
        return None
