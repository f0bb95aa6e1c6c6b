"""Which replica owns a request: the call id names its owner, `<replica id>.<call>`.

The replica that answers an offer prefixes the call's id with its own Serve replica id, so
any process that sees a follow-up (the router in the proxy, the replica itself) knows the
owner without a shared table. The id travels in the path (`/v1/realtime/calls/{id}/…`:
browser EventSource cannot set headers), in `?call_id=` (the WebSocket sideband), or in
Serve's session header; `?replica=` names a replica directly (per-replica /metrics).
Ephemeral keys are held by the replica that minted them, which names itself in them the same
way (`ek_<replica id>.<hex>_<secret>`): a request presenting one goes to that replica.
"""

from __future__ import annotations

from typing import Iterable, Optional
from urllib.parse import parse_qs

from agent.gate.api_keys import EPHEMERAL_PREFIX, bearer_token

CALLS_PATH = "/v1/realtime/calls"
OFFER_PATHS = (CALLS_PATH, "/v1/realtime")
SESSION_HEADER = "x-session-id"  # Serve's default session header (RAY_SERVE_SESSION_ID_HEADER_KEY)
REPLICA_HEADER = "x-omni-replica"  # set on every bridged response: which replica answered


def call_id(prefix: str, local_id: str) -> str:
    """The id a replica gives a call: its own replica id, a dot, the call's local id."""
    return f"{prefix}.{local_id}" if prefix else local_id


def owner_of(call: str) -> Optional[str]:
    """The replica id inside a call id, or None for an id no replica minted (single-process form)."""
    owner, dot, rest = call.partition(".")
    return owner if dot and owner and rest else None


def is_offer(method: str, path: str) -> bool:
    """POST /v1/realtime/calls or the older POST /v1/realtime: a new call, not a follow-up."""
    return method.upper() == "POST" and path.rstrip("/") in OFFER_PATHS


def call_in_path(path: str) -> Optional[str]:
    """`{id}` of /v1/realtime/calls/{id}[/…], else None."""
    if not path.startswith(CALLS_PATH + "/"):
        return None
    head = path[len(CALLS_PATH) + 1 :].split("/", 1)[0]
    return head or None


def owner_from_request(
    path: str, query: str | bytes = "", headers: Iterable[tuple[bytes, bytes]] = ()
) -> Optional[str]:
    """The replica a request must reach, or None when any replica may answer it."""
    call = call_in_path(path)
    if isinstance(query, bytes):
        query = query.decode("latin-1")
    params = parse_qs(query) if query else {}
    if call is None and params.get("call_id"):
        call = params["call_id"][0]
    named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    if call is None:
        call = named.get(SESSION_HEADER)
    if call is not None:
        return owner_of(call)
    if params.get("replica"):
        return params["replica"][0] or None
    return _ephemeral_key_owner(named)


def _ephemeral_key_owner(headers: dict[str, str]) -> Optional[str]:
    token = bearer_token(
        {
            "Authorization": headers.get("authorization", ""),
            "Sec-WebSocket-Protocol": headers.get("sec-websocket-protocol", ""),
        }
    )
    if token and token.startswith(EPHEMERAL_PREFIX):
        return owner_of(token[len(EPHEMERAL_PREFIX) :].partition("_")[0])
    return None
