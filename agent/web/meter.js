// The latency readout: the server's figures (TTFT/TTFA) and the page's own measurement.
import { omni, ui, ms } from "./state.js";

// RMS that counts as "audible": about -40 dBFS, above Opus comfort noise, below speech.
const AUDIBLE_RMS = 0.01;
// Analyser poll period; it bounds the resolution of the client-side latency numbers.
const METER_PERIOD_MS = 10;

// Voice-to-voice is measured where the user hears it: the first remote audio above
// AUDIBLE_RMS after the end of a turn, read off an AnalyserNode on the remote stream.
// A second analyser on the mic remembers when the user last made sound, so the page can
// also report the full mic-quiet -> reply-audible time (it includes the server's VAD silence).
export function makeMeter() {
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

// Server-side figures (ms, null when the reply had none, e.g. no audio in text mode).
export function showLatency(figures) {
  for (const key of ["ttft_ms", "ttfa_ms"]) {
    if (!(key in figures)) continue;
    omni.latency[key] = figures[key];
    ui[key === "ttft_ms" ? "ttft" : "ttfa"].textContent = ms(figures[key]);
  }
}

// Where the last turn's time went, stage by stage (the server's omni.turn_timing event): the
// stages follow each other from the end of speech to the reply's first sound leaving the agent.
export function showTurnTiming(timing) {
  const stages = timing.stages ?? {};
  const names = ["endpoint", "admission", "prefill", "first_output", "transport"];
  omni.latency.turn_stages = stages;
  omni.latency.turn_total_ms = timing.total_ms;
  ui.turnStages.textContent =
    names.map((name) => ms(stages[name])).join(" · ") + (timing.total_ms == null ? "" : ` = ${ms(timing.total_ms)}`);
}
