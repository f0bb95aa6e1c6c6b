"""aiohttp front door: the page, the OpenAI Realtime (GA) routes, health and metrics.

Routes under /v1/realtime need a key when --api-key is set (see agent/gate/api_keys.py):
  POST   /v1/realtime/calls[?model=]        WebRTC offer → 201 SDP answer + Location
  POST   /v1/realtime?model=                the same, older URL form
  DELETE /v1/realtime/calls/{id}            end a call (also POST …/{id}/hangup)
  GET    /v1/realtime/calls/{id}/events     the call's server events as SSE (410 once it has ended)
  GET    /v1/realtime/calls/{id}/captions.vtt  the call's captions as WebVTT (agent/transport/captions_http.py)
  GET    /v1/realtime?model=                WebSocket transport (?call_id= attaches to a call)
  POST   /v1/realtime/client_secrets        mint an ephemeral ek_ key
GET /v1/omni/calls/latest/events (SSE: the newest call's events) checks the same key itself.
Open: GET /, GET /v1/omni/config, GET /healthz, GET /livez, GET /readyz, GET /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from agent import metrics
from agent.config import Config
from agent.engine.loop import Engine
from agent.gate.access import CallRate, cors_middleware
from agent.gate.api_keys import DEFAULT_TTL_S, KeyStore, bearer_token
from agent.gate.ladder import Admission
from agent.media.semantic_turn import CompletenessJudge
from agent.media.smart_turn import load_judge
from agent.media.turn_model import default_path
from agent.realtime import session_checks, session_config
from agent.telemetry import otlp
from agent.transport import audio_level, captions_http
from agent.transport.calls import MAX_OFFER_BYTES, create_call, hangup
from agent.transport.http import (
    ADMISSION,
    CALL_RATE,
    CONFIG,
    DECODE_POOL,
    DRAINING,
    ENGINE,
    ENGINE_START,
    GRANT,
    KEYS,
    LADDER_TICK,
    SESSIONS,
    TRACING,
    TURN_JUDGE,
    check_tools_off_loop,
    json_error,
)
from agent.transport.turn_credentials import PAGE_USER, browser_ice_servers, needs_minting
from agent.transport.ws import websocket

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_PROBES = frozenset({"/healthz", "/livez", "/readyz", "/metrics"})
CONNECTION_CLOSE_S = 5.0  # the longest a shutdown waits on one connection's close (a WebSocket bounds its own)


def _api(path: str) -> bool:
    """The API's and the probes' routes (errors in JSON), not the page's files."""
    return path.startswith("/v1/") or path in _PROBES


def _methods_served(app: web.Application, path: str) -> set[str]:
    """The methods the API's routes (not the page's files) serve at `path`."""
    methods: set[str] = set()
    for resource in app.router.resources():
        info = resource.get_info()
        pattern = info.get("pattern")
        if info.get("path") == path or (pattern is not None and pattern.fullmatch(path)):
            methods |= {route.method for route in resource if route.method != "*"}
    return methods


@web.middleware
async def json_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """API errors are JSON with a reason, and a bug is a 500 without a traceback in the body
    (the traceback goes to the log). An API path no route serves (the page's catch-all file
    route would answer it with an empty 404, or a 405) is a JSON 404, or 405 naming the
    methods that are served there."""
    match = request.match_info
    unrouted = isinstance(match.route.resource, web.StaticResource) or match.http_exception is not None
    if _api(request.path) and unrouted:
        served = _methods_served(request.app, request.path)
        if served:
            allow = ", ".join(sorted(served))
            return json_error(405, f"{request.method} is not served here: {allow}", "method_not_allowed", Allow=allow)
        return json_error(404, f"no route {request.path}", "not_found")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not _api(request.path):
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status, "invalid_request"
        )
        allow = exc.headers.get("Allow")
        return json_error(exc.status, exc.reason, code, **({"Allow": allow} if allow else {}))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return json_error(500, "internal error (logged on the server)", "server_error", kind="server_error")


