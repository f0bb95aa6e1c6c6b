"""Voice detectors compared: Silero (ONNX, one thread) against webrtcvad, inside the real Endpointer.

Each condition is a timeline of espeak-ng utterances (several voices, 1-3 s each, 0.8-2.5 s apart,
at -23 dBFS) over continuous background at a given SNR (speech RMS over background RMS):
  noise   pink noise
  babble  six other espeak-ng voices talking at once (different sentences)
  music   synthetic chords (triads with harmonics and a bass line, a chord per half second) and
          a noise hi-hat on the beat
plus the clean utterances. The Endpointer (agent/media/vad.py, default settings: 120 ms to start, 300 ms
silence to end) runs over the mixture in 80 ms chunks with each detector, and every SpeechStarted
is scored against the utterances' true spans:
  false starts / min   a turn whose onset is in no utterance (or more than 200 ms before one)
  missed onsets / min  an utterance in which no turn starts (e.g. a turn held open by the
                       background runs straight through it)
  ms per 20 ms         CPU time (process time) of the detector alone per 20 ms sub-frame
Last line: the headline figures, averaged over the noisy conditions.

    .venv/bin/python scripts/bench_vad.py [--minutes 2] [--out bench/results/vad-DATE.txt]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.media.ingest import AudioChunk  # noqa: E402
from agent.media.turn_events import SpeechStarted  # noqa: E402
from agent.media.vad import Endpointer  # noqa: E402
from agent.media.voice import VAD_KINDS, make_detector  # noqa: E402

RATE = 16_000
SPEECH_DBFS = -23.0
ONSET_SLACK_S = 0.2

SENTENCES = [
    "Hello agent, what do you see on my desk?",
    "Could you tell me the weather for tomorrow morning?",
    "Stop, that is not what I asked.",
    "Please read the next item on the list.",
    "How long does it take to boil an egg?",
    "Yes.",
    "No, the other one, the blue one.",
    "Set a timer for ten minutes.",
    "What is the capital of Australia?",
    "Remind me to call my sister tonight.",
    "Wait.",
    "Can you say that again more slowly?",
]
BABBLE = [
    "The committee will meet again after the holidays to discuss the budget in detail.",
    "I think we should take the train instead, it is faster and much cheaper on weekends.",
    "She said the results were promising but the sample was far too small to be sure.",
    "Turn left at the second light and the parking garage is right behind the bakery.",
    "Nobody expected the old bridge to last that long after the flood twenty years ago.",
    "We ran out of coffee again so somebody has to go to the store before the meeting.",
]
VOICES = ["en-us", "en-gb", "en-us+f3", "en-gb+m3", "en-us+f2", "en-us+m7"]


def espeak(text: str, voice: str, folder: Path, speed: int = 165) -> np.ndarray:
    out = folder / f"{abs(hash((text, voice, speed)))}.wav"
    if not out.exists():
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(out), text], check=True)
    with wave.open(str(out)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float64) / 32768
    n = int(len(pcm) * RATE / rate)
    pcm = np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm)
    loud = np.flatnonzero(np.abs(pcm) > 10 ** (-50 / 20))
    return pcm[loud[0] : loud[-1] + 1]


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x * x)))


def scale_to(x: np.ndarray, dbfs: float) -> np.ndarray:
    return x * (10 ** (dbfs / 20) / max(rms(x), 1e-12))


@dataclass
class Timeline:
    speech: np.ndarray
    spans: list[tuple[float, float]]  # true utterance spans (s)


def timeline(seconds: float, folder: Path, rng: np.random.Generator) -> Timeline:
    pcm = np.zeros(int(seconds * RATE))
    spans: list[tuple[float, float]] = []
    t = 1.0
    i = 0
    while True:
        utt = espeak(SENTENCES[i % len(SENTENCES)], VOICES[i % len(VOICES)], folder)
        utt = scale_to(utt, SPEECH_DBFS)
        start = int(t * RATE)
        if start + len(utt) > len(pcm) - RATE // 2:
            break
        pcm[start : start + len(utt)] += utt
        spans.append((t, t + len(utt) / RATE))
        t += len(utt) / RATE + rng.uniform(0.8, 2.5)
        i += 1
    return Timeline(pcm, spans)


def pink_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(len(spectrum))
    spectrum[1:] /= np.sqrt(f[1:])
    spectrum[0] = 0
    return np.fft.irfft(spectrum, n)


def babble(n: int, folder: Path) -> np.ndarray:
    out = np.zeros(n)
    for k, voice in enumerate(VOICES):
        stream = np.zeros(0)
        j = k
        while len(stream) < n:
            stream = np.concatenate([stream, espeak(BABBLE[j % len(BABBLE)], voice, folder, speed=150 + 10 * k)])
            j += 1
        offset = (k * 7919) % RATE  # voices out of step
        out += np.roll(stream[:n], offset)
    return out


def music(n: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(n) / RATE
    out = np.zeros(n)
    chord_s = 0.5
    roots = [220.0, 174.6, 261.6, 196.0]  # A F C G
    env_len = int(chord_s * RATE)
    env = np.minimum(1.0, np.arange(env_len) / (0.02 * RATE)) * np.exp(-np.arange(env_len) / (0.35 * RATE))
    for c in range(int(n / env_len)):
        root = roots[c % len(roots)]
        seg = slice(c * env_len, min(n, (c + 1) * env_len))
        tt = t[seg]
        e = env[: len(tt)]
        for ratio in (1.0, 1.25, 1.5):  # major triad
            for h in range(1, 5):
                out[seg] += e * np.sin(2 * np.pi * root * ratio * h * tt) / h
        out[seg] += 0.8 * e * np.sin(2 * np.pi * root / 2 * tt)  # bass
        hat = min(len(tt), int(0.03 * RATE))  # a hi-hat on the beat
        out[seg][:hat] += 0.3 * rng.standard_normal(hat) * np.exp(-np.arange(hat) / (0.005 * RATE))
    return out


def chunks(pcm: np.ndarray) -> list[AudioChunk]:
    pcm = np.clip(pcm, -1, 1).astype(np.float32)
    n = len(pcm) // 1280
    return [AudioChunk(pcm=pcm[i * 1280 : (i + 1) * 1280], index=i, start=i * 0.08) for i in range(n)]


def score(onsets: list[float], spans: list[tuple[float, float]]) -> tuple[int, int]:
    """(false starts, missed onsets)."""
    false = sum(1 for o in onsets if not any(s - ONSET_SLACK_S <= o <= e for s, e in spans))
    missed = sum(1 for s, e in spans if not any(s - ONSET_SLACK_S <= o <= e for o in onsets))
    return false, missed


def detector_cpu_ms(kind: str, pcm: np.ndarray) -> float:
    """Process time of the detector alone per 20 ms sub-frame."""
    detector = make_detector(kind)
    pcm16 = np.clip(np.round(pcm * 32768), -32768, 32767).astype(np.int16)
    subs = [pcm16[i : i + 320] for i in range(0, len(pcm16) - 319, 320)]
    t0 = time.process_time()
    for sub in subs:
        detector.voiced(sub)
    return (time.process_time() - t0) * 1000 / len(subs)


def versions() -> str:
    def v(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    espeak_v = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.split()[3]
    return (
        f"onnxruntime {v('onnxruntime')}, silero-vad {v('silero-vad')} (silero_vad.onnx), "
        f"webrtcvad-wheels {v('webrtcvad-wheels')}, numpy {v('numpy')}, espeak-ng {espeak_v}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.0, help="audio per condition")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if shutil.which("espeak-ng") is None:
        print("espeak-ng is missing", file=sys.stderr)
        return 2
    seconds = args.minutes * 60
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# bench_vad {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}")
    say(
        f"# {args.minutes:g} min per condition, speech at {SPEECH_DBFS:g} dBFS, Endpointer defaults "
        f"(120 ms to start, 300 ms silence to end), silero threshold 0.5, webrtcvad mode 2"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(args.seed)
        tl = timeline(seconds, folder, rng)
        n = len(tl.speech)
        backgrounds = {"noise": pink_noise(n, rng), "babble": babble(n, folder), "music": music(n, rng)}
        speech_rms = 10 ** (SPEECH_DBFS / 20)
        conditions: list[tuple[str, float | None, np.ndarray]] = [("clean", None, tl.speech)]
        for name, bg in backgrounds.items():
            for snr in (10.0, 5.0):
                conditions.append((name, snr, tl.speech + scale_to(bg, 20 * np.log10(speech_rms) - snr)))
        minutes = n / RATE / 60
        say(f"# {len(tl.spans)} utterances per condition ({minutes:.2f} min)")
        say(
            f"{'background':<10} {'SNR':>5} {'vad':<7} {'starts':>6} {'false/min':>9} {'missed/min':>10} "
            f"{'missed %':>8} {'ms/20ms':>8}"
        )
        totals: dict[str, list[float]] = {k: [0.0, 0.0, 0.0, 0] for k in VAD_KINDS}  # type: ignore[misc]
        for name, snr, mix in conditions:
            for kind in VAD_KINDS:
                ep = Endpointer(vad=kind)
                onsets = [e.onset for c in chunks(mix) for e in ep.push(c) if isinstance(e, SpeechStarted)]
                false, missed = score(onsets, tl.spans)
                cpu = detector_cpu_ms(kind, mix)
                snr_s = "-" if snr is None else f"{snr:g} dB"
                say(
                    f"{name:<10} {snr_s:>5} {kind:<7} {len(onsets):>6} {false / minutes:>9.2f} "
                    f"{missed / minutes:>10.2f} {100 * missed / len(tl.spans):>7.1f}% {cpu:>8.3f}"
                )
                if snr is not None:
                    t = totals[kind]
                    t[0] += false / minutes
                    t[1] += missed / minutes
                    t[2] += cpu
                    t[3] += 1
    noisy = {k: (t[0] / t[3], t[1] / t[3], t[2] / t[3]) for k, t in totals.items()}
    best = min(VAD_KINDS, key=lambda k: noisy[k][0] + noisy[k][1])
    say(
        "vad_bench "
        + " ".join(
            f"{k}_false_per_min={noisy[k][0]:.2f} {k}_missed_per_min={noisy[k][1]:.2f} {k}_ms_per_20ms={noisy[k][2]:.3f}"
            for k in VAD_KINDS
        )
        + f" better={best}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
