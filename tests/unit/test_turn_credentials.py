"""TURN REST credentials (`--turn-secret`) and the ICE servers the page is handed.

Pins: a minted credential is the draft-uberti-behave-turn-rest / coturn `use-auth-secret` one
(username `<expiry>:<id>`, credential base64(HMAC-SHA1(secret, username)), recomputed here from
the formula) and expires the TTL after minting; the agent's own servers get a minted credential
for bare TURN URLs and keep static ones; the page's list has STUN as given, bare TURN URLs with
a minted credential (only with a key when the agent wants one), and never a static TURN
credential; a bare TURN URL without a secret, or a TTL out of range, is refused at start-up
(Config and the command line). GET /v1/omni/config (the handler on an app of its own): the
shared secret never appears in its JSON, the credential expires the TTL after the request, no
caching, a wrong key is a 401 with a JSON reason, without a key a keyed agent lists STUN only and
says so, and with the API key or an ek_ key it adds the TURN credential.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import time
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from agent.config import Config
from agent.engine.api import Voices
from agent.flags import add_serve_arguments, config_from_args
from agent.gate.api_keys import KeyStore
from agent.server import omni_config
from agent.transport.http import CONFIG, ENGINE, KEYS
from agent.transport.ice import IceServer, parse_ice_server
from agent.transport.turn_credentials import browser_ice_servers, mint, with_credentials

SECRET = "coturn-static-auth-secret-for-tests"
STUN = IceServer("stun:stun.example.com:3478")
BARE_TURN = IceServer("turn:turn.example.com:3478?transport=udp")
BARE_TURNS = IceServer("turns:turn.example.com:5349?transport=tcp")
STATIC_TURN = IceServer("turn:static.example.com:3478", "alice", "long-term-password")


def expected_credential(secret: str, username: str) -> str:
    """The formula from the draft, written out independently of the agent's code."""
    return base64.b64encode(hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()).decode()


def test_minted_credential_is_the_turn_rest_hmac() -> None:
    now = 1_700_000_000.75
    cred = mint(SECRET, 600, "omni-page", now)
    assert cred.username == f"{int(now) + 600}:omni-page"
    assert cred.expires_at == int(now) + 600
    assert cred.credential == expected_credential(SECRET, cred.username)
    assert cred.credential != expected_credential("another-secret", cred.username)
    assert SECRET not in repr(cred) and cred.credential not in repr(cred)


def test_expiry_is_the_ttl_after_minting() -> None:
    for ttl in (1, 600, 3600):
        before = time.time()
        cred = mint(SECRET, ttl, "omni-agent", time.time())
        after = time.time()
        expiry = int(cred.username.split(":", 1)[0])
        assert expiry == cred.expires_at
        assert int(before) + ttl <= expiry <= after + ttl  # in the future by the TTL, to the second


def test_mint_refuses_what_coturn_could_not_read() -> None:
    with pytest.raises(ValueError, match="turn-secret"):
        mint("", 600, "omni-page", time.time())
    with pytest.raises(ValueError, match="':'"):
        mint(SECRET, 600, "a:b", time.time())


def test_agent_side_mints_for_bare_turn_and_keeps_static() -> None:
    now = time.time()
    servers = with_credentials((STUN, BARE_TURN, STATIC_TURN, BARE_TURNS), SECRET, 600, "omni-agent", now)
    stun, turn, static, turns = servers
    assert stun == STUN and static == STATIC_TURN
    assert turn.url == BARE_TURN.url and turn.username.endswith(":omni-agent")
    assert turn.credential == expected_credential(SECRET, turn.username)
    assert (turns.username, turns.credential) == (turn.username, turn.credential)
    # Nothing to mint: no secret needed, the servers come back as they are.
    assert with_credentials((STUN, STATIC_TURN), "", 600, "omni-agent", now) == (STUN, STATIC_TURN)


def test_page_list_has_stun_and_minted_turn_never_static_turn() -> None:
    now = time.time()
    page = browser_ice_servers((STUN, BARE_TURN, STATIC_TURN, BARE_TURNS), SECRET, 600, "omni-page", now)
    assert page[0] == {"urls": STUN.url}
    assert len(page) == 2
    turn = page[1]
    assert turn["urls"] == [BARE_TURN.url, BARE_TURNS.url]
    assert turn["username"].endswith(":omni-page")
    assert turn["credential"] == expected_credential(SECRET, turn["username"])
    flat = repr(page)
    assert SECRET not in flat and STATIC_TURN.credential not in flat and STATIC_TURN.url not in flat
    # Without a key (the agent wants one): STUN only.
    assert browser_ice_servers((STUN, BARE_TURN), SECRET, 600, "omni-page", now, with_turn=False) == [
        {"urls": STUN.url}
    ]


