// What the page asks of the session: its mode (a conversation, captions only, or interpreting
// into a language), the user's speech transcribed or not, text-only replies, the voice, the
// camera as video, and the priority class. The controls start from the page's URL (?transcribe,
// ?captions, ?interpret_to=French, ?priority=high, ?voice=ethan, ?text) and the URL follows them,
// so a bookmark keeps a setup.
import { omni, ui } from "./state.js";

// What a transcribing session transcribes with (the loaded model's Thinker).
const TRANSCRIBER = { model: "qwen3-omni-thinker" };

export function mode() {
  return ui.modes.find((r) => r.checked)?.value ?? "conversation";
}

function selectMode(value) {
  const radio = ui.modes.find((r) => r.value === value);
  if (radio) radio.checked = true;
}

// Captions only is a transcription session (the server's cheapest: the user's words transcribed
// live, nothing answered, no voice sent back). Its type is fixed when the call is created, so
// switching to or from it takes a new call.
export const captionsOnly = () => mode() === "captions";

export function interpretTo() {
  const language = ui.interpretTo.value.trim();
  return mode() === "interpret" && language ? language : null;
}

// The page's URL as the controls' first values. `voice` waits for the voice list (voices.js).
export function readUrl() {
  const q = new URLSearchParams(window.location.search);
  const on = (name) => q.has(name) && q.get(name) !== "0";
  ui.transcribe.checked = on("transcribe");
  ui.textOnly.checked = on("text");
  ui.highPriority.checked = q.get("priority") === "high";
  if (q.get("interpret_to")) {
    ui.interpretTo.value = q.get("interpret_to");
    selectMode("interpret");
  }
  if (on("captions")) selectMode("captions");
  return { voice: q.get("voice") };
}

// The controls back into the URL (replaceState: no history entry per click).
export function writeUrl() {
  const q = new URLSearchParams();
  if (ui.transcribe.checked) q.set("transcribe", "");
  if (ui.textOnly.checked) q.set("text", "");
  if (captionsOnly()) q.set("captions", "");
  if (interpretTo()) q.set("interpret_to", interpretTo());
  if (ui.highPriority.checked) q.set("priority", "high");
  if (ui.voiceSelect.value && ui.voiceSelect.value !== omni.config.default_voice) q.set("voice", ui.voiceSelect.value);
  const search = q.toString().replace(/=(?=&|$)/g, ""); // ?transcribe, not ?transcribe=
  window.history.replaceState(null, "", `${window.location.pathname}${search ? `?${search}` : ""}`);
}

export const priority = () => (ui.highPriority.checked ? "high" : null);

// The session part of the offer (and of a minted key): what must be fixed at creation, and
// what the first turn needs (input transcription, the voice): the user may start speaking
// before the data channel opens and the first session.update can go out.
export function creationSession() {
  const session = captionsOnly() ? { type: "transcription" } : { type: "realtime" };
  if (priority()) session.omni = { priority: priority() };
  if (!captionsOnly()) {
    session.output_modalities = [ui.textOnly.checked ? "text" : "audio"];
    session.audio = { input: { transcription: ui.transcribe.checked ? TRANSCRIBER : null } };
    if (ui.voiceSelect.value) session.audio.output = { voice: ui.voiceSelect.value };
  }
  return session;
}

let interpreting = null; // the interpret_to the server was last sent (null: off)

// The session.update of a conversation call: the whole of what the controls say, sent when the
// data channel opens and again on every change (the server acts only on what changed).
export function sessionUpdate() {
  const session = {
    type: "realtime",
    output_modalities: [ui.textOnly.checked ? "text" : "audio"],
    audio: { input: { transcription: ui.transcribe.checked ? TRANSCRIBER : null } },
    omni: { video: !omni.cameraOff, interpret_to: interpretTo() },
  };
  if (ui.voiceSelect.value) session.audio.output = { voice: ui.voiceSelect.value };
  // Interpreter mode set the interpreter's instructions and turned barge-in off; lifting it
  // (interpret_to null) keeps both, so leaving it asks for the session's first ones back.
  if (interpreting && !interpretTo()) {
    session.instructions = omni.firstInstructions ?? "";
    session.audio.input.turn_detection = { interrupt_response: true };
  }
  interpreting = interpretTo();
  return session;
}

// A new call starts with interpreter mode off on the server.
export function newCall() {
  interpreting = null;
}

// `changed()` runs after any mode control changes (typing a language picks "Interpret into").
export function onChanged(changed) {
  for (const input of [ui.textOnly, ui.transcribe, ui.highPriority, ...ui.modes]) {
    input.addEventListener("change", changed);
  }
  ui.interpretTo.addEventListener("change", () => {
    if (ui.interpretTo.value.trim()) selectMode("interpret");
    changed();
  });
}

// While in captions only the conversation's controls do nothing: say so by disabling them.
export function reflectMode() {
  const captions = captionsOnly();
  ui.textOnly.disabled = captions;
  ui.transcribe.disabled = captions; // a transcription session always transcribes
  ui.voiceSelect.disabled = captions || ui.voiceSelect.options.length <= 1;
}
