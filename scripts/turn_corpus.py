"""A spoken corpus that knows where each turn truly ends, for benchmarking end-of-turn detection.

At each pause in a user's speech an end-of-turn detector must decide: done (end the turn after a short
silence) or going on (wait). This corpus gives it synthetic speech whose answer is known, from two
synthesizers (scripts/turn_voices.py runs them): espeak-ng's formant voices and Festival's diphone and
HTS voices, which sound far more like a person (a detector trained on human speech, Smart Turn v3.2,
barely tells a sentence's end from a pause inside it on espeak-ng, AUC about 0.6):

  complete      a whole request, question or statement, then silence: the turn ends at end_of_speech_s
  incomplete    speech with one pause inside where the speaker is not done, then the continuation, then
                silence; pause_kind says why the pause is not an end: mid_clause ("go to the ... train
                station"), conjunction ("and ... she didn't answer"), list ("eggs, milk, ... and bread"),
                number ("five five five ... two one three four"), hesitation ("maybe ... we could go")
  backchannel   a short listener token ("uh-huh", "yeah", "I see") that is no bid for the turn
  interruption  a real barge-in over the agent ("wait, stop, that's not what I asked")

How a pause is made: the whole utterance is one espeak-ng call in SSML mode with <break time="NNNms"/>
at the pause point (never a splice of two calls: each would end as a sentence). espeak-ng makes the
break a clause boundary with its "no punctuation" tune, so the word before it does not take a sentence
end's fall: over its last 150 ms "the" in "go to the <break/>" stays level (en+m3: 95 -> 95 Hz; before a
comma 94 -> 99, a continuation rise; before a full stop 83 -> 78), likewise "maybe" (98 -> 93 against
83 -> 78 at a full stop); after "and" the break and the full stop end alike, the nucleus being earlier.
The break itself is digital zeros about 10 ms longer than asked, whatever the speaking rate. The pause
is then measured from the audio (the run below the speech threshold at the break, so a word's unvoiced
tail counts as pause) and the zeros in its middle are trimmed or padded until that run is the drawn
length: the recorded [start, end] is what a listener gets. Commas in a list template are left out of
the synthesis (espeak-ng pauses 120-240 ms at a comma: a second pause with no label); those in an
interruption stay, and its comma pauses are listed in `pauses` like any other.

Festival: the sentence, its commas before the pause point left out, is also ONE utterance, so the word
before the pause has mid-sentence prosody (Festival's phrasing is set to break only at punctuation:
its own models would break before "and" or "but"; any "Hmm" is given as "Hum", which it does not
spell out). Festival reports each word's start and end; the
wave is cut at the end of the word before the pause and at the start of the next (each snapped to the
quietest 5 ms within 20 ms, with 5 ms fades so the cut makes no click), and zeros go in between: first
the drawn length, to measure the quiet that the words' own edges add (a decaying vowel, a stop's
closure), then the drawn length less that, so the measured pause is again exactly the drawn one.
Festival's own silence is low noise, not zeros (its diphone voices' leading pause up to some 45 dB under
the loudest 10 ms): the file's speech starts 10 ms after the cut before it, and after it the wave is
cut 30 ms after the last word, then at 50 dB under the loudest 10 ms.

Every file: the synthesizer's own leading and trailing silence trimmed, 300 ms lead-in, the speech,
1.5 s of trailing silence, all over a -70 dBFS white-noise floor (seeded per file) so that no sample run is
digital zero (some detectors treat exact zeros specially; the floor sits some 55 dB under the speech's
loudest 10 ms). 16 kHz mono int16 WAV (espeak-ng's 22.05 kHz and the HTS voice's 32 kHz resampled by
a Kaiser-windowed sinc polyphase filter in numpy: scipy is not in the venv).

Manifest (corpus.jsonl, one line per file): file, kind, pause_kind (incomplete only, else null), text
(" ... " at the pause), engine ("espeak-ng" or "festival"; a manifest without it is espeak-ng's),
voice (espeak-ng's -v, base+variant; Festival's voice name), rate (espeak-ng's -s in wpm; Festival's
speed in per cent of the voice's own), pitch (espeak-ng's -p; Festival's target mean f0 in Hz for the
diphone voices, 0 for the HTS voice, whose pitch is its model's), split (tune|heldout), speech_start_s
and end_of_speech_s (first and last 10 ms within 40 dB of the file's loudest), pauses ([start_s, end_s]
of each inner gap of 150 ms or more: exactly one for an incomplete item, none for a complete one),
duration_s.

Split: whole sentence templates and whole voices are held out (a template is held out when its index in
its list is 3 mod 4; the base voices en-gb-scotland and en-029 and the variants m6, m7, aunty and Annie
are held out; of Festival's, ked_diphone is held out, kal_diphone and the HTS voice cmu_us_slt_arctic_hts
are tune's, so each split has a male diphone voice), so a held-out item shares neither text nor base
voice nor variant nor Festival voice with any tune item. Engines: by default the items of each kind and
split alternate between espeak-ng and Festival (half each); `engines` / --engines picks one or both.
The same seed and engines give byte-identical files and manifest (with espeak-ng alone, the same as
before Festival came in).

    .venv/bin/python scripts/turn_corpus.py --out /tmp/turns --count 200 --seed 0
    .venv/bin/python scripts/turn_corpus.py --out /tmp/turns --count 200 --engines espeak-ng
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
from turn_voices import FESTIVAL_F0, FESTIVAL_RATE, HTS_VOICES, espeak, festival, festival_missing, resample

SAMPLE_RATE = 16_000
LEAD_IN_S = 0.30
TRAIL_S = 1.50
PAUSE_RANGE_S = (0.15, 0.70)
# A gap at least this long inside speech counts as a pause; complete items must have none (nor any gap
# over MAX_GAP_COMPLETE_S, a margin so that a coarser measurement still finds none).
MIN_PAUSE_S = 0.15
MAX_GAP_COMPLETE_S = 0.12
# Speech is a 10 ms RMS above this many dB under the file's loudest 10 ms (about 80 int16 units for
# espeak-ng's level): quiet fricatives count as speech, the -70 dBFS floor (about 10 units) does not.
SPEECH_REL_DB = -40.0
NOISE_DBFS = -70.0
MANIFEST = "corpus.jsonl"
MAX_ATTEMPTS = 8

KINDS = ("complete", "incomplete", "backchannel", "interruption")
ENGINES = ("espeak-ng", "festival")
PAUSE_KINDS = ("mid_clause", "conjunction", "list", "number", "hesitation")

# Voices: espeak-ng's own English voices ("en" is its British English; "en-gb+<variant>" would silently
# drop the variant) and the human variants that add no echo: f2-f5 and m2 add a 120-140 ms echo at
# -16 to -20 dB, which fills a pause with the last word's reverberation and blurs where speech ends.
# Held-out bases and variants are never used for tune items.
TUNE_BASES = ("en-us", "en", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-us-nyc")
HELDOUT_BASES = ("en-gb-scotland", "en-029")
TUNE_VARIANTS = ("m1", "m3", "m4", "m5", "m8", "f1", "belinda", "linda", "steph")
HELDOUT_VARIANTS = ("m6", "m7", "aunty", "Annie")
RATE_WPM = (130, 200)
PITCH = (30, 70)
# Festival's voices (speed FESTIVAL_RATE, diphone pitch FESTIVAL_F0: see turn_voices); the held-out one
# is never used for tune items.
TUNE_FESTIVAL = ("kal_diphone", "cmu_us_slt_arctic_hts")
HELDOUT_FESTIVAL = ("ked_diphone",)
# Festival's quiet edges: its silence is low noise; speech starts this long after the cut before it, and
# the silence after it is trimmed at this many dB under the loudest 10 ms.
FESTIVAL_ONSET_S = 0.010
FESTIVAL_TRIM_DB = -50.0
FADE_S = 0.005
SNAP_S = 0.020

# Complete turns: no commas, so espeak-ng makes no clause pause inside them.
COMPLETE = (
    "What's the weather like in Paris tomorrow?",
    "Please book a table for two at seven.",
    "I think that's all for today.",
    "Can you set an alarm for six thirty tomorrow morning?",
    "Remind me to call my mother this evening.",
    "How long does it take to drive to the airport?",
    "Turn off the lights in the living room.",
    "What time does the pharmacy close tonight?",
    "Play some relaxing music while I cook.",
    "Send a message to Anna saying I'm running late.",
    "How many ounces are in a cup?",
    "Add milk to my shopping list.",
    "Is it going to rain this weekend?",
    "Tell me a joke about computers.",
    "What's the capital of Australia?",
    "I'd like to cancel my subscription.",
    "Could you read me the latest news headlines?",
    "Thank you so much for your help.",
    "Find me a good Italian restaurant nearby.",
    "How do I reset my password?",
    "Translate good morning into Spanish.",
    "What's on my calendar for Monday?",
    "Set a timer for ten minutes.",
    "Who won the football match last night?",
    "I need a taxi to the train station.",
    "Can you explain how compound interest works?",
    "Move my dentist appointment to next Thursday.",
    "What's the best way to learn a new language?",
    "Order more coffee beans from the usual shop.",
    "How far is the moon from the earth?",
    "Please turn the volume down a little.",
    "I'm looking for a birthday present for my sister.",
    "Do I need an umbrella today?",
    "Write a short email to my landlord about the broken heater.",
    "What does the word serendipity mean?",
    "Skip this song.",
    "When is the next bus to the city centre?",
    "Let me know when my package arrives.",
    "Which platform does the train to Leeds leave from?",
    "I'd like to speak to a real person please.",
    "That sounds perfect to me.",
    "Can you recommend a good book for the holidays?",
    "How much is a return ticket to Manchester?",
    "Please call me back in an hour.",
    "I don't need anything else.",
    "How many dollars is one euro worth today?",
    "Start my workout playlist.",
    "Why is the sky blue?",
)

# Incomplete turns: " ... " marks the one pause where the speaker is not done.
INCOMPLETE: dict[str, tuple[str, ...]] = {
    "mid_clause": (
        "I want to go to the ... train station.",
        "Could you book me a flight to ... Barcelona next Friday?",
        "Can you remind me to pick up the ... dry cleaning after work?",
        "I'm looking for a restaurant that serves ... vegetarian food.",
        "What's the fastest way to get to the ... city library?",
        "Please send the report to ... my manager by noon.",
        "Set the thermostat in the ... bedroom to twenty degrees.",
        "I'd like to change my ... delivery address.",
        "How much does it cost to fly to ... Tokyo in April?",
        "Tell me more about the ... history of the Roman empire.",
    ),
    "conjunction": (
        "I called her and ... she didn't answer.",
        "I wanted to go out but ... it started raining.",
        "We can't meet on Tuesday because ... I'm travelling for work.",
        "The shop was closed so ... I ordered it online.",
        "I tried restarting the router and ... it still doesn't work.",
        "I'd love to come but ... I have to work late.",
        "Book the hotel and ... send me the confirmation.",
        "My flight was delayed so ... I missed the connection.",
        "Can you check the forecast because ... I want to go hiking?",
        "I like the blue one but ... the red one is cheaper.",
    ),
    "list": (
        "I need eggs, milk, ... and bread.",
        "Add apples, bananas, ... and oranges to my list.",
        "We visited Rome, Florence, ... and Venice.",
        "Invite Sarah, Tom, ... and the neighbours.",
        "Pack the charger, my glasses, ... and the passports.",
        "I'd like soup, a salad, ... and sparkling water.",
        "Remind me about the dentist, the plumber, ... and the car service.",
        "The meeting is with sales, marketing, ... and finance.",
        "Buy flour, sugar, butter, ... and two lemons.",
    ),
    "number": (
        "My number is five five five ... two one three four.",
        "The code is four seven ... nine two.",
        "My order number is three eight one ... six six zero.",
        "My account number is nine nine two ... four one eight seven.",
        "Set an alarm for seven ... forty five.",
        "The flight number is two seven ... nine one.",
        "Transfer two hundred and ... fifty dollars to Mark.",
        "The verification code is eight one ... three three five.",
    ),
    "hesitation": (
        "I was thinking maybe ... we could go on Friday.",
        "I'm not really sure ... whether I locked the door.",
        "Well um ... I'd like to change my booking.",
        "Could you uh ... find me a cheaper option?",
        "So basically ... the printer keeps jamming.",
        "I guess what I mean is ... the app is too slow.",
        "Let me think ... a table for four please.",
        "It's kind of ... hard to explain.",
        "Hmm maybe ... the one near the park.",
    ),
}

# Backchannels: (text in the manifest, what espeak-ng is given, what Festival is given). "mm-hmm" as
# text is spelled out as letters by both, so espeak-ng is given phonemes and Festival "um hum"
# (/ah m hh ah m/; "mhm", "mm hmm" and "hmm" it spells).
BACKCHANNELS = (
    ("uh-huh", "uh huh", "uh huh"),
    ("yeah", "yeah", "yeah"),
    ("mm-hmm", "[[m@m'h@m]]", "um hum"),
    ("okay", "okay", "okay"),
    ("right", "right", "right"),
    ("sure", "sure", "sure"),
    ("I see", "I see", "I see"),
    ("got it", "got it", "got it"),
    ("yep", "yep", "yep"),
    ("oh really", "oh really", "oh really"),
    ("alright", "alright", "alright"),
    ("exactly", "exactly", "exactly"),
)
# Words Festival spells out as letters, and what it is given instead (one word for one: the pause is
# found by counting words).
FESTIVAL_WORDS = {"Hmm": "Hum"}

INTERRUPTIONS = (
    "Wait, stop, that's not what I asked.",
    "Hold on, can you repeat the address please?",
    "Sorry, I meant tomorrow, not today.",
    "No no no, cancel that.",
    "Excuse me, can I ask something?",
    "Stop, that's enough.",
    "Actually, make it two tickets.",
    "Hang on, go back to the first option.",
    "Wait, what was the price again?",
    "Sorry to interrupt, but I have to go.",
    "No, I said Tuesday.",
    "Okay okay, I get it.",
)


@dataclass(frozen=True)
class Item:
    """One file of the corpus, as its manifest line says, with `path` the WAV file resolved."""

    file: str
    kind: str
    pause_kind: str | None
    text: str
    engine: str
    voice: str
    rate: int
    pitch: int
    split: str
    speech_start_s: float
    end_of_speech_s: float
    pauses: tuple[tuple[float, float], ...]
    duration_s: float
    path: Path

    def manifest(self) -> dict:
        """The manifest line (everything but the resolved path)."""
        line = asdict(self)
        del line["path"]
        line["pauses"] = [list(p) for p in self.pauses]
        return line


@dataclass(frozen=True)
class _Plan:
    """What one file will say, decided before any synthesis so that threads cannot change it."""

    index: int
    kind: str
    pause_kind: str | None
    text: str
    spoken: str
    split: str
    engine: str = "espeak-ng"


# ---- audio measurement -------------------------------------------------------------------------------


def envelope(pcm: np.ndarray, win_s: float = 0.010) -> np.ndarray:
    """Centered moving RMS over `win_s`, one value per sample (int16 units in, same units out)."""
    n = max(1, int(round(win_s * SAMPLE_RATE)))
    csum = np.concatenate([[0.0], np.cumsum(np.asarray(pcm, dtype=np.float64) ** 2)])
    rms = np.sqrt(np.maximum(csum[n:] - csum[:-n], 0.0) / n)
    return np.concatenate([np.zeros(n // 2), rms, np.zeros(n - n // 2 - 1)])[: len(pcm)]


def speech_mask(pcm: np.ndarray) -> np.ndarray:
    """Per sample: is the 10 ms around it speech (within SPEECH_REL_DB of the loudest 10 ms)."""
    env = envelope(pcm)
    return env >= env.max() * 10 ** (SPEECH_REL_DB / 20) if env.size and env.max() > 0 else env > 0


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) sample ranges where `mask` is true."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def inner_gaps(pcm: np.ndarray, min_s: float = 0.0) -> list[tuple[int, int]]:
    """Non-speech runs strictly between the first and last speech sample, at least `min_s` long."""
    speech = runs(speech_mask(pcm))
    gaps = [(a[1], b[0]) for a, b in zip(speech, speech[1:])]
    return [g for g in gaps if g[1] - g[0] >= min_s * SAMPLE_RATE]


# ---- synthesis -------------------------------------------------------------------------------------


def _ssml(text: str, pause_ms: int) -> str:
    """The SSML for an incomplete template: a break at " ... ", and the list commas before it dropped
    (espeak-ng pauses 120-240 ms at a comma, which would be a second pause with no label)."""
    before, after = text.split(" ... ")
    before = before.rstrip(",").replace(",", "")
    return f'<speak>{escape(before)} <break time="{pause_ms}ms"/> {escape(after)}</speak>'


def _trim(pcm: np.ndarray) -> np.ndarray:
    """espeak-ng's own leading and trailing silence cut: from the first to the last audible sample."""
    audible = np.flatnonzero(np.abs(pcm) >= 1.0)
    return pcm[audible[0] : audible[-1] + 1] if audible.size else pcm[:0]


