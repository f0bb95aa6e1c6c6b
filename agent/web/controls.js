// In-call controls: Mute, the text box, and the call id with its captions-overlay link.
import { omni, ui } from "./state.js";
import { transcript } from "./transcript.js";

let mic = null; // the mic track the call sends (the RTCRtpSender's own track)

// A disabled track still sends, but silence: the agent's VAD hears no speech, so no turn starts.
function setMuted(muted) {
  omni.muted = muted;
  if (mic) mic.enabled = !muted;
  ui.mute.setAttribute("aria-pressed", String(muted));
}

// Called with the mic track once the call has one (and whether it starts muted: a reconnect
// keeps Mute as it was), and with null when the call ends.
export function callControls(track, muted = omni.muted) {
  mic = track;
  if (track) setMuted(muted);
  ui.mute.disabled = !track;
  if (!track) {
    enableTextBox(false);
    showCallId(null);
  }
}

// A new mic track mid-call (a device switch): Mute applies to it as it did to the old one.
export function setMicTrack(track) {
  mic = track;
  setMuted(omni.muted);
}

// The text box works while the data channel is open.
export function enableTextBox(open) {
  ui.textInput.disabled = !open;
  ui.textSend.disabled = !open;
}

// A typed message is a user item with input_text, then a request for the reply.
function sendText(text) {
  omni.send({
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
  });
  omni.send({ type: "response.create" });
  transcript.user(text);
}

// The call id is the last path segment of the call's Location; captions.html follows it.
export function callId() {
  return omni.callUrl ? new URL(omni.callUrl).pathname.split("/").filter(Boolean).at(-1) : null;
}

export function showCallId(id) {
  ui.callInfo.hidden = !id;
  ui.callId.textContent = id ?? "";
  if (id) ui.overlayLink.href = `captions.html?session=${encodeURIComponent(id)}`;
  else ui.overlayLink.removeAttribute("href");
}

ui.mute.addEventListener("click", () => setMuted(!omni.muted));
ui.textForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.textInput.value.trim();
  if (!text || ui.textInput.disabled) return;
  sendText(text);
  ui.textInput.value = "";
});
ui.copyOverlay.addEventListener("click", () => {
  navigator.clipboard?.writeText(ui.overlayLink.href).catch(() => {}); // no clipboard: the link is on screen
});
ui.download.addEventListener("click", () => transcript.download(callId()));
ui.downloadVtt.addEventListener("click", () => transcript.downloadVtt(callId()));
