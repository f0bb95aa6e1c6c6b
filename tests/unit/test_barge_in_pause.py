"""The barge-in pause: the agent's voice stops on a likely interruption, a false alarm costs nothing.

Pins, over the real objects (AgentAudioTrack on a fake clock, Endpointer / InputBuffer with the
real detectors, or a detector that calls anything not silent voiced for the policy):
- track: pause() sends silence and keeps the queue; resume() plays on with the same samples in
  order; flush() while paused drops the held audio, so pushed - flushed counts only the frames
  really sent (what Replies.interrupt calls heard); a pause past its bound resumes by itself; no
  underrun is counted while paused.
- endpointer: while the agent plays, BargeInCandidate comes with the first voiced sub-frame above
  the echo level, from peek(), before its 80 ms chunk is complete; a confirmed candidate goes on to
  SpeechStarted with no BargeInDropped, a candidate that dies (gap over 100 ms) gets BargeInDropped;
  a silent agent or voice under the echo level never makes a candidate.
- the agent's own reply fed back at -10 dB never pauses it; a user talking over it pauses it at
  their onset, well before the barge-in is confirmed.
- --no-barge-in-pause / --barge-in-pause-max-ms reach Config.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from support.echo import FakeClock, LoudIsVoiced, gap, speakerphone, tone

from agent.config import Config
from agent.flags import add_serve_arguments, config_from_args
from agent.media.ingest import AudioChunk
from agent.media.playout import AgentAudioTrack
from agent.media.turn_events import BargeInCandidate, BargeInDropped, SpeechStarted, TurnEvent
from agent.media.vad import Endpointer
from agent.metrics import REGISTRY

N = 480  # samples per outbound frame


def pcm_of(frame) -> np.ndarray:
    return frame.to_ndarray().reshape(-1)


def pauses(outcome: str) -> float:
    return REGISTRY.get_sample_value("agent_barge_in_pauses_total", {"outcome": outcome}) or 0.0


def ramp(n: int) -> np.ndarray:
    return (np.arange(n) % 20000 + 1).astype(np.int16)  # never zero: any sample is recognisable


# ---- the track ------------------------------------------------------------------------------


async def test_pause_sends_silence_and_resume_plays_on_with_the_same_samples():
    clock = FakeClock()
    track = AgentAudioTrack(clock=clock, sleep=clock.sleep)
    audio = ramp(10 * N)
    track.begin_reply()  # and not ended: a silent frame inside it would count as an underrun
    track.push(audio)
    sent = [pcm_of(await track.recv()) for _ in range(3)]
    resumed_before = pauses("resumed")
    track.pause(0.6)
    held = track.buffered_seconds
    silent = [pcm_of(await track.recv()) for _ in range(5)]
    assert all(not f.any() for f in silent)
    assert track.buffered_seconds == held == 7 * N / 24000  # nothing dropped, nothing taken
    assert track.underruns == 0
    track.resume()
    assert pauses("resumed") == resumed_before + 1
    sent += [pcm_of(await track.recv()) for _ in range(7)]
    assert np.array_equal(np.concatenate(sent), audio)  # every sample, in order, none lost
    assert track.underruns == 0
    track.end_reply()
    assert not track.in_reply  # then the reply drained as usual


async def test_flush_while_paused_drops_the_held_audio_and_heard_counts_sent_frames_only():
    clock = FakeClock()
    track = AgentAudioTrack(clock=clock, sleep=clock.sleep)
    pushed = 20 * N
    track.begin_reply()
    track.push(ramp(pushed))
    for _ in range(4):
        await track.recv()
    track.pause(0.6)
    for _ in range(6):  # paused frames are sent as silence: not heard
        assert not pcm_of(await track.recv()).any()
    flushed_before = pauses("flushed")
    dropped = track.flush()
    assert pauses("flushed") == flushed_before + 1
    assert not track.paused
    # Replies.interrupt: heard = samples pushed - seconds flushed
    assert pushed - round(dropped * 24000) == 4 * N
    assert not pcm_of(await track.recv()).any()


async def test_a_pause_past_its_bound_resumes_by_itself():
    clock = FakeClock()
    track = AgentAudioTrack(clock=clock, sleep=clock.sleep)
    audio = ramp(8 * N)
    track.push(audio)
    expired_before = pauses("expired")
    track.pause(0.1)  # 5 frames
    frames = [pcm_of(await track.recv()) for _ in range(13)]
    assert [bool(f.any()) for f in frames] == [False] * 5 + [True] * 8
    assert np.array_equal(np.concatenate(frames[5:]), audio)
    assert pauses("expired") == expired_before + 1
    track.resume()  # a late BargeInDropped: nothing to do
    assert not track.paused


# ---- the endpointer's candidate events ------------------------------------------------------


def feed(ep: Endpointer, pcm: np.ndarray) -> list[tuple[int, TurnEvent]]:
    """Drive the endpointer like InputBuffer does with 20 ms microphone frames: peek() after each
    frame at the chunk being filled, push() when a chunk is complete. (sub-frame index, event)."""
    pcm = np.concatenate([gap(160), pcm, gap(800)]).astype(np.float32)  # past the warm-up
    out: list[tuple[int, TurnEvent]] = []
    for s in range(len(pcm) // 320):
        index, k = divmod(s, 4)
        if k == 3:
            chunk = AudioChunk(pcm[index * 1280 : (index + 1) * 1280], index, index * 0.08)
            out += [(s, e) for e in ep.push(chunk)]
            out += [(s, e) for e in ep.peek(index + 1, pcm[:0])]
        else:
            out += [(s, e) for e in ep.peek(index, pcm[index * 1280 : index * 1280 + (k + 1) * 320])]
    return out


def candidates_of(events: list[tuple[int, TurnEvent]]) -> list[str]:
    return [type(e).__name__ for _, e in events if isinstance(e, (BargeInCandidate, BargeInDropped, SpeechStarted))]


def test_candidate_comes_per_sub_frame_before_its_chunk_completes():
    ep = Endpointer(detector=LoudIsVoiced(), echo=lambda: 0.01, barge_in_ms=200)
    # Voice from sub-frame 9 (chunk 2, second sub-frame): the candidate is known when that
    # sub-frame is complete, two sub-frames before the chunk's push().
    events = feed(ep, np.concatenate([gap(20), tone(400, -20.0)]))
    first = next((s, e) for s, e in events if isinstance(e, BargeInCandidate))
    assert first[0] == 9 and first[1].onset == pytest.approx(0.18)
    assert candidates_of(events) == ["BargeInCandidate", "SpeechStarted"]
    start = next(e for _, e in events if isinstance(e, SpeechStarted))
    assert start.onset == first[1].onset


def test_a_candidate_that_dies_is_dropped():
    ep = Endpointer(detector=LoudIsVoiced(), echo=lambda: 0.01, barge_in_gap_ms=100)
    events = feed(ep, np.concatenate([tone(100, -20.0), gap(300), tone(80, -20.0)]))
    assert candidates_of(events) == ["BargeInCandidate", "BargeInDropped"] * 2
    # Dropped once the gap passed 100 ms: sub-frame 8 + 5 voiced + 5 unvoiced, at its chunk's push.
    drops = [s for s, e in events if isinstance(e, BargeInDropped)]
    assert drops[0] < 8 + 5 + 5 + 4


def test_no_candidate_while_the_agent_is_silent_or_under_the_echo_level():
    silent = Endpointer(detector=LoudIsVoiced(), echo=lambda: None)
    assert candidates_of(feed(silent, tone(400, -20.0))) == ["SpeechStarted"]
    loud_agent = Endpointer(detector=LoudIsVoiced(), echo=lambda: 0.1)  # threshold 0.05
    assert candidates_of(feed(loud_agent, tone(1000, -40.0))) == []  # RMS 0.01: echo-level voice


# ---- over the echo: the real track, the real InputBuffer and detector -----------------------


async def speakerphone_pausing(
    clips,
    *,
    user_at_s: float | None,
    vad: str,
) -> tuple[list[tuple[int, TurnEvent]], list[bool]]:
    """test_echo_guard's speakerphone, with the track paused / resumed / flushed on the events
    as Session does."""
    config = Config(vad=vad)

    def drive(track: AgentAudioTrack, event: TurnEvent) -> None:
        if isinstance(event, BargeInCandidate):
            track.pause(config.barge_in_pause_max_ms / 1000)
        elif isinstance(event, BargeInDropped):
            track.resume()
        elif isinstance(event, SpeechStarted):
            track.flush()

    return await speakerphone(clips, config=config, user_at_s=user_at_s, on_event=drive)


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
async def test_own_echo_at_minus_10_db_never_pauses_the_agent(voices, vad):
    events, audible = await speakerphone_pausing(voices, user_at_s=None, vad=vad)
    assert candidates_of(events) == []
    # The reply played without a hole: audible from its first frame to its last.
    first, last = audible.index(True), len(audible) - 1 - audible[::-1].index(True)
    assert last - first + 1 == int(np.ceil(len(voices["reply"]) / N))


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
async def test_talking_over_the_reply_silences_it_at_the_candidate(voices, vad):
    events, audible = await speakerphone_pausing(voices, user_at_s=1.0, vad=vad)
    kinds = candidates_of(events)
    assert "SpeechStarted" in kinds
    started_at = next(i for i, e in events if isinstance(e, SpeechStarted))
    paused_at = max(i for i, e in events if isinstance(e, BargeInCandidate) and i <= started_at)
    assert paused_at >= 1.0 / 0.02 - 3  # on the user's voice, not on the echo before it
    # From the pause that the confirmation kept, the agent is silent: the wait for the
    # confirmation (barge_in_ms, 10 frames at least) is not heard.
    assert not any(audible[paused_at + 1 :])
    assert started_at - paused_at >= 10 - 4


def test_flags_reach_config():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    # Longer than an interruption takes to confirm (600 ms of voice with its gaps).
    assert default.barge_in_pause and default.barge_in_pause_max_ms == 2000
    off = config_from_args(parser.parse_args(["--no-barge-in-pause", "--barge-in-pause-max-ms", "400"]))
    assert (off.barge_in_pause, off.barge_in_pause_max_ms) == (False, 400)
