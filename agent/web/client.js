// omni-agent browser client, and the reference client for the server's protocol: the OpenAI
// Realtime API (GA) over WebRTC. Camera + mic go out on media tracks, the agent's voice comes
// back on the same audio transceiver, and its events arrive as JSON on the "oai-events" data
// channel that this side creates. Signalling is one POST of the raw SDP offer to
// /v1/realtime/calls (201 + SDP answer + Location naming the call); hang-up is DELETE on that
// Location. No framework, no build step.
"use strict";

// aiortc does no trickle ICE, so the offer must carry every candidate: wait for gathering
// to finish, but never longer than this (a host with a dead interface can stall it).
const ICE_GATHER_TIMEOUT_MS = 2000;
// The agent looks at 4 frames per second at most; more only costs server decode time.
const VIDEO_MAX_FPS = 4;
const VIDEO_MAX_WIDTH = 640;
// RMS that counts as "audible": about -40 dBFS, above Opus comfort noise, below speech.
const AUDIBLE_RMS = 0.01;
// Analyser poll period; it bounds the resolution of the client-side latency numbers.
const METER_PERIOD_MS = 10;
// Lifetime asked for the ephemeral key (the server's default). The key authorizes the
// signalling POST and, later, the hang-up DELETE; a call that outlives it still ends on the
// server when the peer connection closes.
const EPHEMERAL_KEY_SECONDS = 600;

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), stateText: $("state-text"), mode: $("mode"), error: $("error"),
  start: $("start"), stop: $("stop"), video: $("self-view"), placeholder: $("placeholder"),
  captions: $("captions"), audio: $("agent-audio"), keyForm: $("key-form"), key: $("api-key"),
  textOnly: $("text-only"), throttle: $("camera-throttle"),
  ttft: $("ttft"), ttfa: $("ttfa"), eotV2v: $("eot-v2v"), v2v: $("v2v"),
};

// Tests and curious people read this: every data-channel message lands in `events`.
// callUrl is the call's Location (what DELETE hangs up), token the call's ek_ key (null when
// the server is open), authRequired what GET /v1/omni/config said. camera is the video
// sender and its own cap ({sender, fps, scale}); throttle the agent's last input_video.throttle.
const omni = (window.omni = {
  pc: null, channel: null, state: "new", sessionId: null, callUrl: null, token: null, authRequired: null,
  events: [], latency: {}, camera: null, throttle: null,
  send(message) {
    if (omni.channel && omni.channel.readyState === "open") omni.channel.send(JSON.stringify(message));
  },
});

let media = null; // the local camera + mic stream
let meter = null; // WebAudio energy meter, see makeMeter()