def _trim_quiet(pcm: np.ndarray) -> np.ndarray:
    """Festival's own leading and trailing silence (low noise, up to some -45 dB under the loudest 10 ms
    in the diphone voices' leading pause) cut: from FESTIVAL_ONSET_S before the first speech sample, faded
    in, to the last sample whose 10 ms is within -FESTIVAL_TRIM_DB of the loudest."""
    speech, env = np.flatnonzero(speech_mask(pcm)), envelope(pcm)
    if not speech.size:
        return pcm[:0]
    start = max(0, speech[0] - int(FESTIVAL_ONSET_S * SAMPLE_RATE))
    end = np.flatnonzero(env >= env.max() * 10 ** (FESTIVAL_TRIM_DB / 20))[-1] + 1
    out = pcm[start:end].copy()
    fade = min(len(out), int(FADE_S * SAMPLE_RATE)) if start > 0 else 0
    out[:fade] *= np.linspace(0.0, 1.0, fade)
    return out


def _set_pause(pcm: np.ndarray, target_s: float) -> np.ndarray | None:
    """The longest inner gap (the break) cut or padded in its middle, which is digital zeros, so that
    it measures `target_s`; None when the gap is too short to be the break."""
    gaps = inner_gaps(pcm, MIN_PAUSE_S * 0.5)
    if not gaps:
        return None
    a, b = max(gaps, key=lambda g: g[1] - g[0])
    mid, change = (a + b) // 2, int(round(target_s * SAMPLE_RATE)) - (b - a)
    if change >= 0:
        return np.concatenate([pcm[:mid], np.zeros(change), pcm[mid:]])
    return np.concatenate([pcm[: mid + change // 2], pcm[mid + change // 2 - change :]])


def _quietest(pcm: np.ndarray, at: int) -> int:
    """The sample within SNAP_S of `at` whose 5 ms is quietest: where to cut between two words."""
    r = int(SNAP_S * SAMPLE_RATE)
    lo, hi = max(0, at - r), min(len(pcm), at + r + 1)
    return lo + int(np.argmin(envelope(pcm, 0.005)[lo:hi])) if hi > lo else min(max(at, 0), len(pcm))


def _splice_pause(pcm: np.ndarray, a: int, b: int, target_s: float) -> np.ndarray | None:
    """`pcm` cut at samples a and b (between them goes), faded over FADE_S each side, and zeros put in so
    that the quiet run there measures `target_s`: the words' quiet edges count towards it, so zeros of
    the drawn length go in first, the run is measured, and the excess comes out. None when the edges
    alone are quieter for longer than the target."""
    n, fade = round(target_s * SAMPLE_RATE), int(FADE_S * SAMPLE_RATE)
    ramp = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, fade))  # 0 -> 1
    left, right = pcm[:a].copy(), pcm[b:].copy()
    k, m = min(fade, len(left)), min(fade, len(right))
    left[len(left) - k :] *= ramp[::-1][fade - k :]
    right[:m] *= ramp[:m]
    probe = np.concatenate([left, np.zeros(n), right])
    run = [g for g in inner_gaps(probe) if g[0] <= len(left) + n // 2 < g[1]]
    if not run or run[0][1] - run[0][0] > 2 * n:
        return None
    return np.concatenate([left, np.zeros(2 * n - (run[0][1] - run[0][0])), right])


def _festival_speech(plan: _Plan, voice: str, rate: int, f0: int, pause_s: float) -> np.ndarray | None:
    """The plan spoken by Festival as one utterance; an incomplete one cut after the word before " ... "
    and its pause set to `pause_s` (None when it cannot be)."""
    if plan.kind != "incomplete":
        return _trim_quiet(festival(plan.spoken, voice, rate, f0)[0])
    before, after = plan.spoken.split(" ... ")
    before = before.rstrip(",").replace(",", "")
    pcm, words = festival(f"{before} {after}", voice, rate, f0)
    last = len(before.split()) - 1
    ends = [w.end for w in words if w.token == last]
    starts = [w.start for w in words if w.token == last + 1]
    if not ends or not starts:
        return None
    a = _quietest(pcm, ends[-1])
    b = max(a, _quietest(pcm, starts[0]))
    spliced = _splice_pause(pcm, a, b, pause_s)
    return None if spliced is None else _trim_quiet(spliced)


def _draw_voice(rng: random.Random, split: str, engine: str) -> tuple[str, int, int]:
    """Voice, rate and pitch for one attempt (see Item for their units per engine)."""
    if engine == "festival":
        voice = rng.choice(TUNE_FESTIVAL if split == "tune" else HELDOUT_FESTIVAL)
        rate, f0 = rng.randint(*FESTIVAL_RATE), rng.randint(*FESTIVAL_F0)
        return voice, rate, 0 if voice in HTS_VOICES else f0
    bases, variants = (TUNE_BASES, TUNE_VARIANTS) if split == "tune" else (HELDOUT_BASES, HELDOUT_VARIANTS)
    return f"{rng.choice(bases)}+{rng.choice(variants)}", rng.randint(*RATE_WPM), rng.randint(*PITCH)


def _draw_pause_s(rng: random.Random) -> float:
    """Log-uniform over PAUSE_RANGE_S, whole ms: most pauses in speech are short, yet long ones
    (the hard case for a silence timeout) are well covered. Median about 320 ms."""
    lo, hi = PAUSE_RANGE_S
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3)


def _speech(plan: _Plan, voice: str, rate: int, pitch: int, pause_s: float) -> np.ndarray | None:
    """The plan spoken, at 16 kHz, the synthesizer's silence trimmed; an incomplete one with its pause set
    to `pause_s` (None when no break is found)."""
    if plan.engine == "festival":
        return _festival_speech(plan, voice, rate, pitch, pause_s)
    if plan.kind != "incomplete":
        return _trim(resample(espeak(plan.spoken, voice, rate, pitch, ssml=False), 22_050))
    ssml = _ssml(plan.text, round(pause_s * 1000))
    return _set_pause(_trim(resample(espeak(ssml, voice, rate, pitch, ssml=True), 22_050)), pause_s)


def _problem(kind: str, pcm: np.ndarray, pause_s: float) -> str:
    """What breaks the corpus' rules in a finished file ("" when nothing): a gap in a complete turn
    over MAX_GAP_COMPLETE_S, or an incomplete turn without exactly one pause, of the drawn length."""
    if kind == "complete":
        longest = max((b - a for a, b in inner_gaps(pcm)), default=0) / SAMPLE_RATE
        return f"a {longest * 1000:.0f} ms gap in a complete turn" if longest > MAX_GAP_COMPLETE_S else ""
    if kind == "incomplete":
        lo, hi = (round(s * SAMPLE_RATE) for s in PAUSE_RANGE_S)
        lengths = [b - a for a, b in inner_gaps(pcm, MIN_PAUSE_S)]
        # 10 ms: the measured run may differ from the drawn length by a sample or two of noise.
        if len(lengths) != 1 or not lo <= lengths[0] <= hi or abs(lengths[0] / SAMPLE_RATE - pause_s) > 0.010:
            return f"pauses of {lengths} samples where one of {pause_s} s was put"
    return ""


def _render(plan: _Plan, seed: int, out_dir: Path) -> Item:
    """Synthesize, check and write one file, redrawing voice, rate, pitch and pause (deterministically:
    the draws depend only on seed, item and attempt) while the audio breaks the corpus' rules."""
    problem = "no break found"
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"{seed}/{plan.index}/{attempt}")
        voice, rate, pitch = _draw_voice(rng, plan.split, plan.engine)
        pause_s = _draw_pause_s(rng)
        speech = _speech(plan, voice, rate, pitch, pause_s)
        if speech is None:
            continue
        lead, trail = np.zeros(int(LEAD_IN_S * SAMPLE_RATE)), np.zeros(int(TRAIL_S * SAMPLE_RATE))
        pcm = np.concatenate([lead, speech, trail])
        noise = np.random.default_rng(rng.getrandbits(64)).standard_normal(len(pcm))
        pcm = np.clip(np.round(pcm + noise * 32768 * 10 ** (NOISE_DBFS / 20)), -32768, 32767).astype(np.int16)
        problem = _problem(plan.kind, pcm, pause_s)
        if problem:
            continue
        voiced = np.flatnonzero(speech_mask(pcm))
        pauses = tuple((round(a / SAMPLE_RATE, 4), round(b / SAMPLE_RATE, 4)) for a, b in inner_gaps(pcm, MIN_PAUSE_S))
        name = f"{plan.index:04d}_{plan.kind}{'_' + plan.pause_kind if plan.pause_kind else ''}.wav"
        _write_wav(out_dir / name, pcm)
        return Item(
            file=name,
            kind=plan.kind,
            pause_kind=plan.pause_kind,
            text=plan.text,
            engine=plan.engine,
            voice=voice,
            rate=rate,
            pitch=pitch,
            split=plan.split,
            speech_start_s=round(voiced[0] / SAMPLE_RATE, 4),
            end_of_speech_s=round((voiced[-1] + 1) / SAMPLE_RATE, 4),
            pauses=pauses,
            duration_s=round(len(pcm) / SAMPLE_RATE, 4),
            path=(out_dir / name).resolve(),
        )
    raise RuntimeError(f"item {plan.index} ({plan.text!r}): {problem} after {MAX_ATTEMPTS} voices")


