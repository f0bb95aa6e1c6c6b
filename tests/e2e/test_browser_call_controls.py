"""The call page's controls in a real call: headless Chromium (fake mic and camera) against
`python -m agent serve` with the tiny model, on loopback only (tests/e2e/conftest.py).

What it pins:
- keyboard and labels: the first Tab lands on Start, which shows a focus outline and starts the
  call with Enter; Tab then reaches Camera off, the microphone, camera and voice pickers, the
  mode radios, the target language and the option boxes, each with its own <label>; the status
  line and the transcript are live regions; the newest caption line has at least 4.5:1 contrast
  against its box laid over a white camera image (the worst case);
- the voice picker lists the tiny model's speakers (aiden, chelsie, ethan, from GET
  /v1/omni/config), takes ?voice= as its first value, which the first session.update carries
  (session.updated echoes it), and a voice picked mid-call is accepted (session.updated, no
  `error`) and goes into the URL; a voice the server refuses shows its `error` and the picker
  goes back;
- switching microphone and camera mid-call replaces the senders' tracks (RTCRtpSender.replaceTrack:
  the track ids change) while the call stays the same (same Location, still "connected") and the
  agent goes on hearing and answering (speech_started and response.done after the switch).
  Chromium's fake devices are two microphones (and "Default") but one camera: the camera switch
  goes from "Default" to fake_device_0, a new getUserMedia track of the same device, still
  put on the wire by replaceTrack;
- Camera off sends session.update with omni.video false (echoed by session.updated), the video
  sender's track becomes null and its framesSent stops growing; Camera on again sends
  omni.video true and frames flow again;
- with ?transcribe the user's words (conversation.item.input_audio_transcription.*) and the
  agent's replies both reach the transcript, and "Download WebVTT" saves transcript-<call id>.vtt
  that webvtt-py parses: cues in time order, <v user> and <v agent> voices, the texts of the
  page's transcript (escaped);
- a call dropped by the server (DELETE on its Location from outside the page) is reconnected
  after a visible "reconnecting in N s": a new call with a new id, and the overlay link follows
  it; a retry refused with 403 stops the retries and shows the server's reason; the user's Stop
  never leads to a reconnect;
- modes are controls: ?interpret_to=German selects "Interpret into" German and the first update
  sets omni.interpret_to (the interpreter's instructions follow); choosing Conversation mid-call
  lifts it and restores the session's first instructions and barge-in; choosing Captions only
  mid-call starts a new call that is a transcription session: the user's words keep coming,
  no reply starts, the text box is off; the URL follows the controls (bookmarkable).
A screenshot of the page mid-call goes to test-output/browser/page-call.png, and with
OMNI_SCREENSHOTS=1 to bench/results/page-call.png (the committed one).
"""

from __future__ import annotations

import html
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import webvtt

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
CALL_TIMEOUT_S = 90
TURN_TIMEOUT_S = 60

COUNT_AFTER_JS = "([type, at]) => window.omni.events.slice(at).filter((e) => e.type === type).length"
SENDERS_JS = """async () => {
  const pc = window.omni.pc;
  const sender = (kind) => pc.getTransceivers().find((t) => t.receiver.track.kind === kind)?.sender ?? null;
  const mic = sender("audio"), video = sender("video");
  let framesSent = 0;
  (await pc.getStats()).forEach((r) => {
    if (r.type === "outbound-rtp" && r.kind === "video") framesSent += r.framesSent ?? 0;
  });
  return { mic: mic?.track?.id ?? null, micEnabled: mic?.track?.enabled ?? null,
           video: video?.track?.id ?? null, framesSent, state: pc.connectionState, callUrl: window.omni.callUrl };
}"""


def wait_updated(page, at: int, test: str, timeout_s: float = 15) -> dict:
    """The first session.updated after event `at` whose session satisfies the JS expression
    `test` (on `s`), waited for."""
    found = page.wait_for_function(
        "(at) => window.omni.events.slice(at)"
        f".find((e) => e.type === 'session.updated' && (s => {test})(e.session))?.session ?? null",
        arg=at,
        timeout=timeout_s * 1000,
    )
    return found.json_value()