def test_bare_turn_needs_a_secret_at_start_up() -> None:
    with pytest.raises(ValueError, match="--turn-secret"):
        Config(ice_servers=(BARE_TURN,))
    with pytest.raises(ValueError, match="--turn-ttl"):
        Config(ice_servers=(BARE_TURN,), turn_secret=SECRET, turn_ttl_s=0)
    assert Config(ice_servers=(BARE_TURN,), turn_secret=SECRET).turn_ttl_s == 600
    assert Config(ice_servers=(STUN, STATIC_TURN)).ice_servers == (STUN, STATIC_TURN)
    assert SECRET not in repr(Config(ice_servers=(BARE_TURN,), turn_secret=SECRET))
    assert parse_ice_server(BARE_TURN.url) == BARE_TURN  # the URL alone parses; Config judges


def test_command_line_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_AGENT_TURN_SECRET", raising=False)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = ["--ice-server", BARE_TURN.url, "--turn-secret", SECRET, "--turn-ttl", "120"]
    config = config_from_args(parser.parse_args(flags))
    assert (config.ice_servers, config.turn_secret, config.turn_ttl_s) == ((BARE_TURN,), SECRET, 120)
    with pytest.raises(ValueError, match="--turn-secret"):
        config_from_args(parser.parse_args(["--ice-server", BARE_TURN.url]))
    # The secret may come from the environment instead of the command line (and `ps`).
    monkeypatch.setenv("OMNI_AGENT_TURN_SECRET", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args(["--ice-server", BARE_TURN.url])).turn_secret == "from-env"


async def _get_config(
    config: Config, headers: dict[str, str] | None = None, keys: KeyStore | None = None
) -> tuple[int, dict, dict]:
    app = web.Application()
    app[CONFIG] = config
    app[KEYS] = keys or KeyStore(config.api_key)
    app[ENGINE] = SimpleNamespace(voices=Voices())  # the endpoint reads only the engine's voices
    app.router.add_get("/v1/omni/config", omni_config)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.get("/v1/omni/config", headers=headers or {})
        return resp.status, await resp.json(), dict(resp.headers)


async def test_config_endpoint_hands_out_credentials_never_the_secret() -> None:
    config = Config(ice_servers=(STUN, BARE_TURN, STATIC_TURN), turn_secret=SECRET, turn_ttl_s=300)
    status, body, headers = await _get_config(config)
    assert status == 200 and body["auth_required"] is False and body["turn_needs_key"] is False
    assert "no-store" in headers["Cache-Control"]
    raw = repr(body)
    assert SECRET not in raw and STATIC_TURN.credential not in raw
    stun, turn = body["ice_servers"]
    assert stun == {"urls": STUN.url}
    assert turn["urls"] == [BARE_TURN.url]
    assert turn["credential"] == expected_credential(SECRET, turn["username"])
    assert 0 < int(turn["username"].split(":")[0]) - time.time() <= 300


async def test_config_endpoint_with_an_api_key() -> None:
    config = Config(ice_servers=(STUN, BARE_TURN), turn_secret=SECRET, api_key="sk-test")
    status, body, _ = await _get_config(config)  # the page's first look, before it has a key
    assert status == 200 and body["auth_required"] is True and body["turn_needs_key"] is True
    assert body["ice_servers"] == [{"urls": STUN.url}]
    status, body, _ = await _get_config(config, {"Authorization": "Bearer sk-wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    keys = KeyStore(config.api_key)
    ek, _ = keys.mint(60, {})  # what the page holds once it has minted its call's key
    for key in ("sk-test", ek):
        status, body, _ = await _get_config(config, {"Authorization": f"Bearer {key}"}, keys)
        assert status == 200 and body["turn_needs_key"] is False
        turn = body["ice_servers"][1]
        assert turn["credential"] == expected_credential(SECRET, turn["username"]) and SECRET not in repr(body)
