"""The camera on the audio clock: which frames the model receives, where, and how many.

Pins:
- a synthetic 30 fps 1280x720 video with a moving marker, through the session's VideoSampler
  (4 fps) into StreamingRunner while the audio arrives in 80 ms pieces: the model receives one
  grid per 0.5 s made of the 4 fps samples 2j and 2j+1 (checked by their pixels: the marker
  moves), its tokens at temporal position block start + 0.5 j * position_id_per_seconds and
  each before the audio token of its time, and all of them prefilled while the user speaks but
  those of the last audio window; the end of the turn encodes at most one grid (the last 0.5 s);
- the visual-token cap holds over a 20 s turn at 4 fps: the resolution is scaled down so the
  first window fits half of the cap, the first window gets every grid, later grids are thinned,
  and the turn still ends with its last view;
- grids of two sessions that closed while a third session's reply ran are encoded together,
  both sessions' grids in one forward of the vision tower;
- a session with video off (omni.video false, validated as a bool), or a runner without the
  video policy, gets no video tokens; the --video-* flags reach the Config, a value <= 0 refused.
"""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest
from support.engine_drive import SYSTEM
from support.engine_drive import make_audio as speech

from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.video_clock import TurnVideo, VideoPolicy
from agent.engine.stages.video_grid import PatchSpec, grid_threshold, patch_frames, resize
from agent.media.ingest import VideoSampler

REAL_PPS = 13  # the real checkpoint's positions per second (the tiny one's 25 outrun its audio)


def marker_video(seconds: float, fps: int = 30, width: int = 1280, height: int = 720) -> list[av.VideoFrame]:
    frames = []
    for i in range(int(seconds * fps)):
        rgb = np.full((height, width, 3), 20, dtype=np.uint8)
        x = int((i / fps) * 400) % (width - 80)  # 400 px/s to the right
        rgb[300:380, x : x + 80] = (255, 255, 255)
        f = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        f.pts, f.time_base = i, fractions.Fraction(1, fps)
        frames.append(f)
    return frames


def marker_x(image: np.ndarray) -> float:
    """Where the marker is, as a fraction of the width (its columns' mean)."""
    cols = np.nonzero(image[..., 0].max(axis=0) > 128)[0]
    return float(cols.mean()) / image.shape[1]


class Recorder:
    """Wraps the thinker: every prefill job's ids and positions, every grid the tower encodes."""

    def __init__(self, thinker) -> None:
        self.jobs, self.pixels = [], []
        start, encode = thinker.start_prefill, thinker.encode_videos

        def start_prefill(state, ids, *args, **kwargs):
            job = start(state, ids, *args, **kwargs)
            self.jobs.append((list(ids), job.rope.float().cpu()))
            return job

        def encode_videos(clips):
            self.pixels += [pixels.clone() for pixels, _ in clips]
            return encode(clips)

        thinker.start_prefill, thinker.encode_videos = start_prefill, encode_videos


