// omni-agent browser client, and the reference client for the server's protocol: the OpenAI
// Realtime API (GA) over WebRTC. Camera + mic go out on media tracks, the agent's voice comes
// back on the same audio transceiver, and its events arrive as JSON on the "oai-events" data
// channel that this side creates. Signalling is one POST of the raw SDP offer to
// /v1/realtime/calls (201 + SDP answer + Location naming the call); hang-up is DELETE on that
// Location. No framework, no build step: ES modules, loaded by index.html.
//   state.js       window.omni and the page's elements
//   transcript.js  caption overlay and transcript panel
//   meter.js       latency readout (server figures and the page's own analyser)
//   signalling.js  keys, the offer POST, the hang-up DELETE
//   throttle.js    camera cap and the agent's back-pressure
//   controls.js    Mute, text box, call id and overlay link
//   ice.js         the agent's STUN/TURN servers, ?relay
// This file: start, stop, teardown, the server's events, and the wiring.
import { omni, ui, showError } from "./state.js";
import { captions, transcript } from "./transcript.js";
import { makeMeter, showLatency } from "./meter.js";
import { loadServerConfig, mintEphemeralKey, iceGatheringDone, postOffer, hangUp } from "./signalling.js";
import { capVideo, applyThrottle } from "./throttle.js";
import { newPeerConnection } from "./ice.js";
import { callControls, enableTextBox, callId, showCallId } from "./controls.js";

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
    case "conversation.item.input_audio_transcription.completed": // the user's words (?transcribe)
      transcript.user(ev.transcript);
      break;
    case "response.created":
      captions.line(ev.response.id);
      break;
    case "response.output_audio_transcript.delta": // words of a spoken reply
    case "response.output_text.delta": // words of a text-only reply
      captions.append(ev.response_id, ev.delta);
      transcript.agent(ev.response_id, ev.delta);
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

// What the page asks of the session: spoken replies unless the box says text only.
// With ?transcribe in the page's URL, the user's speech is transcribed live too (for
// captions.html?session=<call id>, which follows the call's events, and the transcript panel).
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

async function start() {
  teardown(); // a failed call leaves its peer behind until the next Start
  showError("");
  captions.clear();
  transcript.clear();
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

    const pc = (omni.pc = await newPeerConnection(token)); // the agent's STUN/TURN servers (ice.js)
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
    channel.addEventListener("open", () => {
      sendSessionConfig();
      if (omni.channel === channel) enableTextBox(true);
    });
    channel.addEventListener("close", () => enableTextBox(false));
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
    callControls(mic);
    const [cam] = media.getVideoTracks();
    if (cam) await capVideo(pc.addTransceiver(cam, { direction: "sendonly", streams: [media] }).sender, cam);

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringDone(pc);
    const answer = await postOffer(pc.localDescription.sdp, token);
    if (omni.pc !== pc) return hangUp(answer.callUrl, token); // Stop was pressed meanwhile
    omni.callUrl = answer.callUrl;
    showCallId(callId());
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
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
  omni.camera = null;
  hangUp(omni.callUrl, omni.token);
  omni.callUrl = null;
  callControls(null);
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

// getUserMedia exists only in a secure context (HTTPS, or http://localhost / 127.0.0.1):
// elsewhere Start could never work, so say why instead of failing on the click.
const canCapture = window.isSecureContext && Boolean(navigator.mediaDevices?.getUserMedia);
if (canCapture) {
  ui.start.addEventListener("click", start);
} else {
  ui.start.disabled = true;
  showError(
    "The microphone needs this page on localhost or HTTPS: the browser offers no microphone or camera " +
      `to ${window.location.origin}. Open it as http://localhost:<port>/ on the agent's machine, or serve it over HTTPS.`,
  );
}
ui.stop.addEventListener("click", stop);
ui.textOnly.addEventListener("change", sendSessionConfig); // takes effect from the next reply
ui.keyForm.addEventListener("submit", (e) => {
  e.preventDefault(); // Enter in the key field means Start (unless a call is already up)
  if (canCapture && !ui.start.disabled) start();
});
window.addEventListener("pagehide", teardown);
loadServerConfig();
