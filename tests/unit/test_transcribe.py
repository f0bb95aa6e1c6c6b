"""Live input transcription in the streaming runner (agent/engine/runner/transcriber.py), tiny model.

Pins (the tiny model's words are random: the protocol and the prefix property, not words):
- while the user speaks, a partial comes for every half second of speech (new final tokens, or
  the open chunk's provisional ones, which never stay in the transcript row); each
  partial's text starts with the previous one's stable prefix, and the stable prefix only grows;
- the end of the turn gives one final transcript that starts with the last stable prefix;
- partials come in the 20 ms frame that crosses each half-second mark, though a transcription-only
  session encodes its audio in 80 ms pieces;
- a transcription-only session ('only') never prefills its turn into a conversation, answers
  no reply, takes no second slot, and its transcript row stays bounded over many turns;
- a conversation session ('on') transcribes in a slot of its own, gives it back when turned
  off, and its reply still comes (the transcript's final after the reply's prefill);
- a discarded turn gives no transcript, and a turn of text only (no audio) none either;
- a user item committed with no reply asked (end_user_item) has its final transcript at once,
  equal to the one its speech gets as a turn answered by a reply; the turn goes on: the next
  item's partials and final cover only its own speech (equal to its speech's as a turn of its
  own), and the reply that answers the turn prefills both items' audio; a reply right after a
  commit, with no speech since, gives no second final;
- a turn answered by a committed speculation (its reply began on a fork of the turn at a pause)
  is the same turn to the transcriber: its final transcript starts with the stable prefix the
  partials promised and equals the one of the same turn answered without speculation, also
  when the turn's queued audio was encoded (and transcribed) after the fork.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_drive import PIECE, SYSTEM, make_audio, run_until_idle

from agent.engine.api import ReplyDone, TranscriptOut
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.state.phase import ReplyPhase


def audio(seconds: float, seed: int) -> np.ndarray:
    return make_audio(seconds, 220, seed, noise=0.05, loud_first=False)


def speak(runner: StreamingRunner, sid: str, wav: np.ndarray) -> list[TranscriptOut]:
    """Feed 80 ms pieces, stepping as an engine loop would; the transcripts that came."""
    outs = []
    for i in range(0, len(wav), PIECE):
        runner.append_audio(sid, wav[i : i + PIECE])
        outs += run_until_idle(runner)
    return [o for o in outs if isinstance(o, TranscriptOut)]


def check_prefixes(partials: list[TranscriptOut], final: TranscriptOut) -> None:
    stable = ""
    for p in [*partials, final]:
        assert p.text.startswith(stable), (stable, p.text)
        assert p.stable_chars >= len(stable)
        stable = p.text[: p.stable_chars]
    assert final.final and final.stable_chars == len(final.text)


@pytest.fixture
def runner(loaded):
    return StreamingRunner(
        loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.4, audio_window_s=1.0, max_sessions=3
    )


def test_transcription_only_session(runner):
    runner.open_session("c")
    assert runner.set_transcription("c", "only") == "only"
    free = len(runner.sessions.slots._free)
    lengths = []
    for turn in range(3):
        runner.set_transcript_item("c", f"item{turn}")
        partials = speak(runner, "c", audio(3.2, turn))
        assert len(partials) >= 6  # one per half second of speech, not only per final chunk
        tr = runner.transcriber.sessions["c"]
        # Only final tokens stay in the row (3 full chunks); the provisional ones were cropped.
        assert tr.fed == 39 and tr.kv.length == tr.audio_end[0]
        assert all(not p.final and p.item_id == f"item{turn}" for p in partials)
        runner.end_turn("c")
        finals = [o for o in run_until_idle(runner) if isinstance(o, TranscriptOut)]
        assert len(finals) == 1 and finals[0].item_id == f"item{turn}"
        check_prefixes(partials, finals[0])
        lengths.append(runner.transcriber.sessions["c"].kv.length)
        state = runner.sessions["c"]
        assert not state.turn.header_done and state.reply is None  # no conversation at all
    assert len(set(lengths)) == 1  # back to the system prompt after every turn: bounded
    assert len(runner.sessions.slots._free) == free  # no second slot
    with pytest.raises(RuntimeError):
        runner.begin_reply("c", [])


def test_conversation_transcribes_in_its_own_slot(runner):
    runner.open_session("s")
    free = len(runner.sessions.slots._free)
    runner.set_transcription("s", "on")
    assert len(runner.sessions.slots._free) == free - 1
    runner.set_transcript_item("s", "u1")
    partials = speak(runner, "s", audio(2.4, 7))
    assert partials
    runner.begin_reply("s", [], text_only=True)
    outs = run_until_idle(runner)
    finals = [o for o in outs if isinstance(o, TranscriptOut)]
    assert [type(o) for o in outs if isinstance(o, ReplyDone)] == [ReplyDone]
    assert len(finals) == 1 and finals[0].final and finals[0].item_id == "u1"
    check_prefixes(partials, finals[0])
    # A turn of text only has no audio to transcribe: no transcript (it sent u1's again, new words).
    runner.add_user_text("s", "and now in writing")
    runner.begin_reply("s", [], text_only=True)
    outs = run_until_idle(runner)
    assert any(isinstance(o, ReplyDone) for o in outs)
    assert not [o for o in outs if isinstance(o, TranscriptOut)]
    # A false start: nothing is transcribed for it.
    runner.set_transcript_item("s", "u2")
    runner.append_audio("s", audio(0.5, 8))
    runner.discard_turn("s")
    assert not [o for o in run_until_idle(runner) if isinstance(o, TranscriptOut)]
    runner.set_transcription("s", "off")
    assert len(runner.sessions.slots._free) == free
    runner.close_session("s")
    assert len(runner.sessions.slots._free) == free + 1


def test_an_item_committed_without_a_reply_is_transcribed_at_once(runner):
    def answer(sid: str) -> tuple[list[TranscriptOut], ReplyDone]:
        runner.begin_reply(sid, [], text_only=True)
        outs = run_until_idle(runner)
        [done] = [o for o in outs if isinstance(o, ReplyDone)]
        return [o for o in outs if isinstance(o, TranscriptOut)], done

    first, second = audio(2.4, 7), audio(1.7, 9)
    # The references: each speech as a turn of its own, answered by a reply.
    runner.open_session("r")
    runner.set_transcription("r", "on")
    reference, audio_tokens = [], 0
    for n, wav in enumerate((first, second)):
        runner.set_transcript_item("r", f"r{n}")
        speak(runner, "r", wav)
        [final], done = answer("r")
        reference.append(final.text)
        audio_tokens += done.stats["input_audio_tokens"]
    runner.close_session("r")

    runner.open_session("s")
    runner.set_transcription("s", "on")
    runner.set_transcript_item("s", "u1")
    partials = speak(runner, "s", first)
    runner.end_user_item("s")  # committed, no reply: its transcript comes now
    [final] = [o for o in run_until_idle(runner) if isinstance(o, TranscriptOut)]
    assert (final.item_id, final.final, final.text) == ("u1", True, reference[0])
    check_prefixes(partials, final)
    state = runner.sessions["s"]
    assert state.reply is None and state.turn.audio_feats + state.turn.pending_audio  # the turn goes on
    runner.set_transcript_item("s", "u2")
    partials = speak(runner, "s", second)
    assert partials and {p.item_id for p in partials} == {"u2"}
    finals, done = answer("s")
    assert [(f.item_id, f.text) for f in finals] == [("u2", reference[1])]
    check_prefixes(partials, finals[0])
    assert done.stats["input_audio_tokens"] == audio_tokens  # one turn holding both items' speech
    # A commit answered right away, with no speech since: one final only.
    runner.set_transcript_item("s", "u3")
    speak(runner, "s", audio(1.2, 11))
    runner.end_user_item("s")
    finals, _ = answer("s")
    assert [(f.item_id, f.final) for f in finals] == [("u3", True)]


def test_partials_wait_for_first_audio(runner):
    """Under load transcription is what waits: in a tick with a reply waiting for its first
    audio, no transcript is made; once the engine has slack, it comes."""
    runner.open_session("talker")
    runner.open_session("captions")
    runner.set_transcription("captions", "only")
    runner.set_transcript_item("captions", "c1")
    speak(runner, "talker", audio(1.0, 3))
    wav = audio(2.0, 4)
    for i in range(0, len(wav), PIECE):  # an idle engine encodes at once: tokens are ready
        runner.append_audio("captions", wav[i : i + PIECE])
    assert runner.transcriber.has_work(runner.sessions)
    runner.begin_reply("talker", [])
    first = runner.step()
    assert runner.sessions["talker"].reply.prefill.done  # the reply's prefill had the tick
    assert not [o for o in first if isinstance(o, TranscriptOut)]
    later = [o for o in run_until_idle(runner) if isinstance(o, TranscriptOut)]
    assert later and all(o.item_id == "c1" for o in later)


def test_graph_wiring_gives_the_same_transcripts(loaded, tiny_model_dir):
    """The GPU path (captured decode and prefill graphs, run on CPU by fake_graphs) transcribes
    exactly as the eager one: the transcript rows go through the same graphs as replies."""
    from agent.engine.checkpoints.model import load_model
    from agent.engine.instruments.fake_graphs import fake_graph_config

    options = dict(max_reply_tokens=6, max_reply_seconds=0.4, audio_window_s=1.0, max_sessions=3, context_limit=1024)
    texts = []
    for runner in (
        StreamingRunner(loaded, SYSTEM, **options),
        StreamingRunner(load_model(str(tiny_model_dir), device="cpu"), SYSTEM, graphs=fake_graph_config(), **options),
    ):
        runner.open_session("a")
        runner.open_session("b")
        runner.set_transcription("a", "only")
        runner.set_transcription("b", "on")
        for sid in ("a", "b"):
            runner.set_transcript_item(sid, sid)
        wav = audio(2.2, 11)
        outs = []
        for i in range(0, len(wav), PIECE):  # both at once: batched transcript rows
            runner.append_audio("a", wav[i : i + PIECE])
            runner.append_audio("b", wav[i : i + PIECE])
            outs += run_until_idle(runner)
        runner.end_turn("a")
        runner.begin_reply("b", [], text_only=True)
        outs += run_until_idle(runner)
        texts.append([(o.item_id, o.text, o.stable_chars, o.final) for o in outs if isinstance(o, TranscriptOut)])
    assert texts[0] == texts[1] and any(final for *_, final in texts[0])


def test_a_new_session_takes_back_a_transcription_slot(runner):
    """Sessions come first: with every slot taken, a new session gets the slot a conversation's
    transcription held (that transcription stops), and a transcription asking for a slot when
    none is free is refused."""
    runner.open_session("s1")
    runner.set_transcription("s1", "on")
    runner.open_session("s2")  # 3 slots: s1, s1's transcript, s2
    with pytest.raises(RuntimeError):
        runner.set_transcription("s2", "on")
    runner.open_session("s3")
    assert "s1" not in runner.transcriber.sessions and set(runner.sessions) == {"s1", "s2", "s3"}


def test_partials_come_at_each_half_second_mark(runner):
    """A transcription-only session encodes its audio in 80 ms pieces, yet its partials come in
    the 20 ms frame whose audio crosses each half-second mark (chunk ends included), not later."""
    runner.open_session("c")
    runner.set_transcription("c", "only")
    runner.set_transcript_item("c", "i")
    wav, frame = audio(2.3, 21), 320
    mel = runner.sessions["c"].turn.audio.mel
    at = []
    for i in range(0, len(wav), frame):
        runner.append_audio("c", wav[i : i + frame])
        if any(isinstance(o, TranscriptOut) for o in run_until_idle(runner)):
            at.append(i + frame)
    marks = [next(n for n in range(frame, len(wav) + frame, frame) if mel.frames_for(n) >= 50 * k) for k in range(1, 5)]
    assert at == marks


def answered_turn(runner: StreamingRunner, wav: np.ndarray, speculate: bool) -> list[TranscriptOut]:
    """One transcribed conversation turn answered text-only, with or without a speculation
    started (and held) at its end and committed by begin_reply; its transcripts."""
    runner.open_session("s")
    runner.set_transcription("s", "on")
    runner.set_transcript_item("s", "u1")
    outs = speak(runner, "s", wav)
    if speculate:
        assert runner.speculate("s", [], text_only=True)
        for _ in range(50):  # bounded: the speculation parks once its first token is made
            outs += [o for o in runner.step() if isinstance(o, TranscriptOut)]
            if runner.sessions["s"].reply.phase is ReplyPhase.HELD:
                break
        assert runner.sessions["s"].reply.phase is ReplyPhase.HELD
    runner.begin_reply("s", [], text_only=True)
    outs += [o for o in runner.take_ready() + run_until_idle(runner, 300) if isinstance(o, TranscriptOut)]
    return outs


def test_a_committed_speculation_keeps_the_transcript(runner, loaded):
    wav = audio(4.0, 7)
    plain = answered_turn(runner, wav, speculate=False)
    speculated = answered_turn(
        StreamingRunner(loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.4, audio_window_s=1.0, max_sessions=3),
        wav,
        speculate=True,
    )
    partials, finals = [o for o in speculated if not o.final], [o for o in speculated if o.final]
    assert any(p.stable_chars for p in partials), "nothing became stable: the test would prove nothing"
    assert len(finals) == 1 and finals[0].item_id == "u1"
    check_prefixes(partials, finals[0])  # (the bug: the fork was a new turn, transcribed over: "")
    assert [(o.text, o.stable_chars) for o in speculated] == [(o.text, o.stable_chars) for o in plain]


def test_a_fork_behind_its_turn_keeps_the_transcript(loaded):
    """The speculation forked the turn while its audio still waited to be encoded (the engine was
    busy with another session's reply); the turn's own encode then fed the transcript row audio
    tokens made after the fork: the transcript still goes on from the row, and is the one made
    without speculation."""
    finals = []
    for speculate in (False, True):
        runner = StreamingRunner(
            loaded, SYSTEM, max_reply_tokens=40, max_reply_seconds=3.0, audio_window_s=1.0, max_sessions=4
        )
        runner.open_session("s")
        runner.set_transcription("s", "on")
        runner.set_transcript_item("s", "u1")
        wav = audio(3.2, 7)
        head = len(wav) - 8 * PIECE
        outs = speak(runner, "s", wav[:head])
        runner.open_session("other")  # a reply in flight: the rest of the turn is queued, not encoded
        runner.append_audio("other", audio(0.8, 3))
        runner.begin_reply("other", [], text_only=True)
        runner.step()
        for i in range(head, len(wav), PIECE):
            runner.append_audio("s", wav[i : i + PIECE])
        turn = runner.sessions["s"].turn
        assert turn.pcm, "the end of the turn was encoded at once: no fork behind its turn"
        if speculate:
            assert runner.speculate("s", [], text_only=True)
            fork = runner.sessions["s"].reply.turn
            shared = sum(int(t.shape[0]) for t in (*fork.audio_feats, *fork.pending_audio))
        outs += [o for o in run_until_idle(runner, 400) if isinstance(o, TranscriptOut)]
        if speculate:
            fed = runner.transcriber.sessions["s"].fed
            assert fed > shared, "the row never went past the tokens the fork was made with"
        runner.begin_reply("s", [], text_only=True)
        outs += [o for o in runner.take_ready() + run_until_idle(runner, 400) if isinstance(o, TranscriptOut)]
        final = [o for o in outs if o.final]
        assert len(final) == 1
        check_prefixes([o for o in outs if not o.final], final[0])
        finals.append(final[0].text)
    assert finals[0] == finals[1] and finals[0]
