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
//   devices.js     mic and camera pickers, switching mid-call (replaceTrack), Camera off
//   modes.js       conversation / captions only / interpret, and the session config they make
//   voices.js      the voice picker
//   reconnect.js   a new call, with backoff, after a dropped one
//   vtt.js         the transcript as WebVTT
// This file: start, stop, teardown, the server's events, and the wiring.
import { omni, ui, showError } from "./state.js";
import { captions, transcript } from "./transcript.js";
import { makeMeter, showLatency, showTurnTiming } from "./meter.js";
import { loadServerConfig, mintEphemeralKey, iceGatheringDone, postOffer, hangUp } from "./signalling.js";
import { capVideo, applyThrottle } from "./throttle.js";
import { newPeerConnection } from "./ice.js";
import { callControls, setMicTrack, enableTextBox, callId, showCallId } from "./controls.js";
import { listDevices, getMedia, attachCall, detachCall, onCameraToggled } from "./devices.js";
import * as modes from "./modes.js";
import { showVoices, onVoiceChosen, voiceRefused } from "./voices.js";
import { makeReconnector, DISCONNECTED_GRACE_MS } from "./reconnect.js";

// How long a hung-up call's peer waits for the server's answer to the DELETE before closing.
const HANGUP_WAIT_MS = 5000;

let media = null; // the local camera + mic stream
let meter = null; // WebAudio energy meter, see makeMeter()
let established = false; // the current call reached "connected" (so losing it is a drop)
let callIsCaptions = false; // the current call is a transcription session (captions only)

function setState(state) {
  omni.state = state;
  ui.status.dataset.state = state;
  ui.stateText.textContent = state;
  const live = state === "connecting" || state === "connected" || state === "reconnecting";
  ui.start.disabled = live;
  ui.stop.disabled = !live && state !== "disconnected";
}

const reconnector = makeReconnector({ connect: () => start({ retry: true }), setState });

// ---- server events ---------------------------------------------------------------------
// GA Realtime events; the project's extras ride in `omni` fields and `omni.*` events.
function onEvent(ev) {
  omni.events.push(ev);
  switch (ev.type) {
    case "session.created":
      omni.sessionId = ev.session?.id ?? null;
      omni.firstInstructions ??= ev.session?.instructions; // what leaving interpreter mode restores
      omni.session = ev.session ?? null;
      break;
    case "session.updated":
      omni.session = ev.session ?? null;
      break;
    case "input_audio_buffer.speech_started":
      captions.clear();
      meter?.cancelTurn();
      if (transcribing()) transcript.speechStarted(ev.item_id);
      break;
    case "input_audio_buffer.speech_stopped": // the server's end of turn: latency starts here
      meter?.endOfTurn();
      transcript.speechStopped(ev.item_id);
      break;
    // The user's words, when the session transcribes them: stable text as it comes, then the final.
    case "conversation.item.input_audio_transcription.delta":
      transcript.userDelta(ev.item_id, ev.delta ?? "");
      break;
    case "conversation.item.input_audio_transcription.completed":
      transcript.userCompleted(ev.item_id, ev.transcript);
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
    case "output_audio_buffer.stopped": // the reply has played out: its transcript cue ends
      transcript.agentStopped(ev.response_id);
      break;
    case "response.done":
      if (ev.response?.omni) showLatency(ev.response.omni);
      break;
    case "omni.turn_timing": // where the last turn's time went, stage by stage
      showTurnTiming(ev);
      break;
    case "input_video.throttle": // the agent is behind on video: send less (never less audio)
      applyThrottle(ev);
      break;
    case "omni.response.mode": // the server degraded (e.g. text only while overloaded): say so
      ui.mode.hidden = ev.mode === "audio";
      ui.mode.textContent = ev.mode === "audio" ? "" : `${ev.mode} mode${ev.reason ? `: ${ev.reason}` : ""}`;
      break;
    case "error": // shown whatever it is; a refused voice also puts the picker back
      showError(`Agent error: ${ev.error?.message ?? "unknown"}${ev.error?.code ? ` (${ev.error.code})` : ""}`);
      if (ev.error?.param === "session.audio.output.voice") voiceRefused();
      break;
  }
}

