"""Bounded rings between media ingest and the turn logic.

Never an unbounded queue: aiortc's own remote-track queue already is one, and a reader
slower than real time turns into delay that grows without limit. ``FrameRing.put`` is
drop-oldest, latest wins. For camera samples: the turn only wants the newest few frames, so a
stale one is worth less than a fresh one and the producer (a track reader that must keep
draining aiortc) never waits.

Microphone chunks do not go through a ring: AudioIn and the Endpointer run inline in the
audio track reader, since losing audio would break the session clock.

All methods are for the asyncio thread only (no locks).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from agent.metrics import INGEST_BUFFER, INGEST_DROPPED

T = TypeVar("T")

MIN_CAPACITY = 5
MAX_CAPACITY = 10


class FrameRing(Generic[T]):
    """A ring of at most ``capacity`` items; a put when full drops the oldest and counts it.

    ``kind`` labels its metrics: agent_ingest_buffer_frames{kind} follows the occupancy and
    agent_ingest_dropped_frames_total{kind,reason="full"} counts the drops. Every session has
    its own rings, so the gauge moves by deltas (it sums the rings of one kind); call
    ``clear()`` when the session ends to take this ring's share back out.
    """

    def __init__(self, capacity: int, kind: str) -> None:
        # A ring this small keeps latency bounded (8 frames of 4 FPS video = 2 s) while
        # riding out a consumer hiccup; outside 5-10 it is a configuration mistake.
        assert MIN_CAPACITY <= capacity <= MAX_CAPACITY, f"capacity {capacity} not in 5..10"
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._kind = kind
        self._buffer_gauge = INGEST_BUFFER.labels(kind=kind)
        self._dropped_counter = INGEST_DROPPED.labels(kind=kind, reason="full")
        self._reported = 0  # this ring's share of the gauge
        self.dropped = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def kind(self) -> str:
        return self._kind

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self._capacity

    def put(self, item: T) -> bool:
        """Append item; when full drop the oldest first and return False."""
        accepted = True
        if self.full():
            self._items.popleft()
            self.dropped += 1
            self._dropped_counter.inc()
            accepted = False
        self._items.append(item)
        self._changed()
        return accepted

    def latest(self, n: int) -> list[T]:
        """The newest n items, oldest first, left in the ring."""
        if n <= 0:
            return []
        return list(self._items)[-n:]

    def pop_oldest(self) -> T:
        """Remove and return the oldest item (IndexError when empty)."""
        item = self._items.popleft()
        self._changed()
        return item

    def drain(self) -> list[T]:
        """Remove and return everything, oldest first."""
        items = list(self._items)
        self._items.clear()
        self._changed()
        return items

    def clear(self) -> None:
        self._items.clear()
        self._changed()

    def _changed(self) -> None:
        occupancy = len(self._items)
        if occupancy != self._reported:
            self._buffer_gauge.inc(occupancy - self._reported)
            self._reported = occupancy
