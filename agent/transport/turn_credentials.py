"""Short-lived TURN credentials from a shared secret (`--turn-secret`): the TURN REST scheme.

coturn's `use-auth-secret` / `static-auth-secret` mode (draft-uberti-behave-turn-rest): the
agent and the TURN server share one secret; for each call the agent mints
    username   = "<expiry, unix seconds>:<id>"
    credential = base64(HMAC-SHA1(secret, username))
and the TURN server recomputes the HMAC and refuses a username whose expiry has passed. The
page thus gets a credential that opens allocations for `--turn-ttl` seconds, never the secret.
An allocation made in time outlives the expiry: the server keeps the key for the session.

Which servers get one: a `turn:`/`turns:` URL given by `--ice-server` without a credential of
its own. A TURN server with a static credential (`URL,USER,PASS`) is the agent's alone: that
credential is long-lived, so the page never receives it (docs/ice.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from agent.transport.ice import IceServer

# The draft's own bound is a day; a longer-lived credential is a long-term password in disguise.
MAX_TTL_S = 86_400
_TURN = ("turn:", "turns:")
# The id part of minted usernames: the TURN server's logs and quotas tell the two sides apart.
AGENT_USER = "omni-agent"
PAGE_USER = "omni-page"


@dataclass(frozen=True)
class TurnCredential:
    username: str
    credential: str = field(repr=False)
    expires_at: int  # unix seconds, the number the username starts with


def is_turn(url: str) -> bool:
    return url.startswith(_TURN)


def needs_minting(server: IceServer) -> bool:
    """A TURN server named without a credential: its credential comes from the shared secret."""
    return is_turn(server.url) and not server.credential


def mint(secret: str, ttl_s: int, user: str, now: float) -> TurnCredential:
    """A credential valid until `now + ttl_s` for the TURN user id `user` (which, the TURN
    server being told only the username, labels its logs and per-user quotas)."""
    if not secret:
        raise ValueError("minting TURN credentials needs the shared secret (--turn-secret)")
    if ":" in user:
        raise ValueError(f"a TURN user id may not contain ':' (the username's separator): {user!r}")
    expires_at = int(now) + ttl_s
    username = f"{expires_at}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return TurnCredential(username, base64.b64encode(digest).decode("ascii"), expires_at)


def check_turn_settings(servers: tuple[IceServer, ...], secret: str, ttl_s: int) -> None:
    """Refuse, at start-up, settings that could never mint: a bare TURN URL with no secret
    (the call would fail later, far from the cause) or a TTL out of range. Raises ValueError."""
    bare = [s.url for s in servers if needs_minting(s)]
    if bare and not secret:
        raise ValueError(
            f"TURN server {bare[0]} has no credential: give URL,USERNAME,CREDENTIAL or a shared "
            "secret with --turn-secret (or $OMNI_AGENT_TURN_SECRET)"
        )
    if not 1 <= ttl_s <= MAX_TTL_S:
        raise ValueError(f"--turn-ttl must be 1..{MAX_TTL_S} seconds, got {ttl_s}")


def with_credentials(
    servers: tuple[IceServer, ...], secret: str, ttl_s: int, user: str, now: float
) -> tuple[IceServer, ...]:
    """The agent's own servers for one peer: every bare TURN URL with a fresh credential, the
    others as given (one coturn config then serves the agent and the page alike)."""
    cred = mint(secret, ttl_s, user, now) if any(needs_minting(s) for s in servers) else None
    return tuple(IceServer(s.url, cred.username, cred.credential) if cred and needs_minting(s) else s for s in servers)


def browser_ice_servers(
    servers: tuple[IceServer, ...], secret: str, ttl_s: int, user: str, now: float, *, with_turn: bool = True
) -> list[dict[str, Any]]:
    """The list for the page's `new RTCPeerConnection({iceServers})`, in the browser's
    RTCIceServer shape: STUN servers as they are, bare TURN URLs with one freshly minted
    credential (left out when `with_turn` is False: the caller has no key), static-credential
    TURN servers never."""
    out: list[dict[str, Any]] = [{"urls": s.url} for s in servers if not is_turn(s.url)]
    minted = [s.url for s in servers if needs_minting(s)]
    if minted and with_turn:
        cred = mint(secret, ttl_s, user, now)
        # One entry with every URL: the browser then tries them with one credential, as the
        # server sees one user.
        out.append({"urls": minted, "username": cred.username, "credential": cred.credential})
    return out
