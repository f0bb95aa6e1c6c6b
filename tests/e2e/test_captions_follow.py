"""The caption overlay following "the latest call", its style parameters, its stop reasons, and
a call's WebVTT, in headless Chromium against the package's agent subprocess (loopback only).

Pins:
- captions.html?follow=latest opened before any call says it is waiting (a visible status), then
  shows the user's and the agent's words of a call started after it (agent/web/ with
  `?transcribe`), the user's line marked final once its completed transcript came; when the
  call ends it says so and waits; a second call is followed too, its lines replacing the first
  call's; with `position=top` the status and latency readouts move to the bottom edge, off the
  lines;
- style parameters apply (`size` → the font size, `color` → the text colour, `position=top`)
  and a bad value (`bg=red;x`) is ignored and listed, the default backing kept; the defaults
  keep WCAG AA contrast (4.5:1) even over a white frame, the page background stays transparent,
  and the caption region is an aria-live log; a screenshot of the styled overlay goes to
  test-output/browser/captions-follow.png (and the WebVTT beside it), and with
  OMNI_SCREENSHOTS=1 to bench/results/captions-overlay.png (the committed one);
- the call's GET /v1/realtime/calls/{id}/captions.vtt parses with webvtt-py: cues in start
  order, none ending before it starts, both speakers (`<v user>`, `<v agent>`) with text, and
  each final user line the overlay showed is a user cue with the same words;
- the overlay stops for good, with the reason on screen, on 410 (a call that has ended), 404
  (no such call), 403 and 401 (a wrong key on an agent with --api-key), and retries a 503 with
  backoff until the agent answers.
"""

from __future__ import annotations

import html
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
import webvtt

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_MS = 120_000

# Both speakers on screen, the user's line final: a partial may still be taken back by its
# completed transcript (the tiny random model's final can come out empty), and the WebVTT keeps
# what the completed transcript said, so only a final line is sure to be in it.
SAID_BOTH_JS = """() => {
  const shown = [...document.querySelectorAll('#lines .line')];
  const said = (who, final) => shown.some((p) => p.dataset.speaker === who && (!final || p.dataset.final === 'true')
    && p.querySelector('.said').innerText.trim());
  return said('user', true) && said('agent', false);
}"""
FINAL_USER_JS = (
    "window.captions.lines.filter((l) => l.speaker === 'user' && l.final && l.stable.trim()).map((l) => l.stable)"
)


def _start_call(page, agent_url: str) -> str:
    page.goto(agent_url + "?transcribe")
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'connected' && window.omni.callUrl", timeout=TIMEOUT_MS)
    return page.evaluate("window.omni.callUrl").rstrip("/").rsplit("/", 1)[1]


def _words(text: str) -> str:
    return " ".join(text.split())


def _ms(stamp: str) -> int:
    h, m, s = stamp.split(":")
    return round((int(h) * 3600 + int(m) * 60 + float(s)) * 1000)


def test_overlay_follows_the_latest_call(page, chromium, agent_url, tmp_path):
    context = chromium.new_context(viewport={"width": 1280, "height": 360})
    overlay = context.new_page()
    errors: list[str] = []
    overlay.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        overlay.goto(f"{agent_url}captions.html?follow=latest&size=40&color=%23ffd34d&bg=red;x&position=top")
        # A call of an earlier test may still be closing: wait until none is followed.
        overlay.wait_for_function(
            "window.captions.connected && window.captions.callId === null && /waiting/.test(window.captions.status)",
            timeout=30_000,
        )
        status = overlay.locator("#status")
        assert status.is_visible() and "waiting for" in status.inner_text()
        styled = overlay.evaluate(
            """() => ({ size: getComputedStyle(document.body).fontSize, color: getComputedStyle(document.body).color,
                justify: getComputedStyle(document.body).justifyContent, ignored: window.captions.ignored,
                bg: window.captions.style.bg })"""
        )
        assert styled == {
            "size": "40px",
            "color": "rgb(255, 211, 77)",
            "justify": "flex-start",
            "ignored": ["bg"],
            "bg": "rgba(0, 0, 0, 0.6)",
        }
        calls_before = overlay.evaluate("window.captions.calls")

        first = _start_call(page, agent_url)
        overlay.wait_for_function(f"window.captions.callId === {first!r}", timeout=30_000)
        overlay.wait_for_function(SAID_BOTH_JS, timeout=TIMEOUT_MS)
        assert not status.is_visible()
        readout = overlay.locator("#latency").bounding_box()
        assert readout["y"] > 360 / 2, readout  # position=top: the readout sits at the bottom
        # One atomic look: every event re-renders the lines.
        backing = overlay.evaluate("getComputedStyle(document.querySelector('#lines .line .said')).backgroundColor")
        assert backing == "rgba(0, 0, 0, 0.6)"
        shot = tmp_path / "captions-follow.png"
        overlay.screenshot(path=str(shot))
        keep = REPO / "test-output" / "browser" / "captions-follow.png"
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)
        if os.environ.get("OMNI_SCREENSHOTS") == "1":  # the copy the README shows
            shutil.copyfile(shot, REPO / "bench" / "results" / "captions-overlay.png")
        first_ids = overlay.evaluate("window.captions.lines.map((l) => l.id)")
        finals = overlay.evaluate(FINAL_USER_JS)
        assert finals, overlay.evaluate("window.captions.lines")

        page.get_by_role("button", name="Stop the call").click()
        overlay.wait_for_function("/call ended/.test(window.captions.status)", timeout=30_000)
        assert status.is_visible()

        # The finished call's WebVTT: both speakers, in order.
        with urllib.request.urlopen(f"{agent_url}v1/realtime/calls/{first}/captions.vtt", timeout=10) as resp:
            assert resp.headers.get_content_type() == "text/vtt"
            text = resp.read().decode("utf-8")
        (keep.parent / "captions-follow.vtt").write_text(text)
        cues = list(webvtt.from_string(text))
        starts = [_ms(c.start) for c in cues]
        assert starts == sorted(starts), text
        assert all(_ms(c.end) >= _ms(c.start) for c in cues), text
        for who in ("user", "agent"):
            assert any(c.voice == who and c.text.strip() for c in cues), text
        # Each final user line the overlay showed is a user cue, word for word: the two are built
        # from the same server events.
        said = {_words(html.unescape(c.text)) for c in cues if c.voice == "user"}
        for line in finals:
            assert _words(line) in said, (line, text)
        print(f"\n{len(cues)} cues; screenshot {shot} (copy: {keep})")

        # A second call: followed, and the first call's lines are gone.
        second = _start_call(page, agent_url)
        assert second != first
        overlay.wait_for_function(f"window.captions.callId === {second!r}", timeout=30_000)
        assert overlay.evaluate("window.captions.calls") == calls_before + 2
        shown = overlay.evaluate("window.captions.lines.map((l) => l.id)")
        assert not set(shown) & set(first_ids), (shown, first_ids)
        assert not overlay.evaluate("window.captions.ended")
    finally:
        context.close()
        # Only a call still up is hung up here: clicking a disabled Stop would time out and hide
        # the failure that brought the test here (a loaded run once lost an assertion that way).
        stop = page.get_by_role("button", name="Stop the call")
        if stop.is_enabled():
            stop.click()
    assert not errors, errors


