"""aiohttp front door: the page, signalling (/offer), health, metrics and SSE events."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from . import metrics
from .config import Config
from .engine import Engine, EngineBusy
from .ice import keep_loopback_candidates, loopback_only
from .ladder import Admission
from .peer import close_peer
from .session import Session

log = logging.getLogger(__name__)

CONFIG: web.AppKey[Config] = web.AppKey("config", Config)
ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
SESSIONS: web.AppKey[dict] = web.AppKey("sessions", dict)
ADMISSION: web.AppKey[Admission] = web.AppKey("admission", Admission)
ENGINE_START: web.AppKey[asyncio.Future] = web.AppKey("engine_start", asyncio.Future)
LADDER_TICK: web.AppKey[asyncio.Future] = web.AppKey("ladder_tick", asyncio.Future)

_MAX_SDP_BYTES = 64 * 1024  # a real offer is a few KB; anything huge is not an offer


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _peer_connection() -> RTCPeerConnection:
    # No STUN/TURN servers: aiortc's default is a public STUN server, which this agent
    # neither needs on a LAN/loopback nor may reach. Host candidates come from agent.ice.
    return RTCPeerConnection(RTCConfiguration(iceServers=[]))


async def offer(request: web.Request) -> web.Response:
    config, engine, sessions = request.app[CONFIG], request.app[ENGINE], request.app[SESSIONS]
    if request.content_length is not None and request.content_length > _MAX_SDP_BYTES:
        metrics.OFFERS_REJECTED.labels(reason="bad_request").inc()
        return _error(413, "offer too large")
    try:
        body: Any = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        metrics.OFFERS_REJECTED.labels(reason="bad_request").inc()
        return _error(400, "body must be JSON: {\"sdp\": ..., \"type\": \"offer\"}")
    if not isinstance(body, dict) or not isinstance(body.get("sdp"), str) or body.get("type") != "offer":
        metrics.OFFERS_REJECTED.labels(reason="bad_request").inc()
        return _error(400, "expected {\"sdp\": string, \"type\": \"offer\"}")
    if not engine.ready:
        metrics.OFFERS_REJECTED.labels(reason="not_ready").inc()
        return _error(503, "engine is still loading", **{"Retry-After": "5"})
    if len(sessions) >= config.max_sessions:
        metrics.OFFERS_REJECTED.labels(reason="capacity").inc()
        return _error(503, f"session limit reached ({config.max_sessions})", **{"Retry-After": "10"})

    sdp = body["sdp"]
    if loopback_only(config.ice_hosts):
        sdp = keep_loopback_candidates(sdp)
    pc = _peer_connection()
    session = Session(config, engine, pc, request.app[ADMISSION], on_closed=lambda s: _forget(sessions, s))
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except (ValueError, KeyError, IndexError) as exc:  # aiortc's SDP parser raises these
        await close_peer(pc)
        metrics.OFFERS_REJECTED.labels(reason="bad_sdp").inc()
        return _error(400, f"invalid SDP offer: {exc}")
    if not any(t.kind == "audio" for t in pc.getTransceivers()):
        await close_peer(pc)
        metrics.OFFERS_REJECTED.labels(reason="bad_sdp").inc()
        return _error(400, "the offer has no audio: send the microphone")
    # Added after setRemoteDescription so it rides the browser's sendrecv audio transceiver.
    pc.addTrack(session.track)
    try:
        session.start()
    except EngineBusy:
        await close_peer(pc)
        metrics.OFFERS_REJECTED.labels(reason="busy").inc()
        return _error(503, "engine is overloaded", **{"Retry-After": "5"})
    sessions[session.id] = session
    metrics.SESSIONS_ACTIVE.set(len(sessions))
    answer = await pc.createAnswer()
    await pc.setLocalDescription(answer)
    return web.json_response(
        {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type, "session_id": session.id}
    )


def _forget(sessions: dict, session: Session) -> None:
    sessions.pop(session.id, None)
    metrics.SESSIONS_ACTIVE.set(len(sessions))


async def healthz(request: web.Request) -> web.Response:
    engine, start = request.app[ENGINE], request.app[ENGINE_START]
    body: dict[str, Any] = {"status": "ok" if engine.ready else "loading", "sessions": len(request.app[SESSIONS])}
    if start.done() and start.exception() is not None:
        body.update(status="failed", error=f"model load failed: {start.exception()}")
    return web.json_response(body, status=200 if engine.ready else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the same JSON events as the data channel, for captions elsewhere."""
    session = request.app[SESSIONS].get(request.match_info["session_id"])
    if session is None:
        return _error(404, "no such session")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    q = session.subscribe()
    try:
        while session.subscribed(q):
            try:
                text = await asyncio.wait_for(q.get(), timeout=15.0)
            except asyncio.TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if text is None:
                break
            await resp.write(f"data: {text}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        session.unsubscribe(q)
    return resp


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(request.app[CONFIG].web_dir / "index.html")


async def _tick(admission: Admission) -> None:
    # Recovery is a matter of time passing, not only of new samples arriving.
    gpu = metrics.GpuSampler()
    while True:
        await asyncio.sleep(1.0)
        admission.tick()
        gpu.sample()


def create_app(config: Config, engine: Engine) -> web.Application:
    app = web.Application(client_max_size=_MAX_SDP_BYTES * 2)
    app[CONFIG] = config
    app[ENGINE] = engine
    app[SESSIONS] = {}
    app[ADMISSION] = admission = Admission.from_config(config)
    app.router.add_get("/", index)
    app.router.add_post("/offer", offer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/sessions/{session_id}/events", events)
    app.router.add_static("/", config.web_dir, show_index=False)

    async def on_startup(app: web.Application) -> None:
        # Load in the background: /healthz says "loading" until the engine is ready.
        app[ENGINE_START] = asyncio.ensure_future(engine.start())
        app[LADDER_TICK] = asyncio.ensure_future(_tick(admission))

    async def on_shutdown(app: web.Application) -> None:
        app[LADDER_TICK].cancel()
        for session in list(app[SESSIONS].values()):
            await session.close()
        await engine.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app
