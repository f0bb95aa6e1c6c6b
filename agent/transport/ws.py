"""The WebSocket transport: GET /v1/realtime?model=… (the `openai` SDK's realtime.connect()).

Audio in as input_audio_buffer.append (base64, per session.audio.input.format), audio out as
response.output_audio.delta (base64 pcm16 24 kHz), events both ways as JSON text frames. One
writer task sends in order from a bounded queue: a client that stops reading is disconnected
instead of growing the agent's memory. `?call_id=rtc_…` attaches a sideband connection to a
WebRTC call: the call's events, and client events into that call.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from aiohttp import WSCloseCode, WSMsgType, web

from agent.engine.api import EngineBusy
from agent.realtime import client_events, session_config
from agent.realtime.session import Session
from agent.transport.captions_http import CAPTIONS
from agent.transport.http import (
    ADMISSION,
    CONFIG,
    DECODE_POOL,
    ENGINE,
    SESSIONS,
    TRACING,
    TURN_JUDGE,
    forget,
    grant,
    json_error,
    refuse_new_session,
    remember,
)
from agent.transport.rtc import RtcCall

log = logging.getLogger(__name__)

_SEND_QUEUE = 4096  # server events waiting for the socket (an 80 ms audio delta each, at most)
# One append may carry up to 15 MiB of audio, base64 (20 MiB): the socket takes a little more
# than the events' own limit, so a message just over it gets `event_too_large`, not a close (1009).
_MAX_MESSAGE = client_events.MAX_MESSAGE_CHARS + 1024 * 1024
# A ping when the client has sent nothing for this long, and no pong within half of it: the
# client is gone (its network dropped with no FIN), and its session and engine slot are freed.
HEARTBEAT_S = 20.0
# A close frame is waited on at most this long: a client that does not read (stalled, or gone)
# is cut off, so it cannot hold up a shutdown, other sessions' closes or the process's exit.
CLOSE_TIMEOUT_S = 2.0


async def close_bounded(ws: web.WebSocketResponse, transport, code: int, message: bytes) -> None:
    """Close `ws` with `code`, giving the client CLOSE_TIMEOUT_S to take the close frame and
    answer it; past that (a client that does not read) the connection is aborted."""
    try:
        await asyncio.wait_for(ws.close(code=code, message=message), CLOSE_TIMEOUT_S)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    if transport is not None and (not transport.is_closing() or transport.get_write_buffer_size()):
        transport.abort()  # (what the client did not read is dropped with it)


class WsConnection:
    def __init__(self, ws: web.WebSocketResponse, transport=None) -> None:
        self.ws, self._transport = ws, transport
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=_SEND_QUEUE)
        self.session: Session | None = None
        self.overflowed = False
        self.writer_task: asyncio.Future | None = None

    def send(self, text: str) -> None:
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:
            self.overflowed = True

    async def writer(self) -> None:
        try:
            while not self.overflowed:
                text = await self.queue.get()
                if text is None:
                    return
                await self.ws.send_str(text)
        except ConnectionError:
            return  # the connection was cut (aborted, reset): nothing more to send
        log.warning("websocket client is not reading its events: closing")
        await close_bounded(self.ws, self._transport, WSCloseCode.TRY_AGAIN_LATER, b"client too slow")

    async def close(self) -> None:
        """The server is shutting down: 1001 (going away), bounded."""
        await close_bounded(self.ws, self._transport, WSCloseCode.GOING_AWAY, b"server shutting down")

    async def finish(self) -> None:
        """The session's teardown hook: when the server ends the session (e.g. the engine could
        not open it), its last events go out, then the socket closes, ending the read loop.
        When the client ended it, all of this is already done or harmless."""
        self.send(None)
        try:
            if self.writer_task is not None:
                await asyncio.wait_for(self.writer_task, timeout=1.0)
        except Exception:  # noqa: BLE001 (a reset or slow socket: it is being closed anyway)
            pass
        await close_bounded(self.ws, self._transport, WSCloseCode.OK, b"")


async def websocket(request: web.Request) -> web.StreamResponse:
    app = request.app
    if request.query.get("call_id"):
        return await _sideband(request)
    who = grant(request)
    intent = request.query.get("intent")  # transcription: a transcription-only session
    if intent not in (None, "", "conversation", "transcription"):
        return json_error(400, "intent must be transcription (or absent)", "invalid_value", param="intent")
    if who.session and intent and (intent == "transcription") != (who.session.get("type") == "transcription"):
        kind = who.session.get("type", "realtime")
        return json_error(
            400, f"this key's session is a {kind} session: ?intent cannot change it", "invalid_value", param="intent"
        )
    if who.session:
        settings = copy.deepcopy(who.session)
    else:
        settings = session_config.base_session(app[CONFIG], intent)
    if request.query.get("model"):
        settings["model"] = request.query["model"]
    try:
        fixed = session_config.priority_of(who.session) if who.session else None
        settings = session_config.offer_priority(settings, request.query.get("priority"), fixed)
    except session_config.ConfigError as exc:
        return json_error(400, str(exc), "invalid_value", param=exc.param)
    refused = refuse_new_session(
        request, session_config.priority_of(settings), transcription=settings.get("type") == "transcription"
    )
    if refused is not None:
        return refused
    ws = web.WebSocketResponse(protocols=("realtime",), max_msg_size=_MAX_MESSAGE, heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    conn = WsConnection(ws, request.transport)
    session = Session(
        app[CONFIG],
        app[ENGINE],
        app[ADMISSION],
        send=conn.send,
        webrtc=False,
        settings=settings,
        on_closed=lambda s: forget(app, s.id),
        decode_pool=app[DECODE_POOL],
        turn_judge=app[TURN_JUDGE],
        tracer=app[TRACING].tracer if app[TRACING] is not None else None,
    )
    conn.session = session
    session.on_close.append(conn.finish)
    writer = conn.writer_task = asyncio.ensure_future(conn.writer())
    try:
        session.start()
    except EngineBusy:
        conn.send(
            '{"type":"error","event_id":"event_busy","error":{"type":"server_error","code":"busy",'
            '"message":"engine is overloaded","param":null,"event_id":null}}'
        )
        conn.send(None)
        await writer
        await close_bounded(ws, request.transport, WSCloseCode.OK, b"")
        return ws
    remember(app, session.id, conn)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                client_events.handle(session, msg.data)
                await session.inbox.idle()  # read on once a slow event is done: TCP slows the client
            elif msg.type == WSMsgType.BINARY:
                session.emit_error("send client events as JSON text frames", "invalid_event")
            if conn.overflowed:
                break
    finally:
        await session.close()  # its teardown hook, conn.finish, flushes the events and closes the socket
    return ws


async def _sideband(request: web.Request) -> web.StreamResponse:
    call_id = request.query["call_id"]
    call = request.app[SESSIONS].get(call_id)
    if not isinstance(call, RtcCall):
        if call is None and request.app[CAPTIONS].ended(call_id):  # as its events route says
            return json_error(410, f"call {call_id} has ended", "call_ended", param="call_id")
        return json_error(404, "no such call", "call_not_found", param="call_id")
    ws = web.WebSocketResponse(protocols=("realtime",), max_msg_size=_MAX_MESSAGE, heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    session = call.session
    q = session.outbox.subscribe()

    async def forward() -> None:
        try:
            while True:
                text = await q.get()
                if text is None:
                    break
                await ws.send_str(text)
        except ConnectionError:
            return
        # The end marker: the call ended, or this reader fell too far behind and was dropped.
        if session.outbox.closed:
            await close_bounded(ws, request.transport, WSCloseCode.OK, b"call ended")
        else:
            log.warning("sideband client is not reading the call's events: closing")
            await close_bounded(ws, request.transport, WSCloseCode.TRY_AGAIN_LATER, b"client too slow")

    task = asyncio.ensure_future(forward())

    async def end() -> None:
        """The call ended: so does its sideband, also one whose client does not read (its
        forward is stuck on a full socket and would never see the end marker)."""
        task.cancel()
        await close_bounded(ws, request.transport, WSCloseCode.OK, b"call ended")

    session.on_close.append(end)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                client_events.handle(session, msg.data)
                await session.inbox.idle()
    finally:
        if end in session.on_close:
            session.on_close.remove(end)
        session.outbox.unsubscribe(q)
        task.cancel()
        # (a client gone without a FIN, found by the heartbeat, still has writes queued to it)
        await close_bounded(ws, request.transport, WSCloseCode.OK, b"")
    return ws
