"""Who can reach what: static files stay inside web/, CORS only when asked, a per-address call rate.

Pins, against a real agent (tiny model) on loopback: requests that try to leave web/ (`../`,
percent-encoded `..%2f` and `%2e%2e`, double-encoded, backslashes, absolute paths, a symlink
inside web/ that points outside) never return a file from outside it; with no `--cors-origin`
no response carries CORS headers and preflights are not answered; with one, that origin (only)
gets them, on preflights (the request headers SDKs add are allowed, when they are header
names) and on replies; a client address that opens calls faster than
`--max-calls-per-minute` gets 429 with Retry-After and a JSON reason, on WebRTC and WebSocket
alike, while its calls within the limit are answered. `--ice-server` parsing: STUN, TURN with
credentials, refused forms (a bare TURN URL needs `--turn-secret`); the peer configuration
carries exactly those servers.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest
from support.realtime_helpers import offer_sdp, start_agent

from agent.flags import add_serve_arguments, config_from_args
from agent.transport.ice import IceServer, parse_ice_server, rtc_configuration

SECRET = "top-secret-outside-web"


def _raw_get(port: int, target: str) -> tuple[int, bytes]:
    """GET with the request target sent exactly as written (clients normalise `..` away)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[-1]


@pytest.fixture
def web_dir(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    web = root / "web"
    web.mkdir(parents=True)
    (web / "index.html").write_text("<h1>agent</h1>")
    (web / "client.js").write_text("// page")
    (root / "secret.txt").write_text(SECRET)
    (web / "link.txt").symlink_to(root / "secret.txt")
    (web / "linkdir").symlink_to(root)
    return web


async def test_static_files_cannot_leave_web(tiny_model_dir: Path, web_dir: Path) -> None:
    running = await start_agent(tiny_model_dir, web_dir=web_dir)
    port = running.config.port
    attempts = [
        "/../secret.txt",
        "/..%2fsecret.txt",
        "/%2e%2e/secret.txt",
        "/%2e%2e%2fsecret.txt",
        "/%252e%252e%252fsecret.txt",
        "/..\\secret.txt",
        "/..%5csecret.txt",
        "/client.js/../../secret.txt",
        "/./../secret.txt",
        "//../secret.txt",
        "/link.txt",
        "/linkdir/secret.txt",
        "/%2Fetc%2Fpasswd",
        "/../../../../../../etc/passwd",
        "/static/../../secret.txt",
    ]
    try:
        loop = asyncio.get_running_loop()
        statuses = []
        for target in attempts:
            status, body = await loop.run_in_executor(None, _raw_get, port, target)
            statuses.append(status)
            assert SECRET.encode() not in body and b"root:" not in body, f"{target} leaked: {status}"
            assert status in (400, 403, 404), f"{target}: {status}"
        ok, body = await loop.run_in_executor(None, _raw_get, port, "/client.js")
        assert ok == 200 and body == b"// page"
    finally:
        await running.stop()
    print(f"\ntraversal: {len(attempts)} paths tried, statuses {sorted(set(statuses))}, 0 files from outside web/")


async def test_no_cors_unless_asked(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir)
    preflight = {
        "Origin": "https://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    try:
        async with aiohttp.ClientSession() as http:
            async with http.options(f"{running.url}/v1/realtime/calls", headers=preflight) as resp:
                assert "Access-Control-Allow-Origin" not in resp.headers and resp.status >= 400
            async with http.get(f"{running.url}/v1/omni/config", headers={"Origin": "https://evil.example"}) as resp:
                assert resp.status == 200 and not [h for h in resp.headers if h.lower().startswith("access-control")]
    finally:
        await running.stop()


async def test_cors_for_the_named_origin_only(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir, cors_origins=("https://app.example",), api_key="k")
    try:
        async with aiohttp.ClientSession() as http:
            good = {
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            async with http.options(f"{running.url}/v1/realtime/calls", headers=good) as resp:
                assert resp.status == 204  # answered before the key check: preflights carry no key
                assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert "POST" in resp.headers["Access-Control-Allow-Methods"]
                assert "authorization" in resp.headers["Access-Control-Allow-Headers"].lower()
            # The headers SDKs add are allowed too (a fixed list would fail every call they make);
            # what is not a header name is not echoed.
            sdk = {**good, "Access-Control-Request-Headers": "authorization, x-openai-agents-sdk, x-stainless-os, a b"}
            async with http.options(f"{running.url}/v1/realtime/calls", headers=sdk) as resp:
                allowed = [h.strip().lower() for h in resp.headers["Access-Control-Allow-Headers"].split(",")]
                assert resp.status == 204 and {"x-openai-agents-sdk", "x-stainless-os"} <= set(allowed)
                assert "a b" not in allowed and allowed.count("authorization") == 1
            async with http.options(
                f"{running.url}/v1/realtime/calls", headers={**good, "Origin": "https://evil.example"}
            ) as resp:
                assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
                assert (await resp.json())["error"]["code"] == "cors_forbidden"
            # Replies carry the header for the allowed origin, errors included (so the page can read them).
            async with http.post(
                f"{running.url}/v1/realtime/calls",
                data=b"v=0",
                headers={"Origin": "https://app.example", "Content-Type": "application/sdp"},
            ) as resp:
                assert resp.status == 401
                assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
            async with http.get(f"{running.url}/v1/omni/config", headers={"Origin": "https://evil.example"}) as resp:
                assert "Access-Control-Allow-Origin" not in resp.headers
    finally:
        await running.stop()


async def test_calls_per_minute_per_address(tiny_model_dir: Path) -> None:
    running = await start_agent(tiny_model_dir, max_calls_per_minute=3, max_sessions=8)
    offer = await offer_sdp()
    statuses = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                async with http.post(
                    f"{running.url}/v1/realtime/calls", data=offer, headers={"Content-Type": "application/sdp"}
                ) as resp:
                    statuses.append(resp.status)
                    if resp.status == 201:
                        async with http.delete(running.url + resp.headers["Location"]) as gone:
                            assert gone.status == 204
                    else:
                        refused = resp
                        body = await resp.json()
            assert statuses == [201, 201, 201, 429], statuses
            assert body["error"]["code"] == "rate_limited" and "a minute" in body["error"]["message"]
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            # The WebSocket transport counts against the same limit.
            async with http.get(f"{running.url}/v1/realtime?model=x") as resp:
                assert resp.status == 429 and (await resp.json())["error"]["code"] == "rate_limited"
            # A refused offer is not a bad one: bad input is still told apart (400), not counted.
            async with http.post(
                f"{running.url}/v1/realtime/calls", data=b"garbage", headers={"Content-Type": "application/sdp"}
            ) as resp:
                assert resp.status == 400
    finally:
        await running.stop()
    print(f"\ncall rate: 4 offers at a limit of 3 a minute: {statuses}, then WebSocket 429")


def test_ice_server_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args(
        [
            "--ice-server",
            "stun:stun.example.com:3478",
            "--ice-server",
            "turn:turn.example.com:3478?transport=udp,alice,s3cret",
            "--cors-origin",
            "https://app.example",
        ]
    )
    config = config_from_args(ns)
    assert config.ice_servers == (
        IceServer("stun:stun.example.com:3478"),
        IceServer("turn:turn.example.com:3478?transport=udp", "alice", "s3cret"),
    )
    assert "s3cret" not in repr(config)
    assert config.cors_origins == ("https://app.example",)
    servers = rtc_configuration(config.ice_servers).iceServers
    assert [(s.urls, s.username, s.credential) for s in servers] == [
        ("stun:stun.example.com:3478", None, None),
        ("turn:turn.example.com:3478?transport=udp", "alice", "s3cret"),
    ]
    assert rtc_configuration(()).iceServers == []  # never aiortc's default public STUN server
    for bad in ("http://turn.example.com", "turn:t.example.com,alice", "turn:t.example.com,alice,", "stun:"):
        with pytest.raises(ValueError):
            parse_ice_server(bad)
        with pytest.raises(SystemExit):
            parser.parse_args(["--ice-server", bad])
    # A TURN URL alone parses (its credentials would be minted from --turn-secret), but without
    # a secret the configuration is refused.
    with pytest.raises(ValueError, match="--turn-secret"):
        config_from_args(parser.parse_args(["--ice-server", "turn:turn.example.com"]))
