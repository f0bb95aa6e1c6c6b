// omni-agent browser client: camera + mic go out over WebRTC, the agent's voice comes back
// on the same audio transceiver and its words arrive as JSON on the "events" data channel
// (OpenAI Realtime API event names). No framework, no build step: this file is also the
// reference client for the server's contract.
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

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), stateText: $("state-text"), mode: $("mode"), error: $("error"),
  start: $("start"), stop: $("stop"), video: $("self-view"), placeholder: $("placeholder"),
  captions: $("captions"), audio: $("agent-audio"),
  ttft: $("ttft"), ttfa: $("ttfa"), eotV2v: $("eot-v2v"), v2v: $("v2v"),
};

// Tests and curious people read this: every data-channel message lands in `events`.
const omni = (window.omni = {
  pc: null, channel: null, state: "new", sessionId: null, events: [], latency: {},
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
function onEvent(ev) {
  omni.events.push(ev);
  switch (ev.type) {
    case "session.created":
      omni.sessionId = ev.session_id;
      break;
    case "input_audio_buffer.speech_started":
      captions.clear();
      meter?.cancelTurn();
      break;
    case "input_audio_buffer.speech_stopped":
      meter?.endOfTurn();
      break;
    case "response.created":
      captions.line(ev.response_id);
      break;
    case "response.text.delta":
      captions.append(ev.response_id, ev.delta);
      break;
    case "response.done":
      omni.latency.ttft_ms = ev.ttft_ms;
      omni.latency.ttfa_ms = ev.ttfa_ms;
      ui.ttft.textContent = ms(ev.ttft_ms);
      ui.ttfa.textContent = ms(ev.ttfa_ms);
      break;
    case "response.mode": // the server degraded (e.g. text only while overloaded): say so
      ui.mode.hidden = ev.mode === "audio";
      ui.mode.textContent = ev.mode === "audio" ? "" : `${ev.mode} mode${ev.reason ? `: ${ev.reason}` : ""}`;
      break;
    case "error":
      showError(`Agent error: ${ev.error?.message ?? "unknown"}${ev.error?.code ? ` (${ev.error.code})` : ""}`);
      break;
  }
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
  params.encodings[0].maxFramerate = VIDEO_MAX_FPS;
  if (width > VIDEO_MAX_WIDTH) params.encodings[0].scaleResolutionDownBy = width / VIDEO_MAX_WIDTH;
  try {
    await sender.setParameters(params);
  } catch (err) {
    console.warn("video cap not applied:", err); // the call still works at full rate
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

async function postOffer(desc) {
  // Relative URL: works when the page is served under a path prefix, too.
  const res = await fetch("offer", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ sdp: desc.sdp, type: desc.type }),
  });
  const body = await res.json().catch(() => ({}));
  if (!res.ok) {
    const retry = res.headers.get("Retry-After");
    throw new Error(`The server refused the call (HTTP ${res.status}): ${body.error || res.statusText}` +
      (retry ? `. Try again in ${retry} s.` : ""));
  }
  return body;
}

async function start() {
  teardown(); // a failed call leaves its peer behind until the next Start
  showError("");
  captions.clear();
  omni.events.length = 0;
  omni.latency = {};
  setState("connecting");
  meter = makeMeter();
  try {
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

    // The channel must exist before the offer so the SDP carries an application section.
    const channel = (omni.channel = pc.createDataChannel("events"));
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
    const answer = await postOffer(pc.localDescription);
    omni.sessionId = answer.session_id ?? omni.sessionId;
    await pc.setRemoteDescription({ type: answer.type, sdp: answer.sdp });
  } catch (err) {
    teardown();
    setState("failed");
    showError(err.name === "NotAllowedError" ? "Camera/microphone permission was refused." : err.message);
  }
}

function teardown() {
  const pc = omni.pc;
  omni.pc = null; // before close(): its late state events are ignored
  omni.channel = null;
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
window.addEventListener("pagehide", teardown);
