"""Hostile WebRTC signalling never takes the agent down.

Pins, against a real agent (tiny model) on both offer routes (`POST /v1/realtime/calls`, what
the page and the SDKs use, and the older `POST /v1/realtime`): no body, a non-JSON or JSON
body, a wrong content type, a body over the size limit (declared or chunked), a multipart
without `sdp`, garbage SDP, SDP with no audio, only video, 20 media sections, unsupported
codecs only, an SDP answer instead of an offer, an offer with its DTLS role taken, media
sections not bundled, no usable certificate fingerprint, a multipart part with a malformed
header -> each a 4xx with a JSON reason and no
traceback, and the server still answers a real offer afterwards. Then a property-based fuzz
(hypothesis, a bounded number of examples) of the same endpoint with mutated offers and
random bodies: never a 5xx, always JSON on refusal, no session left behind. An API path or
method no route serves is a JSON 404 or 405 naming the methods served. Each test prints
what it tried.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.realtime_helpers import offer_sdp, start_agent, wait_no_sessions

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROUTES = ("/v1/realtime/calls", "/v1/realtime")
FUZZ_EXAMPLES = 150


async def _answer_to(offer: str) -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    from aiortc import RTCSessionDescription

    await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
    pc.addTrack(AudioStreamTrack())
    await pc.setLocalDescription(await pc.createAnswer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(tiny_model_dir: Path):
    running = await start_agent(tiny_model_dir, max_sessions=4, connect_timeout_s=2.0)
    offer = await offer_sdp(video=True)
    yield running, offer
    await running.stop()


def _bodies(offer: str, audio_only: str, answer: str) -> list[tuple[str, bytes, str, int]]:
    """(what, body, content type, expected status)."""
    head, *media = re.split(r"(?=^m=)", audio_only, flags=re.M)
    audio = next(m for m in media if m.startswith("m=audio"))
    twenty = head + "".join(audio.replace("a=mid:0", f"a=mid:{i + 10}") for i in range(20))
    no_audio = head + "".join(m for m in re.split(r"(?=^m=)", offer, flags=re.M)[1:] if not m.startswith("m=audio"))
    only_video = head + "".join(m for m in re.split(r"(?=^m=)", offer, flags=re.M)[1:] if m.startswith("m=video"))
    bad_codecs = re.sub(r"(a=rtpmap:\d+ )(opus|G722|PCMU|PCMA)/", r"\1X-NOPE/", audio_only)
    bad_codecs = re.sub(r"^(m=audio \d+ \S+) .*$", r"\1 96 9 97 98", bad_codecs, flags=re.M)
    multipart = b'--b\r\nContent-Disposition: form-data; name="session"\r\n\r\n{"type": "realtime"}\r\n--b--\r\n'
    no_fingerprint = re.sub(r"^a=fingerprint:.*\r?\n", "", offer, flags=re.M)
    bad_fingerprint = re.sub(r"^a=fingerprint:(\S+) .*$", r"a=fingerprint:\1 ZZ", offer, flags=re.M)
    bad_header = b"--b\r\ngarbage no headers\r\n\r\nx\r\n--b--\r\n"
    unbundled = re.sub(r"^a=group:BUNDLE.*\r?\n", "", offer, flags=re.M)  # aiortc would bundle it anyway
    active = offer.replace("a=setup:actpass", "a=setup:active")  # an offer with the role taken
    bad_session = (
        b'--b\r\nContent-Disposition: form-data; name="sdp"\r\n\r\n'
        + offer.encode()
        + b'\r\n--b\r\nContent-Disposition: form-data; name="session"\r\n\r\n{nope\r\n--b--\r\n'
    )
    return [
        ("no body", b"", "application/sdp", 400),
        ("non-JSON as JSON", b"{this is not json", "application/json", 415),
        ("JSON without sdp", b'{"type": "offer"}', "application/json", 415),
        ("an offer as JSON", offer.encode(), "application/json", 415),
        ("form-encoded", b"sdp=v%3D0", "application/x-www-form-urlencoded", 415),
        ("over the size limit", b"v=0\r\n" + b"a=x\r\n" * 14_000, "application/sdp", 413),
        ("multipart without sdp", multipart, "multipart/form-data; boundary=b", 400),
        ("multipart, session not JSON", bad_session, "multipart/form-data; boundary=b", 400),
        ("multipart, no boundary", multipart, "multipart/form-data", 400),
        ("garbage SDP", b"garbage", "application/sdp", 400),
        ("SDP header only", b"v=0\r\n", "application/sdp", 400),
        ("not UTF-8", bytes(range(256)) * 4, "application/sdp", 400),
        ("no audio m-line", no_audio.encode(), "application/sdp", 400),
        ("only video", only_video.encode(), "application/sdp", 400),
        ("20 m-lines", twenty.encode(), "application/sdp", 400),
        ("unsupported codecs only", bad_codecs.encode(), "application/sdp", 400),
        ("an answer instead of an offer", answer.encode(), "application/sdp", 400),
        ("no a=fingerprint (could never connect)", no_fingerprint.encode(), "application/sdp", 400),
        ("a fingerprint not hex", bad_fingerprint.encode(), "application/sdp", 400),
        ("multipart, a part's header malformed", bad_header, "multipart/form-data; boundary=b", 400),
        ("media sections not bundled (the data channel would never open)", unbundled.encode(), "application/sdp", 400),
        ("a=setup:active in an offer", active.encode(), "application/sdp", 400),
    ]


async def _refused_cleanly(http: aiohttp.ClientSession, resp: aiohttp.ClientResponse) -> dict:
    body = await resp.text()
    assert "Traceback" not in body and 'File "' not in body, body[:500]
    assert resp.content_type == "application/json", f"{resp.status} {resp.content_type}: {body[:200]}"
    error = (await resp.json())["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str)
    return error


async def test_routes_not_served_answer_json(agent) -> None:
    """An API path or method nothing serves is a JSON 404 or 405 (with Allow), never the page's
    empty file 404; the page's own files are still served."""
    running, _ = agent
    cases = [
        ("GET", "/v1/realtime/calls", 405, "POST"),
        ("GET", "/v1/realtime/client_secrets", 405, "POST"),
        ("PUT", "/v1/realtime/calls", 405, "POST"),
        ("GET", "/v1/realtime/calls/rtc_x/hangup", 405, "POST"),
        ("GET", "/v1/nothing/here", 404, None),
        ("POST", "/v1/nothing/here", 404, None),
        ("POST", "/healthz", 405, "GET, HEAD"),
        ("POST", "/metrics", 405, "GET, HEAD"),
    ]
    async with aiohttp.ClientSession() as http:
        for method, path, status, allow in cases:
            async with http.request(method, running.url + path) as resp:
                assert (resp.status, resp.headers.get("Allow")) == (status, allow), f"{method} {path}"
                error = await _refused_cleanly(http, resp)
                print(f"  {method} {path}: {resp.status} {error['code']}")
        async with http.get(running.url + "/") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"