def test_30fps_720p_reaches_the_model_as_4fps_grids_at_their_times(loaded):
    seconds = 3.0
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=4,
        max_reply_seconds=0.4,
        audio_window_s=1.0,
        video=VideoPolicy(fps=4.0, window_s=2.0, max_tokens=768),
    )
    runner.turns.video.pps = REAL_PPS
    rec = Recorder(runner.thinker)
    runner.open_session("s")
    sampler = VideoSampler(fps=4.0, max_side=448)
    audio, video = speech(seconds, 220, 3, onset_s=0.2), marker_video(seconds)
    samples, v = [], 0
    for start in range(0, len(audio), 1280):
        now = start / 16000
        while v < len(video) and video[v].time < now + 0.08:
            sample = sampler.push(video[v], now)
            if sample is not None:
                samples.append(sample)
                runner.append_video("s", sample.image, sample.audio_clock)
            v += 1
        runner.append_audio("s", audio[start : start + 1280])
    during = len(rec.pixels)
    prefilled_during = sum(ids.count(runner.turns.video.kinds.video_pad) for ids, _ in rec.jobs)
    runner.begin_reply("s", [])
    while runner.has_work():
        done = runner.step()[-1]

    # 4 fps kept from 30 fps, evenly: 12 samples in 3 s, the marker 100 px further each time.
    assert len(samples) == 12
    assert np.allclose(np.diff([s.pts_s for s in samples]), 0.25, atol=0.02)
    assert samples[0].image.shape == (252, 448, 3)
    # One grid per 0.5 s, each made of samples 2j, 2j+1 at the turn's one grid size.
    stats = done.stats
    kinds, pps = runner.turns.video.kinds, REAL_PPS
    spec = PatchSpec.from_processor(loaded.image_processor)
    per_grid = stats["input_video_tokens"] // stats["video_grids"]
    size = next(
        (h, w)
        for h in range(32, 253, 32)
        for w in range(32, 449, 32)
        if (h // 32) * (w // 32) == per_grid and abs(w / h - 448 / 252) < 0.15
    )
    assert stats["video_grids"] == 6 and stats["video_grids_dropped"] == 0
    assert len(rec.pixels) == 6
    for j, pixels in enumerate(rec.pixels):
        expected, _ = patch_frames([resize(samples[2 * j].image, size), resize(samples[2 * j + 1].image, size)], spec)
        assert pixels.shape == expected.shape
        assert np.allclose(pixels.numpy(), expected.numpy(), atol=1e-5), f"grid {j} is not samples {2 * j}, {2 * j + 1}"
    assert marker_x(samples[0].image) < marker_x(samples[2].image) < marker_x(samples[4].image)
    # Positions: the block's tokens in order, each grid at its time, before the audio token of its time.
    ids = [t for job_ids, _ in rec.jobs for t in job_ids]
    rope = np.concatenate([r.numpy() for _, r in rec.jobs], axis=1)
    first = ids.index(kinds.audio_start)
    block_start = rope[0, first] + 1
    audio_seen, grid = 0, 0
    i = first + 1
    while ids[i] != kinds.audio_end:
        if ids[i] == kinds.audio_pad:
            assert rope[0, i] == block_start + audio_seen
            audio_seen += 1
            i += 1
            continue
        assert ids[i] == kinds.video_pad
        assert audio_seen == grid_threshold(0.5 * grid, pps), "a grid is not before the audio token of its time"
        assert np.all(rope[0, i : i + per_grid] == block_start + 0.5 * grid * pps)
        i += per_grid
        grid += 1
    assert grid == 6
    # While the user spoke: every grid but the open one encoded, every grid before the last
    # audio window prefilled; the end of the turn encodes at most the last 0.5 s.
    assert during >= 5
    assert stats["video_grids_encoded_at_end_of_turn"] <= 1
    assert prefilled_during >= 3 * per_grid
    assert stats["video_grids_prefilled_at_end_of_turn"] <= 1.0 / 0.5 + 1


def test_grids_that_waited_through_a_reply_are_encoded_together(loaded):
    """Two users speak with their cameras on while a third session's reply runs: their closed
    grids wait (the vision tower has the lowest priority) and are then encoded in shared
    forwards, grids of both sessions in one call, rather than one session's at a time."""
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_sessions=3,
        max_reply_tokens=12,
        max_reply_seconds=1.0,
        audio_window_s=1.0,
        video=VideoPolicy(fps=4.0, window_s=2.0, max_tokens=768),
    )
    calls: list[list[float]] = []  # per encode_videos call: each grid's mean pixel (tells the sessions apart)
    encode = runner.thinker.encode_videos

    def encode_videos(clips):
        calls.append([float(pixels.mean()) for pixels, _ in clips])
        return encode(clips)

    runner.thinker.encode_videos = encode_videos
    for sid in ("talk", "a", "b"):
        runner.open_session(sid)
    runner.append_audio("talk", speech(1.0, 220, 5, onset_s=0.1))
    runner.begin_reply("talk", [])
    dark, light = np.full((240, 320, 3), 20, np.uint8), np.full((240, 320, 3), 235, np.uint8)
    audio = {"a": speech(2.0, 180, 8, onset_s=0.1), "b": speech(2.0, 260, 9, onset_s=0.1)}
    for i, start in enumerate(range(0, 32000, 1280)):
        for sid, frame in (("a", dark), ("b", light)):
            if i % 3 == 0:  # ~4 fps against 80 ms of audio per piece
                runner.append_video(sid, frame, start / 16000)
            runner.append_audio(sid, audio[sid][start : start + 1280])
        runner.step()
    for _ in range(400):  # bounded: the reply is at most 12 tokens / 1 s of audio
        if not runner.has_work():
            break
        runner.step()

    sessions = [{m < 0 for m in call} for call in calls]  # normalised pixels: a dark < 0 < b light
    assert sum(len(call) for call in calls) >= 4, calls
    assert any(len(s) == 2 for s in sessions), f"no call encoded both sessions' grids: {calls}"
    assert len(calls) < sum(len(call) for call in calls), calls