const transcribing = () => callIsCaptions || Boolean(omni.session?.audio?.input?.transcription);

// What the page asks of a conversation session (modes.js), sent when the channel opens and
// on every change of a control. A captions-only call got its session with the offer.
function sendSessionConfig() {
  if (!callIsCaptions) omni.send({ type: "session.update", session: modes.sessionUpdate() });
}

// A control changed: into the URL, and into the call when there is one. Captions only is a
// session type, fixed when a call is created: switching to or from it mid-call takes a new call.
function settingsChanged() {
  modes.writeUrl();
  modes.reflectMode();
  if (!omni.pc) return; // the next Start takes them
  if (modes.captionsOnly() !== callIsCaptions) {
    start({ keep: true });
    return;
  }
  sendSessionConfig();
}

// ---- call setup ------------------------------------------------------------------------
// opts.retry: a reconnect after a drop; opts.keep: a new call in the same sitting (a mode that
// needs one). Both keep the transcript and its clock: one conversation, however many calls.
async function start(opts = {}) {
  const fresh = !opts.retry && !opts.keep;
  if (!opts.retry) reconnector.cancel();
  teardown(); // a failed call leaves its peer behind until the next Start
  if (fresh) {
    showError("");
    captions.clear();
    transcript.clear();
    omni.events.length = 0;
    omni.callStart = performance.now();
  }
  omni.latency = {};
  omni.throttle = null;
  omni.session = null;
  ui.throttle.hidden = true;
  established = false;
  callIsCaptions = modes.captionsOnly();
  modes.newCall();
  setState("connecting");
  meter = makeMeter();
  try {
    if (omni.authRequired === null || !omni.config.voices?.length) {
      await loadServerConfig(); // the first load failed, or came before the model was loaded
      showVoices();
      modes.reflectMode();
    }
    const session = modes.creationSession();
    const token = (omni.token = omni.authRequired ? await mintEphemeralKey(session) : null);

    media = await getMedia();
    listDevices(); // with permission granted, the pickers can name the devices
    ui.video.srcObject = media;
    ui.placeholder.hidden = true;
    meter.watchMic(media);

    const pc = (omni.pc = await newPeerConnection(token)); // the agent's STUN/TURN servers (ice.js)
    let grace = null; // "disconnected": ICE may come back by itself before this runs out
    pc.addEventListener("connectionstatechange", () => {
      if (omni.pc !== pc) return; // a stopped call reporting late
      clearTimeout(grace);
      setState(pc.connectionState);
      if (pc.connectionState === "connected") {
        established = true;
        reconnector.connected();
      } else if (pc.connectionState === "disconnected") {
        grace = setTimeout(() => lost(pc, "the connection stayed disconnected"), DISCONNECTED_GRACE_MS);
      } else if (pc.connectionState === "failed" || pc.connectionState === "closed") {
        lost(pc, "no media path to the server");
      }
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
      if (omni.channel === channel) enableTextBox(!callIsCaptions);
    });
    channel.addEventListener("close", () => {
      // Not ours to close (teardown forgets the channel first, and callControls(null) shut
      // the text box): the server ended the call. A hung-up call's channel closes later, maybe
      // after the next call began: it must not touch that call's page.
      if (omni.channel !== channel) return;
      enableTextBox(false);
      lost(pc, "the server closed the call's events channel");
    });
    channel.addEventListener("message", (e) => {
      if (omni.channel !== channel) return; // a hung-up call's last words, after Stop
      try {
        onEvent(JSON.parse(e.data));
      } catch (err) {
        console.warn("unreadable event:", e.data, err);
      }
    });

    // sendrecv audio: the server answers on this same transceiver with the agent's voice.
    const [mic] = media.getAudioTracks();
    const micSender = pc.addTransceiver(mic, { direction: "sendrecv", streams: [media] }).sender;
    callControls(mic, fresh ? false : omni.muted); // Mute carries over a reconnect
    const [cam] = media.getVideoTracks();
    const camSender = cam ? pc.addTransceiver(cam, { direction: "sendonly", streams: [media] }).sender : null;
    if (cam) await capVideo(camSender, cam);
    const watch = meter;
    await attachCall({
      stream: media, mic: micSender, cam: camSender,
      onMic: (track) => { setMicTrack(track); watch.watchMic(new MediaStream([track])); },
    });

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringDone(pc);
    // The session goes with the offer (or with the key, when keyed): a transcription session is
    // made by it, and a conversation transcribes its first turn.
    const answer = await postOffer(pc.localDescription.sdp, token, {
      session: token ? null : session, priority: modes.priority(),
    });
    if (omni.pc !== pc) return hangUp(answer.callUrl, token); // Stop was pressed meanwhile
    omni.callUrl = answer.callUrl;
    showCallId(callId());
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
  } catch (err) {
    teardown();
    if (opts.retry) return reconnector.attemptFailed(err);
    setState("failed");
    showError(err.name === "NotAllowedError" ? "Camera/microphone permission was refused." : err.message);
  }
}

