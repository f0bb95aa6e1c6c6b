"""What the HTTP handlers share: the app's keys, OpenAI-shaped JSON errors, admission checks."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from aiohttp import web

from agent import metrics
from agent.config import Config
from agent.engine.loop import Engine
from agent.gate import priority
from agent.gate.access import CallRate
from agent.gate.api_keys import Grant, KeyStore
from agent.gate.ladder import Admission
from agent.media.semantic_turn import CompletenessJudge
from agent.realtime.tool_config import check_tools
from agent.telemetry.otlp import Tracing

CONFIG: web.AppKey[Config] = web.AppKey("config", Config)
ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
SESSIONS: web.AppKey[dict] = web.AppKey("sessions", dict)  # call id / session id -> RtcCall | WsConnection
ADMISSION: web.AppKey[Admission] = web.AppKey("admission", Admission)
KEYS: web.AppKey[KeyStore] = web.AppKey("keys", KeyStore)
ENGINE_START: web.AppKey[asyncio.Future] = web.AppKey("engine_start", asyncio.Future)
LADDER_TICK: web.AppKey[asyncio.Future] = web.AppKey("ladder_tick", asyncio.Future)
CALL_RATE: web.AppKey[CallRate] = web.AppKey("call_rate", CallRate)
# Decoding that would hold the loop (a message's images and audio): agent/realtime/inbox.py.
DECODE_POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("decode_pool", ThreadPoolExecutor)
# The end-of-turn judge every session shares (agent/media/smart_turn.py); None without its model.
TURN_JUDGE: web.AppKey[Optional[CompletenessJudge]] = web.AppKey("turn_judge", object)
# The calls' trace export (agent/telemetry/otlp.py); None: no tracing.
TRACING: web.AppKey[Optional[Tracing]] = web.AppKey("tracing", object)
# Set once on SIGTERM/Ctrl-C (agent/__main__.py): new calls get 503 while replies finish.
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining", asyncio.Event)
GRANT: web.RequestKey[Grant] = web.RequestKey("grant", Grant)  # what the auth middleware found


def json_error(
    status: int,
    message: str,
    code: str,
    *,
    kind: str = "invalid_request_error",
    param: Optional[str] = None,
    **headers: str,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return web.json_response(body, status=status, headers=headers)


def refuse_new_session(
    request: web.Request, priority_class: str = priority.NORMAL, transcription: bool = False
) -> Optional[web.Response]:
    """503 (with Retry-After) while the engine loads, after it died, while shutting down or at
    the session limit (for a normal session: the limit less the slots kept for high priority;
    for a transcription session, its own limit when --max-transcription-sessions sets one);
    429 when this client address opens calls too fast."""
    app = request.app
    config, engine = app[CONFIG], app[ENGINE]
    if app[DRAINING].is_set():
        metrics.OFFERS_REJECTED.labels(reason="shutting_down").inc()
        return json_error(
            503, "the agent is shutting down", "shutting_down", kind="server_error", **{"Retry-After": "30"}
        )
    if engine.failed is not None:
        metrics.OFFERS_REJECTED.labels(reason="engine_failed").inc()
        return json_error(
            503,
            f"the engine has stopped: {engine.failed}",
            "engine_failed",
            kind="server_error",
            **{"Retry-After": "30"},
        )
    if not engine.ready:
        metrics.OFFERS_REJECTED.labels(reason="not_ready").inc()
        return json_error(503, "engine is still loading", "not_ready", kind="server_error", **{"Retry-After": "5"})
    own_limit = config.max_transcription_sessions
    conversations, transcriptions = active_sessions(app)
    if transcription and own_limit:
        if sum(transcriptions.values()) >= own_limit:
            metrics.OFFERS_REJECTED.labels(reason="capacity").inc()
            return json_error(
                503,
                f"transcription session limit reached ({own_limit})",
                "capacity",
                kind="server_error",
                **{"Retry-After": "10"},
            )
        reason = None
    else:
        # With a limit of their own, transcription sessions take nothing from max_sessions.
        active = conversations if own_limit else {p: n + transcriptions[p] for p, n in conversations.items()}
        reason = priority.refusal(active, priority_class, config.max_sessions, config.high_priority_slots)
    if reason == "capacity":
        metrics.OFFERS_REJECTED.labels(reason="capacity").inc()
        return json_error(
            503,
            f"session limit reached ({config.max_sessions})",
            "capacity",
            kind="server_error",
            **{"Retry-After": "10"},
        )
    if reason == "reserved":
        metrics.OFFERS_REJECTED.labels(reason="reserved").inc()
        return json_error(
            503,
            f"session limit for normal priority reached ({config.high_priority_slots} of "
            f"{config.max_sessions} slots are kept for priority=high)",
            "capacity",
            kind="server_error",
            **{"Retry-After": "10"},
        )
    wait = app[CALL_RATE].admit(request.remote or "")
    if wait is not None:
        metrics.OFFERS_REJECTED.labels(reason="call_rate").inc()
        return json_error(
            429,
            f"too many new calls from this address (at most {config.max_calls_per_minute} a minute)",
            "rate_limited",
            **{"Retry-After": str(int(wait + 0.999))},
        )
    return None


def active_sessions(app: web.Application) -> tuple[dict[str, int], dict[str, int]]:
    """Conversation sessions and transcription sessions, each per priority class, in one walk
    (a connection whose session is not made yet counts as a normal conversation)."""
    conversations = {p: 0 for p in priority.PRIORITIES}
    transcriptions = dict(conversations)
    for connection in app[SESSIONS].values():
        session = getattr(connection, "session", None)
        kind = transcriptions if getattr(session, "transcription_only", False) else conversations
        kind[getattr(session, "priority", priority.NORMAL)] += 1
    return conversations, transcriptions


def _export_sessions(app: web.Application) -> None:
    conversations, transcriptions = active_sessions(app)
    for name, count in conversations.items():
        metrics.SESSIONS_ACTIVE.labels(priority=name).set(count + transcriptions[name])
    # Beside --max-transcription-sessions, what an operator sizes it by.
    metrics.TRANSCRIPTION_SESSIONS_ACTIVE.set(sum(transcriptions.values()))


def grant(request: web.Request) -> Grant:
    return request.get(GRANT) or Grant(ephemeral=False)


def forget(app: web.Application, key: str) -> None:
    app[SESSIONS].pop(key, None)
    _export_sessions(app)


def remember(app: web.Application, key: str, value: Any) -> None:
    app[SESSIONS][key] = value
    _export_sessions(app)


async def check_tools_off_loop(app: web.Application, session_part: Any, base: dict[str, Any]) -> None:
    """The tools of a session sent with an offer or a key request, checked on the decode pool
    before the handler's own check, which then finds them checked (agent/realtime/tool_config.py
    remembers a list). Their JSON Schema meta-check is ~8 ms a schema in Python: a list of 90
    checked on the loop held every call's audio for most of a second. `base`: the session the
    part is merged into (one with no tools, a transcription session's, ignores them). Raises
    ConfigError."""
    tools = session_part.get("tools") if isinstance(session_part, dict) else None
    if "tools" in base and isinstance(tools, list) and tools:
        await asyncio.get_running_loop().run_in_executor(app[DECODE_POOL], check_tools, tools, "session.tools")
