// The page's shared state, and the DOM elements every module writes to.
//
// Tests and curious people read window.omni: every data-channel message lands in `events`.
// callUrl is the call's Location (what DELETE hangs up), token the call's ek_ key (null when
// the server is open), authRequired what GET /v1/omni/config said. camera is the video
// sender and its own cap ({sender, fps, scale}); throttle the agent's last input_video.throttle.
// muted says whether the mic track is disabled, cameraOff whether the camera sends nothing;
// transcript is the panel's lines ({who: "you" | "agent", text, responseId?, itemId?, start,
// end}: start and end in ms since callStart, the performance.now() of the Start press).
// config is what GET /v1/omni/config said (voices, default_voice); session the last session
// the server echoed (session.created / session.updated); reconnect the pending retry, if any.
export const omni = (window.omni = {
  pc: null, channel: null, state: "new", sessionId: null, callUrl: null, token: null, authRequired: null,
  events: [], latency: {}, camera: null, throttle: null, muted: false, transcript: [],
  cameraOff: false, config: {}, session: null, callStart: 0, reconnect: null,
  send(message) {
    if (omni.channel && omni.channel.readyState === "open") omni.channel.send(JSON.stringify(message));
  },
});

const $ = (id) => document.getElementById(id);
export const ui = {
  status: $("status"), stateText: $("state-text"), mode: $("mode"), error: $("error"),
  start: $("start"), stop: $("stop"), mute: $("mute"), video: $("self-view"), placeholder: $("placeholder"),
  captions: $("captions"), audio: $("agent-audio"), keyForm: $("key-form"), key: $("api-key"),
  textOnly: $("text-only"), throttle: $("camera-throttle"),
  ttft: $("ttft"), ttfa: $("ttfa"), eotV2v: $("eot-v2v"), v2v: $("v2v"), turnStages: $("turn-stages"),
  textForm: $("text-form"), textInput: $("text-input"), textSend: $("text-send"), pictureInput: $("picture-input"),
  transcript: $("transcript"), download: $("download-transcript"),
  callInfo: $("call-info"), callId: $("call-id"), overlayLink: $("overlay-link"), copyOverlay: $("copy-overlay"),
  cameraOff: $("camera-off"), micSelect: $("mic-select"), cameraSelect: $("camera-select"),
  voiceSelect: $("voice-select"), interpretTo: $("interpret-to"), transcribe: $("transcribe"),
  highPriority: $("high-priority"), downloadVtt: $("download-vtt"),
  modes: [...document.querySelectorAll('input[name="mode"]')],
};

export function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

export const ms = (v) => (Number.isFinite(v) ? `${Math.round(v)} ms` : "–");