// The call went away without the user's Stop. One that was up is reconnected; a reconnect
// attempt that never got up counts as a failed try; a first call that never got up just failed.
function lost(pc, reason) {
  if (omni.pc !== pc) return;
  const wasUp = established;
  teardown();
  if (wasUp) reconnector.dropped(reason);
  else if (reconnector.active) reconnector.attemptFailed(new Error(reason));
  else {
    setState("failed");
    showError(`Connection failed: ${reason}.`);
  }
}

function teardown() {
  const pc = omni.pc;
  omni.pc = null; // before close(): its late state events are ignored
  omni.channel = null;
  omni.camera = null;
  const ended = hangUp(omni.callUrl, omni.token);
  omni.callUrl = null;
  established = false;
  detachCall();
  callControls(null);
  // The peer closes once the server has answered the DELETE (or after a bound): closed at
  // once, its DTLS close can reach the server first, which then ends the call as a dropped
  // peer and answers the DELETE 404. Our tracks stop now, so nothing is sent meanwhile.
  const closePeer = () => pc?.close();
  const bound = setTimeout(closePeer, HANGUP_WAIT_MS);
  ended.finally(() => { clearTimeout(bound); closePeer(); });
  media?.getTracks().forEach((t) => t.stop());
  media = null;
  meter?.close();
  meter = null;
  ui.video.srcObject = null;
  ui.audio.srcObject = null;
  ui.placeholder.hidden = false;
}

function stop() {
  reconnector.cancel(); // the user's Stop: no reconnect
  teardown();
  setState("closed");
}

// getUserMedia exists only in a secure context (HTTPS, or http://localhost / 127.0.0.1):
// elsewhere Start could never work, so say why instead of failing on the click.
const canCapture = window.isSecureContext && Boolean(navigator.mediaDevices?.getUserMedia);
if (canCapture) {
  ui.start.addEventListener("click", () => start());
} else {
  ui.start.disabled = true;
  showError(
    "The microphone needs this page on localhost or HTTPS: the browser offers no microphone or camera " +
      `to ${window.location.origin}. Open it as http://localhost:<port>/ on the agent's machine, or serve it over HTTPS.`,
  );
}
ui.stop.addEventListener("click", stop);
ui.keyForm.addEventListener("submit", (e) => {
  e.preventDefault(); // Enter in the key field means Start (unless a call is already up)
  if (canCapture && !ui.start.disabled) start();
});
// Every setting: into the URL and the call (a reply under way keeps what it began with).
// Camera off also tells the agent (omni.video); a device switch needs no word to the server.
modes.onChanged(settingsChanged);
onVoiceChosen(settingsChanged);
onCameraToggled(settingsChanged);
window.addEventListener("pagehide", () => {
  reconnector.cancel();
  teardown();
});

const { voice } = modes.readUrl();
modes.reflectMode();
listDevices();
loadServerConfig().then(() => {
  showVoices(voice);
  modes.reflectMode();
});
