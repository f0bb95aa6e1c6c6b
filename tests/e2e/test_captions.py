"""The caption overlay (agent/web/captions.html) in headless Chromium, following a live call over SSE.

Pins, end to end (the package's agent subprocess and Chromium with a fake mic, loopback only):
- a first page makes a call with agent/web/ and `?transcribe` (its offer's session turns on live
  input transcription, so the call's first turn is transcribed too); a second page, in its own
  browser context and with no WebRTC of its own, opens captions.html?session=<that call's id>
  and shows the user's words (from conversation.item.input_audio_transcription.*) and the
  agent's (its reply transcript) under speaker labels, at most three lines;
- its background is transparent (a browser source over a stream) and the latency readout shows
  figures, and hides with the L key; `?latency=0` starts it hidden;
- a screenshot of the overlay goes to the test's tmp_path and test-output/browser/captions.png.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_MS = 120_000

FIRST_TURN_TRANSCRIBED_JS = """() => {
  const first = window.omni.events.find((e) => e.type === "input_audio_buffer.speech_started");
  return Boolean(first) && window.omni.events.some((e) =>
    e.type === "conversation.item.input_audio_transcription.completed" && e.item_id === first.item_id);
}"""
LINES_JS = """() => [...document.querySelectorAll('#lines .line')].map((p) => ({
  speaker: p.dataset.speaker, text: p.querySelector('.stable').innerText + p.querySelector('.tail').innerText }))"""


def test_overlay_follows_a_call(page, chromium, agent_url, tmp_path):
    page.goto(agent_url + "?transcribe")
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'connected' && window.omni.callUrl", timeout=TIMEOUT_MS)
    call_id = page.evaluate("window.omni.callUrl").rstrip("/").rsplit("/", 1)[1]
    assert call_id.startswith("rtc_")
    # The page's session went with its offer, so even the call's first turn (spoken before the
    # data channel opened) is transcribed.
    page.wait_for_function(FIRST_TURN_TRANSCRIBED_JS, timeout=TIMEOUT_MS)

    context = chromium.new_context(viewport={"width": 1280, "height": 360})
    overlay = context.new_page()
    errors: list[str] = []
    overlay.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        overlay.goto(f"{agent_url}captions.html?session={call_id}")
        overlay.wait_for_function("window.captions.connected", timeout=30_000)
        # Both speakers on screen at once (the fake mic loops: a turn, a reply, the next turn).
        # The lines are read in the same evaluation that saw both: the fake mic's next turn can
        # change the screen between two calls from here (it did once, on a loaded machine).
        lines = overlay.wait_for_function(
            """() => {
          const shown = [...document.querySelectorAll('#lines .line')];
          const said = (who) => shown.some((p) => p.dataset.speaker === who && p.innerText.trim().length > who.length);
          return said('user') && said('agent') && (LINES_JS)();
        }""".replace("LINES_JS", LINES_JS),
            timeout=TIMEOUT_MS,
        ).json_value()
        assert 2 <= len(lines) <= 3, lines
        assert {line["speaker"] for line in lines} <= {"user", "agent"}
        assert overlay.evaluate("getComputedStyle(document.body).backgroundColor") == "rgba(0, 0, 0, 0)"
        readout = overlay.locator("#latency")
        assert readout.is_visible() and "first words" in readout.inner_text()
        shot = tmp_path / "captions.png"
        overlay.screenshot(path=str(shot))
        keep = REPO / "test-output" / "browser" / "captions.png"
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)
        print(f"\ncaptions: {lines}; screenshot {shot} (copy: {keep})")
        overlay.keyboard.press("l")
        assert not readout.is_visible()
        hidden = context.new_page()
        hidden.goto(f"{agent_url}captions.html?session={call_id}&latency=0")
        hidden.wait_for_function("window.captions.connected", timeout=30_000)
        assert not hidden.locator("#latency").is_visible()
    finally:
        context.close()
        page.get_by_role("button", name="Stop the call").click()
    assert not errors, errors
