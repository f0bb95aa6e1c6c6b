"""Server events out of one session: ids, serialization, the transport and SSE subscribers."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Optional

from agent.realtime.events import error_event, new_id

_SSE_QUEUE = 256  # per SSE subscriber; a subscriber that falls this far behind is dropped


def _json(event: dict[str, Any]) -> str:
    """The event's JSON text, non-ASCII characters as themselves: a \\uXXXX escape is 6 bytes
    where UTF-8 takes 1 to 4, and a data channel's messages are bounded (64 KiB on some peers).
    A lone surrogate (a client's own "\\ud800", echoed) has no UTF-8: such an event is escaped."""
    text = json.dumps(event, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(event)
    return text


def is_extra(kind: str) -> bool:
    """An event type the GA protocol does not define: the project's `omni.*` events and the
    camera's `input_video.throttle`. Some client libraries raise on a type they do not know
    (Pipecat's parse_server_event), so a transport gets these only when its session asks."""
    return kind.startswith("omni.") or kind == "input_video.throttle"


class Outbox:
    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._sse: list[asyncio.Queue] = []
        # Listeners that see every event as it goes out (the caption timeline,
        # agent/transport/caption_book.py): called in order, synchronously, never dropped.
        self.taps: list[Callable[[dict[str, Any], str], None]] = []
        self.closed = False
        # Whether the transport gets the extra event types (is_extra); SSE and taps always do.
        # The session sets it from session.omni.events (session_config.extra_events).
        self.extras = True

    def emit(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        event.setdefault("event_id", new_id("event"))
        text = _json(event)
        if self.extras or not is_extra(event["type"]):
            self._send(text)
        for q in list(self._sse):
            try:
                q.put_nowait(text)
            except asyncio.QueueFull:
                # A stalled reader loses its stream, not our memory; it is told (the end
                # marker), so that its connection is closed rather than left open and silent.
                self._sse.remove(q)
                _end(q)
        # Taps last: one may emit an event of its own (the turn timing after a response.done),
        # which every reader must get after this one.
        for tap in self.taps:
            tap(event, text)

    def error(
        self,
        message: str,
        code: str,
        *,
        param: Optional[str] = None,
        event_id: Optional[str] = None,
        kind: str = "invalid_request_error",
    ) -> None:
        self.emit(error_event(message, code, param=param, event_id=event_id, kind=kind))

    def close(self) -> None:
        """No more events; SSE readers get their end marker."""
        self.closed = True
        self._send = _drop  # the transport refers to its session: break the cycle
        self.taps = []  # a tap refers to its listener: the same
        for q in self._sse:
            _end(q)

    def subscribed(self, q: asyncio.Queue) -> bool:
        return q in self._sse and not self.closed

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=_SSE_QUEUE)
        self._sse.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        if q in self._sse:
            self._sse.remove(q)


def _drop(text: str) -> None:
    """The send of a closed outbox."""


def _end(q: asyncio.Queue) -> None:
    """The end marker, even to a full queue (its oldest event makes room for it)."""
    while q.full():
        q.get_nowait()
    q.put_nowait(None)