@web.middleware
async def require_key(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every /v1/realtime route needs the API key or a live ephemeral key (when a key is set)."""
    if request.path.startswith("/v1/realtime"):
        keys = request.app[KEYS]
        grant = keys.check(bearer_token(request.headers))
        if grant is None:
            return json_error(401, "missing, wrong or expired API key (Authorization: Bearer …)", "invalid_api_key")
        if request.path == "/v1/realtime/client_secrets" and grant.ephemeral:
            return json_error(401, "ephemeral keys cannot mint keys: use the API key", "invalid_api_key")
        request[GRANT] = grant
    return await handler(request)


async def client_secrets(request: web.Request) -> web.Response:
    """Mint an ephemeral key carrying a session config: {"value": "ek_…", "expires_at", "session"}."""
    try:
        body: Any = await request.json() if request.can_read_body else {}
    except ValueError:
        return json_error(400, "body must be JSON", "invalid_json")
    if not isinstance(body, dict):
        return json_error(400, "body must be a JSON object", "invalid_request")
    expires = body.get("expires_after") or {}
    if not isinstance(expires, dict):
        return json_error(400, "expires_after must be an object", "invalid_value", param="expires_after")
    seconds = expires.get("seconds", DEFAULT_TTL_S)
    if expires.get("anchor", "created_at") != "created_at":
        return json_error(400, "expires_after.anchor must be created_at", "invalid_value", param="expires_after.anchor")
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        return json_error(
            400, "expires_after.seconds must be an integer", "invalid_value", param="expires_after.seconds"
        )
    try:
        part = body.get("session")
        kind = part.get("type") if isinstance(part, dict) else None
        await check_tools_off_loop(request.app, part, session_config.base_session(request.app[CONFIG], kind))
        session = session_config.client_secret_session(request.app[CONFIG], body)
        session_checks.check_servable(
            session, request.app[ENGINE].voices, request.app[CONFIG].context_limit, request.app[CONFIG].mcp_allow
        )
        value, expires_at = request.app[KEYS].mint(seconds, session)
    except session_config.ConfigError as exc:
        return json_error(400, str(exc), "invalid_value", param=exc.param)
    except ValueError as exc:
        return json_error(400, str(exc), "invalid_value", param="expires_after.seconds")
    return web.json_response({"value": value, "expires_at": expires_at, "session": session})


async def omni_config(request: web.Request) -> web.Response:
    """What the page needs before connecting: whether it must mint an ephemeral key first, and
    the STUN/TURN servers for its RTCPeerConnection (agent/transport/turn_credentials.py), and
    the voices its picker offers (the model's talker speakers; none until the model is loaded).

    Open, since the page asks before it has a key. Minted TURN credentials are a resource (a
    relay's bandwidth), so when the agent wants a key they come only with one: the API key or
    an ek_ key in `Authorization: Bearer` (the page asks again after minting its ek_ key);
    without one the answer says `turn_needs_key` and lists STUN only; a wrong key is a 401.
    Fresh credentials on every request, hence no caching."""
    keys, config = request.app[KEYS], request.app[CONFIG]
    token = bearer_token(request.headers)
    if keys.required and token is not None and keys.check(token) is None:
        return json_error(401, "wrong or expired API key (Authorization: Bearer …)", "invalid_api_key")
    with_turn = not keys.required or token is not None
    ice_servers = browser_ice_servers(
        config.ice_servers, config.turn_secret, config.turn_ttl_s, PAGE_USER, time.time(), with_turn=with_turn
    )
    needs_key = not with_turn and any(needs_minting(s) for s in config.ice_servers)
    voices = request.app[ENGINE].voices
    body = {
        "auth_required": keys.required,
        "ice_servers": ice_servers,
        "turn_needs_key": needs_key,
        "voices": list(voices.names),
        "default_voice": voices.default or None,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})


def startup_body(engine: Engine) -> dict[str, Any]:
    """Where a start-up is, for a probe's body while it is not over: the running phase and the
    finished phases' seconds (agent/engine/startup.py)."""
    view = engine.startup
    return {"phase": view.phase, "phases": {name: round(seconds, 3) for name, seconds in view.finished}}


async def healthz(request: web.Request) -> web.Response:
    engine, start = request.app[ENGINE], request.app[ENGINE_START]
    body: dict[str, Any] = {"status": "ok" if engine.ready else "loading", "sessions": len(request.app[SESSIONS])}
    healthy = engine.ready
    if not engine.ready:  # loading, or failed while loading: say how far it got
        body.update(startup_body(engine))
    if start.done() and start.exception() is not None:
        body.update(status="failed", error=f"model load failed: {start.exception()}")
    elif engine.ready and not engine.alive:  # read per request: a dead thread fails the next probe
        body.update(status="failed", error=engine.failed or "engine thread stopped")
        healthy = False
    elif request.app[DRAINING].is_set():
        body.update(status="draining")
        healthy = False
    return web.json_response(body, status=200 if healthy else 503)


def _engine_failure(app: web.Application) -> Optional[str]:
    """Why the engine cannot serve and never will without a restart (the load failed, or its
    thread died), else None: still loading is not a failure."""
    engine = app[ENGINE]
    start = app.get(ENGINE_START)
    if start is not None and start.done() and not start.cancelled() and start.exception() is not None:
        return f"model load failed: {start.exception()}"
    if engine.failed:
        return engine.failed
    if engine.ready and not engine.alive:  # read per request: a dead thread fails the next probe
        return "engine thread stopped"
    return None


def liveness(app: web.Application) -> tuple[bool, dict[str, Any]]:
    """(alive, body) for /livez: the process answers and its engine thread is loading or serving.
    A slow load is alive (restarting it would only start the load over); a failed load or a dead
    engine thread is not (a restart is the cure). Draining is alive: a drain must finish."""
    failure = _engine_failure(app)
    if failure is not None:
        return False, {"status": "failed", "error": failure}
    return True, {"status": "ok" if app[ENGINE].ready else "loading"}


async def livez(request: web.Request) -> web.Response:
    alive, body = liveness(request.app)
    return web.json_response(body, status=200 if alive else 503)


async def readyz(request: web.Request) -> web.Response:
    """Ready for new calls: the model is loaded, the engine alive, and the agent not draining."""
    alive, body = liveness(request.app)
    engine = request.app[ENGINE]
    ready = alive and engine.ready
    if ready and request.app[DRAINING].is_set():
        body, ready = {"status": "draining"}, False
    elif not engine.ready:  # loading (or its load failed): the phase it is in, and those done
        body.update(startup_body(engine))
    return web.json_response(body, status=200 if ready else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(request.app[CONFIG].web_dir / "index.html")


async def _tick(admission: Admission) -> None:
    # Recovery is a matter of time passing, not only of new samples arriving.
    gpu = metrics.GpuSampler()
    while True:
        await asyncio.sleep(1.0)
        admission.tick()
        gpu.sample()


async def _close(connection) -> None:
    try:
        await asyncio.wait_for(connection.close(), CONNECTION_CLOSE_S)
    except asyncio.TimeoutError:
        log.warning("shutting down: a connection did not close within %.0f s", CONNECTION_CLOSE_S)
    except Exception:  # noqa: BLE001 (its peer's failure: the others still close)
        log.exception("shutting down: closing a connection failed")


async def drain(app: web.Application, deadline_s: float) -> int:
    """Shutting down: refuse new calls (503 shutting_down) and wait, at most `deadline_s`, until
    no session is replying or playing a reply out. Returns the sessions still replying then
    (the caller's cleanup closes every session and peer either way)."""
    app[DRAINING].set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s

    def replying() -> int:
        return sum(1 for c in app[SESSIONS].values() if c.session is not None and c.session.replies.active)

    busy = replying()
    log.info("shutting down: no new calls; %d session(s) finishing their reply (at most %.0f s)", busy, deadline_s)
    while busy and loop.time() < deadline:
        await asyncio.sleep(0.05)
        busy = replying()
    if busy:
        log.warning("shutting down: %d reply(ies) cut off at the %.0f s deadline", busy, deadline_s)
    return busy


def turn_judge(config: Config) -> Optional[CompletenessJudge]:
    """The end-of-turn judge semantic_vad sessions share; None with --turn-model off."""
    if config.turn_model == "off":
        return None
    return load_judge(Path(config.turn_model) if config.turn_model else default_path(config.cache_dir))


def create_app(config: Config, engine: Engine) -> web.Application:
    audio_level.install()  # aiortc's per-frame audio level, vectorized (agent/transport/audio_level.py)
    # CORS first: a browser's preflight carries no key. Then JSON errors around everything.
    middlewares = [cors_middleware(config.cors_origins)] if config.cors_origins else []
    app = web.Application(client_max_size=MAX_OFFER_BYTES * 2, middlewares=[*middlewares, json_errors, require_key])
    app[CONFIG] = config
    app[ENGINE] = engine
    app[SESSIONS] = {}
    app[KEYS] = KeyStore(config.api_key, prefix=config.call_id_prefix)
    app[ADMISSION] = admission = Admission.from_config(config)
    app[CALL_RATE] = CallRate(config.max_calls_per_minute)
    app[DRAINING] = asyncio.Event()
    # Half the cores at most: the engine thread and the loop need theirs while pictures decode.
    app[DECODE_POOL] = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="decode")
    app[TURN_JUDGE] = turn_judge(config)
    # A Ray replica's traces name it (its id prefixes its call ids); a lone agent: host:pid.
    app[TRACING] = otlp.from_settings(config.otlp_endpoint, instance=config.call_id_prefix or None)
    app.router.add_get("/", index)
    captions_http.install(app)  # the caption book, the WebVTT and latest-call routes
    app.router.add_post("/v1/realtime/calls", captions_http.recorded(create_call))
    app.router.add_post("/v1/realtime", captions_http.recorded(create_call))
    app.router.add_get("/v1/realtime", websocket)
    app.router.add_delete("/v1/realtime/calls/{call_id}", hangup)
    app.router.add_post("/v1/realtime/calls/{call_id}/hangup", hangup)
    app.router.add_get("/v1/realtime/calls/{call_id}/events", captions_http.events_or_gone)
    app.router.add_post("/v1/realtime/client_secrets", client_secrets)
    app.router.add_get("/v1/omni/config", omni_config)
    app.router.add_get("/healthz", healthz)  # kept as it was: loaded, alive and not draining, in one answer
    app.router.add_get("/livez", livez)  # for restarts (Kubernetes livenessProbe)
    app.router.add_get("/readyz", readyz)  # for traffic (readinessProbe, startupProbe)
    app.router.add_get("/metrics", metrics_endpoint)
    # Only files under web_dir (agent/web/): aiohttp resolves the path and refuses anything
    # outside the folder, and symlinks are not followed (tests/integration/test_access.py).
    app.router.add_static("/", config.web_dir, show_index=False, follow_symlinks=False)

    async def on_startup(app: web.Application) -> None:
        # Load in the background: /healthz says "loading" until the engine is ready.
        app[ENGINE_START] = asyncio.ensure_future(engine.start())
        app[LADDER_TICK] = asyncio.ensure_future(_tick(admission))

    async def on_shutdown(app: web.Application) -> None:
        app[LADDER_TICK].cancel()
        connections = list(app[SESSIONS].values())
        for connection in connections:  # replies the drain cut off end, saying why
            if connection.session is not None:
                connection.session.replies.shut_down()
        # All at once, each bounded: one client that does not read its socket (stalled, or gone
        # with no FIN) cannot hold up the others' closes, the engine's stop or the exit.
        await asyncio.gather(*(_close(connection) for connection in connections))
        await engine.stop()
        app[DECODE_POOL].shutdown(wait=False, cancel_futures=True)
        if app[TURN_JUDGE] is not None:
            app[TURN_JUDGE].close()
        if app[TRACING] is not None:  # (the calls' root spans have ended: send what is left)
            await asyncio.get_running_loop().run_in_executor(None, app[TRACING].close)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app
