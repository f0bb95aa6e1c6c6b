// In-call controls: Mute, the text box (with a picture), and the call id with its captions-overlay link.
import { omni, ui, showError } from "./state.js";
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
  ui.pictureInput.disabled = !open;
}

// A typed message is a user item with input_text (and input_image, with a picture chosen), then
// a request for the reply.
function sendMessage(text, picture) {
  const content = [];
  if (text) content.push({ type: "input_text", text });
  if (picture) content.push({ type: "input_image", image_url: picture });
  omni.send({ type: "conversation.item.create", item: { type: "message", role: "user", content } });
  omni.send({ type: "response.create" });
  transcript.user(picture ? `${text} [picture]`.trim() : text);
}

// A chosen picture as a JPEG data URL, its longer side at most 896 px (what the agent shows the
// model for detail "auto") and small enough for one data-channel message (256 KiB): a lower
// quality where the first is too large.
const PICTURE_SIDE = 896;
const PICTURE_CHARS = 240_000;
async function pictureUrl(file) {
  const bitmap = await createImageBitmap(file);
  const scale = Math.min(1, PICTURE_SIDE / Math.max(bitmap.width, bitmap.height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  let url = "";
  for (const quality of [0.85, 0.6, 0.4]) {
    url = canvas.toDataURL("image/jpeg", quality);
    if (url.length <= PICTURE_CHARS) return url;
  }
  throw new Error("the picture is too detailed to send; try a smaller one");
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
ui.textForm.addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = ui.textInput.value.trim();
  const file = ui.pictureInput.files[0];
  if ((!text && !file) || ui.textInput.disabled) return;
  let picture = null;
  if (file) {
    try {
      picture = await pictureUrl(file);
    } catch (err) {
      showError(`Picture: ${err.message ?? err}`); // (a file the browser cannot decode lands here too)
      return;
    }
  }
  sendMessage(text, picture);
  ui.textInput.value = "";
  ui.pictureInput.value = "";
});
ui.copyOverlay.addEventListener("click", () => {
  navigator.clipboard?.writeText(ui.overlayLink.href).catch(() => {}); // no clipboard: the link is on screen
});
ui.download.addEventListener("click", () => transcript.download(callId()));
ui.downloadVtt.addEventListener("click", () => transcript.downloadVtt(callId()));
