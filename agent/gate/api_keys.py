"""API key and ephemeral (`ek_…`) keys for the /v1/realtime routes.

With no API key configured everything is open (the loopback default). With one, a request
needs `Authorization: Bearer <key>` (or, from a browser's WebSocket, the subprotocol
`openai-insecure-api-key.<key>`), where the key is the API key or an unexpired ephemeral key
minted by POST /v1/realtime/client_secrets. Every comparison is constant-time: an ephemeral
key is looked up by its public half and its secret half compared with hmac.compare_digest.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

EPHEMERAL_PREFIX = "ek_"
MIN_TTL_S, MAX_TTL_S, DEFAULT_TTL_S = 10, 7200, 600
_MAX_LIVE_KEYS = 10_000  # minting past this drops the oldest: memory stays bounded
_WS_KEY_PROTOCOL = "openai-insecure-api-key."


@dataclass(frozen=True)
class Grant:
    """Who a request is: the API key holder, or an ephemeral key and the session it carries."""

    ephemeral: bool
    session: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class _Ephemeral:
    secret: str
    expires_at: int
    session: dict[str, Any]


class KeyStore:
    def __init__(self, api_key: str = "", clock: Callable[[], float] = time.time, prefix: str = "") -> None:
        self._api_key = api_key
        # A Ray Serve replica's id: its keys read `ek_<prefix>.<hex>_<secret>`, so the router can
        # send a request carrying one to the replica that holds it (agent/serve/ownership.py).
        self._prefix = prefix
        self.clock = clock  # public: tests move time forward
        self._ephemeral: dict[str, _Ephemeral] = {}

    @property
    def required(self) -> bool:
        return bool(self._api_key)

    def check(self, token: Optional[str]) -> Optional[Grant]:
        """The grant for a presented key, or None when it is missing, wrong or expired."""
        if not self.required:
            return Grant(ephemeral=False)
        if not token:
            return None
        if token.startswith(EPHEMERAL_PREFIX):
            public, _, secret = token[len(EPHEMERAL_PREFIX) :].partition("_")
            entry = self._ephemeral.get(public)
            if entry is None or not hmac.compare_digest(entry.secret.encode(), secret.encode()):
                return None
            if self.clock() >= entry.expires_at:
                del self._ephemeral[public]
                return None
            return Grant(ephemeral=True, session=entry.session)
        if hmac.compare_digest(self._api_key.encode(), token.encode()):
            return Grant(ephemeral=False)
        return None

    def mint(self, ttl_s: int, session: dict[str, Any]) -> tuple[str, int]:
        """A new ephemeral key valid for ttl_s seconds: (value, expires_at unix seconds)."""
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"expires_after.seconds must be {MIN_TTL_S}..{MAX_TTL_S}")
        now = self.clock()
        self._ephemeral = {k: v for k, v in self._ephemeral.items() if v.expires_at > now}
        while len(self._ephemeral) >= _MAX_LIVE_KEYS:
            del self._ephemeral[next(iter(self._ephemeral))]
        public, secret = secrets.token_hex(8), secrets.token_hex(16)
        if self._prefix:
            public = f"{self._prefix}.{public}"
        expires_at = int(now) + ttl_s
        self._ephemeral[public] = _Ephemeral(secret, expires_at, session)
        return f"{EPHEMERAL_PREFIX}{public}_{secret}", expires_at


def bearer_token(headers: Any) -> Optional[str]:
    """The key from `Authorization: Bearer …` or from the browser WebSocket subprotocol."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    for proto in headers.get("Sec-WebSocket-Protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(_WS_KEY_PROTOCOL):
            return proto[len(_WS_KEY_PROTOCOL) :] or None
    return None
