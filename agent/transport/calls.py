"""WebRTC signalling, GA form: POST /v1/realtime/calls and the call's sub-routes.

The offer comes as a raw `application/sdp` body (the session config then comes from the
ephemeral key, or the defaults) or as `multipart/form-data` with parts `sdp` and `session`.
The answer is 201 with the SDP answer as body and `Location: /v1/realtime/calls/{call_id}`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any, Optional

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiortc import RTCPeerConnection, RTCSessionDescription

from agent import metrics
from agent.config import Config
from agent.engine.api import EngineBusy
from agent.realtime import session_checks, session_config
from agent.transport.consent import install_consent_freshness
from agent.transport.dtls_flight import install_dtls_resend
from agent.transport.http import (
    ADMISSION,
    CONFIG,
    DECODE_POOL,
    ENGINE,
    SESSIONS,
    TRACING,
    TURN_JUDGE,
    check_tools_off_loop,
    forget,
    grant,
    json_error,
    refuse_new_session,
    remember,
)
from agent.transport.ice import keep_loopback_candidates, loopback_only, rtc_configuration
from agent.transport.offer import OfferError, check_offer
from agent.transport.peer import close_peer
from agent.transport.rtc import RtcCall
from agent.transport.turn_credentials import AGENT_USER, with_credentials

MAX_OFFER_BYTES = 64 * 1024  # a real offer is a few KB; anything huge is not an offer
# What an offer may come as: the GA raw form (`application/sdp`; some clients say text/plain or
# nothing) or multipart. JSON, forms and the like are a client talking to the wrong endpoint.
_OFFER_TYPES = ("application/sdp", "text/plain", "application/octet-stream", "multipart/form-data")
_SSE_KEEPALIVE_S = 15.0
_MAX_PARTS = 4


def _bad(status: int, message: str, reason: str = "bad_request", param: Optional[str] = None) -> web.Response:
    metrics.OFFERS_REJECTED.labels(reason=reason).inc()
    return json_error(status, message, "invalid_offer" if reason == "bad_sdp" else "invalid_request", param=param)


async def _read_offer(request: web.Request) -> tuple[str, Any]:
    """(sdp, session part or None); raises ValueError with a reason."""
    if request.content_type.startswith("multipart/"):
        sdp, session = "", None
        reader = await request.multipart()
        parts = 0
        async for part in reader:
            parts += 1
            if parts > _MAX_PARTS or not isinstance(part, BodyPartReader):
                raise ValueError("a multipart offer has the parts 'sdp' and 'session' only")
            if part.name == "sdp":
                sdp = await _part_text(part)
            elif part.name == "session":
                try:
                    session = json.loads(await _part_text(part))
                except ValueError:
                    raise ValueError("the session part is not JSON") from None
        return sdp, session
    return await request.text(), None


async def _part_text(part: BodyPartReader) -> str:
    # The request's own size limit covers only whole-body reads, not multipart parts.
    data = bytearray()
    while chunk := await part.read_chunk():
        data += chunk
        if len(data) > MAX_OFFER_BYTES:
            raise ValueError(f"a part is larger than {MAX_OFFER_BYTES} bytes")
    return data.decode(part.get_charset(default="utf-8"))


def _peer_connection(config: Config) -> RTCPeerConnection:
    # Only the --ice-server servers (none by default; aiortc's own default is a public STUN
    # server). Host candidates come from agent.transport.ice. A TURN URL without a credential
    # gets one minted for this call from --turn-secret, as the page's does.
    servers = with_credentials(config.ice_servers, config.turn_secret, config.turn_ttl_s, AGENT_USER, time.time())
    install_consent_freshness()  # a call outlives a peer that answers consent checks late
    install_dtls_resend()  # a peer that drops the first ClientHello connects without a 1 s wait
    return RTCPeerConnection(rtc_configuration(servers))


async def create_call(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    if request.content_length is not None and request.content_length > MAX_OFFER_BYTES:
        return _bad(413, f"offer too large (at most {MAX_OFFER_BYTES} bytes)")
    if request.content_type not in _OFFER_TYPES:
        return _bad(415, f"an offer is application/sdp or multipart/form-data, not {request.content_type}")
    try:
        sdp, session_part = await _read_offer(request)
    except (ValueError, UnicodeDecodeError, LookupError, RuntimeError, AssertionError, HttpProcessingError) as exc:
        # aiohttp's multipart reader raises these on malformed bodies (a part's bad header:
        # HttpProcessingError; the 413 of a too-large plain body is an HTTPException: JSON too,
        # from server.json_errors).
        return _bad(400, f"unreadable offer: {exc}")
    if len(sdp) > MAX_OFFER_BYTES:  # a chunked body declares no length
        return _bad(413, f"offer too large (at most {MAX_OFFER_BYTES} bytes)")
    if not sdp.strip():
        return _bad(400, "the body must be an SDP offer (application/sdp, or multipart part 'sdp')", param="sdp")
    who = grant(request)
    # A session part with type "transcription" makes a transcription-only call (no replies, no
    # outbound audio).
    kind = session_part.get("type") if isinstance(session_part, dict) else None
    settings = copy.deepcopy(who.session) if who.session else session_config.base_session(config, kind)
    try:
        await check_tools_off_loop(app, session_part, settings)
        if session_part is not None:
            settings = session_config.merge(settings, session_part, config.vad_silence_ms)
            session_checks.check_servable(settings, app[ENGINE].voices, config.context_limit, config.mcp_allow)
        if request.query.get("model"):
            settings["model"] = request.query["model"]
        # ?priority= or the session's omni.priority; an ephemeral key's session fixes it.
        fixed = session_config.priority_of(who.session) if who.session else None
        settings = session_config.offer_priority(settings, request.query.get("priority"), fixed)
    except session_config.ConfigError as exc:
        return _bad(400, str(exc), param=exc.param)
    try:  # the SDP itself, before aiortc builds anything from it
        check_offer(sdp)
    except OfferError as exc:
        return _bad(400, f"invalid SDP offer: {exc}", "bad_sdp", param="sdp")
    refused = refuse_new_session(
        request, session_config.priority_of(settings), transcription=settings.get("type") == "transcription"
    )
    if refused is not None:
        return refused

    if loopback_only(config.ice_hosts):
        sdp = keep_loopback_candidates(sdp)
    pc = _peer_connection(config)
    call = RtcCall(
        config,
        app[ENGINE],
        app[ADMISSION],
        pc,
        settings,
        lambda c: forget(app, c.id),
        decode_pool=app[DECODE_POOL],
        turn_judge=app[TURN_JUDGE],
        tracer=app[TRACING].tracer if app[TRACING] is not None else None,
    )
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except Exception as exc:  # what aiortc raises on an offer it cannot take is input-dependent
        await close_peer(pc)
        return _bad(400, f"invalid SDP offer: {exc}", "bad_sdp", param="sdp")
    # Added after setRemoteDescription so it rides the client's sendrecv audio transceiver.
    if call.session.track is not None:  # a transcription call sends nothing back: recvonly
        pc.addTrack(call.track)
    try:
        call.start()
    except EngineBusy:
        await close_peer(pc)
        metrics.OFFERS_REJECTED.labels(reason="busy").inc()
        return json_error(503, "engine is overloaded", "busy", kind="server_error", **{"Retry-After": "5"})
    remember(app, call.id, call)
    try:
        return await _answer(config, call, pc)
    except BaseException:  # a cancelled request or a failure: the session must not outlive it
        await call.close()
        raise


async def _answer(config: Config, call: RtcCall, pc: RTCPeerConnection) -> web.Response:
    """The call's SDP answer, once the engine has its session; a refusal closes the call."""
    # No answer before the engine has the session: one it cannot open (no slot left, as when
    # offers passed admission at the same instant) is a 503 now, not a call that connects and
    # is then closed. A slow engine only delays the answer up to the connect timeout.
    try:
        await asyncio.wait_for(asyncio.shield(call.session.opened), timeout=config.connect_timeout_s)
    except asyncio.TimeoutError:
        pass  # answered anyway: a later failure still ends the session with an error
    except Exception as exc:  # noqa: BLE001 (the engine's reason, passed on)
        await call.close()
        metrics.OFFERS_REJECTED.labels(reason="capacity").inc()
        return json_error(
            503,
            f"the engine could not open this session: {exc}",
            "capacity",
            kind="server_error",
            **{"Retry-After": "10"},
        )
    if call.session.closed:  # ended while it waited (the server stopping): no 201 for a dead call
        return json_error(
            503, "the call ended before it was answered", "call_ended", kind="server_error", **{"Retry-After": "5"}
        )
    try:
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:  # e.g. a media section without a direction aiortc can intersect
        await call.close()
        return _bad(400, f"cannot answer this offer: {type(exc).__name__}: {exc}", "bad_sdp", param="sdp")
    call.answer_sent()
    return web.Response(
        status=201,
        text=pc.localDescription.sdp,
        content_type="application/sdp",
        headers={"Location": f"/v1/realtime/calls/{call.id}"},
    )


def _call(request: web.Request) -> Optional[RtcCall]:
    call = request.app[SESSIONS].get(request.match_info["call_id"])
    return call if isinstance(call, RtcCall) else None


async def hangup(request: web.Request) -> web.Response:
    """DELETE /v1/realtime/calls/{id} or POST …/hangup: end the call."""
    call = _call(request)
    if call is None:
        return json_error(404, "no such call", "call_not_found", param="call_id")
    await call.close()
    return web.Response(status=204)


async def call_events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the call's server events, as on its data channel (for captions elsewhere)."""
    call = _call(request)
    if call is None:
        return json_error(404, "no such call", "call_not_found", param="call_id")
    session = call.session
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    q = session.outbox.subscribe()
    try:
        while True:
            try:
                text = await asyncio.wait_for(q.get(), timeout=_SSE_KEEPALIVE_S)
            except asyncio.TimeoutError:
                if not session.outbox.subscribed(q):
                    break
                await resp.write(b": keep-alive\n\n")
                continue
            if text is None:
                break
            await resp.write(f"data: {text}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        session.outbox.unsubscribe(q)
    return resp