def _write_wav(path: Path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.astype("<i2").tobytes())


def read_wav(path: Path) -> np.ndarray:
    """A corpus file's samples: int16, 16 kHz mono (checked)."""
    with wave.open(str(path)) as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, SAMPLE_RATE):
            raise ValueError(f"{path}: not 16 kHz mono int16")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


# ---- the corpus ------------------------------------------------------------------------------------


def _festival_text(text: str) -> str:
    """What Festival is given for a template: the words it would spell out replaced."""
    return " ".join(FESTIVAL_WORDS.get(w, w) for w in text.split(" "))


def _pools(split: str) -> dict[str, list[tuple[str | None, str, dict[str, str]]]]:
    """Per kind, the templates of one split: (pause kind, text, what each engine is given).
    A template is held out when its index in its list is 3 mod 4: fixed, whatever the seed."""

    def keep(i: int) -> bool:
        return (i % 4 == 3) == (split == "heldout")

    def says(espeak_says: str, festival_says: str | None = None) -> dict[str, str]:
        return {"espeak-ng": espeak_says, "festival": festival_says or _festival_text(espeak_says)}

    return {
        "complete": [(None, t, says(t)) for i, t in enumerate(COMPLETE) if keep(i)],
        "incomplete": [(k, t, says(t)) for k in PAUSE_KINDS for i, t in enumerate(INCOMPLETE[k]) if keep(i)],
        "backchannel": [(None, t, says(e, f)) for i, (t, e, f) in enumerate(BACKCHANNELS) if keep(i)],
        "interruption": [(None, t, says(t)) for i, t in enumerate(INTERRUPTIONS) if keep(i)],
    }


