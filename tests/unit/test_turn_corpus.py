"""The end-of-turn corpus (scripts/turn_corpus.py) says truly where each turn ends and pauses.

Pins, on a small corpus from real espeak-ng and Festival (both engines, about half the items each),
each claim re-measured here from the WAV files with an independent energy detector (10 ms frames,
speech within 40 dB of the loudest frame), for the items of both engines alike:
- the same seed gives the same manifest and byte-identical WAV files; another seed does not;
- files are 16 kHz mono int16: 300 ms lead-in, speech, 1.5 s of silence; speech_start_s and
  end_of_speech_s are where the energy really starts and ends (within 40 ms of where the frames cross
  40 dB under the loudest, or 3 dB lower: a weak stop release or voiced closure of a Festival voice can
  sit right at the threshold, where a 10 ms frame's RMS and the module's sliding one fall either side);
- every incomplete item has exactly one inner pause, recorded in 150-700 ms; re-measured it is there
  (within 30 ms: frames quantize each edge by up to 10 ms and a frame's threshold crossing on a
  decaying consonant lands a few ms off the sample-level one), silent inside, with speech on both sides;
- complete items have no inner pause of 150 ms or more;
- held-out items share no template text, no base voice and no variant (espeak-ng) and no voice
  (Festival) with tune items, and every pause kind and every kind of item is there;
- a default build has items of both engines in every kind, engine="festival" ones in Festival's voices;
  the engines change which synthesizer says an item, never what it says;
- each voice in the pools sounds different (espeak-ng silently drops a variant on some voice names;
  Festival's pitch setting must reach the diphone voices);
- Festival missing: a clear error naming the Debian packages, unless only espeak-ng is asked for;
- load_corpus gives back what build_corpus made, and reads a manifest from before `engine` as
  espeak-ng's; the CLI ends with its totals line, and --engines picks the synthesizers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import turn_corpus as tc  # noqa: E402
import turn_voices as tv  # noqa: E402

COUNT = 40
FRAME = 160  # 10 ms at 16 kHz
EDGE_TOLERANCE_S = 0.030
END_TOLERANCE_S = 0.040


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[tc.Item]]:
    out = tmp_path_factory.mktemp("turns")
    return out, tc.build_corpus(out, COUNT, seed=0)


def frames_db(path: Path) -> np.ndarray:
    """Each 10 ms frame's RMS in dB under the file's loudest frame, read with `wave` here."""
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64)
    rms = np.sqrt(np.mean(pcm[: len(pcm) // FRAME * FRAME].reshape(-1, FRAME) ** 2, axis=1))
    return 20 * np.log10(np.maximum(rms, 1e-9) / rms.max())


def speech_edges(db: np.ndarray, threshold: float) -> tuple[float, float]:
    """Where the first speech frame (at least `threshold` dB) starts and the last one ends, in s."""
    speech = np.flatnonzero(db >= threshold)
    return speech[0] * FRAME / 16_000, (speech[-1] + 1) * FRAME / 16_000


def silent_runs(db: np.ndarray) -> list[tuple[float, float]]:
    """[start_s, end_s] of each run of frames under -40 dB, between the first and last speech frame."""
    speech = np.flatnonzero(db >= -40)
    quiet = db[speech[0] : speech[-1] + 1] < -40
    edges = np.diff(np.concatenate([[0], quiet.astype(int), [0]]))
    starts, ends = np.flatnonzero(edges == 1) + speech[0], np.flatnonzero(edges == -1) + speech[0]
    return [(a * FRAME / 16_000, b * FRAME / 16_000) for a, b in zip(starts, ends)]


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a, b, c = (tc.build_corpus(tmp_path / name, 8, seed=seed) for name, seed in (("a", 5), ("b", 5), ("c", 6)))
    assert (tmp_path / "a" / tc.MANIFEST).read_bytes() == (tmp_path / "b" / tc.MANIFEST).read_bytes()
    for x, y in zip(a, b):
        assert x.path.read_bytes() == y.path.read_bytes(), x.file
    assert (tmp_path / "a" / tc.MANIFEST).read_bytes() != (tmp_path / "c" / tc.MANIFEST).read_bytes()


def test_files_and_where_speech_is(corpus) -> None:
    _, items = corpus
    for item in items:
        db = frames_db(item.path)
        (start, end), (start_low, end_low) = (speech_edges(db, threshold) for threshold in (-40, -43))
        assert start_low - END_TOLERANCE_S <= item.speech_start_s <= start + END_TOLERANCE_S, item
        assert end - END_TOLERANCE_S <= item.end_of_speech_s <= end_low + END_TOLERANCE_S, item
        assert abs(item.speech_start_s - tc.LEAD_IN_S) <= 0.015, item
        assert item.duration_s == pytest.approx(len(db) * FRAME / 16_000, abs=FRAME / 16_000)
        assert item.duration_s - item.end_of_speech_s >= tc.TRAIL_S - 0.01, item
        assert db[: int(0.28 * 100)].max() < -40, item  # the lead-in holds no speech
    for item in items:
        if item.kind == "backchannel":
            assert item.end_of_speech_s - item.speech_start_s < 1.0, item


def test_incomplete_items_pause_once_and_really(corpus) -> None:
    _, items = corpus
    incomplete = [i for i in items if i.kind == "incomplete"]
    assert len(incomplete) == COUNT - COUNT // 2
    for item in incomplete:
        assert " ... " in item.text and len(item.pauses) == 1, item
        start, end = item.pauses[0]
        assert 0.150 <= end - start <= 0.700, item
        assert item.speech_start_s < start and end < item.end_of_speech_s, item
        db = frames_db(item.path)
        # Re-measured: the quiet run around the pause's middle has (nearly) the recorded edges.
        (run,) = [r for r in silent_runs(db) if r[0] <= (start + end) / 2 < r[1]]
        assert abs(run[0] - start) <= EDGE_TOLERANCE_S and abs(run[1] - end) <= EDGE_TOLERANCE_S, (item, run)
        assert 0.150 - EDGE_TOLERANCE_S <= run[1] - run[0] <= 0.700 + EDGE_TOLERANCE_S, (item, run)
        inside = db[int(start * 100) + 1 : int(end * 100) - 1]
        assert inside.max() < -40, item
        # Speech on both sides: within 150 ms of each edge some frame is within 25 dB of the loudest
        # (the -70 dBFS floor is some 55 dB under it).
        assert db[int(start * 100) - 15 : int(start * 100)].max() > -25, item
        assert db[int(end * 100) + 1 : int(end * 100) + 16].max() > -25, item


def test_complete_items_have_no_inner_pause(corpus) -> None:
    _, items = corpus
    complete = [i for i in items if i.kind == "complete"]
    assert len(complete) == COUNT // 2
    for item in complete:
        assert item.pauses == () and " ... " not in item.text, item
        longest = max((b - a for a, b in silent_runs(frames_db(item.path))), default=0.0)
        assert longest < tc.MIN_PAUSE_S, (item, longest)


def test_heldout_shares_no_text_and_no_voice(corpus) -> None:
    _, items = corpus
    tune = [i for i in items if i.split == "tune"]
    heldout = [i for i in items if i.split == "heldout"]
    assert tune and heldout and len(tune) + len(heldout) == len(items)
    assert {i.text for i in tune}.isdisjoint(i.text for i in heldout)
    assert {i.voice for i in tune}.isdisjoint(i.voice for i in heldout)
    espeak = {s: [i for i in group if i.engine == "espeak-ng"] for s, group in (("tune", tune), ("heldout", heldout))}
    bases = {s: {i.voice.split("+")[0] for i in group} for s, group in espeak.items()}
    variants = {s: {i.voice.split("+")[1] for i in group} for s, group in espeak.items()}
    assert bases["tune"].isdisjoint(bases["heldout"]) and variants["tune"].isdisjoint(variants["heldout"])
    assert {i.voice for i in tune if i.engine == "festival"} <= set(tc.TUNE_FESTIVAL)
    assert {i.voice for i in heldout if i.engine == "festival"} <= set(tc.HELDOUT_FESTIVAL)
    assert {i.kind for i in heldout} == set(tc.KINDS)
    assert {i.pause_kind for i in items if i.kind == "incomplete"} == set(tc.PAUSE_KINDS)
    assert all(i.pause_kind is None for i in items if i.kind != "incomplete")
    assert len({i.voice for i in items}) >= 10
    for i in items:
        if i.engine == "espeak-ng":
            assert tc.RATE_WPM[0] <= i.rate <= tc.RATE_WPM[1] and tc.PITCH[0] <= i.pitch <= tc.PITCH[1], i
        elif i.voice in tv.HTS_VOICES:
            assert tv.FESTIVAL_RATE[0] <= i.rate <= tv.FESTIVAL_RATE[1] and i.pitch == 0, i
        else:
            assert tv.FESTIVAL_RATE[0] <= i.rate <= tv.FESTIVAL_RATE[1], i
            assert tv.FESTIVAL_F0[0] <= i.pitch <= tv.FESTIVAL_F0[1], i


def test_default_build_has_both_engines(corpus) -> None:
    _, items = corpus
    assert {i.engine for i in items} == set(tc.ENGINES)
    festival = [i for i in items if i.engine == "festival"]
    assert {i.voice for i in festival} <= set(tc.TUNE_FESTIVAL + tc.HELDOUT_FESTIVAL)
    assert len({i.voice for i in festival}) >= 2
    for kind in tc.KINDS:
        mine = [i for i in items if i.kind == kind]
        share = sum(i.engine == "festival" for i in mine) / len(mine)
        assert 0.25 <= share <= 0.75, (kind, share)
    incomplete = {e: [i for i in items if i.kind == "incomplete" and i.engine == e] for e in tc.ENGINES}
    assert all(len(group) >= 5 for group in incomplete.values()), incomplete
    # The engines say the same templates: only the synthesizer changes.
    plans = {e: tc.plan_corpus(COUNT, 0, e) for e in (("espeak-ng",), ("festival",), tc.ENGINES)}
    texts = {e: [(p.kind, p.text, p.split) for p in group] for e, group in plans.items()}
    assert texts[("espeak-ng",)] == texts[("festival",)] == texts[tc.ENGINES]
    assert {p.engine for p in plans[("festival",)]} == {"festival"}


def test_every_voice_sounds_different() -> None:
    voices = [f"{b}+{v}" for b in tc.TUNE_BASES for v in tc.TUNE_VARIANTS]
    voices += [f"{b}+{v}" for b in tc.HELDOUT_BASES for v in tc.HELDOUT_VARIANTS]
    spoken = {v: tc.espeak("hello there", v, 175, 50, ssml=False).tobytes() for v in voices}
    assert len(set(spoken.values())) == len(voices)
    festival = {v: tv.festival("hello there", v, 100, 105)[0].tobytes() for v in tc.TUNE_FESTIVAL + tc.HELDOUT_FESTIVAL}
    assert len(set(festival.values())) == len(festival)
    # Pitch reaches the diphone voices, speed all of them (slower: longer), and the words come back.
    low, words = tv.festival("hello there", "kal_diphone", 100, tv.FESTIVAL_F0[0])
    assert low.tobytes() != festival["kal_diphone"] and [w.name for w in words] == ["hello", "there"]
    for voice in tc.TUNE_FESTIVAL:
        assert len(tv.festival("hello there", voice, 80, 105)[0]) > 1.1 * len(
            tv.festival("hello there", voice, 118, 105)[0]
        )


def test_festival_missing_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tv, "FESTIVAL_BIN", "no-such-festival")
    with pytest.raises(RuntimeError, match="festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"):
        tc.build_corpus(tmp_path / "both", 8, seed=0)
    assert not (tmp_path / "both").exists()
    items = tc.build_corpus(tmp_path / "espeak", 8, seed=0, engines=("espeak-ng",))
    assert len(items) == 10 and {i.engine for i in items} == {"espeak-ng"}


def test_load_corpus_gives_back_the_build(corpus, tmp_path: Path) -> None:
    out, items = corpus
    loaded = tc.load_corpus(out)
    assert loaded == items
    assert all(i.path.is_file() and i.path.parent == out.resolve() for i in loaded)
    # A manifest from before Festival came in has no engine: its items are espeak-ng's.
    old = [json.loads(line) for line in (out / tc.MANIFEST).read_text().splitlines() if '"espeak-ng"' in line]
    (tmp_path / tc.MANIFEST).write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "engine"}) + "\n" for r in old)
    )
    assert [i.engine for i in tc.load_corpus(tmp_path)] == ["espeak-ng"] * len(old)


def test_cli_prints_the_totals(tmp_path: Path) -> None:
    script = Path(tc.__file__)
    run = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--count", "8", "--seed", "1", "--engines", "festival"],
        capture_output=True,
        text=True,
        check=True,
    )
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("items=10 complete=4 incomplete=4 "), last
    assert "heldout=" in last and last.endswith(" festival=10"), last
    assert [i.engine for i in tc.load_corpus(tmp_path)] == ["festival"] * 10
