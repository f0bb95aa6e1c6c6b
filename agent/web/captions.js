// Caption overlay: follows one call's server events over SSE and shows the last few lines of
// what the user and the agent said. The user's lines come from live input transcription
// (conversation.item.input_audio_transcription.*, and the project's omni.input_audio_transcription.partial
// for a hypothesis with no new stable text: `omni.stable_chars` of `omni.text` are final, the rest
// is shown dimmed), the agent's from its reply transcript.
"use strict";

const params = new URLSearchParams(window.location.search);
const callId = params.get("session") || params.get("call_id") || "";
const maxLines = Math.max(1, Math.min(6, Number(params.get("lines")) || 3));
const key = params.get("key");
const ui = { lines: document.getElementById("lines"), latency: document.getElementById("latency") };

// What the page has seen, for tests and debugging (window.captions).
const state = (window.captions = { connected: false, ended: false, events: 0, lines: [], figures: {} });

function lineFor(id, speaker) {
  let line = state.lines.find((l) => l.id === id);
  if (!line) {
    line = { id, speaker, stable: "", tail: "" };
    state.lines.push(line);
    while (state.lines.length > 4 * maxLines) state.lines.shift(); // forget what is long gone
  }
  return line;
}

function render() {
  ui.lines.replaceChildren(
    ...state.lines
      .filter((l) => l.stable || l.tail)
      .slice(-maxLines) // the oldest rolls off
      .map((l) => {
        const p = document.createElement("p");
        p.className = "line";
        p.dataset.speaker = l.speaker;
        const who = document.createElement("span");
        who.className = "who";
        who.textContent = l.speaker;
        const stable = document.createElement("span");
        stable.className = "stable";
        stable.textContent = l.stable;
        const tail = document.createElement("span");
        tail.className = "tail";
        tail.textContent = l.tail;
        p.append(who, stable, tail);
        return p;
      }),
  );
  const f = state.figures;
  const ms = (v) => (typeof v === "number" ? `${Math.round(v)} ms` : "–");
  ui.latency.textContent =
    `first words ${ms(f.first_partial_ms)} · final ${ms(f.final_ms)} · reply audio ${ms(f.ttfa_ms)}`;
}

function onEvent(ev) {
  state.events += 1;
  switch (ev.type) {
    case "input_audio_buffer.speech_started":
      lineFor(ev.item_id, "user");
      break;
    case "omni.input_audio_transcription.partial": // the hypothesis changed, no new stable text
    case "conversation.item.input_audio_transcription.delta": {
      const line = lineFor(ev.item_id, "user");
      if (ev.omni && typeof ev.omni.text === "string") {
        line.stable = ev.omni.text.slice(0, ev.omni.stable_chars);
        line.tail = ev.omni.text.slice(ev.omni.stable_chars);
        if (line.first === undefined) line.first = state.figures.first_partial_ms = ev.omni.since_speech_ms;
      } else {
        line.stable += ev.delta || ""; // a server without the extra: append-only deltas
      }
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const line = lineFor(ev.item_id, "user");
      line.stable = ev.transcript || "";
      line.tail = "";
      if (ev.omni) state.figures.final_ms = ev.omni.after_end_ms;
      break;
    }
    case "response.created":
      lineFor(ev.response.id, "agent");
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      lineFor(ev.response_id, "agent").stable += ev.delta;
      break;
    case "response.done":
      if (ev.response?.omni) state.figures.ttfa_ms = ev.response.omni.ttfa_ms ?? ev.response.omni.ttft_ms;
      break;
    default:
      return;
  }
  render();
}

// EventSource cannot send a key, so the stream is read with fetch.
async function follow() {
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch(`v1/realtime/calls/${encodeURIComponent(callId)}/events`, { headers });
  if (res.status === 404) {
    state.ended = true; // no such call (or it has ended): nothing to follow
    return;
  }
  if (!res.ok) throw new Error(`events: HTTP ${res.status}`);
  state.connected = true;
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) {
        try {
          onEvent(JSON.parse(data));
        } catch (err) {
          console.warn("captions: bad event", err);
        }
      }
    }
  }
  state.connected = false;
  state.ended = true; // the call ended
}

async function run() {
  ui.latency.hidden = params.get("latency") === "0";
  document.addEventListener("keydown", (e) => {
    if (e.key === "l" || e.key === "L") ui.latency.hidden = !ui.latency.hidden;
  });
  render();
  if (!callId) return;
  // A dropped connection (not an ended call) is followed again after a pause.
  while (!state.ended) {
    try {
      await follow();
    } catch (err) {
      state.connected = false;
      console.warn("captions:", err);
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

run();
