"""Headless Chromium holds a real call with the agent through web/, on loopback only, over
the OpenAI Realtime API (GA) protocol the page speaks.

What it pins, end to end (`python -m agent serve` with the tiny model as a subprocess,
Debian's Chromium driven by Playwright, a fake mic playing espeak-ng speech and a fake
camera playing a synthetic y4m):
- the page signals with one raw-SDP POST to /v1/realtime/calls (201, Location naming an
  rtc_ call), its RTCPeerConnection reaches "connected" and its status line says so;
- events arrive on the client-created "oai-events" channel; the page's session.update is
  answered by session.updated; the agent's words arrive as
  response.output_audio_transcript.delta and appear in the caption overlay; response.done's
  `omni` figures fill the TTFT/TTFA readout;
- the agent's voice arrives and is audible: inbound-rtp audio packetsReceived > 0 and
  totalAudioEnergy > 0, and the page's own analyser measured speech_stopped -> audible;
- the page asked the camera sender for 4 fps (RTCRtpSender.setParameters);
- Stop hangs up with DELETE on the call's Location (204);
- a refused offer (the server's 4xx JSON error) is shown to the user, not swallowed;
- against a server started with --api-key, the page shows its key field, tells the user a
  key is needed when none is given, and with the key mints an ek_ key on its own origin and
  signals with it (the API key itself never goes to /v1/realtime/calls).
A screenshot of the live call goes to the test's tmp_path and to test-output/browser/page.png.

Network rule: Chromium gathers every interface's address and aiortc probes whatever the
browser offers, so these tests only run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up && pytest -m browser'
Outside one they skip rather than send a packet beyond 127.0.0.0/8.
"""

from __future__ import annotations

import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
CALL_TIMEOUT_S = 90
SERVER_START_TIMEOUT_S = 120

# The flags FACTS.md found to work headless. The fake-capture files are appended per launch.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
]

# One atomic look at the page: everything the assertions need, read in a single evaluate
# so the captions, events and stats describe the same moment.
SNAPSHOT_JS = """async () => {
  const o = window.omni;
  const byType = (t) => o.events.filter((e) => e.type === t);
  const text = (id) => document.getElementById(id).innerText.trim();
  const done = byType("response.done");
  const s = {
    state: o.state, statusText: text("state-text"), channel: o.channel?.label ?? null, callUrl: o.callUrl,
    deltas: byType("response.output_audio_transcript.delta").length + byType("response.output_text.delta").length,
    updated: byType("session.updated").length,
    dones: done.length, lastDone: done.at(-1) ?? null, errors: byType("error"),
    caption: text("captions"), errorBox: document.getElementById("error").hidden ? "" : text("error"),
    ttftText: text("ttft"), ttfaText: text("ttfa"), latency: o.latency,
    audioPackets: 0, audioEnergy: 0, videoFpsCap: null,
  };
  if (o.pc) {
    (await o.pc.getStats()).forEach((r) => {
      if (r.type === "inbound-rtp" && r.kind === "audio") {
        s.audioPackets = r.packetsReceived ?? 0;
        s.audioEnergy = r.totalAudioEnergy ?? 0;
      }
    });
    const video = o.pc.getSenders().find((x) => x.track && x.track.kind === "video");
    if (video) s.videoFpsCap = video.getParameters().encodings[0]?.maxFramerate ?? null;
  }
  return s;
}"""


# ---- helpers (plain functions, so they can also drive a stand-in server by hand) -----------


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_fake_mic(speech_wav: Path, out: Path, silence_s: float = 3.0) -> Path:
    """48 kHz copy of the speech plus trailing silence: Chromium loops the file, and the
    silence is what lets the agent's endpointer see an end of turn before the next loop."""
    subprocess.run(
        ["sox", str(speech_wav), "-r", "48000", "-c", "1", "-b", "16", str(out), "pad", "0", str(silence_s)],
        check=True,
    )
    return out


