"""The vision encoder runs on camera frames as they arrive, not at the end of the turn.

Pins, with StreamingRunner on the tiny model: frames appended with append_video while no reply
runs are encoded at once, so a reply shown those frames encodes none at the end of its turn
(`frames_encoded_at_end_of_turn` 0 in ReplyDone.stats) and still equals transformers'
generate() given the same frames (the tower attends within each image, so features encoded one
frame at a time equal the batch's); a frame the runner never saw is encoded at the end of the
turn and counted; frames that arrive while a reply runs wait (nothing is encoded between the
reply's steps) and are encoded once the engine is idle again, or counted at the end of the turn.
"""

from __future__ import annotations

from agent.engine.stream import StreamingRunner
from test_streaming_exact import SECONDS, SYSTEM, TOKENS, assert_same, make_audio, make_image, reference, stream_turn


def _runner(loaded) -> StreamingRunner:
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=TOKENS, max_reply_seconds=SECONDS, record=True)
    runner.open_session("s")
    return runner


def test_frames_encoded_on_arrival_leave_nothing_for_the_end_of_turn(loaded):
    audio, frames = make_audio(1.5, 220, 1), [make_image(0), make_image(40), make_image(80)]
    runner = _runner(loaded)
    for i, frame in enumerate(frames):
        runner.append_video("s", frame, 0.25 * i)
    assert runner.turns.vision.encoded_on_arrival == 3
    _, done = stream_turn(runner, "s", audio, frames[-2:])
    assert done.stats["frames_encoded_at_end_of_turn"] == 0
    assert done.stats["input_image_tokens"] > 0
    assert_same(runner.records["s"], reference(loaded, audio, frames[-2:]))


def test_an_unseen_frame_is_encoded_at_the_end_of_turn_and_counted(loaded):
    audio, seen, unseen = make_audio(1.2, 330, 2), make_image(10), make_image(90)
    runner = _runner(loaded)
    runner.append_video("s", seen, 0.0)
    _, done = stream_turn(runner, "s", audio, [seen, unseen])
    assert done.stats["frames_encoded_at_end_of_turn"] == 1
    assert_same(runner.records["s"], reference(loaded, audio, [seen, unseen]))


def test_frames_arriving_during_a_reply_wait_until_the_engine_is_idle(loaded):
    runner = _runner(loaded)
    for i in range(0, 16000, 1280):
        runner.append_audio("s", make_audio(1.0, 220, 3)[i : i + 1280])
    runner.begin_reply("s", [])
    runner.step()
    late = make_image(5)
    runner.append_video("s", late, 1.0)  # a reply runs: not encoded between its steps
    assert runner.turns.vision.encoded_on_arrival == 0
    while runner.has_work():
        runner.step()
    runner.append_video("s", make_image(6), 1.25)  # idle again: both are encoded now
    assert runner.turns.vision.encoded_on_arrival == 2