def plan_corpus(count: int, seed: int = 0, engines: tuple[str, ...] = ENGINES) -> list[_Plan]:
    """What each file says: count//2 complete, the rest incomplete, count//8 backchannels and as many
    interruptions; every 4th of each kind held out; templates dealt from a seeded shuffle of their pool,
    whole rounds at a time, so all of them are used about equally. Within each kind and split the items
    take the engines in turn, from a seeded first one (a random stream of its own, so that the templates
    dealt do not depend on the engines)."""
    engines = tuple(e for e in ENGINES if e in engines)
    if not engines:
        raise ValueError(f"engines must name one or more of {ENGINES}")
    rng, first = random.Random(seed), random.Random(f"{seed}/engines")
    sizes = {"complete": count // 2, "incomplete": count - count // 2, "backchannel": count // 8}
    sizes["interruption"] = count // 8
    pools = {split: _pools(split) for split in ("tune", "heldout")}
    plans: list[_Plan] = []
    for kind in KINDS:
        decks: dict[tuple[str, str | None], list] = {}
        taken = {"tune": 0, "heldout": 0}
        offset = {split: first.randrange(len(engines)) for split in taken}
        for j in range(sizes[kind]):
            split = "heldout" if j % 4 == 3 else "tune"
            # Incomplete items take the pause kinds in turn, so every kind is there even in a small corpus.
            want = PAUSE_KINDS[taken[split] % len(PAUSE_KINDS)] if kind == "incomplete" else None
            engine = engines[(taken[split] + offset[split]) % len(engines)]
            taken[split] += 1
            deck = decks.setdefault((split, want), [])
            if not deck:
                pool = [e for e in pools[split][kind] if e[0] == want]
                deck.extend(rng.sample(pool, len(pool)))
            pause_kind, text, says = deck.pop()
            plans.append(_Plan(len(plans), kind, pause_kind, text, says[engine], split, engine))
    return plans


def build_corpus(out_dir: Path, count: int, seed: int = 0, engines: tuple[str, ...] = ENGINES) -> list[Item]:
    """Synthesize the corpus into `out_dir` (WAV files and corpus.jsonl) with `engines` (both by default;
    a RuntimeError naming the Debian packages when Festival is asked for and not installed); the same
    seed and engines give the same bytes."""
    out_dir = Path(out_dir)
    plans = plan_corpus(count, seed, engines)
    if "festival" in engines and (missing := festival_missing(TUNE_FESTIVAL + HELDOUT_FESTIVAL)):
        raise RuntimeError(f"{missing}; or build with engines=('espeak-ng',) (--engines espeak-ng)")
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_old(out_dir)
    # espeak-ng and festival run as processes and numpy releases the GIL, so threads keep the cores busy.
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        items = list(pool.map(lambda p: _render(p, seed, out_dir), plans))
    with open(out_dir / MANIFEST, "w") as f:
        for item in items:
            f.write(json.dumps(item.manifest()) + "\n")
    return items


def _remove_old(out_dir: Path) -> None:
    """The files of a corpus built here before, so that a smaller corpus leaves no stray WAV behind."""
    if (out_dir / MANIFEST).is_file():
        for item in load_corpus(out_dir):
            item.path.unlink(missing_ok=True)


def load_corpus(out_dir: Path) -> list[Item]:
    """The corpus in `out_dir`, from its corpus.jsonl, each item's WAV path resolved."""
    out_dir = Path(out_dir)
    items = []
    for line in (out_dir / MANIFEST).read_text().splitlines():
        row = json.loads(line)
        row.setdefault("engine", "espeak-ng")  # manifests from before Festival came in
        row["pauses"] = tuple(tuple(p) for p in row["pauses"])
        items.append(Item(**row, path=(out_dir / row["file"]).resolve()))
    return items


def summary(items: list[Item]) -> str:
    """Items per kind and split (and how many of them Festival's), pause lengths per pause kind, items,
    voices and rates per engine, and a last line of totals."""
    lines = [f"{'kind':<14}{'tune':>6}{'heldout':>9}{'festival':>10}"]
    for kind in KINDS:
        n = {s: sum(i.kind == kind and i.split == s for i in items) for s in ("tune", "heldout")}
        festival = sum(i.kind == kind and i.engine == "festival" for i in items)
        lines.append(f"{kind:<14}{n['tune']:>6}{n['heldout']:>9}{festival:>10}")
    lines.append(f"\n{'pause kind':<14}{'items':>6}{'min ms':>9}{'median ms':>11}{'max ms':>9}")
    for pk in (*PAUSE_KINDS, None):
        ms = [
            1000 * (b - a) for i in items if i.kind == "incomplete" and pk in (None, i.pause_kind) for a, b in i.pauses
        ]
        if ms:
            name = pk or "all"
            lines.append(f"{name:<14}{len(ms):>6}{min(ms):>9.0f}{statistics.median(ms):>11.0f}{max(ms):>9.0f}")
    lines.append(f"\n{'engine':<14}{'items':>6}{'voices':>8}  rate")
    for engine, unit in zip(ENGINES, ("wpm", "% speed")):
        mine = [i for i in items if i.engine == engine]
        if mine:
            rates = f"{min(i.rate for i in mine)}-{max(i.rate for i in mine)} {unit}"
            lines.append(f"{engine:<14}{len(mine):>6}{len({i.voice for i in mine}):>8}  {rates}")
    by = {k: sum(i.kind == k for i in items) for k in KINDS}
    lines.append(
        f"items={len(items)} complete={by['complete']} incomplete={by['incomplete']} "
        f"backchannel={by['backchannel']} interruption={by['interruption']} "
        f"heldout={sum(i.split == 'heldout' for i in items)} festival={sum(i.engine == 'festival' for i in items)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the WAV files and corpus.jsonl")
    parser.add_argument("--count", type=int, default=200, help="complete + incomplete utterances")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="synthesizers to use (default: both)"
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    items = build_corpus(args.out, args.count, args.seed, tuple(args.engines))
    print(f"built {len(items)} files in {time.monotonic() - began:.1f} s into {args.out}", file=sys.stderr)
    print(summary(items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