async def test_bad_offers_get_4xx_json_and_the_server_keeps_serving(agent) -> None:
    running, offer = agent
    audio_only = await offer_sdp()
    cases = _bodies(offer, audio_only, await _answer_to(audio_only))
    tried: Counter = Counter()
    async with aiohttp.ClientSession() as http:
        for route in ROUTES:
            for what, body, content_type, status in cases:
                async with http.post(running.url + route, data=body, headers={"Content-Type": content_type}) as resp:
                    assert resp.status == status, f"{route} {what}: {resp.status} {await resp.text()}"
                    error = await _refused_cleanly(http, resp)
                tried[resp.status] += 1
                print(f"  {route} {what}: {resp.status} {error['code']}: {error['message'][:90]}")

            async def chunked():  # no Content-Length: the limit must hold on the bytes read
                for _ in range(40):
                    yield b"a=x" * 1000 + b"\r\n"

            async with http.post(
                running.url + route, data=chunked(), headers={"Content-Type": "application/sdp"}
            ) as resp:
                assert resp.status == 413, await resp.text()
                await _refused_cleanly(http, resp)
                tried[resp.status] += 1
            # Still serving: health, and a real offer is answered.
            async with http.get(f"{running.url}/healthz") as resp:
                assert resp.status == 200
            async with http.post(
                running.url + route, data=audio_only, headers={"Content-Type": "application/sdp"}
            ) as resp:
                assert resp.status == 201, await resp.text()
                location = resp.headers["Location"]
            async with http.delete(running.url + location) as resp:
                assert resp.status == 204
    await wait_no_sessions(running.url, "a refused or hung-up offer kept a session")
    print(
        f"\nsignalling: {sum(tried.values())} bad offers on {len(ROUTES)} routes, statuses {dict(tried)}, "
        f"0 server errors, server still answering"
    )


_CONTENT_TYPES = st.sampled_from(
    [
        "application/sdp",
        "application/sdp",
        "text/plain",
        "application/json",
        "multipart/form-data; boundary=b",
        "image/png",
        "",
    ]
)


@st.composite
def _mutated(draw, offer: str) -> bytes:
    """A real offer with lines dropped, duplicated, swapped or replaced by junk."""
    lines = offer.split("\r\n")
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["drop", "dup", "swap", "junk", "truncate"]))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "junk":
            lines[i] = draw(st.text(max_size=40))
        else:
            lines[i] = lines[i][: draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        if not lines:
            break
    return "\r\n".join(lines).encode("utf-8", "surrogatepass")


def _post(url: str, body: bytes, content_type: str) -> tuple[int, dict, bytes]:
    """A synchronous POST (hypothesis drives a plain function, on a worker thread)."""
    request = urllib.request.Request(url, data=body, method="POST")
    if content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


async def test_fuzzed_offers_never_break_the_server(agent) -> None:
    running, offer = agent
    statuses: Counter = Counter()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        body=st.one_of(_mutated(offer), st.binary(max_size=3000), st.text(max_size=500).map(str.encode)),
        content_type=_CONTENT_TYPES,
        route=st.sampled_from(ROUTES),
    )
    def fuzz(body: bytes, content_type: str, route: str) -> None:
        status, headers, answer = _post(running.url + route, body, content_type)
        statuses[status] += 1
        assert status < 500, f"{status}: {answer[:300]!r} for {body[:300]!r}"
        if status == 201:  # a mutation that is still a fine offer: end that call
            request = urllib.request.Request(running.url + headers["Location"], method="DELETE")
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.status == 204
            return
        assert headers.get("Content-Type", "").startswith("application/json"), (status, answer[:300])
        error = json.loads(answer)["error"]
        assert error["message"] and b"Traceback" not in answer

    # The agent serves on this loop: hypothesis runs on a worker thread meanwhile.
    await asyncio.to_thread(fuzz)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{running.url}/healthz") as resp:
            assert resp.status == 200
    await wait_no_sessions(running.url, "a fuzzed offer left a session behind")
    total = sum(statuses.values())
    print(
        f"\nfuzz: {total} offers, statuses {dict(sorted(statuses.items()))}, "
        f"{sum(n for s, n in statuses.items() if s >= 500)} server errors"
    )
    assert total >= FUZZ_EXAMPLES