def test_the_cap_holds_over_a_20s_turn(loaded):
    spec = PatchSpec.from_processor(loaded.image_processor)
    policy = VideoPolicy(fps=4.0, window_s=2.0, max_tokens=768)
    video = TurnVideo(policy, spec, REAL_PPS)
    frame = np.zeros((252, 448, 3), dtype=np.uint8)
    for i in range(20 * 4):
        video.add(frame, i * 0.25)
    video.close_all()
    per_grid = video.tokens
    assert per_grid <= policy.max_tokens // (2 * policy.window_grids)  # scaled down first
    assert video.size[0] < 252 and video.size[1] < 448
    assert len(video.grids) * per_grid <= policy.max_tokens
    starts = [g.start_s for g in video.grids]
    assert starts[: policy.window_grids] == [0.5 * j for j in range(policy.window_grids)]  # the window: every grid
    gaps = np.diff(starts)
    assert gaps[-2] > 0.5 and all(b >= a for a, b in zip(gaps[:-2], gaps[1:-1]))  # then thinned
    assert starts[-1] == 19.5  # and the turn ends with its last view
    assert video.stats.frames_thinned > 0


@pytest.mark.parametrize("how", ["session", "runner"])
def test_video_off_means_no_video_tokens(loaded, how):
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=4,
        max_reply_seconds=0.4,
        audio_window_s=1.0,
        video=None if how == "runner" else VideoPolicy(),
    )
    runner.open_session("s")
    if how == "session":
        runner.set_video("s", False)
    audio = speech(1.5, 220, 4, onset_s=0.2)
    frame = np.zeros((96, 128, 3), dtype=np.uint8)
    for start in range(0, len(audio), 1280):
        runner.append_video("s", frame, start / 16000)
        runner.append_audio("s", audio[start : start + 1280])
    runner.begin_reply("s", [])
    while runner.has_work():
        done = runner.step()[-1]
    assert done.stats["input_video_tokens"] == 0 and done.stats["video_grids"] == 0
    assert done.stats["input_audio_tokens"] > 0


def test_the_session_switch_is_a_validated_omni_extra():
    from agent.config import Config
    from agent.realtime import session_config as sc

    base = sc.default_session(Config())
    assert sc.video_on(base)
    off = sc.merge(base, {"omni": {"video": False}})
    assert not sc.video_on(off) and sc.video_on(sc.merge(off, {"omni": {"video": True}}))
    with pytest.raises(sc.ConfigError) as err:
        sc.merge(base, {"omni": {"video": "off"}})
    assert err.value.param == "session.omni.video"


def test_flags_reach_the_config_and_refuse_non_positive_values():
    import argparse

    from agent.flags import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--video-fps", "2", "--video-window", "3", "--video-turn-tokens", "500"])
    )
    assert (config.video_fps, config.video_window_s, config.video_turn_tokens) == (2.0, 3.0, 500)
    for flag in ("--video-fps", "--video-window", "--video-turn-tokens"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])
