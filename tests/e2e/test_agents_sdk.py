"""OpenAI's own browser Agents SDK (@openai/agents-realtime 0.20.0, unmodified, vendored under
tests/e2e/vendor/) talks to the agent with only its base URL changed.

In headless Chromium, a page on the agent's origin builds
`OpenAIRealtimeWebRTC({baseUrl: origin + "/v1/realtime/calls", useInsecureApiKey: true})`
inside a `RealtimeSession` and speaks through the fake mic. What it pins:
- `session.connect()` resolves because the agent answered the SDK's session.update with
  session.updated (the SDK otherwise resolves after a 5 s timeout with a warning, which
  fails this test);
- the reply is heard: a WebAudio analyser on the SDK's audio element measures audible
  sound after a response started, and inbound-rtp audio carries energy;
- the transcript reaches the SDK: `audio_transcript_delta` fires and the session history
  gains an assistant message;
- every standard event type the agent sent passed the SDK's own zod schemas (each raw
  event of a listed type was also emitted as a parsed, non-generic event);
- no client-side errors: no session `error` events, no uncaught page errors, no console
  errors or warnings from the SDK;
- a replayed history and a picture: `updateHistory` appending a system and an assistant message
  sends them as items the agent takes (no error; both in the SDK's history), and `addImage`
  (no response asked) puts the picture into the next spoken turn, whose response.done counts
  image tokens; no console errors;
- function calling: an agent with a `tool()` (a JSON-schema function, tool choice required)
  gets the call from the agent, runs the tool's `execute` in the page with arguments that
  match its schema, and the SDK's own function_call_output and response.create get a reply
  that is heard, with the call and an assistant message in the session history.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.browser

VENDOR = Path(__file__).resolve().parent / "vendor" / "agents-realtime"
CALL_TIMEOUT_S = 90

# GA server events the agent sends over WebRTC; each must survive the SDK's strict parse.
STRICT_TYPES = [
    "session.created",
    "session.updated",
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "conversation.item.added",
    "conversation.item.done",
    "conversation.item.retrieved",
    "response.created",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_audio_transcript.delta",
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "output_audio_buffer.started",
    "output_audio_buffer.stopped",
    "response.done",
    "error",
]

HARNESS = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>Agents SDK</title></head>
<body><audio id="out" autoplay></audio>
<script type="module">
import { OpenAIRealtimeWebRTC, RealtimeAgent, RealtimeSession, tool } from "./openai-realtime-agents.mjs";
const sdk = (window.sdk = { connected: false, errors: [], raw: {}, strict: {}, transcript: "",
                            history: [], responding: false, audible: false, calls: [], usages: [] });
const audio = document.getElementById("out");
const transport = new OpenAIRealtimeWebRTC({
  baseUrl: location.origin + "/v1/realtime/calls", useInsecureApiKey: true, audioElement: audio,
});
AGENT_SETUP
sdk.transport = transport;
sdk.session = session;
transport.on("response.done", (e) => { sdk.usages.push(e.response?.usage ?? null); });
transport.on("*", (e) => { sdk.raw[e.type] = (sdk.raw[e.type] ?? 0) + 1; });
for (const type of STRICT_TYPES) transport.on(type, () => { sdk.strict[type] = (sdk.strict[type] ?? 0) + 1; });
transport.on("response.created", () => { sdk.responding = sdk.calls.length >= CALLS_BEFORE_LISTENING; });
transport.on("audio_transcript_delta", (e) => { sdk.transcript += e.delta; });
session.on("history_updated", (h) => { sdk.history = h.map((i) => ({ type: i.type, role: i.role, name: i.name,
  content: (i.content ?? []).map((c) => c.type) })); });
session.on("error", (e) => sdk.errors.push(String(e?.error?.error?.message ?? e?.error?.message ?? e?.error ?? e)));

// The reply is heard: RMS of the SDK's own audio element's stream, after a response began.
const ctx = new AudioContext();
const buf = new Float32Array(512);
let analyser = null;
setInterval(() => {
  if (!analyser && audio.srcObject) {
    analyser = ctx.createAnalyser();
    analyser.fftSize = buf.length;
    ctx.createMediaStreamSource(audio.srcObject).connect(analyser);
  }
  if (!analyser || !sdk.responding) return;
  analyser.getFloatTimeDomainData(buf);
  let sum = 0;
  for (const v of buf) sum += v * v;
  if (Math.sqrt(sum / buf.length) > 0.01) sdk.audible = true;
}, 10);

try {
  await session.connect({ apiKey: "loopback-key-unused" });
  sdk.connected = true;
} catch (err) {
  sdk.errors.push("connect: " + String(err?.message ?? err));
}
</script></body></html>
"""

