"""VideoSampler keeps 4 evenly spaced frames per second of source time whatever the input rate
and jitter (no drift, no burst after a gap), never converts the frames it drops, caps the
source at 1080p and resizes so the longer side is at most max_side, across resolution changes."""

from __future__ import annotations

import fractions
import random
from typing import Any

import av
import numpy as np
import pytest

from agent.media.ingest import VideoSample, VideoSampler
from agent.metrics import REGISTRY

TB = fractions.Fraction(1, 90000)


def vframe(t: float, width: int = 64, height: int = 48) -> av.VideoFrame:
    f = av.VideoFrame(width=width, height=height, format="yuv420p")
    f.pts = int(round(t * 90000))
    f.time_base = TB
    return f


class CountingFrame:
    """Stands in for a VideoFrame (which cannot be subclassed) and counts conversions."""

    conversions = 0

    def __init__(self, frame: av.VideoFrame) -> None:
        self._frame = frame

    def __getattr__(self, name: str) -> Any:
        if name in ("to_ndarray", "reformat", "to_image", "to_rgb"):
            CountingFrame.conversions += 1
        return getattr(self._frame, name)


def times(fps: float, seconds: float, jitter: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    n = int(round(seconds * fps))
    return sorted(max(0.0, i / fps + rng.uniform(-jitter, jitter)) for i in range(n))


def run(sampler: VideoSampler, ts: list[float], **size: int) -> list[VideoSample]:
    kept = []
    for t in ts:
        s = sampler.push(vframe(t, **size), audio_clock=t + 0.5)
        if s is not None:
            kept.append(s)
    return kept


@pytest.mark.parametrize(
    ("fps", "jitter"),
    [(30, 0.0), (30, 0.006), (20, 0.0), (20, 0.008), (24, 0.01), (15, 0.01), (5, 0.0), (4, 0.01)],
)
def test_four_fps_from_any_input_rate_evenly_spaced(fps, jitter):
    ts = times(fps, 10.0, jitter, seed=fps)
    kept = run(VideoSampler(fps=4.0), ts)
    assert 39 <= len(kept) <= 41
    pts = np.array([s.pts_s for s in kept])
    gaps = np.diff(pts)
    # Each kept frame is the input frame nearest its mark: spacing within one input interval.
    assert gaps.min() >= 0.25 - 1 / fps - 2 * jitter - 1e-6
    assert gaps.max() <= 0.25 + 1 / fps + 2 * jitter + 1e-6
    # No drift, nearest frame: the k-th kept frame is within half an input interval (plus
    # jitter) of the mark k * 0.25, however long the stream runs.
    marks = pts[0] + 0.25 * np.arange(len(pts))
    assert np.abs(pts - marks).max() <= 0.5 / fps + 2 * jitter + 1e-6


def test_dropped_frames_are_never_converted_and_are_counted():
    before = REGISTRY.get_sample_value("agent_ingest_dropped_frames_total", {"kind": "video", "reason": "rate"}) or 0.0
    CountingFrame.conversions = 0
    sampler = VideoSampler(fps=4.0)
    kept = 0
    for i in range(90):  # 3 s at 30 fps
        if sampler.push(CountingFrame(vframe(i / 30)), audio_clock=0.0) is not None:  # type: ignore[arg-type]
            kept += 1
    assert kept == 12
    assert CountingFrame.conversions == kept
    assert sampler.kept == 12 and sampler.dropped == 78
    after = REGISTRY.get_sample_value("agent_ingest_dropped_frames_total", {"kind": "video", "reason": "rate"})
    assert after - before == 78


def test_no_burst_after_a_gap():
    ts = [i / 30 for i in range(60)]  # 0 - 2 s
    ts += [5.0 + i / 30 for i in range(60)]  # the camera resumes at 5 s
    sampler = VideoSampler(fps=4.0)
    kept = run(sampler, ts)
    pts = [s.pts_s for s in kept]
    after = [p for p in pts if p >= 5.0]
    assert after[0] == pytest.approx(5.0)
    assert np.diff(after).min() >= 0.25 - 1 / 30 - 1e-6  # no catch-up burst
    assert len(after) == 8
    assert sampler.reanchors == 1


def test_4k_input_is_capped_then_resized_for_the_model():
    seen: list[dict[str, Any]] = []

    class Spy(CountingFrame):
        def __getattr__(self, name: str) -> Any:
            attr = super().__getattr__(name)
            if name == "to_ndarray":

                def spy(**kwargs: Any) -> np.ndarray:
                    seen.append(kwargs)
                    return attr(**kwargs)

                return spy
            return attr

    sampler = VideoSampler(fps=4.0, max_side=448, max_source_height=1080)
    s = sampler.push(Spy(vframe(0.0, 3840, 2160)), audio_clock=1.25)  # type: ignore[arg-type]
    assert s is not None
    assert seen[0]["width"] == 1920 and seen[0]["height"] == 1080  # never converted at 4K
    assert s.image.shape == (252, 448, 3) and s.image.dtype == np.uint8
    assert s.source_size == (3840, 2160)
    assert s.audio_clock == 1.25 and s.pts_s == 0.0

    portrait = sampler.push(vframe(0.25, 2160, 3840), audio_clock=1.5)
    assert portrait is not None and portrait.image.shape == (448, 252, 3)


def test_small_frames_are_not_upscaled():
    s = VideoSampler(max_side=448).push(vframe(0.0, 320, 240), audio_clock=0.0)
    assert s is not None and s.image.shape == (240, 320, 3)


def test_resolution_change_midstream():
    sampler = VideoSampler(fps=4.0, max_side=448)
    sizes = [(640, 480)] * 30 + [(1280, 720)] * 30 + [(320, 180)] * 30
    shapes = []
    for i, (w, h) in enumerate(sizes):
        s = sampler.push(vframe(i / 30, w, h), audio_clock=0.0)
        if s is not None:
            shapes.append((s.source_size, s.image.shape))
    assert ((640, 480), (336, 448, 3)) in shapes
    assert ((1280, 720), (252, 448, 3)) in shapes
    assert ((320, 180), (180, 320, 3)) in shapes
    assert len(shapes) == 12


def test_colour_survives_conversion():
    rgb = np.zeros((480, 640, 3), dtype=np.uint8)
    rgb[..., 0] = 200  # red
    rgb[:, 320:, 2] = 180  # right half magenta-ish
    f = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
    f.pts, f.time_base = 0, TB
    s = VideoSampler(max_side=448).push(f, audio_clock=0.0)
    assert s is not None
    left, right = s.image[:, :100].reshape(-1, 3).mean(0), s.image[:, -100:].reshape(-1, 3).mean(0)
    assert np.allclose(left, [200, 0, 0], atol=8)
    assert np.allclose(right, [200, 0, 180], atol=8)


def test_source_clock_restart_reanchors():
    sampler = VideoSampler(fps=4.0)
    run(sampler, [i / 30 for i in range(90)])  # 0 - 3 s
    # The pts restart from 0 (a new stream): the first frame is kept at once.
    assert sampler.push(vframe(0.0), audio_clock=3.0) is not None
    assert sampler.push(vframe(1 / 30), audio_clock=3.0) is None
