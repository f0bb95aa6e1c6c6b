"""Every call's caption timeline, kept a while after the call, and the overlays that follow
"the latest call".

A call's timeline (agent/transport/captions_log.py) is fed by a tap on the call's outbox
from its answer on. After the call ends it is kept for `keep_s` (an hour by default, time to
fetch the WebVTT after a stream), and at most `keep_calls` finished calls are kept (the
oldest go first): with each call's text bounded too, the book's memory is bounded whatever
the traffic. An id that was kept and then dropped is remembered (bounded, ids only), so a
request for it is told "gone" (410) rather than "never existed" (404).

A follower is one `GET /v1/omni/calls/latest/events` stream: the book pushes into its one
bounded queue the events of the newest live call in its scope, with `omni.call.started` when
it moves to a call (a newer one started, or the one it followed ended and an older one is
still running), `omni.call.ended` and `omni.call.waiting` when no call is left. A follower that
falls `_FOLLOWER_QUEUE` events behind is dropped (its stream ends; the overlay reconnects):
a stalled reader costs one queue, never more.

Scope: with no API key every call is in every follower's scope. With one, an overlay opened
with the API key follows every call (each was made with that key or an ephemeral key minted
from it: the agent has one API key); one opened with an ephemeral key follows the calls made
with that same ephemeral key only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from agent.gate.api_keys import EPHEMERAL_PREFIX, Grant
from agent.transport.captions_log import CallCaptions

KEEP_S = 3600.0  # a finished call's captions: long enough to fetch them after the stream
KEEP_CALLS = 32  # finished calls kept at once (each at most captions_log.MAX_CHARS of text)
_FORGOTTEN_IDS = 4096  # ids dropped from the book, remembered to answer 410 instead of 404
_FOLLOWER_QUEUE = 512  # events a follower may be behind before it is dropped


def scope_of(grant: Grant, token: Optional[str]) -> Optional[str]:
    """The scope of a request's key: `ek:<public half>` for an ephemeral key, None (every
    call) for the API key or an open agent."""
    if grant.ephemeral and token and token.startswith(EPHEMERAL_PREFIX):
        return "ek:" + token[len(EPHEMERAL_PREFIX) :].partition("_")[0]
    return None


def _sees(follower_scope: Optional[str], call_scope: Optional[str]) -> bool:
    return follower_scope is None or follower_scope == call_scope


@dataclass(eq=False)
class Follower:
    scope: Optional[str]
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=_FOLLOWER_QUEUE))
    call_id: Optional[str] = None  # the call it follows now
    dropped: bool = False  # fell too far behind: its stream ends

    def push(self, text: str) -> bool:
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:
            self.dropped = True
            return False
        return True


def _marker(kind: str, call_id: Optional[str] = None) -> str:
    event: dict[str, Any] = {"type": kind}
    if call_id is not None:
        event["call_id"] = call_id
    return json.dumps(event)


class CaptionBook:
    def __init__(
        self, keep_s: float = KEEP_S, keep_calls: int = KEEP_CALLS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keep_s = keep_s
        self.keep_calls = keep_calls
        self.clock = clock  # public: tests move time forward
        self._calls: "OrderedDict[str, CallCaptions]" = OrderedDict()  # in start order
        self._forgotten: "OrderedDict[str, None]" = OrderedDict()
        self._followers: set[Follower] = set()

    # ---- calls ------------------------------------------------------------------------------
    def start(self, call_id: str, scope: Optional[str]) -> CallCaptions:
        """A call was answered: its timeline starts now, and the followers in its scope move to it."""
        self._prune()
        log = self._calls[call_id] = CallCaptions(call_id, self.clock(), scope)
        for follower in list(self._followers):
            if _sees(follower.scope, scope):
                self._move(follower, call_id)
        return log

    def event(self, call_id: str, event: dict[str, Any], text: str) -> None:
        """One server event of a call (the outbox tap): into its timeline and to its followers."""
        log = self._calls.get(call_id)
        if log is None or log.ended is not None:
            return
        log.record(event, self.clock())
        for follower in list(self._followers):
            if follower.call_id == call_id and not follower.push(text):
                self._followers.discard(follower)

    def end(self, call_id: str) -> None:
        """The call ended: its open cues close, and its followers move on or wait."""
        log = self._calls.get(call_id)
        if log is None or log.ended is not None:
            return
        log.end(self.clock())
        for follower in list(self._followers):
            if follower.call_id == call_id:
                if follower.push(_marker("omni.call.ended", call_id)):
                    self._settle(follower)
                else:
                    self._followers.discard(follower)
        self._prune()

    def get(self, call_id: str) -> Optional[CallCaptions]:
        self._prune()
        return self._calls.get(call_id)

    def forgot(self, call_id: str) -> bool:
        """Whether the book once kept this call and has let it go."""
        return call_id in self._forgotten

    def ended(self, call_id: str) -> bool:
        """Whether this call is known to have ended (kept or forgotten since)."""
        log = self.get(call_id)
        return (log is not None and log.ended is not None) or self.forgot(call_id)

    def latest(self, scope: Optional[str]) -> Optional[str]:
        """The newest live call in a scope."""
        for call_id in reversed(self._calls):
            log = self._calls[call_id]
            if log.ended is None and _sees(scope, log.scope):
                return call_id
        return None

    def _prune(self) -> None:
        now = self.clock()
        finished = [c for c, log in self._calls.items() if log.ended is not None]
        too_many = len(finished) - self.keep_calls
        for call_id in finished:
            log = self._calls[call_id]
            if too_many > 0 or now - (log.ended or now) > self.keep_s:
                del self._calls[call_id]
                too_many -= 1
                self._forgotten[call_id] = None
                while len(self._forgotten) > _FORGOTTEN_IDS:
                    self._forgotten.popitem(last=False)

    # ---- followers --------------------------------------------------------------------------
    def follow(self, scope: Optional[str]) -> Follower:
        """A new follower, told at once which call it follows (or that it waits)."""
        follower = Follower(scope)
        self._followers.add(follower)
        self._settle(follower)
        return follower

    def unfollow(self, follower: Follower) -> None:
        self._followers.discard(follower)

    def release_followers(self) -> None:
        """End every follower's stream (this agent is being drained): each overlay reconnects,
        and through a proxy reaches an agent that goes on serving. An open stream would also
        hold a Serve replica's shutdown back (agent/serve/replica.py)."""
        for follower in list(self._followers):
            follower.dropped = True
            follower.push(_marker("omni.agent.draining"))  # wakes its stream; full: it ends anyway
        self._followers.clear()

    @property
    def followers(self) -> int:
        return len(self._followers)

    def _settle(self, follower: Follower) -> None:
        call_id = self.latest(follower.scope)
        if call_id is None:
            follower.call_id = None
            if not follower.push(_marker("omni.call.waiting")):
                self._followers.discard(follower)
        else:
            self._move(follower, call_id)

    def _move(self, follower: Follower, call_id: str) -> None:
        follower.call_id = call_id
        if not follower.push(_marker("omni.call.started", call_id)):
            self._followers.discard(follower)
