"""Headless Chromium holds a real call with the agent through agent/web/, on loopback only, over
the OpenAI Realtime API (GA) protocol the page speaks.

What it pins, end to end (`python -m agent serve` with the tiny model as a subprocess,
Debian's Chromium driven by Playwright, a fake mic playing espeak-ng speech and a fake
camera playing a synthetic y4m):
- the page signals with one raw-SDP POST to /v1/realtime/calls (201, Location naming an
  rtc_ call), its RTCPeerConnection reaches "connected" and its status line says so;
- events arrive on the client-created "oai-events" channel; the page's session.update is
  answered by session.updated; the agent's words arrive as
  response.output_audio_transcript.delta and appear in the caption overlay; response.done's
  `omni` figures fill the TTFT/TTFA readout, and omni.turn_timing's five stages and their total
  the "Where it went" row;
- the agent's voice arrives and is audible: inbound-rtp audio packetsReceived > 0 and
  totalAudioEnergy > 0, and the page's own analyser measured speech_stopped -> audible;
- the page asked the camera sender for 4 fps (RTCRtpSender.setParameters);
- ticking "Text replies only" mid-call sends session.update (output_modalities ["text"]); the
  next reply comes as response.output_text.delta, and its readout shows TTFT but no TTFA;
- Stop hangs up with DELETE on the call's Location (204), and the page keeps its peer open
  until the server answers: a DELETE held a second on its way still finds the call;
- a refused offer (the server's 4xx JSON error) is shown to the user, not swallowed;
- once the call is up the page shows its id (the last segment of the Location) and a link to
  captions.html?session=<that id>; Mute disables the mic sender's track (aria-pressed), the
  level the sender encodes (getStats media-source audioLevel) reaches zero, and while the fake
  mic goes on speaking no speech_started arrives; a question typed in the text box goes
  out as conversation.item.create + response.create and gets a reply (response.done with deltas),
  and the transcript panel shows a "you" line with the typed text and an agent line (and
  "Download transcript" saves them as transcript-<call id>.txt); a 1600x1200 picture chosen with
  a question goes out in one item (input_text, input_image) that the reply counts image tokens
  for, the file field is cleared and the line ends "[picture]"; Unmute brings speech_started back;
- without getUserMedia (no secure context) the page says the microphone needs localhost or HTTPS
  and keeps Start disabled;
- against a server started with --api-key, the page shows its key field, tells the user a
  key is needed when none is given, and with the key mints an ek_ key on its own origin and
  signals with it (the API key itself never goes to /v1/realtime/calls).
A screenshot of the live call goes to the test's tmp_path and to test-output/browser/page.png.
The agent, the browser and the loopback-only rule live in tests/e2e/conftest.py.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.page_watch import watch_call

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
CALL_TIMEOUT_S = 90

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
    ttftText: text("ttft"), ttfaText: text("ttfa"), latency: o.latency, stagesText: text("turn-stages"),
    audioPackets: 0, audioEnergy: 0, videoFpsCap: null,
  };
  // The TTFA readout follows the latest event carrying one: a reply's response.done, or the next
  // reply's output_audio_buffer.started when that came after it.
  const lat = o.events.filter((e) => (e.type === "output_audio_buffer.started" && e.omni)
    || (e.type === "response.done" && e.response?.omni)).at(-1);
  s.shownTtfa = lat ? (lat.type === "response.done" ? lat.response.omni.ttfa_ms : lat.omni.ttfa_ms) : null;
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

    def checks(snap: dict) -> dict[str, bool]:
        return {
            "connected": snap["state"] == "connected" and snap["statusText"] == "connected",
            "session.updated": snap["updated"] > 0,
            "transcript delta": snap["deltas"] > 0,
            "caption": bool(snap["caption"]),
            "audio packets": snap["audioPackets"] > 0,
            "audio energy": snap["audioEnergy"] > 0,
            "response.done": snap["dones"] > 0,
            "audible": (snap["latency"].get("eot_to_audible_ms") or 0) > 0,
            # the stages of the last turn (omni.turn_timing), shown in the latency readout
            "turn stages": snap["stagesText"].count(" ms") >= 5 and (snap["latency"].get("turn_total_ms") or 0) > 0,
        }

    _, snap = watch_call(
        page,
        SNAPSHOT_JS,
        checks,
        timeout_s,
        finished=lambda snap: bool(snap["caption"]) and snap["state"] == "connected",
        on_timeout=lambda: page.screenshot(path=str(out_dir / "page-timeout.png"), full_page=True),
    )
    shot = out_dir / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    snap["screenshot"] = shot
    return snap


def switch_to_text(page, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """Tick "Text replies only" mid-call and wait for a whole text reply (the fake mic loops)."""
    page.get_by_label("Text replies only").check()
    page.wait_for_function(
        """() => {
      const o = window.omni;
      const at = o.events.findIndex((e) => e.type === "session.updated" && e.session.output_modalities[0] === "text");
      return at >= 0 && o.events.slice(at).some((e) => e.type === "response.done" && e.response.omni?.mode === "text");
    }""",
        timeout=timeout_s * 1000,
    )
    return page.evaluate("""() => {
      const o = window.omni;
      const text = (id) => document.getElementById(id).innerText.trim();
      const done = o.events.filter((e) => e.type === "response.done").at(-1);
      const id = done.response.id;
      return { done, textDeltas: o.events.filter((e) => e.type === "response.output_text.delta" && e.response_id === id).length,
               audioDeltas: o.events.filter((e) => e.type === "response.output_audio_transcript.delta" && e.response_id === id).length,
               ttftText: text("ttft"), ttfaText: text("ttfa") };
    }""")


def hang_up(page, hold_s: float = 1.0) -> dict:
    """Press Stop, hold the page's DELETE for `hold_s` (a slow network), then let it through;
    return what the server answered. The page must keep its peer open until the answer: a
    peer closed at once reaches the server first (DTLS close), and the DELETE then finds no
    call (404)."""
    held: list = []
    page.route(
        "**/v1/realtime/calls/*",
        lambda route: held.append(route) if route.request.method == "DELETE" else route.continue_(),
    )
    with page.expect_response(lambda r: r.request.method == "DELETE") as response_info:
        page.get_by_role("button", name="Stop the call").click()
        for _ in range(200):  # bounded: 10 s for the page to send it
            if held:
                break
            page.wait_for_timeout(50)
        assert held, "Stop sent no DELETE"
        page.wait_for_timeout(hold_s * 1000)
        held[0].continue_()
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


# ---- tests -------------------------------------------------------------------------------


def test_call_shows_captions_and_plays_the_agents_voice(page, agent_url, tmp_path):
    snap = drive_call(page, agent_url, tmp_path)

    assert snap["channel"] == "oai-events"
    assert re.fullmatch(re.escape(agent_url) + r"v1/realtime/calls/rtc_[0-9a-f]{24}", snap["callUrl"] or ""), snap
    assert snap["videoFpsCap"] == 4, "the camera sender was not capped at 4 fps"
    figures = snap["lastDone"]["response"]["omni"]
    assert snap["ttftText"] == js_ms(figures.get("ttft_ms")) and snap["ttfaText"] == js_ms(snap["shownTtfa"])

    keep = REPO / "test-output" / "browser" / "page.png"
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(snap["screenshot"], keep)
    print(f"\nscreenshot: {snap['screenshot']} (copy: {keep})")
    print(
        f"caption: {snap['caption']!r}; latency: {snap['latency']}; "
        f"audio packets {snap['audioPackets']}, energy {snap['audioEnergy']:.4f}"
    )

    text = switch_to_text(page)
    assert text["textDeltas"] > 0 and text["audioDeltas"] == 0, text
    assert text["done"]["response"]["output_modalities"] == ["text"], text["done"]
    assert text["ttfaText"] == "–" and text["ttftText"] == js_ms(text["done"]["response"]["omni"]["ttft_ms"]), text

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


def test_keyed_server_page_mints_an_ephemeral_key(page, keyed_agent_url, api_key):
    calls: list[dict] = []
    page.on(
        "request",
        lambda r: (
            calls.append({"url": r.url, "method": r.method, "auth": r.headers.get("authorization", "")})
            if "/v1/realtime/calls" in r.url
            else None
        ),
    )
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
    key_field.fill(api_key)
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function(
        "window.omni.state === 'connected' && window.omni.events.some((e) => e.type === 'session.updated')",
        timeout=CALL_TIMEOUT_S * 1000,
    )
    posts = [c for c in calls if c["method"] == "POST"]
    assert len(posts) == 1 and posts[0]["auth"].startswith("Bearer ek_"), calls
    assert api_key not in str(calls)

    hung = hang_up(page)
    assert hung["status"] == 204, hung
    assert page.evaluate("window.omni.events.filter((e) => e.type === 'error')") == []


def start_call(page, base_url: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
    page.goto(base_url)
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function(
        "window.omni.state === 'connected' && window.omni.events.some((e) => e.type === 'session.updated')",
        timeout=timeout_s * 1000,
    )


COUNT_JS = "(t) => window.omni.events.filter((e) => e.type === t).length"
MIC_ENABLED_JS = """() => window.omni.pc.getSenders().find((s) => s.track && s.track.kind === "audio").track.enabled"""
QUIET_S = 5  # how long a muted mic must start no turn
SENT_LEVEL_ZERO_JS = """async () => {
  const stats = await window.omni.pc.getStats();
  const sources = [...stats.values()].filter((r) => r.type === "media-source" && r.kind === "audio");
  return sources.length > 0 && sources.every((r) => r.audioLevel === 0);
}"""


def test_mute_text_box_transcript_and_call_id(page, agent_url, tmp_path):
    start_call(page, agent_url)

    # The call id and the overlay link that follows it.
    call_id = page.evaluate("window.omni.callUrl").rsplit("/", 1)[-1]
    assert re.fullmatch(r"rtc_[0-9a-f]{24}", call_id), call_id
    assert page.locator("#call-id").inner_text() == call_id
    link = page.get_by_role("link", name="Captions overlay")
    assert link.get_attribute("href") == f"captions.html?session={call_id}"
    assert page.get_by_role("button", name="Copy the captions overlay link").is_enabled()

    # Mute: the sender's track goes disabled; wait out a turn the mute may have cut short.
    mute = page.get_by_role("button", name="Mute microphone")
    mute.click()
    assert mute.get_attribute("aria-pressed") == "true"
    assert page.evaluate(MIC_ENABLED_JS) is False
    # What the call sends is silence: the mic's media-source level (what the RTP sender encodes)
    # reaches zero, although the fake mic goes on speaking.
    page.wait_for_function(SENT_LEVEL_ZERO_JS, timeout=10_000, polling=200)
    time.sleep(2)
    page.wait_for_function(
        """() => { const n = (t) => window.omni.events.filter((e) => e.type === t).length;
                   return n("response.created") === n("response.done")
                     && n("input_audio_buffer.speech_started") === n("input_audio_buffer.speech_stopped"); }""",
        timeout=30_000,
    )
    muted_at = time.monotonic()
    started = page.evaluate(COUNT_JS, "input_audio_buffer.speech_started")

    # The text box: a typed question gets a reply, and both land in the transcript panel.
    question = "What colour is the square?"
    sent_at = page.evaluate("window.omni.events.length")
    page.get_by_label("Message").fill(question)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        """(at) => window.omni.events.slice(at).some((e) => e.type === "response.done")""",
        arg=sent_at,
        timeout=CALL_TIMEOUT_S * 1000,
    )
    reply = page.evaluate(
        """(at) => { const evs = window.omni.events.slice(at);
                     const done = evs.find((e) => e.type === "response.done");
                     const deltas = evs.filter((e) => e.response_id === done.response.id
                       && (e.type === "response.output_audio_transcript.delta" || e.type === "response.output_text.delta"));
                     return { done, deltas: deltas.length, errors: evs.filter((e) => e.type === "error") }; }""",
        sent_at,
    )
    assert not reply["errors"] and reply["done"]["response"]["status"] in ("completed", "incomplete"), reply
    assert reply["deltas"] > 0, reply
    page.wait_for_function(
        """() => document.querySelector('#transcript li[data-speaker="agent"] .said')?.textContent.length > 0""",
        timeout=10_000,
    )
    lines = page.evaluate(
        """() => [...document.querySelectorAll("#transcript li")].map((li) =>
             ({ who: li.dataset.speaker, tag: li.querySelector(".who").textContent, text: li.querySelector(".said").textContent }))"""
    )
    assert {"who": "you", "tag": "You", "text": question} in lines, lines
    assert any(line["who"] == "agent" and line["tag"] == "Agent" and line["text"] for line in lines), lines
    with page.expect_download(timeout=10_000) as download_info:
        page.get_by_role("button", name="Download transcript").click()
    download = download_info.value
    assert download.suggested_filename == f"transcript-{call_id}.txt"
    assert f"You: {question}\n" in Path(download.path()).read_text(encoding="utf-8")

    # A picture with a question: one item of input_text and input_image (a JPEG the page scaled
    # to 896 px at most), answered with the picture's tokens counted; the line says so.
    picture = tmp_path / "square.png"
    ramp = np.linspace(0, 255, 1600, dtype=np.uint8)
    image = np.stack(
        [np.tile(ramp, (1200, 1)), np.tile(ramp[::-1], (1200, 1)), np.full((1200, 1600), 90, np.uint8)], -1
    )
    image[400:800, 600:1000] = (250, 40, 40)  # a red square on a gradient
    Image.fromarray(image).save(picture)
    sent_at = page.evaluate("window.omni.events.length")
    page.get_by_label("Picture").set_input_files(str(picture))
    page.get_by_label("Message").fill("And this one?")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        """(at) => window.omni.events.slice(at).some((e) => e.type === "response.done")""",
        arg=sent_at,
        timeout=CALL_TIMEOUT_S * 1000,
    )
    seen = page.evaluate(
        """(at) => { const evs = window.omni.events.slice(at);
                     return { added: evs.find((e) => e.type === "conversation.item.added" && e.item.role === "user"),
                              done: evs.find((e) => e.type === "response.done"),
                              errors: evs.filter((e) => e.type === "error") }; }""",
        sent_at,
    )
    assert not seen["errors"], seen["errors"]
    assert seen["added"]["item"]["content"] == [
        {"type": "input_text", "text": "And this one?"},
        {"type": "input_image", "detail": "auto", "image_url": None},
    ], seen["added"]
    assert seen["done"]["response"]["usage"]["input_token_details"]["image_tokens"] > 0, seen["done"]
    assert page.get_by_label("Picture").input_value() == ""  # (cleared for the next message)
    page.wait_for_function(
        """() => [...document.querySelectorAll('#transcript li[data-speaker="you"] .said')]
                   .some((s) => s.textContent === "And this one? [picture]")""",
        timeout=10_000,
    )

    # Still muted for QUIET_S at least: no turn began, though the fake mic never stops talking.
    time.sleep(max(0.0, QUIET_S - (time.monotonic() - muted_at)))
    assert page.evaluate(COUNT_JS, "input_audio_buffer.speech_started") == started

    # Unmute: the agent hears the mic again.
    mute.click()
    assert mute.get_attribute("aria-pressed") == "false" and page.evaluate(MIC_ENABLED_JS) is True
    page.wait_for_function(
        "(n) => window.omni.events.filter((e) => e.type === 'input_audio_buffer.speech_started').length > n",
        arg=started,
        timeout=30_000,
    )

    hung = hang_up(page)
    assert hung["status"] == 204, hung
    assert page.locator("#call-info").is_hidden()


def test_page_without_media_devices_says_why_and_keeps_start_disabled(page, agent_url):
    # What an http:// page on a LAN address sees: no navigator.mediaDevices (loopback is always secure).
    page.add_init_script("Object.defineProperty(Navigator.prototype, 'mediaDevices', { get: () => undefined })")
    page.goto(agent_url)
    error_box = page.get_by_role("alert")
    error_box.wait_for(state="visible", timeout=10_000)
    assert "localhost or HTTPS" in error_box.inner_text()
    assert page.get_by_role("button", name="Start the call").is_disabled()
