// The camera's encoder settings: the page's own cap, and the agent's back-pressure on top.
import { omni, ui } from "./state.js";

// The agent looks at 4 frames per second at most; more only costs server decode time.
const VIDEO_MAX_FPS = 4;
const VIDEO_MAX_WIDTH = 640;

// Ask the encoder for what the agent uses, so neither side spends CPU on frames it drops.
export async function capVideo(sender, track) {
  const params = sender.getParameters();
  if (!params.encodings || params.encodings.length === 0) return; // nothing to tune
  const width = track.getSettings().width || VIDEO_MAX_WIDTH;
  const scale = width > VIDEO_MAX_WIDTH ? width / VIDEO_MAX_WIDTH : 1;
  omni.camera = { sender, fps: VIDEO_MAX_FPS, scale };
  params.encodings[0].maxFramerate = VIDEO_MAX_FPS;
  if (scale > 1) params.encodings[0].scaleResolutionDownBy = scale;
  try {
    await sender.setParameters(params);
  } catch (err) {
    console.warn("video cap not applied:", err); // the call still works at full rate
  }
}

// The agent's back-pressure: it asks for a lower frame rate and resolution, or a paused
// camera, while its video backlog is high, and for the full rate again once it has drained.
// Applied to the encoder itself, on top of the page's own cap; the self-view is untouched.
export async function applyThrottle(ev) {
  omni.throttle = ev;
  const cam = omni.camera;
  const slowed = ev.paused || ev.max_fps < VIDEO_MAX_FPS || ev.scale_resolution_down_by > 1;
  ui.throttle.hidden = !slowed;
  ui.throttle.textContent = ev.paused ? "camera paused: agent busy"
    : `camera ${ev.max_fps} fps${ev.scale_resolution_down_by > 1 ? `, 1/${ev.scale_resolution_down_by} size` : ""}: agent busy`;
  if (!cam) return;
  const params = cam.sender.getParameters();
  if (!params.encodings || params.encodings.length === 0) return;
  const enc = params.encodings[0];
  enc.active = !ev.paused;
  enc.maxFramerate = Math.max(0.5, Math.min(cam.fps, Number(ev.max_fps) || cam.fps));
  enc.scaleResolutionDownBy = cam.scale * Math.max(1, Number(ev.scale_resolution_down_by) || 1);
  try {
    await cam.sender.setParameters(params);
  } catch (err) {
    console.warn("throttle not applied:", err);
  }
}
