// The transcript as WebVTT: one cue per utterance, timed as the page saw the call (ms since
// Start), with <v user> / <v agent> voice tags, so a video editor or player can lay it under a
// recording of the call.

// A cue needs end > start; an utterance seen in one event (a typed line) gets this much.
const MIN_CUE_MS = 500;

// hh:mm:ss.ttt, as WebVTT wants it (hours always written: calls may pass an hour).
export function vttTime(ms) {
  const total = Math.max(0, Math.round(ms));
  const pad = (n, width = 2) => String(n).padStart(width, "0");
  const h = Math.floor(total / 3_600_000);
  const m = Math.floor(total / 60_000) % 60;
  const s = Math.floor(total / 1000) % 60;
  return `${pad(h)}:${pad(m)}:${pad(s)}.${pad(total % 1000, 3)}`;
}

// Cue text is markup: & and < must be escaped, and > too, so that no "-->" can end up in a
// cue (a line holding "-->" would be read as a new timing line). Blank lines would end the
// cue, so line breaks inside an utterance become spaces.
export function vttEscape(text) {
  return text
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/\s*[\r\n]+\s*/g, " ");
}

// lines: the transcript entries ({who, text, start, end}); those with no text are skipped.
// Cues come sorted by start time (WebVTT requires it): a user's line can arrive after the
// reply to it has begun, but its speech started first.
export function toVtt(lines) {
  const cues = lines
    .filter((l) => l.text && l.text.trim())
    .map((l) => ({ ...l, end: Math.max(l.end ?? l.start, l.start + MIN_CUE_MS) }))
    .sort((a, b) => a.start - b.start);
  const blocks = cues.map((c, i) => {
    const voice = c.who === "agent" ? "agent" : "user";
    return `${i + 1}\n${vttTime(c.start)} --> ${vttTime(c.end)}\n<v ${voice}>${vttEscape(c.text.trim())}</v>`;
  });
  return ["WEBVTT", ...blocks].join("\n\n") + "\n";
}
