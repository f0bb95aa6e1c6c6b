"""A call's caption timeline and its WebVTT (agent/transport/captions_log.py).

Pins:
- timestamps are `HH:MM:SS.mmm`, rounded to the millisecond, hours past 99 not wrapped;
- cue text escapes `&`, `<` and `>` (so a said `-->` or `<b>` stays text), and has no blank
  line (which would end the cue); the speaker is a `<v user>`/`<v agent>` voice span;
- a timeline built from server events (speech_started/stopped, transcription partials and
  completed, reply transcript deltas, output_audio_buffer.started/stopped) gives one user cue
  per item and one agent cue per response, the agent's from when its audio started, times from
  the call's start, in start order; open cues end at "now" while the call runs and at its end
  after; an empty completed transcription shows no cue, even after partials showed words (the
  completed transcript is the final word, as on the overlay);
- the file parses with webvtt-py, with the cues' text and voices as recorded;
- memory: past max_chars the oldest cues are dropped and a NOTE says how many.
"""

from __future__ import annotations

import webvtt

from agent.transport.captions_log import CallCaptions, escape, timestamp, voice


def _ms(stamp: str) -> int:
    h, m, s = stamp.split(":")
    return round((int(h) * 3600 + int(m) * 60 + float(s)) * 1000)


def test_timestamps() -> None:
    assert timestamp(0) == "00:00:00.000"
    assert timestamp(1.2344) == "00:00:01.234"
    assert timestamp(1.2346) == "00:00:01.235"
    assert timestamp(61.5) == "00:01:01.500"
    assert timestamp(3599.9996) == "01:00:00.000"  # rounding carries into the hour
    assert timestamp(100 * 3600 + 2.25) == "100:00:02.250"
    assert timestamp(-3) == "00:00:00.000"


def test_escaping() -> None:
    assert escape("a < b & c > d") == "a &lt; b &amp; c &gt; d"
    assert escape("go --> there") == "go --&gt; there"
    assert escape("<v agent>fake</v>") == "&lt;v agent&gt;fake&lt;/v&gt;"
    assert escape("&amp;") == "&amp;amp;"  # what was said, not an entity
    assert escape("one\n\n\ntwo  \n  three ") == "one\ntwo\nthree"
    assert voice("user", "hi & bye") == "<v user>hi &amp; bye"


def _call() -> CallCaptions:
    log = CallCaptions("rtc_test", started=100.0)
    ev = log.record
    ev({"type": "input_audio_buffer.speech_started", "item_id": "item_1"}, 101.0)
    ev(
        {
            "type": "conversation.item.input_audio_transcription.delta",
            "item_id": "item_1",
            "delta": "what",
            "omni": {"text": "what is", "stable_chars": 4},
        },
        101.5,
    )
    ev({"type": "omni.input_audio_transcription.partial", "item_id": "item_1", "omni": {"text": "what's -->"}}, 101.8)
    ev({"type": "input_audio_buffer.speech_stopped", "item_id": "item_1"}, 102.5)
    ev({"type": "response.created", "response": {"id": "resp_1"}}, 102.6)
    ev({"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "delta": "Fish "}, 102.7)
    ev(
        {
            "type": "conversation.item.input_audio_transcription.completed",
            "item_id": "item_1",
            "transcript": "what's <this> & that?",
        },
        102.9,
    )
    ev({"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "delta": "& chips."}, 103.0)
    ev({"type": "output_audio_buffer.started", "response_id": "resp_1"}, 103.2)
    ev({"type": "response.output_audio_transcript.done", "response_id": "resp_1", "transcript": "Fish & chips."}, 103.3)
    ev({"type": "response.done", "response": {"id": "resp_1"}}, 103.4)
    ev({"type": "output_audio_buffer.stopped", "response_id": "resp_1"}, 105.0)
    # A second turn whose partial the empty final takes back, and a third still being said.
    ev({"type": "input_audio_buffer.speech_started", "item_id": "item_2"}, 106.0)
    ev({"type": "omni.input_audio_transcription.partial", "item_id": "item_2", "omni": {"text": "uh"}}, 106.2)
    ev({"type": "input_audio_buffer.speech_stopped", "item_id": "item_2"}, 106.4)
    ev({"type": "conversation.item.input_audio_transcription.completed", "item_id": "item_2", "transcript": ""}, 106.6)
    ev({"type": "input_audio_buffer.speech_started", "item_id": "item_3"}, 107.0)
    ev({"type": "conversation.item.input_audio_transcription.delta", "item_id": "item_3", "delta": "and"}, 107.3)
    return log


def test_timeline_from_events() -> None:
    log = _call()
    cues = list(webvtt.from_string(log.vtt(now=108.0)))
    assert [(c.voice, c.text) for c in cues] == [
        ("user", "what's &lt;this&gt; &amp; that?"),
        ("agent", "Fish &amp; chips."),
        ("user", "and"),
    ]
    spans = [(_ms(c.start), _ms(c.end)) for c in cues]
    # The user's turn from speech_started to speech_stopped; the reply from its audio's start
    # (not its first transcript delta) to its audio's end; the open turn up to now.
    assert spans == [(1000, 2500), (3200, 5000), (7000, 8000)]
    assert [c.identifier for c in cues] == ["user-1", "agent-2", "user-3"]


def test_an_ended_call_closes_its_cues_and_takes_no_more() -> None:
    log = _call()
    log.end(109.0)
    log.record(
        {"type": "conversation.item.input_audio_transcription.delta", "item_id": "item_9", "delta": "late"}, 110.0
    )
    cues = list(webvtt.from_string(log.vtt(now=500.0)))
    assert len(cues) == 3
    assert (_ms(cues[-1].start), _ms(cues[-1].end)) == (7000, 9000)


def test_cues_are_in_start_order_with_a_minimum_length() -> None:
    log = CallCaptions("rtc_test", started=0.0)
    # The reply's transcript starts before the user's late transcript arrives, but its audio
    # starts later: the cues sort by when they are heard.
    log.record({"type": "response.output_text.delta", "response_id": "r", "delta": "text reply"}, 5.0)
    log.record({"type": "response.done", "response": {"id": "r"}}, 5.01)
    log.record(
        {"type": "conversation.item.input_audio_transcription.completed", "item_id": "i", "transcript": "hi"}, 4.0
    )
    cues = list(webvtt.from_string(log.vtt(now=6.0)))
    assert [c.voice for c in cues] == ["user", "agent"]
    starts = [_ms(c.start) for c in cues]
    assert starts == sorted(starts)
    assert all(_ms(c.end) - _ms(c.start) >= 500 for c in cues)  # a cue shows long enough to read


def test_memory_is_bounded() -> None:
    log = CallCaptions("rtc_test", started=0.0, max_chars=100)
    for n in range(20):
        log.record(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": f"i{n}",
                "transcript": f"turn {n:02d} " + "x" * 12,
            },
            float(n),
        )
    text = log.vtt(now=30.0)
    cues = list(webvtt.from_string(text))
    assert 0 < len(cues) < 20 and sum(len(c.text) for c in cues) <= 100
    assert cues[-1].text.startswith("turn 19")  # the newest are kept
    assert f"NOTE {20 - len(cues)} earlier cues were dropped" in text
