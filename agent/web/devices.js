// Microphone and camera: the pickers (enumerateDevices: names once the page has permission,
// refreshed on devicechange), the call's media, switching device mid-call, and Camera off.
// A switch mid-call is RTCRtpSender.replaceTrack on the call's own sender: no renegotiation,
// the same call and call id; the new track starts muted if Mute is on, and stays off the wire
// while the camera is off.
import { omni, ui, showError } from "./state.js";
import { capVideo, applyThrottle } from "./throttle.js";

const AUDIO = { echoCancellation: true, noiseSuppression: true, autoGainControl: true };
const VIDEO = { width: 640, height: 480, frameRate: 15 };

// The call's media while there is one: {stream, mic: RTCRtpSender, cam: RTCRtpSender | null,
// onMic(track): Mute and the meter follow a new mic track}.
let call = null;
let switching = Promise.resolve(); // switches run one at a time, in the order asked

const withDevice = (base, id) => (id ? { ...base, deviceId: { exact: id } } : base);

// Fill a picker: "Default" (the browser's choice) and every device of its kind. Before the
// page has permission the browser names no device (and hides their ids): only "Default" then.
function fill(select, devices, noun) {
  const chosen = select.value;
  const options = [new Option("Default", "")];
  devices.forEach((d, i) => {
    if (d.deviceId && d.deviceId !== "default") options.push(new Option(d.label || `${noun} ${i + 1}`, d.deviceId));
  });
  select.replaceChildren(...options);
  select.value = options.some((o) => o.value === chosen) ? chosen : "";
  return select.value !== chosen; // the chosen device is gone (unplugged)
}

export async function listDevices() {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  const devices = await navigator.mediaDevices.enumerateDevices().catch(() => []);
  const micGone = fill(ui.micSelect, devices.filter((d) => d.kind === "audioinput"), "Microphone");
  const camGone = fill(ui.cameraSelect, devices.filter((d) => d.kind === "videoinput"), "Camera");
  // The call's device went away: carry on with the default one rather than with a dead track.
  if (micGone) switchDevice("audio");
  if (camGone) switchDevice("video");
}

// The call's camera + mic, from the chosen devices.
export async function getMedia() {
  const audio = withDevice(AUDIO, ui.micSelect.value);
  const video = withDevice(VIDEO, ui.cameraSelect.value);
  try {
    return await navigator.mediaDevices.getUserMedia({ audio, video });
  } catch (err) {
    // No camera (or camera refused) should not cost the user the conversation.
    if (err.name !== "NotFoundError" && err.name !== "NotReadableError") throw err;
    showError("No camera available: voice only.");
    return navigator.mediaDevices.getUserMedia({ audio });
  }
}

export async function attachCall(media) {
  call = media;
  await setCameraOff(omni.cameraOff); // off before the call: it starts off
}

export function detachCall() {
  call = null;
}

function switchDevice(kind) {
  switching = switching.then(() => replace(kind)).catch((err) => showError(`Could not switch the ${kind === "audio" ? "microphone" : "camera"}: ${err.message}`));
  return switching;
}

async function replace(kind) {
  const sender = kind === "audio" ? call?.mic : call?.cam;
  if (!sender) return; // no call (the next Start uses the choice), or a call without a camera
  const media = call;
  const stream = await navigator.mediaDevices.getUserMedia(
    kind === "audio" ? { audio: withDevice(AUDIO, ui.micSelect.value) } : { video: withDevice(VIDEO, ui.cameraSelect.value) },
  );
  const [track] = stream.getTracks();
  if (call !== media) return track.stop(); // the call ended meanwhile
  track.enabled = kind === "audio" ? !omni.muted : !omni.cameraOff;
  if (kind === "audio" || !omni.cameraOff) await sender.replaceTrack(track);
  for (const old of media.stream.getTracks().filter((t) => t.kind === kind)) {
    media.stream.removeTrack(old);
    old.stop();
  }
  media.stream.addTrack(track);
  ui.video.srcObject = media.stream;
  if (kind === "audio") {
    media.onMic(track);
  } else {
    await capVideo(sender, track); // the page's cap, for this camera's size
    if (omni.throttle) await applyThrottle(omni.throttle); // and the agent's back-pressure still holds
  }
}

// Camera off: the sender sends nothing (replaceTrack(null)) and the self-view goes dark; the
// agent is told separately (session.update omni.video, modes.js). On: the camera track again.
async function setCameraOff(off) {
  omni.cameraOff = off;
  ui.cameraOff.setAttribute("aria-pressed", String(off));
  if (!call) return;
  const [cam] = call.stream.getVideoTracks();
  if (cam) cam.enabled = !off;
  if (call.cam) await call.cam.replaceTrack(off ? null : cam ?? null);
}

// Camera off / on; `toggled()` then tells the agent.
export function onCameraToggled(toggled) {
  ui.cameraOff.addEventListener("click", async () => {
    await setCameraOff(!omni.cameraOff);
    toggled();
  });
}

ui.micSelect.addEventListener("change", () => switchDevice("audio"));
ui.cameraSelect.addEventListener("change", () => switchDevice("video"));
navigator.mediaDevices?.addEventListener?.("devicechange", listDevices);
