"""LoopedVideoFile, the `omni-agent call --video FILE` camera: a file played over and over.

Pins: frames come at the file's own rate on every pass, not only the first (aiortc's
MediaPlayer(loop=True) decodes flat out from the second pass on, which flooded the event
loop's wake-up pipe and lost the Ctrl-C signal); pts keep rising across passes; a stopped
track ends (MediaStreamError) and stopping twice is harmless; a file with no video stream is
refused at once with a clear error.
"""

from __future__ import annotations

import asyncio
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from agent.client.media import LoopedVideoFile

FPS = 25
FRAMES = 5  # 0.2 s a pass


def write_y4m(path: Path, frames: int = FRAMES, fps: int = FPS, width: int = 64, height: int = 48) -> Path:
    with open(path, "wb") as f:
        f.write(f"YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(frames):
            luma = np.full((height, width), 40 + 30 * i, np.uint8)
            chroma = np.full((height // 2, width // 2), 128, np.uint8)
            f.write(b"FRAME\n" + luma.tobytes() + chroma.tobytes() + chroma.tobytes())
    return path


async def test_every_pass_is_paced_at_the_files_rate_and_pts_keep_rising(tmp_path: Path) -> None:
    track = LoopedVideoFile(write_y4m(tmp_path / "clip.y4m"))
    assert track.period == pytest.approx(1 / FPS)
    n = 8 * FRAMES  # eight passes
    started = time.monotonic()
    frames = [await track.recv() for _ in range(n)]
    elapsed = time.monotonic() - started
    track.stop()

    assert track.passes >= 8
    pts = [f.pts for f in frames]
    assert all(b > a for a, b in zip(pts, pts[1:])), pts
    # Frame k is not sent before k periods have passed (sleeps only ever run late): a player
    # that decodes ahead after its first pass would deliver the last 35 frames at once.
    assert elapsed >= (n - 1) / FPS * 0.95, f"{n} frames in {elapsed:.2f} s at {FPS} fps"
    # The clip's own pictures, in order, pass after pass.
    lumas = [int(f.to_ndarray(format="gray")[0, 0]) for f in frames]
    assert lumas[:FRAMES] == lumas[FRAMES : 2 * FRAMES] == lumas[-FRAMES:], lumas


async def test_a_stopped_track_ends_and_stopping_twice_is_harmless(tmp_path: Path) -> None:
    track = LoopedVideoFile(write_y4m(tmp_path / "clip.y4m"))
    await track.recv()
    track.stop()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()
    with pytest.raises(MediaStreamError):
        track._decode_next()  # an executor decode that starts after close finds it closed


async def test_stop_while_a_frame_is_being_decoded_ends_cleanly(tmp_path: Path) -> None:
    track = LoopedVideoFile(write_y4m(tmp_path / "clip.y4m"))
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)  # recv is on its way to the executor
    track.stop()
    try:
        frame = await pending
        assert frame.width == 64  # decoded before the close: a whole frame, not garbage
    except MediaStreamError:
        pass


def test_a_file_without_video_is_refused_at_once(tmp_path: Path) -> None:
    wav = tmp_path / "voice.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.zeros(1600, np.int16).tobytes())
    with pytest.raises(ValueError, match="no video stream"):
        LoopedVideoFile(wav)
