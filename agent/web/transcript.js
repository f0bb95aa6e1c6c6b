// What was said: the caption overlay on the video (the last few replies) and the transcript
// panel (the whole call, both sides, downloadable as .txt and as WebVTT).
import { omni, ui } from "./state.js";
import { toVtt } from "./vtt.js";

// ---- captions ------------------------------------------------------------------------
// One <p> per reply. A new reply pushes the previous one up where CSS fades it; a new
// speech_started clears them all, since the server has already stopped (barged in on)
// whatever was playing and its words would only mislead.
export const captions = {
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

// ---- transcript panel ------------------------------------------------------------------
// One <li> per utterance, marked with who said it: the user's (typed, or transcribed by the
// server when the session transcribes) and the agent's (one line per reply, grown by its deltas).
// Each line keeps when it started and ended, as the page saw it (ms since the Start press), for
// the WebVTT download: a spoken line from its speech_started to its speech_stopped, a reply
// from its first words to the end of its audio (or its last words).
const WHO = { you: "You", agent: "Agent" };
const now = () => performance.now() - omni.callStart;

function addLine(who, text, key = {}) {
  const entry = { who, text, ...key, start: now(), end: now() };
  omni.transcript.push(entry);
  const li = document.createElement("li");
  li.dataset.speaker = who;
  if (key.responseId !== undefined) li.dataset.response = String(key.responseId);
  const tag = document.createElement("span");
  tag.className = "who";
  tag.textContent = WHO[who];
  const body = document.createElement("span");
  body.className = "said";
  body.textContent = text;
  li.append(tag, " ", body);
  li.hidden = !text; // a spoken line waits for its first words
  ui.transcript.append(li);
  if (text) shown(li);
  return { entry, body, li };
}

function shown(li) {
  li.hidden = false;
  li.scrollIntoView?.({ block: "nearest" });
  ui.download.disabled = false;
  ui.downloadVtt.disabled = false;
}

function setText(line, text) {
  line.entry.text = text;
  line.body.textContent = text; // textContent: model output is never HTML
  if (text && line.li.hidden) shown(line.li);
}

const replies = new Map(); // response id -> line
const spoken = new Map(); // user item id -> line (placed at speech_started, so in speaking order)

function save(text, type, name) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

export const transcript = {
  user(text) {
    if (text && text.trim()) addLine("you", text.trim());
  },
  // The user's speech, when the session transcribes it: a line for the item at speech_started
  // (hidden while empty), its stable words as deltas, the final transcript at completed.
  speechStarted(itemId) {
    if (itemId && !spoken.has(itemId)) spoken.set(itemId, addLine("you", "", { itemId }));
  },
  speechStopped(itemId) {
    const line = spoken.get(itemId);
    if (line) line.entry.end = now();
  },
  userDelta(itemId, delta) {
    this.speechStarted(itemId);
    setText(spoken.get(itemId), spoken.get(itemId).entry.text + delta);
  },
  userCompleted(itemId, text) {
    this.speechStarted(itemId);
    const line = spoken.get(itemId);
    setText(line, (text ?? line.entry.text).trim()); // its cue ends where the speech did
  },
  agent(responseId, delta) {
    let line = replies.get(responseId);
    if (!line) replies.set(responseId, (line = addLine("agent", "", { responseId })));
    setText(line, line.entry.text + delta);
    line.entry.end = now();
  },
  // The reply's audio finished playing out (output_audio_buffer.stopped): its cue ends here.
  agentStopped(responseId) {
    const line = replies.get(responseId);
    if (line) line.entry.end = Math.max(line.entry.end, now());
  },
  clear() {
    omni.transcript.length = 0;
    replies.clear();
    spoken.clear();
    ui.transcript.replaceChildren();
    ui.download.disabled = true;
    ui.downloadVtt.disabled = true;
  },
  text() {
    return omni.transcript.filter((l) => l.text).map((l) => `${WHO[l.who]}: ${l.text}`).join("\n") + "\n";
  },
  download(callId) {
    save(transcript.text(), "text/plain;charset=utf-8", `transcript${callId ? `-${callId}` : ""}.txt`);
  },
  downloadVtt(callId) {
    save(toVtt(omni.transcript), "text/vtt;charset=utf-8", `transcript${callId ? `-${callId}` : ""}.vtt`);
  },
};
