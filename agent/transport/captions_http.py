"""The caption routes: the WebVTT of a call, the latest call's events, and the call book's feed.

  GET /v1/realtime/calls/{id}/captions.vtt   the call's captions as WebVTT (running or finished)
  GET /v1/realtime/calls/{id}/events         as before, but 410 once the call has ended
  GET /v1/omni/calls/latest/events           SSE: the newest call's events, moving to each new call

Why one long SSE stream for "latest", not a URL the overlay polls: a browser source runs for
hours, and a stream that the server moves from call to call costs one connection and one
bounded queue (agent/transport/caption_book.py), tells the overlay of a new call the moment
it is answered (no poll interval of missed first words), and has nothing to leak on either
side: the overlay keeps only its last few lines, and a follower that stops reading is dropped
and reconnects. Keep-alive comments every 15 s let the overlay tell a dead connection from a
quiet one, and recheck the key (an ephemeral key that expires ends the stream; the overlay's
reconnect then gets its 401).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from agent.gate.api_keys import bearer_token
from agent.transport.calls import call_events
from agent.transport.caption_book import CaptionBook, scope_of
from agent.transport.http import KEYS, SESSIONS, grant, json_error
from agent.transport.rtc import RtcCall

log = logging.getLogger(__name__)

CAPTIONS: web.AppKey[CaptionBook] = web.AppKey("captions", CaptionBook)
_KEEPALIVE_S = 15.0

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def recorded(create_call: _Handler) -> _Handler:
    """The offer handler, with the answered call's captions recorded from then on."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await create_call(request)
        if response.status == 201:
            call_id = response.headers.get("Location", "").rsplit("/", 1)[-1]
            call = request.app[SESSIONS].get(call_id)
            if isinstance(call, RtcCall) and not call.session.closed:
                scope = scope_of(grant(request), bearer_token(request.headers))
                _record(request.app[CAPTIONS], call, scope)
        return response

    return handler


def _record(book: CaptionBook, call: RtcCall, scope: str | None) -> None:
    call_id = call.id
    book.start(call_id, scope)

    def tap(event: dict[str, Any], text: str) -> None:
        try:
            book.event(call_id, event, text)
        except Exception:  # a caption bug must not break the call that emits the event
            log.exception("call %s: caption timeline failed on %s", call_id, event.get("type"))

    call.session.outbox.taps.append(tap)

    async def ended() -> None:
        book.end(call_id)

    call.session.on_close.append(ended)


def _gone(book: CaptionBook, call_id: str) -> web.Response:
    return json_error(
        410,
        f"call {call_id} has ended"
        + ("" if book.get(call_id) else f" and its captions are no longer kept (kept {book.keep_s:.0f} s)"),
        "call_ended",
        param="call_id",
    )


async def events_or_gone(request: web.Request) -> web.StreamResponse:
    """The call's SSE events; a call that has ended is 410 (gone), one never seen 404."""
    call_id = request.match_info["call_id"]
    book = request.app[CAPTIONS]
    if call_id not in request.app[SESSIONS] and book.ended(call_id):
        return _gone(book, call_id)
    return await call_events(request)


async def captions_vtt(request: web.Request) -> web.Response:
    """The call's captions as WebVTT: user and agent cues, times from the call's start."""
    call_id = request.match_info["call_id"]
    book = request.app[CAPTIONS]
    log = book.get(call_id)
    if log is None:
        if book.forgot(call_id):
            return _gone(book, call_id)
        return json_error(404, "no such call", "call_not_found", param="call_id")
    return web.Response(
        text=log.vtt(book.clock()),
        content_type="text/vtt",
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


async def latest_events(request: web.Request) -> web.StreamResponse:
    """SSE: the events of the newest call the key may see, moving to each newer call."""
    keys = request.app[KEYS]
    token = bearer_token(request.headers)
    who = keys.check(token)
    if who is None:  # /v1/omni is not behind the /v1/realtime key check: the same check here
        return json_error(401, "missing, wrong or expired API key (Authorization: Bearer …)", "invalid_api_key")
    book = request.app[CAPTIONS]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    follower = book.follow(scope_of(who, token))
    try:
        while not follower.dropped:
            try:
                text = await asyncio.wait_for(follower.queue.get(), timeout=_KEEPALIVE_S)
            except asyncio.TimeoutError:
                if keys.check(token) is None:
                    break  # the key expired: the reconnect is told so (401)
                await resp.write(b": keep-alive\n\n")
                continue
            await resp.write(f"data: {text}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        book.unfollow(follower)
    return resp


def install(app: web.Application) -> None:
    """The caption book and its read routes (the offer routes are wrapped with `recorded`)."""
    app[CAPTIONS] = CaptionBook()
    app.router.add_get("/v1/realtime/calls/{call_id}/captions.vtt", captions_vtt)
    app.router.add_get("/v1/omni/calls/latest/events", latest_events)
