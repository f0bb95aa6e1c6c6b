// What was said: the caption overlay on the video (the last few replies) and the transcript
// panel (the whole call, both sides, downloadable as .txt).
import { omni, ui } from "./state.js";

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
const WHO = { you: "You", agent: "Agent" };

function addLine(who, text, responseId) {
  const entry = { who, text, responseId };
  omni.transcript.push(entry);
  const li = document.createElement("li");
  li.dataset.speaker = who;
  if (responseId !== undefined) li.dataset.response = String(responseId);
  const tag = document.createElement("span");
  tag.className = "who";
  tag.textContent = WHO[who];
  const body = document.createElement("span");
  body.className = "said";
  body.textContent = text;
  li.append(tag, " ", body);
  ui.transcript.append(li);
  li.scrollIntoView?.({ block: "nearest" });
  ui.download.disabled = false;
  return { entry, body };
}

const replies = new Map(); // response id -> {entry, body}

export const transcript = {
  user(text) {
    if (text && text.trim()) addLine("you", text.trim());
  },
  agent(responseId, delta) {
    let line = replies.get(responseId);
    if (!line) replies.set(responseId, (line = addLine("agent", "", responseId)));
    line.entry.text += delta;
    line.body.textContent = line.entry.text;
  },
  clear() {
    omni.transcript.length = 0;
    replies.clear();
    ui.transcript.replaceChildren();
    ui.download.disabled = true;
  },
  text() {
    return omni.transcript.map((l) => `${WHO[l.who]}: ${l.text}`).join("\n") + "\n";
  },
  download(callId) {
    const url = URL.createObjectURL(new Blob([transcript.text()], { type: "text/plain;charset=utf-8" }));
    const a = document.createElement("a");
    a.href = url;
    a.download = `transcript${callId ? `-${callId}` : ""}.txt`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  },
};
