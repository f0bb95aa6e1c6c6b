"""Browser-test plumbing shared by the e2e modules: the agent as a subprocess (open, and
with --api-key), headless Debian Chromium with a fake mic and camera, and the rule that
these tests only run inside a loopback-only network namespace.

Network rule: Chromium gathers every interface's address and aiortc probes whatever the
browser offers, so these tests only run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up && pytest -m browser'
Outside one they skip rather than send a packet beyond 127.0.0.0/8 (under CI=true they fail).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.loopback import LADDER_OFF_ARGS, free_port

REPO = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT_S = 120
API_KEY = "sk-test-" + "0123456789abcdef" * 2

# The flags that work for headless Chromium with fake media. The fake-capture files are appended per launch.
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


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


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


def serve(tiny_model_dir: Path, log_dir: Path, *extra: str):
    """The agent on a free loopback port; yields its base URL and stops it afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ice-host",
        "127.0.0.1",
        "--model",
        str(tiny_model_dir),
        *LADDER_OFF_ARGS,
        *extra,
    ]
    proc = start_server(cmd, url, log_dir / "server.log")
    try:
        yield url
    finally:
        stop_server(proc)


# ---- fixtures (package scope: one agent and one browser for every e2e module) -------------


@pytest.fixture(scope="package", autouse=True)
def _require_loopback_namespace():
    # Under CI a missing tool or network namespace fails the run: a green CI that never opened
    # a browser would say nothing. A developer's machine skips with the reason.
    missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if not loopback_only():
        missing(
            "browser tests send ICE checks to every interface: run them inside "
            "`unshare -n sh -c 'ip link set lo up && pytest -m browser'` (make test does)"
        )
    if shutil.which("chromium") is None or shutil.which("sox") is None:
        missing("needs Debian's chromium and sox (make test installs them: apt-get install chromium sox)")


@pytest.fixture(scope="package")
def agent_url(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="package")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="package")
def keyed_agent_url(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("keyed-server"), "--api-key", API_KEY)


@pytest.fixture(scope="package")
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
    """A fresh context and page; uncaught page errors fail the test."""
    context = chromium.new_context(viewport={"width": 820, "height": 1000})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    yield page
    context.close()
    assert not page_errors, f"uncaught errors in the page: {page_errors}"
