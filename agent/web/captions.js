// Caption overlay: follows a call's server events over SSE and shows the last few lines of
// what the user and the agent said. The user's lines come from live input transcription
// (conversation.item.input_audio_transcription.*, and the project's omni.input_audio_transcription.partial
// for a hypothesis with no new stable text: `omni.stable_chars` of `omni.text` are final, the rest
// is shown dimmed), the agent's from its reply transcript. The completed transcript replaces a
// user line's partials (it may be empty: the line goes), and marks the line data-final.
//
// Which call: `?session=<call id>` follows that call until it ends; `?follow=latest` follows
// whichever call is newest on the agent (of those the key may see), moving to each new one, so a
// browser source is set up once (GET v1/omni/calls/latest/events; the server says
// omni.call.started / omni.call.ended / omni.call.waiting).
//
// When to give up: a refusal that asking again cannot change (401/403 key, 404 unknown call,
// 410 call ended) stops the overlay with the reason on screen; anything else (network, 5xx, 503
// while the agent restarts) is retried with a backoff of 1 s doubling to 30 s, for ever.
import { applyStyle } from "./caption_style.js";
import { HttpError, readEvents } from "./event_stream.js";

const params = new URLSearchParams(window.location.search);
const callId = params.get("session") || params.get("call_id") || "";
const latest = params.get("follow") === "latest";
const key = params.get("key");
const ui = {
  lines: document.getElementById("lines"),
  latency: document.getElementById("latency"),
  status: document.getElementById("status"),
};
const BACKOFF_MS = [1000, 2000, 4000, 8000, 16000, 30000];
const STEADY_MS = 10_000; // a connection up this long starts the backoff over

// What the page has seen, for tests and debugging (window.captions).
const state = (window.captions = {
  mode: latest ? "latest" : callId ? "session" : "none",
  callId: latest ? null : callId,
  calls: 0, // calls followed (?follow=latest)
  connected: false,
  ended: false, // stopped for good: `reason` says why
  reason: "",
  status: "",
  httpStatus: null,
  retries: 0,
  events: 0,
  lines: [],
  figures: {},
  style: {},
  ignored: [],
});
let maxLines = 3;

function show(text) {
  state.status = text;
  ui.status.textContent = text;
  ui.status.hidden = !text;
}

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
        if (l.final) p.dataset.final = "true"; // the user's completed transcript: no longer changes
        const who = document.createElement("span");
        who.className = "who";
        who.textContent = l.speaker;
        const said = document.createElement("span");
        said.className = "said"; // carries the backing colour, line by line when it wraps
        const stable = document.createElement("span");
        stable.className = "stable";
        stable.textContent = l.stable;
        const tail = document.createElement("span");
        tail.className = "tail";
        tail.textContent = l.tail;
        said.append(stable, tail);
        p.append(who, said);
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
    case "omni.call.started": // ?follow=latest: a (newer) call is followed from here on
      state.callId = ev.call_id;
      state.calls += 1;
      state.lines = [];
      state.figures = {};
      show("");
      break;
    case "omni.call.ended":
      show("call ended");
      break;
    case "omni.call.waiting":
      state.callId = null;
      show(state.calls ? "call ended · waiting for the next call" : "waiting for a call");
      break;
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
      line.stable = ev.transcript || ""; // the final word: it may take back every partial
      line.tail = "";
      line.final = true;
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

const WHY = { 401: "the key was refused", 403: "not allowed", 404: "no such call", 410: "the call has ended" };

function stop(reason) {
  state.ended = true;
  state.connected = false;
  state.reason = reason;
  show(`stopped: ${reason}`);
}

async function run() {
  const { style, ignored } = applyStyle(params);
  Object.assign(state, { style, ignored });
  maxLines = style.lines;
  ui.latency.hidden = params.get("latency") === "0";
  document.addEventListener("keydown", (e) => {
    if (e.key === "l" || e.key === "L") ui.latency.hidden = !ui.latency.hidden;
  });
  render();
  if (state.mode === "none") {
    stop("no call to follow: add ?follow=latest or ?session=<call id> to the address");
    return;
  }
  const url = latest ? "v1/omni/calls/latest/events" : `v1/realtime/calls/${encodeURIComponent(callId)}/events`;
  show("connecting…");
  let failures = 0;
  while (!state.ended) {
    const opened = Date.now();
    let why = "the connection closed"; // the server ended the stream: a call that ended, or a restart
    try {
      await readEvents(url, {
        key,
        onEvent,
        onOpen: () => {
          state.connected = true;
          state.httpStatus = 200;
          if (!latest) show("");
        },
      });
    } catch (err) {
      if (err instanceof HttpError) {
        state.httpStatus = err.status;
        if (err.final) {
          stop(`${WHY[err.status] || "refused"} (HTTP ${err.status}): ${err.message}`);
          break;
        }
        why = `HTTP ${err.status}: ${err.message}`;
      } else {
        why = err.message;
      }
      console.warn("captions:", why);
    }
    state.connected = false;
    if (Date.now() - opened > STEADY_MS) failures = 0;
    const wait = BACKOFF_MS[Math.min(failures, BACKOFF_MS.length - 1)];
    failures += 1;
    state.retries += 1;
    show(`${why} · retrying in ${Math.round(wait / 1000)} s`);
    await new Promise((r) => setTimeout(r, wait));
  }
}

run();
