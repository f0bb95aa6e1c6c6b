"""The two synthesizers of the end-of-turn corpus (scripts/turn_corpus.py): espeak-ng and Festival.

espeak-ng: formant voices, many of them, 22.05 kHz; see turn_corpus for how its pause is made.

Festival (Debian: festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts): three voices that
sound far more like a person, which matters to a detector trained on human speech: kal_diphone and
ked_diphone (US male diphone voices, 16 kHz) and cmu_us_slt_arctic_hts (US female, HTS, 32 kHz).
Each utterance is one `festival --pipe` run of a Scheme script that picks the voice, sets its speed
and pitch, synthesizes the whole sentence (SynthText), saves the wave and prints each word's times
from the utterance's Word relation (features word_start and word_end, in seconds of the saved wave;
for the HTS voice the engine writes its own durations back, so they match its wave too) with a flag
saying whether the word begins a whitespace token (a token such as "what's" makes two words).

- Phrasing: Phrase_Method cart_tree with simple_phrase_cart_tree, so that a phrase break (and its
  pause) comes only at punctuation: the voices' own models also break before "and" or "but", which
  would put an unlabelled pause into a complete sentence.
- Speed: `rate` is in per cent of the voice's own (80-118). The diphone voices take it as
  Duration_Stretch = 100 / rate; the HTS voice ignores Duration_Stretch and takes hts_engine's "-r"
  (rate / 100) instead.
- Pitch: the diphone voices' intonation maps its model onto int_lr_params' target_f0_mean (and
  target_f0_std, kept at 14 % of it, as the voices ship): measured, a target of 80/100/120/140 Hz
  gives a median f0 of 88/98/118/137 Hz. Festival's hts_engine module reads only "-m" and "-r", so
  the HTS voice keeps its own pitch (recorded as 0).
- Sample rate: the 32 kHz HTS wave is resampled to 16 kHz with the same numpy polyphase filter as
  espeak-ng's 22.05 kHz; every run is deterministic (same text, voice, speed and pitch: same bytes).
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
FESTIVAL_PACKAGES = "festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"
FESTIVAL_BIN = "festival"
FESTIVAL_VOICE_DIR = Path("/usr/share/festival/voices")
HTS_VOICES = ("cmu_us_slt_arctic_hts",)
FESTIVAL_RATE = (80, 118)  # per cent of the voice's own speed
FESTIVAL_F0 = (85, 135)  # target mean f0 of the diphone voices, Hz (their own: 105)
# Lisp cells: Festival's default heap takes some 0.2 s of each run just to set up (a run is one
# utterance), a tenth of it the run no time (it collects garbage when it must: the output is the same).
FESTIVAL_HEAP = 1_000_000
# The diphone voices end their final pause on a constant offset (some -39 dB under a quiet utterance's
# loudest 10 ms: "speech" to the corpus' detector), so the wave is cut this long after the last word ends,
# the cut faded.
FESTIVAL_TAIL_S = 0.030
FADE_S = 0.005


# ---- resampling ------------------------------------------------------------------------------------


@functools.cache
def _lowpass_phases(up: int, down: int) -> np.ndarray:
    """Kaiser-windowed sinc at 95 % of the lower Nyquist, split into `up` polyphase rows of at least
    24 taps each (more when decimating by 2 or more, so that the filter spans as many input samples)."""
    taps_per_phase = 24 * max(1, down // up)
    n = taps_per_phase * up
    cutoff = 0.95 * 0.5 / max(up, down)  # cycles per sample at the upsampled rate
    k = np.arange(n) - (n - 1) / 2
    h = 2 * cutoff * np.sinc(2 * cutoff * k) * np.kaiser(n, 8.0) * up  # * up: zero-stuffing's gain
    return h.reshape(taps_per_phase, up)  # row i holds h[i*up : (i+1)*up]


def resample(pcm: np.ndarray, rate: int) -> np.ndarray:
    """`pcm` at `rate` Hz to 16 kHz by polyphase filtering; float64 in and out."""
    g = math.gcd(SAMPLE_RATE, rate)
    up, down = SAMPLE_RATE // g, rate // g
    if up == down:
        return np.asarray(pcm, dtype=np.float64)
    phases = _lowpass_phases(up, down)
    taps = phases.shape[0]
    t = np.arange(math.ceil(len(pcm) * up / down)) * down + taps * up // 2  # upsampled index + group delay
    base, phase = t // up, t % up
    idx = base[:, None] - np.arange(taps)[None, :]
    padded = np.concatenate([np.asarray(pcm, dtype=np.float64), np.zeros(taps + 1)])
    # Indices below zero read the zero tail (negative indexing), which stands for the silence before.
    idx = np.where(idx < 0, len(padded) - 1, idx)
    return np.einsum("nt,tn->n", padded[idx], phases[:, phase])


# ---- espeak-ng -------------------------------------------------------------------------------------


def espeak(spoken: str, voice: str, rate: int, pitch: int, ssml: bool) -> np.ndarray:
    """espeak-ng's speech for `spoken` at 22.05 kHz, float64 in int16 units."""
    cmd = ["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "--stdout"]
    out = subprocess.run([*cmd, *(["-m"] if ssml else []), spoken], capture_output=True, check=True).stdout
    # --stdout streams a header whose sizes are placeholders: the samples are everything after "data".
    data = out.index(b"data") + 8
    return np.frombuffer(out[data : data + (len(out) - data) // 2 * 2], dtype=np.int16).astype(np.float64)


# ---- Festival --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Word:
    """One word of a Festival utterance: its name, which whitespace token of the text it belongs to
    (0-based), and where it starts and ends in the 16 kHz wave, in samples."""

    name: str
    token: int
    start: int
    end: int


def festival_missing(voices: tuple[str, ...]) -> str:
    """What of Festival and `voices` is not installed ("" when all is), with the packages to install."""
    missing = [] if shutil.which(FESTIVAL_BIN) else [FESTIVAL_BIN]
    missing += [v for v in voices if not any(FESTIVAL_VOICE_DIR.glob(f"*/{v}"))]
    if not missing:
        return ""
    return f"Festival is not installed (missing: {', '.join(missing)}): apt-get install {FESTIVAL_PACKAGES}"


def _scheme(text: str, voice: str, rate: int, f0: int, wav: Path) -> str:
    quoted = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if voice in HTS_VOICES:
        speed = f"""(set! hts_engine_params (cons (list "-r" {rate / 100:.4f}) hts_engine_params))"""
    else:
        speed = (
            f"(Parameter.set 'Duration_Stretch {100 / rate:.4f})\n"
            f"(set! int_lr_params '((target_f0_mean {f0}) (target_f0_std {0.14 * f0:.2f})"
            " (model_f0_mean 170) (model_f0_std 34)))"
        )
    return f"""(voice_{voice})
(Parameter.set 'Phrase_Method 'cart_tree)
(set! phrase_cart_tree simple_phrase_cart_tree)
{speed}
(set! utt (SynthText {quoted}))
(utt.save.wave utt "{wav}" 'riff)
(mapcar (lambda (w)
  (format t "WORD\\t%s\\t%d\\t%f\\t%f\\n" (item.name w) (if (item.prev (item.relation w 'Token)) 0 1)
          (item.feat w "word_start") (item.feat w "word_end")))
  (utt.relation.items utt 'Word))
"""


def festival(text: str, voice: str, rate: int, f0: int) -> tuple[np.ndarray, list[Word]]:
    """Festival's speech for `text` as one utterance, at 16 kHz (float64 in int16 units), ending
    FESTIVAL_TAIL_S after the last word, and its words."""
    with tempfile.TemporaryDirectory(prefix="turn-festival-") as tmp:
        wav = Path(tmp) / "out.wav"
        run = subprocess.run(
            [FESTIVAL_BIN, "--heap", str(FESTIVAL_HEAP), "--pipe"],
            input=_scheme(text, voice, rate, f0, wav),
            capture_output=True,
            text=True,
        )
        if not wav.is_file():
            raise RuntimeError(f"festival made no wave for {text!r} ({voice}): {run.stdout}{run.stderr}".strip())
        with wave.open(str(wav)) as w:
            rate_hz = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())[:, 0]
    words, token = [], -1
    for line in run.stdout.splitlines():
        if line.startswith("WORD\t"):
            _, name, first, start, end = line.split("\t")
            token += int(first)
            # A clitic that Festival folds into the word before (the "'s" of "what's") has no segments and
            # reports 0 and 0: it is counted in its token, never used for its times.
            if float(end) > float(start):
                words.append(Word(name, token, round(float(start) * SAMPLE_RATE), round(float(end) * SAMPLE_RATE)))
    pcm = resample(pcm.astype(np.float64), rate_hz)
    if words:
        pcm = pcm[: words[-1].end + int(FESTIVAL_TAIL_S * SAMPLE_RATE)]
        fade = min(len(pcm), int(FADE_S * SAMPLE_RATE))
        pcm[len(pcm) - fade :] *= np.linspace(1.0, 0.0, fade)
    return pcm, words