def make_fake_camera(out: Path, width: int = 320, height: int = 240, frames: int = 20) -> Path:
    """A y4m (4:2:0) clip: drifting colour gradient with a white square crossing it."""
    yy, xx = np.mgrid[0:height, 0:width]
    cy, cx = np.mgrid[0 : height // 2, 0 : width // 2]
    with open(out, "wb") as f:
        f.write(f"YUV4MPEG2 W{width} H{height} F15:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(frames):
            luma = (40 + ((xx + yy + 6 * i) % 160)).astype(np.uint8)
            x0 = int(i * (width - 64) / max(frames - 1, 1))
            luma[height // 2 - 32 : height // 2 + 32, x0 : x0 + 64] = 235
            u = (128 + 60 * np.sin((cx + 4 * i) / 20)).astype(np.uint8)
            v = (128 + 60 * np.cos((cy + 4 * i) / 15)).astype(np.uint8)
            f.write(b"FRAME\n" + luma.tobytes() + u.tobytes() + v.tobytes())
    return out


def start_server(cmd: list[str], base_url: str, log_path: Path) -> subprocess.Popen:
    """Start the server and wait until GET /healthz answers 200 (it loads the model first)."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(base_url + "healthz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"no 200 from /healthz in {SERVER_START_TIMEOUT_S} s:\n{tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, n: int = 4000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace") if path.exists() else ""


def launch_chromium(playwright, fake_mic: Path, fake_camera: Path):
    return playwright.chromium.launch(
        executable_path=shutil.which("chromium"),
        headless=True,
        args=CHROMIUM_FLAGS
        + [f"--use-file-for-fake-audio-capture={fake_mic}", f"--use-file-for-fake-video-capture={fake_camera}"],
    )


def js_ms(value) -> str:
    """The page's ms() formatter: Math.round (halves go up) then ' ms'."""
    return f"{math.floor(value + 0.5)} ms" if isinstance(value, (int, float)) else "–"


def drive_call(page, base_url: str, out_dir: Path, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """Open the page, press Start, and wait until every sign of a working call has been seen.

    The fake mic loops, so a new speech_started clears the captions every few seconds: each
    condition is latched when first seen, and the screenshot waits for a moment when the
    captions are on screen again.
    """
    page.goto(base_url)
    page.get_by_role("button", name="Start the call").click()
    need = ["connected", "session.updated", "transcript delta", "caption", "audio packets", "audio energy",
            "response.done", "audible"]
    seen: dict[str, dict] = {}
    snap: dict = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = page.evaluate(SNAPSHOT_JS)
        assert not snap["errors"], f"agent sent error events: {snap['errors']}"
        assert snap["state"] not in ("failed", "closed"), f"call {snap['state']}: {snap['errorBox']}"
        checks = {
            "connected": snap["state"] == "connected" and snap["statusText"] == "connected",
            "session.updated": snap["updated"] > 0,
            "transcript delta": snap["deltas"] > 0,
            "caption": bool(snap["caption"]),
            "audio packets": snap["audioPackets"] > 0,
            "audio energy": snap["audioEnergy"] > 0,
            "response.done": snap["dones"] > 0,
            "audible": (snap["latency"].get("eot_to_audible_ms") or 0) > 0,
        }
        for name, ok in checks.items():
            if ok and name not in seen:
                seen[name] = snap
        if len(seen) == len(need) and snap["caption"] and snap["state"] == "connected":
            shot = out_dir / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            snap["screenshot"] = shot
            return snap
        time.sleep(0.2)
    missing = [n for n in need if n not in seen]
    page.screenshot(path=str(out_dir / "page-timeout.png"), full_page=True)
    raise AssertionError(f"after {timeout_s} s still missing {missing}; last snapshot: {snap}")


def hang_up(page) -> dict:
    """Press Stop and return the DELETE the page sent to the call's Location."""
    with page.expect_response(lambda r: r.request.method == "DELETE") as response_info:
        page.get_by_role("button", name="Stop the call").click()
    response = response_info.value
    return {"url": response.url, "status": response.status, "state": page.evaluate("window.omni.state")}


def drive_refused_offer(page, base_url: str) -> dict:
    """Press Start while the browser mangles the SDP offer into garbage on its way out:
    the real server refuses it, and the page must tell the user so."""
    page.route("**/v1/realtime/calls", lambda route: route.continue_(post_data="this is not an SDP offer"))
    page.goto(base_url)
    with page.expect_response("**/v1/realtime/calls") as response_info:
        page.get_by_role("button", name="Start the call").click()
    response = response_info.value
    error_box = page.get_by_role("alert")
    error_box.wait_for(state="visible", timeout=10_000)
    page.wait_for_function("window.omni.state === 'failed'", timeout=10_000)
    return {
        "status": response.status,
        "body": response.json(),
        "error_text": error_box.inner_text(),
        "start_enabled": page.get_by_role("button", name="Start the call").is_enabled(),
    }


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _require_loopback_namespace():
    if not loopback_only():
        pytest.skip("browser tests send ICE checks to every interface: run them inside "
                    "`unshare -n sh -c 'ip link set lo up && pytest -m browser'`")
    if shutil.which("chromium") is None or shutil.which("sox") is None:
        pytest.skip("needs Debian's chromium and sox (apt-get install chromium sox)")


def serve(tiny_model_dir: Path, log_dir: Path, *extra: str):
    """The agent on a free loopback port; yields its base URL and stops it afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, "-m", "agent", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--ice-host", "127.0.0.1", "--model", str(tiny_model_dir), *extra]
    proc = start_server(cmd, url, log_dir / "server.log")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def agent_url(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("server"))


API_KEY = "sk-test-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def keyed_agent_url(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("keyed-server"), "--api-key", API_KEY)


@pytest.fixture(scope="module")
def chromium(speech_wav, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    media = tmp_path_factory.mktemp("fake-media")
    mic = make_fake_mic(speech_wav, media / "mic.wav")
    camera = make_fake_camera(media / "camera.y4m")
    with sync_playwright() as p:
        browser = launch_chromium(p, mic, camera)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium):
    context = chromium.new_context(viewport={"width": 820, "height": 1000})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    yield page
    context.close()
    assert not page_errors, f"uncaught errors in the page: {page_errors}"


# ---- tests -------------------------------------------------------------------------------


def test_call_shows_captions_and_plays_the_agents_voice(page, agent_url, tmp_path):
    snap = drive_call(page, agent_url, tmp_path)

    assert snap["channel"] == "oai-events"
    assert re.fullmatch(re.escape(agent_url) + r"v1/realtime/calls/rtc_[0-9a-f]{24}", snap["callUrl"] or ""), snap
    assert snap["videoFpsCap"] == 4, "the camera sender was not capped at 4 fps"
    figures = snap["lastDone"]["response"]["omni"]
    assert snap["ttftText"] == js_ms(figures.get("ttft_ms")) and snap["ttfaText"] == js_ms(figures.get("ttfa_ms"))

    keep = REPO / "test-output" / "browser" / "page.png"
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(snap["screenshot"], keep)
    print(f"\nscreenshot: {snap['screenshot']} (copy: {keep})")
    print(f"caption: {snap['caption']!r}; latency: {snap['latency']}; "
          f"audio packets {snap['audioPackets']}, energy {snap['audioEnergy']:.4f}")

    hung = hang_up(page)
    assert hung["url"] == snap["callUrl"] and hung["status"] == 204, hung
    assert hung["state"] == "closed", hung


def test_refused_offer_is_shown_to_the_user(page, agent_url):
    result = drive_refused_offer(page, agent_url)

    assert 400 <= result["status"] < 500, result
    error = result["body"].get("error")
    reason = error.get("message") if isinstance(error, dict) else error
    assert isinstance(reason, str) and reason, result
    assert f"HTTP {result['status']}" in result["error_text"], result
    assert reason in result["error_text"], result
    assert result["start_enabled"], "Start must be usable again after a refused call"


def test_keyed_server_page_mints_an_ephemeral_key(page, keyed_agent_url):
    calls: list[dict] = []
    page.on("request", lambda r: calls.append({"url": r.url, "method": r.method,
                                                "auth": r.headers.get("authorization", "")})
            if "/v1/realtime/calls" in r.url else None)
    page.goto(keyed_agent_url)
    key_field = page.get_by_label("API key")
    key_field.wait_for(state="visible", timeout=10_000)

    # No key: the mint is refused and the page says a key is needed; no call is attempted.
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'failed'", timeout=10_000)
    error_text = page.get_by_role("alert").inner_text()
    assert "HTTP 401" in error_text and "API key" in error_text, error_text
    assert not calls, calls

    # With the key: the page mints an ek_ key and signals with that, never with the API key.
    key_field.fill(API_KEY)
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function(
        "window.omni.state === 'connected' && window.omni.events.some((e) => e.type === 'session.updated')",
        timeout=CALL_TIMEOUT_S * 1000)
    posts = [c for c in calls if c["method"] == "POST"]
    assert len(posts) == 1 and posts[0]["auth"].startswith("Bearer ek_"), calls
    assert API_KEY not in str(calls)

    hung = hang_up(page)
    assert hung["status"] == 204, hung
    assert page.evaluate("window.omni.events.filter((e) => e.type === 'error')") == []