SNAPSHOT_JS = """async () => {
  const s = window.sdk;
  if (!s) return null;
  let energy = 0;
  const pc = s.transport.connectionState.peerConnection;
  if (pc) (await pc.getStats()).forEach((r) => {
    if (r.type === "inbound-rtp" && r.kind === "audio") energy = r.totalAudioEnergy ?? 0;
  });
  return { connected: s.connected, callId: s.transport.callId ?? null, errors: s.errors, raw: s.raw,
           strict: s.strict, transcript: s.transcript, history: s.history, audible: s.audible, energy,
           calls: s.calls, usages: s.usages };
}"""


# The plain agent, and one with a tool the model must call (tool choice required); its execute
# runs in the page and lets the next response be free (auto), so the reply after it is spoken.
PLAIN_AGENT = """const session = new RealtimeSession(
  new RealtimeAgent({ name: "Assistant", instructions: "Answer briefly." }),
  { transport, model: "qwen3-omni" });
const CALLS_BEFORE_LISTENING = 0;"""
TOOL_AGENT = """const setLight = tool({
  name: "set_light",
  description: "Turn a room's light on or off.",
  parameters: {
    type: "object",
    properties: { room: { type: "string", enum: ["kitchen", "hall"] }, on: { type: "boolean" } },
    required: ["room", "on"],
    additionalProperties: false,
  },
  strict: true,
  execute: async (input) => {
    sdk.calls.push(input);
    transport.updateSessionConfig({ toolChoice: "auto" });
    return `the ${input.room} light is ${input.on ? "on" : "off"}`;
  },
});
const session = new RealtimeSession(
  new RealtimeAgent({ name: "Assistant", instructions: "Answer briefly.", tools: [setLight] }),
  { transport, model: "qwen3-omni", config: { toolChoice: "required" } });
const CALLS_BEFORE_LISTENING = 1;"""
# GA events a call adds.
TOOL_TYPES = ["response.function_call_arguments.delta", "response.function_call_arguments.done"]


def serve_vendor(route) -> None:
    """The harnesses and the SDK's files, fulfilled by the browser itself on the agent's origin."""
    name = route.request.url.rsplit("/", 1)[-1].split("?")[0]
    if name in ("harness.html", "tools.html"):
        agent = TOOL_AGENT if name == "tools.html" else PLAIN_AGENT
        body = HARNESS.replace("STRICT_TYPES", repr(STRICT_TYPES + TOOL_TYPES)).replace("AGENT_SETUP", agent)
        route.fulfill(status=200, content_type="text/html", body=body)
    elif name.endswith(".mjs") and (VENDOR / name).is_file():
        route.fulfill(status=200, content_type="text/javascript", body=(VENDOR / name).read_bytes())
    else:
        route.fulfill(status=404, body="not vendored")


def run_harness(page, agent_url: str, harness: str, until) -> tuple[dict, list[str]]:
    """Open a harness page and poll its snapshot until `until(snapshot)` (bounded by
    CALL_TIMEOUT_S; a client-side error fails at once); returns the snapshot and the console's
    errors and warnings."""
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.route("**/agents-sdk/**", serve_vendor)
    page.goto(agent_url + f"agents-sdk/{harness}")
    return poll_snapshot(page, until, console), console


def rejected_by_the_sdk(snap: dict, types: list[str]) -> dict[str, tuple[int, int]]:
    """Event types of which the SDK parsed fewer than it received: (raw, parsed) counts."""
    return {
        t: (snap["raw"][t], snap["strict"].get(t, 0))
        for t in types
        if snap["raw"].get(t, 0) != snap["strict"].get(t, 0)
    }


