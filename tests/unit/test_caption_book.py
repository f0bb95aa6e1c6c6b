"""The call book behind the caption routes (agent/transport/caption_book.py).

Pins:
- a follower is told at once what it follows: `omni.call.waiting` with no call, else
  `omni.call.started` for the newest live call in its scope; it moves to each newer call, gets
  the events of the call it follows only, `omni.call.ended` when that call ends, then the
  newest call still live (started) or waiting;
- scopes: a follower with scope None sees every call; one with an ephemeral key's scope only
  the calls made with that key; scope_of names an ephemeral key by its public half only;
- a follower that falls a queue's length behind is dropped (bounded memory), the others not;
  draining releases every follower (dropped, woken with `omni.agent.draining`);
- finished calls are kept keep_s and at most keep_calls of them; a dropped one is "forgotten"
  (410 for the routes), an unknown one is not; a live call is never dropped.
"""

from __future__ import annotations

import json

from agent.gate.api_keys import Grant
from agent.transport import caption_book
from agent.transport.caption_book import CaptionBook, scope_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _drain(follower) -> list[dict]:
    out = []
    while not follower.queue.empty():
        out.append(json.loads(follower.queue.get_nowait()))
    return out


def _said(book: CaptionBook, call_id: str, text: str) -> None:
    event = {"type": "response.output_text.delta", "response_id": "r", "delta": text}
    book.event(call_id, event, json.dumps(event))


def test_scope_of() -> None:
    assert scope_of(Grant(ephemeral=False), "sk-anything") is None
    assert scope_of(Grant(ephemeral=False), None) is None
    scope = scope_of(Grant(ephemeral=True), "ek_ab12cd_secretpart")
    assert scope == "ek:ab12cd" and "secret" not in scope


def test_a_follower_waits_then_moves_to_each_new_call() -> None:
    book = CaptionBook(clock=Clock())
    follower = book.follow(None)
    assert _drain(follower) == [{"type": "omni.call.waiting"}]
    book.start("rtc_a", None)
    _said(book, "rtc_a", "one")
    book.start("rtc_b", "ek:x")  # newer: followed from here on, though rtc_a still runs
    _said(book, "rtc_a", "not shown")
    _said(book, "rtc_b", "two")
    got = _drain(follower)
    assert [e["type"] for e in got] == [
        "omni.call.started",
        "response.output_text.delta",
        "omni.call.started",
        "response.output_text.delta",
    ]
    assert [e.get("call_id") or e["delta"] for e in got] == ["rtc_a", "one", "rtc_b", "two"]
    book.end("rtc_b")  # back to the newest call still running
    assert _drain(follower) == [
        {"type": "omni.call.ended", "call_id": "rtc_b"},
        {"type": "omni.call.started", "call_id": "rtc_a"},
    ]
    book.end("rtc_a")
    assert _drain(follower) == [{"type": "omni.call.ended", "call_id": "rtc_a"}, {"type": "omni.call.waiting"}]
    book.unfollow(follower)
    assert book.followers == 0


def test_a_follower_joining_late_gets_the_newest_call() -> None:
    book = CaptionBook(clock=Clock())
    book.start("rtc_a", None)
    book.start("rtc_b", None)
    assert _drain(book.follow(None)) == [{"type": "omni.call.started", "call_id": "rtc_b"}]


def test_an_ephemeral_scope_sees_its_own_calls_only() -> None:
    book = CaptionBook(clock=Clock())
    mine, everyone = book.follow("ek:mine"), book.follow(None)
    _drain(mine), _drain(everyone)
    book.start("rtc_other", "ek:other")
    book.start("rtc_api", None)
    assert _drain(mine) == []
    assert [e["call_id"] for e in _drain(everyone)] == ["rtc_other", "rtc_api"]
    book.start("rtc_mine", "ek:mine")
    assert _drain(mine) == [{"type": "omni.call.started", "call_id": "rtc_mine"}]
    assert book.latest("ek:mine") == "rtc_mine" and book.latest("ek:nobody") is None


def test_a_stalled_follower_is_dropped(monkeypatch) -> None:
    monkeypatch.setattr(caption_book, "_FOLLOWER_QUEUE", 8)
    book = CaptionBook(clock=Clock())
    stalled, reading = book.follow(None), book.follow(None)
    book.start("rtc_a", None)
    for n in range(20):
        _said(book, "rtc_a", str(n))
        _drain(reading)
    assert stalled.dropped and not reading.dropped
    assert book.followers == 1


def test_draining_releases_every_follower() -> None:
    """A replica being removed ends its followers' streams (they reconnect elsewhere): each is
    dropped and woken with `omni.agent.draining`; the calls themselves stay in the book."""
    book = CaptionBook(clock=Clock())
    waiting, following = book.follow(None), book.follow(None)
    book.start("rtc_a", None)
    _drain(waiting)
    book.release_followers()
    assert waiting.dropped and following.dropped and book.followers == 0
    assert _drain(waiting) == [{"type": "omni.agent.draining"}]
    assert _drain(following)[-1] == {"type": "omni.agent.draining"}
    assert book.get("rtc_a") is not None and not book.ended("rtc_a")  # the call goes on recording


def test_finished_calls_are_kept_a_while_and_a_few() -> None:
    clock = Clock()
    book = CaptionBook(keep_s=60.0, keep_calls=2, clock=clock)
    for name in ("rtc_1", "rtc_2", "rtc_3", "rtc_live"):
        book.start(name, None)
    for name in ("rtc_1", "rtc_2", "rtc_3"):
        book.end(name)
    # Three finished, two kept: the oldest went first.
    assert book.get("rtc_1") is None and book.forgot("rtc_1") and book.ended("rtc_1")
    assert book.get("rtc_2") is not None and book.ended("rtc_2") and not book.forgot("rtc_2")
    clock.now += 61.0
    assert book.get("rtc_2") is None and book.get("rtc_3") is None
    assert book.forgot("rtc_2") and book.forgot("rtc_3")
    assert book.get("rtc_live") is not None and not book.ended("rtc_live")  # live: never dropped
    assert not book.forgot("rtc_never") and book.get("rtc_never") is None and not book.ended("rtc_never")