function setState(state) {
  omni.state = state;
  ui.status.dataset.state = state;
  ui.stateText.textContent = state;
  const live = state === "connecting" || state === "connected";
  ui.start.disabled = live;
  ui.stop.disabled = !live && state !== "disconnected";
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

const ms = (v) => (Number.isFinite(v) ? `${Math.round(v)} ms` : "–");

// ---- captions ------------------------------------------------------------------------
// One <p> per reply. A new reply pushes the previous one up where CSS fades it; a new
// speech_started clears them all, since the server has already stopped (barged in on)
// whatever was playing and its words would only mislead.
const captions = {
  line(responseId) {
    let p = ui.captions.querySelector(`p[data-response="${CSS.escape(String(responseId))}"]`);
    if (!p) {
      for (const old of ui.captions.children) old.classList.add("old");
      p = document.createElement("p");
      p.dataset.response = String(responseId);
      ui.captions.append(p);
      while (ui.captions.children.length > 3) ui.captions.firstElementChild.remove();
    }
    return p;
  },
  append(responseId, delta) {
    this.line(responseId).textContent += delta; // textContent: model output is never HTML
  },
  clear() {
    ui.captions.replaceChildren();
  },
};

// ---- latency meter ---------------------------------------------------------------------
// Voice-to-voice is measured where the user hears it: the first remote audio above
// AUDIBLE_RMS after the end of a turn, read off an AnalyserNode on the remote stream.
// A second analyser on the mic remembers when the user last made sound, so the page can
// also report the full mic-quiet -> reply-audible time (it includes the server's VAD silence).
function makeMeter() {
  const ctx = new AudioContext(); // created inside the Start click: no autoplay block
  const buf = new Float32Array(512);
  const tap = (stream) => {
    const analyser = ctx.createAnalyser();
    analyser.fftSize = buf.length; // ~10 ms at 48 kHz: short windows give sharp onsets
    ctx.createMediaStreamSource(stream).connect(analyser); // analysers are pulled unconnected
    return analyser;
  };
  const rms = (analyser) => {
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    for (const v of buf) sum += v * v;
    return Math.sqrt(sum / buf.length);
  };
  const m = {
    mic: null, remote: null, lastMicSound: null, turnEndedAt: null, micQuietAt: null,
    watchMic(stream) { m.mic = tap(stream); },
    watchRemote(stream) { m.remote = tap(stream); },
    endOfTurn() { m.turnEndedAt = performance.now(); m.micQuietAt = m.lastMicSound; },
    cancelTurn() { m.turnEndedAt = null; },
    close() { clearInterval(timer); ctx.close(); },
  };
  const timer = setInterval(() => {
    const now = performance.now();
    if (m.mic && rms(m.mic) > AUDIBLE_RMS) m.lastMicSound = now;
    if (m.remote && m.turnEndedAt !== null && rms(m.remote) > AUDIBLE_RMS) {
      omni.latency.eot_to_audible_ms = now - m.turnEndedAt;
      omni.latency.voice_to_voice_ms = m.micQuietAt === null ? NaN : now - m.micQuietAt;
      ui.eotV2v.textContent = ms(omni.latency.eot_to_audible_ms);
      ui.v2v.textContent = ms(omni.latency.voice_to_voice_ms);
      m.turnEndedAt = null; // one measurement per turn
    }
  }, METER_PERIOD_MS);
  ctx.resume();
  return m;
}

// ---- server events ---------------------------------------------------------------------
// GA Realtime events; the project's extras ride in `omni` fields and `omni.*` events.
function onEvent(ev) {
  omni.events.push(ev);
  switch (ev.type) {
    case "session.created":
      omni.sessionId = ev.session?.id ?? null;
      break;
    case "input_audio_buffer.speech_started":
      captions.clear();
      meter?.cancelTurn();
      break;
    case "input_audio_buffer.speech_stopped": // the server's end of turn: latency starts here
      meter?.endOfTurn();
      break;
    case "response.created":
      captions.line(ev.response.id);
      break;
    case "response.output_audio_transcript.delta": // words of a spoken reply
    case "response.output_text.delta": // words of a text-only reply
      captions.append(ev.response_id, ev.delta);
      break;
    case "output_audio_buffer.started": // the reply's first audio left the server
      if (ev.omni) showLatency({ ttfa_ms: ev.omni.ttfa_ms });
      break;
    case "response.done":
      if (ev.response?.omni) showLatency(ev.response.omni);
      break;
    case "input_video.throttle": // the agent is behind on video: send less (never less audio)
      applyThrottle(ev);
      break;
    case "omni.response.mode": // the server degraded (e.g. text only while overloaded): say so
      ui.mode.hidden = ev.mode === "audio";
      ui.mode.textContent = ev.mode === "audio" ? "" : `${ev.mode} mode${ev.reason ? `: ${ev.reason}` : ""}`;
      break;
    case "error":
      showError(`Agent error: ${ev.error?.message ?? "unknown"}${ev.error?.code ? ` (${ev.error.code})` : ""}`);
      break;
  }
}

// Server-side figures (ms, null when the reply had none, e.g. no audio in text mode).
function showLatency(figures) {
  for (const key of ["ttft_ms", "ttfa_ms"]) {
    if (!(key in figures)) continue;
    omni.latency[key] = figures[key];
    ui[key === "ttft_ms" ? "ttft" : "ttfa"].textContent = ms(figures[key]);
  }
}

// What the page asks of the session: spoken replies unless the box says text only.
// With ?transcribe in the page's URL, the user's speech is transcribed live too (for
// captions.html?session=<call id>, which follows the call's events).
function sendSessionConfig() {
  const session = { type: "realtime", output_modalities: [ui.textOnly.checked ? "text" : "audio"] };
  const query = new URLSearchParams(window.location.search);
  if (query.has("transcribe")) {
    session.audio = { input: { transcription: { model: "qwen3-omni-thinker" } } };
  }
  // ?interpret_to=French: interpreter mode (every utterance answered by its translation).
  if (query.get("interpret_to")) session.omni = { interpret_to: query.get("interpret_to") };
  omni.send({ type: "session.update", session });
}

// ---- keys --------------------------------------------------------------------------------
// GET /v1/omni/config says whether the server wants a key (it needs none itself). If it
// does, the page shows the key field.
async function loadServerConfig() {
  try {
    const res = await fetch("v1/omni/config");
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    omni.authRequired = Boolean((await res.json()).auth_required);
  } catch (err) {
    omni.authRequired = null; // unknown: Start will find out from the call's own answer
    console.warn("GET v1/omni/config failed:", err);
  }
  ui.keyForm.hidden = !omni.authRequired;
}

// A short-lived ek_ key for one call, minted on this origin. With a key typed in, the page
// sends it; with none, it sends no Authorization so that a proxy in front of the agent
// (which knows the real key and authenticates its own users) can add it on this route only.
async function mintEphemeralKey() {
  const headers = { "Content-Type": "application/json" };
  const key = ui.key.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch("v1/realtime/client_secrets", {
    method: "POST",
    headers,
    body: JSON.stringify({
      expires_after: { anchor: "created_at", seconds: EPHEMERAL_KEY_SECONDS },
      session: { type: "realtime", output_modalities: [ui.textOnly.checked ? "text" : "audio"] },
    }),
  });
  if (!res.ok) {
    const hint = res.status === 401 ? (key ? " The API key was not accepted." : " This server needs an API key: enter it above.") : "";
    const message = await httpError(res, "The server refused to mint a key");
    throw new Error(hint ? `${message.replace(/\.?$/, ".")}${hint}` : message);
  }
  return (await res.json()).value;
}

// The server's JSON error: GA form {"error": {"message": ...}} or a plain {"error": "..."}.
async function httpError(res, what) {
  const body = await res.json().catch(() => ({}));
  const reason = body.error?.message ?? body.error ?? res.statusText;
  const retry = res.headers.get("Retry-After");
  return `${what} (HTTP ${res.status}): ${reason}` + (retry ? `. Try again in ${retry} s.` : "");
}

// ---- call setup ------------------------------------------------------------------------
async function getMedia() {
  const audio = { echoCancellation: true, noiseSuppression: true, autoGainControl: true };
  try {
    return await navigator.mediaDevices.getUserMedia({
      audio, video: { width: 640, height: 480, frameRate: 15 },
    });
  } catch (err) {
    // No camera (or camera refused) should not cost the user the conversation.
    if (err.name !== "NotFoundError" && err.name !== "NotReadableError") throw err;
    showError("No camera available: voice only.");
    return navigator.mediaDevices.getUserMedia({ audio });
  }
}

// Ask the encoder for what the agent uses, so neither side spends CPU on frames it drops.
async function capVideo(sender, track) {
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
async function applyThrottle(ev) {
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

function iceGatheringDone(pc) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    const finish = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => pc.iceGatheringState === "complete" && finish();
    const timer = setTimeout(finish, ICE_GATHER_TIMEOUT_MS);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

// GA signalling: the raw offer in, 201 with the raw answer and the call's Location out.
async function postOffer(sdp, token) {
  const headers = { "Content-Type": "application/sdp", Accept: "application/sdp" };
  if (token) headers.Authorization = `Bearer ${token}`;
  // Relative URL: works when the page is served under a path prefix, too.
  // The page's own ?priority=high (a session's priority class) rides along on the offer.
  const priority = new URLSearchParams(window.location.search).get("priority");
  const url = priority ? `v1/realtime/calls?priority=${encodeURIComponent(priority)}` : "v1/realtime/calls";
  const res = await fetch(url, { method: "POST", headers, body: sdp });
  if (res.status !== 201) throw new Error(await httpError(res, "The server refused the call"));
  const location = res.headers.get("Location");
  return { sdp: await res.text(), callUrl: location ? new URL(location, res.url).href : null };
}

async function start() {
  teardown(); // a failed call leaves its peer behind until the next Start
  showError("");
  captions.clear();
  omni.events.length = 0;
  omni.latency = {};
  omni.throttle = null;
  ui.throttle.hidden = true;
  setState("connecting");
  meter = makeMeter();
  try {
    if (omni.authRequired === null) await loadServerConfig(); // first load failed: ask again
    const token = (omni.token = omni.authRequired ? await mintEphemeralKey() : null);

    media = await getMedia();
    ui.video.srcObject = media;
    ui.placeholder.hidden = true;
    meter.watchMic(media);

    const pc = (omni.pc = new RTCPeerConnection()); // no STUN/TURN: host candidates only
    pc.addEventListener("connectionstatechange", () => {
      if (omni.pc !== pc) return; // a stopped call reporting late
      setState(pc.connectionState);
      if (pc.connectionState === "failed") showError("Connection failed: no media path to the server.");
      // A dead call should not keep the camera light on; the state line keeps the verdict.
      if (pc.connectionState === "failed" || pc.connectionState === "closed") teardown();
    });
    pc.addEventListener("track", (e) => {
      if (e.track.kind !== "audio") return;
      const stream = e.streams[0] || new MediaStream([e.track]);
      ui.audio.srcObject = stream; // also what makes Chrome feed the stream to WebAudio
      ui.audio.play().catch(() => {});
      meter.watchRemote(stream);
    });

    // The client creates "oai-events", before the offer, so the SDP carries an application
    // section; the server never opens a channel of its own.
    const channel = (omni.channel = pc.createDataChannel("oai-events"));
    channel.addEventListener("open", sendSessionConfig);
    channel.addEventListener("message", (e) => {
      try {
        onEvent(JSON.parse(e.data));
      } catch (err) {
        console.warn("unreadable event:", e.data, err);
      }
    });

    // sendrecv audio: the server answers on this same transceiver with the agent's voice.
    const [mic] = media.getAudioTracks();
    pc.addTransceiver(mic, { direction: "sendrecv", streams: [media] });
    const [cam] = media.getVideoTracks();
    if (cam) await capVideo(pc.addTransceiver(cam, { direction: "sendonly", streams: [media] }).sender, cam);

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringDone(pc);
    const answer = await postOffer(pc.localDescription.sdp, token);
    if (omni.pc !== pc) return hangUp(answer.callUrl, token); // Stop was pressed meanwhile
    omni.callUrl = answer.callUrl;
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
  } catch (err) {
    teardown();
    setState("failed");
    showError(err.name === "NotAllowedError" ? "Camera/microphone permission was refused." : err.message);
  }
}

// DELETE on the call's Location ends it on the server at once (closing the peer alone would
// leave the server waiting for ICE to time out). keepalive lets it outlive a closing page.
function hangUp(callUrl, token) {
  if (!callUrl) return;
  fetch(callUrl, {
    method: "DELETE", keepalive: true, headers: token ? { Authorization: `Bearer ${token}` } : {},
  }).catch((err) => console.warn("hang-up failed:", err));
}

function teardown() {
  const pc = omni.pc;
  omni.pc = null; // before close(): its late state events are ignored
  omni.channel = null;
  omni.camera = null;
  hangUp(omni.callUrl, omni.token);
  omni.callUrl = null;
  pc?.close();
  media?.getTracks().forEach((t) => t.stop());
  media = null;
  meter?.close();
  meter = null;
  ui.video.srcObject = null;
  ui.audio.srcObject = null;
  ui.placeholder.hidden = false;
}

function stop() {
  teardown();
  setState("closed");
}

ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", stop);
ui.textOnly.addEventListener("change", sendSessionConfig); // takes effect from the next reply
ui.keyForm.addEventListener("submit", (e) => {
  e.preventDefault(); // Enter in the key field means Start (unless a call is already up)
  if (!ui.start.disabled) start();
});
window.addEventListener("pagehide", teardown);
loadServerConfig();