def test_agents_sdk_connects_hears_the_reply_and_gets_the_transcript(page, agent_url):
    snap, console = run_harness(
        page,
        agent_url,
        "harness.html",
        lambda snap: bool(
            snap.get("connected")
            and snap["transcript"]
            and snap["audible"]
            and snap["raw"].get("response.done")
            and any(i["role"] == "assistant" for i in snap["history"])
        ),
    )

    assert snap["callId"] and snap["callId"].startswith("rtc_"), snap
    assert snap["raw"].get("session.updated") and snap["energy"] > 0, snap
    rejected = rejected_by_the_sdk(snap, STRICT_TYPES)
    assert not rejected, f"events the SDK's schemas rejected (raw, parsed): {rejected}"
    assert not console, f"console errors/warnings: {console}"
    print(f"\nAgents SDK transcript: {snap['transcript']!r}; events: {snap['raw']}")


def test_agents_sdk_replays_history_and_sends_a_picture(page, agent_url, tmp_path):
    _, console = run_harness(page, agent_url, "harness.html", lambda snap: bool(snap.get("connected")))
    out = io.BytesIO()
    ramp = np.linspace(0, 255, 320, dtype=np.uint8)
    Image.fromarray(np.stack([np.tile(ramp, (240, 1))] * 3, -1)).save(out, "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
    # updateHistory appends a system and an assistant message (the SDK sends each as an item);
    # addImage sends the picture as a user item, answered with the next turn (no response asked).
    page.evaluate(
        """(url) => {
          const s = window.sdk.session;
          s.updateHistory((h) => [...h,
            { itemId: "item_sys_1", type: "message", role: "system", content: [{ type: "input_text", text: "Be brief." }] },
            { itemId: "item_asst_1", type: "message", role: "assistant", status: "completed",
              content: [{ type: "output_text", text: "Noted." }] }]);
          s.addImage(url, { triggerResponse: false });
        }""",
        url,
    )
    # The picture is in the reply to the next spoken turn: a response.done counts its tokens.
    snap = poll_snapshot(
        page,
        lambda snap: any((u or {}).get("input_token_details", {}).get("image_tokens", 0) > 0 for u in snap["usages"]),
        console,
    )
    # (The SDK's history schema has no input_image for a user item, from any server: it keeps
    # the system and assistant messages, and the turns.)
    roles = [(i["role"], i["content"]) for i in snap["history"] if i["type"] == "message"]
    assert ("system", ["input_text"]) in roles and ("assistant", ["output_text"]) in roles, roles
    assert not console, f"console errors/warnings: {console}"


def poll_snapshot(page, until, console: list[str] = ()) -> dict:
    """Poll the open harness's snapshot until `until(snapshot)` (bounded by CALL_TIMEOUT_S; a
    client-side error fails at once)."""
    snap: dict = {}
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        snap = page.evaluate(SNAPSHOT_JS) or {}
        assert not snap.get("errors"), f"client-side errors: {snap['errors']}"
        if until(snap):
            return snap
        time.sleep(0.3)
    raise AssertionError(f"after {CALL_TIMEOUT_S} s: {snap}; console: {list(console)}")


def test_agents_sdk_tool_is_called_and_the_reply_after_it_heard(page, agent_url):
    snap, console = run_harness(
        page,
        agent_url,
        "tools.html",
        lambda snap: bool(
            snap.get("calls")
            and snap["audible"]
            and snap["raw"].get("response.done", 0) >= 2
            and any(i["role"] == "assistant" for i in snap["history"])
        ),
    )

    call = snap["calls"][0]
    assert call["room"] in ("kitchen", "hall") and isinstance(call["on"], bool), call
    kinds = [i["type"] for i in snap["history"]]
    assert "function_call" in kinds and kinds.index("function_call") < max(
        i for i, item in enumerate(snap["history"]) if item["role"] == "assistant"
    ), snap["history"]
    rejected = rejected_by_the_sdk(snap, STRICT_TYPES + TOOL_TYPES)
    assert not rejected, f"events the SDK's schemas rejected (raw, parsed): {rejected}"
    assert not console, f"console errors/warnings: {console}"