def mark(page) -> int:
    return page.evaluate("window.omni.events.length")


def wait_connected(page, timeout_s: float = CALL_TIMEOUT_S) -> None:
    page.wait_for_function(
        "window.omni.state === 'connected' && window.omni.events.some((e) => e.type === 'session.updated' || e.type === 'session.created')",
        timeout=timeout_s * 1000,
    )


def error_events(page) -> list:
    return page.evaluate("window.omni.events.filter((e) => e.type === 'error')")


def luminance(rgb: tuple[float, float, float]) -> float:
    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def parse_css_color(text: str) -> tuple[float, float, float, float]:
    inside = text[text.index("(") + 1 : text.index(")")].replace("/", ",").split(",")
    values = [float(v) for v in inside]
    return (values[0], values[1], values[2], values[3] if len(values) > 3 else 1.0)


def contrast_over_white(color: str, background: str) -> float:
    """Contrast of `color` text on `background` composited over white (the brightest camera image)."""
    fr, fg, fb, _ = parse_css_color(color)
    br, bg, bb, alpha = parse_css_color(background)
    under = tuple(alpha * c + (1 - alpha) * 255 for c in (br, bg, bb))
    hi, lo = sorted((luminance((fr, fg, fb)), luminance(under)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def words(text: str) -> str:
    """Whitespace runs as one space (a cue holds its utterance on one line)."""
    return " ".join(text.split())


def seconds(timestamp: str) -> float:
    """A WebVTT timestamp in seconds, to the millisecond (webvtt-py's *_in_seconds are whole seconds)."""
    h, m, s = timestamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def keep_screenshot(page, tmp_path: Path) -> Path:
    shot = tmp_path / "page-call.png"
    page.screenshot(path=str(shot), full_page=True)
    copy = REPO / "test-output" / "browser" / "page-call.png"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, copy)
    if os.environ.get("OMNI_SCREENSHOTS") == "1":
        shutil.copyfile(shot, REPO / "bench" / "results" / "page-call.png")
    return copy


# ---- tests -------------------------------------------------------------------------------


def test_keyboard_voices_devices_camera_and_webvtt(page, agent_url, tmp_path):
    page.goto(agent_url + "?transcribe&voice=chelsie")
    page.wait_for_function("document.querySelectorAll('#voice-select option').length > 1", timeout=10_000)

    # Labels: every select, box and field is found by its label; the live regions are there.
    for name in (
        "Microphone",
        "Camera",
        "Voice",
        "Target language",
        "Transcribe my speech",
        "Text replies only",
        "High priority",
        "Message",
        "Conversation",
        "Captions only",
        "Interpret into",
    ):
        assert page.get_by_label(name, exact=True).count() == 1, name
    assert page.locator("#status").get_attribute("role") == "status"
    assert page.locator("#transcript").get_attribute("aria-live") == "polite"

    # The voice picker: the model's speakers, ?voice= selected; ?transcribe ticked the box.
    voices = page.evaluate("[...document.querySelectorAll('#voice-select option')].map((o) => o.value)")
    assert voices == ["aiden", "chelsie", "ethan"], voices
    assert page.get_by_label("Voice", exact=True).input_value() == "chelsie"
    assert page.get_by_label("Transcribe my speech").is_checked()

    # Keyboard: the first Tab is Start, with a visible focus ring; Tab goes on through the controls.
    page.keyboard.press("Tab")
    focused = page.evaluate("""() => { const el = document.activeElement, st = getComputedStyle(el);
        return { id: el.id, outline: st.outlineStyle, width: parseFloat(st.outlineWidth) }; }""")
    assert focused["id"] == "start" and focused["outline"] != "none" and focused["width"] >= 2, focused
    reached = {}
    for _ in range(14):
        page.keyboard.press("Tab")
        here = page.evaluate("""() => { const el = document.activeElement;
            return [el.id || el.value, getComputedStyle(el).outlineStyle]; }""")
        reached[here[0]] = here[1]
    for control in (
        "camera-off",
        "mic-select",
        "camera-select",
        "voice-select",
        "conversation",
        "interpret-to",
        "transcribe",
        "text-only",
        "high-priority",
    ):
        assert control in reached, (control, reached)
        assert reached[control] != "none", (control, reached)

    # Start with the keyboard. The first update carries the URL's voice and transcription.
    page.locator("#start").focus()
    page.keyboard.press("Enter")
    wait_connected(page)
    first = wait_updated(page, 0, "true")
    assert first["audio"]["output"]["voice"] == "chelsie" and first["audio"]["input"]["transcription"], first
    call_url = page.evaluate("window.omni.callUrl")

    # A voice picked mid-call is accepted.
    at = mark(page)
    page.get_by_label("Voice", exact=True).select_option("aiden")
    assert wait_updated(page, at, "s.audio.output.voice === 'aiden'")
    assert "voice=aiden" in page.evaluate("location.search")

    # Switch the microphone, then the camera: new tracks on the same senders, the same call.
    before = page.evaluate(SENDERS_JS)
    mics = page.evaluate("[...document.querySelectorAll('#mic-select option')].map((o) => o.value)")
    other_mic = next(v for v in mics if v and v != page.get_by_label("Microphone", exact=True).input_value())
    page.get_by_label("Microphone", exact=True).select_option(other_mic)
    page.wait_for_function(f"async () => (await ({SENDERS_JS})()).mic !== {before['mic']!r}", timeout=10_000)
    cams = page.evaluate("[...document.querySelectorAll('#camera-select option')].map((o) => o.value)")
    page.get_by_label("Camera", exact=True).select_option(next(v for v in cams if v))
    page.wait_for_function(f"async () => (await ({SENDERS_JS})()).video !== {before['video']!r}", timeout=10_000)
    after = page.evaluate(SENDERS_JS)
    assert after["mic"] and after["video"] and after["micEnabled"] is True, after
    assert after["callUrl"] == call_url and after["state"] == "connected", after
    at = mark(page)
    page.wait_for_function(
        "(at) => { const evs = window.omni.events.slice(at);"
        " const heard = evs.findIndex((e) => e.type === 'input_audio_buffer.speech_started');"
        " return heard >= 0 && evs.slice(heard).some((e) => e.type === 'response.done'); }",
        arg=at,
        timeout=TURN_TIMEOUT_S * 1000,
    )

    # Camera off: the agent is told, the sender sends nothing; on again: frames flow.
    at = mark(page)
    page.get_by_role("button", name="Turn camera off").click()
    assert page.get_by_role("button", name="Turn camera off").get_attribute("aria-pressed") == "true"
    assert wait_updated(page, at, "s.omni.video === false")
    off = page.evaluate(SENDERS_JS)
    assert off["video"] is None, off
    time.sleep(2)
    still = page.evaluate(SENDERS_JS)
    assert still["framesSent"] - off["framesSent"] <= 1, (off, still)  # one may have been in flight
    at = mark(page)
    page.get_by_role("button", name="Turn camera off").click()
    assert wait_updated(page, at, "s.omni.video === true")
    page.wait_for_function(
        f"async () => (await ({SENDERS_JS})()).framesSent > {still['framesSent'] + 2}", timeout=15_000
    )

    # Both sides in the transcript (the fake mic loops: the user is transcribed turn after turn).
    page.wait_for_function(
        """() => { const t = window.omni.transcript;
                   return t.some((l) => l.who === "you" && l.text.trim()) && t.some((l) => l.who === "agent" && l.text.trim()); }""",
        timeout=TURN_TIMEOUT_S * 1000,
    )
    page.wait_for_function(
        "document.querySelector('#captions p')?.textContent.length > 0", timeout=TURN_TIMEOUT_S * 1000
    )
    shot = keep_screenshot(page, tmp_path)
    print(f"\nscreenshot: {shot}")
    caption = page.evaluate("""() => { const p = [...document.querySelectorAll('#captions p')].at(-1), st = getComputedStyle(p);
        return { color: st.color, background: st.backgroundColor }; }""")
    assert contrast_over_white(caption["color"], caption["background"]) >= 4.5, caption

    # WebVTT: parses, cues in order, both voices, the page's own texts.
    call_id = call_url.rsplit("/", 1)[-1]
    lines = page.evaluate("window.omni.transcript.filter((l) => l.text.trim())")
    with page.expect_download(timeout=10_000) as download_info:
        page.get_by_role("button", name="Download WebVTT").click()
    download = download_info.value
    assert download.suggested_filename == f"transcript-{call_id}.vtt"
    vtt = webvtt.read(download.path())
    cues = list(vtt)
    assert len(cues) >= len(lines) >= 2, (len(cues), lines)
    starts = [seconds(c.start) for c in cues]
    assert starts == sorted(starts), starts
    assert all(seconds(c.end) > seconds(c.start) for c in cues), [(c.start, c.end) for c in cues]
    assert {c.voice for c in cues} == {"user", "agent"}, [c.raw_text for c in cues]
    # Each line read before the download is in a cue of its speaker (a line may have grown since:
    # deltas only append, and a final transcript starts with the stable text before it).
    cue_texts = [(c.voice, words(html.unescape(c.text))) for c in cues]
    for line in lines:
        voice = "agent" if line["who"] == "agent" else "user"
        assert any(v == voice and t.startswith(words(line["text"])) for v, t in cue_texts), (line, cue_texts)

    # A voice the server refuses (not one the model has: slipped into the picker here) is shown
    # as the server's error, and the picker goes back to the voice the session kept.
    at = mark(page)
    page.evaluate("document.getElementById('voice-select').add(new Option('nobody', 'nobody'))")
    page.get_by_label("Voice", exact=True).select_option("nobody")
    page.wait_for_function(
        "(at) => window.omni.events.slice(at).some((e) => e.type === 'error')", arg=at, timeout=15_000
    )
    refused = error_events(page)
    assert [e["error"].get("param") for e in refused] == ["session.audio.output.voice"], refused
    assert "nobody" in page.get_by_role("alert").inner_text()
    assert page.get_by_label("Voice", exact=True).input_value() == "aiden"

    hung = _stop(page)
    assert hung == 204
    assert error_events(page) == refused, error_events(page)  # no error but the one provoked


def _stop(page) -> int:
    with page.expect_response(lambda r: r.request.method == "DELETE") as response_info:
        page.get_by_role("button", name="Stop the call").click()
    return response_info.value.status


def _delete(url: str) -> int:
    request = urllib.request.Request(url, method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def test_reconnect_after_a_drop_but_not_after_stop(page, agent_url):
    posts: list[str] = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" and "/v1/realtime/calls" in r.url else None)
    page.goto(agent_url)
    page.get_by_role("button", name="Start the call").click()
    wait_connected(page)
    first = page.evaluate("window.omni.callUrl")

    # The server ends the call (not the user): the page counts down, then calls again.
    assert _delete(first) == 204
    # The page as it is when the countdown shows, read in one step: the countdown is 1 s, and a
    # second read could find the call back and the alert gone (CI, 2026-12-06).
    dropped = page.wait_for_function(
        """() => document.getElementById('state-text').textContent.startsWith('reconnecting in') && {
            state: document.getElementById('status').dataset.state,
            reconnect: window.omni.reconnect,
            alert: document.getElementById('error').hidden ? null : document.getElementById('error').textContent,
        }""",
        timeout=20_000,
    ).json_value()
    print(f"\ndropped: {dropped}")
    assert dropped["state"] == "reconnecting", dropped
    assert dropped["reconnect"]["attempt"] == 1, dropped
    assert dropped["alert"] is not None and dropped["reconnect"]["reason"] in dropped["alert"], dropped
    page.wait_for_function(
        "(first) => window.omni.state === 'connected' && window.omni.callUrl && window.omni.callUrl !== first",
        arg=first,
        timeout=CALL_TIMEOUT_S * 1000,
    )
    second = page.evaluate("window.omni.callUrl")
    second_id = second.rsplit("/", 1)[-1]
    assert page.locator("#call-id").inner_text() == second_id
    assert (
        page.get_by_role("link", name="Captions overlay").get_attribute("href") == f"captions.html?session={second_id}"
    )
    assert len(posts) == 2, posts

    # A retry refused with 403 is final: the reason is shown and no further try is made.
    page.route(
        "**/v1/realtime/calls*",
        lambda route: (
            route.fulfill(
                status=403,
                content_type="application/json",
                body='{"error": {"message": "this key was revoked", "type": "invalid_request_error", "code": "forbidden"}}',
            )
            if route.request.method == "POST"
            else route.continue_()
        ),
    )
    assert _delete(second) == 204
    page.wait_for_function("window.omni.state === 'failed'", timeout=20_000)
    error = page.get_by_role("alert").inner_text()
    assert "this key was revoked" in error and "HTTP 403" in error, error
    tries = len(posts)
    assert tries == 3, posts
    time.sleep(3)  # beyond the next backoff step (2 s)
    assert len(posts) == tries and page.evaluate("window.omni.state") == "failed"
    page.unroute("**/v1/realtime/calls*")

    # The user's own Stop: no reconnect.
    page.get_by_role("button", name="Start the call").click()
    wait_connected(page)
    assert _stop(page) == 204
    tries = len(posts)
    time.sleep(3)
    assert len(posts) == tries and page.evaluate("window.omni.state") == "closed"
    assert page.evaluate("window.omni.reconnect") is None


def test_modes_are_controls_and_the_url_follows_them(page, agent_url):
    page.goto(agent_url + "?interpret_to=German")
    assert page.get_by_label("Interpret into").is_checked()
    assert page.get_by_label("Target language").input_value() == "German"
    page.get_by_role("button", name="Start the call").click()
    wait_connected(page)
    created = page.evaluate("window.omni.events.find((e) => e.type === 'session.created').session")
    interpreting = wait_updated(page, 0, "s.omni.interpret_to === 'German'")
    assert "German" in interpreting["instructions"]
    assert interpreting["audio"]["input"]["turn_detection"]["interrupt_response"] is False

    # Back to a conversation mid-call: interpreter mode lifted, the first instructions back.
    at = mark(page)
    page.get_by_label("Conversation").check()
    plain = wait_updated(page, at, "s.omni.interpret_to === null")
    assert plain["instructions"] == created["instructions"]
    assert plain["audio"]["input"]["turn_detection"]["interrupt_response"] is True
    assert "interpret_to" not in page.evaluate("location.search")

    # Captions only: a new call, a transcription session; the user's words, no replies.
    conversation_call = page.evaluate("window.omni.callUrl")
    at = mark(page)
    page.get_by_label("Captions only").check()
    page.wait_for_function(
        "([at, first]) => window.omni.state === 'connected' && window.omni.callUrl !== first"
        " && window.omni.events.slice(at).some((e) => e.type === 'session.created')",
        arg=[at, conversation_call],
        timeout=CALL_TIMEOUT_S * 1000,
    )
    session = page.evaluate(
        "(at) => window.omni.events.slice(at).find((e) => e.type === 'session.created').session", at
    )
    assert session["type"] == "transcription", session
    assert page.evaluate("location.search") == "?captions"
    assert page.get_by_label("Message").is_disabled()
    page.wait_for_function(
        "(at) => window.omni.events.slice(at).some((e) => e.type === 'conversation.item.input_audio_transcription.completed')",
        arg=at,
        timeout=TURN_TIMEOUT_S * 1000,
    )
    assert page.evaluate(COUNT_AFTER_JS, ["response.created", at]) == 0
    assert _stop(page) == 204
    assert not error_events(page), error_events(page)