def test_overlay_stops_on_refusals_and_retries_outages(page, chromium, agent_url):
    ended = _start_call(page, agent_url)
    page.get_by_role("button", name="Stop the call").click()
    context = chromium.new_context(viewport={"width": 960, "height": 300})
    overlay = context.new_page()
    errors: list[str] = []
    overlay.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        for session, code, why in ((ended, 410, "has ended"), ("rtc_" + "0" * 24, 404, "no such call")):
            overlay.goto(f"{agent_url}captions.html?session={session}")
            overlay.wait_for_function("window.captions.ended", timeout=30_000)
            shown = overlay.locator("#status").inner_text()
            assert overlay.evaluate("window.captions.httpStatus") == code
            assert shown.startswith("stopped:") and why in shown and f"HTTP {code}" in shown, shown

        # A proxy in front may refuse (403): final too. A 503 is not: retried until it passes.
        overlay.route("**/v1/omni/calls/latest/events", lambda route: route.fulfill(status=403, body="no"))
        overlay.goto(f"{agent_url}captions.html?follow=latest")
        overlay.wait_for_function("window.captions.ended", timeout=30_000)
        assert "HTTP 403" in overlay.locator("#status").inner_text()
        overlay.unroute("**/v1/omni/calls/latest/events")
        refusals = []

        def unavailable(route):
            if len(refusals) < 2:
                refusals.append(1)
                route.fulfill(status=503, content_type="application/json", body='{"error": {"message": "busy"}}')
            else:
                route.continue_()

        overlay.route("**/v1/omni/calls/latest/events", unavailable)
        overlay.goto(f"{agent_url}captions.html?follow=latest")
        overlay.wait_for_function("window.captions.retries >= 1", timeout=30_000)
        assert "HTTP 503" in overlay.locator("#status").inner_text()
        overlay.wait_for_function("window.captions.connected", timeout=30_000)  # after 1 s, then 2 s
        state = overlay.evaluate("({ ended: window.captions.ended, retries: window.captions.retries })")
        assert state == {"ended": False, "retries": 2}
        # The defaults: transparent page, a backing that keeps AA contrast over any frame, a live region.
        a11y = overlay.evaluate(
            """() => ({ page: getComputedStyle(document.body).backgroundColor, contrast: window.captions.style.contrast,
                live: document.getElementById('lines').getAttribute('aria-live'),
                status: document.getElementById('status').getAttribute('role') })"""
        )
        assert a11y["page"] == "rgba(0, 0, 0, 0)" and a11y["contrast"] >= 4.5, a11y
        assert a11y["live"] == "polite" and a11y["status"] == "status", a11y
    finally:
        context.close()
    assert not errors, errors


def test_overlay_stops_on_a_wrong_key(chromium, keyed_agent_url, api_key):
    context = chromium.new_context()
    overlay = context.new_page()
    try:
        overlay.goto(f"{keyed_agent_url}captions.html?follow=latest&key=sk-wrong")
        overlay.wait_for_function("window.captions.ended", timeout=30_000)
        shown = overlay.locator("#status").inner_text()
        assert overlay.evaluate("window.captions.httpStatus") == 401
        assert "key was refused" in shown and "HTTP 401" in shown, shown
        overlay.goto(f"{keyed_agent_url}captions.html?follow=latest&key={api_key}")
        overlay.wait_for_function("window.captions.connected && /waiting/.test(window.captions.status)", timeout=30_000)
    finally:
        context.close()
