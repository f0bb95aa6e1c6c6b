// The voice picker: the model's talker speakers, as GET /v1/omni/config lists them. The choice
// goes out as audio.output.voice (in the first session.update, and in one of its own when it
// changes mid-call); this server takes a new voice at any time, from the next reply on.
import { omni, ui } from "./state.js";

let asked = ""; // the voice last asked for (before the server had its say)
let before = ""; // the one before it: what the picker goes back to if the server refuses

// Fill the picker once the server has named its voices (none: it keeps its one "Default").
// `wanted`: the ?voice= of the page's URL, used when the model has that speaker.
export function showVoices(wanted) {
  const names = omni.config.voices ?? [];
  if (!names.length) return;
  const fallback = omni.config.default_voice ?? names[0];
  const keep = [ui.voiceSelect.value, wanted].find((v) => v && names.includes(v)) ?? fallback;
  ui.voiceSelect.replaceChildren(
    ...names.map((name) => new Option(name === fallback ? `${name} (default)` : name, name)),
  );
  ui.voiceSelect.value = keep;
  asked = before = keep;
}

// The user picked a voice: remember the one to go back to, then `chosen()` sends it.
export function onVoiceChosen(chosen) {
  ui.voiceSelect.addEventListener("change", () => {
    before = asked;
    asked = ui.voiceSelect.value;
    chosen();
  });
}

// The server's `error` for session.audio.output.voice: the session kept its voice, so should the picker.
export function voiceRefused() {
  ui.voiceSelect.value = asked = before;
}
